"""`asyncgrpo study` end to end: real `asyncgrpo train` runs (vLLM, Ray), tiny budgets."""

import csv
import subprocess
import sys
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

    again = subprocess.run(study_cli(tmp_path), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 finished before, 0 to run" in again.stdout
    assert len(read_csv(study_dir / "results.csv")) == 2
