"""Finite-difference gradient checks (float64), away from the clip and clamp boundaries."""

import math

import pytest
import torch
from flat_settings import call_with_settings
from torch.autograd import gradcheck

from asyncgrpo.algo import AGG_MODES, bypass_policy_loss, kl_penalty, policy_loss

# Ratios chosen in every regime of the clipped surrogate (inside the range, above 1 + 0.28, below
# 1 - 0.2, beyond the dual clip c = 3) and at least 0.05 away from each boundary.
RATIOS = torch.tensor([[0.9, 1.1, 1.5, 0.5, 5.0], [1.05, 0.6, 2.0, 0.95, 1.2]], dtype=torch.float64)
ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0, -1.0, -2.0], [-0.5, 0.5, -1.5, 2.0, 0.7]], dtype=torch.float64)
# The functions take their config keys without defaults: unless a test sets them, token-mean,
# clip range [0.8, 1.28], dual clip 3, no rollout correction.
PPO = {"loss_type": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "clip_c": 3.0, "agg": "token-mean",
       "norm_constant": None}
NO_CORRECTION = {"is_level": None, "is_threshold": 2.0, "is_batch_normalize": False, "rs": None, "rs_threshold": None}
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float64)
OLD_LOGP = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5], [-0.7, -1.2, -2.5, -0.9, -1.8]], dtype=torch.float64)


def current_logp():
    return (OLD_LOGP + RATIOS.log()).requires_grad_()


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_policy_loss(agg, loss_type):
    weights = torch.tensor([[0.5, 1.0, 2.0, 1.5, 0.8], [1.2, 0.3, 1.0, 1.0, 1.0]], dtype=torch.float64)

    def loss(logp):
        options = PPO | {"loss_type": loss_type, "agg": agg}
        return call_with_settings(policy_loss, logp, OLD_LOGP, ADVANTAGES, MASK, **options, is_weights=weights)[0]

    assert gradcheck(loss, (current_logp(),))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_bypass_ppo_clip_with_rejection(agg):
    # token_k1 at 3 keeps ratios in [1/3, 3]: the ratio 5 is rejected, the others are far from the bounds.
    def loss(logp):
        options = PPO | NO_CORRECTION | {"agg": agg, "is_level": "token", "rs": "token_k1", "rs_threshold": 3.0}
        return call_with_settings(bypass_policy_loss, logp, OLD_LOGP, ADVANTAGES, MASK, **options)[0]

    assert gradcheck(loss, (current_logp(),))


@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
def test_bypass_reinforce(is_level):
    # Every raw weight is >= 0.5 here and a threshold of 0.4 truncates all of them: the weights are
    # locally constant, so finite differences see only the detached-weight gradient.
    def loss(logp):
        options = PPO | NO_CORRECTION | {"loss_type": "reinforce", "is_level": is_level, "is_threshold": 0.4}
        return call_with_settings(bypass_policy_loss, logp, OLD_LOGP, ADVANTAGES, MASK, **options)[0]

    assert gradcheck(loss, (current_logp(),))


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl"])
def test_kl_penalty(kind):
    # |x| in [0.2, 1.5]: away from the kink of abs and from the clamps of k3 (|x| >= 2.3 would clamp).
    offsets = torch.tensor([[0.2, -0.4, 1.5, -1.1], [0.7, -1.5, 0.3, -0.2]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.0, -2.0, -3.0, -0.5], [-0.2, -4.0, -1.0, -2.2]], dtype=torch.float64)
    logp = (ref_logp + offsets).requires_grad_()
    assert gradcheck(lambda lp, ref: kl_penalty(lp, ref, kind=kind), (logp, ref_logp.clone().requires_grad_()))


def test_bypass_reinforce_truncation_premise():
    # The premise of test_bypass_reinforce: the smallest raw sequence weight is above the threshold 0.4.
    log_ratios = RATIOS.log() * MASK
    assert math.exp(log_ratios.sum(-1).min().item()) > 0.4
    assert RATIOS[MASK.bool()].min().item() > 0.4


# GSPO's token form sg[s_i] * pi_t / sg[pi_t] has the exact gradient of its sequence-level objective
# when the advantage and the IS weight are constant along each row, which is what GRPO produces:
# finite differences then see the same gradient. Rows: s ~ 1.06 inside the range (A > 0), s ~ 1.75
# above it with A > 0 (clipped, zero gradient), s ~ 2.45 above it with A < 0 (not clipped).
GSPO_RATIOS = torch.tensor([[0.9, 1.2, 1.1], [1.5, 2.0, 1.8], [2.0, 3.0, 7.0]], dtype=torch.float64)
GSPO_OLD_LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -2.5], [-3.0, -0.9, -1.8]], dtype=torch.float64)
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.float64)
GSPO_ADVANTAGES = torch.tensor([[1.5], [0.5], [-2.0]], dtype=torch.float64) * GSPO_MASK


def test_gspo_sequence_ratios_are_away_from_the_clip_boundaries():
    seq_ratios = ((GSPO_RATIOS.log() * GSPO_MASK).sum(-1) / GSPO_MASK.sum(-1)).exp()
    for ratio in seq_ratios.tolist():
        assert min(abs(ratio - 0.8), abs(ratio - 1.28)) > 0.05, ratio


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("with_weights", [False, True])
def test_gspo(agg, with_weights):
    row_weights = torch.tensor([[0.5], [2.0], [1.2]], dtype=torch.float64).expand(3, 3) if with_weights else None

    def loss(logp):
        options = PPO | {"loss_type": "gspo", "agg": agg}
        return call_with_settings(policy_loss, logp, GSPO_OLD_LOGP, GSPO_ADVANTAGES, GSPO_MASK, **options,
                                  is_weights=row_weights)[0]

    assert gradcheck(loss, ((GSPO_OLD_LOGP + GSPO_RATIOS.log()).requires_grad_(),))


# CISPO's weight is detached by design, so finite differences match only where it is locally
# constant: every ratio here lies outside [0.8, 1.28] (by >= 0.05), so every weight is clipped.
CISPO_RATIOS = torch.tensor([[0.5, 1.5, 2.0, 0.3, 5.0], [1.6, 0.6, 2.0, 0.4, 3.0]], dtype=torch.float64)


def test_cispo_ratios_are_all_clipped():
    assert bool(((CISPO_RATIOS < 0.75) | (CISPO_RATIOS > 1.33)).all())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_cispo(agg):
    weights = torch.tensor([[0.5, 1.0, 2.0, 1.5, 0.8], [1.2, 0.3, 1.0, 1.0, 1.0]], dtype=torch.float64)

    def loss(logp):
        options = PPO | {"loss_type": "cispo", "agg": agg}
        return call_with_settings(policy_loss, logp, OLD_LOGP, ADVANTAGES, MASK, **options, is_weights=weights)[0]

    assert gradcheck(loss, ((OLD_LOGP + CISPO_RATIOS.log()).requires_grad_(),))
