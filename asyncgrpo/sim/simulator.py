"""`asyncgrpo simulate RUN_DIR [key=value ...]`: a discrete-event model of a run, calibrated from
the run's own measured phase times, that predicts throughput, idle fractions and staleness for
other settings (more generators, another staleness bound, more learner ranks, slower pushes).

    Calibration.from_run(run_dir)  what the run measured, per generator call and per learner step
    Settings                       what to simulate: the run's config keys plus sim.* knobs
    simulate(calibration, settings) -> Result

The model (docs/SIMULATOR.md states every assumption): each generator runs the real loop of
asyncgrpo/rollout/generator.py (load the newest weights -> ask for tickets -> one vLLM call -> score ->
send), the dispatcher of asyncgrpo/queue/dispatch.py grants each call's slots to whichever generator asks
and hands each step its slots, and the learner runs the step of asyncgrpo/learner/learner.py (ack_wait ->
gen_wait -> train -> push; a push is visible to the generators when it ends). Each actor has its
own hardware, unless sim.cores makes them share a machine's cores (processor sharing, after taking
out of the calibration the sharing its own run had). Pure Python (no torch, no numpy), so it runs
anywhere in well under a second.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union

import yaml

from asyncgrpo.queue.dispatch import Dispatcher, engine_lag_bound

# The real run's choice lists and formulas, mirrored here because their modules import torch or
# ZeroMQ; tests/unit/test_simulate.py checks them against asyncgrpo.queue.replay_queue and asyncgrpo.config.
STALE_POLICIES = ("throttle", "drop", "both")
THROTTLING_STALE_POLICIES = ("throttle", "both")
DROPPING_STALE_POLICIES = ("drop", "both")


def even_split(num_generators: int, groups_per_step: int) -> list[int]:
    """A step's groups divided among generators as evenly as possible (config.groups_per_generator):
    with rollout.groups_per_call=0 a generator's call asks for its part of a step."""
    return [groups_per_step // num_generators + (1 if i < groups_per_step % num_generators else 0)
            for i in range(num_generators)]


class SimulationError(ValueError):
    """A bad run directory, an unknown or malformed override, or settings the real run would
    refuse; the message is one line."""


