"""The failpoints that make a generator slower (`FailpointPace`): tools/bench_dispatch.py and the
chaos runs make uneven generators with them (asyncgrpo/runtime/faults.py reads their settings)."""

from __future__ import annotations

import time

from asyncgrpo.runtime import faults


class FailpointPace:
    """Generator `generator_id`'s engine steps, slowed as its failpoints say: `generator_slowdown`
    (a factor f: each step lasts f times its own time, a slower generator) and `generator_pace_s`
    (p seconds: generation lasts at least p per finished group, as if on a device of its own)."""

    def __init__(self, generator_id: int) -> None:
        self.slowdown = faults.slowdown(generator_id)
        self.pace_s = faults.pace_s(generator_id)
        self._until = 0.0  # generator_pace_s: generation so far lasts at least until this (perf_counter)

    def after_step(self, started: float, finished: int) -> None:
        """Sleep as the failpoints say after an engine step that began at `started` (time.perf_counter)
        and finished `finished` groups."""
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * (time.perf_counter() - started))
        if self.pace_s > 0 and finished:
            self._until = max(self._until, started) + self.pace_s * finished
            time.sleep(max(0.0, self._until - time.perf_counter()))
