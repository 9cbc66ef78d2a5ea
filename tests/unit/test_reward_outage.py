"""Reward outages end the run: the error rate over a window of learner steps (rewards/errors.py),
the registry's decision from the generators' heartbeats, the learner's waits hearing it, and the
driver turning it into a one-line failure."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.driver import TrainingFailed
from asyncgrpo.learner.intake import wait_for_generators
from asyncgrpo.queue.registry import (
    GeneratorRegistry,
    RewardOutage,
    RunStopped,
    WeightsRejected,
)
from asyncgrpo.rewards.errors import ErrorRate, RewardErrorWindow, outage_reason
from asyncgrpo.schema import RewardConfig
from asyncgrpo.wire import Heartbeat

steps = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)).map(lambda ec: (min(ec), max(ec))), max_size=60)


# ----------------------------------------------------------------------------- the window's arithmetic


@settings(max_examples=200, deadline=None)
@given(closed=steps, pending=st.tuples(st.integers(0, 50), st.integers(0, 50)).map(lambda ec: (min(ec), max(ec))),
       window_steps=st.integers(1, 25), max_rate=st.floats(0.0, 1.0))
def test_the_rate_is_the_last_window_steps_plus_the_step_in_progress(closed, pending, window_steps, max_rate):
    window = RewardErrorWindow(max_rate, window_steps)
    for errors, calls in closed:
        window.close_step(errors, calls)
    rate = window.current(*pending)
    kept = closed[-window_steps:] if closed else []
    errors, calls = sum(e for e, _ in kept) + pending[0], sum(c for _, c in kept) + pending[1]
    assert (rate.errors, rate.calls, rate.steps) == (errors, calls, len(kept))
    assert rate.rate == (errors / calls if calls else 0.0)
    assert window.exceeded(rate) == (calls > 0 and errors / calls > max_rate)


@settings(max_examples=100, deadline=None)
@given(closed=steps, window_steps=st.integers(1, 25))
def test_a_limit_of_one_never_stops_and_no_calls_is_no_evidence(closed, window_steps):
    window = RewardErrorWindow(1.0, window_steps)
    for errors, calls in closed:
        window.close_step(errors, calls)
    assert not window.exceeded(window.current())
    assert not RewardErrorWindow(0.0, window_steps).exceeded(ErrorRate(0, 0, 0))


def test_the_limit_itself_is_not_beyond_it():
    window = RewardErrorWindow(0.5, 20)
    assert not window.exceeded(ErrorRate(10, 20, 1))
    assert window.exceeded(ErrorRate(11, 20, 1))
    assert not RewardErrorWindow(0.57, 20).exceeded(ErrorRate(57, 100, 1))  # no float rounding past the limit
    assert RewardErrorWindow(0.0, 20).exceeded(ErrorRate(1, 1000, 1))  # 0: any error stops the run


def test_a_step_slides_out_of_the_window():
    window = RewardErrorWindow(0.5, 3)
    window.close_step(100, 100)
    for _ in range(2):
        window.close_step(0, 100)
    assert window.current().rate == pytest.approx(1 / 3)
    window.close_step(0, 100)
    assert window.current() == ErrorRate(0, 300, 3)


def test_the_window_comes_from_the_config():
    window = RewardErrorWindow.from_config(RewardConfig(max_error_rate=0.25, error_window_steps=7))
    assert (window.max_rate, window.window_steps) == (0.25, 7)
    with pytest.raises(ValueError):
        RewardErrorWindow(1.5, 7)


def test_the_reason_names_the_rate_the_window_and_each_terms_first_error():
    window = RewardErrorWindow(0.5, 20)
    reason = outage_reason(ErrorRate(90, 100, 4), window,
                           {"judge": "JudgeError: judge http://j/v1/chat/completions failed 4 tries", "fn": "KeyError: 'x'"})
    assert "\n" not in reason
    assert reason.startswith("reward error rate 0.90 (90 of 100 reward calls failed over the last 4 learner step(s)")
    assert "reward.error_window_steps=20" in reason and "reward.max_error_rate=0.5" in reason
    assert reason.endswith("[fn] KeyError: 'x'; [judge] JudgeError: judge http://j/v1/chat/completions failed 4 tries")


# ----------------------------------------------------------------------------- the registry's decision


def beat(registry: GeneratorRegistry, generator_id: int, errors: int, calls: int,
         first_errors: dict[str, str] | None = None) -> None:
    """A heartbeat with generator `generator_id`'s cumulative reward counters."""
    registry.on_heartbeat(Heartbeat(generator_id, next_seq=0, version=0, reward_errors=errors, reward_calls=calls,
                                    reward_first_errors=first_errors or {}))


