"""Checks of a Hugging Face model directory before anything heavy starts, with one-line errors.

`check_model_dir(path, max_positions_needed)` reads config.json and the tokenizer, builds the model
on the meta device (names, shapes, parameter count; no weight is read or allocated) and asks vLLM's
registry whether it can load the architecture (vLLM is imported only for that, and only when the
other checks passed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

# Any one of these makes a directory "have a tokenizer" (fast, BPE, SentencePiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tiktoken.model", "spiece.model")


class ModelDirError(ValueError):
    """A model directory that cannot be used; the message is one line naming the directory."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    vocab_size: int  # rows of the embedding (config.vocab_size)
    tokenizer_size: int  # len(tokenizer): ids the tokenizer can produce, special tokens included
    hidden_size: int
    num_layers: int
    max_positions: int  # config.max_position_embeddings
    num_parameters: int  # distinct parameters (tied embeddings once)
    largest_tensor: str  # its name in the model's state dict
    largest_tensor_shape: tuple[int, ...]
    largest_tensor_bytes: int  # in float32
    dtype: str  # the dtype config.json declares ("unspecified" if none)
    tie_word_embeddings: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _fail(path: Path, reason: str) -> ModelDirError:
    return ModelDirError(f"model directory {path}: {' '.join(reason.split())}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def vllm_supported_architectures() -> frozenset[str]:
    """The architectures vLLM's model registry can load (imports vLLM: seconds)."""
    from vllm.model_executor.models import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def _load_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise _fail(path, "no config.json")
    try:
        json.loads((path / "config.json").read_text())
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any failure to read the config is the directory's
        raise _fail(path, f"config.json does not load: {_first_line(err)}") from None


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise _fail(path, f"no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001
        raise _fail(path, f"the tokenizer does not load: {_first_line(err)}") from None


def _meta_summary(path: Path, config) -> tuple[int, str, tuple[int, ...]]:
    """Parameter count and the largest tensor of the model, built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001
        raise _fail(path, f"transformers cannot build the model: {_first_line(err)}") from None
    num_parameters = sum(p.numel() for p in model.parameters())
    # The state dict is what a weight push carries (a tied lm_head appears under its own name too;
    # the first name of the largest shape is reported).
    name, tensor = max(model.state_dict().items(), key=lambda item: item[1].numel())
    return num_parameters, name, tuple(tensor.shape)


# The safetensors format's own limit on a header (its Rust reader refuses larger ones).
SAFETENSORS_MAX_HEADER = 100_000_000


def weights_error(path: str | Path) -> str | None:
    """Why the directory holds no loadable weights, or None: no *.safetensors or pytorch_model*.bin,
    a shard its index names that is not there, or a safetensors file whose header does not read
    (a cut or foreign file). Reads only each file's header, not its tensors."""
    directory = Path(path).expanduser()
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index.name} does not read ({type(err).__name__})"
        if not all(isinstance(name, str) and name for name in shards):
            return f"{index.name}: its weight_map must name shard files"
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            return f"{index.name} names {len(missing)} missing shard(s), {missing[0]} first"
        files = [directory / name for name in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None if any(directory.glob("pytorch_model*.bin")) else "no weights (*.safetensors or pytorch_model*.bin)"
    for file in files:
        problem = _safetensors_header_error(file)
        if problem:
            return f"{file.name}: {problem}"
    return None


def _safetensors_header_error(file: Path) -> str | None:
    """A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 0 < length <= SAFETENSORS_MAX_HEADER or 8 + length > size:
                return f"not a safetensors file ({size} bytes; header length {length})"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"its safetensors header does not read ({type(err).__name__})"
    return None if isinstance(header, dict) else "its safetensors header is not a JSON object"


def check_model_dir(
    path: str | Path,
    max_positions_needed: int | None,
    *,
    supported_architectures: Collection[str] | None = None,
) -> ModelInfo:
    """Raises ModelDirError (one line) for: a missing directory or config.json, a directory without
    a tokenizer (or one that does not load), a tokenizer larger than the model's embedding, a
    context (max_position_embeddings) shorter than `max_positions_needed` (None: not checked), an
    architecture vLLM cannot load. `supported_architectures` replaces vLLM's registry (None = ask
    vLLM)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise _fail(directory, "not a directory")
    config = _load_config(directory)
    text_config = config.get_text_config()
    tokenizer = _load_tokenizer(directory)
    vocab_size = int(text_config.vocab_size)
    if len(tokenizer) > vocab_size:
        raise _fail(directory, f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                               f"{vocab_size} rows (config.json vocab_size)")
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if max_positions_needed is not None and max_positions is not None and max_positions < max_positions_needed:
        raise _fail(directory, f"context of {max_positions} positions (max_position_embeddings) is shorter than "
                               f"the {max_positions_needed} needed (longest prompt + rollout.max_new_tokens)")
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        raise _fail(directory, "config.json names no architectures")
    supported = vllm_supported_architectures() if supported_architectures is None else supported_architectures
    if not any(arch in supported for arch in architectures):
        raise _fail(directory, f"vLLM cannot load architecture {', '.join(architectures)} (not in vLLM's model "
                               f"registry)")
    num_parameters, largest, largest_shape = _meta_summary(directory, config)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return ModelInfo(
        path=str(directory),
        architecture=next(arch for arch in architectures if arch in supported),
        vocab_size=vocab_size,
        tokenizer_size=len(tokenizer),
        hidden_size=int(text_config.hidden_size),
        num_layers=int(text_config.num_hidden_layers),
        max_positions=int(max_positions) if max_positions is not None else 0,
        num_parameters=num_parameters,
        largest_tensor=largest,
        largest_tensor_shape=largest_shape,
        largest_tensor_bytes=math.prod(largest_shape) * 4,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "unspecified",
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )
