"""algo.mode: bypass (mu anchors the ratio), decoupled (pi_prox anchors it, IS weights pi_prox / mu
multiply the loss) and naive (pi_prox anchors it, no correction): hand-computed cases and properties."""

import dataclasses
import itertools
import math

import pytest
import torch
from flat_settings import call_with_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.algo import (
    AGG_MODES,
    LOSS_TYPES,
    MODES,
    bypass_policy_loss,
    decoupled_policy_loss,
    mode_policy_loss,
    naive_policy_loss,
    policy_loss,
)
from asyncgrpo.schema import AlgoConfig, CorrectionConfig

_ALGO = AlgoConfig()
PPO = {key: getattr(_ALGO, key) for key in ("loss_type", "clip_low", "clip_high", "clip_c", "agg", "norm_constant")}
CORRECTION = dataclasses.asdict(CorrectionConfig())
RATIO_LOSS_TYPES = ["ppo_clip", "gspo", "cispo", "m2po"]
# M2PO's mask is a statistic of the tokens of one call (losses.m2po_removed): its loss alone does not
# add up over a split of the batch.
ADDITIVE_LOSS_TYPES = [loss_type for loss_type in LOSS_TYPES if loss_type != "m2po"]

property_test = settings(max_examples=40, deadline=None, derandomize=True, database=None)


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


@st.composite
def three_policies(draw, max_rows=6, max_tokens=6):
    """(logp, prox_logp, rollout_logp, advantages, mask) in float64, random shapes and padding."""
    rows = draw(st.integers(1, max_rows))
    tokens = draw(st.integers(1, max_tokens))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    prox = -torch.rand(rows, tokens, generator=generator, dtype=torch.float64) * 5
    logp = prox + 0.3 * torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    rollout = prox + torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, 1, generator=generator, dtype=torch.float64).expand(rows, tokens)
    lengths = torch.tensor(draw(st.lists(st.integers(0, tokens), min_size=rows, max_size=rows)))
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.float64)
    return logp, prox, rollout, advantages * mask, mask


def loss_and_gradient(function, logp, *args, **options):
    """function(logp, *args) with config's settings (PPO, CORRECTION), `options` overriding them."""
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = call_with_settings(function, logp, *args, **(PPO | CORRECTION | options))
    (gradient,) = torch.autograd.grad(loss, logp)
    return loss.detach(), gradient, metrics


# ---------------------------------------------------------------------------------------------
# decoupled: prox / mu = [3, 2/3] per token (sequence: 2), A = +1 on two tokens
# ---------------------------------------------------------------------------------------------

PROX = f64([[-1.0, -2.0]])
ROLLOUT = f64([[-1.0 - math.log(3.0), -2.0 + math.log(1.5)]])
ADVANTAGES = f64([[1.0, 1.0]])
MASK = torch.ones(1, 2, dtype=torch.float64)


def decoupled(logp, prox=PROX, rollout=ROLLOUT, *, settings):
    return decoupled_policy_loss(logp, prox, rollout, ADVANTAGES, MASK, settings)


