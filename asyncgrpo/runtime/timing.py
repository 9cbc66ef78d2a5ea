"""Named, timed phases: each loop reads as a list of `with timer("phase"):` blocks."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        return {f"{prefix}{phase}_s": seconds for phase, seconds in self.seconds.items()}

    def reset(self) -> None:
        self.seconds.clear()
