"""The staleness contract (asyncgrpo/contract.py): the admission bounds keep every granted slot
trainable, fixed staleness pins each version to one step, the lag bound never binds an engine the
admission still serves, the settings checks refuse what config.load refuses, and the module needs
nothing beyond the standard library."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo import contract
from asyncgrpo.contract import (
    ack_floor,
    admission_floor,
    admission_limit,
    call_sizes,
    check_fixed_staleness,
    check_max_staleness,
    check_push_settings,
    check_stale_policy,
    engine_lag_bound,
    even_split,
    first_slot,
    staleness,
    step_of,
    trainable,
)

versions = st.integers(0, 50)
etas = st.integers(0, 8)
groups = st.integers(1, 16)


class Refused(ValueError):
    pass


def require(ok: bool, key: str, why: str, value: object) -> None:
    if not ok:
        raise Refused(f"{key} {why} (got {value!r})")


@given(versions, etas, groups)
def test_every_slot_the_admission_bound_grants_is_trainable_by_the_weights_that_sample_it(w, eta, g):
    limit = admission_limit(w, eta, g)
    # Slots of steps before w are taken already; the ones the learner can still train start at w.
    assert all(trainable(w, step_of(slot, g), eta) for slot in range(w * g, limit))
    assert not trainable(w, step_of(limit, g), eta)  # the bound is tight: the next slot would be too stale


@given(versions, etas, groups, versions)
def test_the_fixed_lower_bound_is_never_looser_than_the_upper_and_pins_one_step(w, k, g, first_step):
    floor, limit = admission_floor(w, k, g, first_step), admission_limit(w, k, g)
    if w < first_step:
        assert floor == float("inf")  # weights older than the run's start fill nothing
    elif w == first_step:
        assert floor == 0  # the starting weights fill every step up to first_step + k
    else:
        assert limit - floor == g  # exactly one step, w + k, sampled with staleness exactly k
        assert {step_of(slot, g) - w for slot in range(int(floor), limit)} == {k}


@given(etas, st.integers(1, 10), versions, st.integers(0, 20))
def test_the_learner_waits_for_no_engine_the_admission_still_serves(eta, backlog, learner_version, lag):
    bound = engine_lag_bound(eta, backlog)
    assert bound >= backlog
    engine = learner_version - lag
    waited_for = lag > bound
    still_granted = admission_limit(engine, eta, 1) > learner_version  # a slot of the step the learner waits on
    assert not (waited_for and still_granted)


@given(etas, st.integers(1, 10), versions, versions)
def test_the_ack_floor_waits_exactly_for_the_engines_beyond_the_lag_bound(eta, backlog, learner_version, engine):
    floor = ack_floor(learner_version, engine_lag_bound(eta, backlog))
    assert (engine < floor) == (learner_version - engine > engine_lag_bound(eta, backlog))
    if engine < floor:  # an engine waited for is one the admission no longer grants a slot of this step
        assert admission_limit(engine, eta, 1) <= learner_version


@given(versions, groups)
def test_a_step_trains_the_slots_from_its_first_slot_on_and_no_other(step, g):
    first = first_slot(step, g)
    assert [step_of(slot, g) for slot in range(first, first + g)] == [step] * g
    assert step_of(first - 1, g) == step - 1 and step_of(first + g, g) == step + 1


@given(versions, versions, etas)
def test_staleness_counts_versions_back_from_the_step_and_bounds_what_is_trainable(sampled, step, eta):
    assert staleness(sampled, step) == step - sampled and staleness(step, step) == 0
    assert trainable(sampled, step, eta) == (staleness(sampled, step) <= eta)


@given(st.integers(1, 20), st.integers(0, 40))
def test_a_steps_groups_are_split_evenly_in_order(num_generators, extra):
    total = num_generators + extra
    parts = even_split(num_generators, total)
    assert sum(parts) == total and len(parts) == num_generators
    assert parts == sorted(parts, reverse=True) and parts[0] - parts[-1] <= 1


@given(st.integers(0, 8), st.integers(1, 20), st.integers(0, 40))
def test_a_call_is_the_setting_or_else_the_generators_share_of_a_step(groups_per_call, num_generators, extra):
    total = num_generators + extra
    sizes = call_sizes(groups_per_call, num_generators, total)
    assert sizes == ([groups_per_call] * num_generators if groups_per_call else even_split(num_generators, total))


def test_a_call_size_for_one_generator():
    assert call_sizes(0, 1, 5) == [5]
    assert call_sizes(3, 1, 5) == [3]


def test_trainable_is_the_staleness_bound_and_nothing_else():
    assert trainable(3, 3, 0) and trainable(3, 5, 2)
    assert not trainable(3, 6, 2) and not trainable(3, 4, 0)


@pytest.mark.parametrize(("settings", "key"), [
    ((0, "both", 1, 4), None),
    ((2, "throttle", 3, 1), None),
    ((-1, "both", 1, 4), "train.max_staleness must be >= 0"),
    ((2, "never", 1, 4), "train.stale_policy must be one of throttle, drop, both"),
    ((2, "both", 0, 4), "weights.push_every_steps must be >= 1"),
    ((2, "both", 4, 4), "weights.push_every_steps must be <= train.max_staleness \\+ 1 = 3"),
    ((2, "both", 1, 0), "weights.max_backlog_versions must be >= 1"),
])
def test_the_settings_checks_and_config_load_refuse_the_same(settings, key):
    from asyncgrpo.config import load
    from asyncgrpo.schema import ConfigError

    max_staleness, policy, push_every, backlog = settings
    overrides = [f"train.max_staleness={max_staleness}", f"train.stale_policy={policy}",
                 f"weights.push_every_steps={push_every}", f"weights.max_backlog_versions={backlog}"]

    def check_all() -> None:
        check_max_staleness(require, max_staleness)
        check_stale_policy(require, policy)
        check_push_settings(require, push_every, backlog, max_staleness)

    if key is None:
        check_all()
        load(overrides)
        return
    with pytest.raises(Refused, match=key):
        check_all()
    with pytest.raises(ConfigError, match=key):
        load(overrides)


@pytest.mark.parametrize(("settings", "key"), [
    ((-1, "drop", 3, True), None),  # off: nothing else is asked
    ((2, "both", 1, False), None),
    ((-2, "both", 1, False), "train.fixed_staleness must be -1"),
    ((2, "drop", 1, False), "train.stale_policy must throttle"),
    ((2, "both", 2, False), "weights.push_every_steps must be 1"),
    ((2, "both", 1, True), "rollout.inflight_updates must be false"),
])
def test_fixed_staleness_refuses_what_would_break_exactness(settings, key):
    if key is None:
        check_fixed_staleness(require, *settings)
        return
    with pytest.raises(Refused, match=key):
        check_fixed_staleness(require, *settings)


def test_the_contract_imports_the_standard_library_only():
    tree = ast.parse(Path(contract.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    code = ("import sys, asyncgrpo.contract; "
            "print(sorted(m for m in ('torch', 'numpy', 'zmq', 'ray', 'msgpack', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
