"""The divergence per token age and the per-group cap (asyncgrpo/algo/divergence.py), against values
computed by hand from the definitions (k3 = exp(lt) - 1 - lt, ESS = (sum w)^2 / (n sum w^2))."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.algo import age_bucket_sums, bucket_divergences, group_cap


def k3(lt: float) -> float:
    return math.exp(lt) - 1 - lt


LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.2, -1.5, -0.5], [-0.7, -1.0, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the third token of row 0 is padding
AGES = torch.tensor([[0, 1, 1], [2, 5, 3]])  # 5 falls in the last bucket of 3 ("2plus")


def test_each_age_bucket_gets_the_mean_k3_and_normalised_ess_of_its_tokens():
    sums = age_bucket_sums(LOGP, ROLLOUT, MASK, AGES, num_buckets=3)
    buckets, metrics = bucket_divergences(sums)
    # age 0: lt 0.2; age 1: lt -0.5 (the padded token is left out); 2plus: lt -0.3 (age 2), 0 (age 5), 3 (age 3)
    assert metrics["divergence/k3_age_0"] == pytest.approx(k3(0.2))
    assert metrics["divergence/k3_age_1"] == pytest.approx(k3(-0.5))
    assert metrics["divergence/k3_age_2plus"] == pytest.approx((k3(-0.3) + k3(0.0) + k3(3.0)) / 3)
    w = [math.exp(-0.3), 1.0, math.exp(3.0)]
    assert metrics["divergence/ess_age_2plus"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))
    assert metrics["divergence/ess_age_0"] == pytest.approx(1.0)  # one token: nothing to spread
    assert [(age, tokens) for age, tokens, _, _ in buckets] == [(0.0, 1.0), (1.0, 1.0), (pytest.approx(10 / 3), 3.0)]


def test_the_same_policy_has_no_divergence_and_full_ess():
    buckets, metrics = bucket_divergences(age_bucket_sums(LOGP, LOGP.clone(), MASK, AGES, num_buckets=5))
    assert all(value == 0 for key, value in metrics.items() if "k3" in key)
    assert all(value == pytest.approx(1) for key, value in metrics.items() if "ess" in key)


def test_empty_buckets_are_left_out_and_sums_over_row_splits_add_up_to_the_whole():
    whole = age_bucket_sums(LOGP, ROLLOUT, MASK, AGES, num_buckets=8)
    parts = sum(age_bucket_sums(LOGP[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1], AGES[i:i + 1], num_buckets=8)
                for i in range(2))
    assert torch.allclose(whole, parts)
    _, metrics = bucket_divergences(whole)
    assert sorted(k for k in metrics if "k3" in k) == [f"divergence/k3_age_{a}" for a in (0, 1, 2, 3, 5)]


def test_a_negative_age_is_refused():
    with pytest.raises(ValueError, match="negative age"):
        age_bucket_sums(LOGP, ROLLOUT, MASK, -AGES - 1, num_buckets=3)


GROUPS = torch.tensor([7, 7, 9, 9])
CAP_LOGP = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
# Group 7 has lt = 1 on its three real tokens, group 9 lt = 0.1 on all four.
CAP_ROLLOUT = torch.tensor([[-2.0, -2.0], [-2.0, -9.0], [-1.1, -1.1], [-1.1, -1.1]])
CAP_MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])


def test_drop_zeroes_the_rows_of_a_group_whose_mean_k3_is_beyond_the_cap_and_counts_it():
    scale, capped = group_cap(CAP_LOGP, CAP_ROLLOUT, CAP_MASK, GROUPS, cap=0.5, action="drop")
    assert scale.tolist() == [0.0, 0.0, 1.0, 1.0]  # k3(1) = 0.718 > 0.5; k3(0.1) = 0.005
    assert capped == 1


def test_downweight_scales_a_capped_group_by_cap_over_its_mean_k3():
    scale, capped = group_cap(CAP_LOGP, CAP_ROLLOUT, CAP_MASK, GROUPS, cap=0.5, action="downweight")
    assert scale.tolist() == pytest.approx([0.5 / k3(1.0)] * 2 + [1.0, 1.0])
    assert capped == 1


def test_cap_zero_caps_nothing():
    scale, capped = group_cap(CAP_LOGP, CAP_ROLLOUT, CAP_MASK, GROUPS, cap=0.0, action="drop")
    assert scale.tolist() == [1.0] * 4 and capped == 0


def test_an_unknown_cap_action_is_refused():
    with pytest.raises(ValueError, match="action"):
        group_cap(CAP_LOGP, CAP_ROLLOUT, CAP_MASK, GROUPS, cap=0.5, action="clip")
