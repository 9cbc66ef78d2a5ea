"""Hand-computed cases for asyncgrpo.algo.kl_penalty (x = logp - ref_logp)."""

import math

import pytest
import torch

from asyncgrpo.algo import kl_penalty

X = [0.5, -0.5, 2.0, -30.0, 25.0]
REF_LOGP = torch.tensor([[-1.0, -2.0, -3.0, -0.5, -40.0]], dtype=torch.float64)

K3 = [
    math.exp(-0.5) + 0.5 - 1,  # 0.10653
    math.exp(0.5) - 0.5 - 1,  # 0.14872
    math.exp(-2.0) + 2.0 - 1,  # 1.13534
    10.0,  # -x = 30 -> clamp 20 -> exp(20) - 21 -> clamp 10
    10.0,  # -x = -25 -> clamp -20 -> exp(-20) + 19 -> clamp 10
]
EXPECTED = {
    "k1": X,
    "abs": [0.5, 0.5, 2.0, 30.0, 25.0],
    "k2": [0.125, 0.125, 2.0, 450.0, 312.5],
    "k3": K3,
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def inputs():
    logp = (REF_LOGP + torch.tensor([X], dtype=torch.float64)).requires_grad_()
    return logp, REF_LOGP.clone().requires_grad_()


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl"])
def test_values(kind):
    logp, ref_logp = inputs()
    values = kl_penalty(logp, ref_logp, kind=kind)
    assert values.shape == (1, 5)
    assert values[0].tolist() == pytest.approx(EXPECTED[ALIASES.get(kind, kind)], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", ["k1+", "abs+", "k2+", "k3+", "kl+", "mse+", "low_var_kl+"])
def test_plus_keeps_the_value_and_takes_the_gradient_of_k2(kind):
    logp, ref_logp = inputs()
    values = kl_penalty(logp, ref_logp, kind=kind)
    assert values[0].tolist() == pytest.approx(EXPECTED[ALIASES.get(kind[:-1], kind[:-1])], rel=1e-12, abs=1e-12)
    values.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx(X, rel=1e-12)
    assert ref_logp.grad[0].tolist() == pytest.approx([-x for x in X], rel=1e-12)


def test_k3_gradient_without_plus():
    logp, ref_logp = inputs()
    kl_penalty(logp, ref_logp, kind="k3").sum().backward()
    # d/dx (exp(-x) + x - 1) = 1 - exp(-x) inside the clamps; 0 where the value is clamped at 10.
    expected = [1 - math.exp(-0.5), 1 - math.exp(0.5), 1 - math.exp(-2.0), 0.0, 0.0]
    assert logp.grad[0].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_k3_is_zero_when_policies_agree():
    logp = torch.tensor([[-0.3, -7.0]])
    assert kl_penalty(logp, logp.clone(), kind="k3").tolist() == [[0.0, 0.0]]


def test_kind_has_no_default():
    # algo.kl.kind is config's; a call without it fails instead of picking a kind of its own.
    logp, ref_logp = inputs()
    with pytest.raises(TypeError, match="kind"):
        kl_penalty(logp, ref_logp)


@pytest.mark.parametrize(
    ("arguments", "argument"),
    [
        ({"kind": "k4"}, "kind"),
        ({"kind": "k3++"}, "kind"),
        ({"kind": "full"}, "kind"),
        ({"kind": None}, "kind"),
        ({"ref_logp": torch.zeros(1, 4, dtype=torch.float64)}, "ref_logp"),
        ({"ref_logp": torch.full((1, 5), math.nan, dtype=torch.float64)}, "ref_logp"),
        ({"logp": torch.full((1, 5), math.nan, dtype=torch.float64)}, "logp"),
        ({"logp": torch.zeros(1, 5, dtype=torch.long)}, "logp"),
    ],
)
def test_invalid_arguments(arguments, argument):
    logp, ref_logp = inputs()
    with pytest.raises(ValueError, match=argument):
        kl_penalty(**({"logp": logp, "ref_logp": ref_logp, "kind": "k3"} | arguments))


def test_k3_does_not_round_below_zero_in_float32():
    # exp(6e-8) == 1 in float32, so the naive exp(d) - d - 1 gives -6e-8 here.
    values = kl_penalty(torch.tensor([-5.960464477539063e-08, 1e-7]), torch.tensor([0.0, 0.0]), kind="k3")
    assert bool((values >= 0).all())
