"""Policy-gradient losses and their aggregation over tokens and sequences.

API
---
``aggregate(loss_mat, mask, mode, *, norm_constant, global_num_tokens=None, global_num_seqs=None)``
    [B, T] per-token loss -> scalar, for ``AGG_MODES``:

    * ``token-mean``: sum(l*m) / N_tokens
    * ``seq-mean-token-sum``: sum_i sum_t(l*m) / N_seqs
    * ``seq-mean-token-mean``: sum_i [sum_t(l*m) / sum_t(m)] / N_seqs
    * ``seq-mean-token-sum-norm`` (Dr.GRPO): seq-mean-token-sum / norm_constant (default T)

    N_tokens is the number of real tokens and N_seqs the number of sequences with at least one real
    token, both local to the call unless ``global_num_tokens`` / ``global_num_seqs`` replace them.
    Passing the counts of the whole (global) batch makes the loss additive: summing the results over
    any split of the batch into micro-batches (and ranks) gives the unsplit loss and its gradient
    (for every loss type but ``m2po``, whose mask is a statistic of each call's tokens).

``policy_loss(logp, old_logp, advantages, mask, settings, *, is_weights=None, ...) -> (loss, metrics)``
    ``settings`` is a ``LossSettings`` (asyncgrpo/algo/settings.py); per ``settings.loss_type``:
    ``ppo_clip``: asymmetric clipped surrogate with dual clip, r = exp(clamp(logp - old_logp, ±20)),
    per-token loss max(-A r, -A clamp(r, 1-clip_low, 1+clip_high)), capped at -A*clip_c where A < 0.
    ``reinforce``: per-token loss -A * logp.
    ``gspo``: the sequence ratio s_i = exp(mean over row i's real tokens of (logp - old_logp)), taken
    per token as s_i,t = sg[s_i] * pi_t / sg[pi_t] (value s_i, gradient s_i * grad logp_t), log
    clamped at most 10 as verl does (no lower bound); per-token loss max(-A s_i,t, -A clamp(s_i,t, 1-clip_low, 1+clip_high)), no dual clip.
    ``cispo``: per-token loss -sg[clamp(r, 1-clip_low, 1+clip_high)] * A * logp (clip_low may be 1:
    no lower bound).
    ``m2po``: per-token loss -A * r, unclipped, 0 on the tokens ``m2po_removed`` takes out so the
    mean (log r)^2 of the trust-region tokens left is at most ``m2_threshold`` (they still count in
    the denominators, as the paper averages over all tokens).
    Optional detached ``is_weights`` multiply the per-token loss (after clipping). Metrics:
    ``pg``, ``clipfrac``, ``clipfrac_lower``, ``approx_kl`` (plain floats, means over this call's
    real tokens; ``clipfrac`` is 0 for ``reinforce`` and for ``cispo`` the fraction of clipped IS
    weights, for ``m2po`` the fraction of tokens removed; ``clipfrac_lower``, the dual clip's, is 0
    for all but ``ppo_clip``).

``bypass_policy_loss(logp, rollout_logp, advantages, mask, settings, *, ...) -> (loss, metrics)``
    Bypass mode: the rollout log-probs stand in for the old log-probs (no recompute pass).
    ``rollout_correction`` is run on (logp, rollout_logp) with ``settings.correction``; its
    rejection mask applies to every loss type, its IS weights multiply the ``reinforce`` loss only
    (the ratio of ``ppo_clip``, ``gspo``, ``cispo`` and ``m2po`` is already taken against the rollout
    policy, so applying them would count the correction twice).
    Denominators count the tokens / sequences of the input mask, before rejection: a rejected token
    adds zero to the loss but still counts, as in verl's data-parallel engine. Metrics: the policy
    metrics under ``loss/`` plus the ``is/`` and ``mismatch/`` metrics of ``rollout_correction``.

The config keys (``algo.*``, ``algo.correction.*``) arrive as one ``LossSettings``, validated when
it was built; ``global_num_tokens`` and ``global_num_seqs`` are the batch's, keyword-only.

Gradients flow into ``logp`` only: ``old_logp``, ``rollout_logp``, ``advantages`` and the IS
weights are treated as constants (detached).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from asyncgrpo.algo._checks import (
    check_choice,
    check_mask,
    check_optional_count,
    check_positive,
    check_same_shape,
    check_token_tensor,
)
from asyncgrpo.algo._masked import masked_mean, masked_row_mean, masked_sum, to_floats
from asyncgrpo.algo.correction import rollout_correction
from asyncgrpo.algo.settings import AGG_MODES, LossSettings

# The losses whose ratio is taken against the old policy; `reinforce` ignores old_logp.
_RATIO_LOSS_TYPES = ("ppo_clip", "gspo", "cispo", "m2po")

_LOG_RATIO_BOUND = 20.0
# GSPO's token log-ratio ceiling, verl's (compute_policy_loss_gspo): a sequence whose log-ratio lies
# between 10 and 20 would otherwise get another loss and a gradient where verl's is 0.
_GSPO_LOG_RATIO_CEILING = 10.0


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    norm_constant: float | None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_mat: [B, T] per-token loss.
        mask: [B, T] 0/1 float or bool, 1 on real response tokens.
        mode: one of ``AGG_MODES`` (see the module docstring).
        norm_constant: divisor of ``seq-mean-token-sum-norm`` (> 0, or None for T = loss_mat.shape[1]);
            ignored by the other modes. Pass it explicitly when micro-batches are padded to
            different lengths, or the split loss will not add up.
        global_num_tokens: token count of the whole batch, replacing the local one (``token-mean``).
        global_num_seqs: non-empty sequence count of the whole batch (``seq-mean-*`` modes).
            Each global count is used only by the modes it belongs to; a count of 0 gives a loss of 0.

    Returns:
        [] scalar loss.

    Raises:
        ValueError: unknown mode, norm_constant <= 0, negative or non-numeric count, shape
            mismatch, non-0/1 mask, NaN in loss_mat.
    """
    check_choice("mode", mode, AGG_MODES)
    loss_mat = check_token_tensor("loss_mat", loss_mat)
    keep = check_mask(mask, "loss_mat", loss_mat)
    norm_constant = None if norm_constant is None else check_positive("norm_constant", norm_constant)
    global_num_tokens = check_optional_count("global_num_tokens", global_num_tokens)
    global_num_seqs = check_optional_count("global_num_seqs", global_num_seqs)
    return _aggregate(loss_mat, keep, mode, norm_constant, global_num_tokens, global_num_seqs)


