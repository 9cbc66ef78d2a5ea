"""Group-relative advantages for outcome rewards (one scalar reward per response).

API
---
``group_advantages(rewards, group_ids, *, mode, eps=1e-6) -> Tensor[B]``

Responses that share a group id (the prompt they answer) form a group with n members, mean m and
unbiased standard deviation s:

* ``grpo``:    A_i = (R_i - m) / (s + eps)
* ``drgrpo``:  A_i = R_i - m                        (Dr.GRPO: no division by s)
* ``rloo``:    A_i = n / (n - 1) * (R_i - m)        (R_i minus the mean of the other n - 1 rewards)

A group whose rewards are all equal, including a group of one, gets A = 0 exactly. verl returns
R_i / (1 + eps) for a singleton group under GRPO; asyncgrpo returns 0 (deviation, see
docs/ALGORITHMS.md). The per-token advantage the losses take is ``advantages[:, None] * mask``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from asyncgrpo.algo._checks import check_choice, check_real, check_tensor

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence[Hashable] | np.ndarray,
    *,
    mode: str,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of every response relative to the other responses of its group.

    Args:
        rewards: [B] scalar reward per response (any real dtype; integers become the default float).
        group_ids: [B] group of each response: an integer tensor or array, or any sequence of
            hashable ids (prompt uuids, strings, tuples).
        mode: ``"grpo"``, ``"drgrpo"`` or ``"rloo"`` (algo.advantage).
        eps: added to the group standard deviation under ``grpo``; must be >= 0.

    Returns:
        [B] advantages, same device as ``rewards``, detached from any autograd graph.

    Raises:
        ValueError: unknown mode, negative eps, rewards not 1-D or not finite, length mismatch,
            non-integer group id tensor.
    """
    check_choice("mode", mode, ADVANTAGE_MODES)
    eps = check_real("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    rewards = check_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [B], got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    group_index = _dense_group_index(group_ids, len(rewards)).to(rewards.device)

    with torch.no_grad():
        return _group_relative(rewards.detach(), group_index, mode, eps)


def _dense_group_index(group_ids: object, batch_size: int) -> torch.Tensor:
    """Map arbitrary group ids to 0..G-1 (a [B] int64 tensor)."""
    if isinstance(group_ids, np.ndarray) and np.issubdtype(group_ids.dtype, np.integer):
        group_ids = torch.from_numpy(group_ids)
    if isinstance(group_ids, torch.Tensor):
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids tensor must have an integer dtype, got {group_ids.dtype}")
        if group_ids.dim() != 1 or len(group_ids) != batch_size:
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} but rewards has shape ({batch_size},)")
        return torch.unique(group_ids, return_inverse=True)[1]
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Sequence | np.ndarray):
        raise ValueError(f"group_ids must be a tensor or a sequence of hashable ids, got {type(group_ids).__name__}")
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries but rewards has {batch_size}")
    dense_of_id: dict[Hashable, int] = {}
    try:
        dense = [dense_of_id.setdefault(group_id, len(dense_of_id)) for group_id in group_ids]
    except TypeError as error:
        raise ValueError(f"group_ids must hold hashable ids: {error}") from error
    return torch.tensor(dense, dtype=torch.long)


def _group_relative(rewards: torch.Tensor, group_index: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    num_groups = int(group_index.max()) + 1 if len(group_index) else 0
    dtype = rewards.dtype
    counts = torch.bincount(group_index, minlength=num_groups).to(dtype)
    sums = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, group_index, rewards)
    deviation = rewards - (sums / counts)[group_index]

    # (R - mean) is not exactly 0 in floating point when all rewards are equal (0.1 * 3 / 3 != 0.1),
    # and grpo would then divide rounding noise by a tiny std; equal groups are zeroed explicitly.
    group_max = torch.full_like(sums, -torch.inf).scatter_reduce(0, group_index, rewards, "amax")
    group_min = torch.full_like(sums, torch.inf).scatter_reduce(0, group_index, rewards, "amin")
    degenerate = (group_max == group_min)[group_index]

    count_per_response = counts[group_index]
    if mode == "grpo":
        squared = torch.zeros_like(sums).index_add_(0, group_index, deviation.square())
        unbiased_std = (squared / (counts - 1).clamp_min(1)).sqrt()
        advantages = deviation / (unbiased_std[group_index] + eps)
    elif mode == "drgrpo":
        advantages = deviation
    else:
        advantages = deviation * count_per_response / (count_per_response - 1).clamp_min(1)
    return torch.where(degenerate, torch.zeros_like(advantages), advantages)
