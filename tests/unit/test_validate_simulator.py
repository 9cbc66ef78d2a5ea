"""tools/validate_simulator.py: the pure parts (one prediction beside a measurement, which run the
"same generators" column calibrates from, the worst ratio per column, the table); no training."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_simulate import constant_run
from tools import validate_simulator as vs

from asyncgrpo.sim.calibration import Measured
from asyncgrpo.sim.model import simulate


def measured(samples_per_s: float) -> Measured:
    return Measured(samples_per_s=samples_per_s, steady_samples_per_s=samples_per_s, learner_idle_frac=0.25,
                    generator_idle_frac=0.5, staleness_mean=1.5, staleness_histogram={1: 4, 2: 4})


def test_a_prediction_is_the_simulation_beside_the_run_as_a_ratio():
    cal, s = constant_run(generate_s=1.0, train_s=2.0, max_staleness=0)
    result = simulate(cal, s)  # 8 samples per 3 s step
    column = vs.prediction(measured(2.0), result, "runs/ref")
    assert column["calibrated_from"] == "runs/ref"
    assert column["samples_per_s"] == pytest.approx(8 / 3, abs=0.01)
    assert column["ratio"] == pytest.approx((8 / 3) / 2.0, abs=1e-4)
    assert column["learner_idle_frac"] == pytest.approx(1 / 3, abs=1e-4)
    assert column["staleness_mean"] == 0.0
    assert vs.prediction(measured(0.0), result, "x")["ratio"] is None  # nothing measured: no ratio


@pytest.mark.parametrize("available, key, reference_eta, expected", [
    ([(2, 0), (2, 1), (2, 2), (2, 4)], (2, 0), 2, (2, 2)),  # the reference's eta
    ([(2, 0), (2, 1), (2, 2), (2, 4)], (2, 2), 2, (2, 1)),  # the reference's eta itself: the nearest other
    ([(2, 1), (2, 2), (2, 3)], (2, 2), 2, (2, 1)),  # a tie: the lower
    ([(1, 0), (1, 2), (2, 0)], (2, 0), 2, None),  # 2 generators ran at no other eta
    ([(1, 0), (1, 4)], (1, 0), 2, (1, 4)),  # the reference's eta not run with this many: the nearest
])
def test_the_same_generators_column_calibrates_from_another_eta_with_as_many_generators(available, key,
                                                                                      reference_eta, expected):
    assert vs.same_generators_source(available, *key, reference_eta) == expected


def row(generators: int, eta: int, cross: float, same: float | None, own: float, source: bool = False) -> dict:
    cell = {"calibrated_from": "r", "samples_per_s": 100.0, "learner_idle_frac": 0.1, "generator_idle_frac": 0.2,
            "staleness_mean": 1.0}
    return {"generators": generators, "max_staleness": eta,
            "measured": {"samples_per_s": 100.0, "learner_idle_frac": 0.1, "generator_idle_frac": 0.2,
                         "staleness_mean": 1.0},
            "cross": {**cell, "ratio": cross, **({"is_source": True} if source else {})},
            "same_generators": {**cell, "ratio": same} if same is not None else None,
            "own": {**cell, "ratio": own}}


def test_the_worst_ratio_is_the_farthest_from_one_and_leaves_the_reference_out_of_cross():
    rows = [row(1, 0, 0.80, 1.05, 1.01), row(1, 2, 1.50, 0.99, 1.00, source=True), row(2, 0, 1.10, None, 0.97)]
    assert vs.worst(rows, "cross") == {"ratio": 0.80, "generators": 1, "max_staleness": 0, "runs": 2,
                                       "within_15pct": False}
    assert vs.worst(rows, "same_generators") == {"ratio": 1.05, "generators": 1, "max_staleness": 0, "runs": 2,
                                                 "within_15pct": True}
    assert vs.worst(rows, "own")["ratio"] == 0.97 and vs.worst(rows, "own")["runs"] == 3
    assert vs.worst([], "cross") is None


def test_the_table_has_a_row_per_run_and_marks_the_reference():
    table = vs.format_table([row(1, 0, 0.8, 1.05, 1.01), row(1, 2, 1.0, None, 1.0, source=True)]).splitlines()
    assert table[0].startswith("| generators | max_staleness | measured samples/s | predicted (cross) | ratio cross |")
    assert len(table) == 4
    assert "| 1 | 0 | 100.0 | 100.0 | 0.800 | 1.050 | 1.010 |" in table[2]
    assert "| 1.000* | - | 1.000 |" in table[3]


def test_phase_times_are_what_a_prediction_carries_over_and_print_as_a_table():
    cal, _ = constant_run(generate_s=1.5, train_s=[9.0, 2.0, 4.0, 3.0], push_s=0.5, warmup_steps=1)
    phases = vs.phase_times(cal)
    assert phases == {"call_s": 1.5, "call_groups": 4, "train_s": 3.0, "push_s": 0.5}  # the warm-up step left out
    table = vs.format_phases([{"generators": 1, "max_staleness": 0, "phases": phases}]).splitlines()
    assert table[2] == "| 1 | 0 | 1.5000 (4) | 3.0000 | 0.5000 |"


def test_rounds_combine_into_the_median_ratio_per_setting_with_its_spread_and_the_worst_is_judged_on_medians():
    rounds = [[row(1, 0, 0.80, 1.05, 1.01), row(1, 2, 1.0, None, 1.0, source=True)],
              [row(1, 0, 0.95, 1.00, 1.00), row(1, 2, 1.0, None, 1.0, source=True)],
              [row(1, 0, 0.90, 0.90, 0.99), row(1, 2, 1.0, None, 1.0, source=True)]]
    rounds[1][0]["measured"]["samples_per_s"] = 130.0
    combined = vs.combine(rounds)
    first, reference = combined
    assert (first["generators"], first["max_staleness"], first["rounds"]) == (1, 0, 3)
    assert first["cross"] == {"ratio": 0.90, "min": 0.80, "max": 0.95}
    assert first["same_generators"] == {"ratio": 1.00, "min": 0.90, "max": 1.05}
    assert first["measured"] == {"samples_per_s": 100.0, "min": 100.0, "max": 130.0}
    assert reference["cross"]["is_source"] and reference["same_generators"] is None
    # One round's 0.80 alone would fail the 15% bar; the median 0.90 does not.
    assert vs.worst(combined, "cross") == {"ratio": 0.90, "generators": 1, "max_staleness": 0, "runs": 1,
                                           "within_15pct": True}
    table = vs.format_combined(combined).splitlines()
    assert "| 1 | 0 | 3 | 100.0 [100.0-130.0] | 0.900 [0.800-0.950] | 1.000 [0.900-1.050] |" in table[2]
    assert "1.000 [1.000-1.000]* | - |" in table[3]


def test_auto_cores_are_the_predicted_runs_machine_cores_and_a_number_is_taken_as_given():
    cal, _ = constant_run()
    assert vs.target_cores(replace(cal, machine_cores=2), "auto") == 2
    assert vs.target_cores(cal, "auto") == 0  # its actors.json did not say
    assert vs.target_cores(replace(cal, machine_cores=2), "0") == 0
    assert vs.target_cores(cal, "3") == 3


# ------------------------------------------------------------------ --bench-env


def bench_run(kind: str, latency_ms: int, repeat: int) -> dict:
    return {"mode": f"{kind} {latency_ms} ms", "kind": kind, "latency_ms": latency_ms, "repeat": repeat,
            "run_dir": f"r{repeat}_{kind}_{latency_ms}_ms"}


def test_each_bench_env_run_is_predicted_from_its_kinds_reference_latency_run_of_the_same_repeat():
    runs = [bench_run(kind, ms, r) for r in (0, 1) for kind in ("sync", "async") for ms in (0, 200)]
    runs.append(bench_run("async", 50, 2))  # repeat 2 never ran at 0 ms: the lowest repeat's
    runs.append(bench_run("other", 50, 0))  # a kind never run at 0 ms: nothing to predict it from
    pairs = {run["run_dir"]: reference and reference["run_dir"] for run, reference in vs.env_references(runs, 0)}
    assert pairs["r1_sync_200_ms"] == "r1_sync_0_ms" and pairs["r0_async_200_ms"] == "r0_async_0_ms"
    assert pairs["r1_async_0_ms"] == "r1_async_0_ms"  # the reference itself
    assert pairs["r2_async_50_ms"] == "r0_async_0_ms"
    assert pairs["r0_other_50_ms"] is None
    assert {run["run_dir"]: ref and ref["run_dir"] for run, ref in vs.env_references(runs, 200)}["r0_sync_0_ms"] \
        == "r0_sync_200_ms"


def test_bench_env_rows_combine_per_mode_into_medians_and_the_worst_names_the_mode():
    def env_row(kind: str, ms: int, measured: float, cross: float, own: float, source: bool = False) -> dict:
        cell = {"samples_per_s": measured * cross, "ratio": cross, **({"is_source": True} if source else {})}
        return {"mode": f"{kind} {ms} ms", "kind": kind, "latency_ms": ms, "measured": {"samples_per_s": measured},
                "cross": cell, "own": {"samples_per_s": measured * own, "ratio": own}}

    rows = [env_row("sync", 200, 100.0, 0.90, 1.0), env_row("sync", 200, 120.0, 0.80, 0.95),
            env_row("sync", 200, 110.0, 1.00, 1.05), env_row("sync", 0, 300.0, 1.02, 1.02, source=True)]
    combined = vs.combine_env(rows)
    assert [c["mode"] for c in combined] == ["sync 0 ms", "sync 200 ms"]  # by kind, then latency
    slow = combined[1]
    assert slow["measured"] == {"samples_per_s": 110.0, "min": 100.0, "max": 120.0}
    assert {k: slow["cross"][k] for k in ("ratio", "min", "max")} == {"ratio": 0.90, "min": 0.80, "max": 1.00}
    assert combined[0]["cross"]["is_source"]
    assert vs.worst(combined, "cross", ("mode",)) == {"ratio": 0.90, "mode": "sync 200 ms", "runs": 1,
                                                      "within_15pct": True}
    table = vs.format_env_table(combined).splitlines()
    # predicted: the median of 90, 96 and 110 samples/s
    assert table[3] == "| sync 200 ms | 3 | 110.0 [100.0-120.0] | 96.0 | 0.900 [0.800-1.000] | 1.000 [0.950-1.050] |"
    assert table[2].endswith("1.020 [1.020-1.020]* | 1.020 [1.020-1.020] |")


def test_each_bench_tail_run_is_predicted_from_the_reference_modes_run_of_the_same_repeat(tmp_path):
    runs = [{"mode": mode, "repeat": r, "run_dir": f"r{r}_{mode}"}
            for r in (0, 1) for mode in ("sync", "call-batched", "continuous")]
    runs.append({"mode": "continuous", "repeat": 2, "run_dir": "r2_continuous"})  # repeat 2 has no sync run
    pairs = {run["run_dir"]: reference["run_dir"] for run, reference in vs.tail_references(runs, "sync")}
    assert pairs["r1_continuous"] == "r1_sync" and pairs["r0_call-batched"] == "r0_sync"
    assert pairs["r1_sync"] == "r1_sync" and pairs["r2_continuous"] == "r0_sync"
    assert vs.tail_references(runs, "sync, learner 2 cores") == []
    # The default reference is the bench's synchronous baseline, as bench_tail.json names it.
    (tmp_path / "bench_tail.json").write_text('{"sync_baseline_mode": "sync, learner 2 cores"}')
    assert vs.tail_reference_mode(tmp_path, "") == "sync, learner 2 cores"
    assert vs.tail_reference_mode(tmp_path, "continuous") == "continuous"
    assert vs.tail_reference_mode(tmp_path / "missing", "") == "sync"


@pytest.mark.parametrize(("argv", "says"), [
    (["--etas", "a"], "argument --etas: wants an integer >= 0, got 'a'"),
    (["--generators", ""], "argument --generators: wants a comma-separated list without empty items"),
    (["--generators", "0"], "argument --generators: wants an integer >= 1, got '0'"),
    (["--etas", "-1"], "argument --etas: wants an integer >= 0, got '-1'"),
    (["--etas", "1,1"], "argument --etas: 1 given twice"),
    (["--steps", "0"], "argument --steps: wants an integer >= 1, got '0'"),
    (["trian.max_steps=3"], "unknown config key 'trian.max_steps'"),
])
def test_bad_arguments_exit_2_naming_what_was_wrong_before_anything_trains(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vs, "train", lambda *a: pytest.fail("a run trained"))
    with pytest.raises(SystemExit) as exit_info:
        vs.main(["--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err.strip().splitlines()[-1]


@pytest.mark.parametrize("reuse", [False, True])
def test_a_run_folder_an_earlier_call_left_is_refused_before_anything_trains(reuse, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vs, "train", lambda *a: pytest.fail("a run trained"))
    (tmp_path / "g2_eta1").mkdir()
    (tmp_path / "g2_eta1" / "metrics.jsonl").write_text("{}\n")  # unfinished: --reuse trains it again
    with pytest.raises(SystemExit) as exit_info:
        vs.main(["--out", str(tmp_path), "--etas", "1", "--generators", "2", "--reference", "2,1",
                 *(["--reuse"] if reuse else [])])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "g2_eta1 already holds" in err[-1]


def test_an_env_reference_latency_no_run_has_is_exit_2_naming_the_latencies_present(tmp_path, capsys):
    runs = [{"mode": f"{kind} {ms} ms", "kind": kind, "latency_ms": ms, "repeat": 0}
            for kind in ("sync", "async") for ms in (0, 200)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(run) + "\n" for run in runs))
    assert vs.main(["--bench-env", str(tmp_path), "--env-reference-ms", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--env-reference-ms 50" in err and "latencies: 0, 200 ms" in err


@pytest.mark.parametrize("override", [[], ["run_dir_reuse=true"]])
def test_a_folder_train_would_accept_is_not_refused(override, tmp_path, monkeypatch):
    # A run that failed before its first step leaves config.yaml and summary.json only; with
    # run_dir_reuse=true even a run's metrics may be trained over: asyncgrpo train takes both.
    (tmp_path / "g2_eta1").mkdir()
    (tmp_path / "g2_eta1" / "summary.json").write_text('{"status": "failed"}\n')
    if override:
        (tmp_path / "g2_eta1" / "metrics.jsonl").write_text("{}\n")
    trained = []
    monkeypatch.setattr(vs, "one_round", lambda *a: trained.append(a) or None)
    assert vs.main(["--out", str(tmp_path), "--etas", "1", "--generators", "2", "--reference", "2,1", *override]) == 1
    assert len(trained) == 1  # past the check: the round ran (and, faked, gave nothing)