# --------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """What to simulate. The first group are the run's config keys (same names on the command
    line); the sim.* knobs change the calibrated times or the simulation itself."""

    num_generators: int
    groups_per_step: int
    samples_per_prompt: int
    max_staleness: int
    stale_policy: str
    groups_per_call: int  # 0: a step's groups over the generators per call, as in the generator
    world_size: int
    capacity_groups: int
    push_every_steps: int
    steps: int  # learner steps to simulate; from a run: its own number of steps
    seed: int = 0
    # The first steps take longer (allocation, first-call compilation): they are replayed in order
    # from the run and left out of the steady-state figures and of the times drawn afterwards.
    warmup_steps: int = 1
    # True: each step trains and pushes as long as the run's step of that number did, in order, as
    # far as the run goes (its slow episodes included), then draws; False: draws after the warm-up.
    # Resampling a short run's step times moves the total by their sampling error (several % here).
    replay: bool = True
    # Speed-up of n learner ranks over one: n x scaling_efficiency (1 for one rank).
    scaling_efficiency: float = 1.0
    push_latency_s: float | None = None  # None: the run's time/push_s per push
    weight_load_s: float | None = None  # None: the run's load time per version, per generator
    generate_scale: float = 1.0  # x every vLLM call's time (a faster or slower engine)
    train_scale: float = 1.0  # x every step's prepare + train time
    generate_cv: float = 0.0  # coefficient of variation of a call's time (gamma noise, mean kept)
    call_size_exponent: float = 1.0  # a call of n groups takes (n / measured n) ** this x measured
    # Relative speed of each generator's calls, comma-separated ("1,0.5": the second takes twice as
    # long); "" = all 1. Models uneven generators (other hardware, a smaller core share).
    generator_speeds: str = ""
    # weights.max_backlog_versions: the learner waits only for an engine this far behind (and at
    # least max_staleness + 1).
    max_backlog_versions: int = 4
    # Processors every actor's busy phases share (processor sharing, docs/SIMULATOR.md); 0: each
    # actor has its own hardware, as a GPU cluster. A CPU machine's cores: the calibration is first
    # freed of the contention its own run had (Calibration.uncontended).
    cores: int = 0

    @property
    def throttles(self) -> bool:
        return self.stale_policy in THROTTLING_STALE_POLICIES

    @property
    def drops_stale(self) -> bool:
        return self.stale_policy in DROPPING_STALE_POLICIES

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.samples_per_prompt

    def call_groups(self) -> list[int]:
        """Each generator's groups per call (rollout.spec.groups_per_call)."""
        return [self.groups_per_call or part for part in even_split(self.num_generators, self.groups_per_step)]

    def speeds(self) -> list[float]:
        """Each generator's relative speed (sim.generator_speeds)."""
        if not self.generator_speeds.strip():
            return [1.0] * self.num_generators
        try:
            values = [float(v) for v in self.generator_speeds.split(",")]
        except ValueError:
            raise SimulationError(f"sim.generator_speeds must be comma-separated numbers (got {self.generator_speeds!r})") \
                from None
        if len(values) != self.num_generators or min(values) <= 0:
            raise SimulationError(f"sim.generator_speeds must give {self.num_generators} speeds > 0, one per generator "
                                  f"(rollout.num_generators) (got {self.generator_speeds!r})")
        return values

    def check(self) -> None:
        """Refuse what the real config validation (config.validate) refuses, and meaningless knobs."""
        def require(ok: bool, key: str, why: str, value: Any) -> None:
            if not ok:
                raise SimulationError(f"{key} {why} (got {value!r})")

        require(1 <= self.num_generators <= self.groups_per_step, "rollout.num_generators",
                f"must be between 1 and train.groups_per_step={self.groups_per_step}", self.num_generators)
        require(self.groups_per_step >= 1, "train.groups_per_step", "must be >= 1", self.groups_per_step)
        require(self.max_staleness >= 0, "train.max_staleness", "must be >= 0", self.max_staleness)
        require(self.stale_policy in STALE_POLICIES, "train.stale_policy", f"must be one of {STALE_POLICIES}",
                self.stale_policy)
        require(self.groups_per_call >= 0, "rollout.groups_per_call", "must be >= 0", self.groups_per_call)
        require(self.world_size >= 1, "learner.world_size", "must be >= 1", self.world_size)
        require(self.capacity_groups >= self.groups_per_step, "queue.capacity_groups",
                f"must hold at least one step (train.groups_per_step={self.groups_per_step})", self.capacity_groups)
        require(1 <= self.push_every_steps <= self.max_staleness + 1, "weights.push_every_steps",
                f"must be between 1 and train.max_staleness + 1 = {self.max_staleness + 1}", self.push_every_steps)
        require(self.steps >= 1, "sim.steps", "must be >= 1", self.steps)
        require(self.warmup_steps >= 0, "sim.warmup_steps", "must be >= 0", self.warmup_steps)
        require(0 < self.scaling_efficiency <= 1, "sim.scaling_efficiency", "must be in (0, 1]",
                self.scaling_efficiency)
        for key, value in (("sim.push_latency_s", self.push_latency_s), ("sim.weight_load_s", self.weight_load_s)):
            require(value is None or value >= 0, key, "must be >= 0 (or null: the run's)", value)
        require(self.generate_scale > 0, "sim.generate_scale", "must be > 0", self.generate_scale)
        require(self.train_scale > 0, "sim.train_scale", "must be > 0", self.train_scale)
        require(self.generate_cv >= 0, "sim.generate_cv", "must be >= 0", self.generate_cv)
        require(self.call_size_exponent >= 0, "sim.call_size_exponent", "must be >= 0", self.call_size_exponent)
        require(self.cores >= 0, "sim.cores", "must be >= 0 (0: every actor has processors of its own)", self.cores)
        require(self.max_backlog_versions >= 1, "weights.max_backlog_versions", "must be >= 1",
                self.max_backlog_versions)
        self.speeds()


# Command-line key -> Settings field. The config keys keep the names `asyncgrpo train` uses.
CONFIG_KEYS = {
    "rollout.num_generators": "num_generators",
    "weights.max_backlog_versions": "max_backlog_versions",
    "rollout.groups_per_call": "groups_per_call",
    "train.groups_per_step": "groups_per_step",
    "train.max_staleness": "max_staleness",
    "train.stale_policy": "stale_policy",
    "learner.world_size": "world_size",
    "queue.capacity_groups": "capacity_groups",
    "weights.push_every_steps": "push_every_steps",
}
SIM_KEYS = {f"sim.{name}": name for name in (
    "steps", "seed", "warmup_steps", "replay", "scaling_efficiency", "push_latency_s", "weight_load_s", "generate_scale",
    "train_scale", "generate_cv", "call_size_exponent", "generator_speeds", "cores")}
OVERRIDE_KEYS = {**CONFIG_KEYS, **SIM_KEYS}


def apply_overrides(settings: Settings, overrides: list[str]) -> Settings:
    """`key=value` strings over `settings`; an unknown key or a bad value is one line."""
    types = {f.name: f.type for f in fields(Settings)}
    changes: dict[str, Any] = {}
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep:
            raise SimulationError(f"override {override!r} is not key=value")
        if key not in OVERRIDE_KEYS:
            raise SimulationError(f"unknown key {key!r}; known: {', '.join(OVERRIDE_KEYS)}")
        name = OVERRIDE_KEYS[key]
        kind = str(types[name])
        try:
            if "None" in kind and text.lower() in ("null", "none", ""):
                changes[name] = None
            elif kind == "bool":
                changes[name] = {"true": True, "false": False}[text.lower()]
            elif kind.startswith("int"):
                changes[name] = int(text)
            elif kind.startswith("float"):
                changes[name] = float(text)
            else:
                changes[name] = text
        except (ValueError, KeyError):
            raise SimulationError(f"{key}={text!r} is not a {kind.split(' ')[0]}") from None
    result = replace(settings, **changes)
    result.check()
    return result


def changed_keys(base: Settings, settings: Settings) -> dict[str, tuple[Any, Any]]:
    """Override key -> (run's value, simulated value), for each setting that differs."""
    return {key: (getattr(base, name), getattr(settings, name)) for key, name in OVERRIDE_KEYS.items()
            if getattr(base, name) != getattr(settings, name)}


# ------------------------------------------------------------------------------ calibration


@dataclass(frozen=True)
class GeneratorTimes:
    """One measured generator's costs, from its totals in summary.json (docs/SIMULATOR.md)."""

    generate_s: float  # one vLLM call of `call_groups` groups: gen_time/generate_s / calls
    call_groups: int  # groups per call in the run: rollout.groups_per_call, or its part of a step (even_split)
    score_s_per_group: float  # gen_time/score_s / groups scored
    score_wait_s: float  # per call: gen_time/score_wait_s / calls (rewards not ready; idle)
    send_s_per_group: float  # (gen_time/send_s - gen/send_blocked_s) / groups sent
    weight_load_s: float  # per version loaded: gen/weight_load_s / gen/weight_loads
    other_s: float  # per call: gen/wall_s minus every timed phase, over calls (tokenizing, ...)
    first_call_extra_s: float = 0.0  # the engine's warm-up, added to its first call (_split_first_call)


@dataclass(frozen=True)
class Measured:
    """What the run itself reported, to compare a simulation of its own settings with."""

    samples_per_s: float  # summary.json: samples / train_s
    steady_samples_per_s: float  # metrics.jsonl, steps after the warm-up: perf/samples / time/step_s
    learner_idle_frac: float  # summary.json: learner.idle_frac
    generator_idle_frac: float  # mean over generators of gen/idle_frac
    staleness_mean: float  # from learner.staleness_histogram
    staleness_histogram: dict[int, int]


