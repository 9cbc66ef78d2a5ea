"""Property tests (hypothesis) for asyncgrpo.algo."""

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
    KL_KINDS,
    LOSS_TYPES,
    aggregate,
    bypass_policy_loss,
    group_advantages,
    kl_penalty,
    policy_loss,
    rollout_correction,
)
from asyncgrpo.schema import AlgoConfig, CorrectionConfig

# M2PO's mask is a statistic of the tokens of one call (losses.m2po_removed): its loss alone does not
# add up over a split of the batch.
ADDITIVE_LOSS_TYPES = [loss_type for loss_type in LOSS_TYPES if loss_type != "m2po"]

# The functions take their config keys without defaults; these tests use config's, overriding
# what they vary.
_ALGO = AlgoConfig()
PPO = {key: getattr(_ALGO, key) for key in ("loss_type", "clip_low", "clip_high", "clip_c", "agg", "norm_constant")}
CORRECTION = dataclasses.asdict(CorrectionConfig())

# Derandomized so CI is reproducible; no example database is written to the work tree.
property_test = settings(max_examples=40, deadline=None, derandomize=True, database=None)


@st.composite
def token_batches(draw, max_rows=6, max_tokens=6, log_ratio_scale=1.0):
    """(logp, other_logp, advantages, mask) in float64 with random shapes, values and padding."""
    rows = draw(st.integers(1, max_rows))
    tokens = draw(st.integers(1, max_tokens))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logp = -torch.rand(rows, tokens, generator=generator, dtype=torch.float64) * 5
    other = logp + log_ratio_scale * torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    advantages = torch.randn(rows, 1, generator=generator, dtype=torch.float64).expand(rows, tokens).clone()
    lengths = torch.tensor(draw(st.lists(st.integers(0, tokens), min_size=rows, max_size=rows)))
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.float64)
    return logp, other, advantages * mask, mask


@st.composite
def row_splits(draw, rows):
    """A partition of range(rows) into micro-batches, in arbitrary order."""
    order = draw(st.permutations(range(rows)))
    cut_points = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=rows - 1))) if rows > 1 else []
    bounds = [0, *cut_points, rows]
    return [torch.tensor(order[start:end]) for start, end in itertools.pairwise(bounds)]


# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------


@property_test
@given(
    data=st.lists(st.tuples(st.integers(0, 4), st.floats(-10, 10)), min_size=1, max_size=24),
    mode=st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
def test_advantages_sum_to_zero_per_group(data, mode):
    group_ids = torch.tensor([group for group, _ in data])
    rewards = torch.tensor([reward for _, reward in data], dtype=torch.float64)
    advantages = group_advantages(rewards, group_ids, mode=mode)
    for group in group_ids.unique():
        members = group_ids == group
        assert abs(advantages[members].sum().item()) < 1e-6 * max(1.0, advantages[members].abs().max().item())
        if members.sum() == 1:
            assert advantages[members].item() == 0.0


@property_test
@given(data=st.lists(st.tuples(st.integers(0, 3), st.floats(-10, 10)), min_size=1, max_size=16))
def test_rloo_is_reward_minus_mean_of_others(data):
    group_ids = [group for group, _ in data]
    rewards = [reward for _, reward in data]
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_ids, mode="rloo")
    for index, (group, reward) in enumerate(data):
        others = [r for j, (g, r) in enumerate(data) if g == group and j != index]
        expected = reward - sum(others) / len(others) if others and len({*others, reward}) > 1 else 0.0
        assert advantages[index].item() == pytest.approx(expected, abs=1e-9)


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------

log_probs = st.lists(st.floats(-60, 0), min_size=1, max_size=12)


@property_test
@given(logp=log_probs, ref_logp=log_probs)
def test_k3_is_non_negative(logp, ref_logp):
    size = min(len(logp), len(ref_logp))
    values = kl_penalty(torch.tensor(logp[:size]), torch.tensor(ref_logp[:size]), kind="k3")
    assert bool((values >= 0).all())


@property_test
@given(
    logp=log_probs,
    ref_logp=log_probs,
    kind=st.sampled_from([kind for kind in KL_KINDS if kind.endswith("+")]),
)
def test_plus_kinds_have_the_gradient_of_k2(logp, ref_logp, kind):
    size = min(len(logp), len(ref_logp))
    logp_tensor = torch.tensor(logp[:size], dtype=torch.float64, requires_grad=True)
    ref_tensor = torch.tensor(ref_logp[:size], dtype=torch.float64)
    values = kl_penalty(logp_tensor, ref_tensor, kind=kind)
    (gradient,) = torch.autograd.grad(values.sum(), logp_tensor)
    torch.testing.assert_close(gradient, logp_tensor.detach() - ref_tensor)
    torch.testing.assert_close(values.detach(), kl_penalty(logp_tensor.detach(), ref_tensor, kind=kind[:-1]))


