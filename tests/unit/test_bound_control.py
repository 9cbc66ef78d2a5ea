"""The divergence-gated admission bound (asyncgrpo/queue/bound_control.py): scripted divergence traces
(constant, rising, falling, noisy) drive it to the bound that holds the target without oscillating,
and whatever the trace the bound stays in [min_staleness, max_staleness] and moves by one at most
every HOLD_STEPS steps."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.queue.bound_control import (
    DEADBAND,
    HOLD_STEPS,
    PROBE_STEPS,
    BoundController,
    divergence_of,
    fit_rate,
    target_of,
)

TARGET = 1.0


def measured(rate: float, bound: int, noise: float = 0.0, rng: random.Random | None = None) -> list[tuple[float, float, float]]:
    """One step's buckets when the divergence at age a is rate * a^2: ages 0 .. bound, 100 tokens each."""
    factor = 1.0 + (noise * rng.gauss(0, 1) if rng else 0.0)
    return [(float(age), 100.0, max(0.0, rate * age ** 2 * factor)) for age in range(bound + 1)]


def run(rates: list[float], min_staleness: int = 0, max_staleness: int = 8, noise: float = 0.0,
        seed: int = 0) -> list[int]:
    controller = BoundController(min_staleness, max_staleness, TARGET)
    rng = random.Random(seed)
    bounds = []
    for rate in rates:
        bounds.append(controller.observe(measured(rate, controller.bound, noise, rng)))
    return bounds


def direction_changes(bounds: list[int]) -> int:
    moves = [b - a for a, b in zip(bounds, bounds[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


def holds(rate: float, bound: int, max_staleness: int = 8) -> bool:
    """The bound holds the target, and the next one up would not clear it by the dead band."""
    return rate * bound ** 2 <= TARGET and (bound == max_staleness or rate * (bound + 1) ** 2 > (1 - DEADBAND) * TARGET)


def test_a_constant_drift_settles_at_the_largest_bound_that_holds_the_target_without_turning_back():
    bounds = run([0.05] * 60)
    assert bounds[-1] == 4 == math.floor(math.sqrt(TARGET / 0.05))
    assert holds(0.05, bounds[-1])
    assert direction_changes(bounds) == 0  # up from min_staleness and stop


def test_it_starts_at_min_staleness_and_climbs_one_step_per_hold_while_unmeasured():
    bounds = run([0.0] * 30, min_staleness=1, max_staleness=4)
    assert bounds[0] == 1
    assert bounds[HOLD_STEPS - 2] == 1 and bounds[HOLD_STEPS - 1] == 2
    assert bounds[-1] == 4


def test_a_rising_drift_lowers_the_bound_to_what_still_holds_and_never_raises_it_again():
    rates = [0.01] * 60 + [0.01 + 0.99 * i / 100 for i in range(100)] + [1.0] * 40
    bounds = run(rates)
    assert bounds[59] == 8  # 0.01 a^2: every bound up to max holds
    assert bounds[-1] == 1 and holds(1.0, 1)
    assert direction_changes(bounds) == 1  # up once at the start, then only down


def test_a_falling_drift_raises_the_bound_to_max_staleness_though_bound_0_measures_nothing():
    rates = [2.0] * 40 + [2.0 - 1.99 * i / 100 for i in range(100)] + [0.01] * 60
    bounds = run(rates, min_staleness=0)
    assert bounds[20] == 0
    assert max(bounds[:100]) <= 1  # at 2.0 per version only probes of one version, every PROBE_STEPS
    assert bounds[-1] == 8
    # Each probe is one up and one down: at most two direction changes per PROBE_STEPS steps.
    assert direction_changes(bounds) <= 2 * len(rates) // PROBE_STEPS


@pytest.mark.parametrize("seed", range(5))
def test_noisy_measurements_at_a_constant_drift_hold_the_target_with_few_direction_changes(seed):
    # 30% multiplicative noise per step, near the edge between bounds 2 and 3 (3 holds up to 0.111,
    # and 2 goes up at 0.1).
    bounds = run([0.095] * 400, noise=0.3, seed=seed)
    settled = bounds[100:]
    assert sum(1 for b in settled if b == 3) >= 0.8 * len(settled), settled
    assert all(2 <= b <= 4 for b in settled)  # one version off at most, when the noise persists
    assert direction_changes(bounds) <= 8


def test_without_the_hold_and_dead_band_the_same_noise_would_flap():
    # The premise of the test above: the noise is large enough that the per-step choice alone flips.
    rng = random.Random(0)
    wishes = [math.floor(math.sqrt(TARGET / max(1e-9, 0.095 * (1 + 0.3 * rng.gauss(0, 1))))) for _ in range(400)]
    assert direction_changes(wishes) > 50


@settings(max_examples=200, deadline=None)
@given(min_staleness=st.integers(0, 4), extra=st.integers(0, 6), target=st.floats(0, 5),
       trace=st.lists(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 1000), st.floats(0, 50)), max_size=6),
                      max_size=120))
def test_whatever_the_measurements_the_bound_stays_in_range_and_moves_by_one_at_most_every_hold(
        min_staleness, extra, target, trace):
    controller = BoundController(min_staleness, min_staleness + extra, target)
    bounds = [controller.bound]
    for buckets in trace:
        bounds.append(controller.observe(buckets))
    assert all(min_staleness <= b <= min_staleness + extra for b in bounds)
    moves = [i for i in range(1, len(bounds)) if bounds[i] != bounds[i - 1]]
    assert all(abs(bounds[i] - bounds[i - 1]) == 1 for i in moves)
    assert all(b - a >= HOLD_STEPS for a, b in zip(moves, moves[1:]))


def test_the_rate_is_the_token_weighted_quadratic_fit_through_the_origin_and_age_zero_alone_says_nothing():
    assert fit_rate([(0.0, 50.0, 0.3)]) is None
    assert fit_rate([(1.0, 100.0, 0.2), (2.0, 100.0, 0.8)]) == pytest.approx(0.2)
    # sum n a^2 d / sum n a^4 = (300*1*0.1 + 100*4*1.0) / (300 + 1600)
    assert fit_rate([(1.0, 300.0, 0.1), (2.0, 100.0, 1.0)]) == pytest.approx(430 / 1900)


def test_the_ess_target_is_held_as_minus_log_ess():
    assert target_of("ess", 0.5) == pytest.approx(math.log(2))
    assert divergence_of("ess", k3=9.0, ess=0.25) == pytest.approx(math.log(4))
    assert divergence_of("kl", k3=0.3, ess=0.25) == 0.3 and target_of("kl", 0.02) == 0.02


def test_a_checkpointed_controller_continues_where_it_was():
    controller = BoundController(0, 8, TARGET)
    for _ in range(20):
        controller.observe(measured(0.05, controller.bound))
    resumed = BoundController(0, 8, TARGET)
    resumed.load_state_dict(controller.state_dict())
    assert (resumed.bound, resumed.rate) == (controller.bound, controller.rate)
    narrower = BoundController(0, 2, TARGET)
    narrower.load_state_dict(controller.state_dict())
    assert narrower.bound == 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_staleness=3, max_staleness=2"):
        BoundController(3, 2, 0.1)
