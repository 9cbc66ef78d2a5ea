"""One optimizer step of bypass-mode GRPO on a batch: advantages, the loss over token-budget
micro-batches with global denominators, gradient clipping, the optimizer and schedule steps.

Every rank holds the whole batch: advantages and the loss denominators (the batch's global token
and sequence counts) come from all of it, so the update depends neither on how the batch is split
into micro-batches nor on the number of ranks. Each rank trains on its share of the groups; FSDP2
sums the gradients over ranks.
"""

from __future__ import annotations

import time

import torch

from asyncgrpo import algo
from asyncgrpo.learner.batch import Batch, micro_batch_plan, rank_shares
from asyncgrpo.learner.metrics import reduce_metrics
from asyncgrpo.learner.policy import Policy
from asyncgrpo.schema import Config


def update(policy: Policy, batch: Batch, cfg: Config, rank: int, world_size: int) -> dict[str, float]:
    """Every rank calls it with the same batch; returns the step's loss and optimizer metrics."""
    policy.model.train()
    advantages = algo.group_advantages(batch.rewards, batch.group_index, mode=cfg.algo.advantage)
    global_tokens = float(batch.mask.sum())
    global_seqs = float((batch.mask.sum(1) > 0).sum())
    lengths = batch.attention_mask.sum(1).tolist()
    learner = cfg.learner
    plans = [micro_batch_plan(lengths, rows, learner.micro_batch_tokens, learner.bucket_by_length)
             for rows in rank_shares(batch, world_size)]
    mine = plans[rank]
    # Each forward and backward is a collective under FSDP2: every rank runs as many micro-batches
    # as the busiest one; a rank that runs out repeats a row with its loss multiplied by 0.
    num_micro = max(1, max(len(plan) for plan in plans))
    policy.optimizer.zero_grad(set_to_none=True)
    parts: list[tuple[float, dict[str, float]]] = []
    loss_total = pg_total = 0.0
    for i in range(num_micro):
        padding = i >= len(mine)
        index = torch.tensor(mine[i] if not padding else [0], dtype=torch.int64, device=batch.rewards.device)
        micro = batch.select(index)
        loss, metrics = micro_batch_loss(policy, micro, advantages.index_select(0, index), cfg,
                                         global_tokens, global_seqs)
        (loss * 0.0 if padding else loss).backward()
        if padding:
            parts.append((0.0, metrics))
            continue
        loss_total += float(loss.detach())
        pg_total += metrics["loss/pg"]  # with global denominators the shares add up
        parts.append((float(micro.mask.sum()), metrics))
    metrics = reduce_metrics(parts, {"loss/total": loss_total, "loss/pg": pg_total}, world_size, policy.device)
    metrics["optim/lr"] = policy.optimizer.param_groups[0]["lr"]
    optimizer_start = time.perf_counter()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), learner.grad_clip_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    policy.optimizer.step()
    policy.scheduler.step()
    metrics["time/optimizer_s"] = time.perf_counter() - optimizer_start  # part of time/train_s
    metrics["optim/grad_norm"] = float(grad_norm)
    metrics["perf/micro_batches"] = num_micro
    return metrics


def micro_batch_loss(policy: Policy, micro: Batch, advantages: torch.Tensor, cfg: Config, global_tokens: float,
                     global_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the global loss (policy loss plus the KL penalty, if on).

    advantages [B]; global_tokens / global_seqs: the whole batch's counts (the denominators).
    """
    a = cfg.algo
    # Dr.GRPO's constant must not depend on a micro-batch's padding.
    norm_constant = a.norm_constant or float(cfg.rollout.max_new_tokens)
    logp = policy.logprobs(micro)
    loss, metrics = algo.bypass_policy_loss(
        logp,
        micro.rollout_logp,
        advantages.unsqueeze(1) * micro.mask,
        micro.mask,
        loss_type=a.loss_type,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        clip_c=a.clip_c,
        agg=a.agg,
        norm_constant=norm_constant,
        is_level=a.correction.is_level,
        is_threshold=a.correction.is_threshold,
        is_batch_normalize=a.correction.is_batch_normalize,
        rs=a.correction.rs,
        rs_threshold=a.correction.rs_threshold,
        global_num_tokens=global_tokens,
        global_num_seqs=global_seqs,
    )
    if policy.reference is not None:
        kl = algo.aggregate(algo.kl_penalty(logp, policy.reference_logprobs(micro), kind=a.kl.kind), micro.mask,
                            a.agg, norm_constant=norm_constant, global_num_tokens=global_tokens,
                            global_num_seqs=global_seqs)
        loss = loss + a.kl.coef * kl
        # Each micro-batch's share of the global mean; combine_metrics weights by tokens.
        metrics["loss/kl"] = float(kl.detach()) * global_tokens / max(1.0, float(micro.mask.sum()))
    return loss, metrics
