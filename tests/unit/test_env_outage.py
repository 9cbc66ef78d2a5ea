"""Environment outages end the run: the generators' heartbeats carry their environment calls, failures
and first failure (rollout/channel.py, the wire), and learner rank 0's registry keeps them in a
window of env.error_window_steps steps, logs env/calls, env/errors and env/error_rate, and stops the
run beyond env.max_error_rate with one line naming it and the first error."""

from __future__ import annotations

import pytest

from asyncgrpo.queue.registry import EnvOutage, GeneratorRegistry, RewardOutage, RunStopped
from asyncgrpo.rewards.errors import ErrorWindow
from asyncgrpo.rollout.channel import GroupChannel
from asyncgrpo.rollout.stats import GeneratorStats
from asyncgrpo.schema import EnvConfig
from asyncgrpo.wire import Heartbeat, decode, encode


def env_beat(registry: GeneratorRegistry, generator_id: int, errors: int, calls: int, first_error: str = "",
             incarnation: int = 0) -> None:
    """A heartbeat with generator `generator_id`'s cumulative environment counters."""
    registry.on_heartbeat(Heartbeat(generator_id, next_seq=0, version=0, env_calls=calls, env_errors=errors,
                                    env_first_error=first_error, incarnation=incarnation))


def env_registry(max_rate: float, window_steps: int = 20) -> GeneratorRegistry:
    return GeneratorRegistry(ErrorWindow(0.5, 20), ErrorWindow(max_rate, window_steps))


def test_the_run_stops_beyond_the_rate_not_at_it():
    registry = env_registry(0.5)
    env_beat(registry, 0, errors=10, calls=32), env_beat(registry, 1, errors=22, calls=32)
    registry.check_reports()  # 32 of 64: at the limit
    env_beat(registry, 1, errors=23, calls=32)
    with pytest.raises(EnvOutage, match=r"^environment error rate 0\.52 \(33 of 64 environment calls failed"):
        registry.check_reports()


def test_a_limit_of_one_never_stops_the_run():
    registry = env_registry(1.0)
    env_beat(registry, 0, errors=500, calls=500, first_error="EnvCallError: connection refused")
    registry.check_reports()
    assert registry.report_increments()["env/error_rate"] == 1.0
    registry.check_reports()


def test_the_reason_is_one_line_naming_the_key_the_window_and_the_first_error():
    registry = env_registry(0.25, window_steps=7)
    env_beat(registry, 1, errors=1, calls=8, first_error="EnvCallError: POST http://127.0.0.1:8100/step answered HTTP 500")
    env_beat(registry, 0, errors=8, calls=8, first_error="EnvCallError: a later first error of another generator")
    env_beat(registry, 1, errors=2, calls=16, first_error="EnvCallError: not the first")
    with pytest.raises(EnvOutage) as stopped:
        registry.check_reports()
    reason = str(stopped.value)
    assert "\n" not in reason and "env.max_error_rate=0.25" in reason and "env.error_window_steps=7" in reason
    assert reason.endswith("first error: EnvCallError: POST http://127.0.0.1:8100/step answered HTTP 500")
    assert isinstance(stopped.value, RunStopped) and not isinstance(stopped.value, RewardOutage)


def test_an_outage_is_heard_before_any_step_completes_and_slides_out_of_the_window():
    registry = env_registry(0.5, window_steps=2)
    rates = []

    def step(errors: int, calls: int) -> dict[str, float]:  # cumulative counters, then the step ends
        env_beat(registry, 0, errors, calls)
        registry.check_reports()
        increments = registry.report_increments()
        rates.append(increments["env/error_rate"])
        return increments

    assert step(0, 10) == pytest.approx({"time/gen_idle_s": 0.0, "reward/errors": 0, "reward/groups_dropped": 0,
                                         "reward/calls": 0, "reward/error_rate": 0.0, "env/calls": 10,
                                         "env/errors": 0, "env/error_rate": 0.0})
    step(8, 20)  # 8 of this step's 10 fail: 8 of 20 over the window
    env_beat(registry, 0, 18, 30)  # all 10 of the step in progress fail: no step has to end to hear it
    with pytest.raises(EnvOutage, match=r"rate 0\.60 \(18 of 30 .* last 2 learner step"):
        registry.check_reports()
    rates.append(registry.report_increments()["env/error_rate"])
    step(18, 60)  # 18 of 50 with the clean step in progress: within the limit
    step(18, 90)  # the failing steps have slid out of the window
    assert rates == pytest.approx([0.0, 8 / 20, 18 / 20, 10 / 40, 0.0])


def test_without_an_env_window_environment_errors_never_end_the_run():
    registry = GeneratorRegistry(ErrorWindow(0.5, 20))
    env_beat(registry, 0, errors=64, calls=64)
    registry.check_reports()
    increments = registry.report_increments()
    assert increments["env/errors"] == 64 and "env/error_rate" not in increments


def test_a_restarted_generators_counts_add_to_its_predecessors():
    registry = env_registry(1.0)
    env_beat(registry, 0, errors=3, calls=10)
    env_beat(registry, 0, errors=1, calls=4, incarnation=1)  # a new process counts from 0 again
    increments = registry.report_increments()
    assert (increments["env/errors"], increments["env/calls"]) == (4, 14)


def test_the_env_window_comes_from_env_config():
    window = ErrorWindow.from_config(EnvConfig(max_error_rate=0.3, error_window_steps=9))
    assert (window.max_rate, window.window_steps) == (0.3, 9)


def test_the_heartbeats_env_fields_round_trip_and_the_first_error_is_cut():
    beat = Heartbeat(1, next_seq=3, version=2, env_calls=40, env_errors=7, env_first_error="EnvCallError: down")
    assert decode(encode(beat)) == beat
    long = decode(encode(Heartbeat(0, next_seq=0, version=0, env_first_error="x" * 5000)))
    assert 0 < len(long.env_first_error) <= 300


class CapturingSink:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def try_send(self, message: object, timeout_s: float) -> bool:
        self.sent.append(message)
        return True


class QuietScorer:
    def stats_snapshot(self) -> dict[str, int]:
        return {"reward/errors": 0, "reward/groups_dropped": 0, "reward/calls": 0}

    def first_errors(self) -> dict[str, str]:
        return {}


class NoRejections:
    delta_mismatches = 0

    def rejections(self) -> tuple[int, str]:
        return 0, ""


def test_a_generators_heartbeat_carries_its_environment_counters():
    stats = GeneratorStats(env_calls=12, env_errors={"timeout": 2, "http": 3}, env_first_error="EnvCallError: slow")
    sink = CapturingSink()
    channel = GroupChannel(sink, generator_id=4, incarnation=1, stats=stats, scorer=QuietScorer(), wait_limit=None)
    channel.heartbeat(version=6, weights=NoRejections(), periodic=False)
    [beat] = sink.sent
    assert isinstance(beat, Heartbeat)
    assert (beat.env_calls, beat.env_errors, beat.env_first_error) == (12, 5, "EnvCallError: slow")
