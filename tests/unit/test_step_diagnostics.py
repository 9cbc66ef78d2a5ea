"""The diagnostics GRPO users watch: policy entropy, groups whose rewards are all equal, completions
cut at the length limit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.algo import token_entropy
from asyncgrpo.learner.batch import Batch
from asyncgrpo.learner.metrics import all_equal_fraction, batch_metrics


def test_token_entropy_of_uniform_logits_is_log_vocabulary():
    assert token_entropy(torch.zeros(3, 7)).tolist() == pytest.approx([math.log(7)] * 3)


def test_token_entropy_of_a_certain_token_is_zero_even_with_minus_infinity_logits():
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [50.0, 0.0, 0.0]])
    entropy = token_entropy(logits)
    assert torch.isfinite(entropy).all()
    assert entropy.tolist() == pytest.approx([0.0, 0.0], abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=12))
def test_token_entropy_matches_minus_sum_p_log_p(values):
    logits = torch.tensor(values, dtype=torch.float64)
    p = logits.softmax(-1)
    expected = -(p * p.log()).sum().item()
    assert token_entropy(logits).item() == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert 0.0 <= token_entropy(logits).item() <= math.log(len(values)) + 1e-5


def test_token_entropy_refuses_an_empty_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        token_entropy(torch.zeros(2, 0))


def test_all_equal_fraction_counts_groups_whose_rewards_are_all_the_same():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 0.5])
    group_index = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])  # group 3 has a single sample: all equal
    assert all_equal_fraction(rewards, group_index) == pytest.approx(3 / 4)


def test_all_equal_fraction_is_zero_when_every_group_has_a_spread():
    assert all_equal_fraction(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])) == 0.0


def tiny_batch(lengths: list[int], rewards: list[float], group_index: list[int],
               truncated: list[float] | None = None) -> Batch:
    samples, longest = len(lengths), max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (longest - n) for n in lengths])
    zeros = torch.zeros(samples, longest, dtype=torch.int64)
    return Batch(input_ids=torch.ones(samples, longest + 2, dtype=torch.int64),
                 attention_mask=torch.tensor([[1] * (n + 2) + [0] * (longest - n) for n in lengths]),
                 logit_index=zeros, targets=zeros, mask=mask, completion_lengths=torch.tensor(lengths),
                 rollout_logp=torch.zeros(samples, longest),
                 token_versions=zeros, rewards=torch.tensor(rewards), group_index=torch.tensor(group_index),
                 group_version_min=torch.zeros(max(group_index) + 1, dtype=torch.int64),
                 truncated=torch.tensor(truncated or [0.0] * samples))


def test_clipped_fraction_counts_completions_that_used_every_allowed_token():
    batch = tiny_batch([5, 3, 5, 1], [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    metrics = batch_metrics(batch, torch.tensor([0, 1]), version=1, samples_consumed=4, max_new_tokens=5)
    assert metrics["response/clipped_frac"] == pytest.approx(0.5)
    assert metrics["reward/all_equal_frac"] == pytest.approx(0.5)
    assert batch_metrics(batch, torch.tensor([0, 1]), 1, 4, max_new_tokens=6)["response/clipped_frac"] == 0.0


def test_length_percentiles_and_the_truncated_fraction_describe_the_steps_tail():
    lengths = [1] * 98 + [50, 100]
    batch = tiny_batch(lengths, [0.0, 1.0] * 50, [i // 2 for i in range(100)], truncated=[0.0] * 99 + [1.0])
    metrics = batch_metrics(batch, torch.zeros(50, dtype=torch.int64), version=1, samples_consumed=100,
                            max_new_tokens=100)
    assert (metrics["response/length_p50"], metrics["response/length_p90"]) == (1.0, 1.0)
    # Position 0.99 x 99 = 98.01 of the sorted lengths: between the 50 and the 100, 50.5.
    assert metrics["response/length_p99"] == pytest.approx(50.5)
    assert metrics["response/length_max"] == 100.0
    assert metrics["response/truncated_frac"] == pytest.approx(0.01)


def test_token_ages_count_from_the_version_the_step_trained_at_as_the_group_staleness_does():
    # The first step (version=1 after it) trained at version 0 on tokens of version 0: staleness 0.
    batch = tiny_batch([3, 2], [1.0, 0.0], [0, 0])
    metrics = batch_metrics(batch, torch.tensor([0]), version=1, samples_consumed=2, max_new_tokens=5)
    assert metrics["staleness/max"] == 0 and metrics["staleness/tokens_age_0"] == 1.0
