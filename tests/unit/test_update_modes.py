"""The learner's update under each algo.mode, in-process on the tiny model (no FSDP, no processes):
decoupled and naive recompute the proximal log-probs before the gradient pass, bypass does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.config import load
from asyncgrpo.learner.batch import collate
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.wire import ScoredGroup


def groups(num_groups: int = 3, samples: int = 4) -> list[ScoredGroup]:
    """Completions of varied lengths with rollout log-probs far from the model's (stale samples)."""
    rng = np.random.default_rng(0)
    result = []
    for g in range(num_groups):
        lengths = rng.integers(1, 5, size=samples).astype(np.int32)
        total = int(lengths.sum())
        result.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g,
            prompt_tokens=rng.integers(3, 60, size=5).astype(np.int32),
            tokens=rng.integers(1, 60, size=total).astype(np.int32),
            logprobs=-rng.uniform(0.5, 5.0, size=total).astype(np.float32),
            versions=np.zeros(total, dtype=np.int32),
            lengths=lengths,
            rewards=(np.arange(samples) % 2).astype(np.float32),
        ))
    return result


def one_update(*overrides: str, with_reference: bool = False) -> dict[str, float]:
    cfg = load(["learner.warmup_steps=0", *overrides])
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0) if with_reference else None
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), reference,
                    torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)
    return update(policy, collate(groups(), tokenizer.pad_token_id), cfg, rank=0, world_size=1,
                  max_new_tokens=cfg.rollout.max_new_tokens)


@pytest.mark.parametrize("kl_enabled", [True, False])
def test_a_policy_whose_reference_disagrees_with_algo_kl_enabled_is_refused(kl_enabled):
    with pytest.raises(ValueError, match=f"algo.kl.enabled={str(kl_enabled).lower()}"):
        one_update(f"algo.kl.enabled={str(kl_enabled).lower()}", with_reference=not kl_enabled)


def test_bypass_does_not_recompute():
    assert one_update("algo.mode=bypass")["time/recompute_s"] == 0.0


@pytest.mark.parametrize("mode", ["decoupled", "naive"])
@pytest.mark.parametrize("micro_batch_tokens", [0, 12])
def test_decoupled_and_naive_recompute_the_anchor_before_the_optimizer_step(mode, micro_batch_tokens):
    metrics = one_update(f"algo.mode={mode}", "algo.correction.is_level=token",
                         f"learner.micro_batch_tokens={micro_batch_tokens}")
    assert metrics["time/recompute_s"] > 0
    assert (metrics["perf/micro_batches"] > 1) == (micro_batch_tokens > 0)
    # The anchor is the weights the gradient pass starts from, row for row in every micro-batch:
    # the trained policy equals it, so the ratio is 1 and nothing is clipped.
    assert metrics["loss/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["loss/clipfrac"] == 0.0
    assert ("is/mean" in metrics) == (mode == "decoupled")
    assert np.isfinite(metrics["loss/total"]) and np.isfinite(metrics["optim/grad_norm"])


def test_decoupled_and_bypass_see_the_same_rollout_mismatch_before_the_optimizer_step():
    bypass = one_update("algo.mode=bypass", "algo.correction.is_level=token")
    decoupled = one_update("algo.mode=decoupled", "algo.correction.is_level=token")
    for key in ("mismatch/kl", "is/mean", "is/max"):
        assert decoupled[key] == pytest.approx(bypass[key], rel=1e-6), key
    # bypass's ratio is against mu, decoupled's against pi_prox.
    assert abs(bypass["loss/approx_kl"]) > 0.1
