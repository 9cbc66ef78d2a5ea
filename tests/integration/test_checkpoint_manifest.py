"""A checkpoint carries a SHA-256 manifest, and every reader checks it before DCP unpickles anything:
a changed, missing or added file (or no manifest) is one CheckpointError naming it, never a torch
traceback. Real `checkpoint.save` and `asyncgrpo export` on a small state; no process group."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from asyncgrpo.cli import main
from asyncgrpo.learner import checkpoint

# DCP without a process group says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WEIGHTS = {"embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "head.bias": torch.ones(4)}
SHARD = "dcp/__0_0.distcp"


class Weights:
    """A ShardedState: what the policy hands DCP, reduced to a few tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return {"model": {name: t.clone() for name, t in self.tensors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = state["model"]


@pytest.fixture
def saved(tmp_path) -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["Tiny"], "dtype": "float32"}))
    return checkpoint.save(tmp_path / "checkpoints", 7, Weights(WEIGHTS), {"learner": {"version": 7}},
                           model_dir=str(model_dir), rank=0, world_size=1, keep=0)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything reaches DCP's readers (where `.metadata` is unpickled)."""
    def refuse(*args, **kwargs):
        raise AssertionError("DCP was reached before the manifest check failed")

    monkeypatch.setattr(dcp, "load", refuse)
    monkeypatch.setattr(FileSystemReader, "read_metadata", refuse)


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def load_fresh(path: Path) -> dict[str, Any]:
    return checkpoint.load(path, Weights({name: torch.zeros_like(t) for name, t in WEIGHTS.items()}), rank=0)


def test_a_saved_checkpoint_lists_every_file_and_verifies_and_loads(saved, caplog):
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    files = manifest["files"]
    assert manifest["algorithm"] == "sha256"
    assert set(files) == {"dcp/.metadata", SHARD, checkpoint.META, "rng/rank_0.json", "model_files/config.json"}
    assert files[SHARD]["size"] == (saved / SHARD).stat().st_size and len(files[SHARD]["sha256"]) == 64

    weights = Weights({name: torch.zeros_like(t) for name, t in WEIGHTS.items()})
    with caplog.at_level(logging.INFO, logger=checkpoint.__name__):
        meta = checkpoint.load(saved.parent, weights, rank=0)
    assert meta["version"] == 7 and meta["format"] == checkpoint.FORMAT and meta["path"] == str(saved)
    assert all(torch.equal(weights.tensors[name], t) for name, t in WEIGHTS.items())
    assert any("verified" in record.getMessage() for record in caplog.records)  # the time it took is logged


def test_one_flipped_byte_in_a_shard_fails_naming_that_file_before_dcp_loads(saved, no_unpickling):
    flip_one_byte(saved / SHARD)
    with pytest.raises(checkpoint.CheckpointError, match=f"{SHARD} does not match its SHA-256"):
        load_fresh(saved)


def test_a_malicious_metadata_pickle_is_never_unpickled(saved, tmp_path):
    sentinel = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))  # unpickling creates the file

    (saved / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CheckpointError, match=r"dcp/\.metadata has \d+ bytes, MANIFEST.json lists"):
        load_fresh(saved)
    assert not sentinel.exists()


def test_a_deleted_shard_fails_naming_it(saved, no_unpickling):
    (saved / SHARD).unlink()
    with pytest.raises(checkpoint.CheckpointError, match=f"{SHARD} is listed in MANIFEST.json but missing"):
        load_fresh(saved)


def test_an_extra_file_under_dcp_fails_naming_it(saved, no_unpickling):
    (saved / "dcp" / "__1_0.distcp").write_bytes(b"not from this save")
    with pytest.raises(checkpoint.CheckpointError, match="dcp/__1_0.distcp is not listed in MANIFEST.json"):
        load_fresh(saved)


def test_an_extra_file_with_a_newline_in_its_name_still_fails_in_one_line(saved, no_unpickling):
    (saved / "dcp" / "x\ny").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError) as raised:
        load_fresh(saved)
    assert "\n" not in str(raised.value) and "not listed" in str(raised.value)


def test_a_symlink_in_the_checkpoint_is_refused(saved, tmp_path, no_unpickling):
    # Same content, so only the link itself can be objected to: nothing outside the directory is read.
    outside = tmp_path / "config.json"
    outside.write_bytes((saved / "model_files" / "config.json").read_bytes())
    (saved / "model_files" / "config.json").unlink()
    os.symlink(outside, saved / "model_files" / "config.json")
    with pytest.raises(checkpoint.CheckpointError, match="model_files/config.json is a symlink"):
        load_fresh(saved)


def test_a_checkpoint_without_a_manifest_is_refused(saved, no_unpickling):
    (saved / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no MANIFEST.json: the checkpoint cannot be verified"):
        load_fresh(saved)


def test_a_format_2_checkpoint_from_before_manifests_is_refused_saying_so(saved, no_unpickling):
    meta = json.loads((saved / checkpoint.META).read_text())
    (saved / checkpoint.META).write_text(json.dumps({**meta, "format": 2}))
    (saved / checkpoint.MANIFEST).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="checkpoint format 2 has no MANIFEST.json"):
        load_fresh(saved)


