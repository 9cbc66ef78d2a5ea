"""Record a short stream from an in-process learner (a ListSource of stale synthetic groups, the
real tiny Qwen2 under FSDP2 on a gloo group of one), then `asyncgrpo replay` it: the same stream,
config and seed give identical losses at every step, equal to the recording run's; another
correction runs on the same data and differs; staleness is the recording's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from learner_fixtures import fixed_groups, make_model_dir

from asyncgrpo import cli
from asyncgrpo.config import load
from asyncgrpo.recording.stream import STREAM_FILE
from asyncgrpo.learner.learner import Learner
from asyncgrpo.learner.parts import offline_learner_parts, stream_recorder
from asyncgrpo.queue.sources import GroupSource, ListSource

pytestmark = pytest.mark.slow

# The version that sampled each step's groups: the learner takes step k at version k, so the
# staleness it trains with is k - SAMPLED_AT[k].
SAMPLED_AT = [0, 0, 0, 2]
LOSS_KEYS = ("loss/pg", "loss/total", "optim/grad_norm")


def offline_learner(cfg, model_dir, source: GroupSource, recorder=None) -> Learner:
    """The one-rank learner a replay builds (asyncgrpo/driver/replay.py)."""
    return Learner(**offline_learner_parts(cfg, model_dir, source, recorder).arguments)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(recording directory, the recording run's step metrics)."""
    base = tmp_path_factory.mktemp("recorded")
    model_dir = make_model_dir(base / "model")
    directory = base / "rec"
    cfg = load([f"model.path={model_dir}", "device=cpu", "train.groups_per_step=3", "learner.warmup_steps=0",
                "learner.lr=1e-3", "learner.micro_batch_tokens=24", f"wire.record_dir={directory}",
                f"run_dir={base / 'run'}"])
    groups = [group for step, version in enumerate(SAMPLED_AT)
              for group in fixed_groups(num_groups=3, seed=100 + step, version=version)]
    for group in groups[-3:]:  # a token sampled a version later (an in-flight update), not the group's oldest
        sample = int(np.argmax(group.lengths >= 2))
        assert group.lengths[sample] >= 2
        group.versions[group.offsets[sample]] += 1
    learner = offline_learner(cfg, model_dir, ListSource(groups), stream_recorder(cfg, model_dir))
    try:
        metrics = [learner.step() for _ in SAMPLED_AT]
    finally:
        learner.close()
    return directory, metrics


def replay(directory: Path, run_dir: Path, *overrides: str) -> list[dict]:
    """The replay's step records (its held-out evaluation is off: these tests are about losses, and
    tests/e2e/test_record_replay.py evaluates)."""
    assert cli.main(["replay", str(directory), f"run_dir={run_dir}", "progress=false", "eval.at_start=false",
                     "eval.at_end=false", *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_replays_of_the_same_stream_config_and_seed_have_identical_losses_at_every_step(recorded, tmp_path):
    directory, original = recorded
    first = replay(directory, tmp_path / "a")
    second = replay(directory, tmp_path / "b")
    assert len(first) == len(second) == len(SAMPLED_AT)
    for step, (a, b, o) in enumerate(zip(first, second, original, strict=True)):
        for key in LOSS_KEYS:
            assert a[key] == b[key], (step, key)
            assert a[key] == o[key], (step, key)  # and the recording run's own
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == summary["version"] == len(SAMPLED_AT)
    assert summary["torn_tail_records"] == 0 and (tmp_path / "a" / "config.yaml").is_file()


def test_replay_staleness_is_the_recorded_consumption_version_minus_the_oldest_token_version(recorded, tmp_path):
    directory, original = recorded
    records = replay(directory, tmp_path / "r")
    assert [r["staleness/max"] for r in records] == [k - v for k, v in enumerate(SAMPLED_AT)]
    assert [r["staleness/max"] for r in records] == [r["staleness/max"] for r in original]
    assert records[-1]["staleness/inflight_span_max"] == 1


def test_another_correction_on_the_same_stale_data_runs_and_differs(recorded, tmp_path):
    directory, _ = recorded
    bypass = replay(directory, tmp_path / "bypass")
    decoupled = replay(directory, tmp_path / "decoupled", "algo.mode=decoupled", "algo.correction.is_level=token")
    assert all(r["time/recompute_s"] > 0 for r in decoupled)
    assert any(a["loss/pg"] != b["loss/pg"] for a, b in zip(bypass, decoupled, strict=True))
    # The data is the same: what the groups are, and how stale, does not depend on the settings.
    for key in ("reward/mean", "perf/tokens", "staleness/mean"):
        assert [r[key] for r in bypass] == [r[key] for r in decoupled], key


def test_a_torn_tail_is_ignored_and_counted_and_the_steps_before_it_replay_the_same(recorded, tmp_path):
    directory, original = recorded
    torn = tmp_path / "torn"
    shutil.copytree(directory, torn, ignore=shutil.ignore_patterns("replay-*"))
    stream = torn / STREAM_FILE
    stream.write_bytes(stream.read_bytes()[:-10])  # the crash came while the last step was written
    records = replay(torn, tmp_path / "r")
    assert len(records) == len(SAMPLED_AT) - 1
    assert [r["loss/total"] for r in records] == [r["loss/total"] for r in original[:-1]]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["torn_tail_records"] == 3 and summary["recorded_steps"] == len(SAMPLED_AT) - 1


def test_train_max_steps_stops_the_replay_early(recorded, tmp_path):
    directory, original = recorded
    records = replay(directory, tmp_path / "r", "train.max_steps=2")
    assert [r["loss/total"] for r in records] == [r["loss/total"] for r in original[:2]]


def test_a_recording_made_after_a_resume_replays_from_that_checkpoint(tmp_path):
    model_dir = make_model_dir(tmp_path / "model")
    directory = tmp_path / "rec"
    overrides = [f"model.path={model_dir}", "device=cpu", "train.groups_per_step=3", "learner.warmup_steps=0",
                 "learner.lr=1e-3", f"run_dir={tmp_path / 'run'}"]
    groups = [group for step in range(4) for group in fixed_groups(num_groups=3, seed=200 + step, version=step)]
    first = offline_learner(load(overrides), model_dir, ListSource(groups[:6]))
    try:
        first.step(), first.step()
        checkpoint = first.save_checkpoint(tmp_path / "checkpoints")
    finally:
        first.close()
    cfg = load([*overrides, f"wire.record_dir={directory}", f"resume={checkpoint}"])
    resumed = offline_learner(cfg, model_dir, ListSource(groups[6:]), stream_recorder(cfg, model_dir))
    try:
        resumed.load_checkpoint(checkpoint)
        original = [resumed.step() for _ in range(2)]
    finally:
        resumed.close()
    header = json.loads((directory / "recording.json").read_text())
    assert header["start_version"] == 2 and header["checkpoint"] == str(Path(checkpoint).resolve())
    records = replay(directory, tmp_path / "replay")
    assert [r["step"] for r in records] == [3, 4]
    assert [r["loss/total"] for r in records] == [r["loss/total"] for r in original]
