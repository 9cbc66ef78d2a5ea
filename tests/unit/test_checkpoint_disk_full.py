"""A checkpoint save that runs out of disk fails as ENOSPC naming where (tools/chaos.py found it
failing as DCP's multi-line CheckpointException around torch's "unexpected pos", no word of space)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from asyncgrpo.learner.checkpoint import disk_full_error, state_bytes

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def free_space(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096))


def test_an_enospc_inside_dcp_s_wrapper_is_the_error(monkeypatch, tmp_path):
    free_space(monkeypatch, 1 << 30)  # the chain decides, whatever the free space says
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "dcp" / "__0_0.distcp"))
    wrapped = CheckpointException("save", {0: (full, None)})
    error = disk_full_error(wrapped, tmp_path, needed_bytes=100)
    assert error is not None and error.errno == errno.ENOSPC
    assert str(error) == f"[Errno 28] No space left on device: '{tmp_path / 'dcp' / '__0_0.distcp'}'"


def test_a_short_write_with_no_room_left_is_a_full_disk(monkeypatch, tmp_path):
    # torch's zip writer: the OSError is lost, only the position it did not reach remains.
    free_space(monkeypatch, 8192)
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error = disk_full_error(CheckpointException("save", {0: (lost, None)}), tmp_path, needed_bytes=1_400_000)
    assert error is not None and error.errno == errno.ENOSPC and "\n" not in str(error)
    assert "No space left on device" in str(error) and "unexpected pos 704 vs 598" in str(error)
    assert "8192 bytes free" in str(error) and str(tmp_path) in str(error)


def test_another_failure_with_room_to_spare_is_left_as_it_is(monkeypatch, tmp_path):
    free_space(monkeypatch, 1 << 30)
    assert disk_full_error(RuntimeError("a bug"), tmp_path, needed_bytes=1_400_000) is None
    assert disk_full_error(OSError(errno.EACCES, "Permission denied"), tmp_path, needed_bytes=10) is None


def test_a_save_needs_the_bytes_of_its_tensors():
    state = {"model": {"w": torch.zeros(10, 4), "b": torch.zeros(4, dtype=torch.float16)},
             "optim": {"state": {0: {"exp_avg": torch.zeros(3), "step": 7}}, "param_groups": [{"lr": 0.1}]}}
    assert state_bytes(state) == 10 * 4 * 4 + 4 * 2 + 3 * 4


def test_the_save_raises_the_full_disk_from_the_failpoint(monkeypatch, tmp_path: Path):
    from asyncgrpo.runtime import faults
    from asyncgrpo.learner import checkpoint

    monkeypatch.setenv(faults.ENV, '{"checkpoint_enospc": 3}')
    policy = SimpleNamespace(state_dict=lambda: {"w": torch.zeros(4)})
    checkpoint.save(tmp_path, 2, policy, {}, model_dir=str(tmp_path), rank=0, world_size=1, keep=0)
    try:
        checkpoint.save(tmp_path, 3, policy, {}, model_dir=str(tmp_path), rank=0, world_size=1, keep=0)
    except OSError as err:
        assert err.errno == errno.ENOSPC and "step_3.tmp" in str(err)
    else:
        raise AssertionError("the failpoint did not fail the save")
    assert checkpoint.is_complete(tmp_path / "step_2") and not (tmp_path / "step_3").exists()
