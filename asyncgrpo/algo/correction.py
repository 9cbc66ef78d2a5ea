"""Rollout correction: importance weights and rejection masks for the rollout/trainer mismatch.

API
---
``rollout_correction(logp_train, logp_rollout, mask, *, is_level, is_threshold, is_batch_normalize, rs,
rs_threshold) -> (weights | None, new_mask, metrics)``

The keyword arguments are the ``algo.correction.*`` keys, with no defaults of their own: config's
are the only ones (``is_level=None`` and ``rs=None`` switch IS weights and rejection off).

With lam = logp_train - logp_rollout per token (0 on padding):

Importance weights (``is_level``), detached and 0 on padding:

* ``token``: w_t = exp(clamp(lam_t, -20, 20))
* ``sequence``: w_i = exp(clamp(sum_t lam_t, -20, 20)) on every real token of sequence i
* ``is_threshold`` U (a number or a numeric string): truncation (TIS), w = min(w, U).
  ``"L_U"`` (e.g. ``"0.5_2.0"``): masking (IcePop), w kept where L <= w <= U, else 0; the token
  mask is not changed.
* ``is_batch_normalize``: divide w by its batch mean (over real tokens for ``token``, over
  non-empty sequences for ``sequence``), unless that mean is <= 1e-8.

Rejection sampling (``rs``, comma-separated ``RS_OPTIONS``; a token survives only if every option
passes), on lt = clamp(lam, -20, 20) with k1 = -lt, k2 = lt^2 / 2, k3 = exp(lt) - 1 - lt:

* ``token_kN``: the token's own value; ``seq_sum_kN`` / ``seq_mean_kN`` / ``seq_max_kN``: the sum /
  mean / max over the sequence's real tokens, removing the whole sequence when it fails.
* k1 options keep log(L) <= stat <= log(U) (threshold ``"L_U"``, or U alone meaning L = 1/U);
  k2 and k3 options keep stat <= U and take a single U.
* ``rs_threshold``: a number or a string; the string holds one threshold per option, comma
  separated, or a single one shared by all options.

The returned ``new_mask`` is ``mask`` (same dtype) with rejected tokens set to 0; the IS weights are
not multiplied by it. Metrics (plain floats, computed on the input mask):

* ``is/mean``, ``is/std``, ``is/ess`` of the applied weights before batch normalisation (ESS is the
  normalised effective sample size 1 / mean((w / mean w)^2), in [0, 1]); ``is/max``, ``is/min`` of
  the raw weights; ``is/frac_above`` / ``is/frac_below``: fraction of raw weights above U / below
  L (L = 1/U for truncation), over real tokens (``token``) or non-empty sequences (``sequence``);
  ``is/batch_norm_factor`` when normalising. Present only when ``is_level`` is set.
* ``is/rs_masked_token_frac``, ``is/rs_masked_seq_frac`` (fraction of real tokens removed, fraction
  of non-empty sequences that lost at least one token) and the same per option as
  ``is/rs_<option>_masked_token_frac`` / ``is/rs_<option>_masked_seq_frac``. Present when ``rs`` is set.
* Always: ``mismatch/kl`` = mean(logp_rollout - logp_train), ``mismatch/k3_kl`` = mean(k3),
  ``mismatch/ppl_train`` / ``mismatch/ppl_rollout`` (mean over sequences of exp(-mean token
  log-prob)), ``mismatch/ppl_ratio`` (mean over sequences of ppl_train / ppl_rollout),
  ``mismatch/chi2_token`` = mean(exp(2 lt)) - 1, ``mismatch/chi2_seq`` = mean over sequences of
  exp(2 clamp(sum_t lam, ±20)) - 1.

Token means run over the real tokens and sequence means over the non-empty sequences of this call;
with no real token at all every metric is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncgrpo.algo._checks import (
    check_bool,
    check_choice,
    check_mask,
    check_positive,
    check_same_shape,
    check_token_tensor,
)
from asyncgrpo.algo._masked import (
    masked_max,
    masked_mean,
    masked_min,
    masked_row_mean,
    masked_sum,
    to_floats,
)

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

LOG_RATIO_BOUND = 20.0
_MIN_NORMALIZER = 1e-8


@dataclass(frozen=True)
class _Bounds:
    lower: float | None
    upper: float


def rollout_correction(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str | None,
    is_threshold: float | str | None,
    is_batch_normalize: bool,
    rs: str | None,
    rs_threshold: float | str | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection mask and mismatch diagnostics of the rollout policy against the trainer.

    Args:
        logp_train: [B, T] log-probabilities of the sampled tokens under the trained policy (the
            recomputed old policy, or the current forward pass in bypass mode).
        logp_rollout: [B, T] log-probabilities reported by the rollout engine.
        mask: [B, T] 0/1 float or bool, 1 on real response tokens.
        is_level: ``None`` (no weights), ``"token"`` or ``"sequence"``.
        is_threshold: U > 0 (truncation) or ``"L_U"`` with 0 < L <= U (masking); may be ``None``
            only while ``is_level`` is ``None``. Validated even while IS is off.
        is_batch_normalize: normalise the weights to batch mean 1.
        rs: ``None`` or comma-separated ``RS_OPTIONS``, each at most once.
        rs_threshold: required with ``rs``; see the module docstring.

    Returns:
        (weights, new_mask, metrics): [B, T] detached weights or ``None`` when ``is_level`` is
        ``None``; [B, T] mask after rejection, dtype of ``mask``; metrics (see module docstring).

    Raises:
        ValueError: unknown level or option, threshold <= 0, L > U, boolean or malformed threshold,
            wrong number of thresholds, shape mismatch, non-0/1 mask, NaN in an input.
    """
    is_bounds, rs_bounds = _parse_settings(is_level, is_threshold, is_batch_normalize, rs, rs_threshold)
    logp_train = check_token_tensor("logp_train", logp_train)
    logp_rollout = check_token_tensor("logp_rollout", logp_rollout)
    check_same_shape("logp_rollout", logp_rollout, "logp_train", logp_train)
    keep = check_mask(mask, "logp_train", logp_train)

    with torch.no_grad():
        logp_train = logp_train.detach().masked_fill(~keep, 0)
        logp_rollout = logp_rollout.detach().masked_fill(~keep, 0)
        log_ratio = logp_train - logp_rollout
        stats = _mismatch_stats(logp_train, logp_rollout, log_ratio, keep)
        weights = None
        if is_level is not None and is_bounds is not None:
            weights, is_stats = _importance_weights(log_ratio, keep, is_level, is_bounds, is_batch_normalize)
            stats |= is_stats
        new_mask = mask
        if rs_bounds:
            survivors, rs_stats = _rejection(log_ratio, keep, rs_bounds)
            stats |= rs_stats
            new_mask = (keep & survivors).to(mask.dtype)
        metrics = to_floats(stats)
    if not bool(keep.any()):
        metrics = dict.fromkeys(metrics, 0.0)
    return weights, new_mask, metrics


