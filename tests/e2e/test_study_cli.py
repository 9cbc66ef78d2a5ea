"""`asyncgrpo study` end to end: real `asyncgrpo train` runs (vLLM, Ray), tiny budgets."""

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from shared_cache import warm_cache

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def alive(pid: int) -> bool:
    """A live process: an exited one its parent has not reaped yet (a zombie) holds nothing, and is
    what the study cluster's reaping (asyncgrpo/study/cluster.py) already leaves out."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def study_cli(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncgrpo.cli", "study", "quick",  # configs/studies/quick.yaml: 2 cells x 1 seed
        f"study_dir={tmp_path / 'study'}",
        # A short warm start, shared by the session's end-to-end runs: they test the plumbing, not learning.
        f"model.cache_dir={warm_cache(tmp_path)}",
        "model.warmstart_max_seconds=5",
        *overrides,
    ]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def test_a_quick_study_runs_both_cells_on_one_kept_engine_reports_them_and_a_rerun_skips_both(tmp_path):
    result = subprocess.run(study_cli(tmp_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study_dir = tmp_path / "study"
    rows = read_csv(study_dir / "results.csv")
    assert [(r["algo.mode"], r["seed"], r["status"]) for r in rows] == [("bypass", "0", "finished"),
                                                                         ("decoupled", "0", "finished")]
    # The second run took the first one's generator process (vLLM not restarted) and reset it to the
    # same starting weights and seed: its held-out evaluation before training is the first one's.
    first, second = (json.loads((Path(r["run_dir"]) / "summary.json").read_text()) for r in rows)
    pids = [json.loads((Path(r["run_dir"]) / "actors.json").read_text())["generator_pids"] for r in rows]
    assert pids[0] == pids[1]
    assert (first["engines_reused"], second["engines_reused"]) == ([], [0])
    assert second["eval_accuracy_start"] == first["eval_accuracy_start"]
    assert second["eval_greedy_accuracy_start"] == first["eval_greedy_accuracy_start"]
    # The study's Ray cluster, and the engine in it, are gone with the study.
    port = int(re.search(r"Ray cluster at 127\.0\.0\.1:(\d+)", result.stdout).group(1))
    assert not any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections(kind="inet"))
    assert not alive(pids[0][0])
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
    assert "Ray cluster" not in again.stdout  # nothing to run: no cluster started
    assert len(read_csv(study_dir / "results.csv")) == 2


def test_a_quick_study_with_two_concurrent_runs_runs_them_at_once_each_on_its_own_engine(tmp_path):
    result = subprocess.run([*study_cli(tmp_path), "--concurrent", "2"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 to run; in" in result.stdout and "2 at a time" in result.stdout
    rows = read_csv(tmp_path / "study" / "results.csv")
    assert [(r["algo.mode"], r["status"]) for r in rows] == [("bypass", "finished"), ("decoupled", "finished")]
    # Both started before either finished, each on an engine of its own slot's pool.
    lines = result.stdout.splitlines()
    first_end = next(i for i, line in enumerate(lines) if ": finished in" in line)
    assert sum(": started (" in line for line in lines[:first_end]) == 2
    pids = [json.loads((Path(r["run_dir"]) / "actors.json").read_text())["generator_pids"] for r in rows]
    assert pids[0] != pids[1]
