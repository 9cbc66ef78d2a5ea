"""Policy entropy per token, from the logits that predict each response token."""

from __future__ import annotations

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dimension: logits [..., V] -> [...], in nats.

    Computed as logsumexp(z) - sum(p * z), which stays finite where some logits are -inf (masked
    tokens have p = 0 and contribute nothing). Pass logits already divided by the temperature to get
    the entropy of the sampling distribution.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    logits = logits.float()
    probs = logits.softmax(-1)
    weighted = torch.where(probs > 0, probs * logits, torch.zeros_like(logits)).sum(-1)
    return logits.logsumexp(-1) - weighted
