"""Hand-computed cases for asyncgrpo.algo.rollout_correction."""

import math

import pytest
import torch

from asyncgrpo.algo import rollout_correction

# rollout_correction takes its algo.correction.* keys without defaults. Unless a test sets them:
# no IS weights, threshold 2 (truncation), no batch normalisation, no rejection.
NO_CORRECTION = {"is_level": None, "is_threshold": 2.0, "is_batch_normalize": False, "rs": None, "rs_threshold": None}


def correct(logp_train, logp_rollout, mask, **options):
    """rollout_correction with NO_CORRECTION, `options` overriding it."""
    return rollout_correction(logp_train, logp_rollout, mask, **(NO_CORRECTION | options))


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def from_ratios(ratios, mask):
    """logp_train / logp_rollout whose per-token ratio pi_train / pi_rollout is ``ratios``."""
    logp_rollout = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    logp_train = logp_rollout + torch.log(f64(ratios))
    return logp_train, logp_rollout, f64(mask)


# ---------------------------------------------------------------------------------------------
# importance weights
# ---------------------------------------------------------------------------------------------


def test_token_truncation():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 0.25, 1.5, 9.0]], [[1, 1, 1, 0]])
    weights, new_mask, metrics = correct(logp_train, logp_rollout, mask, is_level="token")
    assert weights[0].tolist() == pytest.approx([2.0, 0.25, 1.5, 0.0], rel=1e-12)
    assert new_mask is mask
    # applied weights [2, 0.25, 1.5]: mean 1.25, E[w^2] = 6.3125 / 3
    second_moment = 6.3125 / 3
    assert metrics["is/mean"] == pytest.approx(1.25, rel=1e-12)
    assert metrics["is/std"] == pytest.approx(math.sqrt(second_moment - 1.25**2), rel=1e-9)
    assert metrics["is/ess"] == pytest.approx(1.25**2 / second_moment, rel=1e-7)
    assert metrics["is/max"] == pytest.approx(3.0, rel=1e-12)  # raw, before truncation
    assert metrics["is/min"] == pytest.approx(0.25, rel=1e-12)
    assert metrics["is/frac_above"] == pytest.approx(1 / 3)
    assert metrics["is/frac_below"] == pytest.approx(1 / 3)  # 0.25 < 1 / U = 0.5


def test_sequence_weight_is_the_product_of_token_ratios():
    logp_train, logp_rollout, mask = from_ratios([[2.0, 1.5, 1.0], [0.5, 0.5, 7.0]], [[1, 1, 1], [1, 1, 0]])
    weights, _, metrics = correct(logp_train, logp_rollout, mask, is_level="sequence", is_threshold=2.0)
    # row 0: 2 * 1.5 = 3 -> truncated to 2; row 1: 0.25 (the padded ratio 7 is ignored)
    torch.testing.assert_close(weights, f64([[2.0, 2.0, 2.0], [0.25, 0.25, 0.0]]))
    assert metrics["is/max"] == pytest.approx(3.0, rel=1e-12)
    assert metrics["is/min"] == pytest.approx(0.25, rel=1e-12)
    assert metrics["is/mean"] == pytest.approx((3 * 2.0 + 2 * 0.25) / 5, rel=1e-12)
    # per sequence: one above U = 2, one below 1/U
    assert metrics["is/frac_above"] == pytest.approx(0.5)
    assert metrics["is/frac_below"] == pytest.approx(0.5)


def test_sequence_log_ratio_beyond_twenty_is_clamped():
    logp_train = f64([[15.0, 15.0], [-15.0, -15.0]])
    weights, _, metrics = correct(
        logp_train, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2), is_level="sequence", is_threshold=1e12
    )
    torch.testing.assert_close(weights, f64([[math.exp(20)] * 2, [math.exp(-20)] * 2]))
    assert math.isfinite(metrics["mismatch/chi2_seq"])
    assert metrics["mismatch/chi2_seq"] == pytest.approx((math.exp(40) + math.exp(-40)) / 2 - 1, rel=1e-12)


