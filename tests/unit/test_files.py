"""asyncgrpo.runtime.files: private directories (refused when another user could change them) and atomic writes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from asyncgrpo.schema import ConfigError
from asyncgrpo.runtime.files import UnsafeDirectory, private_dir, write_atomic

OTHER_UID = 4242


def test_private_dir_creates_missing_directory_and_parents_with_mode_0700(tmp_path):
    made = private_dir(tmp_path / "runs" / "exp1")
    assert made == tmp_path / "runs" / "exp1" and made.is_dir()
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "runs").st_mode) == 0o700


def test_private_dir_accepts_an_existing_own_directory_readable_by_others(tmp_path):
    existing = tmp_path / "run"
    existing.mkdir()
    existing.chmod(0o755)  # readable is fine; only writable by others is refused
    (existing / "keep").write_text("x")
    assert private_dir(existing) == existing
    assert (existing / "keep").read_text() == "x"


def test_private_dir_refuses_a_world_writable_directory(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        private_dir(shared)


def test_private_dir_refuses_a_group_writable_directory(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        private_dir(shared)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_private_dir_refuses_a_directory_another_user_created_first(tmp_path):
    planted = tmp_path / "run"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectory, match=f"owned by uid {OTHER_UID}, not by this user"):
        private_dir(planted)


def test_private_dir_refuses_a_directory_not_owned_by_the_effective_user(tmp_path, monkeypatch):
    existing = tmp_path / "run"
    existing.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    with pytest.raises(UnsafeDirectory, match="not by this user"):
        private_dir(existing)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_private_dir_refuses_a_path_below_another_users_directory(tmp_path):
    # The README's paths under /tmp: another user makes /tmp/x first; our run_dir /tmp/x/run would be
    # ours, but they could rename it away and put theirs in its place.
    theirs = tmp_path / "x"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectory, match="above .* owned by uid 4242"):
        private_dir(theirs / "run")


def test_private_dir_refuses_a_path_below_a_world_writable_directory_without_sticky_bit(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by anyone and not sticky"):
        private_dir(open_dir / "run")
    open_dir.chmod(0o1777)  # like /tmp: others cannot rename what we own in it
    assert private_dir(open_dir / "run").is_dir()


def test_private_dir_refuses_a_symlink_and_a_file(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeDirectory, match="is a symlink"):
        private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_dir(tmp_path / "file")


def test_unsafe_directory_is_a_one_line_config_error(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        private_dir(shared)
    assert "\n" not in str(caught.value)


def test_write_atomic_does_not_follow_a_symlink_planted_at_the_old_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "summary.json.tmp").symlink_to(victim)  # the name the old code wrote through
    write_atomic(tmp_path / "summary.json", "new\n")
    assert victim.read_text() == "untouched"
    assert (tmp_path / "summary.json").read_text() == "new\n"
    assert not stat.S_ISLNK(os.lstat(tmp_path / "summary.json").st_mode)


def test_write_atomic_writes_a_private_file_and_leaves_no_temporary(tmp_path):
    write_atomic(tmp_path / "a.json", "1", durable=True)
    write_atomic(tmp_path / "a.json", "2")
    assert (tmp_path / "a.json").read_text() == "2"
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_write_atomic_removes_its_temporary_when_the_write_fails(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(tmp_path / "a.json", "1")
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_an_unsafe_run_dir_as_one_line_and_exits_2(tmp_path, capsys):
    from asyncgrpo import cli

    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o777)
    code = cli.main(["train", f"run_dir={shared}", "device=cpu"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("asyncgrpo:")]
    assert len(lines) == 1 and "writable by group or others" in lines[0], err
    assert "Traceback" not in err
    assert list(shared.iterdir()) == []  # nothing written into a directory another user could read or change


def test_warm_start_cache_planted_by_another_user_is_refused_before_anything_in_it_is_loaded(tmp_path, monkeypatch):
    import json

    import asyncgrpo.models.warmstart as warmstart
    from asyncgrpo.schema import ModelConfig
    from asyncgrpo.tasks import ArithmeticTask

    sizes = {key: getattr(ModelConfig(), key) for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                          "intermediate_size", "max_positions")}
    task = ArithmeticTask(num_digits=2, eval_size=500)
    cache = tmp_path / "cache"
    cache.mkdir()
    key = warmstart.warm_model_cache_key(warmstart.TinyModelSpec(**sizes), task, 0, 0.12)
    planted = cache / f"tiny-qwen2-{key}"
    planted.mkdir()
    (planted / warmstart.WARMSTART_RECORD).write_text(json.dumps({"reached_target": True}))
    cache.chmod(0o777)

    def no_training(*args, **kwargs):
        raise AssertionError("the refusal comes first")

    monkeypatch.setattr(warmstart, "_train_and_save", no_training)
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        warmstart.ensure_warm_model(cache, model_kwargs=sizes, task=task, seed=0, target_accuracy=0.12,
                                    max_seconds=5, log=lambda _: None)


def test_recording_directory_writable_by_others_is_refused(tmp_path):
    from asyncgrpo.recording.recorder import StreamRecorder

    shared = tmp_path / "recording"
    shared.mkdir()
    shared.chmod(0o777)
    recorder = StreamRecorder(shared, "defaults:\n  - asyncgrpo\n  - _self_\n", str(tmp_path), 1)
    with pytest.raises(UnsafeDirectory):
        recorder.record_step(0, [])
    assert list(shared.iterdir()) == []


def test_study_directory_writable_by_others_is_a_study_error_and_no_run_starts(tmp_path):
    from asyncgrpo.study.runner import StudyError, run_study
    from asyncgrpo.study.spec import Spec

    spec = Spec.parse({"name": "demo", "base": ["train.max_steps=3"], "grid": {"train.fixed_staleness": [0]},
                       "seeds": [0]})
    shared = tmp_path / "study"
    shared.mkdir()
    shared.chmod(0o777)
    started = []
    with pytest.raises(StudyError, match="writable by group or others"):
        run_study(spec, shared, runner=started.append, log=lambda _: None)
    assert started == [] and list(shared.iterdir()) == []



def test_owned_dirs_of_dead_processes_are_removed_and_live_or_unnamed_ones_kept(tmp_path):
    from asyncgrpo.runtime.files import owned_private_dir, process_start_time, remove_stale_owned_dirs

    mine = Path(owned_private_dir("asyncgrpo-wire-", parent=str(tmp_path)))
    assert mine.name.startswith(f"asyncgrpo-wire-{os.getpid()}-{process_start_time(os.getpid())}-")
    assert (mine.stat().st_mode & 0o777) == 0o700
    dead = tmp_path / "asyncgrpo-wire-999999999-12345-abc"  # no such pid
    dead.mkdir()
    reused = tmp_path / f"asyncgrpo-wire-{os.getpid()}-{process_start_time(os.getpid()) + 1}-def"
    reused.mkdir()  # our pid, but another process's start time: its creator is gone
    unnamed = tmp_path / "asyncgrpo-wire-oldstyle"
    unnamed.mkdir()
    other_prefix = tmp_path / "asyncgrpo-weights-999999999-12345-ghi"
    other_prefix.mkdir()
    removed = remove_stale_owned_dirs(str(tmp_path), "asyncgrpo-wire-")
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert mine.is_dir() and unnamed.is_dir() and other_prefix.is_dir()


def test_the_wires_socket_directories_are_named_after_their_process():
    import shutil

    from asyncgrpo.wire.sockets import IPC_DIR_PREFIX, _private_ipc_dir

    directory = _private_ipc_dir()
    try:
        assert os.path.basename(directory).startswith(f"{IPC_DIR_PREFIX}{os.getpid()}-")
    finally:
        shutil.rmtree(directory)