def check_correction_settings(*, is_level: str | None, is_threshold: float | str | None, is_batch_normalize: bool,
                              rs: str | None, rs_threshold: float | str | None) -> None:
    """Validate ``rollout_correction``'s settings without tensors (a config is refused before
    anything starts). Raises ValueError naming the setting, as ``rollout_correction`` would."""
    _parse_settings(is_level, is_threshold, is_batch_normalize, rs, rs_threshold)


def _parse_settings(is_level: str | None, is_threshold: float | str | None, is_batch_normalize: bool,
                    rs: str | None, rs_threshold: float | str | None) -> tuple[_Bounds | None, dict[str, _Bounds]]:
    if is_level is not None:
        check_choice("is_level", is_level, IS_LEVELS)
    # An unused threshold is still validated so a bad config fails before IS is switched on.
    is_bounds = None if is_level is None and is_threshold is None else _parse_bounds("is_threshold", is_threshold)
    check_bool("is_batch_normalize", is_batch_normalize)
    rs_bounds = _parse_rejection(rs, rs_threshold) if rs is not None else {}
    return is_bounds, rs_bounds


def _parse_number(name: str, text: str) -> float:
    try:
        return check_positive(name, float(text))
    except ValueError as error:
        raise ValueError(f"{name} has an invalid threshold {text!r}: {error}") from error


