"""Hand-computed cases for asyncgrpo.algo.group_advantages."""

import math

import numpy as np
import pytest
import torch

from asyncgrpo.algo import group_advantages

SQRT_HALF = 1 / math.sqrt(2)


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_group_of_two_is_plus_minus_one_over_sqrt_two():
    # mean 0.5, unbiased std sqrt(0.5); (1 - 0.5) / (sqrt(0.5) + 1e-6)
    advantages = group_advantages(f64([1.0, 0.0]), [0, 0], mode="grpo")
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert advantages.tolist() == pytest.approx([expected, -expected], rel=1e-12)
    assert advantages.tolist() == pytest.approx([SQRT_HALF, -SQRT_HALF], rel=1e-5)


def test_grpo_uses_unbiased_std():
    # rewards 1, 2, 3: mean 2, unbiased std 1 (the biased one would be sqrt(2/3)).
    advantages = group_advantages(f64([1.0, 2.0, 3.0]), ["p", "p", "p"], mode="grpo", eps=0.0)
    assert advantages.tolist() == [-1.0, 0.0, 1.0]


def test_grpo_eps_is_added_to_std():
    advantages = group_advantages(f64([1.0, 2.0, 3.0]), [0, 0, 0], mode="grpo", eps=1.0)
    assert advantages.tolist() == pytest.approx([-0.5, 0.0, 0.5], abs=1e-15)


def test_drgrpo_subtracts_the_mean_only():
    advantages = group_advantages(f64([1.0, 2.0, 6.0, 0.0, 1.0]), [0, 0, 0, 1, 1], mode="drgrpo")
    assert advantages.tolist() == pytest.approx([-2.0, -1.0, 3.0, -0.5, 0.5], abs=1e-15)


def test_rloo_is_reward_minus_mean_of_the_others():
    # 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5
    advantages = group_advantages(f64([1.0, 2.0, 6.0]), [0, 0, 0], mode="rloo")
    assert advantages.tolist() == pytest.approx([-3.0, -1.5, 4.5], abs=1e-14)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_singleton_group_gets_zero(mode):
    advantages = group_advantages(f64([5.0, 1.0, 0.0]), ["solo", "pair", "pair"], mode=mode)
    assert advantages[0].item() == 0.0
    assert advantages[1].item() > 0 > advantages[2].item()


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_all_equal_group_gets_exactly_zero(mode):
    # 0.1 * 3 / 3 != 0.1 in floating point: the zero must not come from rounding noise / tiny std.
    advantages = group_advantages(f64([0.1, 0.1, 0.1, 1.0, 1.0]), [0, 0, 0, 1, 1], mode=mode)
    assert advantages.tolist() == [0.0] * 5


def test_interleaved_groups():
    advantages = group_advantages(f64([1.0, 4.0, 0.0, 2.0]), [7, 3, 7, 3], mode="grpo")
    assert advantages.tolist() == pytest.approx([SQRT_HALF, SQRT_HALF, -SQRT_HALF, -SQRT_HALF], rel=1e-5)


@pytest.mark.parametrize(
    "group_ids",
    [
        torch.tensor([10, 20, 10, 20, 20]),
        torch.tensor([10, 20, 10, 20, 20], dtype=torch.int32),
        np.array([10, 20, 10, 20, 20]),
        np.array(["a", "b", "a", "b", "b"], dtype=object),
        ["a", "b", "a", "b", "b"],
        (("x", 1), ("y", 2), ("x", 1), ("y", 2), ("y", 2)),
    ],
)
def test_group_id_kinds(group_ids):
    advantages = group_advantages(f64([1.0, 1.0, 3.0, 2.0, 3.0]), group_ids, mode="drgrpo")
    assert advantages.tolist() == pytest.approx([-1.0, -1.0, 1.0, 0.0, 1.0], abs=1e-15)


def test_integer_rewards_become_float():
    advantages = group_advantages(torch.tensor([1, 0]), [0, 0], mode="drgrpo")
    assert advantages.dtype == torch.get_default_dtype()
    assert advantages.tolist() == [0.5, -0.5]


def test_result_is_detached():
    rewards = f64([1.0, 0.0]).requires_grad_()
    assert not group_advantages(rewards, [0, 0], mode="grpo").requires_grad


def test_empty_batch():
    assert group_advantages(torch.zeros(0), [], mode="grpo").shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "ppo"}, "mode"),
        ({"mode": None}, "mode"),
        ({"eps": -1e-6}, "eps"),
        ({"eps": True}, "eps"),
        ({"eps": float("nan")}, "eps"),
    ],
)
def test_invalid_options(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        group_advantages(f64([1.0, 0.0]), [0, 0], **({"mode": "grpo"} | kwargs))


@pytest.mark.parametrize(
    ("rewards", "group_ids", "argument"),
    [
        (f64([1.0, float("nan")]), [0, 0], "rewards"),
        (f64([1.0, float("inf")]), [0, 0], "rewards"),
        (f64([[1.0, 0.0]]), [0, 0], "rewards"),
        ([1.0, 0.0], [0, 0], "rewards"),
        (f64([1.0, 0.0]), [0, 0, 0], "group_ids"),
        (f64([1.0, 0.0]), torch.tensor([0, 0, 1]), "group_ids"),
        (f64([1.0, 0.0]), torch.tensor([0.0, 1.0]), "group_ids"),
        (f64([1.0, 0.0]), [[0], [1]], "group_ids"),
        (f64([1.0, 0.0]), "ab", "group_ids"),
    ],
)
def test_invalid_inputs(rewards, group_ids, argument):
    with pytest.raises(ValueError, match=argument):
        group_advantages(rewards, group_ids, mode="grpo")
