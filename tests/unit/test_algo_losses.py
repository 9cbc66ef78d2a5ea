"""Hand-computed cases for asyncgrpo.algo.aggregate, policy_loss and bypass_policy_loss."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flat_settings import NO_CORRECTION, call_with_settings, flat_settings

from asyncgrpo.algo import CorrectionSettings, KLSettings, aggregate, bypass_policy_loss, m2po_removed, policy_loss

# The functions take their config keys (algo.*, algo.correction.*) as a LossSettings without
# defaults. The hand-computed cases below assume these values unless a test overrides them: a
# symmetric clip range of 0.2, dual clip 3, token-mean, and no rollout correction.
PPO = {"loss_type": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0, "agg": "token-mean",
       "norm_constant": None}


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def ppo(logp, old_logp, advantages, mask, **options):
    """policy_loss with PPO's settings, `options` overriding them."""
    return call_with_settings(policy_loss, logp, old_logp, advantages, mask, **(PPO | options))


def bypass(logp, rollout_logp, advantages, mask, **options):
    """bypass_policy_loss with PPO's settings and no correction, `options` overriding them."""
    return call_with_settings(bypass_policy_loss, logp, rollout_logp, advantages, mask,
                              **(PPO | NO_CORRECTION | options))


# ---------------------------------------------------------------------------------------------
# aggregate
# ---------------------------------------------------------------------------------------------

LOSS_MAT = f64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = f64([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty rows
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # divided by T = 3
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(LOSS_MAT, MASK, mode, norm_constant=None).item() == pytest.approx(expected, rel=1e-12)
    assert aggregate(LOSS_MAT, MASK.bool(), mode, norm_constant=None).item() == pytest.approx(expected, rel=1e-12)


def test_aggregate_norm_constant():
    assert aggregate(LOSS_MAT, MASK, "seq-mean-token-sum-norm", norm_constant=7).item() == pytest.approx(0.5)
    # Only seq-mean-token-sum-norm divides by the constant.
    assert aggregate(LOSS_MAT, MASK, "token-mean", norm_constant=7).item() == pytest.approx(7 / 3)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 10),
        ("seq-mean-token-sum", 7 / 5),
        ("seq-mean-token-mean", 5.5 / 5),
        ("seq-mean-token-sum-norm", 7 / 5 / 3),
    ],
)
def test_aggregate_global_denominators(mode, expected):
    loss = aggregate(LOSS_MAT, MASK, mode, norm_constant=None, global_num_tokens=10, global_num_seqs=5)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_micro_batches_add_up(mode):
    loss_mat = LOSS_MAT.clone().requires_grad_()
    whole = aggregate(loss_mat, MASK, mode, norm_constant=None)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)
    parts = sum(
        aggregate(loss_mat[rows], MASK[rows], mode, norm_constant=None, global_num_tokens=3, global_num_seqs=2)
        for rows in (slice(0, 1), slice(1, 3))
    )
    (parts_grad,) = torch.autograd.grad(parts, loss_mat)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_fully_masked_batch_is_zero_with_zero_gradient(mode):
    loss_mat = LOSS_MAT.clone().requires_grad_()
    loss = aggregate(loss_mat, torch.zeros(3, 3), mode, norm_constant=None)
    loss.backward()
    assert loss.item() == 0.0
    assert loss_mat.grad.abs().sum().item() == 0.0


def test_aggregate_ignores_infinite_padding():
    loss_mat = f64([[1.0, math.inf], [2.0, -math.inf]])
    assert aggregate(loss_mat, f64([[1, 0], [1, 0]]), "token-mean", norm_constant=None).item() == 1.5


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "sum"}, "mode"),
        ({"mode": "token-mean", "norm_constant": 0}, "norm_constant"),
        ({"mode": "token-mean", "norm_constant": -2.0}, "norm_constant"),
        ({"mode": "token-mean", "norm_constant": True}, "norm_constant"),
        ({"mode": "token-mean", "global_num_tokens": -1}, "global_num_tokens"),
        ({"mode": "token-mean", "global_num_tokens": False}, "global_num_tokens"),
        ({"mode": "token-mean", "global_num_seqs": float("nan")}, "global_num_seqs"),
        ({"mode": "token-mean", "global_num_seqs": math.inf}, "global_num_seqs"),
        ({"mode": "token-mean", "mask": torch.ones(3, 2)}, "mask"),
        ({"mode": "token-mean", "mask": torch.full((3, 3), 0.5)}, "mask"),
        ({"mode": "token-mean", "loss_mat": f64([1.0, 2.0, 3.0])}, "loss_mat"),
        ({"mode": "token-mean", "loss_mat": torch.full((3, 3), math.nan)}, "loss_mat"),
    ],
)
def test_aggregate_invalid_arguments(kwargs, argument):
    arguments = {"loss_mat": LOSS_MAT, "mask": MASK, "norm_constant": None} | kwargs
    with pytest.raises(ValueError, match=argument):
        aggregate(**arguments)


# ---------------------------------------------------------------------------------------------
# policy_loss: one row, one token per regime (clip_low 0.2, clip_high 0.28, clip_c 3)
# ---------------------------------------------------------------------------------------------

RATIOS = [1.5, 0.5, 0.5, 5.0, 1.1, 100.0]
ADVANTAGES = f64([[1.0, 1.0, -1.0, -1.0, -2.0, 5.0]])
REGIME_MASK = f64([[1, 1, 1, 1, 1, 0]])  # the last token is padding
# token 0: A>0, r above 1+0.28    -> clipped: -1.28             (clipfrac)
# token 1: A>0, r below 1-0.2     -> unclipped: -0.5
# token 2: A<0, r below 1-0.2     -> clipped: 0.8               (clipfrac)
# token 3: A<0, r = 5             -> max(5, 1.28) = 5, dual clip: min(5, 3) = 3   (clipfrac_lower)
# token 4: A<0, r inside the range -> 2.2
PER_TOKEN_LOSS = [-1.28, -0.5, 0.8, 3.0, 2.2]


def regime_inputs():
    old_logp = f64([[-1.0, -2.0, -0.5, -3.0, -1.5, -4.0]])
    logp = (old_logp + torch.log(f64([RATIOS]))).requires_grad_()
    return logp, old_logp


def test_ppo_clip_hand_computed():
    logp, old_logp = regime_inputs()
    loss, metrics = ppo(logp, old_logp, ADVANTAGES, REGIME_MASK, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    assert loss.item() == pytest.approx(sum(PER_TOKEN_LOSS) / 5, rel=1e-12)
    assert metrics["pg"] == pytest.approx(0.844, rel=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)
    assert metrics["clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["approx_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 0.5 * 5.0 * 1.1) / 5, rel=1e-12)
    assert all(type(value) is float for value in metrics.values())


def test_ppo_clip_gradient_only_through_unclipped_tokens():
    logp, old_logp = regime_inputs()
    loss, _ = ppo(logp, old_logp, ADVANTAGES, REGIME_MASK, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    loss.backward()
    # d(-A r)/d logp = -A r on the unclipped tokens 1 and 4, divided by the 5 real tokens.
    expected = [0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected, abs=1e-12)


def test_ppo_clip_symmetric_clip_range():
    logp, old_logp = regime_inputs()
    loss, metrics = ppo(logp, old_logp, ADVANTAGES, REGIME_MASK, clip_low=0.2, clip_high=0.2)
    # clip_high 0.2: token 0 becomes -1.2; the dual-clipped token keeps 3.
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 + 2.2) / 5, rel=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)


def test_ppo_clip_dual_clip_constant():
    logp, old_logp = regime_inputs()
    loss, metrics = ppo(logp, old_logp, ADVANTAGES, REGIME_MASK, clip_high=0.28, clip_c=10.0)
    # r = 5 < c = 10: the dual clip no longer binds.
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 5.0 + 2.2) / 5, rel=1e-12)
    assert metrics["clipfrac_lower"] == 0.0


def test_ppo_clip_log_ratio_beyond_twenty_is_clamped():
    old_logp = f64([[0.0, 0.0, 0.0, 0.0]])
    logp = f64([[30.0, 1000.0, -30.0, 25.0]]).requires_grad_()
    advantages = f64([[1.0, -1.0, 1.0, -1.0]])
    loss, metrics = ppo(logp, old_logp, advantages, torch.ones(1, 4, dtype=torch.float64))
    # token 0: clipped to -1.2; tokens 1 and 3: exp(20) dual-clipped to 3; token 2: -exp(-20).
    expected = (-1.2 + 3.0 - math.exp(-20) + 3.0) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["approx_kl"] == pytest.approx((-20 - 20 + 20 - 20) / 4)
    assert metrics["clipfrac_lower"] == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_ppo_clip_is_weights_multiply_after_clipping_and_get_no_gradient():
    logp, old_logp = regime_inputs()
    weights = f64([[2.0, 1.0, 0.5, 1.0, 0.0, 7.0]]).requires_grad_()
    loss, _ = ppo(logp, old_logp, ADVANTAGES, REGIME_MASK, clip_high=0.28, clip_c=3.0, is_weights=weights)
    assert loss.item() == pytest.approx((-1.28 * 2 - 0.5 + 0.8 * 0.5 + 3.0) / 5, rel=1e-12)
    loss.backward()
    assert weights.grad is None
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.1, 0.0, 0.0, 0.0, 0.0], abs=1e-12)


