"""Named shapes of real architectures, written as randomly initialised Hugging Face directories.

`make_model("qwen2.5-0.5b", out_dir)` writes config.json, generation_config.json, float32
safetensors and a locally trained byte-level BPE tokenizer (asyncgrpo/models/bpe.py) that
transformers and vLLM load as they are. The weights are random: they exercise the machinery
(weight pushes, memory, long sequences, vocabulary-sized log-softmaxes), not learning.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncgrpo.models import bpe


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A Qwen2 architecture's sizes (config.json keys in parentheses)."""

    name: str
    description: str
    vocab_size: int  # (vocab_size) rows of the embedding; the tokenizer may be smaller
    hidden_size: int
    num_layers: int  # (num_hidden_layers)
    num_heads: int  # (num_attention_heads)
    num_kv_heads: int  # (num_key_value_heads)
    intermediate_size: int
    max_positions: int  # (max_position_embeddings)
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: heads must divide hidden_size and kv heads must divide heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_QWEN25_05B = {"vocab_size": 151_936, "hidden_size": 896, "num_heads": 14, "num_kv_heads": 2,
               "intermediate_size": 4_864, "max_positions": 32_768}

SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(name="qwen2.5-0.5b", description="Qwen2.5-0.5B: 24 layers, tied embeddings, 494M parameters",
                   num_layers=24, **_QWEN25_05B),
        ModelShape(name="qwen2.5-0.5b-2l", description="Qwen2.5-0.5B's widths and vocabulary with 2 layers",
                   num_layers=2, **_QWEN25_05B),
        ModelShape(name="qwen2.5-7b", description="Qwen2.5-7B: 28 layers, untied embeddings, 7.6B parameters "
                                                  "(for config checks; 30 GB to write)",
                   vocab_size=152_064, hidden_size=3_584, num_layers=28, num_heads=28, num_kv_heads=4,
                   intermediate_size=18_944, max_positions=32_768, tie_word_embeddings=False),
        # head_dim 64: one of the sizes vLLM's CPU attention runs (runtime/resources.py).
        ModelShape(name="tiny-fullvocab", description="Qwen2.5's 151,936-token vocabulary, small widths, for tests",
                   vocab_size=151_936, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                   intermediate_size=256, max_positions=2_048),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def qwen2_config(shape: ModelShape, *, eos_token_id: int | None = None, bos_token_id: int | None = None):
    """The transformers Qwen2Config of a shape (float32, no sliding window, Qwen's rope and norm)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        max_window_layers=shape.num_layers,
        use_sliding_window=False,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_word_embeddings,
        hidden_act="silu",
        initializer_range=0.02,
        # No pad_token_id, as in Qwen's own config: it would make the embedding row a padding_idx
        # (zeroed, and masked from the embedding's gradient). Padding is the tokenizer's business.
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        dtype="float32",
    )


def meta_model(config):
    """The model of a config on the meta device: names, shapes and parameter counts, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def meta_model_of(model_dir: str | Path):
    """The model in `model_dir` (its config.json alone: no weights read) on the meta device."""
    from transformers import AutoConfig

    return meta_model(AutoConfig.from_pretrained(model_dir))


def count_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once), on any device, meta included."""
    return sum(p.numel() for p in model.parameters())


def shape_parameter_count(shape: ModelShape) -> int:
    return count_parameters(meta_model(qwen2_config(shape)))


@dataclass(frozen=True)
class MadeModel:
    path: Path
    shape: str
    num_parameters: int  # distinct parameters of the written model (tied embeddings once)
    tokenizer_size: int  # len(tokenizer), special tokens included


def make_model(
    shape_name: str,
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_train_size: int = bpe.DEFAULT_VOCAB_SIZE,
) -> MadeModel:
    """Writes a random model of a named shape and a locally trained tokenizer into `out_dir`, which
    must be missing or empty. Same shape, seed and vocabulary size: same files. Written beside
    `out_dir` and renamed into place, so a crash never leaves a half-written model under its name.

    Peak memory is about one float32 copy of the model plus one shard being serialised."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    shape = get_shape(shape_name)
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    if vocab_train_size > shape.vocab_size:
        raise ValueError(f"vocabulary size {vocab_train_size} exceeds the {shape.name} embedding's "
                         f"{shape.vocab_size} rows")
    tokenizer = bpe.train_tokenizer(vocab_train_size, seed=seed, model_max_length=shape.max_positions)
    eos, pad = tokenizer.convert_tokens_to_ids([bpe.EOS_TOKEN, bpe.PAD_TOKEN])
    config = qwen2_config(shape, eos_token_id=eos)
    with torch.random.fork_rng(devices=[]):  # the seed fixes the init without touching global RNG state
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    num_parameters = count_parameters(model)
    # Stop at the end of a turn or of a text, as Qwen2.5-Instruct does. Token ids only: sampling
    # settings here (temperature, top_p, ...) would become vLLM's default sampling parameters.
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Shards bound the serialisation buffer (safetensors copies a shard's bytes before writing it).
        model.save_pretrained(tmp, max_shard_size="512MB")
        del model
        tokenizer.save_pretrained(tmp)
        _write_chat_template_into_config(tmp)
        (tmp / "asyncgrpo_model.json").write_text(json.dumps(
            {"shape": shape.to_dict(), "seed": seed, "vocab_train_size": vocab_train_size,
             "num_parameters": num_parameters, "tokenizer": "byte-level BPE trained locally (asyncgrpo.models.bpe)",
             "weights": "random (transformers' Qwen2 init under the seed)"}, indent=2) + "\n")
        _readable_as_umask_allows(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return MadeModel(path=out, shape=shape.name, num_parameters=num_parameters, tokenizer_size=len(tokenizer))


def _readable_as_umask_allows(directory: Path) -> None:
    """safetensors writes its files with mode 0600; give every file the mode a plain write would."""
    umask = os.umask(0)
    os.umask(umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def _write_chat_template_into_config(directory: Path) -> None:
    """transformers 5 saves the chat template as chat_template.jinja; older readers look for it in
    tokenizer_config.json. Both carry the same template."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = bpe.CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