def test_token_log_ratio_beyond_twenty_is_clamped():
    logp_train = f64([[1000.0, -1000.0]])
    weights, _, metrics = correct(
        logp_train, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2), is_level="token", is_threshold=1e12
    )
    torch.testing.assert_close(weights, f64([[math.exp(20), math.exp(-20)]]))
    assert metrics["mismatch/kl"] == 0.0
    assert metrics["mismatch/k3_kl"] == pytest.approx(((math.exp(20) - 21) + (math.exp(-20) + 19)) / 2, rel=1e-12)


def test_icepop_token_window_zeroes_weights_outside_and_keeps_the_mask():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 0.25, 1.5, 0.8]], [[1, 1, 1, 1]])
    weights, new_mask, metrics = correct(
        logp_train, logp_rollout, mask, is_level="token", is_threshold="0.5_2.0"
    )
    assert weights[0].tolist() == pytest.approx([0.0, 0.0, 1.5, 0.8], rel=1e-12)
    assert new_mask is mask
    assert metrics["is/frac_above"] == pytest.approx(0.25)
    assert metrics["is/frac_below"] == pytest.approx(0.25)
    assert metrics["is/mean"] == pytest.approx(2.3 / 4, rel=1e-12)
    assert metrics["is/max"] == pytest.approx(3.0, rel=1e-12)


def test_icepop_sequence_window():
    logp_train, logp_rollout, mask = from_ratios([[2.0, 1.5], [1.5, 1.0]], [[1, 1], [1, 1]])
    weights, _, _ = correct(logp_train, logp_rollout, mask, is_level="sequence", is_threshold=" 0.5_2 ")
    torch.testing.assert_close(weights, f64([[0.0, 0.0], [1.5, 1.5]]))


def test_threshold_as_numeric_string_truncates():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 0.25]], [[1, 1]])
    weights, _, _ = correct(logp_train, logp_rollout, mask, is_level="token", is_threshold="1.5")
    assert weights[0].tolist() == pytest.approx([1.5, 0.25], rel=1e-12)


def test_token_batch_normalization():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 0.25, 1.5, 9.0]], [[1, 1, 1, 0]])
    weights, _, metrics = correct(logp_train, logp_rollout, mask, is_level="token", is_batch_normalize=True)
    assert weights[0].tolist() == pytest.approx([1.6, 0.2, 1.2, 0.0], rel=1e-12)
    assert metrics["is/batch_norm_factor"] == pytest.approx(1.25, rel=1e-12)
    assert metrics["is/mean"] == pytest.approx(1.25, rel=1e-12)  # reported before normalisation


def test_sequence_batch_normalization_averages_over_sequences_not_tokens():
    # row 0: two tokens, weight min(3, 2) = 2; row 1: one token, weight 0.25.
    logp_train, logp_rollout, mask = from_ratios([[2.0, 1.5], [0.25, 1.0]], [[1, 1], [1, 0]])
    weights, _, metrics = correct(
        logp_train, logp_rollout, mask, is_level="sequence", is_batch_normalize=True
    )
    assert metrics["is/batch_norm_factor"] == pytest.approx(1.125, rel=1e-12)  # (2 + 0.25) / 2
    torch.testing.assert_close(weights, f64([[2 / 1.125, 2 / 1.125], [0.25 / 1.125, 0.0]]))


def test_batch_normalization_skips_a_zero_mean():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 4.0]], [[1, 1]])
    weights, _, metrics = correct(
        logp_train, logp_rollout, mask, is_level="token", is_threshold="0.5_2", is_batch_normalize=True
    )
    assert weights.tolist() == [[0.0, 0.0]]
    assert metrics["is/batch_norm_factor"] == 1.0
    assert metrics["is/ess"] == 0.0


def test_weights_are_detached_and_zero_on_padding():
    logp_train, logp_rollout, mask = from_ratios([[1.2, 0.9], [1.1, 5.0]], [[1, 1], [1, 0]])
    logp_train.requires_grad_()
    for level in ("token", "sequence"):
        weights, _, _ = correct(logp_train, logp_rollout, mask, is_level=level)
        assert not weights.requires_grad
        assert weights[1, 1].item() == 0.0


