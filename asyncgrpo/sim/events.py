"""The discrete-event engine the model runs on: processes are Python generators yielding what
they wait for (`Delay`, `Work` on shared processors, `Until` a condition), `EventLoop` moves the
clock from event to event, and each actor's `Clock` adds up its seconds per phase. Knows nothing
of generators or learners."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Delay:
    """Busy for `seconds`."""

    seconds: float


@dataclass(frozen=True)
class Work:
    """Busy for `seconds` of processor time on `processes` processors, shared with every other Work
    running at the same moment (EventLoop(cores=c)): while the running Works take k processors in
    all, each advances at min(1, c / k) seconds of its work per second (processor sharing, as an
    operating system shares cores among busy processes). With cores=0 it is a Delay."""

    seconds: float
    processes: int = 1


@dataclass(frozen=True)
class Until:
    """Blocked until `condition()` holds. `reads`: what the condition depends on, for an EventLoop
    that tracks changes (None: anything)."""

    condition: Callable[[], bool]
    reads: frozenset[str] | None = None


Process = Generator[Union[Delay, Work, Until], None, None]


class SimulationStuck(RuntimeError):
    """No process can move: a deadlock the real run would hit as a timeout."""


class EventLoop:
    """Processes are Python generators yielding `Delay` or `Until`. Time moves only when a Delay
    ends (a heap of wake-up times); after every event each blocked process's condition is checked
    again, so a process never needs to know who it waits for.

    With `track_changes` the owner calls `changed(what)` whenever it alters something a condition
    reads, and after an event only the conditions that read something changed (`Until.reads`) are
    checked again: with hundreds of generators nearly every event is one generator's phase ending
    or a group sent, which wakes none of those waiting for new weights, and checking all of them
    after each event made such a simulation take minutes. Blocked processes are kept by what they
    read and checked in the order they blocked, so the outcome is the same as checking every one
    after every event, as long as each condition reads only what its `reads` names."""

    def __init__(self, track_changes: bool = False, cores: int = 0) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Process]] = []
        # Processor sharing (Work): every running Work advances at the same rate, so each is kept
        # by the "virtual" time (work done by any one of them since the start) at which it ends.
        self._cores = cores
        self._work: list[tuple[float, int, Process, int]] = []  # (virtual end, order, process, processes)
        self._virtual = 0.0
        self._load = 0  # processors the running Works want
        # reads -> [(the order it blocked in, process, Until)], each list in that order
        self._blocked: dict[frozenset[str] | None, list[tuple[int, Process, Until]]] = {}
        self._order = 0  # ties at one instant run in scheduling order: deterministic
        self._blocked_order = 0
        self._track_changes = track_changes
        self._changed: set[str] = set()

    def changed(self, what: str) -> None:
        """`what` (a name some Until.reads may hold) has changed; only needed with track_changes."""
        self._changed.add(what)

    def start(self, process: Process) -> None:
        self._schedule(process, self.now)

    def run(self, done: Callable[[], bool]) -> None:
        while not done():
            self._wake()
            self._advance(self._next())

    def _rate(self) -> float:
        return 1.0 if self._load <= self._cores else self._cores / self._load

    def _next(self) -> Process:
        """The process whose Delay or Work ends first (a Delay on a tie), with the clock moved there."""
        delay_end = self._heap[0][0] if self._heap else math.inf
        work_end = self.now + max(0.0, self._work[0][0] - self._virtual) / self._rate() if self._work else math.inf
        if delay_end == math.inf and work_end == math.inf:
            raise SimulationStuck(f"every process is blocked at t={self.now:.3f} s")
        if work_end < delay_end:
            virtual_end, _, process, processes = heapq.heappop(self._work)
            self._move_to(work_end)
            self._virtual = max(self._virtual, virtual_end)  # rounding must not leave it short
            self._load -= processes
            return process
        _, _, process = heapq.heappop(self._heap)
        self._move_to(delay_end)
        return process

    def _move_to(self, at: float) -> None:
        if self._load:
            self._virtual += (at - self.now) * self._rate()
        self.now = at

    def _schedule(self, process: Process, at: float) -> None:
        heapq.heappush(self._heap, (at, self._order, process))
        self._order += 1

    def _advance(self, process: Process) -> None:
        try:
            request = next(process)
        except StopIteration:
            return
        if isinstance(request, Work) and self._cores:
            heapq.heappush(self._work, (self._virtual + request.seconds, self._order, process, request.processes))
            self._order += 1
            self._load += request.processes
        elif isinstance(request, (Delay, Work)):
            self._schedule(process, self.now + request.seconds)
        elif request.condition():
            self._schedule(process, self.now)
        else:
            self._block(self._blocked_order, process, request)
            self._blocked_order += 1

    def _block(self, order: int, process: Process, until: Until) -> None:
        self._blocked.setdefault(until.reads, []).append((order, process, until))

    def _wake(self) -> None:
        changed, self._changed = self._changed, set()
        if self._track_changes:
            if not changed:
                return  # every blocked condition was false and reads the same state still
            due = [reads for reads in self._blocked if reads is None or not reads.isdisjoint(changed)]
        else:
            due = list(self._blocked)
        # Oldest blocked first across the lists, as if they were one (orders are unique, so the
        # heap never compares processes).
        pending = [entry for reads in due for entry in self._blocked.pop(reads)]
        heapq.heapify(pending)
        seen = set(changed)
        while pending:
            order, process, until = heapq.heappop(pending)
            if until.condition():
                self._schedule(process, self.now)
            else:
                self._block(order, process, until)  # keeps its place: the lists stay in blocking order
            if self._track_changes and not self._changed <= seen:
                # A condition with side effects (dropping stale groups gives their slots back)
                # changed something: the waits that read it and blocked after this one are checked
                # in this pass too, as without tracking; those before it at the next event, as
                # without tracking (its changed() stands for that).
                new, seen = self._changed - seen, seen | self._changed
                for reads in [r for r in self._blocked if r is not None and not r.isdisjoint(new)]:
                    entries = self._blocked.pop(reads)
                    earlier = [entry for entry in entries if entry[0] <= order]  # this one too: checked
                    if earlier:
                        self._blocked[reads] = earlier
                    for entry in entries[len(earlier):]:
                        heapq.heappush(pending, entry)


@dataclass
class Clock:
    """One actor's seconds per phase; a wait or a busy phase still open at the end is counted up
    to the end. `work_s` / `work_wall_s`: its processor work as calibrated, and the seconds that
    work took (more than work_s where it shared processors, sim.cores)."""

    seconds: dict[str, float] = field(default_factory=dict)
    waiting: tuple[str, float] | None = None
    running: tuple[str, float] | None = None  # a busy phase, and since when
    work_s: float = 0.0
    work_wall_s: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def close(self, now: float) -> None:
        for open_phase in (self.waiting, self.running):
            if open_phase is not None:
                phase, since = open_phase
                self.add(phase, now - since)
        self.waiting = self.running = None