@pytest.mark.parametrize("text", ["{", "[]", '{"algorithm": "sha256", "files": {"meta.json": {"size": "1"}}}'])
def test_an_unreadable_or_malformed_manifest_is_a_checkpoint_error(saved, no_unpickling, text):
    (saved / checkpoint.MANIFEST).write_text(text)
    with pytest.raises(checkpoint.CheckpointError, match="MANIFEST.json is unreadable"):
        load_fresh(saved)


def test_a_changed_meta_json_is_caught_too(saved, no_unpickling):
    # meta.json decides the format and the parts' states: it is covered like the shards.
    meta = json.loads((saved / checkpoint.META).read_text())
    meta["states"]["learner"]["version"] = 8
    (saved / checkpoint.META).write_text(json.dumps(meta, indent=1) + "\n")
    with pytest.raises(checkpoint.CheckpointError, match="meta.json"):
        load_fresh(saved)


def test_a_directory_without_complete_is_still_ignored(saved):
    (saved / checkpoint.MARKER).unlink()
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.latest(saved.parent)


def test_export_of_an_intact_checkpoint_writes_its_weights(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    assert main(["export", str(saved), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(exported) == set(WEIGHTS) and all(torch.equal(exported[n], t) for n, t in WEIGHTS.items())


def test_export_of_a_tampered_checkpoint_fails_in_one_line_naming_the_file(saved, tmp_path, capsys, no_unpickling):
    flip_one_byte(saved / SHARD)
    assert main(["export", str(saved.parent.parent), str(tmp_path / "hf")]) == 2  # a run directory
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("asyncgrpo: export: ") and SHARD in err, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


# A meta.json or DCP metadata that matches its manifest but is not what this code writes (edited by
# hand, or the manifest rewritten over it): the manifest cannot tell, the readers must.
@pytest.mark.parametrize(("meta", "said"), [
    ("not json{", "meta.json is unreadable"),
    ("[1, 2]", "meta.json is not a JSON object"),
    ('{"format": 3}', "meta.json: 'version' is missing"),
    ('{"format": 2, "version": 7}', "checkpoint format 2, this code reads 3"),
])
def test_a_foreign_meta_json_is_one_checkpoint_error_for_resume_and_export(saved, tmp_path, capsys, meta, said):
    (saved / checkpoint.META).write_text(meta)
    checkpoint.write_manifest(saved)
    with pytest.raises(checkpoint.CheckpointError, match=said):
        load_fresh(saved)
    assert main(["export", str(saved), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err and "Traceback" not in err


def test_foreign_dcp_metadata_is_one_line_from_export_not_an_unpickling_traceback(saved, tmp_path, capsys):
    (saved / "dcp" / ".metadata").write_bytes(b"garbage pickle")
    checkpoint.write_manifest(saved)
    assert main(["export", str(saved), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "its metadata is unreadable (UnpicklingError" in err and "\n" not in err


GOOD_LORA_RECORD = {"learner.lora.rank": 4, "learner.lora.alpha": 8.0, "learner.lora.dropout": 0.0,
                    "learner.lora.target_modules": ["q_proj"], "base_sha256": "0" * 64}


@pytest.mark.parametrize(("record", "said"), [
    ([4, 8.0], "LoRA record is list, not an object"),
    ({**GOOD_LORA_RECORD, "learner.lora.rank": "4"}, "learner.lora.rank='4', not of type int"),
    ({**GOOD_LORA_RECORD, "learner.lora.rank": 0}, "learner.lora.rank=0, not >= 1"),
    ({**GOOD_LORA_RECORD, "learner.lora.alpha": None}, "learner.lora.alpha=None, not of type int or float"),
    ({**GOOD_LORA_RECORD, "learner.lora.target_modules": [1]}, "learner.lora.target_modules=[1], not module names"),
    ({k: v for k, v in GOOD_LORA_RECORD.items() if k != "base_sha256"}, "base_sha256=None, not of type str"),
])
def test_a_foreign_lora_record_in_meta_json_is_one_line_from_export_before_any_weights_are_read(
        saved, tmp_path, capsys, no_unpickling, record, said):
    meta = json.loads((saved / checkpoint.META).read_text())
    meta["states"]["lora"] = record
    (saved / checkpoint.META).write_text(json.dumps(meta))
    checkpoint.write_manifest(saved)
    assert main(["export", str(saved), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err and "not written by asyncgrpo" in err


def test_the_lora_record_a_checkpoint_keeps_reads_back_as_its_settings_and_base_digest():
    from asyncgrpo.learner import lora
    from asyncgrpo.schema import LoraConfig

    settings = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "v_proj"])
    states = {"lora": {**lora.settings_record(settings), "base_sha256": "ab" * 32}}
    assert lora.read_adapter_record(json.loads(json.dumps(states)), "ckpt") == (settings, "ab" * 32)
    assert lora.read_adapter_record({}, "ckpt") is None
