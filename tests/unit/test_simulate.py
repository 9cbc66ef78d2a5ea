"""`asyncgrpo simulate` (asyncgrpo/sim/): the event model against hand-computed answers with
constant times, the staleness bound over random settings, calibration from a fabricated run
directory, and the command's one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from one_line import raises_one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgrpo.cli import main
from asyncgrpo.contract import STALE_POLICIES
from asyncgrpo.sim.calibration import Calibration, GeneratorTimes, Measured
from asyncgrpo.sim.model import simulate
from asyncgrpo.sim.settings import Settings, SimulationError, apply_overrides

NO_MEASUREMENT = Measured(samples_per_s=0.0, steady_samples_per_s=0.0, learner_idle_frac=0.0, generator_idle_frac=0.0,
                          staleness_mean=0.0, staleness_histogram={})


def constant_run(*, generate_s: float = 1.0, score_s: float = 0.0, train_s: float | list[float] = 2.0,
                 push_s: float = 0.0, weight_load_s: float = 0.0, groups_per_step: int = 4, max_staleness: int = 0,
                 steps: int = 20, warmup_steps: int = 0, num_generators: int = 1,
                 capacity_groups: int | None = None) -> tuple[Calibration, Settings]:
    """A calibration of one generator whose call of one step's groups takes `generate_s` and
    scoring `score_s`, and a learner whose step trains `train_s` and pushes `push_s`; no other cost."""
    settings = Settings(num_generators=num_generators, groups_per_step=groups_per_step, samples_per_prompt=2,
                        max_staleness=max_staleness, stale_policy="both", groups_per_call=0, world_size=1,
                        capacity_groups=capacity_groups or (max_staleness + 1) * groups_per_step,
                        push_every_steps=1, steps=steps, warmup_steps=warmup_steps)
    times = GeneratorTimes(generate_s=generate_s, call_groups=groups_per_step, score_s_per_group=score_s / groups_per_step,
                           score_wait_s=0.0, send_s_per_group=0.0, weight_load_s=weight_load_s, other_s=0.0)
    train = train_s if isinstance(train_s, list) else [train_s]
    calibration = Calibration(run_dir="constant", settings=settings, generators=[times], train_s=train,
                              push_s=[push_s], learner_other_s=0.0, measured=NO_MEASUREMENT)
    return calibration, settings


# ------------------------------------------------------------------ hand-checkable answers


def test_synchronous_one_generator_runs_at_samples_per_step_over_generate_score_train_push():
    cal, s = constant_run(generate_s=1.0, score_s=0.25, train_s=2.0, push_s=0.5, max_staleness=0)
    result = simulate(cal, s)
    cycle = 1.0 + 0.25 + 2.0 + 0.5
    assert result.samples_per_s == pytest.approx(s.samples_per_step / cycle)
    assert result.sim_time_s == pytest.approx(s.steps * cycle)
    # The learner waits for every step's generation, the generator for every train + push.
    assert result.learner_idle_frac == pytest.approx(1.25 / cycle)
    assert result.generator_idle_fracs == [pytest.approx(2.5 / cycle)]
    assert result.staleness_histogram == {0: s.steps * s.groups_per_step}


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_with_staleness_and_generation_faster_than_training_the_learner_waits_only_for_the_first_step(max_staleness):
    # generate + score + weight load (1.35 s) < train + push (2.5 s)
    cal, s = constant_run(generate_s=1.0, score_s=0.25, train_s=2.0, push_s=0.5, weight_load_s=0.1,
                          max_staleness=max_staleness, steps=30, warmup_steps=1)
    result = simulate(cal, s)
    assert result.learner_seconds["gen_wait"] == pytest.approx(1.25)  # the first call only
    assert result.learner_seconds.get("ack_wait", 0.0) == 0.0
    assert result.steady_samples_per_s == pytest.approx(s.samples_per_step / 2.5)
    assert result.staleness_max <= max_staleness


def test_staleness_is_max_staleness_once_the_generator_runs_ahead_of_a_slow_learner():
    cal, s = constant_run(generate_s=0.1, train_s=1.0, max_staleness=2, steps=10)
    result = simulate(cal, s)
    # Steps 1..3 train what versions 0, 0, 0 generated (staleness 0, 1, 2); from then on the
    # generator waits at the throttle and every group is exactly 2 versions old.
    assert result.staleness_histogram == {0: 4, 1: 4, 2: 32}


def test_n_generators_scale_generation_until_the_learner_saturates():
    # One generator: 8 s for a step's 16 groups; n generators each make 16/n groups in 8/n s.
    def samples_per_s(n: int) -> float:
        cal, s = constant_run(generate_s=8.0, train_s=1.0, groups_per_step=16, max_staleness=1, steps=100,
                              num_generators=n)
        return simulate(cal, s).samples_per_s

    spp = 16 * 2
    for n in (1, 2, 4, 16):
        assert samples_per_s(n) == pytest.approx(spp / max(8.0 / n, 1.0), rel=0.03), n


def test_learner_ranks_divide_training_time_at_the_given_efficiency():
    cal, s = constant_run(generate_s=0.01, train_s=4.0, max_staleness=1, steps=200, warmup_steps=1)
    one = simulate(cal, s).steady_samples_per_s
    four = simulate(cal, replace(s, world_size=4, scaling_efficiency=0.5)).steady_samples_per_s
    assert one == pytest.approx(s.samples_per_step / 4.0)
    assert four == pytest.approx(2 * one)


def test_a_reward_wait_still_running_at_the_end_counts_as_idle_only_up_to_the_end():
    # Three generators, each call followed by 1 s waiting for its rewards. Generator 0 (a quarter
    # speed) calls its 2 groups for 0.5 s and sends them at 1.5 s, which ends the only step; the
    # other two (half speed) call 1 group for 0.125 s, send it at 1.125 s, call another until
    # 1.25 s and have waited 0.25 s of its 1 s at the end. Idle 1.0 and 1.25 of 1.5 s.
    cal, s = constant_run(generate_s=0.0625 * 4, train_s=0.0, groups_per_step=4, steps=1, num_generators=3,
                          capacity_groups=8)
    cal.generators[0] = replace(cal.generators[0], call_groups=1, generate_s=0.0625, score_wait_s=1.0)
    s = replace(s, stale_policy="drop", generator_speeds="0.25,0.5,0.5")
    result = simulate(cal, s)
    assert result.sim_time_s == pytest.approx(1.5)
    assert result.generator_idle_fracs == pytest.approx([1.0 / 1.5, 1.25 / 1.5, 1.25 / 1.5])


def test_warmup_steps_replay_the_runs_first_times_then_draw_from_the_rest():
    cal, s = constant_run(generate_s=1.0, train_s=[5.0, 1.0, 1.0], max_staleness=0, steps=3, warmup_steps=1)
    result = simulate(cal, s)
    assert result.sim_time_s == pytest.approx((1 + 5) + (1 + 1) + (1 + 1))
    assert result.steady_samples_per_s == pytest.approx(2 * s.samples_per_step / 4.0)


def test_replay_follows_the_runs_step_times_in_order_and_draws_beyond_them():
    cal, s = constant_run(generate_s=1.0, train_s=[5.0, 1.0, 3.0], max_staleness=0, steps=3, warmup_steps=1)
    assert simulate(cal, s).sim_time_s == pytest.approx((1 + 5) + (1 + 1) + (1 + 3))
    drawn = replace(s, replay=False, steps=3)
    times = {simulate(cal, replace(drawn, seed=seed)).sim_time_s for seed in range(20)}
    # The warm-up step is the run's; the other two are drawn from the run's later steps (1 or 3 s).
    assert times <= {6 + 2 + 2, 6 + 2 + 4, 6 + 4 + 4} and len(times) > 1


def test_push_latency_override_replaces_the_measured_push_time():
    cal, s = constant_run(generate_s=1.0, train_s=2.0, push_s=0.5, max_staleness=0)
    result = simulate(cal, replace(s, push_latency_s=3.0))
    assert result.samples_per_s == pytest.approx(s.samples_per_step / (1.0 + 2.0 + 3.0))


def test_a_seed_makes_a_noisy_simulation_repeatable():
    cal, s = constant_run(generate_s=1.0, train_s=[2.0, 1.0, 3.0], max_staleness=1, steps=40)
    noisy = replace(s, generate_cv=0.5, seed=7)
    assert simulate(cal, noisy) == simulate(cal, noisy)
    assert simulate(cal, noisy).sim_time_s != simulate(cal, replace(noisy, seed=8)).sim_time_s


# ------------------------------------------------------------------ the bound, any settings


def test_tickets_give_a_half_speed_generator_half_the_work_at_the_sum_of_their_speeds():
    # 16 groups a step, 0.5 s a group at speed 1, one group per call; a fast learner (0.1 s a step).
    # Each asks when free: 2 + 1 = 3 groups/s, the sum of their speeds alone.
    cal, s = constant_run(generate_s=8.0, train_s=0.1, groups_per_step=16, max_staleness=2, steps=60,
                          num_generators=2, warmup_steps=2)
    uneven = simulate(cal, replace(s, groups_per_call=1, generator_speeds="1,0.5"))
    assert uneven.steady_samples_per_s / 2 == pytest.approx(3.0, rel=0.05)
    assert uneven.staleness_max <= 2


def test_generator_speeds_slow_each_call_by_its_factor_and_bad_values_are_one_line():
    cal, s = constant_run(generate_s=2.0, train_s=0.5, max_staleness=0, steps=10)
    half = simulate(cal, replace(s, generator_speeds="0.5"))
    assert half.samples_per_s == pytest.approx(s.samples_per_step / (4.0 + 0.5))
    for bad, match in [("1,x", "comma-separated numbers"), ("1,1", "must give 1 finite speeds > 0"),
                       ("0", "must give 1 finite speeds > 0"), ("nan", "must give 1 finite speeds > 0"),
                       ("inf", "must give 1 finite speeds > 0")]:
        with raises_one_line(SimulationError, match=match):
            apply_overrides(s, [f"sim.generator_speeds={bad}"])

@pytest.mark.parametrize("k", [1, 2, 4])
def test_fixed_staleness_overlaps_generation_with_training_and_trains_every_step_past_the_warm_up_k_stale(k):
    # One generator: 1 s to generate a step, 2 s to train it. The version that fills step v + 1 is
    # published at step v's take, so step v + 1 is generated while step v trains: 2 s a step.
    cal, s = constant_run(generate_s=1.0, train_s=2.0, steps=30, warmup_steps=k + 1)
    fixed = apply_overrides(s, [f"train.fixed_staleness={k}", f"queue.capacity_groups={(k + 1) * s.groups_per_step}"])
    assert fixed.max_staleness == k  # as the config sets it
    result = simulate(cal, fixed)
    g = s.groups_per_step
    assert result.staleness_histogram == {**{u: g for u in range(k)}, k: (s.steps - k) * g}
    assert result.steady_samples_per_s == pytest.approx(s.samples_per_step / 2.0)


def test_fixed_staleness_zero_alternates_generation_and_training_as_synchronous_grpo():
    cal, s = constant_run(generate_s=1.0, train_s=2.0, steps=20)
    result = simulate(cal, apply_overrides(s, ["train.fixed_staleness=0"]))
    assert result.samples_per_s == pytest.approx(s.samples_per_step / 3.0)
    assert result.staleness_histogram == {0: s.steps * s.groups_per_step}


@pytest.mark.parametrize("overrides, match", [
    (["train.fixed_staleness=2", "train.max_staleness=1"], "train.max_staleness must be train.fixed_staleness=2"),
    (["train.fixed_staleness=2", "train.stale_policy=drop"], "train.stale_policy must throttle"),
    (["train.fixed_staleness=1", "rollout.inflight_updates=true"], "rollout.inflight_updates must be false"),
    (["train.fixed_staleness=-2"], "train.fixed_staleness must be -1"),
])
def test_fixed_staleness_refuses_in_one_line_what_the_config_refuses(overrides, match):
    _, s = constant_run()
    with raises_one_line(SimulationError, match=match):
        apply_overrides(s, overrides)


@pytest.mark.parametrize("key", ["rollout.dispatch=tickets", "rollout.generator_shares=10,6", "queue.full_policy=block"])
def test_the_removed_dispatch_keys_are_unknown_overrides(key):
    _, s = constant_run()
    with pytest.raises(SimulationError, match=r"unknown key"):
        apply_overrides(s, [key])


@st.composite
def random_run(draw: st.DrawFn) -> tuple[Calibration, Settings]:
    num_generators = draw(st.integers(1, 5))
    groups_per_step = draw(st.integers(num_generators, 12))
    max_staleness = draw(st.integers(0, 4))
    stale_policy = draw(st.sampled_from(STALE_POLICIES))
    push_every_steps = draw(st.integers(1, max_staleness + 1))
    settings = Settings(
        num_generators=num_generators, groups_per_step=groups_per_step, samples_per_prompt=2,
        max_staleness=max_staleness, stale_policy=stale_policy, groups_per_call=draw(st.integers(0, 6)),
        world_size=draw(st.integers(1, 4)), capacity_groups=groups_per_step + draw(st.integers(0, 24)),
        push_every_steps=push_every_steps, max_backlog_versions=draw(st.integers(1, 6)),
        steps=draw(st.integers(1, 25)),
        seed=draw(st.integers(0, 3)), warmup_steps=draw(st.integers(0, 2)), replay=draw(st.booleans()),
        scaling_efficiency=draw(st.floats(0.3, 1.0)), generate_cv=draw(st.floats(0.0, 1.0)),
        generator_speeds=",".join(str(draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))) for _ in range(num_generators)))
    seconds = st.floats(0.0, 2.0)
    generators = [GeneratorTimes(generate_s=draw(st.floats(0.01, 3.0)), call_groups=draw(st.integers(1, 8)),
                                 score_s_per_group=draw(seconds) / 8, score_wait_s=draw(seconds),
                                 send_s_per_group=draw(seconds) / 8, weight_load_s=draw(seconds),
                                 other_s=draw(seconds), first_call_extra_s=draw(seconds))
                  for _ in range(draw(st.integers(1, 3)))]
    calibration = Calibration(run_dir="random", settings=settings, generators=generators,
                              train_s=draw(st.lists(seconds, min_size=1, max_size=4)),
                              push_s=draw(st.lists(seconds, min_size=0, max_size=3)), learner_other_s=draw(seconds),
                              measured=NO_MEASUREMENT)
    return calibration, settings


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_run())
def test_no_simulated_group_is_ever_trained_beyond_max_staleness(run):
    calibration, s = run
    result = simulate(calibration, s)
    assert result.staleness_max <= s.max_staleness
    assert sum(result.staleness_histogram.values()) == s.steps * s.groups_per_step
    assert 0.0 <= result.learner_idle_frac <= 1.0 + 1e-9
    assert all(0.0 <= f <= 1.0 + 1e-9 for f in result.generator_idle_fracs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_run(), st.integers(0, 4))
def test_under_fixed_staleness_any_simulated_run_finishes_with_every_step_past_the_warm_up_exactly_k_stale(run, k):
    calibration, s = run
    s = replace(s, stale_policy="both", push_every_steps=1, max_staleness=k, fixed_staleness=k,
                capacity_groups=max(s.capacity_groups, s.groups_per_step))
    s.check()
    result = simulate(calibration, s)  # no deadlock: every step is trained
    warm_up = min(k, s.steps)
    g = s.groups_per_step
    assert result.staleness_histogram == {**{u: g for u in range(warm_up)},
                                          **({k: (s.steps - k) * g} if s.steps > k else {})}


def test_importing_the_simulator_loads_neither_torch_nor_zmq():
    code = ("import sys, asyncgrpo.sim.report, asyncgrpo.sim.events; "
            "print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ calibration from a run dir


CONFIG = """\
rollout: {num_generators: 2, samples_per_prompt: 4, groups_per_call: 0}
train: {groups_per_step: 6, max_staleness: 1, stale_policy: both}
learner: {world_size: 1}
queue: {capacity_groups: 12}
weights: {push_every_steps: 1}
"""


def fake_run(tmp_path: Path, first_gen_wait_s: float = 0.5) -> Path:
    """Three steps and two generators, with numbers whose derived values are easy to check."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(CONFIG)
    phases = {"gen_wait": [first_gen_wait_s, 0.1, 0.0], "prepare": [0.1, 0.05, 0.05], "train": [1.0, 0.45, 0.55],
              "push": [0.2, 0.1, 0.3]}
    lines = [json.dumps({"step": 0, "eval/accuracy": 0.1})]
    for i in range(3):
        record = {"step": i + 1, "perf/samples": 24, "time/ack_wait_s": 0.0,
                  **{f"time/{k}_s": v[i] for k, v in phases.items()}}
        record["time/step_s"] = sum(v[i] for v in phases.values())  # 1.8, 0.7, 0.9 by default
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "time/tr')  # a torn last line
    generator = {"gen/groups_sent": 10, "gen_time/generate_s": 2.0, "gen_time/score_s": 1.0,
                 "gen_time/score_wait_s": 0.4, "gen_time/send_s": 0.6, "gen/send_blocked_s": 0.1,
                 "gen/weight_load_s": 0.3, "gen/weight_loads": 3, "gen_time/weights_s": 0.1,
                 "gen_time/throttle_s": 1.0, "gen_time/exhausted_s": 0.0, "gen/wall_s": 5.5, "gen/idle_frac": 0.2}
    summary = {"status": "finished", "train_s": 3.6, "samples_per_s": 20.0,
               "learner": {"idle_frac": 0.17, "staleness_histogram": {"0": 6, "1": 12}},
               "generators": [generator, {**generator, "gen/groups_sent": 9, "gen/idle_frac": 0.4}]}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_calibration_derives_per_call_and_per_step_times_from_a_run_directory(tmp_path):
    cal = Calibration.from_run(fake_run(tmp_path))
    assert cal.settings.num_generators == 2 and cal.settings.groups_per_step == 6 and cal.settings.steps == 3
    assert cal.train_s == pytest.approx([1.1, 0.5, 0.6])  # prepare + train
    assert cal.push_s == pytest.approx([0.2, 0.1, 0.3])
    assert cal.learner_other_s == pytest.approx((3.6 - 3.4) / 3)  # the driver's clock minus the timed phases
    first, second = cal.generators
    # Half a step (3 groups) per call; 10 groups sent = 4 calls (the last one cut short).
    assert first.call_groups == 3
    assert first.generate_s == pytest.approx(2.0 / 4)
    assert first.score_s_per_group == pytest.approx(1.0 / 10)
    assert first.score_wait_s == pytest.approx(0.4 / 4)
    assert first.send_s_per_group == pytest.approx((0.6 - 0.1) / 10)
    assert first.weight_load_s == pytest.approx(0.1)
    assert first.other_s == pytest.approx((5.5 - (0.1 + 2.0 + 1.0 + 0.4 + 1.0 + 0.6)) / 4)
    assert first.first_call_extra_s == 0.0  # the first step's wait (0.5 s) shows no engine warm-up
    assert second.generate_s == pytest.approx(2.0 / 3)  # 9 groups = 3 calls
    m = cal.measured
    assert (m.samples_per_s, m.learner_idle_frac) == (20.0, 0.17)
    assert m.generator_idle_frac == pytest.approx(0.3)
    assert m.staleness_mean == pytest.approx(12 / 18)
    assert m.steady_samples_per_s == pytest.approx(48 / 1.6)  # steps after the first


