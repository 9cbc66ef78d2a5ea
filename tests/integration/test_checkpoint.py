"""Exact resume: 6 steps straight equal 3 steps, a checkpoint, a new learner, 3 more steps.

And a save killed before it finished is never taken for a checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from learner_fixtures import RESUME_LOSS_KEYS, full_params, make_model_dir, max_abs_diff, step_groups, train_each

from asyncgrpo.config import load

from asyncgrpo.composition import run_record
from asyncgrpo.learner import checkpoint
from asyncgrpo.learner.learner import Learner

pytestmark = pytest.mark.slow

# Warm-up then cosine decay over the 6 steps, weight decay and a KL term: the schedule's position,
# Adam's moments and the reference (the starting weights, not the checkpoint's) must all survive.
OVERRIDES = ["learner.warmup_steps=2", "learner.lr_schedule=cosine", "train.max_steps=6", "learner.lr=1e-3",
             "learner.weight_decay=0.1", "algo.kl.enabled=true", "algo.kl.coef=0.1", "learner.micro_batch_tokens=24"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def test_resume_matches_an_uninterrupted_run(model_dir, tmp_path):
    batches = step_groups(6)
    straight = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        straight_metrics = train_each(straight, batches)
        straight_params = full_params(straight)
    finally:
        straight.close()

    first = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        first_metrics = train_each(first, batches[:3])
        saved = Path(first.save_checkpoint(tmp_path / "checkpoints"))
    finally:
        first.close()
    assert saved.name == "step_3" and (saved / checkpoint.MARKER).is_file() and (saved / checkpoint.MANIFEST).is_file()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    # What a resume is checked against (asyncgrpo/learner/resume.py): this run's generators, task and seed.
    assert checkpoint.read_meta(saved)["run"] == run_record(load(OVERRIDES))

    resumed = Learner.from_config(load(OVERRIDES), model_dir)
    try:
        meta = resumed.load_checkpoint(tmp_path)  # a run directory: its newest complete checkpoint
        assert meta["version"] == 3 and resumed.version == 3 and resumed.samples_consumed == 3 * 5 * 4
        resumed_metrics = train_each(resumed, batches[3:])
        resumed_params = full_params(resumed)
    finally:
        resumed.close()

    worst_loss = 0.0
    for got, want in zip(first_metrics + resumed_metrics, straight_metrics):
        assert got["step"] == want["step"]
        for key in RESUME_LOSS_KEYS:
            worst_loss = max(worst_loss, abs(got[key] - want[key]))
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
    assert straight_metrics[-1]["loss/kl"] > 0
    worst = max_abs_diff(resumed_params, straight_params)
    print(f"resume vs straight: max |loss difference| {worst_loss:.2e}, max |param difference| {worst:.2e}")
    assert worst < 1e-6


KILLED_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from learner_fixtures import step_groups
    from asyncgrpo.config import load
    from asyncgrpo.learner import checkpoint
    from asyncgrpo.learner.learner import Learner

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    # zmq weights: this process is killed, and nothing (no driver here) would remove shared-memory slots.
    learner = Learner.from_config(load(["learner.warmup_steps=0", "weights.backend=zmq"]), model_dir)
    learner.train_on(step_groups(1)[0])
    learner.save_checkpoint(out)

    def stall(tmp):
        (out / "stalled").write_text(str(tmp))
        time.sleep(600)

    checkpoint._before_marker = stall
    learner.train_on(step_groups(2)[1])
    learner.save_checkpoint(out)
""")


def test_a_save_killed_midway_is_never_resumed_from(model_dir, tmp_path):
    out = tmp_path / "checkpoints"
    # The killed process cannot remove its learner's Unix-socket directories: they go under tmp_path.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, model_dir, str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (out / "stalled").exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the second save never reached its marker"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    half = out / "step_2.tmp"
    assert (half / "dcp" / ".metadata").is_file() and (half / checkpoint.META).is_file()  # all data, no marker
    assert not (half / checkpoint.MARKER).exists() and not (out / "step_2").exists()
    # A complete-looking name without the marker (e.g. copied by hand) is not taken either.
    (out / "step_5").mkdir()
    assert checkpoint.latest(out).name == "step_1"
    assert checkpoint.latest(tmp_path).name == "step_1"
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.latest(half)

    learner = Learner.from_config(load(["learner.warmup_steps=0"]), model_dir)
    try:
        assert learner.load_checkpoint(out)["version"] == 1
        # The next save of step 2 replaces the stale .tmp and completes.
        learner.train_on(step_groups(2)[1])
        assert Path(learner.save_checkpoint(out)).name == "step_2"
    finally:
        learner.close()
    assert checkpoint.latest(out).name == "step_2" and not half.exists()
    assert json.loads((out / "step_2" / checkpoint.META).read_text())["version"] == 2


def test_keep_checkpoints_prunes_the_oldest(model_dir, tmp_path):
    learner = Learner.from_config(load(["learner.warmup_steps=0", "train.keep_checkpoints=2"]), model_dir)
    try:
        for groups in step_groups(3):
            learner.train_on(groups)
            learner.save_checkpoint(tmp_path)
    finally:
        learner.close()
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_2", "step_3"]
