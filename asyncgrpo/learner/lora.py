"""LoRA adapters on the learner's policy (`learner.lora.*`, rank > 0), in PEFT's layout.

A targeted `nn.Linear` of a decoder layer is replaced by a `LoraLinear` that keeps the frozen base
weight under its own name (`<path>.weight`, so the base model's state dict names are unchanged) and
adds `<path>.lora_A.weight` [rank, in] and `<path>.lora_B.weight` [out, rank]:

    y = x W^T + b + scale * dropout(x) A^T B^T,    scale = alpha / rank

A starts Kaiming-uniform (a = sqrt(5), as PEFT and nn.Linear do), B at zero, so step 0 is the base
model. PEFT saves these tensors as `base_model.model.<path>.lora_A.weight` (its adapter name is left
out of saved files), and vLLM parses that name back into `<path>` (vllm/lora/utils.py,
parse_fine_tuned_lora_name): `peft_name` is the whole mapping, one-to-one.

What leaves the learner: pushes, the probe and the end-of-run export carry the merged weights
W + scale * B A under the Hugging Face names (`merged`), so generators load plain weights; `asyncgrpo
export` of a LoRA checkpoint writes the adapter directory (`adapter_config`), and with --merged the
merged model too. Checkpoints hold the adapters only (the base is the run's model directory, whose
weight files' digest `adapter_record` keeps, so a resume onto another base model is refused).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncgrpo.schema import LoraConfig

# learner.lora.target_modules: this value targets every nn.Linear of the decoder layers (PEFT's
# spelling; like PEFT's, it leaves out the LM head, which is targeted only when named).
ALL_LINEAR = "all-linear"
# The LM head's module path in a causal LM (PEFT and vLLM name it so; not tied to the embeddings).
OUTPUT_HEAD = "lm_head"
# PEFT's prefix of a saved adapter tensor (its PeftModel wraps the model as base_model.model).
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where `export_hf` (a resume's generator start) puts the adapter beside the merged weights.
EXPORTED_ADAPTER_DIR = "adapter"
_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# Files of a model directory that hold weights (hashed into the base model's digest).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HASH_CHUNK_BYTES = 4 * 2**20


class LoraError(ValueError):
    """An adapter setting the model cannot take, or a checkpoint of another base or adapter (one line)."""


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update; `adapters_on` False gives the base alone."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        # The base's own parameters, registered first: the state dict keeps their names and order.
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **like)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **like)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.adapters_on = True
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merge(self, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """W [out, in] + scale * B [out, rank] @ A [rank, in], from full (unsharded) tensors."""
        return merge_weight(weight, lora_a, lora_b, self.scaling)


def merge_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W [out, in] + scaling * B [out, rank] @ A [rank, in], in W's dtype: the one expression (and
    rounding order) every merged weight comes from (pushes, exports; the generators' in-place merge
    in weights/adapters.py repeats its order on reused buffers)."""
    return weight + scaling * (lora_b.to(weight.dtype) @ lora_a.to(weight.dtype))


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear (or already wrapped one) inside the decoder layers, by its path in `model`."""
    layers = model.model.layers
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return {f"{prefix}.{name}": module for name, module in layers.named_modules()
            if isinstance(module, (nn.Linear, LoraLinear))}


def resolve_targets(model: nn.Module, lora: LoraConfig) -> dict[str, nn.Linear]:
    """The layers `lora.target_modules` names (suffixes of module paths in the decoder layers, as
    PEFT matches them; `all-linear` for all of those; `lm_head` for the LM head, only when named),
    by path in model order; raises LoraError naming a suffix the model lacks, an LM head tied to the
    input embeddings, or a layer narrower than the rank."""
    linears = decoder_linears(model)
    wanted = [lora.target_modules] if isinstance(lora.target_modules, str) else list(lora.target_modules)
    names = [name for name in wanted if name not in (ALL_LINEAR, OUTPUT_HEAD)]
    suffixes = target_suffixes(list(linears))
    for name in names:
        if not any(path == name or path.endswith("." + name) for path in linears):
            raise LoraError(f"learner.lora.target_modules names {name!r}, which no linear layer of the model's "
                            f"decoder layers is (it has {', '.join(suffixes)}; or use {ALL_LINEAR}, or {OUTPUT_HEAD})")
    targets = {path: m for path, m in linears.items()
               if ALL_LINEAR in wanted or any(path == name or path.endswith("." + name) for name in names)}
    if OUTPUT_HEAD in wanted:
        targets.update(_head_target(model))
    for path, module in targets.items():
        narrowest = min(module.in_features, module.out_features)
        if lora.rank > narrowest:
            raise LoraError(f"learner.lora.rank={lora.rank} is larger than {path} ({module.out_features} x "
                            f"{module.in_features}) allows: at most {narrowest}")
    return targets


def _head_target(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's LM head (`OUTPUT_HEAD`) by its path, as a linear layer (or already wrapped one)."""
    head = getattr(model, OUTPUT_HEAD, None)
    if not isinstance(head, (nn.Linear, LoraLinear)):
        raise LoraError(f"learner.lora.target_modules names {OUTPUT_HEAD!r}, which this model does not have as a "
                        "linear layer")
    if getattr(model.config, "tie_word_embeddings", False):
        # A merged update of a tied head would change the input embeddings too (vLLM shares the tensor).
        raise LoraError(f"learner.lora.target_modules names {OUTPUT_HEAD!r}, which this model ties to its input "
                        f"embeddings (tie_word_embeddings): adapt the decoder layers only")
    return {OUTPUT_HEAD: head}


