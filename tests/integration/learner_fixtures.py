"""Shared by the learner tests: a tiny model on disk, fixed groups, and a learner-rank process body."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from asyncgrpo.schema import ModelConfig
from asyncgrpo.wire import ScoredGroup


def make_model_dir(directory: Path) -> str:
    from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
    from asyncgrpo.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    save_model(build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0), tokenizer, directory)
    return str(directory)


def fixed_groups(num_groups: int = 5, samples: int = 4, seed: int = 0, version: int = 0,
                 env_tokens: bool = False) -> list[ScoredGroup]:
    """Groups of varied prompt and completion lengths, with rewards that differ within each group;
    with `env_tokens`, completions of 3 or more tokens hold an environment's observation after their
    first token (a hole in the policy mask; drawn last, so everything else is as without)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        lengths = rng.integers(1, 6, size=samples).astype(np.int32)
        total = int(lengths.sum())
        rewards = rng.integers(0, 2, size=samples).astype(np.float32)
        rewards[0], rewards[1] = 0.0, 1.0
        groups.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g,
            prompt_tokens=rng.integers(3, 60, size=int(rng.integers(4, 8))).astype(np.int32),
            tokens=rng.integers(1, 60, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 5.0, size=total).astype(np.float32),
            versions=np.full(total, version, dtype=np.int32),
            lengths=lengths,
            rewards=rewards,
        ))
    for group in groups if env_tokens else []:
        mask = [np.ones(n, np.uint8) for n in group.lengths.tolist()]
        for row in mask:
            if row.size >= 3:
                row[1:1 + int(rng.integers(1, row.size - 1))] = 0
        group.policy_mask = np.concatenate(mask)
        group.logprobs = np.where(group.policy_mask == 1, group.logprobs, 0.0).astype(np.float32)
    return groups


# The step metrics an exact resume must reproduce (its checkpoint tests compare them step by step).
RESUME_LOSS_KEYS = ("loss/total", "loss/pg", "loss/kl", "optim/lr", "optim/grad_norm")


def train_each(learner, batches: list[list[ScoredGroup]]) -> list[dict[str, float]]:
    """One learner step per batch; their metrics."""
    return [learner.train_on(groups) for groups in batches]


def step_groups(num_steps: int, num_groups: int = 5) -> list[list[ScoredGroup]]:
    # Multi-turn: the ranks must split, broadcast and trim batches whose policy masks have holes.
    return [fixed_groups(num_groups=num_groups, seed=100 + step, version=step, env_tokens=True)
            for step in range(num_steps)]


def full_params(learner) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, on every rank (a collective)."""
    return {name: p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for name, p in learner.policy.model.named_parameters()}


def full_grads(learner) -> dict[str, torch.Tensor]:
    """The last step's gradients (the learner leaves them in place after the optimizer step), unsharded;
    frozen parameters (the base under LoRA) have none and are left out."""
    return {name: p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for name, p in learner.policy.model.named_parameters() if p.requires_grad}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def rank_main(rank: int, world_size: int, port: int, model_dir: str, runs: list[tuple[str, list[str]]],
              num_steps: int, out_dir: str, checkpoint_after: int) -> None:
    """One learner rank in its own process: for each named run, a fresh learner takes `num_steps`
    steps on the same groups; rank 0 saves the metrics and final parameters to out_dir/<name>.pt.
    The first run also writes a checkpoint after `checkpoint_after` steps."""
    import torch.distributed as dist

    from asyncgrpo.config import load
    from asyncgrpo.learner.learner import Learner
    from asyncgrpo.learner.rendezvous import join_spawner_store

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from datetime import timedelta

    join_spawner_store(port, rank, world_size, timedelta(seconds=120))
    try:
        batches = step_groups(num_steps)
        for index, (name, overrides) in enumerate(runs):
            learner = Learner.from_config(load(overrides), model_dir, rank=rank, world_size=world_size)
            try:
                metrics = []
                for step, groups in enumerate(batches):
                    metrics.append(learner.train_on(groups if rank == 0 else None))
                    if index == 0 and step + 1 == checkpoint_after:
                        learner.save_checkpoint(Path(out_dir) / "checkpoints")
                params, grads = full_params(learner), full_grads(learner)
            finally:
                learner.close()
            if rank == 0:
                torch.save({"metrics": metrics, "params": params, "grads": grads}, Path(out_dir) / f"{name}.pt")
    finally:
        dist.destroy_process_group()