def edit_config(run: Path, old: str, new: str) -> None:
    config = (run / "config.yaml").read_text()
    assert old in config
    (run / "config.yaml").write_text(config.replace(old, new))


# A run's config.yaml as written before the shares dispatch was removed: every one had
# queue.full_policy, and rollout.dispatch once there was a choice (shares when absent).
@pytest.mark.parametrize("rollout, queue, recorded", [
    ("groups_per_call: 0}", "capacity_groups: 12}", "tickets"),  # written since: neither key
    ("groups_per_call: 0, dispatch: tickets}", "capacity_groups: 12, full_policy: block}", "tickets"),
    ("groups_per_call: 0, dispatch: shares}", "capacity_groups: 12, full_policy: block}", "shares"),
    ("groups_per_call: 0}", "capacity_groups: 12, full_policy: block}", "shares"),  # before rollout.dispatch
])
def test_a_runs_recorded_dispatch_is_read_from_its_config_with_or_without_the_removed_keys(tmp_path, rollout, queue,
                                                                                          recorded):
    run = fake_run(tmp_path)
    edit_config(run, "groups_per_call: 0}", rollout)
    edit_config(run, "capacity_groups: 12}", queue)
    assert Calibration.from_run(run).recorded_dispatch == recorded


def test_a_shares_run_calibrates_a_tickets_simulation_and_the_report_says_so(tmp_path, capsys):
    run = fake_run(tmp_path)
    tickets = Calibration.from_run(run)
    edit_config(run, "groups_per_call: 0}", "groups_per_call: 0, dispatch: shares}")
    shares = Calibration.from_run(run)
    # Per-call and per-step times do not depend on the dispatch: the same calibration.
    assert replace(shares, recorded_dispatch="tickets") == tickets
    assert main(["simulate", str(run)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith("note: the run was recorded under the removed shares dispatch")
    assert json.loads(lines[-1])["recorded_dispatch"] == "shares"


def test_a_shares_run_with_hand_set_shares_is_refused_in_one_line(tmp_path, capsys):
    run = fake_run(tmp_path)
    edit_config(run, "groups_per_call: 0}", "groups_per_call: 0, dispatch: shares, generator_shares: [4, 2]}")
    assert main(["simulate", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "generator_shares=[4, 2], which sized each generator's calls" in err


def test_a_run_with_an_unknown_dispatch_is_refused_in_one_line(tmp_path):
    run = fake_run(tmp_path)
    edit_config(run, "groups_per_call: 0}", "groups_per_call: 0, dispatch: lottery}")
    with raises_one_line(SimulationError, match=r"rollout.dispatch must be tickets or shares \(got 'lottery'\)"):
        Calibration.from_run(run)


def test_a_runs_max_backlog_versions_is_simulated_and_older_runs_have_the_default(tmp_path):
    run = fake_run(tmp_path)
    assert Calibration.from_run(run).settings.max_backlog_versions == 4
    config = (run / "config.yaml").read_text().replace("{push_every_steps: 1}",
                                                        "{push_every_steps: 1, max_backlog_versions: 6}")
    (run / "config.yaml").write_text(config)
    settings = Calibration.from_run(run).settings
    assert settings.max_backlog_versions == 6
    with pytest.raises(SimulationError, match="weights.max_backlog_versions must be >= 1"):
        apply_overrides(settings, ["weights.max_backlog_versions=0"])


def test_a_runs_fixed_staleness_is_simulated_and_older_runs_have_it_off(tmp_path):
    run = fake_run(tmp_path)
    assert Calibration.from_run(run).settings.fixed_staleness == -1
    edit_config(run, "max_staleness: 1, stale_policy: both}", "max_staleness: 1, stale_policy: both, fixed_staleness: 1}")
    assert Calibration.from_run(run).settings.fixed_staleness == 1


def test_a_generators_waits_for_its_ticket_requests_answers_are_not_calibrated_as_busy_time(tmp_path):
    # gen_time/ask_s: a ticket request's round trip to learner rank 0, waited for (idle in the run).
    run = fake_run(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    summary["generators"][0] = {**summary["generators"][0], "gen_time/ask_s": 0.4, "gen/wall_s": 5.9}
    (run / "summary.json").write_text(json.dumps(summary))
    first = Calibration.from_run(run).generators[0]
    assert first.other_s == pytest.approx((5.5 - (0.1 + 2.0 + 1.0 + 0.4 + 1.0 + 0.6)) / 4)


def test_an_engine_warm_up_seen_in_the_first_steps_wait_is_taken_out_of_the_mean_call(tmp_path):
    # Generator 0: 2.0 s of generation over 4 calls = a 1.1 s warm-up + 4 x 0.225 s. A call's other
    # costs: 3 groups x (0.1 score + 0.05 send) + 0.1 reward wait + 0.1 untimed = 0.65 s, so the
    # learner's first step waited 1.1 + 0.225 + 0.65 s for the first call.
    first = Calibration.from_run(fake_run(tmp_path, first_gen_wait_s=1.1 + 0.225 + 0.65)).generators[0]
    assert first.generate_s == pytest.approx(0.225)
    assert first.first_call_extra_s == pytest.approx(1.1)


def test_a_first_call_warm_up_delays_only_the_first_step():
    cal, s = constant_run(generate_s=1.0, train_s=2.0, max_staleness=0, steps=10)
    cal = replace(cal, generators=[replace(cal.generators[0], first_call_extra_s=3.0)])
    assert simulate(cal, s).sim_time_s == pytest.approx(3.0 + 10 * (1.0 + 2.0))


def test_overrides_change_settings_and_unknown_keys_fail_with_the_known_ones(tmp_path):
    base = Calibration.from_run(fake_run(tmp_path)).settings
    changed = apply_overrides(base, ["rollout.num_generators=3", "sim.push_latency_s=0.5", "sim.weight_load_s=null",
                                     "sim.replay=false"])
    assert (changed.num_generators, changed.push_latency_s, changed.weight_load_s, changed.replay) == (3, 0.5, None,
                                                                                                     False)
    with pytest.raises(SimulationError, match=r"unknown key 'rollout.temperature'; known: rollout.num_generators"):
        apply_overrides(base, ["rollout.temperature=2"])
    with pytest.raises(SimulationError, match=r"train.max_staleness='two' is not a int"):
        apply_overrides(base, ["train.max_staleness=two"])
    with pytest.raises(SimulationError, match=r"sim.replay='maybe' is not a bool"):
        apply_overrides(base, ["sim.replay=maybe"])
    with pytest.raises(SimulationError, match=r"queue.capacity_groups must hold at least one step"):
        apply_overrides(base, ["queue.capacity_groups=5"])


def test_the_command_prints_a_table_and_a_last_json_line(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert main(["simulate", str(run), "rollout.num_generators=3", "sim.steps=50"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("changed: rollout.num_generators 2 -> 3, sim.steps 3 -> 50")
    payload = json.loads(lines[-1])
    assert {"samples_per_s", "learner_idle_frac", "staleness_mean", "generator_idle_frac",
            "staleness_histogram"} <= payload.keys()
    assert payload["steps"] == 50 and payload["staleness_max"] <= 1


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "missing", "no such directory"),
    (lambda tmp: tmp, "config.yaml not found"),
    (lambda tmp: (fake_run(tmp) / "summary.json").unlink() or tmp / "run", "summary.json not found"),
])
def test_a_bad_run_directory_is_one_line_and_exit_2(tmp_path, capsys, make, expected):
    assert main(["simulate", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and err.startswith("asyncgrpo: simulate: ")


def test_an_unknown_override_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["simulate", str(fake_run(tmp_path)), "sim.nope=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown key 'sim.nope'" in err
