"""The algorithm core of asyncgrpo: pure tensor math, no I/O and no global state.

Shapes: B responses, T response tokens; per-response values are [B], per-token values [B, T], and
``mask`` is a 0/1 float or bool [B, T] tensor that is 1 on real response tokens (the learner's is the
policy mask: an environment's observation tokens are 0, like padding). Metrics come back as
``dict[str, float]`` of plain Python floats. Invalid arguments raise ``ValueError`` naming the
argument. The semantics follow verl (trainer/ppo/core_algos.py and rollout_corr_helper.py); the
formulas, defaults and deliberate deviations are documented in docs/ALGORITHMS.md.

* ``group_advantages``: GRPO / Dr.GRPO / RLOO advantages from outcome rewards and group ids.
* ``LossSettings`` (with ``CorrectionSettings``, ``KLSettings``): the ``algo.*`` keys the losses
  read, validated once when built.
* ``policy_loss``, ``aggregate``: PPO-clip (asymmetric, dual clip) and REINFORCE losses and their
  token / sequence aggregation, additive over micro-batches given global counts.
* ``kl_penalty``: k1 / abs / k2 / k3 KL estimators, optionally with the k2 gradient (``+``).
* ``rollout_correction``: truncated or masked (IcePop) importance weights, rejection sampling and
  rollout/trainer mismatch diagnostics.
* ``policy_loss`` also has GSPO (sequence-level ratio), CISPO (clipped, detached IS weight) and M2PO
  (unclipped, with the second-moment mask ``m2po_removed``).
* ``token_entropy``: the policy's entropy per token, from its logits (a diagnostic).
* ``bypass_policy_loss``: the policy loss with the rollout log-probs as the old policy.
* ``apply_overlong``, ``OverlongSettings``, ``overlong_penalty``: what a completion cut at the token
  limit does to the update (keep, mask, DAPO's soft penalty); ``carries_signal``: whether a group's
  rewards differ (DAPO's dynamic sampling).
* ``decoupled_policy_loss``, ``naive_policy_loss``, ``mode_policy_loss``: the recomputed proximal
  policy as the old policy, with (decoupled) or without (naive) IS weights pi_prox / mu; ``MODES``.
* ``age_bucket_sums``, ``bucket_divergences``, ``group_cap``, ``CAP_ACTIONS``: the k3 KL and IS ESS of
  the current policy against the sampling one per token age, and the per-group divergence cap.
"""

from asyncgrpo.algo.advantages import ADVANTAGE_MODES, group_advantages
from asyncgrpo.algo.correction import IS_LEVELS, RS_OPTIONS, rollout_correction
from asyncgrpo.algo.divergence import CAP_ACTIONS, age_bucket_sums, bucket_divergences, group_cap
from asyncgrpo.algo.entropy import token_entropy
from asyncgrpo.algo.kl import KL_KINDS, kl_penalty
from asyncgrpo.algo.losses import (
    aggregate,
    bypass_policy_loss,
    m2po_removed,
    policy_loss,
)
from asyncgrpo.algo.overlong import (
    OVERLONG_MODES,
    OverlongSettings,
    advantage_rewards,
    apply_overlong,
    carries_signal,
    overlong_penalty,
)
from asyncgrpo.algo.modes import (
    decoupled_policy_loss,
    mode_policy_loss,
    naive_policy_loss,
)
from asyncgrpo.algo.settings import (
    AGG_MODES,
    LOSS_TYPES,
    MODES,
    CorrectionSettings,
    KLSettings,
    LossSettings,
)

__all__ = [
    "ADVANTAGE_MODES",
    "AGG_MODES",
    "CAP_ACTIONS",
    "IS_LEVELS",
    "KL_KINDS",
    "LOSS_TYPES",
    "MODES",
    "OVERLONG_MODES",
    "RS_OPTIONS",
    "CorrectionSettings",
    "KLSettings",
    "LossSettings",
    "OverlongSettings",
    "advantage_rewards",
    "age_bucket_sums",
    "aggregate",
    "apply_overlong",
    "bucket_divergences",
    "bypass_policy_loss",
    "carries_signal",
    "decoupled_policy_loss",
    "group_advantages",
    "group_cap",
    "kl_penalty",
    "m2po_removed",
    "mode_policy_loss",
    "naive_policy_loss",
    "overlong_penalty",
    "policy_loss",
    "rollout_correction",
    "token_entropy",
]
