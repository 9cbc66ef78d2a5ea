"""Tiny Qwen2 models with a character-level tokenizer, and their supervised warm start."""

from asyncgrpo.models.tiny import (
    VLLM_CPU_ENGINE_KWARGS,
    TinyModelSpec,
    build_model,
    save_model,
)
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.models.warmstart import ensure_warm_model

__all__ = [
    "VLLM_CPU_ENGINE_KWARGS",
    "TinyModelSpec",
    "build_char_tokenizer",
    "build_model",
    "ensure_warm_model",
    "save_model",
]
