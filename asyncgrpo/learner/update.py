"""One learner step of GRPO on a batch: advantages, under algo.mode=decoupled|naive the proximal
log-probs (one forward pass without gradient, before any optimizer step), then for each of
learner.mini_batches shares of the groups the loss over token-budget micro-batches with that
share's denominators, gradient clipping and an optimizer step; the schedule steps once. The loss
itself, per mode, is asyncgrpo.algo's; this module only orchestrates, and reads the algo section
into the loss's settings once per step (`loss_settings`).

Every rank holds the whole batch: advantages and the loss denominators (a mini-batch's global token
and sequence counts) come from all of it, so the update depends neither on how a mini-batch is
split into micro-batches nor on the number of ranks. Each rank trains on its share of each
mini-batch's groups; FSDP2 sums the gradients over ranks. A step is one policy version whatever
learner.mini_batches: the weights are pushed after its last optimizer step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from asyncgrpo import algo
from asyncgrpo.learner.batch import Batch, micro_batch_plan, mini_batch_rows, rank_shares
from asyncgrpo.learner.metrics import TOKEN_AGE_BUCKETS, reduce_metrics
from asyncgrpo.learner.policy import Policy
from asyncgrpo.schema import Config, LearnerConfig


@dataclass
class Divergence:
    """A step's divergence of the current policy from the sampling one, by token age, and its cap
    (train.divergence_cap), gathered micro-batch by micro-batch from the log-probs the loss already
    has (asyncgrpo/algo/divergence.py): nothing here runs a forward pass."""

    version: int | None  # the learner's (a token's age is version - its version); None: ages not measured
    cap: float  # train.divergence_cap (0: none)
    cap_action: str  # train.divergence_cap_action
    sums: torch.Tensor  # [TOKEN_AGE_BUCKETS + 1, 5] age_bucket_sums, this rank's so far
    capped_groups: int = 0

    def apply(self, current_logp: torch.Tensor, micro: Batch, advantages: torch.Tensor) -> tuple[Batch, torch.Tensor]:
        """Measure a micro-batch; returns it and its advantages [B] with the cap applied (a dropped
        group's tokens masked, a down-weighted group's advantages scaled: its loss scales with them)."""
        if self.version is not None:
            ages = self.version - micro.token_versions.long()
            self.sums += algo.age_bucket_sums(current_logp, micro.rollout_logp, micro.mask, ages, len(self.sums))
        if self.cap == 0:  # no cap (the default): nothing to judge on every micro-batch
            return micro, advantages
        scale, capped = algo.group_cap(current_logp, micro.rollout_logp, micro.mask, micro.group_index,
                                       cap=self.cap, action=self.cap_action)
        self.capped_groups += capped
        if not capped:
            return micro, advantages
        if self.cap_action == "drop":
            return dataclasses.replace(micro, mask=micro.mask * (scale > 0).to(micro.mask.dtype)[:, None]), advantages
        return micro, advantages * scale.to(advantages.dtype)

    def metrics(self, world_size: int) -> dict[str, float]:
        """divergence/* of the whole step: the sums and the capped count added over ranks (every rank
        calls it: the same values everywhere, so every rank's bound controller sees the same)."""
        flat = torch.cat([self.sums.reshape(-1), self.sums.new_tensor([float(self.capped_groups)])])
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(flat)
        sums = flat[:-1].reshape(self.sums.shape)
        _, metrics = algo.bucket_divergences(sums) if self.version is not None else ([], {})
        return {**metrics, "divergence/capped_groups": float(flat[-1])}


@dataclass
class MiniBatch:
    """A share of the step's whole groups that gets its own optimizer step (learner.mini_batches),
    as this rank trains it: `indices` its micro-batches' rows in `batch` (as many as the busiest
    rank's; those from `real` on are padding, a repeated row whose loss counts 0) and the denominators
    of the whole mini-batch on every rank (verl's: each mini-batch's loss is its own mean)."""

    batch: Batch
    advantages: torch.Tensor  # [B_m], computed over the whole step's batch
    indices: list[torch.Tensor]
    real: int
    global_tokens: float
    global_seqs: float

    @classmethod
    def plan(cls, batch: Batch, advantages: torch.Tensor, rows: list[int], learner: LearnerConfig, rank: int,
             world_size: int) -> "MiniBatch":
        index = torch.tensor(rows, dtype=torch.int64, device=batch.rewards.device)
        mini = batch.select(index)
        lengths = mini.attention_mask.sum(1).tolist()
        plans = [micro_batch_plan(lengths, share, learner.micro_batch_tokens, learner.bucket_by_length)
                 for share in rank_shares(mini, world_size)]
        mine = plans[rank]
        # Each forward and backward is a collective under FSDP2: every rank runs as many micro-batches
        # as the busiest one.
        num_micro = max(1, max(len(plan) for plan in plans))
        indices = [torch.tensor(mine[i] if i < len(mine) else [0], dtype=torch.int64, device=index.device)
                   for i in range(num_micro)]
        return cls(mini, advantages.index_select(0, index), indices, len(mine), float(mini.mask.sum()),
                   float((mini.mask.sum(1) > 0).sum()))


def update(policy: Policy, batch: Batch, cfg: Config, rank: int, world_size: int, *, max_new_tokens: int,
           version: int | None = None) -> dict[str, float]:
    """Every rank calls it with the same batch; returns the step's loss and optimizer metrics.
    `max_new_tokens`: the generators' completion limit (rollout.max_new_tokens), which the loss's
    constant normaliser and algo.overlong count against; `version`: the learner's, for the divergence
    by token age (None: not measured; the cap still applies)."""
    policy.model.train()
    settings = loss_settings(cfg, max_new_tokens)
    # Else KL is dropped, or fails deep in a step. Under LoRA the reference (adapters off) is always there.
    if (settings.kl is not None and not policy.has_reference) or (settings.kl is None and policy.reference is not None):
        raise ValueError(f"algo.kl.enabled={str(settings.kl is not None).lower()} but the policy has "
                         f"{'no' if policy.reference is None else 'a'} KL reference model")
    # algo.overlong: the rewards the advantages see and the mask the loss sees (denominators included).
    # Its lengths count every completion token, as rollout.max_new_tokens (observations included)
    # and the queue's algo.filter_groups do; the mask is the policy's, so denominators count its tokens.
    rewards, loss_mask, overlong_metrics = algo.apply_overlong(batch.rewards, batch.mask, batch.completion_lengths,
                                                               batch.truncated, overlong_settings(cfg, max_new_tokens))
    batch = dataclasses.replace(batch, mask=loss_mask)
    advantages = algo.group_advantages(rewards, batch.group_index, mode=cfg.algo.advantage)
    minis = [MiniBatch.plan(batch, advantages, rows, cfg.learner, rank, world_size)
             for rows in mini_batch_rows(batch.group_index.tolist(), cfg.learner.mini_batches)]
    prox_logps: list[list[torch.Tensor] | None] = [None] * len(minis)
    recompute_s = 0.0
    if settings.mode != "bypass":
        # The anchor is the weights before this step's first optimizer step: computed once, up
        # front, for every micro-batch of every mini-batch (verl's and AReaL's old policy).
        recompute_start = time.perf_counter()
        prox_logps = [proximal_logprobs(policy, mini.batch, mini.indices) for mini in minis]
        recompute_s = time.perf_counter() - recompute_start
    divergence = Divergence(version, cfg.train.divergence_cap, cfg.train.divergence_cap_action,
                            torch.zeros(TOKEN_AGE_BUCKETS + 1, 5, dtype=torch.float64, device=batch.rewards.device))
    parts: list[tuple[float, dict[str, float]]] = []
    loss_total = pg_total = grad_norm_total = optimizer_s = 0.0
    for mini, prox in zip(minis, prox_logps):
        policy.optimizer.zero_grad(set_to_none=True)
        loss, pg = gradient_pass(policy, mini, prox, settings, divergence, parts)
        loss_total, pg_total = loss_total + loss, pg_total + pg
        optimizer_start = time.perf_counter()
        grad_norm_total += optimizer_step(policy, cfg.learner.grad_clip_norm)
        optimizer_s += time.perf_counter() - optimizer_start
    # Each mini-batch's loss is its own mean: the step's is their mean (the ranks' shares add up).
    metrics = reduce_metrics(parts, {"loss/total": loss_total / len(minis), "loss/pg": pg_total / len(minis)},
                             world_size, policy.device)
    metrics.update(overlong_metrics)  # every rank holds the whole batch: the same values everywhere
    metrics.update(divergence.metrics(world_size))
    metrics["optim/lr"] = policy.optimizer.param_groups[0]["lr"]
    policy.scheduler.step()  # once per learner step, whatever learner.mini_batches: schedules count steps
    metrics["time/optimizer_s"] = optimizer_s  # part of time/train_s
    metrics["time/recompute_s"] = recompute_s  # part of time/train_s; 0 under bypass
    metrics["optim/grad_norm"] = grad_norm_total / len(minis)
    metrics["perf/micro_batches"] = sum(len(mini.indices) for mini in minis)
    metrics["perf/mini_batches"] = len(minis)
    return metrics


def gradient_pass(policy: Policy, mini: MiniBatch, prox_logps: list[torch.Tensor] | None,
                  settings: algo.LossSettings, divergence: Divergence,
                  parts: list[tuple[float, dict[str, float]]]) -> tuple[float, float]:
    """Forward and backward over `mini`'s micro-batches, gradients accumulated; each micro-batch's
    metrics appended to `parts` (weighted by its tokens, 0 for padding). Returns this rank's shares
    of the mini-batch's loss and policy loss (with global denominators the ranks' shares add up)."""
    loss_total = pg_total = 0.0
    for i, index in enumerate(mini.indices):
        padding = i >= mini.real
        micro = mini.batch.select(index)
        loss, metrics = micro_batch_loss(policy, micro, None if prox_logps is None else prox_logps[i],
                                         mini.advantages.index_select(0, index), settings, mini.global_tokens,
                                         mini.global_seqs, None if padding else divergence)
        (loss * 0.0 if padding else loss).backward()
        if padding:
            parts.append((0.0, metrics))
            continue
        loss_total += float(loss.detach())
        pg_total += metrics["loss/pg"]
        parts.append((float(micro.mask.sum()), metrics))
    return loss_total, pg_total


def optimizer_step(policy: Policy, grad_clip_norm: float) -> float:
    """Clip the accumulated gradients and step the optimizer; returns the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), grad_clip_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    policy.optimizer.step()
    return float(grad_norm)


def proximal_logprobs(policy: Policy, batch: Batch, indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """[B_i, T_i] log-probs of each micro-batch `batch.select(indices[i])` under the weights as they
    are now (the proximal policy), without gradient; micro-batched like the training forward, so
    every rank runs the same number of forward passes (each is a collective under FSDP2)."""
    with torch.no_grad():
        prox_logps = [policy.logprobs(batch.select(index)) for index in indices]
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)  # so time/recompute_s measures the forwards, not their launch
    return prox_logps


def loss_settings(cfg: Config, max_new_tokens: int) -> algo.LossSettings:
    """The algo section as the loss reads it, `max_new_tokens` (rollout.max_new_tokens) standing for
    `algo.norm_constant`'s 0. `algo.advantage` is read by `update` itself and `algo.kl.reference_on`
    by `Policy.from_config`; `algo.kl.enabled` decides whether `kl` is set."""
    a = cfg.algo
    return algo.LossSettings(
        mode=a.mode,
        loss_type=a.loss_type,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        clip_c=a.clip_c,
        m2_threshold=a.m2_threshold,
        agg=a.agg,
        # Dr.GRPO's constant must not depend on a micro-batch's padding.
        norm_constant=a.norm_constant or float(max_new_tokens),
        correction=algo.CorrectionSettings(
            is_level=a.correction.is_level,
            is_threshold=a.correction.is_threshold,
            is_batch_normalize=a.correction.is_batch_normalize,
            rs=a.correction.rs,
            rs_threshold=a.correction.rs_threshold,
        ),
        kl=algo.KLSettings(kind=a.kl.kind, coef=a.kl.coef) if a.kl.enabled else None,
    )


def overlong_settings(cfg: Config, max_new_tokens: int) -> algo.OverlongSettings:
    """algo.overlong* against `max_new_tokens` (rollout.max_new_tokens), with the buffer's 0 resolved (schema.py)."""
    a, limit = cfg.algo, max_new_tokens
    return algo.OverlongSettings(mode=a.overlong, max_new_tokens=limit,
                                 buffer_tokens=a.overlong_buffer_tokens or max(1, limit // 5),
                                 penalty=a.overlong_penalty)


def micro_batch_loss(policy: Policy, micro: Batch, prox_logp: torch.Tensor | None, advantages: torch.Tensor,
                     settings: algo.LossSettings, global_tokens: float, global_seqs: float,
                     divergence: Divergence | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the global loss (policy loss plus the KL penalty, if on).

    prox_logp [B, T]: the proximal log-probs (None under algo.mode=bypass); advantages [B];
    global_tokens / global_seqs: the whole batch's counts (the denominators); `divergence`: measures
    the micro-batch and applies the cap first (None: a padding micro-batch, whose loss counts 0).
    """
    logp, entropy = policy.logprobs_and_entropy(micro)
    if divergence is not None:
        # The current policy: the pass under way in bypass, the recomputed one (same weights) otherwise.
        micro, advantages = divergence.apply(logp.detach() if prox_logp is None else prox_logp, micro, advantages)
    loss, metrics = algo.mode_policy_loss(
        logp,
        prox_logp,
        micro.rollout_logp,
        advantages.unsqueeze(1) * micro.mask,
        micro.mask,
        settings,
        global_num_tokens=global_tokens,
        global_num_seqs=global_seqs,
    )
    # This micro-batch's mean over its real tokens; combine_metrics weights it by tokens.
    metrics["policy/entropy"] = float((entropy * micro.mask).sum() / micro.mask.sum().clamp(min=1))
    if settings.kl is not None:
        kl = algo.aggregate(algo.kl_penalty(logp, policy.reference_logprobs(micro), kind=settings.kl.kind),
                            micro.mask, settings.agg, norm_constant=settings.norm_constant,
                            global_num_tokens=global_tokens, global_num_seqs=global_seqs)
        loss = loss + settings.kl.coef * kl
        # Each micro-batch's share of the global mean; combine_metrics weights by tokens.
        metrics["loss/kl"] = float(kl.detach()) * global_tokens / max(1.0, float(micro.mask.sum()))
    return loss, metrics