@dataclass(frozen=True)
class Calibration:
    run_dir: str
    settings: Settings  # the run's own (sim.steps = its number of steps)
    generators: list[GeneratorTimes]
    train_s: list[float]  # per step, in order: time/prepare_s + time/train_s
    push_s: list[float]  # per push, in order: time/push_s of the steps that pushed
    learner_other_s: float  # per step: the driver's train_s minus the learner's timed phases, over steps
    measured: Measured
    # The processors the run's actors shared (actors.json): 0, none (each pinned to cores of its
    # own); n, the n cores of their one machine (not pinned); None, not known (a run from before
    # driver_cores was recorded, or actors on several nodes).
    shared_cores: int | None = None
    machine_cores: int | None = None  # the cores the run's actors were planned on (actors.json driver_cores)
    device: str = ""  # the run's config.yaml device ("cpu", "cuda")
    # The dispatch the run was recorded under (recorded_dispatch): "tickets", or "shares", removed
    # since; such a run calibrates only what does not depend on it (docs/SIMULATOR.md).
    recorded_dispatch: str = "tickets"

    @classmethod
    def from_run(cls, run_dir: str | Path) -> Calibration:
        """Read config.yaml, metrics.jsonl and summary.json; a missing or unusable file is one line."""
        path = Path(run_dir)
        config = _read_config(path)
        actors = read_actors(path / "actors.json")
        summary = _read_json(path / "summary.json")
        steps = _step_records(path, summary)
        settings = _run_settings(config, steps=len(steps))
        dispatch = recorded_dispatch(config, path / "config.yaml")
        reports = _generator_reports(path, summary, settings)
        first_step_wait = float(steps[0].get("time/ack_wait_s", 0.0)) + float(steps[0].get("time/gen_wait_s", 0.0))
        parts = even_split(settings.num_generators, settings.groups_per_step)
        generators = [_generator_times(i, report, call_groups, part, first_step_wait)
                      for i, (report, call_groups, part) in enumerate(zip(reports, settings.call_groups(), parts))]

        def phase(key: str) -> list[float]:
            return [float(r.get(f"time/{key}_s", 0.0)) for r in steps]

        timed = sum(sum(phase(key)) for key in ("ack_wait", "gen_wait", "prepare", "train", "push"))
        # The driver's clock (train_s) also covers what no learner phase times: metrics, the step
        # records' trip through Ray, checkpoints.
        wall = float(summary.get("train_s") or sum(phase("step")))
        pushed = [float(r.get("time/push_s", 0.0)) for r in steps if int(r["step"]) % settings.push_every_steps == 0]
        return cls(run_dir=str(path), settings=settings, generators=generators,
                   train_s=[p + t for p, t in zip(phase("prepare"), phase("train"))], push_s=pushed,
                   learner_other_s=max(0.0, (wall - timed) / len(steps)),
                   measured=_measured(summary, reports, steps[settings.warmup_steps:] or steps),
                   shared_cores=_shared_cores(actors), machine_cores=_machine_cores(actors),
                   device=str(config.get("device", "")), recorded_dispatch=dispatch)

    def scaled(self, learner: float, generators: list[float]) -> Calibration:
        """Every processor phase's time x a factor per actor (the learner's, each generator's); the
        reward wait, which uses no processor here, is kept."""
        def generator(times: GeneratorTimes, f: float) -> GeneratorTimes:
            return replace(times, generate_s=times.generate_s * f, score_s_per_group=times.score_s_per_group * f,
                           send_s_per_group=times.send_s_per_group * f, weight_load_s=times.weight_load_s * f,
                           other_s=times.other_s * f, first_call_extra_s=times.first_call_extra_s * f)

        return replace(self, generators=[generator(t, f) for t, f in zip(self.generators, generators)],
                       train_s=[t * learner for t in self.train_s], push_s=[t * learner for t in self.push_s],
                       learner_other_s=self.learner_other_s * learner)

    def uncontended(self, rounds: int = 6) -> Calibration:
        """The times each actor's phases would take on processors of its own.

        A run whose actors shared `shared_cores` cores measured every phase slowed by whatever else
        was busy then. Simulating the run's own settings on those cores stretches each actor's
        work by some factor; the uncontended times are the measured ones divided by it. The factor
        depends on the times (they set what overlaps), so this repeats from the measured times
        `rounds` times (a fixed point; tests/unit/test_simulate_cores.py checks it recovers known times).
        The result is marked as sharing nothing, so it is never freed of the contention twice."""
        if not self.shared_cores:
            return self
        own = replace(self.settings, cores=self.shared_cores)
        current = self
        for _ in range(rounds):
            model = Model(current, own)
            model.run()
            current = self.scaled(1 / _stretch(model.learner),
                                  [1 / _stretch(g.clock) for g in model.generators])
        return replace(current, shared_cores=0)


