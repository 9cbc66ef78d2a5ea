"""Which policy anchors the PPO ratio, and how the rollout policy is corrected for (``algo.mode``).

Three policies meet in an off-policy step: mu, the rollout (behaviour) policy that sampled the
tokens (``rollout_logp``, reported by the generator); pi_prox, the learner's weights at the start of
the step, before any optimizer step of this step (``prox_logp``, one forward pass without gradient);
pi_theta, the policy being trained (``logp``, with gradient).

API
---
``MODES = ("bypass", "decoupled", "naive")`` (asyncgrpo/algo/settings.py, beside ``LossSettings``)

``bypass_policy_loss`` (asyncgrpo/algo/losses.py)
    ``bypass``: no recompute pass; mu is the anchor, ``old_logp := rollout_logp``.

``decoupled_policy_loss(logp, prox_logp, rollout_logp, advantages, mask, settings, *, ...) -> (loss, metrics)``
    ``decoupled`` (verl's decoupled mode, AReaL's decoupled PPO): pi_prox is the anchor,
    ``old_logp := prox_logp``, and ``rollout_correction(prox_logp, rollout_logp, mask, ...)`` gives IS
    weights pi_prox / mu (token or sequence level, truncated or masked per ``settings.correction``)
    that multiply the per-token loss of every loss type, and a rejection mask that applies to it.

``naive_policy_loss(logp, prox_logp, rollout_logp, advantages, mask, settings, *, ...) -> (loss, metrics)``
    ``naive``: pi_prox is the anchor and there is no rollout correction at all (stale samples are
    treated as on-policy); ``rollout_logp`` feeds the ``mismatch/`` diagnostics only, never the loss.

``mode_policy_loss(logp, prox_logp, rollout_logp, advantages, mask, settings, *, ...) -> (loss, metrics)``
    Dispatches on ``settings.mode``: ``prox_logp`` must be ``None`` under ``bypass`` (nothing was
    recomputed) and a tensor under the two other modes.

Shapes: ``logp``, ``prox_logp``, ``rollout_logp``, ``advantages`` and ``mask`` are [B, T]; the loss
is a 0-d tensor. Gradients flow into ``logp`` only (``prox_logp``, ``rollout_logp``, the advantages
and the IS weights are detached). As in bypass mode, the denominators count the tokens / sequences
of the input mask, before rejection, unless ``global_num_tokens`` / ``global_num_seqs`` replace them.
Metrics: the ``policy_loss`` metrics under ``loss/`` (``loss/approx_kl`` is the KL of pi_theta to the
anchor), the ``is/`` metrics (``decoupled`` with ``is_level`` set) and the ``mismatch/`` metrics of
pi_prox against mu (all three modes that recompute; under ``bypass`` they compare pi_theta with mu).

The config keys (``algo.*``, ``algo.correction.*``) arrive as one ``LossSettings``; the per-mode
functions ignore its ``mode``.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncgrpo.algo._checks import (
    check_mask,
    check_same_shape,
    check_token_tensor,
)
from asyncgrpo.algo.correction import rollout_correction
from asyncgrpo.algo.losses import bypass_policy_loss, policy_loss
from asyncgrpo.algo.settings import LossSettings


def _check_inputs(
    logp: torch.Tensor, prox_logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the shared inputs; returns (prox_logp detached, mask as bool)."""
    logp = check_token_tensor("logp", logp)
    prox_logp = check_token_tensor("prox_logp", prox_logp)
    rollout_logp = check_token_tensor("rollout_logp", rollout_logp)
    advantages = check_token_tensor("advantages", advantages)
    check_same_shape("prox_logp", prox_logp, "logp", logp)
    check_same_shape("rollout_logp", rollout_logp, "logp", logp)
    check_same_shape("advantages", advantages, "logp", logp)
    return prox_logp.detach(), check_mask(mask, "logp", logp)


