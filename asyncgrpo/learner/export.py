"""The policy in Hugging Face format: safetensors + config + tokenizer, loadable by transformers and vLLM.

Two ways in: a running learner (`Learner.export_hf`, used at the end of a run and to start
generators from a checkpoint) and a checkpoint on disk (`asyncgrpo export CHECKPOINT OUTDIR`,
which needs no GPU, no process group and no model code: shapes come from the checkpoint). A checkpoint
is checked against its SHA-256 manifest before anything in it is read; a tampered one is a
CheckpointError (one line from the CLI)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncgrpo.learner.checkpoint import copy_model_files, latest, read_meta, verify

# Hugging Face's own default shard size: keeps every file small enough for any filesystem.
MAX_SHARD_BYTES = 5 * 10**9
# Written into every export: only a directory holding it may be replaced by a later export.
EXPORT_MARKER = "asyncgrpo_export.json"


def write_hf(named_tensors: Iterable[tuple[str, torch.Tensor]], model_files: str | Path, outdir: str | Path,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write weights as `model.safetensors` (or numbered shards with an index) plus the config and
    tokenizer files found in `model_files`. Written beside `outdir` and renamed into place, so a
    crash never leaves a half-written export under the final name. `outdir` must be missing, empty
    or an earlier export (marked by EXPORT_MARKER): anything else is refused, never deleted."""
    from safetensors.torch import save_file

    outdir = Path(outdir).expanduser().resolve()
    check_export_target(outdir)
    tmp = outdir.with_name(outdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_model_files(Path(model_files), tmp)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, tensor in named_tensors:
        # Own contiguous CPU storage per tensor: safetensors refuses shared or strided storage.
        tensor = tensor.detach().to("cpu").contiguous().clone()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / filename), metadata={"format": "pt"})
            weight_map.update({name: filename for name in shard})
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    _set_config_dtype(tmp, shards)
    (tmp / EXPORT_MARKER).write_text(json.dumps({"tensors": sum(len(s) for s in shards), "bytes": total}) + "\n")
    if outdir.exists():
        check_export_target(outdir)  # again: it may have been filled while the weights were written
        shutil.rmtree(outdir)
    os.replace(tmp, outdir)
    return outdir


def check_export_target(outdir: Path) -> None:
    """Raise FileExistsError unless `outdir` is missing, an empty directory, or an earlier export."""
    if not outdir.exists():
        return
    if not outdir.is_dir():
        raise FileExistsError(f"{outdir} exists and is not a directory: refusing to replace it")
    if any(outdir.iterdir()) and not (outdir / EXPORT_MARKER).is_file():
        raise FileExistsError(f"{outdir} is not empty and not an earlier export (no {EXPORT_MARKER}): refusing to "
                              "replace it; name a new or empty directory")


def _set_config_dtype(directory: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """config.json names the dtype the weights are stored in, so `dtype="auto"` loads them as written."""
    config_path = directory / "config.json"
    floating = [t.dtype for shard in shards for t in shard.values() if t.is_floating_point()]
    if not config_path.exists() or not floating:
        return
    config = json.loads(config_path.read_text())
    dtype = str(floating[0]).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = dtype
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def checkpoint_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The policy's full (unsharded) weights from a checkpoint, in one process, without the model.
    The checkpoint is checked against its manifest first (DCP's metadata is a pickle)."""
    verify(Path(checkpoint))
    return _read_weights(Path(checkpoint))


def _read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """`checkpoint_weights` for a checkpoint that has just been verified."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(Path(checkpoint) / "dcp"))
    entries = reader.read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{checkpoint}: no model weights in the checkpoint")
    state = {"model": model}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: str | Path, outdir: str | Path) -> Path:
    """`asyncgrpo export`: a checkpoint (or the newest complete one in a run directory) -> Hugging Face format."""
    check_export_target(Path(outdir).expanduser().resolve())  # before reading any weights
    path = latest(checkpoint)
    verify(path)  # before meta.json is trusted or DCP unpickles anything
    meta = read_meta(path)
    model_files = path / "model_files"
    if not model_files.is_dir():
        model_files = Path(meta["model_dir"])
    return write_hf(_read_weights(path).items(), model_files, outdir)
