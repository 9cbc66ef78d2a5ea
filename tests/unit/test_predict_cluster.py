"""tools/predict_cluster.py: the anatomy fit reaches its target split on a synthetic calibration,
the steady-state window subtracts the start exactly, and the predictions keep the bounds a
pipeline must (never faster than the learner alone, staleness within the bound)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_simulate import NO_MEASUREMENT, fake_run
from tools import predict_cluster as pc

from asyncgrpo.sim.calibration import Calibration, GeneratorTimes
from asyncgrpo.sim.model import simulate
from asyncgrpo.sim.settings import Settings, SimulationError


def synthetic_calibration() -> Calibration:
    """One generator whose call of its 16 groups takes 0.06 s, with small fixed costs per call
    and group; learner steps of varying length, a little untimed learner work per step."""
    settings = Settings(num_generators=1, groups_per_step=16, samples_per_prompt=8, max_staleness=2,
                        stale_policy="both", groups_per_call=0, world_size=1, capacity_groups=64,
                        push_every_steps=1, steps=6)
    times = GeneratorTimes(generate_s=0.06, call_groups=16, score_s_per_group=1e-4, score_wait_s=2e-5,
                           send_s_per_group=1e-4, weight_load_s=2e-3, other_s=1e-3, first_call_extra_s=0.01)
    return Calibration(run_dir="synthetic", settings=settings, generators=[times],
                       train_s=[0.2, 0.05, 0.06, 0.055, 0.07, 0.045], push_s=[0.005, 0.006, 0.004],
                       learner_other_s=1e-3, measured=NO_MEASUREMENT)


def small_base(cal: Calibration, exponent: float = 1.0, generators: int = 4, eta: int = 0) -> Settings:
    return pc.cluster_settings(cal, generators, eta, groups_per_step=32, steps=40, exponent=exponent,
                               generate_cv=0.3, seed=0)


@pytest.mark.parametrize("exponent", [1.0, 0.5])
@pytest.mark.parametrize("anatomy", [pc.Anatomy(reference_generators=4),
                                     pc.Anatomy(reference_generators=4, generation_frac=0.5, push_frac=0.1,
                                                weight_load_frac=0.02, step_s=30.0)])
def test_the_fit_gives_the_synchronous_step_its_anatomy_within_one_percent(anatomy, exponent):
    cal = synthetic_calibration()
    fitted, split = pc.fit_anatomy(cal, anatomy, small_base(cal, exponent), skip=5)
    # The split the fit reports is what a fresh simulation with its knobs gives.
    again = pc.split_of(pc.steady(cal, fitted, skip=5))
    assert again == split
    fractions = split.fractions()
    assert fractions["generation"] == pytest.approx(anatomy.generation_frac, rel=0.01)
    assert fractions["push"] == pytest.approx(anatomy.push_frac, rel=0.01)
    assert fractions["train"] + fractions["learner_other"] == pytest.approx(anatomy.learner_frac, rel=0.01)
    assert split.step_s == pytest.approx(anatomy.step_s, rel=0.01)
    assert fitted.push_latency_s == pytest.approx(anatomy.push_frac * anatomy.step_s)
    assert fitted.weight_load_s == pytest.approx(anatomy.weight_load_frac * anatomy.step_s)


def test_an_anatomy_without_room_for_training_is_refused():
    cal = synthetic_calibration()
    with pytest.raises(SimulationError, match="positive part of the step"):
        pc.fit_anatomy(cal, pc.Anatomy(generation_frac=0.9, push_frac=0.1), small_base(cal), skip=5)


def test_the_steady_window_is_the_long_simulation_minus_the_short_one():
    cal = synthetic_calibration()
    s = replace(small_base(cal, eta=2), generate_scale=50.0, train_scale=20.0)
    window = pc.steady(cal, s, skip=10)
    whole, head = simulate(cal, s), simulate(cal, replace(s, steps=10))
    assert window.steps == 30
    assert window.seconds == pytest.approx(whole.sim_time_s - head.sim_time_s)
    assert window.samples_per_s == pytest.approx(30 * s.samples_per_step / window.seconds)
    assert window.learner_seconds["train"] == pytest.approx(whole.learner_seconds["train"]
                                                            - head.learner_seconds["train"])
    assert 0 <= window.learner_idle_frac <= 1 and 0 <= window.generator_idle_frac <= 1
    assert window.staleness_max <= 2


def test_predictions_never_beat_the_learner_alone_and_keep_the_bound():
    cal = replace(synthetic_calibration(), train_s=[0.06])  # steps of one length: the bound is exact
    anatomy = pc.Anatomy(reference_generators=4)
    _, split, rows = pc.predict(cal, anatomy, generators=[4, 8, 16], etas=[0, 1, 4], exponent=1.0,
                                groups_per_step=32, steps=30, skip=6, fit_steps=60, generate_cv=0.3, seed=0)
    learner_only = split.train_s + split.push_s + split.other_s  # a step can never be shorter
    for row in rows:
        assert row.step_s >= learner_only * (1 - 1e-9)
        assert row.staleness_max <= row.max_staleness
        if row.max_staleness == 0:
            assert row.vs_sync_same_n == 1.0 and row.staleness_mean == 0.0
    by_key = {(r.generators, r.max_staleness): r for r in rows}
    # At the reference size the synchronous row is the anatomy's step but for the window's sampling.
    assert by_key[4, 0].vs_sync_reference == pytest.approx(1.0, abs=0.1)
    # Staleness lets generation overlap training: faster than synchronous at every size.
    assert all(by_key[n, 4].vs_sync_same_n > 1.05 for n in (4, 8, 16))
    table = pc.format_table(rows, 4)
    assert table.splitlines()[0].startswith("| generators | max_staleness | s per step | vs sync, same N | vs sync at 4")
    assert len(table.splitlines()) == 2 + len(rows)


def test_the_command_prints_the_fit_tables_and_a_last_json_line(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert pc.main([str(run), "--generators", "2,4", "--etas", "0,1", "--exponents", "1.0",
                    "--reference-generators", "2", "--groups-per-step", "8", "--steps", "12", "--skip", "3",
                    "--fit-steps", "30", "--step-s", "50"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith(f"calibrated from {run}")
    assert any("synchronous step at 2 generators" in line for line in out)
    payload = json.loads(out[-1])
    assert payload["anatomy"]["generation_frac"] == 0.77
    assert abs(payload["fits"]["1"]["split"]["generation"] - 0.77) < 0.0077
    assert [(r["generators"], r["max_staleness"]) for r in payload["rows"]] == [(2, 0), (2, 1), (4, 0), (4, 1)]


def test_a_bad_run_directory_is_one_line_and_exit_2(tmp_path, capsys):
    assert pc.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such directory" in err


@pytest.mark.parametrize(("argv", "says"), [
    (["--reference-generators", "0"], "argument --reference-generators: wants an integer >= 1, got '0'"),
    (["--groups-per-step", "0"], "argument --groups-per-step: wants an integer >= 1, got '0'"),
    *((["--step-s", bad], f"argument --step-s: wants a finite number > 0, got '{bad}'") for bad in ("nan", "inf")),
    *((["--weight-load-frac", bad], f"argument --weight-load-frac: wants a finite number, got '{bad}'")
      for bad in ("nan", "inf")),
    (["--generators", "2,x"], "--generators: wants an integer >= 1, got 'x'"),
    (["--generators", "0"], "--generators: wants an integer >= 1, got '0'"),
    (["--etas", "1,1"], "--etas: 1 given twice"),
])
def test_arguments_that_would_divide_by_zero_or_pass_as_nan_exit_2_naming_the_option(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pc.main([str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err.strip().splitlines()[-1]


@pytest.mark.parametrize("anatomy", [pc.Anatomy(step_s=float("inf")), pc.Anatomy(step_s=float("nan")),
                                     pc.Anatomy(weight_load_frac=float("nan")), pc.Anatomy(reference_generators=0)])
def test_an_anatomy_with_a_nan_an_infinity_or_no_generator_is_refused(anatomy):
    with pytest.raises(SimulationError):
        anatomy.check()
