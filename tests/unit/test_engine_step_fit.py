"""A generator's engine-step cost fit and its sample of group lengths (rollout/stats.py): what the
simulator's continuous engine is calibrated from."""

from __future__ import annotations

import statistics

import pytest

import numpy as np

from asyncgrpo.rollout.stats import FIT_SKIPPED_STEPS, KEPT_GROUP_LENGTHS, EngineStepFit, GroupLengths, turn_lengths


def test_the_fit_recovers_a_steps_fixed_and_per_sequence_cost_after_the_compiling_steps():
    fit = EngineStepFit()
    for step in range(FIT_SKIPPED_STEPS):
        fit.add(8, 5.0)  # compiling: far slower, left out
    for step in range(200):
        running = 1 + step % 64
        fit.add(running, 0.002 + 0.00004 * running)
    fixed, per_sequence = fit.fit()
    assert fit.steps == 200
    assert fixed == pytest.approx(0.002) and per_sequence == pytest.approx(0.00004)


def test_one_batch_size_cannot_separate_the_two_costs():
    fit = EngineStepFit()
    for _ in range(FIT_SKIPPED_STEPS + 50):
        fit.add(128, 0.01)
    assert fit.fit() is None


def test_noise_that_would_make_a_cost_negative_is_clamped_at_zero():
    falling = EngineStepFit()
    for step in range(FIT_SKIPPED_STEPS + 100):
        falling.add(1 + step % 10, 0.01 - 0.0001 * (step % 10))  # slower when emptier: no per-sequence cost
    fixed, per_sequence = falling.fit()
    assert per_sequence == 0.0 and fixed == pytest.approx(statistics.fmean(0.01 - 0.0001 * (s % 10)
                                                                           for s in range(FIT_SKIPPED_STEPS, 120)))
    through_zero = EngineStepFit()
    for step in range(FIT_SKIPPED_STEPS + 100):
        running = 10 + step % 10
        through_zero.add(running, 0.001 * running - 0.002)
    fixed, per_sequence = through_zero.fit()
    assert fixed == 0.0 and per_sequence > 0


def test_the_kept_group_lengths_are_a_bounded_uniform_sample_of_every_group_sent():
    kept = GroupLengths()
    for index in range(10 * KEPT_GROUP_LENGTHS):
        kept.add([index, index])
    assert len(kept.groups) == KEPT_GROUP_LENGTHS and kept.seen == 10 * KEPT_GROUP_LENGTHS
    indices = [group[0] for group in kept.groups]
    # Uniform over all 5,120 groups sent, not the first 512: the mean index is near the middle.
    assert 0.4 < statistics.fmean(indices) / (10 * KEPT_GROUP_LENGTHS) < 0.6
    assert max(indices) > 9 * KEPT_GROUP_LENGTHS
    again = GroupLengths()
    for index in range(10 * KEPT_GROUP_LENGTHS):
        again.add([index, index])
    assert again.groups == kept.groups  # seeded: a run's summary is reproducible


def test_a_samples_turns_are_the_runs_of_policy_tokens_between_observations():
    lengths = np.array([7, 3, 0])
    mask = np.array([1, 1, 0, 0, 1, 1, 1] + [0, 1, 1], dtype=np.uint8)  # 2 + 3 tokens around an observation; 2 after one
    assert turn_lengths(lengths, mask) == [[2, 3], [2], []]
    assert turn_lengths(np.array([4, 5]), None) == [[4], [5]]  # no environment: one turn of every token