def add_adapters(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Freeze every parameter of `model` and wrap each targeted layer (before FSDP2 shards it; the
    caller seeds torch, so A's initialisation is reproducible). Returns the wrapped paths."""
    model.requires_grad_(False)
    targets = resolve_targets(model, lora)
    for path, base in targets.items():
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path), child, LoraLinear(base, lora.rank, lora.alpha, lora.dropout))
    return list(targets)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The wrapped layers by path (FSDP2 leaves module paths as they were)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLinear)}


def is_adapter_name(name: str) -> bool:
    return name.endswith(_ADAPTER_SUFFIXES)


def peft_name(name: str) -> str:
    """`<path>.lora_A.weight` -> PEFT's saved name `base_model.model.<path>.lora_A.weight`."""
    return PEFT_PREFIX + name


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model alone (the KL reference): every adapter skipped, and eval mode, as the
    separate reference model was (no dropout), for the duration."""
    modules = list(lora_modules(model).values())
    training = model.training
    for module in modules:
        module.adapters_on = False
    model.eval()
    try:
        yield
    finally:
        for module in modules:
            module.adapters_on = True
        model.train(training)


def target_suffixes(paths: list[str]) -> list[str]:
    """The distinct last components of the wrapped paths: adapter_config.json's target_modules
    (the resolved list, not "all-linear", which not every loader expands)."""
    return sorted({path.rsplit(".", 1)[-1] for path in paths})


def adapter_config(lora: LoraConfig, paths: list[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA of a causal LM (the fields vLLM's
    PEFTHelper reads, with the features it refuses off)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha  # PEFT and vLLM type it int
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": alpha,
        "lora_dropout": lora.dropout, "target_modules": target_suffixes(paths), "bias": "none",
        "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }


def base_digest(model_dir: str | Path) -> str:
    """SHA-256 over the model directory's weight files (names and contents, in name order): the
    identity of the base model an adapter was trained on."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(model_dir).expanduser().iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def settings_record(lora: LoraConfig) -> dict[str, Any]:
    """The adapter's settings, keyed by config key (a resume must match them)."""
    wanted = lora.target_modules
    return {"learner.lora.rank": lora.rank, "learner.lora.alpha": float(lora.alpha),
            "learner.lora.dropout": float(lora.dropout),
            "learner.lora.target_modules": wanted if isinstance(wanted, str) else list(wanted)}


def adapter_record(lora: LoraConfig, model_dir: str | Path) -> dict[str, Any]:
    """What a LoRA checkpoint keeps under states["lora"]: its settings and its base model's digest."""
    return {**settings_record(lora), "base_sha256": base_digest(model_dir)}


