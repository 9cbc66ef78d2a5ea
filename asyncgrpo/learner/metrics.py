"""The learner's step metrics, defined in one place.

    loss/*, optim/*, is/*, ...   update(): per micro-batch, merged over micro-batches and ranks
    time/optimizer_s, time/recompute_s   update(): parts of time/train_s (recompute: 0 under algo.mode=bypass)
    policy/entropy                update(): mean entropy of the sampling distribution over the trained tokens
    overlong/*                    update(): algo.overlong's masked share and mean penalty
    step, samples, perf/*, reward/mean|std|all_equal_frac, staleness/*, response/*   batch_metrics()
    reward/<term>                 reward_term_metrics(): the groups' reward terms
    time/*, learner/ack_waits     the step's phases (PhaseTimer)
    time/gen_idle_s, reward/errors, reward/calls, reward/groups_dropped   the generators' reports (registry)
    reward/error_rate             failed / all reward calls over reward.error_window_steps (registry)
    queue/*, wire/*, audit/*      the group source's counters (audit/*: asyncgrpo/queue/audit.py)
    reward/all_equal_frac_arrived arrived_all_equal_fraction(): all-equal groups before algo.filter_groups
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from asyncgrpo.learner.batch import Batch


def combine_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge per-micro-batch metrics: max of maxima, min of minima, token-weighted mean otherwise."""
    if len(parts) == 1:
        return dict(parts[0][1])
    total = sum(weight for weight, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [(weight, metrics[key]) for weight, metrics in parts if key in metrics]
        if key.endswith("/max"):
            merged[key] = max(v for _, v in values)
        elif key.endswith("/min"):
            merged[key] = min(v for _, v in values)
        else:
            merged[key] = sum(w * v for w, v in values) / total
    return merged


def reduce_metrics(parts: list[tuple[float, dict[str, float]]], sums: dict[str, float], world_size: int,
                   device: torch.device) -> dict[str, float]:
    """`combine_metrics` over every rank's micro-batches, plus `sums` added up over ranks.

    Every rank must call it (collectives) with the same keys; a rank whose micro-batches were all
    padding passes weight-0 parts.
    """
    if world_size == 1:
        return {**combine_metrics(parts), **sums}
    keys = sorted(parts[0][1])
    maxima = [k for k in keys if k.endswith("/max")]
    minima = [k for k in keys if k.endswith("/min")]
    means = [k for k in keys if k not in maxima and k not in minima]
    real = [(w, m) for w, m in parts if w > 0]
    total = [sum(w for w, _ in real)] + [sum(w * m[k] for w, m in real) for k in means] + [sums[k] for k in sorted(sums)]
    counts = torch.tensor([len(keys), -len(keys)], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if counts[0] != len(keys) or -counts[1] != len(keys):
        raise RuntimeError(f"learner ranks logged different metrics (this rank: {len(keys)} keys)")
    summed = torch.tensor(total, dtype=torch.float64, device=device)
    high = torch.tensor([max((m[k] for _, m in real), default=-math.inf) for k in maxima] or [0.0],
                        dtype=torch.float64, device=device)
    low = torch.tensor([min((m[k] for _, m in real), default=math.inf) for k in minima] or [0.0],
                       dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    values = summed.tolist()
    weight = values[0] or 1.0
    merged = {k: v / weight for k, v in zip(means, values[1:1 + len(means)])}
    merged.update(zip(maxima, high.tolist()))
    merged.update(zip(minima, low.tolist()))
    merged.update(zip(sorted(sums), values[1 + len(means):]))
    return merged


def batch_metrics(batch: Batch, staleness: torch.Tensor, version: int, samples_consumed: int,
                  max_new_tokens: int) -> dict[str, float]:
    """What a step trained on. `staleness` [G]: learner version minus each group's oldest policy token
    version; `max_new_tokens`: the generators' completion limit (rollout.max_new_tokens).

    response/length_* count every completion token, an environment's observations included (the
    budget rollout.max_new_tokens counts them too); perf/tokens and the per-token staleness count
    the policy's tokens, the trained ones."""
    lengths = batch.completion_lengths
    return {
        "step": version,
        "samples": samples_consumed,
        "perf/samples": batch.num_samples,
        "perf/tokens": batch.num_tokens,
        "reward/mean": batch.rewards.mean().item(),
        "reward/std": batch.rewards.std().item(),
        "staleness/min": staleness.min().item(),
        "staleness/mean": staleness.float().mean().item(),
        "staleness/max": staleness.max().item(),
        "response/length_mean": lengths.float().mean().item(),
        "response/length_max": lengths.max().item(),
        **length_percentiles(lengths),
        # Completions the generator cut at rollout.max_new_tokens without stopping (algo.overlong).
        "response/truncated_frac": batch.truncated.float().mean().item(),
        # Completions that used all of rollout.max_new_tokens: cut at the limit (or ending at it exactly).
        "response/clipped_frac": (lengths >= max_new_tokens).float().mean().item(),
        # Groups whose samples all got the same reward: zero advantage, so no gradient from them.
        "reward/all_equal_frac": all_equal_fraction(batch.rewards, batch.group_index),
        # Share of the completion tokens an environment inserted (multi-turn observations, never trained).
        "response/env_token_frac": env_token_fraction(batch.mask, lengths),
        "prompt/length_mean": (batch.attention_mask.sum(1) - lengths).float().mean().item(),
        # Versions within one completion (> 0: the weights changed mid-generation, rollout.inflight_updates).
        "staleness/inflight_span_max": version_span(batch.token_versions, batch.mask).max().item(),
        # `version` counts the steps taken, this one included: it trained at version - 1.
        **token_age_histogram(version - 1, batch.token_versions, batch.mask),
    }


TOKEN_AGE_BUCKETS = 4  # staleness/tokens_age_0 .. _3, then _4plus


def env_token_fraction(mask: torch.Tensor, completion_lengths: torch.Tensor) -> float:
    """Share of the completion tokens that are not the policy's: mask [B, T] the policy mask,
    completion_lengths [B] every completion token (0 when there are none)."""
    total = float(completion_lengths.sum())
    return (total - float(mask.sum())) / total if total else 0.0


def token_age_histogram(version: int, token_versions: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The share of a step's trained completion tokens [B, T] (where `mask`, the policy mask) sampled
    0, 1, 2, 3 and 4 or more versions before `version`: with in-flight loads a completion's tokens
    span versions, and this is how old what is trained actually was, token by token (an
    environment's tokens have no version that counts)."""
    ages = (version - token_versions.long())[mask.bool()]
    total = max(1, ages.numel())
    shares = {f"staleness/tokens_age_{k}": float((ages == k).sum()) / total for k in range(TOKEN_AGE_BUCKETS)}
    shares[f"staleness/tokens_age_{TOKEN_AGE_BUCKETS}plus"] = float((ages >= TOKEN_AGE_BUCKETS).sum()) / total
    return shares


def length_percentiles(lengths: torch.Tensor) -> dict[str, float]:
    """response/length_p50, _p90, _p99 of completion lengths [B] (tokens; linear interpolation
    between the nearest lengths, torch.quantile's default): the tail a mean hides."""
    values = torch.quantile(lengths.double(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {f"response/length_p{q}": v for q, v in zip((50, 90, 99), values)}


def all_equal_fraction(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """Share of the groups whose rewards are all equal: rewards [B], group_index [B] (ids 0..G-1)."""
    groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    if groups == 0:
        return 0.0
    rewards = rewards.double()
    high = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards, "amax")
    low = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards, "amin")
    present = torch.zeros(groups, dtype=torch.bool).index_fill(0, group_index, True)
    return float(((high == low) & present).sum()) / max(1, int(present.sum()))


def arrived_all_equal_fraction(metrics: dict[str, float], filtered_before: int, groups: int) -> tuple[int, float]:
    """(queue/filtered now, reward/all_equal_frac_arrived): the share of all-equal groups among those
    that arrived for this step before algo.filter_groups dropped any: the groups it dropped since the
    last step (`filtered_before`: queue/filtered then) plus the step's own all-equal ones (its
    `reward/all_equal_frac` of `groups`), over both. Without the filter it is reward/all_equal_frac."""
    filtered = int(metrics.get("queue/filtered", 0))
    dropped = max(0, filtered - filtered_before)
    kept_equal = metrics["reward/all_equal_frac"] * groups
    return filtered, (dropped + kept_equal) / max(1, dropped + groups)


def version_span(token_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B]: newest minus oldest version among each sample's tokens where `mask` (the policy's; 0 for
    a completion without any)."""
    real = mask.bool()
    big = torch.iinfo(torch.int64).max
    versions = token_versions.long()
    newest = torch.where(real, versions, torch.full_like(versions, -big)).max(1).values
    oldest = torch.where(real, versions, torch.full_like(versions, big)).min(1).values
    return torch.where(real.any(1), newest - oldest, torch.zeros_like(newest))


def rate_metrics(metrics: dict[str, float], step_s: float) -> dict[str, float]:
    return {
        "time/step_s": step_s,
        "perf/samples_per_s": metrics["perf/samples"] / step_s,
        "perf/tokens_per_s": metrics["perf/tokens"] / step_s,
    }
