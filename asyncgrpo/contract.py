"""The staleness contract: the one statement of the rules the dispatcher, the generators, the
queue, the config's validation and the simulator each depend on (docs/ARCHITECTURE.md, Versions
and staleness). Standard library only, so anything may import it, the simulator included.

Versions and slots (eta = train.max_staleness, G = train.groups_per_step):
- The learner's version u is the number of optimizer steps taken; it trains step u next. A group
  is sampled on the version v of the weights its engine held (its tokens' oldest version).
- Slots number the groups in training order: slot s is trained at step s // G (`step_of`), and
  step u trains exactly slots u*G .. u*G + G - 1 (`first_slot` is u*G).
- A group sampled on version v may be trained at step u iff u - v <= eta (`trainable`); its
  staleness is u - v (`staleness`). A dropping stale policy discards, at take time, a group for which this
  fails.
- Admission (a throttling stale policy): an engine holding version w is granted slot s only if
  s < (w + eta + 1) * G (`admission_limit`), so s // G <= w + eta: every granted slot is trainable
  with the weights that sample it, for any number of generators at any relative speeds.
- Divergence control (train.staleness_control=divergence) grants under a lower bound b
  (min_staleness <= b <= eta, moved by the learner): s < (w + b + 1) * G. The contract itself stays
  eta: `trainable`, the drop and fill_early judge by eta, so a slot granted under a higher bound
  stays trainable when b falls, and no granted group is ever made untrainable by the control.
  The push period is at most min_staleness + 1 for the reason below.
- Fixed staleness (train.fixed_staleness = k, max_staleness = k): also only slots with
  s // G >= w + k (`admission_floor`), so weights w fill step w + k and nothing else; the starting
  weights (version first_step: the run's, or a resumed checkpoint's) fill steps
  first_step .. first_step + k, and weights older than those nothing. For any other version the
  floor is one step below the limit: weights w >= first_step always have a step they may fill.
- The learner waits for a live engine only while it lags more than `engine_lag_bound` versions:
  never less than eta + 1, the lag at which the engine stops being granted slots. Before training
  at version u it waits for every live engine to hold at least `ack_floor` (u minus that bound).
- Engines only ever hold pushed versions (multiples of weights.push_every_steps), so the push
  period is at most eta + 1, or the admission and the lag bound would wait for a version that is
  never pushed (`check_push_settings`).

A granted slot travels as a `Ticket` (learner rank 0's dispatcher to a generator).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# train.stale_policy: throttle = the admission bound; drop = the queue drops, at take time, a group
# that is not trainable; both.
STALE_POLICIES = ("throttle", "drop", "both")
THROTTLING_STALE_POLICIES = ("throttle", "both")
DROPPING_STALE_POLICIES = ("drop", "both")

# A sampled version, or a tensor or an array of them (`staleness` works elementwise and returns
# the same kind: int - Versions is a Versions).
Versions = TypeVar("Versions")

# A validation's check: require(ok, key, why, value) raises the caller's error, naming the key,
# when `ok` is false (config.validate raises ConfigError, the simulator SimulationError).
Require = Callable[[bool, str, str, Any], None]


@dataclass(frozen=True)
class Ticket:
    """A granted slot, and the prompt to generate for it."""

    slot: int  # place in the training order: trained at learner version slot // groups_per_step
    position: int  # the prompt's position in the run's prompt stream


def step_of(slot: int, groups_per_step: int) -> int:
    """The learner step (the version it trains at) that trains `slot`."""
    return slot // groups_per_step


def first_slot(step: int, groups_per_step: int) -> int:
    """The first of the slots learner step `step` trains (the next groups_per_step - 1 follow it)."""
    return step * groups_per_step


def staleness(sampled_version: Versions, step: int) -> Versions:
    """How many versions older than learner step `step` the weights `sampled_version` are (also
    elementwise, for a tensor or an array of sampled versions: the result is of its kind)."""
    return step - sampled_version


def trainable(sampled_version: int, step: int, max_staleness: int) -> bool:
    """Whether a group sampled on `sampled_version` may be trained at learner step `step`."""
    return staleness(sampled_version, step) <= max_staleness


def admission_limit(loaded_version: int, max_staleness: int, groups_per_step: int) -> int:
    """Under a throttling stale policy, only slots below this are granted to an engine holding
    `loaded_version`: the first slot of the first step it could not train within max_staleness."""
    return first_slot(loaded_version + max_staleness + 1, groups_per_step)


def check_admission_bound(bound: int, max_staleness: int, fixed_staleness: bool) -> int:
    """`bound`, for divergence control's admission (0 .. max_staleness; max_staleness itself under
    fixed staleness, whose bound does not move); else ValueError."""
    if not 0 <= bound <= max_staleness or (fixed_staleness and bound != max_staleness):
        raise ValueError(f"admission bound {bound} outside 0 .. max_staleness={max_staleness}"
                         + (" (fixed staleness: only max_staleness)" if fixed_staleness else ""))
    return bound


def admission_floor(loaded_version: int, max_staleness: int, groups_per_step: int, first_step: int) -> float:
    """Under fixed staleness, no slot below this is granted to an engine holding `loaded_version`:
    the first slot of step loaded_version + max_staleness; for the starting weights
    (`first_step`'s) every slot from the start; for weights older than those none (infinity)."""
    if loaded_version == first_step:
        return 0
    if loaded_version < first_step:
        return math.inf
    return first_slot(loaded_version + max_staleness, groups_per_step)


def published_at_take(taken_step: int, fixed_staleness: int) -> int:
    """Under fixed staleness k >= 1, the version published once step `taken_step`'s groups are taken
    (before they train): taken_step + 1 - k, the one that fills the next step. The learner holds and
    sends it (learner/publication.py) only if it made it in this run, i.e. newer than the start."""
    return taken_step + 1 - fixed_staleness


def engine_lag_bound(max_staleness: int, max_backlog_versions: int) -> int:
    """How many versions a live generator's engine may lag the learner before the learner waits
    for it (weights.max_backlog_versions): never less than max_staleness + 1, the lag at which the
    engine stops being granted slots, so that the wait never binds an engine the bound still serves."""
    return max(max_backlog_versions, max_staleness + 1)


def ack_floor(version: int, lag_bound: int) -> int:
    """The oldest weights every live engine must have loaded (acknowledged) before the learner
    trains at `version`: `lag_bound` (`engine_lag_bound`) versions back; 0 or less waits for nobody."""
    return version - lag_bound


def even_split(num_generators: int, groups_per_step: int) -> list[int]:
    """A step's groups spread over the generators as evenly as possible, in generator order."""
    return [groups_per_step // num_generators + (1 if i < groups_per_step % num_generators else 0)
            for i in range(num_generators)]


def call_sizes(groups_per_call: int, num_generators: int, groups_per_step: int) -> list[int]:
    """Each generator's groups per vLLM call (the tickets it asks for at once):
    rollout.groups_per_call, or when that is 0 its even share of a step (`even_split`)."""
    return [groups_per_call or share for share in even_split(num_generators, groups_per_step)]


def one_of(choices: tuple[str, ...]) -> str:
    """How a choice rule says what it allows, in config.validate and here alike."""
    return f"must be one of {', '.join(choices)}"


def check_max_staleness(require: Require, max_staleness: int) -> None:
    """Refuse a negative train.max_staleness, through the caller's `require`."""
    require(max_staleness >= 0, "train.max_staleness", "must be >= 0", max_staleness)


def check_stale_policy(require: Require, stale_policy: str) -> None:
    """Refuse an unknown train.stale_policy, through the caller's `require`."""
    require(stale_policy in STALE_POLICIES, "train.stale_policy", one_of(STALE_POLICIES), stale_policy)


def check_push_settings(require: Require, push_every_steps: int, max_backlog_versions: int,
                        max_staleness: int) -> None:
    """Refuse a push period or a backlog bound (weights.*) the rules above cannot serve with
    `max_staleness`, through the caller's `require`."""
    require(push_every_steps >= 1, "weights.push_every_steps", "must be >= 1", push_every_steps)
    require(max_backlog_versions >= 1, "weights.max_backlog_versions", "must be >= 1", max_backlog_versions)
    # Generators only ever hold pushed versions (multiples of k): with k > max_staleness + 1 the
    # throttle and the acknowledgement bound would wait for a version that is never pushed.
    require(push_every_steps <= max_staleness + 1, "weights.push_every_steps",
            f"must be <= train.max_staleness + 1 = {max_staleness + 1}", push_every_steps)


def check_fixed_staleness(require: Require, fixed_staleness: int, stale_policy: str, push_every_steps: int,
                          inflight_updates: bool) -> None:
    """Refuse what would break fixed staleness's argument (every group of step u >= k sampled by
    version u - k exactly), through the caller's `require`; -1 is off."""
    require(fixed_staleness >= -1, "train.fixed_staleness", "must be -1 (off) or >= 0", fixed_staleness)
    if fixed_staleness < 0:
        return
    why = f"with train.fixed_staleness={fixed_staleness}"
    require(stale_policy in THROTTLING_STALE_POLICIES, "train.stale_policy",
            f"must throttle ({', '.join(THROTTLING_STALE_POLICIES)}) {why}: without it a generator runs ahead of the "
            "weights it holds and the staleness is whatever the drop leaves", stale_policy)
    # The published version would lag by up to push_every_steps - 1 more than k.
    require(push_every_steps == 1, "weights.push_every_steps", f"must be 1 {why}", push_every_steps)
    # Weights loaded mid-generation would make a completion's later tokens fresher than k.
    require(not inflight_updates, "rollout.inflight_updates", f"must be false {why}", inflight_updates)
