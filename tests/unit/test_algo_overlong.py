"""algo.overlong's math (asyncgrpo/algo/overlong.py): DAPO's soft penalty at its window's edges, the
mask that keeps a truncated completion out of the loss but in its group's baseline, and the
signal test of algo.filter_groups."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo import algo
from asyncgrpo.algo import OverlongSettings, apply_overlong, carries_signal, overlong_penalty


NO_CORRECTION = algo.CorrectionSettings(is_level=None, is_threshold=None, is_batch_normalize=False, rs=None,
                                        rs_threshold=None)


def settings(mode: str, max_new_tokens: int = 100, buffer_tokens: int = 20, penalty: float = 1.0) -> OverlongSettings:
    return OverlongSettings(mode=mode, max_new_tokens=max_new_tokens, buffer_tokens=buffer_tokens, penalty=penalty)


@pytest.mark.parametrize(("length", "expected"), [
    (0, 0.0),
    (79, 0.0),  # before the window
    (80, 0.0),  # the window's first edge: max_new_tokens - buffer_tokens
    (81, -0.025),  # one token in: 1/20 of the penalty
    (90, -0.25),  # half way
    (100, -0.5),  # the limit: the whole penalty
    (130, -0.5),  # past the limit (a replay with a smaller limit): clamped
])
def test_the_soft_penalty_is_zero_before_the_window_and_falls_linearly_to_minus_the_penalty_at_the_limit(
        length, expected):
    value = overlong_penalty(torch.tensor([length]), max_new_tokens=100, buffer_tokens=20, penalty=0.5)
    assert value.item() == pytest.approx(expected, abs=1e-7)


def test_a_window_as_long_as_the_limit_penalises_from_the_first_token():
    values = overlong_penalty(torch.tensor([0, 5, 10]), max_new_tokens=10, buffer_tokens=10, penalty=1.0)
    assert values.tolist() == pytest.approx([0.0, -0.5, -1.0])


def test_penalty_mode_adds_the_penalty_to_every_completion_by_length_truncated_or_not():
    rewards, mask = torch.tensor([1.0, 1.0, 0.0]), torch.ones(3, 100)
    lengths, truncated = torch.tensor([50.0, 90.0, 100.0]), torch.tensor([0.0, 0.0, 1.0])
    shaped, loss_mask, metrics = apply_overlong(rewards, mask, lengths, truncated, settings("penalty"))
    assert shaped.tolist() == pytest.approx([1.0, 0.5, -1.0])
    assert torch.equal(loss_mask, mask)
    assert metrics == {"overlong/masked_frac": 0.0, "overlong/penalty_mean": pytest.approx(-0.5)}
    assert rewards.tolist() == [1.0, 1.0, 0.0]  # the input is not modified


def test_keep_mode_changes_nothing():
    rewards, mask = torch.tensor([1.0, 0.0]), torch.ones(2, 4)
    shaped, loss_mask, metrics = apply_overlong(rewards, mask, torch.tensor([4.0, 4.0]), torch.tensor([1.0, 1.0]),
                                                settings("keep", max_new_tokens=4, buffer_tokens=2))
    assert torch.equal(shaped, rewards) and torch.equal(loss_mask, mask)
    assert metrics == {"overlong/masked_frac": 0.0, "overlong/penalty_mean": 0.0}


def test_mask_mode_zeroes_the_truncated_rows_only_and_keeps_the_rewards():
    rewards, mask = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    shaped, loss_mask, metrics = apply_overlong(rewards, mask, mask.sum(1), torch.tensor([0.0, 1.0, 0.0]),
                                                settings("mask", max_new_tokens=3, buffer_tokens=1))
    assert torch.equal(shaped, rewards)
    assert loss_mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert metrics["overlong/masked_frac"] == pytest.approx(1 / 3)


def masked_loss_and_grad(logp_rows: torch.Tensor, rollout_logp: torch.Tensor):
    """The bypass PPO loss of one group of 3 (the middle one truncated) under algo.overlong=mask,
    and the gradient with respect to the log-probs."""
    logp = logp_rows.clone().requires_grad_(True)
    mask = torch.ones(3, 4)
    rewards, truncated = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    shaped, loss_mask, _ = apply_overlong(rewards, mask, mask.sum(1), truncated,
                                          settings("mask", max_new_tokens=4, buffer_tokens=1))
    advantages = algo.group_advantages(shaped, torch.zeros(3, dtype=torch.int64), mode="grpo")
    loss_settings = algo.LossSettings(mode="bypass", loss_type="ppo_clip", clip_low=0.2, clip_high=0.28, clip_c=3.0,
                                      m2_threshold=0.04, agg="token-mean", norm_constant=None,
                                      correction=NO_CORRECTION, kl=None)
    loss, _ = algo.mode_policy_loss(logp, None, rollout_logp, advantages.unsqueeze(1) * loss_mask, loss_mask,
                                    loss_settings, global_num_tokens=float(loss_mask.sum()),
                                    global_num_seqs=float((loss_mask.sum(1) > 0).sum()))
    loss.backward()
    return loss.detach(), logp.grad, advantages


def test_a_masked_completion_never_changes_the_loss_or_its_gradient_but_counts_in_the_baseline():
    generator = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=generator) - 0.1
    rollout = -torch.rand(3, 4, generator=generator) - 0.1
    loss, grad, advantages = masked_loss_and_grad(logp, rollout)
    # Whatever the truncated completion's tokens were sampled with and score now:
    other_logp, other_rollout = logp.clone(), rollout.clone()
    other_logp[1], other_rollout[1] = -5.0, -0.01
    other_loss, other_grad, _ = masked_loss_and_grad(other_logp, other_rollout)
    assert torch.equal(loss, other_loss) and torch.equal(grad, other_grad)
    assert torch.count_nonzero(grad[1]) == 0
    # Its reward 0 still counts in the mean and std: [1, 0, 0] gives the others (2/3, -1/3) / std.
    mean, std = 1 / 3, torch.tensor([1.0, 0.0, 0.0]).std().item()
    assert advantages[0].item() == pytest.approx((1 - mean) / (std + 1e-6), rel=1e-5)
    assert advantages[2].item() == pytest.approx((0 - mean) / (std + 1e-6), rel=1e-5)


def test_keeping_the_same_completion_does_change_the_loss():
    # The contrast: without the mask, the same change moves the loss (so the test above can fail).
    generator = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=generator) - 0.1
    rollout = -torch.rand(3, 4, generator=generator) - 0.1
    mask = torch.ones(3, 4)
    advantages = algo.group_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.int64), mode="grpo")

    def loss_of(rollout_logp: torch.Tensor) -> float:
        loss_settings = algo.LossSettings(mode="bypass", loss_type="ppo_clip", clip_low=0.2, clip_high=0.28,
                                          clip_c=3.0, m2_threshold=0.04, agg="token-mean", norm_constant=None,
                                          correction=NO_CORRECTION, kl=None)
        loss, _ = algo.mode_policy_loss(logp, None, rollout_logp, advantages.unsqueeze(1) * mask, mask, loss_settings)
        return float(loss)

    changed = rollout.clone()
    changed[1] = -0.01
    assert loss_of(rollout) != loss_of(changed)


@pytest.mark.parametrize(("rewards", "signal"), [
    ([1.0, 1.0, 1.0], False), ([0.0, 0.0], False), ([0.5], False), ([1.0, 0.0, 1.0], True), ([0.0, 0.0, 1e-6], True),
])
def test_a_group_carries_signal_exactly_when_its_rewards_differ(rewards, signal):
    assert carries_signal(torch.tensor(rewards)) is signal


@pytest.mark.parametrize(("changes", "match"), [
    ({"mode": "clip"}, "mode must be one of keep, mask, penalty"),
    ({"mode": "penalty", "buffer_tokens": 0}, "buffer_tokens"),
    ({"mode": "penalty", "buffer_tokens": 101}, "buffer_tokens"),
    ({"penalty": -1.0}, "penalty must be >= 0"),
    ({"penalty": float("nan")}, "penalty must be >= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_bad_overlong_settings_are_refused_naming_the_argument(changes, match):
    with pytest.raises(ValueError, match=match):
        OverlongSettings(**{"mode": "keep", "max_new_tokens": 100, "buffer_tokens": 20, "penalty": 1.0, **changes})
