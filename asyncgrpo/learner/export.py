"""The policy in Hugging Face format: safetensors + config + tokenizer, loadable by transformers and vLLM.

Two ways in: a running learner (`Learner.export_hf`, used at the end of a run and to start
generators from a checkpoint) and a checkpoint on disk (`asyncgrpo export CHECKPOINT OUTDIR`,
which needs no GPU, no process group and no model code: shapes come from the checkpoint). A checkpoint
is checked against its SHA-256 manifest before anything in it is read; a tampered one is a
CheckpointError (one line from the CLI).

A LoRA run (learner.lora.rank > 0, asyncgrpo/learner/lora.py): the running learner writes the
merged model and, in its `adapter/` subdirectory, the PEFT adapter directory (adapter_config.json,
adapter_model.safetensors); `asyncgrpo export` of its checkpoint writes the adapter directory, and
with `--merged DIR` also the merged model (the base read from the checkpoint's model directory,
whose weight files must still be the ones the adapters were trained on)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.learner import lora
from asyncgrpo.learner.checkpoint import CheckpointError, copy_model_files, latest, read_meta, verify
from asyncgrpo.schema import LoraConfig

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
    try:
        entries = reader.read_metadata().state_dict_metadata
    except Exception as err:  # noqa: BLE001 - whatever the unpickler makes of a foreign file, one line
        raise CheckpointError(f"{checkpoint}/dcp: its metadata is unreadable ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]})") from None
    model = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    if not model:
        raise CheckpointError(f"{checkpoint}: no model weights in the checkpoint")
    state = {"model": model}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: str | Path, outdir: str | Path, merged: str | Path | None = None) -> Path:
    """`asyncgrpo export`: a checkpoint (or the newest complete one in a run directory) -> Hugging
    Face format; a LoRA checkpoint -> a PEFT adapter directory, and with `merged` the merged model there."""
    for target in (outdir, merged):  # before reading any weights
        if target is not None:
            check_export_target(Path(target).expanduser().resolve())
    path = latest(checkpoint)
    verify(path)  # before meta.json is trusted or DCP unpickles anything
    meta = read_meta(path)
    model_files = path / "model_files"
    if not model_files.is_dir():
        model_files = Path(meta["model_dir"])
    try:  # before any weights are read
        adapter = lora.read_adapter_record(meta["states"], path)
    except lora.LoraError as err:
        raise CheckpointError(str(err)) from None
    if adapter is None:
        if merged is not None:
            raise CheckpointError(f"{path} is a full fine-tuning checkpoint: it is the whole model already "
                                  "(--merged is for a LoRA checkpoint)")
        return write_hf(_read_weights(path).items(), model_files, outdir)
    settings, base_sha256 = adapter
    adapters = _read_weights(path)
    paths = sorted({name.removesuffix(".lora_A.weight") for name in adapters if name.endswith(".lora_A.weight")})
    written = write_adapter(((lora.peft_name(n), t) for n, t in adapters.items()),
                            lora.adapter_config(settings, paths, str(meta["model_dir"])), outdir)
    if merged is not None:
        write_hf(merged_checkpoint(adapters, settings, meta["model_dir"], base_sha256).items(),
                 model_files, merged)
    return written


def export_adapter(policy: Any, settings: LoraConfig, model_dir: str, rank: int, outdir: str | Path) -> None:
    """A LoRA learner's adapters (`policy`: its Policy) as a PEFT adapter directory; every rank
    calls it (each adapter is gathered), rank 0 writes."""
    named = list(policy.adapter_state_dict())
    if rank == 0:
        write_adapter(named, lora.adapter_config(settings, list(policy.loras), model_dir), outdir)


def write_adapter(named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, outdir: str | Path) -> Path:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors (what PEFT's
    from_pretrained and vLLM's LoRA loader read). Written beside `outdir` and renamed into place;
    `outdir` must be missing, empty or an earlier export, as for `write_hf`."""
    from safetensors.torch import save_file

    outdir = Path(outdir).expanduser().resolve()
    check_export_target(outdir)
    tmp = outdir.with_name(outdir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named_tensors}
    save_file(tensors, str(tmp / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / lora.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    (tmp / EXPORT_MARKER).write_text(json.dumps({"tensors": len(tensors), "bytes": nbytes, "adapter": True}) + "\n")
    if outdir.exists():
        check_export_target(outdir)
        shutil.rmtree(outdir)
    os.replace(tmp, outdir)
    return outdir


def merged_checkpoint(adapters: dict[str, torch.Tensor], settings: LoraConfig, model_dir: str | Path,
                      base_sha256: str) -> dict[str, torch.Tensor]:
    """The base model's weights from `model_dir` with each adapted weight merged (W + scale * B A),
    under the base's names; the base must be the one the adapters were trained on."""
    from safetensors.torch import load_file

    if lora.base_digest(model_dir) != base_sha256:
        raise CheckpointError(f"{model_dir} is not the base model the adapters were trained on (its weight files "
                              "differ): the merged model cannot be made from it")
    files = sorted(Path(model_dir).expanduser().glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} holds no safetensors weights to merge the adapters into")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    scale = settings.alpha / settings.rank
    for name in [n for n in adapters if n.endswith(".lora_A.weight")]:
        path = name.removesuffix(".lora_A.weight")
        base = weights[f"{path}.weight"]
        merged = lora.merge_weight(base.float(), adapters[name], adapters[f"{path}.lora_B.weight"], scale)
        weights[f"{path}.weight"] = merged.to(base.dtype)
    return weights