@pytest.mark.parametrize(
    ("correction", "weights"),
    [
        ({"is_level": "token", "is_threshold": 2.0}, [2.0, 2 / 3]),  # truncated at 2
        ({"is_level": "token", "is_threshold": "0.5_2.0"}, [0.0, 2 / 3]),  # masked outside [0.5, 2]
        ({"is_level": "sequence", "is_threshold": 1.5}, [1.5, 1.5]),  # 3 * 2/3 = 2, truncated at 1.5
        ({"is_level": None}, [1.0, 1.0]),  # no weights
    ],
)
def test_decoupled_weights_are_prox_over_mu_per_the_correction_settings(correction, weights):
    # logp = prox (the step's single optimizer step has not happened): ratio 1, loss -A * w per token.
    loss, gradient, metrics = loss_and_gradient(decoupled, PROX, **correction)
    assert loss.item() == pytest.approx(-sum(weights) / 2, rel=1e-12)
    assert gradient[0].tolist() == pytest.approx([-w / 2 for w in weights], rel=1e-12)
    assert metrics["loss/approx_kl"] == 0.0
    assert metrics["mismatch/kl"] == pytest.approx((-math.log(3.0) + math.log(1.5)) / 2, rel=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_decoupled_weights_do_not_depend_on_the_trained_policy(loss_type):
    # Unlike bypass, where the weights are pi_theta / mu, decoupled takes them from pi_prox / mu.
    logp = PROX + f64([[0.1, -0.05]])
    correction = {"is_level": "token", "is_threshold": 2.0}
    loss, gradient, _ = loss_and_gradient(decoupled, logp, loss_type=loss_type, **correction)
    options = PPO | {"loss_type": loss_type}
    expected, expected_gradient, _ = loss_and_gradient(policy_loss, logp, PROX, ADVANTAGES, MASK, **options,
                                                       is_weights=f64([[2.0, 2 / 3]]))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(gradient, expected_gradient)


def test_decoupled_rejection_uses_prox_over_mu_and_still_counts_rejected_tokens():
    # token_k1 at 2 keeps prox/mu in [1/2, 2]: token 0 (3) is rejected, token 1 (2/3) kept.
    loss, gradient, metrics = loss_and_gradient(decoupled, PROX, is_level="token", rs="token_k1", rs_threshold=2.0)
    assert loss.item() == pytest.approx(-(2 / 3) / 2, rel=1e-12)  # the denominator still counts token 0
    assert gradient[0].tolist() == pytest.approx([0.0, -(2 / 3) / 2], rel=1e-12)
    assert metrics["is/rs_masked_token_frac"] == pytest.approx(0.5)


def test_decoupled_metric_keys():
    options = PPO | CORRECTION | {"is_level": "sequence", "rs": "seq_mean_k3", "rs_threshold": 5.0}
    _, metrics = call_with_settings(decoupled, PROX.clone().requires_grad_(), **options)
    assert {"loss/pg", "loss/clipfrac", "loss/clipfrac_lower", "loss/approx_kl"} <= metrics.keys()
    assert {"is/mean", "is/ess", "is/rs_masked_token_frac", "mismatch/kl", "mismatch/chi2_seq"} <= metrics.keys()
    assert all(key.split("/")[0] in {"loss", "is", "mismatch"} for key in metrics)


@property_test
@given(
    batch=three_policies(),
    loss_type=st.sampled_from(RATIO_LOSS_TYPES),
    agg=st.sampled_from(AGG_MODES),
    is_level=st.sampled_from([None, "token", "sequence"]),
    is_threshold=st.sampled_from([2.0, "0.5_2.0"]),
    is_batch_normalize=st.booleans(),
)
def test_decoupled_equals_bypass_exactly_when_mu_equals_prox(batch, loss_type, agg, is_level, is_threshold,
                                                             is_batch_normalize):
    # Same anchor, and every weight pi_prox / mu is 1 (bypass applies none to a ratio loss).
    logp, _, rollout, advantages, mask = batch
    options = PPO | CORRECTION | {"loss_type": loss_type, "agg": agg, "is_level": is_level,
                                  "is_threshold": is_threshold, "is_batch_normalize": is_batch_normalize}
    loss, gradient, _ = loss_and_gradient(decoupled_policy_loss, logp, rollout, rollout, advantages, mask, **options)
    expected, expected_gradient, _ = loss_and_gradient(bypass_policy_loss, logp, rollout, advantages, mask, **options)
    assert torch.equal(loss, expected)
    assert torch.equal(gradient, expected_gradient)


@property_test
@given(
    batch=three_policies(),
    agg=st.sampled_from(AGG_MODES),
    is_level=st.sampled_from([None, "token", "sequence"]),
    rs=st.sampled_from([None, "token_k1", "seq_mean_k3", "token_k2,seq_max_k3"]),
)
def test_decoupled_reinforce_equals_bypass_reinforce_before_the_optimizer_step(batch, agg, is_level, rs):
    # With one optimizer step per batch, pi_theta = pi_prox at the forward: bypass's weights
    # pi_theta / mu and rejection are then decoupled's pi_prox / mu.
    _, prox, rollout, advantages, mask = batch
    options = PPO | CORRECTION | {"loss_type": "reinforce", "agg": agg, "is_level": is_level, "rs": rs,
                                  "rs_threshold": "1.5"}
    loss, gradient, metrics = loss_and_gradient(decoupled_policy_loss, prox, prox, rollout, advantages, mask, **options)
    expected, expected_gradient, expected_metrics = loss_and_gradient(bypass_policy_loss, prox, rollout, advantages,
                                                                      mask, **options)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(gradient, expected_gradient)
    assert metrics.keys() == expected_metrics.keys()


@property_test
@given(
    data=st.data(),
    batch=three_policies(max_rows=8),
    loss_type=st.sampled_from(ADDITIVE_LOSS_TYPES),
    agg=st.sampled_from(AGG_MODES),
    is_level=st.sampled_from([None, "token", "sequence"]),
    rs=st.sampled_from([None, "token_k1", "seq_mean_k3"]),
)
def test_decoupled_loss_over_micro_batches_equals_unsplit(data, batch, loss_type, agg, is_level, rs):
    logp, prox, rollout, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | CORRECTION | {"loss_type": loss_type, "agg": agg, "is_level": is_level, "rs": rs,
                                  "rs_threshold": "1.5"}
    whole, _ = call_with_settings(decoupled_policy_loss, logp, prox, rollout, advantages, mask, **options)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    order = data.draw(st.permutations(range(len(mask))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(mask) - 1), max_size=len(mask) - 1))) if len(mask) > 1 else []
    counts = {"global_num_tokens": mask.sum().item(), "global_num_seqs": (mask.sum(-1) > 0).sum().item()}
    parts = 0.0
    for start, end in itertools.pairwise([0, *cuts, len(mask)]):
        rows = torch.tensor(order[start:end])
        part, _ = call_with_settings(decoupled_policy_loss, logp[rows], prox[rows], rollout[rows], advantages[rows],
                                     mask[rows], **options, **counts)
        parts = parts + part
    (parts_grad,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


# ---------------------------------------------------------------------------------------------
# naive
# ---------------------------------------------------------------------------------------------


@property_test
@given(batch=three_policies(), loss_type=st.sampled_from(LOSS_TYPES), agg=st.sampled_from(AGG_MODES))
def test_naive_ignores_mu_entirely(batch, loss_type, agg):
    logp, prox, rollout, advantages, mask = batch
    options = PPO | {"loss_type": loss_type, "agg": agg}
    loss, gradient, metrics = loss_and_gradient(naive_policy_loss, logp, prox, rollout, advantages, mask, **options)
    other, other_gradient, _ = loss_and_gradient(naive_policy_loss, logp, prox, rollout - 3.0, advantages, mask,
                                                 **options)
    assert torch.equal(loss, other) and torch.equal(gradient, other_gradient)
    # It is the plain policy loss against pi_prox, with no weights and no rejection.
    expected, expected_gradient, _ = loss_and_gradient(policy_loss, logp, prox, advantages, mask, **options)
    assert torch.equal(loss, expected) and torch.equal(gradient, expected_gradient)
    assert not any(key.startswith("is/") for key in metrics)


def test_naive_still_reports_the_mismatch_of_prox_and_mu():
    logp = PROX.clone().requires_grad_()
    _, metrics = call_with_settings(naive_policy_loss, logp, PROX, ROLLOUT, ADVANTAGES, MASK, **PPO)
    assert metrics["mismatch/kl"] == pytest.approx((-math.log(3.0) + math.log(1.5)) / 2, rel=1e-12)
    assert metrics["loss/pg"] == pytest.approx(-1.0)  # ratio 1, A = 1, no weights


# ---------------------------------------------------------------------------------------------
# mode_policy_loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_mode_policy_loss_dispatches_to_the_mode(mode):
    logp = PROX + f64([[0.1, -0.05]])
    correction = CORRECTION | {"is_level": "token", "is_threshold": 2.0}
    prox = None if mode == "bypass" else PROX
    loss, _, metrics = loss_and_gradient(mode_policy_loss, logp, prox, ROLLOUT, ADVANTAGES, MASK, mode=mode,
                                         **PPO, **correction)
    if mode == "bypass":
        expected, _, expected_metrics = loss_and_gradient(bypass_policy_loss, logp, ROLLOUT, ADVANTAGES, MASK,
                                                          **PPO, **correction)
    elif mode == "decoupled":
        expected, _, expected_metrics = loss_and_gradient(decoupled_policy_loss, logp, PROX, ROLLOUT, ADVANTAGES,
                                                          MASK, **PPO, **correction)
    else:
        expected, _, expected_metrics = loss_and_gradient(naive_policy_loss, logp, PROX, ROLLOUT, ADVANTAGES, MASK,
                                                          **PPO)
    assert torch.equal(loss, expected)
    assert metrics == expected_metrics


@pytest.mark.parametrize(
    ("mode", "prox", "argument"),
    [("bypass", PROX, "prox_logp"), ("decoupled", None, "prox_logp"), ("naive", None, "prox_logp"),
     ("recompute", PROX, "mode")],
)
def test_mode_policy_loss_refuses_a_missing_or_unexpected_anchor(mode, prox, argument):
    with pytest.raises(ValueError, match=argument):
        call_with_settings(mode_policy_loss, PROX.clone().requires_grad_(), prox, ROLLOUT, ADVANTAGES, MASK, mode=mode,
                           **PPO, **CORRECTION)


@pytest.mark.parametrize("function", [decoupled_policy_loss, naive_policy_loss])
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"prox_logp": torch.zeros(1, 3, dtype=torch.float64)}, "prox_logp"),
        ({"prox_logp": torch.full((1, 2), math.nan, dtype=torch.float64)}, "prox_logp"),
        ({"rollout_logp": torch.zeros(2, 2, dtype=torch.float64)}, "rollout_logp"),
        ({"advantages": torch.zeros(1, 3, dtype=torch.float64)}, "advantages"),
        ({"mask": torch.full((1, 2), 0.5)}, "mask"),
        ({"loss_type": "ppo"}, "loss_type"),
    ],
)
def test_invalid_arguments(function, kwargs, argument):
    arguments = {"logp": PROX.clone().requires_grad_(), "prox_logp": PROX, "rollout_logp": ROLLOUT,
                 "advantages": ADVANTAGES, "mask": MASK} | PPO
    if function is decoupled_policy_loss:
        arguments |= CORRECTION
    with pytest.raises(ValueError, match=argument):
        call_with_settings(function, **(arguments | kwargs))