def test_old_logp_and_advantages_get_no_gradient():
    logp, old_logp = regime_inputs()
    old_logp.requires_grad_()
    advantages = ADVANTAGES.clone().requires_grad_()
    loss, _ = ppo(logp, old_logp, advantages, REGIME_MASK)
    loss.backward()
    assert old_logp.grad is None and advantages.grad is None


def test_reinforce_hand_computed():
    logp = f64([[-1.0, -2.0, -9.0]]).requires_grad_()
    old_logp = f64([[-1.5, -2.0, 0.0]])
    advantages = f64([[1.0, -1.0, 4.0]])
    mask = f64([[1, 1, 0]])
    loss, metrics = ppo(logp, old_logp, advantages, mask, loss_type="reinforce")
    assert loss.item() == pytest.approx((1.0 - 2.0) / 2)  # -A * logp = [1, -2]
    assert metrics["clipfrac"] == 0.0 and metrics["clipfrac_lower"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(-0.25)  # mean(old - new) = (-0.5 + 0) / 2
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, 0.5, 0.0]]


def test_reinforce_with_is_weights():
    logp = f64([[-1.0, -2.0]]).requires_grad_()
    weights = f64([[2.0, 0.5]])
    loss, _ = ppo(logp, logp.detach(), f64([[1.0, -1.0]]), torch.ones(1, 2), loss_type="reinforce", is_weights=weights)
    assert loss.item() == pytest.approx((2.0 - 1.0) / 2)
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, 0.25]]


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", (1.0 + 2.0 + 4.0) / 3),
        ("seq-mean-token-sum", (3.0 + 4.0) / 2),
        ("seq-mean-token-mean", (1.5 + 4.0) / 2),
        ("seq-mean-token-sum-norm", (3.0 + 4.0) / 2 / 2),
    ],
)
def test_policy_loss_aggregation_modes(agg, expected):
    # reinforce with A = 1 makes the per-token loss -logp = [[1, 2], [4, 9]].
    logp = f64([[-1.0, -2.0], [-4.0, -9.0], [-3.0, -3.0]])
    mask = f64([[1, 1], [1, 0], [0, 0]])
    loss, _ = ppo(logp, logp, torch.ones(3, 2, dtype=torch.float64), mask, loss_type="reinforce", agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_policy_loss_fully_masked_rows_are_ignored():
    logp, old_logp = regime_inputs()
    logp2 = torch.cat([logp, logp + 3.0])
    loss, metrics = ppo(
        logp2,
        torch.cat([old_logp, old_logp]),
        torch.cat([ADVANTAGES, -ADVANTAGES]),
        torch.cat([REGIME_MASK, torch.zeros_like(REGIME_MASK)]),
        clip_high=0.28,
    )
    assert loss.item() == pytest.approx(0.844, rel=1e-12)
    assert metrics["clipfrac"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"agg": "mean"}, "agg"),
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": True}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"clip_c": 1.0}, "clip_c"),
        ({"clip_c": "3"}, "clip_c"),
        ({"norm_constant": 0.0}, "norm_constant"),
        ({"global_num_tokens": -3}, "global_num_tokens"),
        ({"global_num_seqs": True}, "global_num_seqs"),
        ({"old_logp": torch.zeros(1, 5, dtype=torch.float64)}, "old_logp"),
        ({"advantages": torch.zeros(2, 6, dtype=torch.float64)}, "advantages"),
        ({"mask": torch.ones(1, 5)}, "mask"),
        ({"mask": torch.full((1, 6), 2.0)}, "mask"),
        ({"is_weights": torch.ones(1, 5)}, "is_weights"),
        ({"is_weights": torch.full((1, 6), math.nan)}, "is_weights"),
        ({"logp": torch.full((1, 6), math.nan)}, "logp"),
        ({"old_logp": torch.full((1, 6), math.nan)}, "old_logp"),
        ({"advantages": torch.full((1, 6), math.nan)}, "advantages"),
        ({"logp": torch.zeros(6)}, "logp"),
    ],
)
def test_policy_loss_invalid_arguments(kwargs, argument):
    logp, old_logp = regime_inputs()
    arguments = {"logp": logp, "old_logp": old_logp, "advantages": ADVANTAGES, "mask": REGIME_MASK} | PPO | kwargs
    with pytest.raises(ValueError, match=argument):
        call_with_settings(policy_loss, **arguments)