def _parse_bounds(name: str, spec: object) -> _Bounds:
    """A number U, a numeric string "U" or a string "L_U" -> bounds, with 0 < L <= U."""
    if isinstance(spec, str):
        parts = [part.strip() for part in spec.strip().split("_")]
        if len(parts) == 1:
            return _Bounds(None, _parse_number(name, parts[0]))
        if len(parts) != 2:
            raise ValueError(f"{name} must be a number U or a string 'L_U', got {spec!r}")
        lower, upper = _parse_number(name, parts[0]), _parse_number(name, parts[1])
        if lower > upper:
            raise ValueError(f"{name} lower bound {lower} exceeds upper bound {upper} in {spec!r}")
        return _Bounds(lower, upper)
    return _Bounds(None, check_positive(name, spec))


def _parse_rejection(rs: object, rs_threshold: object) -> dict[str, _Bounds]:
    if not isinstance(rs, str):
        raise ValueError(f"rs must be a comma-separated string of options, got {rs!r}")
    options = [option.strip() for option in rs.split(",")]
    for option in options:
        check_choice("rs", option, RS_OPTIONS)
    if len(set(options)) != len(options):
        raise ValueError(f"rs lists an option twice: {rs!r}")
    if rs_threshold is None:
        raise ValueError("rs_threshold is required when rs is set")
    specs: list[object] = [rs_threshold]
    if isinstance(rs_threshold, str):
        specs = [part.strip() for part in rs_threshold.split(",")]
    if len(specs) == 1:
        specs *= len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"rs_threshold has {len(specs)} thresholds for {len(options)} rs options; give 1 or {len(options)}"
        )

    bounds: dict[str, _Bounds] = {}
    for option, spec in zip(options, specs, strict=True):
        option_bounds = _parse_bounds("rs_threshold", spec)
        if option.endswith("k1"):
            lower = option_bounds.lower if option_bounds.lower is not None else 1.0 / option_bounds.upper
            if lower > option_bounds.upper:
                raise ValueError(
                    f"rs_threshold {spec!r} for {option}: a single bound U means [1/U, U] and needs U >= 1"
                )
            option_bounds = _Bounds(lower, option_bounds.upper)
        elif option_bounds.lower is not None:
            raise ValueError(f"rs_threshold for {option} takes a single upper bound, got {spec!r}")
        bounds[option] = option_bounds
    return bounds


