"""The loss's settings: the ``algo.*`` config keys the policy loss and the KL penalty read, as one
frozen object validated once when it is built, and the choices each setting may take.

API
---
``MODES``, ``LOSS_TYPES``, ``AGG_MODES``: the valid ``mode``, ``loss_type`` and ``agg``.

``LossSettings(mode, loss_type, clip_low, clip_high, clip_c, m2_threshold, agg, norm_constant, correction, kl)``
    What ``policy_loss``, ``bypass_policy_loss``, ``decoupled_policy_loss``, ``naive_policy_loss``
    and ``mode_policy_loss`` take instead of one keyword argument per config key. ``correction`` is a
    ``CorrectionSettings`` (``algo.correction.*``), ``kl`` a ``KLSettings`` or ``None`` (no KL
    penalty). Every field is required: the structured config (asyncgrpo/schema.py) is the one place
    defaults live, and the learner builds this object from it (``loss_settings`` in
    asyncgrpo/learner/update.py).

A setting out of its range raises ``ValueError`` on construction, in one line naming the field, so a
bad combination fails before any tensor is touched. The correction's thresholds are parsed, and
checked, by ``rollout_correction`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.algo._checks import check_choice, check_positive, check_real
from asyncgrpo.algo.kl import KL_KINDS

MODES = ("bypass", "decoupled", "naive")
LOSS_TYPES = ("ppo_clip", "reinforce", "gspo", "cispo", "m2po")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def clip_low_allowed(clip_low: float, loss_type: str) -> bool:
    """The range of ``clip_low``, for ``LossSettings`` and config's algo rules alike: 0 < clip_low < 1;
    exactly 1 only for ``cispo``, which clips an IS weight, not the surrogate (a floor of 0 is its
    paper's setting)."""
    return 0 < clip_low < 1 or (clip_low == 1 and loss_type == "cispo")


@dataclass(frozen=True)
class CorrectionSettings:
    """``algo.correction.*``: the keyword arguments of ``rollout_correction``, which validates them."""

    is_level: str | None
    is_threshold: float | str | None
    is_batch_normalize: bool
    rs: str | None
    rs_threshold: float | str | None


@dataclass(frozen=True)
class KLSettings:
    """``algo.kl.kind`` and ``algo.kl.coef``: the penalty ``coef * aggregate(kl_penalty(..., kind))``."""

    kind: str
    coef: float

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KL_KINDS)
        if check_real("coef", self.coef) < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef!r}")


@dataclass(frozen=True)
class LossSettings:
    """The policy loss's ``algo.*`` keys (see the module docstring).

    Fields:
        mode: one of ``MODES``, the anchor of the ratio; read by ``mode_policy_loss`` only (the
            per-mode functions are the mode).
        loss_type: one of ``LOSS_TYPES``.
        clip_low: lower clip range, 0 < clip_low < 1 (ratio floor 1 - clip_low); ``cispo`` also
            takes 1 (IS-weight floor 0, i.e. none). Unused by ``reinforce``.
        clip_high: upper clip range, > 0 (ratio ceiling 1 + clip_high). Unused by ``reinforce``.
        clip_c: dual-clip bound for negative advantages, > 1; used by ``ppo_clip`` only.
        m2_threshold: M2PO's bound on the mean squared log-ratio of the trust-region tokens
            (tau_M2), > 0; used by ``m2po`` only.
        agg: aggregation mode, one of ``AGG_MODES``.
        norm_constant: divisor of ``seq-mean-token-sum-norm`` (> 0, or None for T, the padded
            length of each call's tensors); ignored by the other modes.
        correction: the rollout correction (``bypass`` and ``decoupled``; ``naive`` has none).
        kl: the KL penalty against the reference, or None when it is off.
    """

    mode: str
    loss_type: str
    clip_low: float
    clip_high: float
    clip_c: float
    m2_threshold: float
    agg: str
    norm_constant: float | None
    correction: CorrectionSettings
    kl: KLSettings | None

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("agg", self.agg, AGG_MODES)
        if not clip_low_allowed(check_positive("clip_low", self.clip_low), self.loss_type):
            raise ValueError(f"clip_low must be < 1 (or exactly 1 with loss_type cispo), got {self.clip_low!r}")
        check_positive("clip_high", self.clip_high)
        if check_positive("clip_c", self.clip_c) <= 1:
            raise ValueError(f"clip_c must be > 1, got {self.clip_c!r}")
        check_positive("m2_threshold", self.m2_threshold)
        if self.norm_constant is not None:
            check_positive("norm_constant", self.norm_constant)