def decoupled_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled mode: the recomputed proximal policy anchors the ratio, pi_prox / mu corrects for mu.

    Args:
        logp: [B, T] log-probabilities under the policy being trained (receives the gradient).
        prox_logp: [B, T] log-probabilities under the proximal policy, the learner's weights before
            this step's optimizer step (detached).
        rollout_logp: [B, T] log-probabilities reported by the rollout engine (detached).
        advantages: [B, T] per-token advantages.
        mask: [B, T] 0/1 float or bool, 1 on real response tokens (before rejection).
        settings: as in ``policy_loss``, and ``settings.correction`` for ``rollout_correction``,
            applied to (prox_logp, rollout_logp).
        global_num_tokens, global_num_seqs: as in ``aggregate``; when omitted, the counts of
            ``mask`` (before rejection) are used.

    Returns:
        ([] loss, metrics) with ``loss/pg``, ``loss/clipfrac``, ``loss/clipfrac_lower``,
        ``loss/approx_kl`` and the ``is/...`` and ``mismatch/...`` metrics.

    Raises:
        ValueError: any invalid argument of ``policy_loss`` or ``rollout_correction``.
    """
    prox_logp, keep = _check_inputs(logp, prox_logp, rollout_logp, advantages, mask)
    weights, kept_mask, correction_metrics = rollout_correction(
        prox_logp, rollout_logp, mask, **dataclasses.asdict(settings.correction)
    )
    # Rejected tokens add 0 but still count, as in bypass mode: the loss does not depend on the split.
    if global_num_tokens is None:
        global_num_tokens = float(keep.sum())
    if global_num_seqs is None:
        global_num_seqs = float((keep.sum(-1) > 0).sum())
    loss, loss_metrics = policy_loss(
        logp,
        prox_logp,
        advantages,
        kept_mask,
        settings,
        # Unlike bypass, the ratio is against pi_prox, not mu: the weights apply to every loss type.
        is_weights=weights,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )
    return loss, {f"loss/{name}": value for name, value in loss_metrics.items()} | correction_metrics


def naive_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Naive mode: the recomputed proximal policy anchors the ratio and mu is ignored by the loss.

    Args:
        logp, prox_logp, advantages, mask: as in ``decoupled_policy_loss``.
        rollout_logp: [B, T] rollout log-probabilities, used for the ``mismatch/`` metrics only
            (how stale the samples were); the loss and its gradient do not depend on it.
        settings: as in ``policy_loss``; ``settings.correction`` is ignored.
        global_num_tokens, global_num_seqs: as in ``aggregate``.

    Returns:
        ([] loss, metrics) with ``loss/pg``, ``loss/clipfrac``, ``loss/clipfrac_lower``,
        ``loss/approx_kl`` and the ``mismatch/...`` metrics of pi_prox against mu.

    Raises:
        ValueError: any invalid argument of ``policy_loss``, or a shape mismatch or NaN in
            ``prox_logp`` / ``rollout_logp``.
    """
    prox_logp, _ = _check_inputs(logp, prox_logp, rollout_logp, advantages, mask)
    # Diagnostics only: no weights, no rejection.
    _, _, mismatch_metrics = rollout_correction(
        prox_logp, rollout_logp, mask, is_level=None, is_threshold=None, is_batch_normalize=False, rs=None,
        rs_threshold=None,
    )
    loss, loss_metrics = policy_loss(
        logp,
        prox_logp,
        advantages,
        mask,
        settings,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )
    return loss, {f"loss/{name}": value for name, value in loss_metrics.items()} | mismatch_metrics


def mode_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``settings.mode``; the other arguments as in ``decoupled_policy_loss``.

    ``prox_logp`` is ``None`` under ``bypass`` and a [B, T] tensor under ``decoupled`` and ``naive``.
    ``naive`` ignores ``settings.correction``.

    Raises:
        ValueError: ``prox_logp`` given under ``bypass`` or missing under the other modes, and every
            error of the mode's own function.
    """
    counts = {"global_num_tokens": global_num_tokens, "global_num_seqs": global_num_seqs}
    if settings.mode == "bypass":
        if prox_logp is not None:
            raise ValueError("prox_logp must be None under mode bypass: the rollout log-probs are the anchor")
        return bypass_policy_loss(logp, rollout_logp, advantages, mask, settings, **counts)
    if prox_logp is None:
        raise ValueError(
            f"prox_logp is required under mode {settings.mode}: the recomputed proximal log-probs are the anchor"
        )
    if settings.mode == "decoupled":
        return decoupled_policy_loss(logp, prox_logp, rollout_logp, advantages, mask, settings, **counts)
    return naive_policy_loss(logp, prox_logp, rollout_logp, advantages, mask, settings, **counts)