# ---------------------------------------------------------------------------------------------
# bypass_policy_loss: lam = logp - rollout_logp = [log 3, -log 1.5], i.e. ratios [3, 2/3]
# ---------------------------------------------------------------------------------------------


def bypass_inputs():
    logp = f64([[-1.0, -2.0]]).requires_grad_()
    rollout_logp = f64([[-1.0 - math.log(3.0), -2.0 + math.log(1.5)]])
    return logp, rollout_logp, f64([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.float64)


def test_bypass_ppo_clip_uses_rollout_logp_as_old_and_does_not_apply_weights():
    logp, rollout_logp, advantages, mask = bypass_inputs()
    loss, metrics = bypass(logp, rollout_logp, advantages, mask, is_level="token", is_threshold=2.0)
    # ratios [3, 2/3] with A = +1: [-1.2 (clipped), -2/3]; no IS weight on top.
    assert loss.item() == pytest.approx((-1.2 - 2 / 3) / 2, rel=1e-12)
    assert metrics["loss/pg"] == pytest.approx(loss.item())
    assert metrics["loss/clipfrac"] == pytest.approx(0.5)
    assert metrics["is/mean"] == pytest.approx((2.0 + 2 / 3) / 2, rel=1e-12)  # computed for the logs only
    assert metrics["mismatch/kl"] == pytest.approx((-math.log(3.0) + math.log(1.5)) / 2, rel=1e-12)


def test_bypass_reinforce_applies_truncated_weights():
    logp, rollout_logp, advantages, mask = bypass_inputs()
    loss, metrics = bypass(logp, rollout_logp, advantages, mask, loss_type="reinforce", is_level="token", is_threshold=2.0)
    # -A * logp * w with w = [min(3, 2), 2/3] = [2 * 1 * 2, 2 * 2/3] / 2
    assert loss.item() == pytest.approx((2.0 + 4 / 3) / 2, rel=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1 / 3], rel=1e-12)
    assert metrics["loss/approx_kl"] == pytest.approx((-math.log(3.0) + math.log(1.5)) / 2, rel=1e-12)


def test_bypass_reinforce_without_is_level_is_plain_reinforce():
    logp, rollout_logp, advantages, mask = bypass_inputs()
    loss, metrics = bypass(logp, rollout_logp, advantages, mask, loss_type="reinforce")
    assert loss.item() == pytest.approx(1.5)
    assert not any(key.startswith("is/") for key in metrics)


@pytest.mark.parametrize(("loss_type", "expected"), [("ppo_clip", -(2 / 3) / 2), ("reinforce", 2 * (2 / 3) / 2)])
def test_bypass_rejection_applies_to_both_loss_types(loss_type, expected):
    logp, rollout_logp, advantages, mask = bypass_inputs()
    loss, metrics = bypass(
        logp,
        rollout_logp,
        advantages,
        mask,
        loss_type=loss_type,
        is_level="token",
        rs="token_k1",
        rs_threshold=2.0,
    )
    # token 0 (ratio 3) is outside [1/2, 2] and rejected; the denominator still counts it.
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["is/rs_masked_token_frac"] == pytest.approx(0.5)
    assert metrics["is/rs_masked_seq_frac"] == pytest.approx(1.0)
    assert metrics["loss/approx_kl"] == pytest.approx(math.log(1.5), rel=1e-12)  # over the kept token


def test_bypass_global_denominators():
    logp, rollout_logp, advantages, mask = bypass_inputs()
    loss, _ = bypass(logp, rollout_logp, advantages, mask, loss_type="reinforce", global_num_tokens=6)
    assert loss.item() == pytest.approx(3.0 / 6)