# ---------------------------------------------------------------------------------------------
# rollout correction
# ---------------------------------------------------------------------------------------------


@property_test
@given(batch=token_batches())
def test_sequence_weight_is_product_of_token_ratios_before_truncation(batch):
    logp_train, logp_rollout, _, mask = batch
    weights, _, _ = rollout_correction(logp_train, logp_rollout, mask, **(CORRECTION | {"is_level": "sequence", "is_threshold": 1e12}))
    ratios = torch.where(mask.bool(), (logp_train - logp_rollout).exp(), 1.0)
    product = ratios.prod(-1, keepdim=True).expand_as(mask) * mask
    torch.testing.assert_close(weights, product, rtol=1e-9, atol=0.0)


@property_test
@given(batch=token_batches(log_ratio_scale=3.0), threshold=st.floats(0.1, 10.0))
def test_truncated_weights_are_bounded_and_detached(batch, threshold):
    logp_train, logp_rollout, _, mask = batch
    logp_train.requires_grad_()
    for level in ("token", "sequence"):
        weights, _, _ = rollout_correction(
            logp_train, logp_rollout, mask, **(CORRECTION | {"is_level": level, "is_threshold": threshold}))
        assert not weights.requires_grad
        assert bool((weights <= threshold).all()) and bool((weights >= 0).all())
        assert bool((weights[mask == 0] == 0).all())


@property_test
@given(batch=token_batches(log_ratio_scale=3.0), level=st.sampled_from(["token", "sequence"]))
def test_weights_path_carries_no_gradient(batch, level):
    logp, rollout_logp, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | CORRECTION | {"loss_type": "reinforce", "is_level": level, "is_threshold": 1e6}
    loss, _ = call_with_settings(bypass_policy_loss, logp, rollout_logp, advantages, mask, **options)
    (gradient,) = torch.autograd.grad(loss, logp)
    weights, _, _ = rollout_correction(logp.detach(), rollout_logp, mask, **(CORRECTION | {"is_level": level, "is_threshold": 1e6}))
    # d/dlogp of -A * logp * w / N with w held constant; a gradient through w would add A*logp*w/N terms.
    expected = -advantages * weights * mask / max(mask.sum().item(), 1.0)
    torch.testing.assert_close(gradient, expected)


# ---------------------------------------------------------------------------------------------
# additivity over micro-batches with global denominators
# ---------------------------------------------------------------------------------------------


def global_counts(mask):
    return {"global_num_tokens": mask.sum().item(), "global_num_seqs": (mask.sum(-1) > 0).sum().item()}


@property_test
@given(data=st.data(), batch=token_batches(max_rows=8), mode=st.sampled_from(AGG_MODES))
def test_aggregate_over_micro_batches_equals_unsplit(data, batch, mode):
    loss_mat, _, _, mask = batch
    loss_mat.requires_grad_()
    whole = aggregate(loss_mat, mask, mode, norm_constant=None)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)
    splits = data.draw(row_splits(len(mask)))
    parts = sum(aggregate(loss_mat[rows], mask[rows], mode, norm_constant=None, **global_counts(mask)) for rows in splits)
    (parts_grad,) = torch.autograd.grad(parts, loss_mat)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


@property_test
@given(
    data=st.data(),
    batch=token_batches(max_rows=8),
    loss_type=st.sampled_from(ADDITIVE_LOSS_TYPES),
    agg=st.sampled_from(AGG_MODES),
)
def test_policy_loss_over_micro_batches_equals_unsplit(data, batch, loss_type, agg):
    logp, old_logp, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | {"loss_type": loss_type, "agg": agg}
    whole, _ = call_with_settings(policy_loss, logp, old_logp, advantages, mask, **options)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    parts = 0.0
    for rows in data.draw(row_splits(len(mask))):
        part, _ = call_with_settings(
            policy_loss,
            logp[rows],
            old_logp[rows],
            advantages[rows],
            mask[rows],
            **options,
            **global_counts(mask),
        )
        parts = parts + part
    (parts_grad,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


@property_test
@given(
    data=st.data(),
    batch=token_batches(max_rows=8),
    loss_type=st.sampled_from(ADDITIVE_LOSS_TYPES),
    agg=st.sampled_from(AGG_MODES),
    is_level=st.sampled_from([None, "token", "sequence"]),
    rs=st.sampled_from([None, "token_k1", "seq_mean_k3", "token_k2,seq_max_k3"]),
)
def test_bypass_loss_over_micro_batches_equals_unsplit(data, batch, loss_type, agg, is_level, rs):
    logp, rollout_logp, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | CORRECTION | {"loss_type": loss_type, "agg": agg, "is_level": is_level, "rs": rs, "rs_threshold": "1.5"}
    whole, _ = call_with_settings(bypass_policy_loss, logp, rollout_logp, advantages, mask, **options)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    parts = 0.0
    for rows in data.draw(row_splits(len(mask))):
        part, _ = call_with_settings(
            bypass_policy_loss, logp[rows], rollout_logp[rows], advantages[rows], mask[rows], **options,
            **global_counts(mask)
        )
        parts = parts + part
    (parts_grad,) = torch.autograd.grad(parts, logp)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(parts_grad, whole_grad)


@property_test
@given(batch=token_batches(log_ratio_scale=30.0))
def test_extreme_log_ratios_stay_finite(batch):
    logp, old_logp, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | CORRECTION | {"is_level": "sequence", "rs": "seq_sum_k1", "rs_threshold": 1e3}
    loss, metrics = call_with_settings(bypass_policy_loss, logp, old_logp, advantages, mask, **options)
    (gradient,) = torch.autograd.grad(loss, logp)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(gradient).all())
    assert all(math.isfinite(value) for value in metrics.values())