def test_an_outage_is_heard_before_any_step_completes():
    """Under drop_group every group is dropped: no step ends, yet the reports end the run."""
    registry = GeneratorRegistry(RewardErrorWindow(0.5, 20))
    registry.check_reports()
    beat(registry, 0, errors=64, calls=64, first_errors={"judge": "JudgeError: connection refused"})
    with pytest.raises(RewardOutage, match=r"rate 1\.00 \(64 of 64 .* \[judge\] JudgeError: connection refused"):
        registry.check_reports()


def test_errors_within_the_limit_train_on_and_are_logged_per_step():
    registry = GeneratorRegistry(RewardErrorWindow(0.5, 20))
    beat(registry, 0, errors=10, calls=64), beat(registry, 1, errors=22, calls=64)
    registry.check_reports()  # 32 of 128: at the limit, not beyond it
    increments = registry.report_increments()
    assert (increments["reward/errors"], increments["reward/calls"], increments["reward/error_rate"]) == (32, 128, 0.25)
    beat(registry, 0, errors=11, calls=128)
    registry.check_reports()


def test_errors_count_only_while_their_steps_are_in_the_window():
    registry = GeneratorRegistry(RewardErrorWindow(0.5, 2))
    rates = []

    def step(errors: int, calls: int) -> None:  # cumulative counters, then the step ends
        beat(registry, 0, errors, calls)
        registry.check_reports()
        rates.append(registry.report_increments()["reward/error_rate"])

    step(0, 64)
    step(60, 128)  # 60 of this step's 64 fail: 60 of 128 over the window
    beat(registry, 0, 100, 192)  # 40 of 64 more in the step in progress: 100 of 192
    with pytest.raises(RewardOutage, match=r"rate 0\.52 \(100 of 192 .* last 2 learner step"):
        registry.check_reports()
    rates.append(registry.report_increments()["reward/error_rate"])
    beat(registry, 0, 100, 256)
    with pytest.raises(RewardOutage):  # a clean step in progress, but the bad ones are still in the window
        registry.check_reports()
    rates.append(registry.report_increments()["reward/error_rate"])
    step(100, 320)  # the window has moved past the bad steps
    assert rates == pytest.approx([0.0, 60 / 128, 100 / 128, 40 / 128, 0.0])


def test_the_first_error_of_each_term_is_the_first_reported_by_any_generator():
    registry = GeneratorRegistry(RewardErrorWindow(0.0, 20))
    beat(registry, 1, errors=1, calls=8, first_errors={"judge": "first"})
    beat(registry, 0, errors=2, calls=8, first_errors={"judge": "second", "fn": "fn's first"})
    beat(registry, 1, errors=3, calls=16, first_errors={"judge": "first", "fn": "later"})
    assert registry.first_reward_errors == {"judge": "first", "fn": "fn's first"}
    with pytest.raises(RewardOutage, match=r"\[fn\] fn's first; \[judge\] first$"):
        registry.check_reports()


def test_without_a_window_reward_errors_never_end_the_run():
    registry = GeneratorRegistry()
    beat(registry, 0, errors=64, calls=64)
    registry.check_reports()
    assert "reward/error_rate" not in registry.report_increments()


def test_both_reasons_to_stop_are_run_stopped():
    assert issubclass(RewardOutage, RunStopped) and issubclass(WeightsRejected, RunStopped)


class DeepQueue:
    depth = 0


def test_the_learners_wait_for_generators_hears_an_outage():
    registry = GeneratorRegistry(RewardErrorWindow(0.5, 20))
    beat(registry, 0, errors=9, calls=10, first_errors={"task": "ValueError: bad"})
    with pytest.raises(RewardOutage, match=r"\[task\] ValueError: bad"):
        wait_for_generators(registry, DeepQueue(), range(1), version=1, lag_bound=0, groups_per_step=4,
                            timeout_s=5.0)


# ----------------------------------------------------------------------------- the driver


def test_the_driver_fails_the_run_with_just_the_ranks_reason(monkeypatch):
    """Ray raises a rank's exception as a subclass of RayTaskError and the exception's class; the
    run fails with the reason alone (summary.json's `error`), not the rank's traceback."""
    import ray
    from ray.exceptions import RayTaskError

    from asyncgrpo.driver.loop import get_rank_result

    reason = "reward error rate 1.00 (8 of 8 reward calls failed ...); first error of each failing term: [judge] x"
    wrapped = RayTaskError("LearnerActor.train_steps", "Traceback (most recent call last):\n  ...",
                           RewardOutage(reason)).as_instanceof_cause()

    def get(ref):
        raise wrapped

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(TrainingFailed) as failed:
        get_rank_result(object())
    assert str(failed.value) == reason and failed.value.__cause__ is None

    def other_error(ref):
        raise RayTaskError("LearnerActor.train_steps", "tb", RuntimeError("rank 1 died")).as_instanceof_cause()

    monkeypatch.setattr(ray, "get", other_error)
    with pytest.raises(RuntimeError) as raised:  # any other error is re-raised as before
        get_rank_result(object())
    assert not isinstance(raised.value, TrainingFailed) and str(raised.value.cause) == "rank 1 died"