def _importance_weights(
    log_ratio: torch.Tensor, keep: torch.Tensor, level: str, bounds: _Bounds, batch_normalize: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    non_empty = keep.any(-1)
    seq_raw = log_ratio.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    if level == "token":
        raw = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    else:
        raw = seq_raw[:, None].expand_as(log_ratio)
    raw = raw.masked_fill(~keep, 0)
    if bounds.lower is None:
        weights = raw.clamp(max=bounds.upper)
    else:
        weights = torch.where((raw >= bounds.lower) & (raw <= bounds.upper), raw, 0)
    lower = bounds.lower if bounds.lower is not None else 1.0 / bounds.upper

    if level == "token":
        frac_above = masked_mean(raw > bounds.upper, keep, raw.dtype)
        frac_below = masked_mean(raw < lower, keep, raw.dtype)
    else:
        frac_above = masked_mean(seq_raw > bounds.upper, non_empty, raw.dtype)
        frac_below = masked_mean(seq_raw < lower, non_empty, raw.dtype)
    mean = masked_mean(weights, keep)
    variance = (masked_mean(weights.square(), keep) - mean.square()).clamp_min(0)
    normalized_second_moment = masked_mean((weights / (mean + _MIN_NORMALIZER)).square(), keep)
    stats = {
        "is/mean": mean,
        "is/max": masked_max(raw, keep),
        "is/min": masked_min(raw, keep),
        "is/std": torch.where(keep.sum() > 1, variance.sqrt(), 0),
        "is/ess": torch.where(normalized_second_moment > 0, 1 / normalized_second_moment, 0),
        "is/frac_above": frac_above,
        "is/frac_below": frac_below,
    }
    if batch_normalize:
        # Per level, the mean over the units the weights belong to: tokens or sequences.
        batch_mean = mean if level == "token" else masked_mean(masked_row_mean(weights, keep), non_empty)
        normalizer = torch.where(batch_mean > _MIN_NORMALIZER, batch_mean, 1)
        weights = weights / normalizer
        stats["is/batch_norm_factor"] = normalizer
    return weights, stats


def _rejection(
    log_ratio: torch.Tensor, keep: torch.Tensor, bounds_of_option: dict[str, _Bounds]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_token = {"k1": -bounded, "k2": 0.5 * bounded.square(), "k3": torch.expm1(bounded) - bounded}
    non_empty = keep.any(-1)
    dtype = log_ratio.dtype
    survivors = torch.ones_like(keep)
    stats: dict[str, torch.Tensor] = {}
    for option, bounds in bounds_of_option.items():
        level, estimator = option.rsplit("_", 1)
        values = per_token[estimator]
        if level == "seq_sum":
            values = masked_sum(values, keep, dim=-1)
        elif level == "seq_mean":
            values = masked_row_mean(values, keep)
        elif level == "seq_max":
            values = torch.where(non_empty, values.masked_fill(~keep, -torch.inf).amax(-1), 0)
        if bounds.lower is None:
            passes = values <= bounds.upper
        else:
            passes = (values >= math.log(bounds.lower)) & (values <= math.log(bounds.upper))
        if level != "token":
            passes = passes[:, None].expand_as(keep)
        survivors = survivors & passes
        stats |= _removed_fractions(f"is/rs_{option}", passes, keep, non_empty, dtype)
    stats |= _removed_fractions("is/rs", survivors, keep, non_empty, dtype)
    return survivors, stats


def _removed_fractions(
    prefix: str, passes: torch.Tensor, keep: torch.Tensor, non_empty: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    removed = keep & ~passes
    return {
        f"{prefix}_masked_token_frac": masked_mean(removed, keep, dtype),
        f"{prefix}_masked_seq_frac": masked_mean(removed.any(-1), non_empty, dtype),
    }


def _mismatch_stats(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, log_ratio: torch.Tensor, keep: torch.Tensor
) -> dict[str, torch.Tensor]:
    non_empty = keep.any(-1)
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    mean_logp_train = masked_row_mean(logp_train, keep)
    mean_logp_rollout = masked_row_mean(logp_rollout, keep)
    seq_log_ratio = log_ratio.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {
        "mismatch/kl": masked_mean(-log_ratio, keep),
        "mismatch/k3_kl": masked_mean(torch.expm1(bounded) - bounded, keep),
        "mismatch/ppl_train": masked_mean((-mean_logp_train).exp(), non_empty),
        "mismatch/ppl_rollout": masked_mean((-mean_logp_rollout).exp(), non_empty),
        "mismatch/ppl_ratio": masked_mean((mean_logp_rollout - mean_logp_train).exp(), non_empty),
        "mismatch/chi2_token": masked_mean((2 * bounded).exp(), keep) - 1,
        "mismatch/chi2_seq": masked_mean((2 * seq_log_ratio).exp(), non_empty) - 1,
    }
