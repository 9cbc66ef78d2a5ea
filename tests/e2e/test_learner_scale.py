"""The real CLI with two learner ranks, periodic checkpoints (slow ones, outlasting wire.timeout_s),
a resume from them, and the export."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared_cache import warm_cache

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def cli(tmp_path: Path, run: str, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "asyncgrpo.cli", "train",
        f"run_dir={tmp_path / run}",
        f"model.cache_dir={warm_cache(tmp_path)}",
        "model.warmstart_max_seconds=5",
        "progress=false",
        "train.steps_per_call=2",
        "eval.at_start=false",
        "eval.at_end=false",
        *overrides,
    ]


def step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "loss/pg" in r]


def test_two_ranks_checkpoint_resume_and_export(tmp_path):
    # Every save sleeps 15 s (a failpoint: slow storage), past wire.timeout_s=8: told of each save,
    # the generators wait it out (up to train.checkpoint_timeout_s) instead of failing the run.
    slow_saves = {**os.environ, "ASYNCGRPO_FAULTS": json.dumps({"checkpoint_save_delay_s": 15})}
    first = subprocess.run(cli(tmp_path, "first", "learner.world_size=2", "train.max_steps=5",
                               "train.save_every_steps=2", "wire.timeout_s=8", "train.checkpoint_timeout_s=120"),
                           capture_output=True, text=True, timeout=900, env=slow_saves)
    assert first.returncode == 0, first.stderr[-4000:]
    run = tmp_path / "first"
    assert "WireTimeout" not in first.stdout + first.stderr
    # The generator did wait on a save for longer than wire.timeout_s (logged once per save).
    assert "learner rank 0 is saving a checkpoint of version" in first.stdout + first.stderr
    assert [r["time/checkpoint_s"] >= 15 for r in step_records(run) if "time/checkpoint_s" in r] == [True, True]
    assert len(json.loads((run / "actors.json").read_text())["learner_pids"]) == 2
    assert [r["step"] for r in step_records(run)] == [1, 2, 3, 4, 5]
    # Beside the checkpoints, the lineage the run's saves belong to (learner/checkpoint.py).
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LINEAGE.json", "step_2", "step_4"]
    assert all((run / "checkpoints" / s / "COMPLETE").is_file() for s in ("step_2", "step_4"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["generator_restarts"] == 0
    assert summary["probe"]["generator_version"] == summary["probe"]["learner_version"] == 5
    assert summary["probe"]["max_abs_diff_vs_learner"] < 1e-3  # vLLM got the 2-rank learner's weights
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in (run / "export").iterdir()}

    # Resume on one rank (DCP reshards) from the run directory's newest checkpoint, step 4.
    second = subprocess.run(cli(tmp_path, "second", f"resume={run}", "train.max_steps=7"),
                            capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:]
    resumed = tmp_path / "second"
    records = step_records(resumed)
    assert [r["step"] for r in records] == [5, 6, 7]
    assert records[0]["samples"] == 5 * 16 * 8
    assert max(r["staleness/max"] for r in records) <= 2
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_4") and summary["resumed_at_step"] == 4
    assert summary["queue_at_resume"]["queue/consumed"] == 4 * 16
    # The generator started from the checkpoint's weights at version 4 and followed the pushes.
    assert summary["probe"]["generator_version"] == summary["probe"]["learner_version"] == 7
    assert summary["probe"]["max_abs_diff_vs_learner"] < 1e-3
