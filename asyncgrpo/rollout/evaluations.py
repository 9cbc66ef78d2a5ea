"""Generator 0's periodic held-out evaluations (eval.every_steps): when the weights it loaded are due
for one, and the records kept until the driver takes them (from the actor's control thread, while
the generator's run goes on)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncgrpo.metrics import MetricsSink
from asyncgrpo.tasks import Problem, Task

if TYPE_CHECKING:
    from asyncgrpo.rollout.episodes import EpisodeSettings


def held_out_accuracy(engine: Any, tokenizer: Any, task: Task, env: Any, settings: EpisodeSettings,
                      problems: list[Problem], temperature: float) -> float:
    """Held-out accuracy with one episode per problem (temperature 0 = greedy), a turn of every
    episode per engine call, on an engine running nothing else: a generator's evaluations and a
    replay's (asyncgrpo/driver/replay_evaluation.py) are this one function. `settings`: the run's
    (rollout/parts.py: episode_settings)."""
    import numpy as np

    from asyncgrpo.rollout.episodes import play_episodes

    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    episodes = play_episodes(engine, tokenizer, env, settings, prompts, problems, temperature)
    # An episode its environment failed scores 0, as in training.
    return float(np.mean([0.0 if e.failed else task.score(e.answer_text(tokenizer), p)
                          for p, e in zip(problems, episodes)]))


def write_evaluation(metrics: MetricsSink, when: str, step: int, sampled: float, greedy: float) -> dict[str, float]:
    """An evaluation at the start or the end (`when`), by a live run's driver or a replay: its
    metrics.jsonl record written to `metrics`, its line printed; returns its summary entries."""
    metrics.write({"step": step, "eval/accuracy": sampled, "eval/greedy_accuracy": greedy, "eval/when": when})
    print(f"[eval {when}] sampled accuracy {sampled:.3f}, greedy {greedy:.3f}", flush=True)
    return {f"eval_accuracy_{when}": sampled, f"eval_greedy_accuracy_{when}": greedy}


def periodic_eval_line(record: dict[str, Any]) -> str:
    """The printed line of a periodic evaluation's record (`PeriodicEvaluations`)."""
    return (f"[eval step {record['step']}] sampled accuracy {record['eval/accuracy']:.3f}, "
            f"greedy {record['eval/greedy_accuracy']:.3f}")


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
