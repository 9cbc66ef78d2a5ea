"""The admission bound under `train.staleness_control=divergence`: the largest staleness whose predicted
divergence holds `train.divergence_target` (docs/ALGORITHMS.md, Divergence-gated staleness).

Every learner step measures, per token age a (learner version - sampling version), the divergence of
the current policy from the sampling one (asyncgrpo/algo/divergence.py: the mean k3 KL, or the IS
effective sample size, taken as -log ESS so that both grow from 0 with the policy's drift). The law:

1. Fit: d(a) = r a^2, by token-weighted least squares through the origin in a^2:
   r = sum(n_a a^2 d_a) / sum(n_a a^4) over the step's age buckets (age-0 tokens carry no rate).
   Quadratic because both divergences are, to second order, quadratic in the distance the policy
   moved (KL ~ 1/2 dtheta' F dtheta; -log ESS = log(1 + chi^2) ~ chi^2), and that distance grows about
   linearly with the versions between; the embedded default's first run measured k3 at ages 1, 2
   and 3 in ratios near 1 : 4 : 11 (docs/ALGORITHMS.md). A line would under-predict the next bound
   and climb into it, only to come back down: a cycle the hold does not stop. A
   step with no token older than 0 leaves r as it was; after PROBE_STEPS such steps in a row r is
   forgotten (a bound of 0 measures nothing: without this it could never learn that the drift fell).
2. Smooth: r <- (1 - EMA) r + EMA r_step (the first measured rate is taken as is).
3. Choose: the bound k wants to go down while r k^2 > target, up while r (k + 1)^2 <= (1 - DEADBAND)
   target (and k < max_staleness), else stay. With no rate yet it wants up: no token is stale, so a
   higher bound costs nothing measured, and the first stale tokens give the rate.
4. Move: by one, only once it has wanted the same direction HOLD_STEPS steps in a row; then the
   count starts again. Always within [min_staleness, max_staleness].

It starts at min_staleness: the policy moves fastest early in training (the issue's warm-up case), so
the conservative end is the safe one until the drift is measured.

Why it does not oscillate: the fitted quantity is a drift coefficient, which the bound does not set
(a lower bound trains the same number of steps per version, it only picks younger samples), so the
loop has no gain from bound to measurement to ring with; what is left is measurement noise, which
the EMA shrinks, the dead band keeps from straddling the threshold, and the hold keeps from acting on
one step. Reversing needs HOLD_STEPS consecutive contrary wishes after a move.

Pure Python, no torch: the learner (rank 0) runs it and tests script it; the simulator models the
control as its max_staleness instead (docs/SIMULATOR.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

STALENESS_CONTROLS = ("versions", "divergence")
DIVERGENCE_METRICS = ("kl", "ess")

EMA = 0.2  # weight of a step's fitted coefficient in the smoothed one: about 5 steps of memory
HOLD_STEPS = 3  # consecutive steps a direction must be wanted before the bound moves
PROBE_STEPS = 30  # steps without a measured rate after which the old rate is forgotten (and probed again)
DEADBAND = 0.1  # going up needs the prediction 10% under the target: no flapping at the threshold
_MIN_ESS = 1e-12


def divergence_of(metric: str, k3: float, ess: float) -> float:
    """The divergence the law holds for `metric` (train.divergence_metric): the mean k3 KL, or -log ESS."""
    return k3 if metric == "kl" else -math.log(max(ess, _MIN_ESS))


def target_of(metric: str, target: float) -> float:
    """train.divergence_target as a divergence: the k3 KL itself, or -log of the ESS to keep."""
    return target if metric == "kl" else -math.log(max(target, _MIN_ESS))


def fit_rate(buckets: Iterable[tuple[float, float, float]]) -> float | None:
    """r of d(a) = r a^2 from (mean age, tokens, divergence) buckets: token-weighted least squares
    through the origin in a^2; None when no token is older than 0."""
    num = den = 0.0
    for age, tokens, divergence in buckets:
        num += tokens * age ** 2 * divergence
        den += tokens * age ** 4
    return num / den if den > 0 else None


def predicted(rate: float, bound: int) -> float:
    """The divergence the fit predicts at staleness `bound`."""
    return rate * bound ** 2


class BoundController:
    """The admission bound, stepped once per learner step from that step's age buckets."""

    def __init__(self, min_staleness: int, max_staleness: int, target: float) -> None:
        """`target`: the divergence to hold (`target_of`), >= 0."""
        if not 0 <= min_staleness <= max_staleness or not target >= 0:
            raise ValueError(f"bad bound controller settings: min_staleness={min_staleness}, "
                             f"max_staleness={max_staleness}, target={target}")
        self.min_staleness, self.max_staleness, self.target = min_staleness, max_staleness, target
        self.bound = min_staleness
        self.rate: float | None = None  # the smoothed r of d(a) = r a^2; None until measured
        self._wanted = 0  # +n: wanted up the last n steps, -n: down
        self._unmeasured = 0  # steps in a row without a rate

    def wanted(self) -> int:
        """The direction the bound wants to go now: -1, 0 or +1 (step 3 of the law)."""
        if self.rate is None:
            return 1 if self.bound < self.max_staleness else 0
        if self.bound > self.min_staleness and predicted(self.rate, self.bound) > self.target:
            return -1
        if self.bound < self.max_staleness and predicted(self.rate, self.bound + 1) <= (1 - DEADBAND) * self.target:
            return 1
        return 0

    def observe(self, buckets: Iterable[tuple[float, float, float]]) -> int:
        """One step's (mean age, tokens, divergence) buckets in; the bound to grant under out."""
        rate = fit_rate(buckets)
        if rate is not None:
            self.rate = rate if self.rate is None else (1 - EMA) * self.rate + EMA * rate
            self._unmeasured = 0
        else:
            self._unmeasured += 1
            if self._unmeasured >= PROBE_STEPS:
                self.rate, self._unmeasured = None, 0
        direction = self.wanted()
        if direction == 0:
            self._wanted = 0
        elif direction * self._wanted > 0:
            self._wanted += direction
        else:
            self._wanted = direction
        if abs(self._wanted) >= HOLD_STEPS:
            self.bound += direction
            self._wanted = 0
        return self.bound

    def metrics(self) -> dict[str, float]:
        """`divergence/bound` (the bound now) and `divergence/rate` (the smoothed r; 0 before any)."""
        return {"divergence/bound": float(self.bound), "divergence/rate": self.rate or 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "rate": self.rate, "wanted": self._wanted, "unmeasured": self._unmeasured}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`; a bound outside this run's [min, max] is clamped into it."""
        self.bound = min(self.max_staleness, max(self.min_staleness, int(state["bound"])))
        self.rate = None if state["rate"] is None else float(state["rate"])
        self._wanted = int(state["wanted"])
        self._unmeasured = int(state["unmeasured"])