# ---------------------------------------------------------------------------------------------
# gspo and cispo
# ---------------------------------------------------------------------------------------------


@property_test
@given(batch=token_batches(), agg=st.sampled_from(AGG_MODES), loss_type=st.sampled_from(["ppo_clip", "gspo", "cispo"]))
def test_on_policy_ratio_losses_have_the_policy_gradient_of_reinforce(batch, agg, loss_type):
    # At ratio 1 nothing is clipped: gspo's s_i,t and ppo's r_t have the gradient of logp, and cispo's
    # weight is 1. For gspo that is the sequence-mean policy gradient under seq-mean-token-mean.
    logp, _, advantages, mask = batch
    logp.requires_grad_()
    loss, _ = call_with_settings(policy_loss, logp, logp.detach(), advantages, mask,
                                 **(PPO | {"loss_type": loss_type, "agg": agg}))
    reinforce, _ = call_with_settings(policy_loss, logp, logp.detach(), advantages, mask,
                                      **(PPO | {"loss_type": "reinforce", "agg": agg}))
    (gradient,) = torch.autograd.grad(loss, logp)
    (reinforce_gradient,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(gradient, reinforce_gradient)
    if loss_type == "cispo":
        assert loss.item() == reinforce.item()


@property_test
@given(batch=token_batches())
def test_gspo_is_the_clipped_sequence_objective_with_its_gradient(batch):
    # Independently of the token form: s_i = exp(mean_t (logp - old_logp)) per non-empty row, loss =
    # mean_i max(-A_i s_i, -A_i clip(s_i)), gradient -A_i s_i / (|y_i| N_seq) on the rows not clipped.
    logp, old_logp, advantages, mask = batch
    logp.requires_grad_()
    clip_low, clip_high = PPO["clip_low"], PPO["clip_high"]
    options = PPO | {"loss_type": "gspo", "agg": "seq-mean-token-mean"}
    loss, _ = call_with_settings(policy_loss, logp, old_logp, advantages, mask, **options)
    (gradient,) = torch.autograd.grad(loss, logp)

    lengths = mask.sum(-1)
    non_empty = lengths > 0
    num_seqs = max(int(non_empty.sum()), 1)
    seq_ratio = (((logp.detach() - old_logp) * mask).sum(-1) / lengths.clamp_min(1)).exp()
    row_advantage = advantages[:, 0]
    objective = torch.maximum(-row_advantage * seq_ratio,
                              -row_advantage * seq_ratio.clamp(1 - clip_low, 1 + clip_high))
    expected_loss = (objective * non_empty).sum() / num_seqs
    clipped = ((row_advantage > 0) & (seq_ratio > 1 + clip_high)) | ((row_advantage < 0) & (seq_ratio < 1 - clip_low))
    row_gradient = torch.where(clipped, 0.0, -row_advantage * seq_ratio) / (lengths.clamp_min(1) * num_seqs)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(gradient, row_gradient[:, None] * mask)


@property_test
@given(batch=token_batches(log_ratio_scale=3.0), clip_low=st.sampled_from([0.2, 0.5, 1.0]))
def test_cispo_gradient_is_minus_advantage_times_the_clipped_weight(batch, clip_low):
    logp, old_logp, advantages, mask = batch
    logp.requires_grad_()
    options = PPO | {"loss_type": "cispo", "clip_low": clip_low, "agg": "token-mean"}
    loss, metrics = call_with_settings(policy_loss, logp, old_logp, advantages, mask, **options)
    (gradient,) = torch.autograd.grad(loss, logp)
    ratio = (logp.detach() - old_logp).clamp(-20, 20).exp()
    weight = ratio.clamp(1 - clip_low, 1 + PPO["clip_high"])
    assert bool((weight >= 1 - clip_low).all()) and bool((weight <= 1 + PPO["clip_high"]).all())
    torch.testing.assert_close(gradient, -advantages * weight * mask / max(mask.sum().item(), 1.0))
    outside = (ratio < 1 - clip_low) | (ratio > 1 + PPO["clip_high"])
    assert metrics["clipfrac"] == pytest.approx((outside * mask).sum().item() / max(mask.sum().item(), 1.0))