def test_bypass_metric_keys():
    logp, rollout_logp, advantages, mask = bypass_inputs()
    _, metrics = bypass(logp, rollout_logp, advantages, mask, is_level="sequence", rs="seq_mean_k3", rs_threshold=5.0)
    expected_prefixed = {"loss/pg", "loss/clipfrac", "loss/clipfrac_lower", "loss/approx_kl"}
    assert expected_prefixed <= metrics.keys()
    assert {"is/mean", "is/ess", "is/rs_masked_token_frac", "mismatch/kl", "mismatch/chi2_seq"} <= metrics.keys()
    assert all(key.split("/")[0] in {"loss", "is", "mismatch"} for key in metrics)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"is_level": "batch"}, "is_level"),
        ({"is_threshold": "2_1"}, "is_threshold"),
        ({"rs": "token_k1"}, "rs_threshold"),
        ({"clip_c": 0.5}, "clip_c"),
        ({"rollout_logp": torch.zeros(1, 3, dtype=torch.float64)}, "rollout_logp"),
        ({"rollout_logp": torch.full((1, 2), math.nan, dtype=torch.float64)}, "rollout_logp"),
        ({"mask": torch.ones(1, 3)}, "mask"),
        ({"advantages": torch.zeros(1, 3, dtype=torch.float64)}, "advantages"),
    ],
)
def test_bypass_invalid_arguments(kwargs, argument):
    logp, rollout_logp, advantages, mask = bypass_inputs()
    arguments = {"logp": logp, "rollout_logp": rollout_logp, "advantages": advantages, "mask": mask} | PPO | NO_CORRECTION
    with pytest.raises(ValueError, match=argument):
        call_with_settings(bypass_policy_loss, **(arguments | kwargs))


COMPLETE_SETTINGS = [flat_settings(**PPO), CorrectionSettings(**NO_CORRECTION), KLSettings(kind="k3", coef=0.1)]


@pytest.mark.parametrize(
    ("complete", "key"),
    [(settings, field.name) for settings in COMPLETE_SETTINGS for field in dataclasses.fields(settings)],
)
def test_config_keys_have_no_default(complete, key):
    """A missing config key is an error, not a silent default that may differ from config's."""
    arguments = {field.name: getattr(complete, field.name) for field in dataclasses.fields(complete)}
    del arguments[key]
    with pytest.raises(TypeError, match=key):
        type(complete)(**arguments)


# ---------------------------------------------------------------------------------------------
# gspo: sequence ratios s = [1.5^(1/3), 2, 4] (clip_low 0.2, clip_high 0.28)
# ---------------------------------------------------------------------------------------------

