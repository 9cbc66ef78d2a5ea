"""algo.overlong through the learner's update, in-process on the tiny model: under mask a truncated
completion's tokens change neither the loss nor the step (its reward still sets its group's
baseline); under keep they do; under penalty the step sees the shaped rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.config import load
from asyncgrpo.learner.batch import collate
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.update import overlong_settings, update
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.wire import ScoredGroup

MAX_NEW_TOKENS = 5


def groups(truncated_tokens: list[int]) -> list[ScoredGroup]:
    """Two groups of 4; sample 1 of group 0 is truncated at MAX_NEW_TOKENS with `truncated_tokens`
    and rollout log-probs that depend on them."""
    rng = np.random.default_rng(0)
    result = []
    for g in range(2):
        lengths = np.array([3, MAX_NEW_TOKENS, 2, 4], dtype=np.int32)
        total = int(lengths.sum())
        tokens = rng.integers(1, 60, size=total).astype(np.int32)
        logprobs = -rng.uniform(3.9, 4.3, size=total).astype(np.float32)  # near the tiny model's: little clipping
        truncated = np.zeros(4, dtype=np.uint8)
        if g == 0:
            tokens[3:3 + MAX_NEW_TOKENS] = truncated_tokens
            logprobs[3:3 + MAX_NEW_TOKENS] = -4.0 - 0.005 * np.asarray(truncated_tokens, dtype=np.float32)
            truncated[1] = 1
        result.append(ScoredGroup(
            generator_id=0, seq=g, prompt_id=g, prompt_tokens=rng.integers(3, 60, size=5).astype(np.int32),
            tokens=tokens, logprobs=logprobs, versions=np.zeros(total, dtype=np.int32), lengths=lengths,
            rewards=np.array([1.0, 0.0, 0.0, 1.0], dtype=np.float32), truncated=truncated))
    return result


def step(overlong: str, truncated_tokens: list[int], *extra: str) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One update from the same initial weights; its metrics and the weights after it."""
    cfg = load(["learner.warmup_steps=0", f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"algo.overlong={overlong}",
                "learner.micro_batch_tokens=24", *extra])
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = Policy(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None,
                    torch.device("cpu"), torch.device("cpu"), rank=0, temperature=cfg.rollout.temperature)
    metrics = update(policy, collate(groups(truncated_tokens), tokenizer.pad_token_id), cfg, rank=0, world_size=1,
                     max_new_tokens=cfg.rollout.max_new_tokens)
    return metrics, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_under_mask_a_truncated_completions_tokens_change_neither_the_loss_nor_the_step(agg):
    metrics, weights = step("mask", [5, 6, 7, 8, 9], f"algo.agg={agg}")
    other_metrics, other_weights = step("mask", [40, 41, 42, 43, 44], f"algo.agg={agg}")
    assert metrics["loss/total"] == other_metrics["loss/total"]
    assert metrics["optim/grad_norm"] == other_metrics["optim/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(weights, other_weights, strict=True))
    assert metrics["overlong/masked_frac"] == pytest.approx(1 / 8)


def test_under_keep_the_same_tokens_do_change_the_step():
    metrics, weights = step("keep", [5, 6, 7, 8, 9])
    other_metrics, other_weights = step("keep", [40, 41, 42, 43, 44])
    assert metrics["loss/total"] != other_metrics["loss/total"]
    assert not all(torch.equal(a, b) for a, b in zip(weights, other_weights, strict=True))


def test_under_penalty_the_step_reports_the_mean_penalty_added():
    # Buffer 2 of 5 tokens: lengths [3, 5, 2, 4] get [0, -1, 0, -0.5] (penalty 1).
    metrics, _ = step("penalty", [5, 6, 7, 8, 9], "algo.overlong_buffer_tokens=2")
    assert metrics["overlong/penalty_mean"] == pytest.approx(-1.5 / 4)
    assert metrics["overlong/masked_frac"] == 0.0


def test_a_zero_buffer_is_a_fifth_of_the_token_limit_and_at_least_one():
    assert overlong_settings(load(["rollout.max_new_tokens=20", "algo.overlong=penalty"]), 20).buffer_tokens == 4
    assert overlong_settings(load(["rollout.max_new_tokens=4", "algo.overlong=penalty"]), 4).buffer_tokens == 1
    assert overlong_settings(load(["rollout.max_new_tokens=20", "algo.overlong_buffer_tokens=7"]), 20).buffer_tokens == 7