def read_adapter_record(states: dict[str, Any], checkpoint: str | Path) -> tuple[LoraConfig, str] | None:
    """A checkpoint's adapter record (states["lora"], `adapter_record`'s) as the LoRA settings and the
    base model's digest; None for full fine-tuning. Raises LoraError (one line) for a record this
    code did not write (a hand-edited meta.json)."""
    record = states.get("lora")
    if record is None:
        return None

    def field(key: str, kinds: tuple[type, ...]) -> Any:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise LoraError(f"{checkpoint}: meta.json's LoRA record has {key}={value!r}, not of type "
                            f"{' or '.join(kind.__name__ for kind in kinds)}: it was not written by asyncgrpo")
        return value

    if not isinstance(record, dict):
        raise LoraError(f"{checkpoint}: meta.json's LoRA record is {type(record).__name__}, not an object: "
                        "it was not written by asyncgrpo")
    targets = field("learner.lora.target_modules", (str, list))
    if isinstance(targets, list) and not all(isinstance(name, str) for name in targets):
        raise LoraError(f"{checkpoint}: meta.json's LoRA record has learner.lora.target_modules={targets!r}, "
                        "not module names: it was not written by asyncgrpo")
    settings = LoraConfig(rank=field("learner.lora.rank", (int,)),
                          alpha=float(field("learner.lora.alpha", (int, float))),
                          dropout=float(field("learner.lora.dropout", (int, float))), target_modules=targets)
    if settings.rank < 1:
        raise LoraError(f"{checkpoint}: meta.json's LoRA record has learner.lora.rank={settings.rank}, not >= 1: "
                        "it was not written by asyncgrpo")
    return settings, field("base_sha256", (str,))


def check_adapter_resume(states: dict[str, Any], lora: LoraConfig, model_dir: str | Path, checkpoint: str) -> None:
    """Raise LoraError (one line) unless the checkpoint's adapter record matches this run: both full
    fine-tuning, or the same LoRA settings on a base model with the same weight files."""
    read_adapter_record(states, checkpoint)  # a record this code wrote, or one line
    saved = states.get("lora")
    if lora.rank == 0 and saved is None:
        return
    if saved is None:
        raise LoraError(f"{checkpoint} was written by full fine-tuning; it cannot continue as LoRA "
                        f"(learner.lora.rank={lora.rank}): start a new run, or set learner.lora.rank=0")
    if lora.rank == 0:
        raise LoraError(f"{checkpoint} holds LoRA adapters (learner.lora.rank={saved.get('learner.lora.rank')}); "
                        "resume it with the same learner.lora.* settings")
    differences = [f"{key}={now!r} (the checkpoint's: {saved.get(key)!r})"
                   for key, now in settings_record(lora).items() if saved.get(key) != now]
    if differences:
        raise LoraError(f"{checkpoint} holds adapters of other settings: {'; '.join(differences)}")
    if saved.get("base_sha256") != base_digest(model_dir):
        raise LoraError(f"{checkpoint} holds adapters trained on another base model than {model_dir} (its weight "
                        "files differ): resume onto the base model it was trained on")


@dataclass(frozen=True)
class AdapterLayout:
    """A LoRA run's adapters as its weight pushes carry and merge them (asyncgrpo/weights/adapters.py):
    each targeted layer's module path and its weight's [out, in], in model order; the rank (A is
    [rank, in], B [out, rank]); and the merge's scale, alpha / rank as `LoraLinear` computes it."""

    shapes: dict[str, tuple[int, int]]
    rank: int
    scaling: float


def adapter_layout(model_dir: str, lora: LoraConfig) -> AdapterLayout:
    """The adapters `lora` puts on the model in `model_dir`, from its config on the meta device (no
    weights read); raises LoraError as `resolve_targets` does."""
    from asyncgrpo.models.shapes import meta_model_of

    targets = resolve_targets(meta_model_of(model_dir), lora)
    return AdapterLayout({path: (m.out_features, m.in_features) for path, m in targets.items()}, lora.rank,
                         lora.alpha / lora.rank)


def check_model(lora: LoraConfig, model_dir: str) -> list[str]:
    """Preflight: the targeted layers of the model in `model_dir`, built on the meta device (no
    weights); raises LoraError for a target it lacks or a rank too large. [] when LoRA is off."""
    if lora.rank == 0:
        return []
    from asyncgrpo.models.shapes import meta_model_of

    return list(resolve_targets(meta_model_of(model_dir), lora))
