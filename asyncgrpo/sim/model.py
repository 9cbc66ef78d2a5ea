"""The simulated run: generators running the loop of asyncgrpo/rollout/generator.py, the
dispatcher of asyncgrpo/queue/dispatch.py (the real run's code) granting their slots, and the
learner's step of asyncgrpo/learner/learner.py, on the event loop of asyncgrpo/sim/events.py.
`simulate` runs it; `uncontended` takes out of a calibration the processor sharing its run had."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from asyncgrpo.contract import ack_floor, engine_lag_bound, published_at_take, staleness, trainable
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.sim.calibration import Calibration, GeneratorTimes, env_wait_per_call, histogram_mean
from asyncgrpo.sim.engine import engine_generator
from asyncgrpo.sim.events import Clock, Delay, EventLoop, Process, Until, Work
from asyncgrpo.sim.settings import Settings, SimulationError


@dataclass
class SimGenerator:
    index: int
    call_groups: int
    times: GeneratorTimes
    loaded: int = 0  # the version in its engine, acknowledged as soon as it is loaded
    started: int = 0  # groups started: the first call pays the engine's warm-up
    clock: Clock = field(default_factory=Clock)
    # Calls generated whose episodes wait on their environment (Model.deliver_after), and those
    # answered, (tickets, version) each, to be scored and sent at the loop's next turn.
    waiting: int = 0
    answered: deque[tuple[list[Any], int]] = field(default_factory=deque)

    def answer(self, tickets: list[Any], version: int) -> None:
        """A waiting call's episodes answered: handed back to be scored and sent."""
        self.waiting -= 1
        self.answered.append((tickets, version))


@dataclass(frozen=True)
class SimGroup:
    generator: int
    version: int  # of the weights that generated it
    slot: int  # its ticket's slot


@dataclass(frozen=True)
class Result:
    steps: int
    sim_time_s: float
    samples: int
    samples_per_s: float  # over the whole simulated run, as summary.json's samples_per_s
    steady_samples_per_s: float  # after sim.warmup_steps steps
    learner_idle_frac: float  # (ack_wait + gen_wait) / time, as summary.json's learner.idle_frac
    learner_seconds: dict[str, float]
    ack_waits: int
    generator_idle_frac: float  # mean over generators
    generator_idle_fracs: list[float]  # (waits for tickets + reward waits) / time
    staleness_histogram: dict[int, int]
    staleness_mean: float
    staleness_max: int
    dropped_stale: int

    def as_dict(self) -> dict[str, Any]:
        return rounded(asdict(self))


