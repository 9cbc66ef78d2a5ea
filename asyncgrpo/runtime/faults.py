"""Fault injection: named failpoints for the chaos suite (tools/chaos.py) and the fault tests.

Off unless the environment variable ASYNCGRPO_FAULTS holds a JSON object naming them, e.g.

    ASYNCGRPO_FAULTS='{"checkpoint_save_delay_s": 30}'

The driver forwards the variable to every actor (driver/prepare.py, ACTOR_ENV), so a failpoint set
for `asyncgrpo train` acts wherever its code runs. Unknown names are refused, so a misspelt fault
cannot make a chaos scenario pass by never happening. Code asks `faults.value(name)`: the
configured value, or None when the fault is off (the normal case, one dictionary lookup).

Failpoints are for what cannot be produced from outside the process at a chosen moment (a slow
disk, a frame lost between two live processes); faults that can be (SIGKILL, SIGTERM, a judge that
answers 500, a full disk on a small tmpfs) are injected for real by tools/chaos.py.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

ENV = "ASYNCGRPO_FAULTS"

# name -> what it does (where it acts)
KNOWN: dict[str, str] = {
    "checkpoint_save_delay_s": "every checkpoint save sleeps this long before writing (slow storage; learner)",
    "checkpoint_enospc": "a checkpoint save of this version or later fails with ENOSPC after its first file "
                         "(a full disk, where a small tmpfs cannot be mounted; learner)",
    "wire_drop_every": "the N-th, 2N-th, ... scored group is numbered but never sent (lost in transit; generator)",
    "wire_corrupt_every": "the N-th, 2N-th, ... scored group is sent with its header's first byte flipped "
                          "(the learner's decoder must reject it; generator)",
    "grant_drop_every": "the N-th, 2N-th, ... answer to a ticket request that carries tickets is never sent "
                        "(a Grant lost; learner rank 0)",
    "generator_slowdown": "{\"<generator id>\": f, ...}: after each vLLM call that generator sleeps f - 1 times "
                          "as long as the call took, so it runs f times slower (uneven generators where "
                          "cores cannot be shared out unevenly; tools/bench_dispatch.py; generator)",
    "generator_pace_s": "{\"<generator id>\": s, ...}: each vLLM call of that generator lasts at least s "
                        "seconds per group (it sleeps out the rest): a generator on its own device of that "
                        "speed, whose pace other processes' load does not change while the call's own work "
                        "fits in it (tools/bench_dispatch.py; generator)",
}


class FaultSpecError(ValueError):
    pass


@functools.cache
def _active(raw: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as err:
        raise FaultSpecError(f"{ENV} is not JSON ({err.msg} at {err.pos}): {raw[:80]!r}") from None
    if not isinstance(spec, dict):
        raise FaultSpecError(f"{ENV} must be a JSON object of failpoint names to values, got {raw[:80]!r}")
    unknown = sorted(set(spec) - set(KNOWN))
    if unknown:
        raise FaultSpecError(f"{ENV} names unknown failpoint(s) {unknown}; known: {sorted(KNOWN)}")
    return spec


def active() -> dict[str, Any]:
    """Every failpoint set in this process's environment, by name (empty normally)."""
    return dict(_active(os.environ.get(ENV, "")))


def value(name: str) -> Any:
    """The value failpoint `name` is set to, or None when it is off."""
    if name not in KNOWN:
        raise FaultSpecError(f"unknown failpoint {name!r}")
    return _active(os.environ.get(ENV, "")).get(name)


def every(name: str) -> int:
    """A count failpoint's N (`wire_drop_every`: every N-th group), or 0 when it is off. Anything
    but a positive integer is refused: a fault meant to fire must not silently never fire."""
    raw = value(name)
    if raw is None:
        return 0
    if type(raw) is not int or raw < 1:
        raise FaultSpecError(f"{ENV}: {name} must be a positive integer, got {raw!r}")
    return raw


def slowdown(generator_id: int) -> float:
    """Failpoint `generator_slowdown`'s factor for `generator_id` (1.0: not slowed). Anything but a
    map of generator ids to numbers >= 1 is refused."""
    return _per_generator("generator_slowdown", generator_id, off=1.0, least=1.0)


def pace_s(generator_id: int) -> float:
    """Failpoint `generator_pace_s`'s seconds per group for `generator_id` (0.0: not paced). Anything
    but a map of generator ids to numbers >= 0 is refused."""
    return _per_generator("generator_pace_s", generator_id, off=0.0, least=0.0)


def _per_generator(name: str, generator_id: int, off: float, least: float) -> float:
    raw = value(name)
    if raw is None:
        return off
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and k.isdigit() and type(v) in (int, float) and v >= least for k, v in raw.items()):
        raise FaultSpecError(f"{ENV}: {name} must map generator ids to numbers >= {least:g}, got {raw!r}")
    return float(raw.get(str(generator_id), off))
