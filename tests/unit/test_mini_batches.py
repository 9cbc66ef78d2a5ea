"""learner.mini_batches: several optimizer steps per learner step, in-process on the tiny model (no
FSDP, no processes). Each mini-batch is whole groups with its own denominators; the proximal anchor
of decoupled|naive is the weights before the first; the schedule steps once per learner step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_update_modes import groups

from asyncgrpo.config import ConfigError, load
from asyncgrpo.learner.batch import collate, mini_batch_rows
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.update import update
from asyncgrpo.models.tiny import TinyModelSpec, build_model
from asyncgrpo.models.tokenizer import build_char_tokenizer


@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.integers(1, 15))
def test_mini_batches_deal_whole_groups_in_turn_and_hold_every_row_once(group_sizes, count):
    group_index = [g for g, size in enumerate(group_sizes) for _ in range(size)]
    shares = mini_batch_rows(group_index, count)
    assert sorted(row for share in shares for row in share) == list(range(len(group_index)))
    assert len(shares) == min(count, len(group_sizes)) and all(shares)
    for m, share in enumerate(shares):
        groups = sorted({group_index[row] for row in share})
        assert groups == [g for g in range(len(group_sizes)) if g % count == m]  # whole groups, dealt in turn
        assert share == sorted(share)  # the batch's order kept within a mini-batch


def new_policy(cfg, lr: float = 1e-3) -> Policy:
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Policy(model, optimizer, scheduler, None, torch.device("cpu"), torch.device("cpu"), rank=0,
                  temperature=cfg.rollout.temperature)


def train(policy: Policy, cfg, chosen: list) -> dict[str, float]:
    batch = collate(chosen, build_char_tokenizer().pad_token_id)
    return update(policy, batch, cfg, rank=0, world_size=1, max_new_tokens=cfg.rollout.max_new_tokens)


def weights(policy: Policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


@pytest.mark.parametrize("count", [1, 2, 4])
def test_each_mini_batch_takes_an_optimizer_step_and_the_schedule_steps_once(count):
    cfg = load(["learner.warmup_steps=0", f"learner.mini_batches={count}"])
    policy = new_policy(cfg)
    metrics = train(policy, cfg, groups(4))
    adam_steps = {int(state["step"]) for state in policy.optimizer.state.values()}
    assert adam_steps == {count}
    assert policy.scheduler.last_epoch == 1
    assert metrics["perf/mini_batches"] == count
    assert np.isfinite(metrics["loss/total"]) and np.isfinite(metrics["optim/grad_norm"])


@pytest.mark.parametrize("micro_batch_tokens", [0, 12])
def test_under_bypass_two_mini_batches_are_two_steps_on_their_groups_alone(micro_batch_tokens):
    # Advantages are per group and each mini-batch has its own denominators, so (with the anchor the
    # rollout's) the step equals one step on groups 0 and 2 followed by one on groups 1 and 3.
    common = ["learner.warmup_steps=0", f"learner.micro_batch_tokens={micro_batch_tokens}"]
    cfg = load([*common, "learner.mini_batches=2"])
    together = new_policy(cfg)
    metrics = train(together, cfg, groups(4))
    single = load(common)
    apart = new_policy(single)
    everything = groups(4)
    first = train(apart, single, everything[0::2])
    second = train(apart, single, everything[1::2])
    for a, b in zip(weights(together), weights(apart)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert metrics["loss/total"] == pytest.approx((first["loss/total"] + second["loss/total"]) / 2, rel=1e-5)
    assert metrics["optim/grad_norm"] == pytest.approx((first["optim/grad_norm"] + second["optim/grad_norm"]) / 2,
                                                       rel=1e-5)


@pytest.mark.parametrize("mode", ["decoupled", "naive"])
def test_the_proximal_anchor_is_the_weights_before_the_first_mini_batch(mode):
    # With one optimizer step the trained policy is its anchor (ratio 1, nothing clipped); with two,
    # the second mini-batch trains weights that moved away from the anchor, so its clip can act.
    overrides = ["learner.warmup_steps=0", f"algo.mode={mode}", "algo.correction.is_level=token"]
    one = train(new_policy(load(overrides), lr=0.05), load(overrides), groups(4))
    cfg = load([*overrides, "learner.mini_batches=2"])
    two = train(new_policy(cfg, lr=0.05), cfg, groups(4))
    assert one["loss/approx_kl"] == pytest.approx(0.0, abs=1e-7) and one["loss/clipfrac"] == 0.0
    assert abs(two["loss/approx_kl"]) > 1e-4
    assert two["loss/clipfrac"] > 0.0
    assert two["time/recompute_s"] > 0.0


@pytest.mark.parametrize("value", [0, 17])
def test_a_mini_batch_count_outside_one_to_the_step_s_groups_is_refused(value):
    with pytest.raises(ConfigError, match=r"learner.mini_batches must be in \[1, train.groups_per_step=16\]"):
        load([f"learner.mini_batches={value}"])