def _aggregate(
    loss_mat: torch.Tensor,
    keep: torch.Tensor,
    mode: str,
    norm_constant: float | None,
    global_num_tokens: float | None,
    global_num_seqs: float | None,
) -> torch.Tensor:
    if mode == "token-mean":
        num_tokens = keep.sum().clamp_min(1) if global_num_tokens is None else max(global_num_tokens, 1.0)
        return masked_sum(loss_mat, keep) / num_tokens

    tokens_per_seq = keep.sum(-1)
    seq_losses = masked_sum(loss_mat, keep, dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = seq_losses / tokens_per_seq.clamp_min(1)
    # An empty sequence adds 0 to the numerator; it must not count in the denominator either.
    num_seqs = (tokens_per_seq > 0).sum().clamp_min(1) if global_num_seqs is None else max(global_num_seqs, 1.0)
    loss = seq_losses.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (norm_constant if norm_constant is not None else max(loss_mat.shape[-1], 1))
    return loss


class _TokenLoss(NamedTuple):
    """One loss type's per-token terms, each [B, T]."""

    loss: torch.Tensor  # the per-token loss, before IS weights
    clipped: torch.Tensor  # bool: where the clip range binds (clipfrac)
    dual_clipped: torch.Tensor  # bool: where the dual clip binds (clipfrac_lower)


@dataclasses.dataclass(frozen=True)
class _Tokens:
    """The validated per-token inputs of one ``policy_loss`` call, each [B, T].

    ``logp`` carries the gradient; ``old_logp`` and ``advantages`` are detached; ``keep`` is the mask
    as bool; ``log_ratio`` is logp - old_logp clamped to ±20.
    """

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    keep: torch.Tensor
    log_ratio: torch.Tensor


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    is_weights: torch.Tensor | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss of the trained policy on sampled tokens.

    Args:
        logp: [B, T] log-probabilities under the policy being trained (receives the gradient).
        old_logp: [B, T] log-probabilities under the behaviour policy (detached).
        advantages: [B, T] per-token advantages, usually ``group_advantages(...)[:, None] * mask``.
        mask: [B, T] 0/1 float or bool, 1 on real response tokens.
        settings: ``loss_type``, the clip ranges, ``agg`` and ``norm_constant`` are read (see
            ``LossSettings``); the mode, correction and KL settings are not.
        is_weights: optional [B, T] weights multiplying the per-token loss (detached).
        global_num_tokens, global_num_seqs: as in ``aggregate``.

    Returns:
        ([] loss, metrics) with metrics ``pg``, ``clipfrac``, ``clipfrac_lower``, ``approx_kl``.

    Raises:
        ValueError: negative or non-numeric count, shape mismatch, non-0/1 mask, NaN in an input.
    """
    global_num_tokens = check_optional_count("global_num_tokens", global_num_tokens)
    global_num_seqs = check_optional_count("global_num_seqs", global_num_seqs)
    tokens = _checked_tokens(logp, old_logp, advantages, mask)
    if is_weights is not None:
        is_weights = check_token_tensor("is_weights", is_weights)
        check_same_shape("is_weights", is_weights, "logp", logp)

    terms = _TOKEN_LOSSES[settings.loss_type](tokens, settings)
    per_token = terms.loss if is_weights is None else terms.loss * is_weights.detach()
    loss = _aggregate(per_token, tokens.keep, settings.agg, settings.norm_constant, global_num_tokens,
                      global_num_seqs)
    with torch.no_grad():
        metrics = to_floats(
            {
                "pg": loss,
                "clipfrac": masked_mean(terms.clipped, tokens.keep, logp.dtype),
                "clipfrac_lower": masked_mean(terms.dual_clipped, tokens.keep, logp.dtype),
                "approx_kl": masked_mean(-tokens.log_ratio, tokens.keep),
            }
        )
    return loss, metrics


def _checked_inputs(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    behaviour_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A loss's [B, T] tensors checked (finite floats of one shape, a 0/1 mask), with the mask as
    bool; `behaviour_name` names the behaviour log-probs in the error."""
    logp = check_token_tensor("logp", logp)
    behaviour_logp = check_token_tensor(behaviour_name, behaviour_logp)
    advantages = check_token_tensor("advantages", advantages)
    check_same_shape(behaviour_name, behaviour_logp, "logp", logp)
    check_same_shape("advantages", advantages, "logp", logp)
    return logp, behaviour_logp, advantages, check_mask(mask, "logp", logp)


def _checked_tokens(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> _Tokens:
    """Validate ``policy_loss``'s tensors and detach the ones that must carry no gradient."""
    logp, old_logp, advantages, keep = _checked_inputs(logp, old_logp, advantages, mask, "old_logp")
    old_logp = old_logp.detach()
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return _Tokens(logp, old_logp, advantages.detach(), keep, log_ratio)


def _ppo_clip(tokens: _Tokens, settings: LossSettings) -> _TokenLoss:
    """The asymmetric clipped surrogate, capped at -A * clip_c where A < 0 (the dual clip)."""
    advantages = tokens.advantages
    ratio = tokens.log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * settings.clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(pessimistic, dual_clip_bound), pessimistic)
    return _TokenLoss(loss, clipped > unclipped, (pessimistic > dual_clip_bound) & negative)


def _reinforce(tokens: _Tokens, settings: LossSettings) -> _TokenLoss:
    """-A * logp: no ratio, so nothing is clipped."""
    nothing = torch.zeros_like(tokens.keep)
    return _TokenLoss(-tokens.advantages * tokens.logp, nothing, nothing)


def _gspo(tokens: _Tokens, settings: LossSettings) -> _TokenLoss:
    """GSPO's per-token clipped surrogate on the sequence ratio; no dual clip.

    The sequence log-ratio is the mean over the row's real tokens (an empty row gets 0).
    """
    logp, keep, advantages = tokens.logp, tokens.keep, tokens.advantages
    seq_log_ratio = masked_row_mean(logp.detach() - tokens.old_logp, keep)
    # logp - sg[logp] is exactly 0 and is added first, so the value is the sequence log-ratio to the
    # last bit (verl#2775); filling padding keeps an infinite padded logp from turning into NaN.
    token_log_ratio = (logp - logp.detach()).masked_fill(~keep, 0) + seq_log_ratio[:, None]
    # As verl clamps it: at most 10 (beyond, the value is e^10 and the gradient 0), no lower bound.
    ratio = token_log_ratio.clamp(max=_GSPO_LOG_RATIO_CEILING).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    return _TokenLoss(torch.maximum(unclipped, clipped), clipped > unclipped, torch.zeros_like(keep))


def _cispo(tokens: _Tokens, settings: LossSettings) -> _TokenLoss:
    """The clipped IS weight, detached, times -A * logp; ``clipped`` marks the clipped weights."""
    ratio = tokens.log_ratio.detach().exp()
    floor, ceiling = 1 - settings.clip_low, 1 + settings.clip_high
    # The weight is detached: every token keeps its gradient -A * w * grad logp, clipped or not.
    loss = -tokens.advantages * ratio.clamp(floor, ceiling) * tokens.logp
    return _TokenLoss(loss, (ratio < floor) | (ratio > ceiling), torch.zeros_like(tokens.keep))


def m2po_removed(log_ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
                 threshold: float) -> torch.Tensor:
    """M2PO's mask (Zheng et al. 2025, arXiv:2510.01161, Algorithm 1): the tokens to take out.

    The trust-region tokens are the real ones where PPO's clip could bind: A > 0 and log r > 0, or
    A < 0 and log r < 0. While the mean of (log r)^2 over those left exceeds `threshold`, the one
    with the largest (log r)^2 is taken out (the earliest in row-major order among equals). Taking
    the largest out never raises the mean, so this is the shortest run of the largest values whose
    removal brings the mean to `threshold`: found from the sorted values at once. If even the
    smallest exceeds it, every trust-region token is taken out. Computed over this call's tokens.

    Args:
        log_ratio: [B, T] log pi - log pi_old (no gradient is taken through the mask).
        advantages: [B, T] per-token advantages.
        keep: [B, T] bool, the real tokens.
        threshold: tau_M2 > 0 (the paper's 0.04).

    Returns:
        [B, T] bool, True on the tokens taken out.
    """
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        trust = keep & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
        flat = torch.nonzero(trust.reshape(-1)).squeeze(-1)
        removed = torch.zeros_like(keep).reshape(-1)
        if flat.numel() == 0:
            return removed.view_as(keep)
        second = log_ratio.reshape(-1)[flat].double().square()
        # Largest first; among equals the earliest token first, as argmax picks it.
        order = torch.sort(second, descending=True, stable=True).indices
        ranked = second[order]
        # Mean of what is left after taking out the first k, for k = 0 .. n-1 (non-increasing in k).
        left_means = ranked.flip(0).cumsum(0).flip(0) / torch.arange(ranked.numel(), 0, -1, dtype=ranked.dtype,
                                                                      device=ranked.device)
        within = torch.nonzero(left_means <= threshold)
        taken = int(within[0]) if within.numel() else ranked.numel()
        removed[flat[order[:taken]]] = True
        return removed.view_as(keep)


def _m2po(tokens: _Tokens, settings: LossSettings) -> _TokenLoss:
    """The unclipped surrogate -A * r, 0 on the tokens M2PO's second-moment mask takes out;
    ``clipped`` marks those."""
    removed = m2po_removed(tokens.log_ratio, tokens.advantages, tokens.keep, settings.m2_threshold)
    loss = (-tokens.advantages * tokens.log_ratio.exp()).masked_fill(removed, 0.0)
    return _TokenLoss(loss, removed, torch.zeros_like(tokens.keep))


# One entry per LOSS_TYPES name.
_TOKEN_LOSSES: dict[str, Callable[[_Tokens, LossSettings], _TokenLoss]] = {
    "ppo_clip": _ppo_clip,
    "reinforce": _reinforce,
    "gspo": _gspo,
    "cispo": _cispo,
    "m2po": _m2po,
}


def bypass_policy_loss(
    logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss in bypass mode: ``old_logp := rollout_logp``, with rollout correction.

    Args:
        logp: [B, T] log-probabilities under the policy being trained (receives the gradient).
        rollout_logp: [B, T] log-probabilities reported by the rollout engine (detached).
        advantages: [B, T] per-token advantages.
        mask: [B, T] 0/1 float or bool, 1 on real response tokens (before rejection).
        settings: as in ``policy_loss``, and ``settings.correction`` for ``rollout_correction``.
        global_num_tokens, global_num_seqs: as in ``aggregate``; when omitted, the counts of
            ``mask`` (before rejection) are used.

    Returns:
        ([] loss, metrics) with ``loss/pg``, ``loss/clipfrac``, ``loss/clipfrac_lower``,
        ``loss/approx_kl`` and the ``is/...`` and ``mismatch/...`` metrics.

    Raises:
        ValueError: any invalid argument of ``policy_loss`` or ``rollout_correction``.
    """
    logp, rollout_logp, advantages, keep = _checked_inputs(logp, rollout_logp, advantages, mask, "rollout_logp")
    weights, kept_mask, correction_metrics = rollout_correction(
        logp.detach(), rollout_logp, mask, **dataclasses.asdict(settings.correction)
    )
    if global_num_tokens is None:
        global_num_tokens = float(keep.sum())
    if global_num_seqs is None:
        global_num_seqs = float((keep.sum(-1) > 0).sum())
    loss, loss_metrics = policy_loss(
        logp,
        rollout_logp,
        advantages,
        kept_mask,
        settings,
        is_weights=None if settings.loss_type in _RATIO_LOSS_TYPES else weights,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
    )
    return loss, {f"loss/{name}": value for name, value in loss_metrics.items()} | correction_metrics
