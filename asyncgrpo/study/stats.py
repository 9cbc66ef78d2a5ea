"""The study's statistics: a mean over seeds with its Student's t confidence interval, and the
paired difference of a cell against the baseline over the seeds both finished (docs/STUDIES.md,
"The statistics"). Standard library only: scipy is not a dependency."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95  # of every interval in the report and the figures


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t distribution with df degrees of freedom (scipy's t.ppf), by
    bisection on the CDF; scipy is not a dependency."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0 (got p={p}, df={df})")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-13 * max(1.0, high):
            break
    return (low + high) / 2


def t_cdf(t: float, df: float) -> float:
    """P(T <= t), T ~ Student's t(df): 1 - I_x(df/2, 1/2) / 2 for t >= 0, x = df / (df + t^2)."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified Lentz;
    Numerical Recipes' betacf), on the side where it converges fast."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h / a


@dataclass(frozen=True)
class Estimate:
    """A mean over n values with its confidence interval (no interval for n < 2): mean +- half_width,
    or `bounds` where the interval is not symmetric about the mean (a ratio's, `paired_ratio`)."""

    n: int
    mean: float | None
    half_width: float | None
    bounds: tuple[float, float] | None = None

    @property
    def low(self) -> float | None:
        if self.bounds is not None:
            return self.bounds[0]
        return None if self.mean is None or self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        if self.bounds is not None:
            return self.bounds[1]
        return None if self.mean is None or self.half_width is None else self.mean + self.half_width


def mean_ci(values: Sequence[float | None], confidence: float = CONFIDENCE) -> Estimate:
    """Mean and the t-interval mean +- t((1 + confidence) / 2, n - 1) * s / sqrt(n), s the sample
    standard deviation (n - 1 in the denominator). Missing values are left out."""
    xs = [float(v) for v in values if is_number(v)]
    n = len(xs)
    if n == 0:
        return Estimate(0, None, None)
    mean = sum(xs) / n
    if n < 2:
        return Estimate(1, mean, None)
    return Estimate(n, mean, t_quantile((1 + confidence) / 2, n - 1) * math.sqrt(_variance(xs) / n))


def paired_difference(cell: dict[int, float | None], baseline: dict[int, float | None],
                      confidence: float = CONFIDENCE) -> Estimate:
    """Mean of cell - baseline over the seeds both have a value for, with its t-interval: pairing by
    seed removes what a seed does to both (its warm-started model, its prompts)."""
    seeds = [s for s in cell if is_number(cell[s]) and is_number(baseline.get(s))]
    return mean_ci([float(cell[s]) - float(baseline[s]) for s in seeds], confidence)  # type: ignore[arg-type]


def paired_ratio(cell: dict[int, float | None], baseline: dict[int, float | None],
                 confidence: float = CONFIDENCE) -> Estimate:
    """The geometric mean of cell / baseline over the seeds both have a value above 0 for, with the
    t-interval of the log-ratios exponentiated: throughput compared as a ratio, which scales out how
    loaded the machine was while a seed's runs ran (a study runs every cell at a seed before the next
    seed). On the log scale the interval stays above 0 and a cell's ratio to the baseline is the
    inverse of the baseline's to the cell, which neither holds for a mean of ratios."""
    seeds = [s for s in cell if is_number(cell[s]) and is_number(baseline.get(s))
             and float(cell[s]) > 0 and float(baseline[s]) > 0]  # type: ignore[arg-type]
    logs = mean_ci([math.log(float(cell[s]) / float(baseline[s])) for s in seeds], confidence)  # type: ignore[arg-type]
    if logs.mean is None:
        return logs
    bounds = None if logs.half_width is None else (math.exp(logs.low), math.exp(logs.high))  # type: ignore[arg-type]
    return Estimate(logs.n, math.exp(logs.mean), None, bounds)


@dataclass(frozen=True)
class PairingGain:
    """A cell against the baseline over n pairs (recordings or seeds both have), estimated two ways:
    `paired`, the mean of the per-pair differences with its t-interval (var(A - B) / n), and `unpaired`,
    the same mean with the interval it would have if each cell had had its own independent runs
    ((var(A) + var(B)) / n, Welch's degrees of freedom); `variance_ratio` = (var(A) + var(B)) / var(A - B),
    how many times fewer pairs than independent runs per cell give the same precision (above 1:
    pairing helps; infinite when every pair differs by the same amount; None below 2 pairs)."""

    n: int
    paired: Estimate
    unpaired: Estimate
    variance_ratio: float | None


def pairing_gain(cell: dict[int, float | None], baseline: dict[int, float | None],
                 confidence: float = CONFIDENCE) -> PairingGain:
    """The paired and the unpaired estimate of cell - baseline over the keys both have a value for
    (`PairingGain`): what comparing on identical samples buys over independent runs."""
    keys = [k for k in cell if is_number(cell[k]) and is_number(baseline.get(k))]
    a, b = [float(cell[k]) for k in keys], [float(baseline[k]) for k in keys]  # type: ignore[arg-type]
    paired = paired_difference(cell, baseline, confidence)
    n = len(keys)
    if n < 2:
        return PairingGain(n, paired, Estimate(n, paired.mean, None), None)
    var_a, var_b, var_d = _variance(a), _variance(b), _variance([x - y for x, y in zip(a, b)])
    unpaired_var = var_a + var_b
    if unpaired_var == 0:
        unpaired = Estimate(n, paired.mean, 0.0)
    else:
        # Welch-Satterthwaite with equal n: df = (n - 1) (va + vb)^2 / (va^2 + vb^2).
        df = (n - 1) * unpaired_var ** 2 / (var_a ** 2 + var_b ** 2)
        unpaired = Estimate(n, paired.mean, t_quantile((1 + confidence) / 2, df) * math.sqrt(unpaired_var / n))
    ratio = (unpaired_var / var_d if var_d > 0 else (math.inf if unpaired_var > 0 else None))
    return PairingGain(n, paired, unpaired, ratio)


def _variance(xs: Sequence[float]) -> float:
    """The sample variance (n - 1 in the denominator)."""
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def is_number(value: Any) -> bool:
    """A value that counts: a finite int or float (not a bool, NaN or a missing one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (higher or equal in both,
    higher in one): the trade-offs worth having when both are wanted high (samples/s, accuracy)."""
    return [i for i, (x, y) in enumerate(points)
            if not any(ox >= x and oy >= y and (ox > x or oy > y) for ox, oy in points)]
