"""Per-token KL estimators between the trained policy and a reference policy.

API
---
``kl_penalty(logp, ref_logp, *, kind) -> Tensor[B, T]``

With x = logp - ref_logp (Schulman, "Approximating KL divergence"):

* ``k1`` (alias ``kl``): x
* ``abs``: |x|
* ``k2`` (alias ``mse``): x^2 / 2
* ``k3`` (alias ``low_var_kl``): with d = clamp(-x, -20, 20), clamp(exp(d) - d - 1, 0, 10); always >= 0

A ``+`` suffix on any of them (``k1+``, ``abs+``, ``k3+``, ``low_var_kl+``, ...) keeps the forward
value of the base estimator but back-propagates the gradient of k2 (straight-through), because k2's
gradient is the unbiased estimate of the KL gradient while k1/k3 are unbiased only in value.
The result is unmasked; aggregate it with ``asyncgrpo.algo.aggregate``.
"""

from __future__ import annotations

import torch

from asyncgrpo.algo._checks import check_choice, check_float_tensor, check_same_shape

_BASE_OF_ALIAS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS = tuple(_BASE_OF_ALIAS) + tuple(f"{kind}+" for kind in _BASE_OF_ALIAS)

_LOG_RATIO_BOUND = 20.0
_K3_CEILING = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, *, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference.

    Args:
        logp: [B, T] log-probabilities of the sampled tokens under the trained policy.
        ref_logp: [B, T] log-probabilities of the same tokens under the reference policy.
        kind: one of ``KL_KINDS`` (algo.kl.kind; see the module docstring).

    Returns:
        [B, T] estimate, differentiable with respect to both inputs.

    Raises:
        ValueError: unknown kind, shape mismatch, NaN in an input.
    """
    check_choice("kind", kind, KL_KINDS)
    logp = check_float_tensor("logp", logp)
    ref_logp = check_float_tensor("ref_logp", ref_logp)
    check_same_shape("ref_logp", ref_logp, "logp", logp)

    straight_through = kind.endswith("+")
    base = _BASE_OF_ALIAS[kind.rstrip("+")]
    log_ratio = logp - ref_logp
    value = _estimate(log_ratio, base)
    if not straight_through or base == "k2":
        return value
    k2 = _estimate(log_ratio, "k2")
    return k2 - k2.detach() + value.detach()


def _estimate(log_ratio: torch.Tensor, base: str) -> torch.Tensor:
    if base == "k1":
        return log_ratio
    if base == "abs":
        return log_ratio.abs()
    if base == "k2":
        return 0.5 * log_ratio.square()
    reverse_log_ratio = (-log_ratio).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    # exp(d) - d - 1 rounds below zero for tiny d in float32 (exp(6e-8) == 1); expm1 does not lose d,
    # and the floor of 0 (verl: -10, which cannot bind mathematically) absorbs the last rounding error.
    k3 = torch.expm1(reverse_log_ratio) - reverse_log_ratio
    return k3.clamp(0, _K3_CEILING)
