"""A real training run records its stream (`wire.record_dir`), and `asyncgrpo replay` trains on it
again without generators: with the recording's config it repeats every step's losses exactly, also
while it evaluates its weights on the held-out problems between steps."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from shared_cache import warm_cache

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss/pg" in record]


def asyncgrpo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncgrpo.cli", *argv], capture_output=True, text=True, timeout=900)


def test_a_recorded_training_run_replays_with_its_own_losses_and_runs_under_another_correction(tmp_path):
    recording = tmp_path / "rec"
    trained = asyncgrpo("train", f"run_dir={tmp_path / 'run'}", f"model.cache_dir={warm_cache(tmp_path)}",
                        "model.warmstart_max_seconds=5", "progress=false", "train.steps_per_call=2",
                        "train.max_steps=4", "train.groups_per_step=4", "eval.at_start=false", "eval.at_end=false",
                        "train.export_at_end=false", f"wire.record_dir={recording}")
    assert trained.returncode == 0, trained.stderr[-4000:]
    original = step_records(tmp_path / "run")
    assert json.loads((recording / "recording.json").read_text())["start_version"] == 0

    # With held-out evaluation of the replay's weights (vLLM in the replay's process) after step 2 and
    # at the end: the live run's eval records and summary entries, and the same losses as without.
    replayed = asyncgrpo("replay", str(recording), f"run_dir={tmp_path / 'replay'}", "progress=false",
                         "eval.at_end=true", "eval.every_steps=2")
    assert replayed.returncode == 0, replayed.stderr[-4000:]
    records = step_records(tmp_path / "replay")
    assert [r["step"] for r in records] == [r["step"] for r in original] == [1, 2, 3, 4]
    for key in ("loss/pg", "loss/total", "optim/grad_norm", "staleness/max", "reward/mean"):
        assert [r[key] for r in records] == [r[key] for r in original], key
    lines = (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "eval/when" in r]
    assert [(r["step"], r["eval/when"]) for r in evals] == [(2, "periodic"), (4, "end")]
    assert "Invalid process group" not in replayed.stderr  # vLLM shut down before the learner's group went
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert 0 <= summary["eval_accuracy_end"] <= 1 and 0 <= summary["eval_greedy_accuracy_end"] <= 1
    assert "eval_accuracy_start" not in summary  # eval.at_start=false, as recorded

    decoupled = asyncgrpo("replay", str(recording), "progress=false", "algo.mode=decoupled",
                          "algo.correction.is_level=token")
    assert decoupled.returncode == 0, decoupled.stderr[-4000:]
    (run_dir,) = recording.glob("replay-*")
    assert [r["staleness/max"] for r in step_records(run_dir)] == [r["staleness/max"] for r in original]