GSPO_OLD_LOGP = f64([[-1.0, -2.0, -0.5], [-0.3, -1.0, -4.0], [-2.0, -1.0, -3.0]])
GSPO_TOKEN_RATIOS = f64([[2.0, 0.5, 1.5], [2.0, 2.0, 1.0], [16.0, 1.0, 1.0]])
GSPO_MASK = f64([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
GSPO_ADVANTAGES = f64([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
# row 0: A > 0, s = 1.5^(1/3) ~ 1.145 inside the range     -> -s on each of its 3 tokens
# row 1: A > 0, s = 2 above 1 + 0.28                      -> clipped: -1.28 on each of its 2 tokens
# row 2: A < 0, s = 4 above the range, no dual clip        -> 4 on each of its 2 tokens (ppo_clip: 3)
S0 = 1.5 ** (1 / 3)


def gspo_inputs(padding_logp=None):
    logp = GSPO_OLD_LOGP + GSPO_TOKEN_RATIOS.log()
    if padding_logp is not None:
        logp = logp.masked_fill(GSPO_MASK == 0, padding_logp)
    return logp.requires_grad_(), GSPO_OLD_LOGP


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("seq-mean-token-mean", (-S0 - 1.28 + 4.0) / 3),  # the GSPO paper's objective
        ("token-mean", (-3 * S0 - 2 * 1.28 + 2 * 4.0) / 7),
    ],
)
def test_gspo_hand_computed_value_and_metrics(agg, expected):
    logp, old_logp = gspo_inputs()
    loss, metrics = ppo(logp, old_logp, GSPO_ADVANTAGES, GSPO_MASK, loss_type="gspo", clip_high=0.28, agg=agg)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 7)  # row 1's two tokens
    assert metrics["clipfrac_lower"] == 0.0  # gspo has no dual clip
    token_log_ratios = [math.log(r) for r in (2.0, 0.5, 1.5, 2.0, 2.0, 16.0, 1.0)]
    assert metrics["approx_kl"] == pytest.approx(-sum(token_log_ratios) / 7, rel=1e-12)


def test_gspo_gradient_is_the_sequence_ratio_times_grad_logp_on_unclipped_rows():
    logp, old_logp = gspo_inputs()
    loss, _ = ppo(logp, old_logp, GSPO_ADVANTAGES, GSPO_MASK, loss_type="gspo", clip_high=0.28,
                  agg="seq-mean-token-mean")
    loss.backward()
    # -A_i * s_i / (|y_i| * 3 sequences) per real token of an unclipped row; the clipped row 1 gets 0.
    expected = [[-S0 / 9] * 3, [0.0, 0.0, 0.0], [4.0 / 6, 4.0 / 6, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in expected]


def test_gspo_ratio_is_per_sequence_not_per_token():
    # ppo_clip clips token 0 of row 0 (ratio 2) and keeps token 1 (ratio 0.5); gspo sees only s = 1.145.
    logp, old_logp = gspo_inputs()
    _, token_level = ppo(logp, old_logp, GSPO_ADVANTAGES, GSPO_MASK, clip_high=0.28)
    _, sequence_level = ppo(logp, old_logp, GSPO_ADVANTAGES, GSPO_MASK, loss_type="gspo", clip_high=0.28)
    assert token_level["clipfrac"] != sequence_level["clipfrac"]


def test_gspo_infinite_padding_log_probs_give_finite_loss_and_gradient():
    logp, old_logp = gspo_inputs(padding_logp=-math.inf)
    loss, _ = ppo(logp, old_logp, GSPO_ADVANTAGES, GSPO_MASK, loss_type="gspo", clip_high=0.28,
                  agg="seq-mean-token-mean")
    loss.backward()
    assert loss.item() == pytest.approx((-S0 - 1.28 + 4.0) / 3, rel=1e-12)
    assert bool(torch.isfinite(logp.grad).all()) and logp.grad[GSPO_MASK == 0].abs().sum().item() == 0.0


def test_gspo_sequence_log_ratio_beyond_ten_is_clamped_as_verl_does():
    old_logp = f64([[0.0, 0.0]])
    logp = f64([[30.0, 50.0]]).requires_grad_()  # mean log-ratio 40
    loss, _ = ppo(logp, old_logp, f64([[-1.0, -1.0]]), torch.ones(1, 2), loss_type="gspo")
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(10), rel=1e-12)
    assert logp.grad.tolist() == [[0.0, 0.0]]


def test_gspo_at_a_log_ratio_between_ten_and_twenty_has_verls_value_and_zero_gradient():
    # verl (compute_policy_loss_gspo): log s_it = min(sg[log s_i] + logp - sg[logp], 10); with A < 0
    # the unclipped term wins, so the loss is -A * e^10 per token and the clamp stops the gradient.
    old_logp = f64([[-2.0, -3.0]])
    logp = (old_logp + 15.0).requires_grad_()  # sequence log-ratio 15
    loss, metrics = ppo(logp, old_logp, f64([[-0.5, -0.5]]), torch.ones(1, 2), loss_type="gspo",
                        agg="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * math.exp(10), rel=1e-12)
    assert logp.grad.tolist() == [[0.0, 0.0]]
    assert metrics["clipfrac"] == 0.0  # max(-A s, -A clip(s)) took the unclipped term


def test_gspo_has_no_lower_clamp_a_very_negative_log_ratio_keeps_its_tiny_gradient():
    # verl bounds the log-ratio from above only: at -25 (below the -20 other ratios are clamped to),
    # with A > 0 the unclipped -A * e^-25 wins and the gradient is -A * e^-25 / |y| per token.
    old_logp = f64([[0.0, 0.0]])
    logp = f64([[-25.0, -25.0]]).requires_grad_()
    loss, _ = ppo(logp, old_logp, f64([[1.0, 1.0]]), torch.ones(1, 2), loss_type="gspo", agg="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(-25), rel=1e-12)
    assert logp.grad.tolist() == [pytest.approx([-math.exp(-25) / 2] * 2, rel=1e-12)]


# ---------------------------------------------------------------------------------------------
# cispo: one row, ratios [1.5, 0.5, 1.1, 100], IS weights clipped to [0.8, 1.28]
# ---------------------------------------------------------------------------------------------

CISPO_OLD_LOGP = f64([[-1.0, -2.0, -0.5, -6.0, -3.0]])
CISPO_RATIOS = f64([[1.5, 0.5, 1.1, 100.0, 1.0]])
CISPO_ADVANTAGES = f64([[1.0, 1.0, -2.0, -1.0, 0.0]])
CISPO_MASK = f64([[1, 1, 1, 1, 0]])  # the last token is padding
CISPO_WEIGHTS = [1.28, 0.8, 1.1, 1.28]  # clip(r, 0.8, 1.28): tokens 0, 1 and 3 are clipped


def cispo_inputs():
    return (CISPO_OLD_LOGP + CISPO_RATIOS.log()).requires_grad_(), CISPO_OLD_LOGP


def test_cispo_hand_computed_value_and_metrics():
    logp, old_logp = cispo_inputs()
    loss, metrics = ppo(logp, old_logp, CISPO_ADVANTAGES, CISPO_MASK, loss_type="cispo", clip_high=0.28)
    logps = logp.detach()[0, :4].tolist()
    advantages = CISPO_ADVANTAGES[0, :4].tolist()
    expected = sum(-w * a * lp for w, a, lp in zip(CISPO_WEIGHTS, advantages, logps, strict=True)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clipfrac"] == pytest.approx(3 / 4)  # the fraction of clipped IS weights
    assert metrics["clipfrac_lower"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 1.1 * 100.0) / 4, rel=1e-12)


def test_cispo_gradient_is_minus_advantage_times_the_detached_clipped_weight_even_where_clipped():
    logp, old_logp = cispo_inputs()
    loss, _ = ppo(logp, old_logp, CISPO_ADVANTAGES, CISPO_MASK, loss_type="cispo", clip_high=0.28)
    loss.backward()
    # PPO would give tokens 0 and 3 (clipped) a zero gradient; CISPO keeps -A * w / N on every token.
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 4, -0.8 / 4, 2 * 1.1 / 4, 1.28 / 4, 0.0], abs=1e-12)


def test_cispo_clip_low_one_removes_the_floor_of_the_weight():
    logp, old_logp = cispo_inputs()
    loss, metrics = ppo(logp, old_logp, CISPO_ADVANTAGES, CISPO_MASK, loss_type="cispo", clip_low=1.0,
                        clip_high=0.28)
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-0.5 / 4, rel=1e-12)  # weight 0.5, no longer raised to 0.8
    assert metrics["clipfrac"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce", "gspo", "m2po"])
def test_clip_low_one_is_refused_outside_cispo(loss_type):
    logp, old_logp = cispo_inputs()
    with pytest.raises(ValueError, match="clip_low"):
        ppo(logp, old_logp, CISPO_ADVANTAGES, CISPO_MASK, loss_type=loss_type, clip_low=1.0)


@pytest.mark.parametrize("loss_type", ["gspo", "cispo", "m2po"])
def test_bypass_ratio_losses_do_not_apply_is_weights(loss_type):
    # Their ratio is already against mu: the IS weights are logged, not applied (as for ppo_clip).
    logp, rollout_logp, advantages, mask = bypass_inputs()
    with_is, metrics = bypass(logp, rollout_logp, advantages, mask, loss_type=loss_type, is_level="token",
                              is_threshold=2.0)
    without_is, _ = bypass(logp, rollout_logp, advantages, mask, loss_type=loss_type)
    assert with_is.item() == without_is.item()
    assert "is/mean" in metrics


def test_gspo_token_form_gives_each_token_its_own_advantage():
    # s = sqrt(2 * 0.5) = 1 and A = [1, -1]: the token form sg[s] * pi_t / sg[pi_t] gives -A_t * s / N
    # per token; differentiating s itself would spread the mean advantage (0) over both tokens instead.
    old_logp = f64([[-1.0, -2.0]])
    logp = (old_logp + f64([[math.log(2.0), math.log(0.5)]])).requires_grad_()
    loss, _ = ppo(logp, old_logp, f64([[1.0, -1.0]]), torch.ones(1, 2), loss_type="gspo")
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    assert logp.grad.tolist() == [pytest.approx([-0.5, 0.5], rel=1e-12)]


# ---------------------------------------------------------------------------------------------
# m2po (Zheng et al. 2025, arXiv:2510.01161): the paper's Algorithm 1, literally, is the reference
# ---------------------------------------------------------------------------------------------


def m2po_algorithm_1(log_ratio: list[list[float]], advantages: list[list[float]], mask: list[list[int]],
                     threshold: float) -> set[tuple[int, int]]:
    """The tokens Algorithm 1 masks: T = the trust-region tokens (A > 0 and r > 1, or A < 0 and
    r < 1); while mean_{i in T} (log r_i)^2 > threshold, mask j = argmax_{i in T} (log r_i)^2 (the
    first such token) and take it out of T."""
    trust = [(b, t) for b, row in enumerate(log_ratio) for t, value in enumerate(row)
             if mask[b][t] and ((advantages[b][t] > 0 and value > 0) or (advantages[b][t] < 0 and value < 0))]
    masked = set()
    while trust and sum(log_ratio[b][t] ** 2 for b, t in trust) / len(trust) > threshold:
        j = max(trust, key=lambda bt: log_ratio[bt[0]][bt[1]] ** 2)  # max() keeps the first of equals
        masked.add(j)
        trust.remove(j)
    return masked


def test_m2po_hand_computed_mask_value_gradient_and_metrics():
    # Trust region: tokens 0 (A > 0, log r 0.5), 1 (A < 0, log r -0.1), 2 (A > 0, log r 0.3); token 3
    # has log r 0, token 4 is outside (A > 0, log r -2), token 5 is padding. Mean (log r)^2 over the
    # region: 0.35 / 3 > 0.04, take out token 0 (0.25): 0.10 / 2 = 0.05 > 0.04, take out token 2:
    # 0.01 <= 0.04.
    log_ratio = f64([[0.5, -0.1, 0.3, 0.0, -2.0, 0.7]])
    advantages = f64([[1.0, -1.0, 1.0, 1.0, 1.0, 1.0]])
    mask = f64([[1, 1, 1, 1, 1, 0]])
    old_logp = f64([[-1.0, -2.0, -0.5, -3.0, -1.5, -1.0]])
    logp = (old_logp + log_ratio).requires_grad_()
    loss, metrics = ppo(logp, old_logp, advantages, mask, loss_type="m2po", m2_threshold=0.04)
    loss.backward()
    kept = {1: 1.0 * math.exp(-0.1), 3: -1.0, 4: -math.exp(-2.0)}  # -A * r on the tokens left
    assert loss.item() == pytest.approx(sum(kept.values()) / 5, rel=1e-12)  # every real token counts
    assert logp.grad[0].tolist() == pytest.approx([0.0, kept[1] / 5, 0.0, kept[3] / 5, kept[4] / 5, 0.0], abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)  # the fraction taken out
    assert metrics["clipfrac_lower"] == 0.0


def test_m2po_takes_nothing_out_below_the_threshold_and_is_then_the_unclipped_surrogate():
    old_logp = f64([[-1.0, -2.0, -0.5]])
    logp = (old_logp + f64([[0.5, -0.4, 0.9]])).requires_grad_()
    advantages, mask = f64([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    loss, metrics = ppo(logp, old_logp, advantages, mask, loss_type="m2po", m2_threshold=10.0)
    # PPO would clip tokens 0 and 2 (r > 1.28 with A > 0); M2PO keeps -A * r whole.
    expected = -(math.exp(0.5) - math.exp(-0.4) + 2 * math.exp(0.9)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12) and metrics["clipfrac"] == 0.0


def test_m2po_takes_out_every_trust_region_token_when_even_the_smallest_is_beyond_the_threshold():
    log_ratio, advantages = f64([[0.5, -0.6, -0.5]]), f64([[1.0, -1.0, 1.0]])  # token 2 is outside
    removed = m2po_removed(log_ratio, advantages, torch.ones(1, 3, dtype=torch.bool), 0.04)
    assert removed.tolist() == [[True, True, False]]


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data(), rows=st.integers(1, 4), columns=st.integers(1, 6),
       threshold=st.sampled_from([1e-3, 0.04, 0.25, 1.0]))
def test_m2po_mask_is_the_papers_algorithm_1_ties_included(data, rows, columns, threshold):
    # Values from a small set, so equal (log r)^2 (ties, also between +x and -x) are common.
    value = st.sampled_from([-1.0, -0.5, -0.2, -0.1, 0.0, 0.1, 0.2, 0.5, 1.0])
    log_ratio = data.draw(st.lists(st.lists(value, min_size=columns, max_size=columns), min_size=rows, max_size=rows))
    advantages = data.draw(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=columns,
                                             max_size=columns), min_size=rows, max_size=rows))
    mask = data.draw(st.lists(st.lists(st.sampled_from([0, 1]), min_size=columns, max_size=columns),
                              min_size=rows, max_size=rows))
    removed = m2po_removed(f64(log_ratio), f64(advantages), torch.tensor(mask, dtype=torch.bool), threshold)
    found = {(b, t) for b in range(rows) for t in range(columns) if removed[b, t]}
    assert found == m2po_algorithm_1(log_ratio, advantages, mask, threshold)


def test_m2po_threshold_must_be_positive():
    logp, old_logp = cispo_inputs()
    with pytest.raises(ValueError, match="m2_threshold must be > 0"):
        ppo(logp, old_logp, CISPO_ADVANTAGES, CISPO_MASK, loss_type="m2po", m2_threshold=0.0)
