"""How far the policy has moved from the one that sampled the tokens, by the tokens' age, and a hard cap
per group (``train.staleness_control=divergence``, ``train.divergence_cap``; docs/ALGORITHMS.md,
Divergence-gated staleness).

API
---
``age_bucket_sums(logp, rollout_logp, mask, ages, num_buckets) -> [num_buckets, 5]``
    Per age bucket (a token's age = learner version - the version that sampled it; bucket a holds
    age a, the last bucket every age >= num_buckets - 1): the sums (tokens, age, k3, w, w^2) over
    the real tokens, with lt = clamp(logp - rollout_logp, +-20), k3 = exp(lt) - 1 - lt and
    w = exp(lt). Sums, so micro-batches and learner ranks add up (a plain all-reduce) before
    ``bucket_divergences`` turns them into means.

``bucket_divergences(sums) -> (buckets, metrics)``
    From the (added-up) sums: per non-empty bucket (mean age, tokens, mean k3, normalised ESS
    (sum w)^2 / (n sum w^2), in (0, 1]), as plain floats for the bound's control law
    (asyncgrpo/queue/bound_control.py), and the metrics ``divergence/k3_age_<a>``,
    ``divergence/ess_age_<a>``, ``divergence/tokens_age_<a>`` (a count) and ``divergence/mean_age_<a>``
    (``<a>`` = 0, 1, ... and ``<last>plus`` for the last bucket), empty buckets left out.

``group_cap(logp, rollout_logp, mask, group_index, *, cap, action) -> (row_scale, capped_groups)``
    The per-group mean k3 over the group's real tokens among these rows; a group beyond ``cap``
    (> 0) gets row_scale 0 on each of its rows (``action="drop"``: the caller masks its tokens) or
    cap / its mean k3 (``"downweight"``: the caller scales its loss); other rows 1.

Shapes: logp, rollout_logp, mask, ages [B, T]; group_index [B] (any integer ids); row_scale [B].
``logp`` is the current policy's (the forward pass under way in bypass mode, the recomputed
proximal log-probs otherwise): nothing here runs a model. Everything is computed without gradient.
"""

from __future__ import annotations

import math

import torch

from asyncgrpo.algo._checks import check_choice, check_mask, check_same_shape, check_token_tensor
from asyncgrpo.algo.correction import LOG_RATIO_BOUND

CAP_ACTIONS = ("drop", "downweight")
# Columns of age_bucket_sums.
TOKENS, AGE, K3, W, W2 = range(5)


def _log_ratio(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped log-ratio 0 off the mask, keep mask as bool), both [B, T], detached."""
    logp = check_token_tensor("logp", logp).detach()
    rollout_logp = check_token_tensor("rollout_logp", rollout_logp).detach()
    check_same_shape("rollout_logp", rollout_logp, "logp", logp)
    keep = check_mask(mask, "logp", logp)
    lt = (logp - rollout_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).masked_fill(~keep, 0)
    return lt, keep


def age_bucket_sums(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, ages: torch.Tensor,
                    num_buckets: int) -> torch.Tensor:
    """[num_buckets, 5] float64 sums (tokens, age, k3, w, w^2) per age bucket; see the module docstring."""
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    with torch.no_grad():
        lt, keep = _log_ratio(logp, rollout_logp, mask)
        check_same_shape("ages", ages, "logp", logp)
        age = ages.long()[keep]
        if bool((age < 0).any()):
            raise ValueError("a token is younger than the learner (negative age): versions are inconsistent")
        lt = lt[keep].double()
        w = lt.exp()
        columns = torch.stack([torch.ones_like(lt), age.double(), torch.expm1(lt) - lt, w, w.square()], dim=1)
        sums = torch.zeros(num_buckets, 5, dtype=torch.float64, device=lt.device)
        return sums.index_add_(0, age.clamp(max=num_buckets - 1), columns)


def bucket_divergences(sums: torch.Tensor) -> tuple[list[tuple[float, float, float, float]], dict[str, float]]:
    """([(mean age, tokens, mean k3, normalised ESS) per non-empty bucket], metrics); see the module docstring."""
    rows = sums.detach().cpu().double().tolist()
    buckets: list[tuple[float, float, float, float]] = []
    metrics: dict[str, float] = {}
    for index, row in enumerate(rows):
        tokens = row[TOKENS]
        if tokens <= 0:
            continue
        k3 = row[K3] / tokens
        ess = row[W] ** 2 / (tokens * row[W2]) if row[W2] > 0 else 0.0
        buckets.append((row[AGE] / tokens, tokens, k3, ess))
        name = f"{index}plus" if index == len(rows) - 1 else str(index)
        metrics[f"divergence/k3_age_{name}"] = k3
        metrics[f"divergence/ess_age_{name}"] = ess
        metrics[f"divergence/tokens_age_{name}"] = tokens
        metrics[f"divergence/mean_age_{name}"] = row[AGE] / tokens
    return buckets, metrics


def group_cap(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor, *,
              cap: float, action: str) -> tuple[torch.Tensor, int]:
    """([B] row scale, groups capped); see the module docstring. `cap` 0 caps nothing."""
    check_choice("action", action, CAP_ACTIONS)
    if not (cap >= 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number >= 0, got {cap}")
    with torch.no_grad():
        lt, keep = _log_ratio(logp, rollout_logp, mask)
        scale = torch.ones(lt.shape[0], dtype=torch.float32, device=lt.device)
        if cap == 0 or lt.shape[0] == 0:
            return scale, 0
        if group_index.shape != (lt.shape[0],):
            raise ValueError(f"group_index must be [{lt.shape[0]}], got {list(group_index.shape)}")
        groups, row_group = torch.unique(group_index, return_inverse=True)
        k3_sum = torch.zeros(len(groups), dtype=torch.float64, device=lt.device)
        tokens = torch.zeros_like(k3_sum)
        k3_sum.index_add_(0, row_group, (torch.expm1(lt) - lt).masked_fill(~keep, 0).double().sum(1))
        tokens.index_add_(0, row_group, keep.double().sum(1))
        mean_k3 = k3_sum / tokens.clamp(min=1)
        capped = mean_k3 > cap
        per_group = torch.where(capped, cap / mean_k3.clamp(min=1e-30), 1.0) if action == "downweight" \
            else torch.where(capped, 0.0, 1.0)
        return per_group[row_group].float(), int(capped.sum())