def rounded(value: Any) -> Any:
    """`value` with every float in it rounded to 6 decimals, for printing as JSON."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


GENERATOR_IDLE_PHASES = ("throttle", "score_wait")

# What the model tells its event loop has changed: the queue's contents, a version (the learner's,
# the newest pushed, one a generator has loaded), the slots the dispatcher may grant (a step
# taken, a slot given back), or a call's environment answers (Model.env_answers). A generator
# waiting for tickets reads only versions, slots and answers: a group arriving, which is most
# events, grants nobody anything. Every other wait reads all of them (Until.reads None).
QUEUE, VERSIONS, SLOTS, ENV = "queue", "versions", "slots", "env"
GRANT_READS = frozenset({VERSIONS, SLOTS, ENV})


class Model:
    """The shared state (versions, queue) and the two loops; `simulate` runs it."""

    def __init__(self, calibration: Calibration, settings: Settings) -> None:
        self.cal, self.s = calibration, settings
        self.rng = random.Random(settings.seed)
        # Every change to what a wait's condition reads calls self.loop.changed(QUEUE, VERSIONS or
        # SLOTS): the queue helpers below, load(), the learner's version bump and push, and the
        # dispatcher's take and releases.
        self.loop = EventLoop(track_changes=True, cores=settings.cores)
        self.generators = [SimGenerator(i, call_groups, calibration.generators[i % len(calibration.generators)])
                           for i, call_groups in enumerate(settings.call_groups())]
        self.speeds = settings.speeds()
        self.engine_steps = uses_engine_steps(calibration, settings)
        # Slots granted to whichever generator asks (asyncgrpo/queue/dispatch.py, the real run's code).
        # No slot is granted that the queue could not hold, so no generator blocks on a full queue.
        self.dispatcher = Dispatcher(settings.groups_per_step, settings.max_staleness, settings.throttles,
                                     settings.capacity_groups, fixed_staleness=settings.fixed_staleness >= 0)
        self.queue: deque[SimGroup] = deque()
        # Kept up to date as groups enter and leave the queue, because whether anything queued is
        # too stale is asked after every event: walking a queue of thousands of groups each time
        # made a simulation of hundreds of generators take minutes.
        self.queued_per_version: dict[int, int] = {}
        self.version = 0  # the learner's
        self.newest = 0  # the newest version pushed, visible to every generator
        self.steps_done = 0
        self.learner = Clock()
        self.ack_waits = self.dropped_stale = 0
        self.staleness: dict[int, int] = {}
        self.warmup_end = 0.0

    # ---- helpers every loop uses

    def busy(self, clock: Clock, phase: str, seconds: float, processes: int = 1) -> Iterator[Work]:
        """Busy on `processes` processors for `seconds` of calibrated work (longer where it shares
        them, sim.cores)."""
        took = yield from self.timed(clock, phase, Work(seconds, processes))
        clock.work_s += seconds
        clock.work_wall_s += took

    def idle_for(self, clock: Clock, phase: str, seconds: float) -> Iterator[Delay]:
        """Waiting `seconds` without using a processor (a reward wait)."""
        yield from self.timed(clock, phase, Delay(seconds))

    def timed(self, clock: Clock, phase: str, request: Delay | Work) -> Generator[Delay | Work, None, float]:
        """`request`'s seconds counted under `phase` (up to the end if it is still running then);
        returns them."""
        since = self.loop.now
        clock.running = (phase, since)
        yield request
        clock.running = None
        clock.add(phase, self.loop.now - since)
        return self.loop.now - since

    def wait(self, clock: Clock, phase: str, condition: Callable[[], bool],
             reads: frozenset[str] | None = None) -> Iterator[Until]:
        # Several processes may wake for one slot: whoever runs first takes it, the others wait again.
        while not condition():
            clock.waiting = (phase, self.loop.now)
            yield Until(condition, reads)
            clock.close(self.loop.now)

    # ---- a generator (Generator.run)

    def generator(self, g: SimGenerator) -> Process:
        """Ask for a call's worth of tickets, generate what was granted, send it. A call whose
        episodes wait on their environment leaves the engine to the next call meanwhile, as far as
        the staleness bound grants one, and is scored and sent once answered."""
        while True:
            if self.newest > g.loaded:
                yield from self.load(g)
            while g.answered:
                tickets, version = g.answered.popleft()
                yield from self.after_generate(g, len(tickets))
                yield from self.send(g, tickets, version)
            _, tickets = self.dispatcher.grant((g.index, 0), g.loaded, g.call_groups)
            if not tickets:  # nothing within the bound: newer weights, a slot given back or an answer will do
                yield from self.wait_for_slots(g, "env_wait" if g.waiting else "throttle", lambda: (
                    self.newest > g.loaded or self.dispatcher.can_grant(g.loaded) or bool(g.answered)))
                continue
            version = g.loaded
            env_wait_s = self.env_wait_s(g, len(tickets))
            if env_wait_s > 0:
                yield from self.generate(g, len(tickets))
                g.waiting += 1
                self.deliver_after(env_wait_s, lambda tickets=tickets, version=version: g.answer(tickets, version))
                continue
            yield from self.call(g, len(tickets))
            yield from self.send(g, tickets, version)

    def wait_for_slots(self, g: SimGenerator, phase: str = "throttle",
                       ready: Callable[[], bool] | None = None) -> Iterator[Until]:
        """Granted nothing with nothing decoding: wait (under `phase`) until `ready`, by default for
        newer weights or a slot given back. What `ready` reads must be versions, slots or answers."""
        yield from self.wait(g.clock, phase, ready or (lambda: self.newest > g.loaded
                                                       or self.dispatcher.can_grant(g.loaded)), reads=GRANT_READS)

    def deliver_after(self, seconds: float, deliver: Callable[[], None]) -> None:
        """Call `deliver` (an environment's answer) `seconds` from now, using no processor."""
        def answer() -> Process:
            yield Delay(seconds)
            deliver()
            self.loop.changed(ENV)

        self.loop.start(answer())

    def send(self, g: SimGenerator, tickets: list[Any], version: int) -> Process:
        for ticket in tickets:
            yield from self.busy(g.clock, "send", g.times.send_s_per_group)
            # Its slot may have moved while it generated (Dispatcher.fill_early): found by its prompt.
            slot = self.dispatcher.slot_of((g.index, 0), ticket.position)
            self.dispatcher.arrived((g.index, 0), slot)
            self.queued(SimGroup(g.index, version, slot))

    def env_wait_s(self, g: SimGenerator, n: int) -> float:
        """A call of `n` groups' wait on its environment at env.latency_s; 0 without one."""
        return env_wait_per_call(g.times, n * self.s.samples_per_prompt, self.cal.env_max_calls,
                                 self.s.env_latency_s)

    def call(self, g: SimGenerator, n: int) -> Process:
        """One vLLM call of `n` groups, their scoring and the loop's other time (its first call
        pays the engine's warm-up)."""
        yield from self.generate(g, n)
        yield from self.after_generate(g, n)

    def generate(self, g: SimGenerator, n: int) -> Process:
        warmup = g.times.first_call_extra_s if g.started == 0 else 0.0
        g.started += n
        yield from self.busy(g.clock, "generate", warmup + self.generate_s(g, n))

    def after_generate(self, g: SimGenerator, n: int) -> Process:
        """Scoring a call's `n` groups, the reward wait and the loop's other time."""
        yield from self.busy(g.clock, "score", n * g.times.score_s_per_group)
        yield from self.idle_for(g.clock, "score_wait", g.times.score_wait_s)
        yield from self.busy(g.clock, "other", g.times.other_s)

    def load(self, g: SimGenerator) -> Process:
        target = self.newest  # a push arriving during the load waits for the next safe point
        seconds = self.s.weight_load_s if self.s.weight_load_s is not None else g.times.weight_load_s
        yield from self.busy(g.clock, "weights", seconds)
        g.loaded = target
        self.loop.changed(VERSIONS)

    def generate_s(self, g: SimGenerator, n: int) -> float:
        seconds = (g.times.generate_s * (n / g.times.call_groups) ** self.s.call_size_exponent * self.s.generate_scale
                   / self.speeds[g.index])
        if self.s.generate_cv > 1e-3:  # below, the gamma's shape overflows and the noise is nil anyway
            shape = 1.0 / self.s.generate_cv ** 2
            seconds *= self.rng.gammavariate(shape, 1.0 / shape)  # mean 1
        return seconds

    # The queue changes only through these two, which keep its counts and tell the event loop.

    def queued(self, group: SimGroup) -> None:
        # The dispatcher grants no slot the queue could not hold: a generator never blocks on it.
        assert len(self.queue) < self.s.capacity_groups
        self.loop.changed(QUEUE)
        self.queue.append(group)
        self.queued_per_version[group.version] = self.queued_per_version.get(group.version, 0) + 1

    def set_queue(self, groups: deque[SimGroup]) -> None:
        self.loop.changed(QUEUE)
        self.queue = groups
        self.queued_per_version = {}
        for group in groups:
            self.queued_per_version[group.version] = self.queued_per_version.get(group.version, 0) + 1

    # ---- the learner (Learner.step)

    def learner_loop(self) -> Process:
        s = self.s
        for step in range(s.steps):
            floor = ack_floor(self.version, engine_lag_bound(s.max_staleness, s.max_backlog_versions))
            if floor > 0 and not self.acks_ok(floor):
                self.ack_waits += 1
                yield from self.wait(self.learner, "ack_wait", lambda: self.acks_ok(floor))
            yield from self.wait(self.learner, "gen_wait", self.step_ready)
            for group in self.take():
                group_staleness = staleness(group.version, self.version)
                self.staleness[group_staleness] = self.staleness.get(group_staleness, 0) + 1
            if s.fixed_staleness >= 1:
                # The held version that fills the next step, sent before this one trains; the
                # run's push time (the send and the copy kept after the update) is charged here.
                yield from self.busy(self.learner, "push", self.push_s(step))
                published = published_at_take(self.version, s.fixed_staleness)
                if published > 0:  # made in this run (version 0 is the one every generator starts from)
                    self.newest = published
                    self.loop.changed(VERSIONS)
            yield from self.busy(self.learner, "train", self.train_s(step), processes=s.world_size)
            self.version += 1
            self.loop.changed(VERSIONS)
            if s.fixed_staleness < 1 and self.version % s.push_every_steps == 0:
                yield from self.busy(self.learner, "push", self.push_s(self.version // s.push_every_steps - 1))
                self.newest = self.version
                self.loop.changed(VERSIONS)
            yield from self.busy(self.learner, "other", self.cal.learner_other_s)
            self.steps_done += 1
            if self.steps_done == s.warmup_steps:
                self.warmup_end = self.loop.now

    def acks_ok(self, floor: int) -> bool:
        # As wait_for_generators: a full step already queued waits on nobody.
        if self.dispatcher.ready():
            return True
        return all(g.loaded >= floor for g in self.generators) or len(self.queue) >= self.s.groups_per_step

    def step_ready(self) -> bool:
        # A take that comes up short still drops what is too stale (queue/replay_queue.py); the oldest queued
        # version says whether anything is, without walking the queue.
        if (self.s.drops_stale and self.queued_per_version
                and not trainable(min(self.queued_per_version), self.version, self.s.max_staleness)):
            fresh: deque[SimGroup] = deque()
            stale: list[SimGroup] = []
            for group in self.queue:
                (stale if self.too_stale(group) else fresh).append(group)
            self.dropped_stale += len(stale)
            for group in stale:  # its slot is granted again
                self.dispatcher.release(group.slot)
            self.loop.changed(SLOTS)
            self.set_queue(fresh)
        moves = dict(self.dispatcher.fill_early())  # finished later groups in place of running ones
        if moves:
            self.set_queue(deque(replace(group, slot=moves[group.slot]) if group.slot in moves else group
                                 for group in self.queue))
        return self.dispatcher.ready()

    def too_stale(self, group: SimGroup) -> bool:
        return not trainable(group.version, self.version, self.s.max_staleness)

    def take(self) -> list[SimGroup]:
        """The next step's slots, in slot order."""
        slots = {slot for slot, _, _ in self.dispatcher.take()}
        self.loop.changed(SLOTS)  # the queue's room moved on by a step
        batch = [group for group in self.queue if group.slot in slots]
        self.set_queue(deque(group for group in self.queue if group.slot not in slots))
        return batch

    def train_s(self, step: int) -> float:
        run = self.cal.settings
        seconds = self.drawn(self.cal.train_s, step)
        # Training time grows with the step's groups; ranks divide it, at the given efficiency.
        return (seconds * self.s.train_scale * self.s.groups_per_step / run.groups_per_step
                * self.speedup(run.world_size) / self.speedup(self.s.world_size))

    def speedup(self, ranks: int) -> float:
        return 1.0 if ranks == 1 else ranks * self.s.scaling_efficiency

    def push_s(self, push: int) -> float:
        if self.s.push_latency_s is not None:
            return self.s.push_latency_s
        return self.drawn(self.cal.push_s, push) if self.cal.push_s else 0.0

    def drawn(self, samples: list[float], index: int) -> float:
        """The run's own value (during the warm-up, or throughout with sim.replay), then a draw
        from its steady-state values."""
        if index < len(samples) and (self.s.replay or index < self.s.warmup_steps):
            return samples[index]
        return self.rng.choice(samples[self.s.warmup_steps:] or samples)

    # ---- running it

    def run(self) -> Result:
        for g in self.generators:
            self.loop.start(engine_generator(self, g) if self.engine_steps else self.generator(g))
        self.loop.start(self.learner_loop())
        self.loop.run(done=lambda: self.steps_done >= self.s.steps)
        end = self.loop.now
        for clock in [self.learner, *(g.clock for g in self.generators)]:
            clock.close(end)
        samples = self.s.steps * self.s.samples_per_step
        steady_steps = self.s.steps - min(self.s.warmup_steps, self.s.steps)
        steady_s = end - self.warmup_end if steady_steps and self.s.warmup_steps else end
        idle = [sum(g.clock.seconds.get(p, 0.0) for p in GENERATOR_IDLE_PHASES) / end if end else 0.0
                for g in self.generators]
        learner_idle = self.learner.seconds.get("ack_wait", 0.0) + self.learner.seconds.get("gen_wait", 0.0)
        return Result(
            steps=self.s.steps, sim_time_s=end, samples=samples,
            samples_per_s=samples / end if end else math.inf,
            steady_samples_per_s=(steady_steps * self.s.samples_per_step / steady_s if steady_steps and steady_s
                                  else samples / end if end else math.inf),
            learner_idle_frac=learner_idle / end if end else 0.0,
            learner_seconds=dict(self.learner.seconds), ack_waits=self.ack_waits,
            generator_idle_frac=sum(idle) / len(idle), generator_idle_fracs=idle,
            staleness_histogram=dict(sorted(self.staleness.items())), staleness_mean=histogram_mean(self.staleness),
            staleness_max=max(self.staleness, default=0),
            dropped_stale=self.dropped_stale)


def uses_engine_steps(calibration: Calibration, settings: Settings) -> bool:
    """Whether the generators run the engine step by step (sim.engine, asyncgrpo/sim/engine.py)."""
    ready = bool(calibration.group_lengths) and all(g.has_step_fit for g in calibration.generators)
    if settings.engine == "steps" and not ready:
        raise SimulationError(f"sim.engine=steps needs {calibration.run_dir}'s generators to have recorded "
                              f"gen/engine_step_fit and gen/group_lengths (runs since they were added do)")
    # auto leaves a run with an environment call by call: there the engine step by step measured
    # further from bench_env's runs at 200 ms than the call model (docs/SIMULATOR.md).
    return settings.engine == "steps" or (settings.engine == "auto" and ready and not calibration.env_max_calls)


def simulate(calibration: Calibration, settings: Settings) -> Result:
    """Run the model for `settings.steps` learner steps, from an empty queue with every actor at
    version 0 and starting at once; deterministic for a given `settings.seed`."""
    settings.check()
    if any(g.generate_s <= 0 for g in calibration.generators):
        raise SimulationError("every generator's call must take time (GeneratorTimes.generate_s > 0)")
    if settings.cores:
        if calibration.shared_cores is None:
            raise SimulationError(f"sim.cores needs to know whether {calibration.run_dir}'s actors shared cores; its "
                                  f"actors.json has no driver_cores (recorded since commit a9a1ab5), or its actors "
                                  f"ran on several nodes")
        if calibration.shared_cores and calibration.recorded_dispatch != "tickets":
            # Taking the run's contention out replays the run itself, its dispatch included.
            raise SimulationError(f"sim.cores: {calibration.run_dir}'s actors shared {calibration.shared_cores} cores "
                                  f"under the removed shares dispatch, whose contention the simulator can no longer "
                                  f"take out of its times; calibrate from a run under tickets, or leave sim.cores out")
        calibration = uncontended(calibration)
    return Model(calibration, settings).run()


def uncontended(calibration: Calibration, rounds: int = 6) -> Calibration:
    """The times each actor's phases would take on processors of its own.

    A run whose actors shared `shared_cores` cores measured every phase slowed by whatever else
    was busy then. Simulating the run's own settings on those cores stretches each actor's
    work by some factor; the uncontended times are the measured ones divided by it. The factor
    depends on the times (they set what overlaps), so this repeats from the measured times
    `rounds` times (a fixed point; tests/unit/test_simulate_cores.py checks it recovers known times).
    The result is marked as sharing nothing, so it is never freed of the contention twice."""
    if not calibration.shared_cores:
        return calibration
    own = replace(calibration.settings, cores=calibration.shared_cores)
    current = calibration
    for _ in range(rounds):
        model = Model(current, own)
        model.run()
        current = calibration.scaled(1 / _stretch(model.learner),
                                     [1 / _stretch(g.clock) for g in model.generators])
    return replace(current, shared_cores=0)


def _stretch(clock: Clock) -> float:
    """How much longer an actor's processor work took than calibrated (1: it shared nothing)."""
    return clock.work_wall_s / clock.work_s if clock.work_s > 0 else 1.0