def test_no_is_level_gives_no_weights_and_no_is_stats():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 0.25]], [[1, 1]])
    weights, new_mask, metrics = correct(logp_train, logp_rollout, mask)
    assert weights is None and new_mask is mask
    assert not any(key.startswith("is/") for key in metrics)


# ---------------------------------------------------------------------------------------------
# rejection sampling; lt = log(ratio)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rs", "rs_threshold", "ratios", "expected_keep"),
    [
        # k1 = -lt within [log L, log U] <=> ratio within [1/U, 1/L]; a single U means [1/U, U].
        ("token_k1", 2.0, [[3.0, 0.25, 1.5, 0.6]], [[0, 0, 1, 1]]),
        ("token_k1", "0.8_1.25", [[1.3, 0.75, 1.2, 0.9]], [[0, 0, 1, 1]]),
        ("token_k1", "0.5_4", [[0.2, 0.3, 1.9, 2.1]], [[0, 1, 1, 0]]),  # ratio kept within [0.25, 2]
        # k2 = lt^2 / 2 <= 0.5 <=> |lt| <= 1
        ("token_k2", 0.5, [[math.exp(1.5), math.exp(0.5), math.exp(-0.9), math.exp(-1.1)]], [[0, 1, 1, 0]]),
        # k3 = exp(lt) - 1 - lt <= 0.2: lt = 0.5 -> 0.149, lt = -0.9 -> 0.307, lt = 0.1 -> 0.005
        ("token_k3", 0.2, [[math.exp(0.5), math.exp(-0.9), math.exp(0.1), math.exp(0.7)]], [[1, 0, 1, 0]]),
        # sequence options remove whole rows
        ("seq_sum_k1", 2.0, [[1.5, 1.5], [1.5, 0.9]], [[0, 0], [1, 1]]),  # products 2.25 and 1.35
        # sums of k2: 0.18 + 0.18 = 0.36 in, 0.18 + 0.405 = 0.585 out
        ("seq_sum_k2", 0.5, [[math.exp(0.6), math.exp(0.6)], [math.exp(0.6), math.exp(0.9)]], [[1, 1], [0, 0]]),
        # sums of k3: 2 * 0.0214 = 0.043 in, 0.0918 + 0.0499 = 0.142 out
        ("seq_sum_k3", 0.1, [[math.exp(0.2), math.exp(0.2)], [math.exp(0.4), math.exp(0.3)]], [[1, 1], [0, 0]]),
        # geometric mean of the ratios within [0.8, 1.25]: sqrt(1.5 * 1.2) = 1.34 out, sqrt(1.5 * 0.9) = 1.16 in
        ("seq_mean_k1", "0.8_1.25", [[1.5, 1.2], [1.5, 0.9]], [[0, 0], [1, 1]]),
        # means of k2: (0.5 + 0) / 2 = 0.25 in, (0.405 + 0.32) / 2 = 0.3625 out
        ("seq_mean_k2", 0.3, [[math.exp(1.0), math.exp(0.0)], [math.exp(0.9), math.exp(0.8)]], [[1, 1], [0, 0]]),
        # means of k3: 0.1487 / 2 = 0.074 in, (0.0918 + 0.1487) / 2 = 0.120 out
        ("seq_mean_k3", 0.1, [[math.exp(0.5), math.exp(0.0)], [math.exp(0.4), math.exp(0.5)]], [[1, 1], [0, 0]]),
        # max of k2: 0.405 in, 0.605 out
        ("seq_max_k2", 0.5, [[math.exp(0.9), math.exp(-0.9)], [math.exp(0.1), math.exp(-1.1)]], [[1, 1], [0, 0]]),
        # max of k3: 0.4255 in, 0.7183 out
        ("seq_max_k3", 0.5, [[math.exp(0.8), math.exp(0.1)], [math.exp(0.1), math.exp(1.0)]], [[1, 1], [0, 0]]),
    ],
)
def test_single_rejection_option(rs, rs_threshold, ratios, expected_keep):
    # Every statistic above is at least 0.02 away from its threshold.
    mask = [[1] * len(ratios[0])] * len(ratios)
    logp_train, logp_rollout, mask = from_ratios(ratios, mask)
    weights, new_mask, metrics = correct(logp_train, logp_rollout, mask, rs=rs, rs_threshold=rs_threshold)
    assert weights is None
    assert new_mask.tolist() == expected_keep
    removed = 1 - f64(expected_keep)
    assert metrics["is/rs_masked_token_frac"] == pytest.approx(removed.mean().item())
    assert metrics[f"is/rs_{rs}_masked_token_frac"] == pytest.approx(removed.mean().item())


