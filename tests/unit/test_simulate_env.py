"""The simulator's environment waits (asyncgrpo/sim/envwaits.py, Model.env_answers): the rounds a
call of episodes waits, a synchronous step paying them against an asynchronous run hiding them,
calibration from a run with an environment, and runs without one left as they were."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from one_line import raises_one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_simulate import constant_run, edit_config, fake_run, random_run
from test_simulate_tracking import run_both

from asyncgrpo.sim.calibration import Calibration
from asyncgrpo.sim.envwaits import continuation, expected_rounds
from asyncgrpo.sim.model import simulate
from asyncgrpo.sim.settings import SimulationError, apply_overrides

# ------------------------------------------------------------------ rounds of calls


@pytest.mark.parametrize("mean, max_calls", [(1.117, 3), (2.5, 7), (1.9, 2), (3.0, 8)])
def test_the_fitted_continuation_gives_back_the_runs_mean_calls_per_episode(mean, max_calls):
    q, r = continuation(mean, max_calls)
    assert q * sum(r ** j for j in range(max_calls)) == pytest.approx(mean, rel=1e-6)


def test_rounds_are_none_without_calls_one_with_exactly_one_call_and_the_cap_when_every_episode_calls_to_it():
    assert expected_rounds(0.0, 3, 128) == 0.0
    assert expected_rounds(1.0, 3, 128) == pytest.approx(1.0)
    assert expected_rounds(3.0, 3, 5) == pytest.approx(3.0)
    assert expected_rounds(0.25, 3, 1) == pytest.approx(0.25)  # one episode: a call a quarter of the time


def test_a_call_of_more_episodes_waits_for_more_rounds_up_to_the_cap():
    # The calculator preset's mean (1.117 step calls per episode, env.max_turns 3): one group of 8
    # episodes waits about 1.7 rounds, a step of 128 about 2.8.
    rounds = [expected_rounds(1.117, 3, n) for n in (1, 8, 128, 10_000)]
    assert rounds == sorted(rounds)
    assert rounds[0] == pytest.approx(1.117)
    assert rounds[1] == pytest.approx(1.68, abs=0.01) and rounds[2] == pytest.approx(2.76, abs=0.01)
    assert rounds[3] == pytest.approx(3.0)


# ------------------------------------------------------------------ the model


def env_run(latency_s: float, max_staleness: int, calls_per_episode: float = 1.0, overhead_s: float = 0.0,
            **kwargs):
    """constant_run whose episodes call an environment `calls_per_episode` times (env.max_turns 3)."""
    cal, s = constant_run(max_staleness=max_staleness, **kwargs)
    times = replace(cal.generators[0], env_calls_per_episode=calls_per_episode, env_overhead_s=overhead_s)
    cal = replace(cal, generators=[times], env_max_calls=3)
    return cal, replace(s, env_latency_s=latency_s)


def test_a_synchronous_step_pays_its_calls_latency_on_top_of_generate_score_train_push():
    cal, s = env_run(0.5, max_staleness=0, overhead_s=0.1, generate_s=1.0, score_s=0.25, train_s=2.0, push_s=0.5)
    # One call per episode: one round of 0.5 s latency + 0.1 s overhead per step.
    assert simulate(cal, s).sim_time_s == pytest.approx(s.steps * (1.0 + 0.25 + 2.0 + 0.5 + 0.6))
    assert simulate(cal, replace(s, env_latency_s=0.0)).sim_time_s == pytest.approx(s.steps * (3.75 + 0.1))


def test_a_synchronous_generator_waiting_on_its_environment_is_not_idle():
    cal, s = env_run(0.5, max_staleness=0, generate_s=1.0, train_s=2.0)
    result = simulate(cal, s)
    # Idle = waits for tickets (train time, 2 s a step); the environment's 0.5 s is not idle.
    assert result.generator_idle_fracs == [pytest.approx(2.0 / 3.5)]


@pytest.mark.parametrize("latency_s", [0.5, 1.5])
def test_an_asynchronous_run_with_room_in_the_bound_hides_the_latency_behind_the_next_calls(latency_s):
    # Training (2 s) is the bottleneck; generating a step takes 1 s and the bound lets the
    # generator run 2 steps ahead: a wait up to about a step's training is hidden.
    base = dict(generate_s=1.0, train_s=2.0, steps=30, warmup_steps=3)
    hidden = simulate(*env_run(latency_s, max_staleness=2, **base))
    none = simulate(*env_run(0.0, max_staleness=2, **base))
    assert hidden.steady_samples_per_s == pytest.approx(none.steady_samples_per_s)
    synchronous = simulate(*env_run(latency_s, max_staleness=0, **base))
    assert synchronous.steady_samples_per_s < none.steady_samples_per_s / (1 + latency_s / 3.0) * 1.001


def test_an_asynchronous_run_without_room_pays_what_the_bound_cannot_hide():
    # max_staleness 1, a 4 s wait: a step's groups are granted once the step before last is
    # trained, so each step waits for generate + the wait, not just for training.
    base = dict(generate_s=1.0, train_s=2.0, steps=30, warmup_steps=3)
    slow = simulate(*env_run(4.0, max_staleness=1, **base))
    assert slow.steady_samples_per_s < simulate(*env_run(0.0, max_staleness=1, **base)).steady_samples_per_s * 0.9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_run(), st.floats(0.0, 2.0), st.floats(0.0, 3.0), st.integers(1, 5))
def test_with_environment_waits_the_bound_holds_and_tracking_changes_gives_the_same_run(run, latency_s, calls,
                                                                                      max_calls):
    calibration, s = run
    calibration = replace(calibration, env_max_calls=max_calls,
                          generators=[replace(g, env_calls_per_episode=calls) for g in calibration.generators])
    s = replace(s, env_latency_s=latency_s)
    result = simulate(calibration, s)
    assert result.staleness_max <= s.max_staleness
    assert sum(result.staleness_histogram.values()) == s.steps * s.groups_per_step
    tracked, untracked = run_both(calibration, s)
    assert tracked == untracked


# ------------------------------------------------------------------ calibration


def env_fake_run(tmp_path, latency_s: float = 0.05):
    """fake_run (2 generators, calls of 3 groups of 4 episodes) with the calculator: 2 step calls
    per episode on top of each reset, and 0.8 s of environment waits over its 4 calls."""
    run = fake_run(tmp_path)
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config + f"env: {{name: calculator, max_turns: 3, latency_s: {latency_s}}}\n")
    summary = json.loads((run / "summary.json").read_text())
    for generator in summary["generators"]:
        episodes = generator["gen/groups_sent"] * 4
        # The waits are part of the generator's wall time, as in a real run.
        generator.update({"gen/env_calls": 3 * episodes, "gen_time/env_wait_s": 0.8,
                          "gen/wall_s": generator["gen/wall_s"] + 0.8})
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_calibration_reads_calls_per_episode_latency_and_overhead_and_takes_the_waits_out_of_other_time(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "env").mkdir()
    plain = Calibration.from_run(fake_run(tmp_path / "plain"))
    cal = Calibration.from_run(env_fake_run(tmp_path / "env"))
    assert cal.env_max_calls == 3 and cal.settings.env_latency_s == 0.05
    first = cal.generators[0]
    assert first.env_calls_per_episode == pytest.approx(2.0)
    rounds = expected_rounds(2.0, 3, 3 * 4)
    assert first.env_overhead_s == pytest.approx(0.8 / 4 / rounds - 0.05)
    assert first.other_s == pytest.approx(plain.generators[0].other_s)  # the 0.8 s are waits, not other time
    assert apply_overrides(cal.settings, ["env.latency_s=0.2"]).env_latency_s == 0.2


def test_a_run_that_hid_its_waits_calibrates_no_negative_overhead(tmp_path):
    cal = Calibration.from_run(env_fake_run(tmp_path, latency_s=1.0))  # 0.2 s per call < rounds x 1 s
    assert cal.generators[0].env_overhead_s == 0.0


def test_a_run_without_an_environment_calibrates_and_simulates_as_before(tmp_path):
    run = fake_run(tmp_path)
    plain = Calibration.from_run(run)
    assert plain.env_max_calls == 0 and plain.settings.env_latency_s == 0.0
    assert all(g.env_calls_per_episode == 0.0 and g.env_overhead_s == 0.0 for g in plain.generators)
    # An env section without an environment (env.name "", as every config since it exists) changes nothing.
    edit_config(run, "weights: {push_every_steps: 1}\n", "weights: {push_every_steps: 1}\n"
                                                         "env: {name: '', max_turns: 4, latency_s: 0.0}\n")
    assert Calibration.from_run(run) == replace(plain, run_dir=str(run))
    assert simulate(Calibration.from_run(run), plain.settings) == simulate(plain, plain.settings)


def test_a_negative_latency_is_one_line(tmp_path):
    cal = Calibration.from_run(fake_run(tmp_path))
    with pytest.raises(SimulationError, match=r"^env.latency_s must be >= 0 and finite \(got -0.1\)$"):
        apply_overrides(cal.settings, ["env.latency_s=-0.1"])


@pytest.mark.parametrize(("override", "said"), [
    ("env.latency_s=inf", "env.latency_s must be >= 0 and finite"),
    ("sim.generate_scale=inf", "sim.generate_scale must be > 0 and finite"),
    ("sim.push_latency_s=inf", "sim.push_latency_s must be >= 0 and finite"),
    ("sim.steps=10000000000", "sim.steps must be between 1 and 200000"),
])
def test_an_infinite_time_or_an_endless_simulation_is_one_line_not_a_stuck_or_endless_run(tmp_path, override, said):
    cal = Calibration.from_run(fake_run(tmp_path))
    with raises_one_line(SimulationError, match=said):
        apply_overrides(cal.settings, [override])


@pytest.mark.parametrize(("file", "text", "said"), [
    ("summary.json", "[1, 2]", "does not read as this version writes it (AttributeError"),
    ("summary.json", b"\xff\xfe", "does not read as this version writes it (UnicodeDecodeError"),
    ("metrics.jsonl", "5\n[1]\n\xff\n", "metrics.jsonl has no learner step records"),  # skipped, as plot skips them
])
def test_a_malformed_run_file_is_one_simulation_error_not_a_traceback(tmp_path, file, text, said):
    run = fake_run(tmp_path)
    target = run / file
    target.write_bytes(text) if isinstance(text, bytes) else target.write_text(text)
    with pytest.raises(SimulationError) as err:
        Calibration.from_run(run)
    assert said in str(err.value) and "\n" not in str(err.value)