def _stretch(clock: Clock) -> float:
    return clock.work_wall_s / clock.work_s if clock.work_s > 0 else 1.0


def read_actors(path: Path) -> dict[str, Any]:
    """A run's actors.json ({} when missing or unreadable: what it would say is then unknown)."""
    try:
        actors = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return actors if isinstance(actors, dict) else {}


def _machine_cores(actors: dict[str, Any]) -> int | None:
    driver_cores = actors.get("driver_cores")
    return len(driver_cores) if isinstance(driver_cores, list) and driver_cores else None


def _shared_cores(actors: dict[str, Any]) -> int | None:
    """Calibration.shared_cores from a run's actors.json."""
    try:
        cores = [*actors["generator_cores"], *actors["learner_cores"]]
        nodes = {n["node_id"] for n in [*actors["learner_nodes"], *actors["generator_nodes"]]}
    except (KeyError, TypeError):
        return None
    pinned = [set(c) for c in cores if isinstance(c, list)]
    if len(pinned) == len(cores) and all(pinned) and sum(map(len, pinned)) == len(set().union(*pinned)):
        return 0  # every actor on cores of its own
    return _machine_cores(actors) if len(nodes) == 1 else None


def _measured(summary: dict[str, Any], reports: list[dict[str, Any]], steady: list[dict[str, Any]]) -> Measured:
    learner = summary.get("learner") or {}
    histogram = {int(k): int(v) for k, v in (learner.get("staleness_histogram") or {}).items()}
    steady_s = sum(float(r.get("time/step_s", 0.0)) for r in steady)
    return Measured(
        samples_per_s=float(summary.get("samples_per_s", 0.0)),
        steady_samples_per_s=sum(float(r.get("perf/samples", 0.0)) for r in steady) / steady_s if steady_s else 0.0,
        learner_idle_frac=float(learner.get("idle_frac", 0.0)),
        generator_idle_frac=sum(float(g.get("gen/idle_frac", 0.0)) for g in reports) / len(reports),
        staleness_mean=_mean_of(histogram),
        staleness_histogram=histogram,
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise SimulationError(f"{path} not found (summary.json is written when a run ends; is this a run directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SimulationError(f"{path}: not JSON ({err})") from None


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise SimulationError(f"{run_dir}: no such directory")
    if not path.is_file():
        raise SimulationError(f"{path} not found; is this a run directory?")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SimulationError(f"{path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise SimulationError(f"{path}: not a config mapping")
    return config


def _run_settings(config: dict[str, Any], steps: int) -> Settings:
    def get(key: str) -> Any:
        value: Any = config
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise SimulationError(f"config.yaml has no {key}")
            value = value[part]
        return value

    settings = Settings(
        num_generators=int(get("rollout.num_generators")), groups_per_step=int(get("train.groups_per_step")),
        samples_per_prompt=int(get("rollout.samples_per_prompt")), max_staleness=int(get("train.max_staleness")),
        stale_policy=str(get("train.stale_policy")), groups_per_call=int(get("rollout.groups_per_call")),
        world_size=int(get("learner.world_size")), capacity_groups=int(get("queue.capacity_groups")),
        push_every_steps=int(get("weights.push_every_steps")), steps=steps,
        max_backlog_versions=int((config.get("weights") or {}).get(  # absent in older runs: the default
            "max_backlog_versions", Settings.max_backlog_versions)))
    settings.check()
    return settings


def _step_records(run_dir: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """This run's step records: a resumed run's metrics.jsonl also holds the earlier run's steps,
    which its summary's generator totals do not cover."""
    from asyncgrpo.plot import (
        latest_steps,  # numpy, not torch: only where a run is read
    )

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SimulationError(f"{path} not found; is this a run directory?")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial last line
    resumed_at = int(summary.get("resumed_at_step") or 0)
    steps = [r for r in latest_steps([r for r in records if "time/train_s" in r]) if int(r["step"]) > resumed_at]
    if not steps:
        raise SimulationError(f"{path} has no learner step records")
    return steps


def _generator_reports(run_dir: Path, summary: dict[str, Any], settings: Settings) -> list[dict[str, Any]]:
    reports = summary.get("generators")
    if not isinstance(reports, list) or len(reports) != settings.num_generators:
        raise SimulationError(f"{run_dir / 'summary.json'} has no generator reports for rollout.num_generators="
                              f"{settings.num_generators} (status: {summary.get('status', 'unknown')})")
    return reports


def recorded_dispatch(config: dict[str, Any], path: Path) -> str:
    """The dispatch a run's config.yaml was recorded under: "tickets", or "shares" (removed).

    Runs before the shares dispatch was removed record rollout.dispatch, or (older still) default to
    shares without the key; runs since record neither it nor queue.full_policy, which every config
    had until then. Hand-set shares sized each generator's calls unevenly, which a calibration for
    tickets cannot take apart: refused in one line."""
    rollout = config.get("rollout") if isinstance(config.get("rollout"), dict) else {}
    queue = config.get("queue") if isinstance(config.get("queue"), dict) else {}
    dispatch = rollout.get("dispatch", "shares" if "full_policy" in queue else "tickets")
    if dispatch not in ("shares", "tickets"):
        raise SimulationError(f"{path}: rollout.dispatch must be tickets or shares (got {dispatch!r})")
    if dispatch == "shares" and rollout.get("generator_shares"):
        raise SimulationError(f"{path}: recorded under the removed shares dispatch with rollout.generator_shares="
                              f"{rollout['generator_shares']}, which sized each generator's calls: calibrate from a "
                              f"run under tickets")
    return str(dispatch)


def _generator_times(index: int, report: dict[str, Any], call_groups: int, first_step_groups: int,
                     first_step_wait_s: float) -> GeneratorTimes:
    def total(key: str) -> float:
        return float(report.get(key, 0.0))

    sent = int(total("gen/groups_sent"))
    if sent <= 0:
        raise SimulationError(f"generator {index} sent no groups: nothing to calibrate its calls from")
    if total("gen_time/generate_s") <= 0:
        # A call that takes no time would let an unthrottled generator loop forever at one instant.
        raise SimulationError(f"generator {index} reports no generation time (gen_time/generate_s)")
    # Calls are not counted in the summary: with inline rewards every call's groups are sent before
    # the next call, so groups sent / groups per call is exact but for a last call cut short by the
    # shutdown (one call at most, which only rounds up here).
    calls = math.ceil(sent / call_groups)
    timed = sum(total(f"gen_time/{phase}_s")
                for phase in ("weights", "ask", "generate", "score", "score_wait", "throttle", "exhausted", "send"))
    loads = total("gen/weight_loads")
    times = GeneratorTimes(
        generate_s=total("gen_time/generate_s") / calls,
        call_groups=call_groups,
        score_s_per_group=total("gen_time/score_s") / sent,
        score_wait_s=total("gen_time/score_wait_s") / calls,
        send_s_per_group=max(0.0, total("gen_time/send_s") - total("gen/send_blocked_s")) / sent,
        weight_load_s=total("gen/weight_load_s") / loads if loads else 0.0,
        other_s=max(0.0, total("gen/wall_s") - timed) / calls,
    )
    return _split_first_call(times, calls, math.ceil(first_step_groups / call_groups), first_step_wait_s)


def _split_first_call(times: GeneratorTimes, calls: int, first_calls: int, first_step_wait_s: float
                      ) -> GeneratorTimes:
    """Take an engine's warm-up out of the mean call time.

    An engine's first call can take many times a later one (on CPU, vLLM compiles then), and a mean
    over a short run's calls spreads that over every call. The learner's first step waited
    (`first_step_wait_s`: its ack_wait + gen_wait) for the `first_calls` calls that make its part,
    generators and learner starting together; with G the total generation time over `calls` calls
    and c a call's other costs, a later call's g and the first call's extra W solve
        W + calls x g = G    and    W + first_calls x (g + c) = first_step_wait_s.
    The slowest generator sets that wait, so a faster one's W comes out too large. No warm-up is
    taken out when the run is too short to tell (no later calls) or the solution is not positive.
    """
    if calls <= first_calls:
        return times
    total = times.generate_s * calls
    per_call_rest = (times.score_s_per_group + times.send_s_per_group) * times.call_groups \
        + times.score_wait_s + times.other_s
    later = (total - first_step_wait_s + first_calls * per_call_rest) / (calls - first_calls)
    extra = total - calls * later
    if later <= 0 or extra <= 0:
        return times
    return replace(times, generate_s=later, first_call_extra_s=extra)


def _mean_of(histogram: dict[int, int]) -> float:
    count = sum(histogram.values())
    return sum(k * v for k, v in histogram.items()) / count if count else 0.0


# ------------------------------------------------------------------------- the event loop


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


# ------------------------------------------------------------------------------ the model


@dataclass
class SimGenerator:
    index: int
    call_groups: int
    times: GeneratorTimes
    loaded: int = 0  # the version in its engine, acknowledged as soon as it is loaded
    started: int = 0  # groups started: the first call pays the engine's warm-up
    clock: Clock = field(default_factory=Clock)


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
        return _rounded(asdict(self))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


GENERATOR_IDLE_PHASES = ("throttle", "score_wait")

# What the model tells its event loop has changed: the queue's contents, a version (the learner's,
# the newest pushed, one a generator has loaded), or the slots the dispatcher may grant (a step
# taken, a slot given back). A generator waiting for tickets reads only versions and slots: a group
# arriving, which is most events, grants nobody anything. Every other wait reads all three
# (Until.reads None).
QUEUE, VERSIONS, SLOTS = "queue", "versions", "slots"
GRANT_READS = frozenset({VERSIONS, SLOTS})


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
        # Slots granted to whichever generator asks (asyncgrpo/queue/dispatch.py, the real run's code).
        # No slot is granted that the queue could not hold, so no generator blocks on a full queue.
        self.dispatcher = Dispatcher(settings.groups_per_step, settings.max_staleness, settings.throttles,
                                     settings.capacity_groups)
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
        """Ask for a call's worth of tickets, generate what was granted, send it."""
        while True:
            if self.newest > g.loaded:
                yield from self.load(g)
            _, tickets = self.dispatcher.grant((g.index, 0), g.loaded, g.call_groups)
            if not tickets:  # nothing within the bound: newer weights, or a slot given back, will do
                yield from self.wait(g.clock, "throttle",
                                     lambda: self.newest > g.loaded or self.dispatcher.can_grant(g.loaded),
                                     reads=GRANT_READS)
                continue
            version = g.loaded
            yield from self.call(g, len(tickets))
            for ticket in tickets:
                yield from self.busy(g.clock, "send", g.times.send_s_per_group)
                self.dispatcher.arrived((g.index, 0), ticket.slot)
                self.queued(SimGroup(g.index, version, ticket.slot))

    def call(self, g: SimGenerator, n: int) -> Process:
        """One vLLM call of `n` groups, their scoring and the loop's other time (its first call
        pays the engine's warm-up)."""
        warmup = g.times.first_call_extra_s if g.started == 0 else 0.0
        g.started += n
        yield from self.busy(g.clock, "generate", warmup + self.generate_s(g, n))
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

    # The queue changes only through these three, which keep its counts and tell the event loop.

    def queued(self, group: SimGroup) -> None:
        # The dispatcher grants no slot the queue could not hold: a generator never blocks on it.
        assert len(self.queue) < self.s.capacity_groups
        self.loop.changed(QUEUE)
        self.queue.append(group)
        self.queued_per_version[group.version] = self.queued_per_version.get(group.version, 0) + 1

    def unqueued(self, group: SimGroup) -> None:
        """`group` has just been taken off the queue."""
        self.loop.changed(QUEUE)
        self.queued_per_version[group.version] -= 1
        if not self.queued_per_version[group.version]:
            del self.queued_per_version[group.version]

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
            floor = self.version - engine_lag_bound(s.max_staleness, s.max_backlog_versions)
            if floor > 0 and not self.acks_ok(floor):
                self.ack_waits += 1
                yield from self.wait(self.learner, "ack_wait", lambda: self.acks_ok(floor))
            yield from self.wait(self.learner, "gen_wait", self.step_ready)
            for group in self.take():
                staleness = self.version - group.version
                self.staleness[staleness] = self.staleness.get(staleness, 0) + 1
            yield from self.busy(self.learner, "train", self.train_s(step), processes=s.world_size)
            self.version += 1
            self.loop.changed(VERSIONS)
            if self.version % s.push_every_steps == 0:
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
                and self.version - min(self.queued_per_version) > self.s.max_staleness):
            fresh: deque[SimGroup] = deque()
            stale: list[SimGroup] = []
            for group in self.queue:
                (stale if self.too_stale(group) else fresh).append(group)
            self.dropped_stale += len(stale)
            for group in stale:  # its slot is granted again
                self.dispatcher.release(group.slot)
            self.loop.changed(SLOTS)
            self.set_queue(fresh)
        return self.dispatcher.ready()

    def too_stale(self, group: SimGroup) -> bool:
        return self.version - group.version > self.s.max_staleness

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
            self.loop.start(self.generator(g))
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
            staleness_histogram=dict(sorted(self.staleness.items())), staleness_mean=_mean_of(self.staleness),
            staleness_max=max(self.staleness, default=0),
            dropped_stale=self.dropped_stale)


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
        calibration = calibration.uncontended()
    return Model(calibration, settings).run()


# ------------------------------------------------------------------------------ the command


def report(calibration: Calibration, settings: Settings, result: Result) -> str:
    """A small table (the run as measured beside the simulation), then the JSON line last."""
    m = calibration.measured
    changed = changed_keys(calibration.settings, settings)
    rows = [("samples/s", m.samples_per_s, result.samples_per_s),
            ("steady samples/s", m.steady_samples_per_s, result.steady_samples_per_s),
            ("learner idle frac", m.learner_idle_frac, result.learner_idle_frac),
            ("generator idle frac", m.generator_idle_frac, result.generator_idle_frac),
            ("staleness mean", m.staleness_mean, result.staleness_mean)]
    lines = [f"run: {calibration.run_dir} ({calibration.settings.steps} steps)",
             "changed: " + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "nothing (the run's own "
                                                                                              "settings)")]
    if calibration.recorded_dispatch != "tickets":
        lines.append(f"note: the run was recorded under the removed {calibration.recorded_dispatch} dispatch: its "
                     f"times calibrate the simulation of tickets, and its measured figures are of the old dispatch")
    actors = settings.num_generators + settings.world_size
    if not settings.cores and calibration.device == "cpu" and (calibration.machine_cores or actors) < actors:
        lines.append(f"note: {actors} actors, each simulated on a core of its own, where the run had "
                     f"{calibration.machine_cores} CPU cores; sim.cores={calibration.machine_cores} makes them share them")
    if settings.cores:
        lines.append(f"processors: simulated on {settings.cores} shared cores (sim.cores); the run's actors "
                     + (f"shared {calibration.shared_cores} cores, taken out of its times first"
                        if calibration.shared_cores else "had cores of their own"))
    lines.append(f"{'':<22}{'run (measured)':>16}{'simulated':>12}")
    lines += [f"{name:<22}{run:>16.3f}{sim:>12.3f}" for name, run, sim in rows]
    lines.append(f"{'staleness histogram':<22}{json.dumps(m.staleness_histogram):>16}  "
                 f"{json.dumps(result.staleness_histogram)}")
    payload = {**result.as_dict(), "staleness_histogram": {str(k): v for k, v in result.staleness_histogram.items()},
               "measured_samples_per_s": round(m.samples_per_s, 6),
               "ratio_to_measured": round(result.samples_per_s / m.samples_per_s, 4) if m.samples_per_s else None,
               "changed": {k: b for k, (_, b) in changed.items()},
               "recorded_dispatch": calibration.recorded_dispatch}
    lines.append(json.dumps(payload))
    return "\n".join(lines)


def run_command(run_dir: str, overrides: list[str]) -> str:
    """What `asyncgrpo simulate` prints; raises SimulationError (one line) on bad input."""
    calibration = Calibration.from_run(run_dir)
    settings = apply_overrides(calibration.settings, overrides)
    return report(calibration, settings, simulate(calibration, settings))