def test_multiple_options_combine_with_and():
    ratios = [
        [1.1, 0.95, 1.05],  # passes both
        [3.0, 1.0, 1.0],  # token_k2 rejects the first token (|lt| = 1.10 > 1); geometric mean 1.44 -> row out
        [1.2, 1.2, 1.2],  # geometric mean 1.2 > 1.15 -> row out
        [0.9, math.exp(-1.2), 1.0],  # token 1 out (|lt| = 1.2); geometric mean 0.69 -> row out
        [1.0, 1.0, 9.0],  # padding hides the 9: passes
    ]
    mask = [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]]
    logp_train, logp_rollout, mask = from_ratios(ratios, mask)
    _, new_mask, metrics = correct(
        logp_train, logp_rollout, mask.bool(), rs="token_k2, seq_mean_k1", rs_threshold="0.5,1.15"
    )
    assert new_mask.dtype == torch.bool
    assert new_mask.int().tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert metrics["is/rs_token_k2_masked_token_frac"] == pytest.approx(2 / 14)
    assert metrics["is/rs_token_k2_masked_seq_frac"] == pytest.approx(2 / 5)
    assert metrics["is/rs_seq_mean_k1_masked_token_frac"] == pytest.approx(9 / 14)
    assert metrics["is/rs_seq_mean_k1_masked_seq_frac"] == pytest.approx(3 / 5)
    assert metrics["is/rs_masked_token_frac"] == pytest.approx(9 / 14)
    assert metrics["is/rs_masked_seq_frac"] == pytest.approx(3 / 5)


def test_one_threshold_shared_by_all_options():
    ratios = [[1.2, 1.0], [1.0, 3.0]]
    logp_train, logp_rollout, mask = from_ratios(ratios, [[1, 1], [1, 1]])
    _, new_mask, _ = correct(logp_train, logp_rollout, mask, rs="token_k1,seq_max_k3", rs_threshold=2.0)
    # ratio 3 fails token_k1 ([0.5, 2]); k3 of it is 3 - 1 - log 3 = 0.90 < 2, so only that token goes.
    assert new_mask.tolist() == [[1, 1], [1, 0]]


def test_rejection_ignores_fully_masked_rows_in_fractions():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 1.0], [1.0, 1.0], [50.0, 50.0]], [[1, 1], [1, 1], [0, 0]])
    weights, new_mask, metrics = correct(
        logp_train, logp_rollout, mask, is_level="sequence", rs="seq_sum_k1", rs_threshold=2.0
    )
    assert new_mask.tolist() == [[0, 0], [1, 1], [0, 0]]
    assert metrics["is/rs_masked_token_frac"] == pytest.approx(0.5)
    assert metrics["is/rs_masked_seq_frac"] == pytest.approx(0.5)
    assert weights[2].tolist() == [0.0, 0.0]
    assert metrics["is/frac_above"] == pytest.approx(0.5)  # over the two non-empty rows


