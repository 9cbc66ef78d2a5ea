"""A generator's engine step by step (sim.engine=steps): the loop of asyncgrpo/rollout/generator.py
as the simulator runs it where the calibration says how long an engine step takes and how long
groups decode, so that groups finish in the order their lengths give and the engine's occupancy
follows from admission (docs/SIMULATOR.md, The engine step by step).

Invariants, as in the real loop:
- admission asks for at most a call's worth of groups and only for the room the engine has
  (rollout.max_running_seqs); the call-batched baseline (rollout.continuous=false) admits only into
  an empty engine;
- a group's version is the one its engine held at admission (its oldest token's, the staleness the
  learner counts);
- weights are loaded between two engine steps, with running sequences continuing
  (rollout.inflight_updates), or else only once they have all finished, admission paused meanwhile;
- a group is scored and sent the step its last sample ends.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.sim.calibration import Calibration, GeneratorTimes
from asyncgrpo.sim.events import Clock, Process, Until, Work
from asyncgrpo.sim.settings import Settings


class SimulatedGenerator(Protocol):
    """What the loop reads and moves of a simulated generator (model.SimGenerator)."""

    index: int
    call_groups: int
    times: GeneratorTimes
    loaded: int
    started: int
    clock: Clock


class EngineHost(Protocol):
    """What the loop uses of the simulated run (model.Model): its settings, calibration and draws,
    the dispatcher, the newest version pushed, and its timed phases."""

    s: Settings
    cal: Calibration
    rng: random.Random
    speeds: list[float]
    dispatcher: Dispatcher
    newest: int

    def busy(self, clock: Clock, phase: str, seconds: float, processes: int = 1) -> Iterator[Work]: ...
    def load(self, g: Any) -> Process: ...
    def send(self, g: Any, tickets: list[Any], version: int) -> Process: ...
    def wait_for_slots(self, g: Any) -> Iterator[Until]: ...


@dataclass
class RunningEngine:
    """What one simulated engine runs: sequences, and when each sample and group ends (by engine
    step number, so that a step costs O(1) however many sequences run)."""

    sequences: int = 0
    steps: int = 0  # engine steps run
    ending_samples: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    ending_groups: dict[int, list[tuple[Any, int]]] = field(default_factory=lambda: defaultdict(list))

    def admit(self, ticket: Any, version: int, lengths: tuple[int, ...]) -> None:
        """A group whose samples decode `lengths` tokens each, from the next step on."""
        for length in lengths:
            self.ending_samples[self.steps + max(1, length)] += 1
        self.ending_groups[self.steps + max(1, max(lengths))].append((ticket, version))
        self.sequences += len(lengths)

    def step(self) -> list[tuple[Any, int]]:
        """One step over every running sequence; the groups (ticket, version) it finished."""
        self.steps += 1
        self.sequences -= self.ending_samples.pop(self.steps, 0)
        return self.ending_groups.pop(self.steps, [])


def engine_generator(model: EngineHost, g: SimulatedGenerator) -> Process:
    """The generator's turns: load newer weights where allowed, admit what the room and the bound
    grant, run one engine step (or wait for tickets with nothing running), send what finished."""
    s, times, engine = model.s, g.times, RunningEngine()
    step_s = times.step_s_per_sequence * s.generate_scale / model.speeds[g.index]
    fixed_s = times.step_fixed_s * s.generate_scale / model.speeds[g.index]
    while True:
        push_waiting = model.newest > g.loaded
        if push_waiting and (s.inflight_updates or not engine.sequences):
            yield from model.load(g)
            push_waiting = False
        paused = (not s.continuous and engine.sequences > 0) or (push_waiting and engine.sequences > 0)
        if not paused:
            room = (s.max_running_seqs - engine.sequences) // s.samples_per_prompt
            wanted = min(g.call_groups, room) if s.continuous else g.call_groups
            tickets = model.dispatcher.grant((g.index, 0), g.loaded, wanted)[1] if wanted >= 1 else []
            if tickets:
                yield from model.busy(g.clock, "ask", times.ask_s)
            for ticket in tickets:
                engine.admit(ticket, g.loaded, model.rng.choice(model.cal.group_lengths))
        if not engine.sequences:
            yield from model.wait_for_slots(g)
            continue
        warmup_s = times.step_warmup_s if g.started == 0 else 0.0  # the engine compiling, once
        g.started += 1
        yield from model.busy(g.clock, "generate", warmup_s + fixed_s + step_s * engine.sequences)
        yield from model.busy(g.clock, "other", times.other_s_per_step)
        for ticket, version in engine.step():
            yield from model.busy(g.clock, "score", times.score_s_per_group)
            yield from model.send(g, [ticket], version)
