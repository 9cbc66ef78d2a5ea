"""Generator 0's periodic held-out evaluations (eval.every_steps): when the weights it loaded are due
for one, and the records kept until the driver takes them (from the actor's control thread, while
the generator's run goes on)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from asyncgrpo.tasks import Problem, Task


def next_multiple(version: int, every: int) -> int:
    """The first multiple of `every` after `version` (eval.every_steps); 0 when `every` is 0."""
    return (version // every + 1) * every if every else 0


class PeriodicEvaluations:
    """Evaluations on `task`'s held-out problems every `every` versions (0: never), from the first
    multiple after `initial_version`."""

    def __init__(self, every: int, initial_version: int, task: Task) -> None:
        self.every, self.task = every, task
        self._next_version = next_multiple(initial_version, every)
        self._problems: list[Problem] | None = None  # read at the first evaluation
        self._records: list[dict[str, float]] = []
        self._lock = threading.Lock()  # the run's thread adds, the control thread takes

    def due(self, version: int) -> bool:
        """Whether loaded weights of `version` are to be evaluated (the first at or past each multiple)."""
        return bool(self.every) and version >= self._next_version

    def evaluate(self, version: int, accuracy: Callable[[list[Problem], float], float]) -> None:
        """Record the sampled and greedy held-out `accuracy(problems, temperature)` of `version`'s weights."""
        if self._problems is None:
            self._problems = self.task.eval_problems()
        started = time.perf_counter()
        sampled = accuracy(self._problems, 1.0)
        greedy = accuracy(self._problems, 0.0)
        record = {"step": version, "eval/accuracy": sampled, "eval/greedy_accuracy": greedy,
                  "eval/when": "periodic", "eval/seconds": time.perf_counter() - started}
        with self._lock:
            self._records.append(record)
        self._next_version = next_multiple(version, self.every)

    def take(self) -> list[dict[str, float]]:
        """The evaluations since the last call."""
        with self._lock:
            taken, self._records = self._records, []
        return taken
