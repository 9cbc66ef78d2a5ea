"""A generator's engine step by step (sim.engine=steps): the loop of asyncgrpo/rollout/generator.py
as the simulator runs it where the calibration says how long an engine step takes and how long
groups decode, so that groups finish in the order their lengths give and the engine's occupancy
follows from admission (docs/SIMULATOR.md, The model).

Invariants, as in the real loop:
- admission asks for at most a call's worth of groups and only for the room the engine has
  (rollout.max_running_seqs); the call-batched baseline (rollout.continuous=false) admits only into
  an empty engine;
- a group's version is the one its engine held at admission (its oldest token's, the staleness the
  learner counts);
- weights are loaded between two engine steps, with running sequences continuing
  (rollout.inflight_updates), or else only once they have all finished, admission paused meanwhile;
- a sample's turn ends at its recorded length; before its next turn the sample leaves the engine
  for its environment's answer (env.latency_s + the run's overhead per call) and comes back;
- a group is scored and sent the step its last sample's last turn ends.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
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
    def wait_for_slots(self, g: Any, phase: str = "throttle",
                       ready: Callable[[], bool] | None = None) -> Iterator[Until]: ...
    def deliver_after(self, seconds: float, deliver: Callable[[], None]) -> None: ...


@dataclass
class RunningGroup:
    ticket: Any
    version: int  # the engine's at admission
    turns: tuple[tuple[int, ...], ...]  # per sample, its policy tokens per turn
    next_turn: list[int]  # per sample, the turn it decodes or waits to decode
    samples_left: int


@dataclass
class RunningEngine:
    """What one simulated engine runs: sequences (a sample's turn each), and when each turn ends, by
    engine step number (a step costs only what ends in it, however many sequences run)."""

    sequences: int = 0
    steps: int = 0  # engine steps run
    away: int = 0  # samples out of the engine, waiting on their environment
    ending: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    groups: dict[int, RunningGroup] = field(default_factory=dict)
    admitted: int = 0

    def admit(self, ticket: Any, version: int, turns: tuple[tuple[int, ...], ...]) -> None:
        """A group whose samples decode `turns` (per sample, tokens per turn), from the next step on."""
        key, self.admitted = self.admitted, self.admitted + 1
        self.groups[key] = RunningGroup(ticket, version, turns, [0] * len(turns), len(turns))
        for sample in range(len(turns)):
            self._start(key, sample)

    def resume(self, key: int, sample: int) -> None:
        """A sample back from its environment starts its next turn."""
        self.away -= 1
        self._start(key, sample)

    def _start(self, key: int, sample: int) -> None:
        group = self.groups[key]
        length = group.turns[sample][group.next_turn[sample]] if group.turns[sample] else 1
        self.ending[self.steps + max(1, length)].append((key, sample))
        self.sequences += 1

    def step(self) -> tuple[list[tuple[Any, int]], list[tuple[int, int]]]:
        """One step over every running sequence: the groups (ticket, version) it finished, and the
        samples (group, sample) whose turn ended with more to come (now away)."""
        self.steps += 1
        finished, away = [], []
        for key, sample in self.ending.pop(self.steps, ()):
            self.sequences -= 1
            group = self.groups[key]
            group.next_turn[sample] += 1
            if group.next_turn[sample] < len(group.turns[sample]):
                self.away += 1
                away.append((key, sample))
                continue
            group.samples_left -= 1
            if not group.samples_left:
                finished.append((group.ticket, group.version))
                del self.groups[key]
        return finished, away


def admission_open(s: Settings, engine: RunningEngine, push_waiting: bool) -> bool:
    """Whether the generator may admit now: always into an empty engine (no sequence running or away);
    else only when continuous, and not while a push waits for the running sequences to finish
    (without rollout.inflight_updates)."""
    busy = engine.sequences > 0 or engine.away > 0
    return not busy or (s.continuous and not push_waiting)


def engine_generator(model: EngineHost, g: SimulatedGenerator) -> Process:
    """The generator's turns: load newer weights where allowed, take back the samples their
    environment answered, admit what the room and the bound grant, run one engine step (or, with
    nothing running, wait for tickets or answers), send what finished."""
    s, times, engine = model.s, g.times, RunningEngine()
    step_s = times.step_s_per_sequence * s.generate_scale / model.speeds[g.index]
    fixed_s = times.step_fixed_s * s.generate_scale / model.speeds[g.index]
    answer_wait_s = s.env_latency_s + times.env_overhead_s
    answered: deque[tuple[int, int]] = deque()
    while True:
        push_waiting = model.newest > g.loaded
        if push_waiting and (s.inflight_updates or not (engine.sequences or engine.away)):
            yield from model.load(g)
            push_waiting = False
        if answered:  # applying the answers and submitting the next turns is the generator's work
            yield from model.busy(g.clock, "env_answers", len(answered) * times.env_answer_s)
        while answered:
            engine.resume(*answered.popleft())
        if admission_open(s, engine, push_waiting):
            room = (s.max_running_seqs - engine.sequences) // s.samples_per_prompt
            wanted = min(g.call_groups, room) if s.continuous else g.call_groups
            tickets = model.dispatcher.grant((g.index, 0), g.loaded, wanted)[1] if wanted >= 1 else []
            if tickets:
                yield from model.busy(g.clock, "ask", times.ask_s)
            for ticket in tickets:
                engine.admit(ticket, g.loaded, model.rng.choice(model.cal.group_lengths))
        if not engine.sequences and engine.away:  # every episode waits on its environment
            yield from model.wait_for_slots(g, "env_wait", lambda: bool(answered) or (
                model.newest > g.loaded and s.inflight_updates) or (
                admission_open(s, engine, model.newest > g.loaded) and model.dispatcher.can_grant(g.loaded)))
            continue
        if not engine.sequences:
            yield from model.wait_for_slots(g)
            continue
        warmup_s = times.step_warmup_s if g.started == 0 else 0.0  # the engine compiling, once
        g.started += 1
        yield from model.busy(g.clock, "generate", warmup_s + fixed_s + step_s * engine.sequences)
        yield from model.busy(g.clock, "other", times.other_s_per_step)
        finished, away = engine.step()
        for sample in away:
            model.deliver_after(answer_wait_s, lambda sample=sample: answered.append(sample))
        for ticket, version in finished:
            yield from model.busy(g.clock, "score", times.score_s_per_group)
            yield from model.send(g, [ticket], version)