def test_rejection_does_not_change_the_weights():
    logp_train, logp_rollout, mask = from_ratios([[3.0, 1.5]], [[1, 1]])
    weights, new_mask, _ = correct(
        logp_train, logp_rollout, mask, is_level="token", is_threshold=5.0, rs="token_k1", rs_threshold=2.0
    )
    assert new_mask.tolist() == [[0, 1]]
    assert weights[0].tolist() == pytest.approx([3.0, 1.5], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# mismatch diagnostics
# ---------------------------------------------------------------------------------------------


def test_mismatch_metrics_hand_computed():
    # row 0: lam = [0.5, -0.5]; row 1: lam = [0.5] then padding; row 2: fully masked garbage.
    logp_train = f64([[-1.0, -2.0], [-0.5, -9.0], [-50.0, 3.0]])
    logp_rollout = f64([[-1.5, -1.5], [-1.0, 0.0], [0.0, -50.0]])
    mask = f64([[1, 1], [1, 0], [0, 0]])
    weights, new_mask, metrics = correct(logp_train, logp_rollout, mask)
    assert weights is None and new_mask is mask
    e = math.e
    expected = {
        "mismatch/kl": (-0.5 + 0.5 - 0.5) / 3,
        "mismatch/k3_kl": (2 * (math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)) / 3,
        "mismatch/ppl_train": (math.exp(1.5) + math.exp(0.5)) / 2,
        "mismatch/ppl_rollout": (math.exp(1.5) + e) / 2,
        "mismatch/ppl_ratio": (1.0 + math.exp(-0.5)) / 2,
        "mismatch/chi2_token": (e + 1 / e + e) / 3 - 1,
        "mismatch/chi2_seq": (1.0 + e) / 2 - 1,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12), key
    assert all(type(value) is float for value in metrics.values())


def test_k3_on_tokens_sampled_from_mu_estimates_kl_mu_pi_never_negative_and_with_less_spread_than_k1():
    # A small numerical mismatch (bfloat16-like): pi is mu with its logits perturbed by 1e-2.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=generator, dtype=torch.float64)
    log_mu = torch.log_softmax(logits, 0)
    log_pi = torch.log_softmax(logits + 1e-2 * torch.randn(50, generator=generator, dtype=torch.float64), 0)
    kl_mu_pi = float((log_mu.exp() * (log_mu - log_pi)).sum())
    k1, k3 = [], []
    for _ in range(200):  # 200 batches of 256 tokens sampled from mu
        tokens = torch.multinomial(log_mu.exp(), 256, replacement=True, generator=generator).view(16, 16)
        _, _, metrics = correct(log_pi[tokens], log_mu[tokens], torch.ones(16, 16))
        k1.append(metrics["mismatch/kl"])
        k3.append(metrics["mismatch/k3_kl"])
    k1, k3 = torch.tensor(k1), torch.tensor(k3)
    assert float(k3.mean()) == pytest.approx(kl_mu_pi, rel=0.05)
    # k1 is unbiased too, but its noise is of the order of the KL itself: within 3 standard errors.
    assert abs(float(k1.mean()) - kl_mu_pi) < 3 * float(k1.std()) / len(k1) ** 0.5
    assert bool((k3 >= 0).all()) and bool((k1 < 0).any())  # k1 of a batch can come out negative
    assert float(k3.std()) < float(k1.std()) / 10


def test_identical_policies():
    logp = f64([[-0.7, -1.3, -2.0]])
    _, _, metrics = correct(logp, logp.clone(), torch.ones(1, 3), is_level="sequence")
    assert metrics["mismatch/kl"] == 0.0
    assert metrics["mismatch/k3_kl"] == 0.0
    assert metrics["mismatch/chi2_token"] == 0.0
    assert metrics["mismatch/chi2_seq"] == 0.0
    assert metrics["mismatch/ppl_ratio"] == 1.0
    assert metrics["is/mean"] == 1.0 and metrics["is/ess"] == pytest.approx(1.0) and metrics["is/std"] == 0.0


def test_no_real_token_gives_zero_metrics():
    logp = f64([[-0.7, -1.3]])
    weights, new_mask, metrics = correct(
        logp, logp - 1, torch.zeros(1, 2), is_level="token", rs="token_k1", rs_threshold=2.0
    )
    assert weights.tolist() == [[0.0, 0.0]]
    assert new_mask.tolist() == [[0.0, 0.0]]
    assert metrics and set(metrics.values()) == {0.0}


# ---------------------------------------------------------------------------------------------
# invalid arguments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"is_level": "batch"}, "is_level"),
        ({"is_level": "token", "is_threshold": 0.0}, "is_threshold"),
        ({"is_level": "token", "is_threshold": -2.0}, "is_threshold"),
        ({"is_level": "token", "is_threshold": True}, "is_threshold"),
        ({"is_level": "token", "is_threshold": None}, "is_threshold"),
        ({"is_level": "token", "is_threshold": "2.0_0.5"}, "is_threshold"),
        ({"is_level": "token", "is_threshold": "0_2"}, "is_threshold"),
        ({"is_level": "token", "is_threshold": "a_b"}, "is_threshold"),
        ({"is_level": "token", "is_threshold": "0.5_1_2"}, "is_threshold"),
        ({"is_level": "token", "is_threshold": "nan"}, "is_threshold"),
        ({"is_level": "token", "is_threshold": ""}, "is_threshold"),
        ({"is_threshold": -1.0}, "is_threshold"),  # checked even while IS is off
        ({"is_batch_normalize": "yes"}, "is_batch_normalize"),
        ({"rs": "token_k4", "rs_threshold": 2.0}, "rs"),
        ({"rs": "seq_max_k1", "rs_threshold": 2.0}, "rs"),
        ({"rs": "token_k1,token_k1", "rs_threshold": 2.0}, "rs"),
        ({"rs": "token_k1,", "rs_threshold": 2.0}, "rs"),
        ({"rs": ["token_k1"], "rs_threshold": 2.0}, "rs"),
        ({"rs": "token_k1"}, "rs_threshold"),
        ({"rs": "token_k1", "rs_threshold": True}, "rs_threshold"),
        ({"rs": "token_k1", "rs_threshold": 0.0}, "rs_threshold"),
        ({"rs": "token_k1", "rs_threshold": 0.5}, "rs_threshold"),  # [1/U, U] = [2, 0.5]
        ({"rs": "token_k1", "rs_threshold": "2_0.5"}, "rs_threshold"),
        ({"rs": "token_k2", "rs_threshold": "0.5_2"}, "rs_threshold"),
        ({"rs": "token_k1,token_k2,seq_max_k3", "rs_threshold": "2,3"}, "rs_threshold"),
        ({"rs": "token_k2", "rs_threshold": "x"}, "rs_threshold"),
        ({"logp_rollout": torch.zeros(1, 3, dtype=torch.float64)}, "logp_rollout"),
        ({"logp_rollout": torch.full((1, 2), math.nan, dtype=torch.float64)}, "logp_rollout"),
        ({"logp_train": torch.full((1, 2), math.nan, dtype=torch.float64)}, "logp_train"),
        ({"mask": torch.ones(2, 2)}, "mask"),
        ({"mask": torch.full((1, 2), 3.0)}, "mask"),
    ],
)
def test_invalid_arguments(kwargs, argument):
    logp_train, logp_rollout, mask = from_ratios([[1.0, 1.0]], [[1, 1]])
    arguments = {"logp_train": logp_train, "logp_rollout": logp_rollout, "mask": mask} | kwargs
    with pytest.raises(ValueError, match=argument):
        rollout_correction(**(NO_CORRECTION | arguments))


@pytest.mark.parametrize("key", sorted(NO_CORRECTION))
def test_config_keys_have_no_default(key):
    """A missing algo.correction.* key is an error, not a silent default that may differ from config's."""
    logp_train, logp_rollout, mask = from_ratios([[1.0, 1.0]], [[1, 1]])
    arguments = dict(NO_CORRECTION)
    del arguments[key]
    with pytest.raises(TypeError, match=key):
        rollout_correction(logp_train, logp_rollout, mask, **arguments)
