"""A generator's stream of training prompts, with its position (what it has handed out)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from asyncgrpo.tasks.problem import Problem


class PromptStream:
    """Iterates `problems` and counts them. `load_state_dict` on a fresh stream skips to a saved
    position, so a resumed generator continues where the checkpointed run's generator stood."""

    def __init__(self, problems: Iterator[Problem]) -> None:
        self._problems = problems
        self.position = 0

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Problem:
        problem = next(self._problems)
        self.position += 1
        return problem

    def take(self, count: int) -> list[Problem]:
        """Up to `count` problems (fewer when a finite stream runs out)."""
        return list(itertools.islice(self, max(0, count)))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        target = int(state["position"])
        if target < self.position:
            raise ValueError(f"a prompt stream cannot go back from position {self.position} to {target}")
        for _ in itertools.islice(self, target - self.position):
            pass
