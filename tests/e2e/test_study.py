"""`asyncgrpo study` end to end: real `asyncgrpo train` runs (vLLM, Ray), tiny budgets."""

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def study_cli(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncgrpo.cli", "study", "quick",  # configs/studies/quick.yaml: 2 cells x 1 seed
        f"study_dir={tmp_path / 'study'}",
        # A short warm start into a private cache: these runs test the plumbing, not learning.
        f"model.cache_dir={tmp_path / 'cache'}",
        "model.warmstart_max_seconds=5",
        *overrides,
    ]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_a_quick_study_runs_both_cells_reports_them_and_a_rerun_skips_both(tmp_path):
    result = subprocess.run(study_cli(tmp_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study_dir = tmp_path / "study"
    rows = read_csv(study_dir / "results.csv")
    assert [(r["algo.mode"], r["seed"], r["status"]) for r in rows] == [("bypass", "0", "finished"),
                                                                         ("decoupled", "0", "finished")]
    for row in rows:
        assert row["steps"] == "2" and float(row["samples_per_s"]) > 0 and row["eval_accuracy_end"] != ""
        assert float(row["accuracy_auc"]) == pytest.approx(
            (float(row["eval_accuracy_start"]) + float(row["eval_accuracy_end"])) / 2)
        assert "staleness/max" in (Path(row["run_dir"]) / "metrics.jsonl").read_text()
    report = (study_dir / "report.md").read_text()
    assert "2 finished, 0 failed or interrupted, 0 not started" in report
    assert "Baseline: algo.mode=bypass" in report
    assert (study_dir / "plots" / "accuracy_vs_samples.png").stat().st_size > 0
    assert (study_dir / "plots" / "final_accuracy_vs_algo.mode.png").stat().st_size > 0

    start = time.monotonic()
    again = subprocess.run(study_cli(tmp_path), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 finished before, 0 to run" in again.stdout
    assert time.monotonic() - start < 120  # nothing trained: no Ray, no vLLM
    assert len(read_csv(study_dir / "results.csv")) == 2


def test_ctrl_c_stops_the_running_train_which_writes_its_summary_and_the_study_exits_130(tmp_path):
    # A long first run, interrupted once it has logged steps.
    process = subprocess.Popen(study_cli(tmp_path, "train.max_steps=100000", "eval.at_start=false"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "study" / "runs" / "algo.mode-bypass" / "seed_0"
    deadline = time.monotonic() + 600
    try:
        while '"loss/pg"' not in ((run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists()
                                  else ""):
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no training step logged in 600 s"
            time.sleep(1)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert not (tmp_path / "study" / "runs" / "algo.mode-decoupled").exists()  # no run after the interrupt
    rows = read_csv(tmp_path / "study" / "results.csv")
    assert [r["status"] for r in rows] == ["interrupted"]
    assert "0 finished, 1 failed or interrupted, 1 not started" in (tmp_path / "study" / "report.md").read_text()
