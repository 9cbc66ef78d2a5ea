"""A tiny model for log-prob comparisons with vLLM, shared by the integration tests that need one."""

from pathlib import Path

import torch

from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ModelConfig


def save_scaled_tiny_model(directory: Path) -> Path:
    """The embedded model's shape with random weights scaled up (N(0, 0.3)), saved in `directory`:
    its output distribution is far from uniform, which makes a log-prob mismatch (rotary positions,
    attention, norms, an adapter) visible."""
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3, generator=generator)
    save_model(model, tokenizer, directory)
    return directory
