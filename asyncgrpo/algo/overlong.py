"""Long completions: what a completion cut at the token limit does to the update (``algo.overlong``),
and which groups carry no GRPO signal (``algo.filter_groups``).

Shapes: B responses, T response tokens; ``rewards``, ``lengths``, ``truncated`` [B]; ``mask`` [B, T].

* ``keep``: a truncated completion is trained like any other (its reward, often 0, is its verdict).
* ``mask``: its tokens carry no loss (their mask is 0), but its reward still counts in its group's
  mean and std: the baseline of the other samples is what it would have been, and a masked
  completion changes neither the loss nor its gradient through its own tokens.
* ``penalty``: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13; verl's DAPO reward
  manager) is added to every completion's reward before the advantages, by length alone: 0 up to
  ``max_new_tokens - buffer_tokens`` tokens, then falling linearly to ``-penalty`` at
  ``max_new_tokens``. Deviation: clamped at ``-penalty`` for a completion longer than the limit
  (a recording replayed with a smaller ``rollout.max_new_tokens``); verl cannot meet one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OVERLONG_MODES = ("keep", "mask", "penalty")


@dataclass(frozen=True)
class OverlongSettings:
    """The ``algo.overlong*`` keys and the limit they refer to (rollout.max_new_tokens)."""

    mode: str
    max_new_tokens: int
    buffer_tokens: int
    penalty: float

    def __post_init__(self) -> None:
        if self.mode not in OVERLONG_MODES:
            raise ValueError(f"mode must be one of {', '.join(OVERLONG_MODES)}, got {self.mode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.mode == "penalty" and not 1 <= self.buffer_tokens <= self.max_new_tokens:
            raise ValueError(f"buffer_tokens must be in [1, max_new_tokens={self.max_new_tokens}], got {self.buffer_tokens}")
        if not self.penalty >= 0:  # also NaN
            raise ValueError(f"penalty must be >= 0, got {self.penalty}")


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, <= 0: lengths [B] -> [B] float32.

    ``-(length - (max_new_tokens - buffer_tokens)) / buffer_tokens * penalty`` inside the window of
    the last ``buffer_tokens`` tokens, 0 before it, ``-penalty`` at (and past) ``max_new_tokens``.
    """
    if buffer_tokens < 1:
        raise ValueError(f"buffer_tokens must be >= 1, got {buffer_tokens}")
    exceed = lengths.float() - float(max_new_tokens - buffer_tokens)
    return (-exceed / buffer_tokens * penalty).clamp(min=-penalty, max=0.0)


def apply_overlong(rewards: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor,
                   settings: OverlongSettings) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(rewards for the advantages [B], loss mask [B, T], metrics) under ``settings.mode``.

    rewards [B] float; mask [B, T] 0/1; lengths [B] completion lengths in tokens; truncated [B] 0/1
    (the generator's flag: cut at the limit without stopping). The inputs are not modified.
    Metrics: ``overlong/masked_frac`` (share of completions whose tokens carry no loss) and
    ``overlong/penalty_mean`` (mean reward added, <= 0).
    """
    if not (rewards.dim() == lengths.dim() == truncated.dim() == 1 and mask.dim() == 2):
        raise ValueError(f"rewards, lengths, truncated must be [B] and mask [B, T], got {tuple(rewards.shape)}, "
                         f"{tuple(lengths.shape)}, {tuple(truncated.shape)}, {tuple(mask.shape)}")
    if not rewards.shape[0] == lengths.shape[0] == truncated.shape[0] == mask.shape[0]:
        raise ValueError(f"B differs: rewards {rewards.shape[0]}, lengths {lengths.shape[0]}, "
                         f"truncated {truncated.shape[0]}, mask {mask.shape[0]}")
    count = max(1, rewards.shape[0])
    masked = torch.zeros_like(rewards, dtype=torch.bool)
    if settings.mode == "mask":
        masked = truncated.bool()
        mask = mask * (~masked).unsqueeze(1).to(mask.dtype)
    shaped = advantage_rewards(rewards, lengths, settings)
    added = (shaped - rewards).float()
    rewards = shaped
    metrics = {"overlong/masked_frac": float(masked.sum()) / count, "overlong/penalty_mean": float(added.sum()) / count}
    return rewards, mask, metrics


def advantage_rewards(rewards: torch.Tensor, lengths: torch.Tensor, settings: OverlongSettings) -> torch.Tensor:
    """The rewards [B] the advantages see: under ``penalty`` plus ``overlong_penalty`` of the lengths
    [B]; otherwise ``rewards`` itself. The one place both the update and algo.filter_groups read."""
    if settings.mode != "penalty":
        return rewards
    added = overlong_penalty(lengths, settings.max_new_tokens, settings.buffer_tokens, settings.penalty)
    return rewards + added.to(rewards.dtype)


def carries_signal(rewards: torch.Tensor) -> bool:
    """Whether one group's rewards [n] differ: a group whose rewards are all equal has advantage 0 for
    every sample under every ``algo.advantage`` mode, so it adds nothing to the policy gradient."""
    return bool(rewards.numel() > 1 and (rewards != rewards[0]).any())
