"""What a simulation varies: `Settings` (the run's config keys under their own names, plus the
sim.* knobs), the `key=value` overrides of `asyncgrpo simulate`, and the one-line errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from asyncgrpo.contract import (
    DROPPING_STALE_POLICIES,
    THROTTLING_STALE_POLICIES,
    call_sizes,
    check_fixed_staleness,
    check_max_staleness,
    check_push_settings,
    check_stale_policy,
)
from asyncgrpo.schema import WeightsConfig


# sim.steps at most: about a millisecond a step here, so minutes; rates settle within thousands.
MAX_STEPS = 200_000


class SimulationError(ValueError):
    """A bad run directory, an unknown or malformed override, or settings the real run would
    refuse; the message is one line."""



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
    max_backlog_versions: int = WeightsConfig.max_backlog_versions
    # Processors every actor's busy phases share (processor sharing, docs/SIMULATOR.md); 0: each
    # actor has its own hardware, as a GPU cluster. A CPU machine's cores: the calibration is first
    # freed of the contention its own run had (model.uncontended).
    cores: int = 0
    # env.latency_s: seconds added to each environment step call (the run's; 0 for a run without an
    # environment or from before the key). Each call of episodes waits it once per round of calls
    # (asyncgrpo/sim/envwaits.py); a run without environment calls waits nothing whatever it is.
    env_latency_s: float = 0.0
    # The generator's engine (asyncgrpo/sim/engine.py, used under sim.engine=steps): groups are
    # admitted while the engine has room (rollout.max_running_seqs), only into an empty engine for
    # the call-batched baseline (rollout.continuous=false); weights load between engine steps with
    # rollout.inflight_updates, else once the running sequences have finished.
    continuous: bool = True
    max_running_seqs: int = 256
    inflight_updates: bool = False
    # How a generator's generation is simulated: calls (each call of call_groups groups takes the
    # run's mean call time, every group arriving at its end), steps (the engine step by step, from
    # the run's gen/engine_step_fit and gen/group_lengths), or auto: steps where the calibration has
    # both and the run had no environment, calls otherwise (docs/SIMULATOR.md says why).
    engine: str = "auto"
    # train.fixed_staleness=k >= 0 (max_staleness is then k): the dispatcher's lower bound too, and
    # for k >= 1 the learner publishes version v + 1 - k after step v's take instead of each new
    # version after its update (asyncgrpo/learner/publication.py). -1 = off.
    fixed_staleness: int = -1

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
        """Each generator's groups per call, as the run's generators ask (contract.call_sizes)."""
        return call_sizes(self.groups_per_call, self.num_generators, self.groups_per_step)

    def speeds(self) -> list[float]:
        """Each generator's relative speed (sim.generator_speeds)."""
        if not self.generator_speeds.strip():
            return [1.0] * self.num_generators
        try:
            values = [float(v) for v in self.generator_speeds.split(",")]
        except ValueError:
            raise SimulationError(f"sim.generator_speeds must be comma-separated numbers (got {self.generator_speeds!r})") \
                from None
        if len(values) != self.num_generators or not all(0 < value < math.inf for value in values):
            raise SimulationError(f"sim.generator_speeds must give {self.num_generators} finite speeds > 0, one per generator "
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
        check_max_staleness(require, self.max_staleness)
        check_stale_policy(require, self.stale_policy)
        check_push_settings(require, self.push_every_steps, self.max_backlog_versions, self.max_staleness)
        check_fixed_staleness(require, self.fixed_staleness, self.stale_policy, self.push_every_steps,
                              self.inflight_updates)
        require(self.fixed_staleness < 0 or self.max_staleness == self.fixed_staleness, "train.max_staleness",
                f"must be train.fixed_staleness={self.fixed_staleness}, which sets it", self.max_staleness)
        require(self.groups_per_call >= 0, "rollout.groups_per_call", "must be >= 0", self.groups_per_call)
        require(self.world_size >= 1, "learner.world_size", "must be >= 1", self.world_size)
        require(self.capacity_groups >= self.groups_per_step, "queue.capacity_groups",
                f"must hold at least one step (train.groups_per_step={self.groups_per_step})", self.capacity_groups)
        require(1 <= self.steps <= MAX_STEPS, "sim.steps", f"must be between 1 and {MAX_STEPS}", self.steps)
        require(self.warmup_steps >= 0, "sim.warmup_steps", "must be >= 0", self.warmup_steps)
        require(0 < self.scaling_efficiency <= 1, "sim.scaling_efficiency", "must be in (0, 1]",
                self.scaling_efficiency)
        # Finite: an infinite time would leave every simulated process blocked forever.
        for key, value in (("sim.push_latency_s", self.push_latency_s), ("sim.weight_load_s", self.weight_load_s)):
            require(value is None or 0 <= value < math.inf, key, "must be >= 0 and finite (or null: the run's)", value)
        require(0 < self.generate_scale < math.inf, "sim.generate_scale", "must be > 0 and finite", self.generate_scale)
        require(0 < self.train_scale < math.inf, "sim.train_scale", "must be > 0 and finite", self.train_scale)
        require(0 <= self.generate_cv < math.inf, "sim.generate_cv", "must be >= 0 and finite", self.generate_cv)
        require(0 <= self.call_size_exponent < math.inf, "sim.call_size_exponent", "must be >= 0 and finite",
                self.call_size_exponent)
        require(0 <= self.env_latency_s < math.inf, "env.latency_s", "must be >= 0 and finite", self.env_latency_s)
        require(self.cores >= 0, "sim.cores", "must be >= 0 (0: every actor has processors of its own)", self.cores)
        require(self.max_running_seqs >= self.samples_per_prompt, "rollout.max_running_seqs",
                f"must hold a group (rollout.samples_per_prompt={self.samples_per_prompt})", self.max_running_seqs)
        require(self.engine in ENGINE_MODELS, "sim.engine", f"must be one of {', '.join(ENGINE_MODELS)}", self.engine)
        self.speeds()


ENGINE_MODELS = ("auto", "steps", "calls")


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
    "env.latency_s": "env_latency_s",
    "rollout.continuous": "continuous",
    "rollout.max_running_seqs": "max_running_seqs",
    "rollout.inflight_updates": "inflight_updates",
    "train.fixed_staleness": "fixed_staleness",
}
SIM_KEYS = {f"sim.{name}": name for name in (
    "steps", "seed", "warmup_steps", "replay", "scaling_efficiency", "push_latency_s", "weight_load_s", "generate_scale",
    "train_scale", "generate_cv", "call_size_exponent", "generator_speeds", "cores", "engine")}
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
    if changes.get("fixed_staleness", -1) >= 0 and "max_staleness" not in changes:
        changes["max_staleness"] = changes["fixed_staleness"]  # as the config does
    result = replace(settings, **changes)
    result.check()
    return result


def changed_keys(base: Settings, settings: Settings) -> dict[str, tuple[Any, Any]]:
    """Override key -> (run's value, simulated value), for each setting that differs."""
    return {key: (getattr(base, name), getattr(settings, name)) for key, name in OVERRIDE_KEYS.items()
            if getattr(base, name) != getattr(settings, name)}
