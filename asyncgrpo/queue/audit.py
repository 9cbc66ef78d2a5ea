"""The trained-vs-sampled audit: how the groups a run trained on differ from the groups its
generators made (docs/METRICS.md, Trained against sampled).

Learner rank 0's replay queue (asyncgrpo/queue/replay_queue.py) owns a `TrainAudit` and calls it
with its lock held: `arrive` for every group that reaches it and that its registry admits (before
any filter, rejection or drop), `settle` for each group it will not train and why, `train` for the
groups a step takes. Other ranks take no groups and keep none: the audit is rank 0's.

"Sampled" counts every group that arrived, plus those that never did: `lost` (slots granted again
because their group never came: the dispatcher's count; without one, the registry's sequence gaps;
frames the codec rejected are among them) and `given_back` (groups the generators dropped for
reward or environment errors, from their reports). So, at every moment:

    sampled == trained + dropped_stale + unheld + filtered + rejected + lost + given_back + queued

Distributions (a group's mean completion length, its mean reward) exist only for groups that
arrived; they are compared between the trained groups and the sampled ones whose fate is known
(trained or not trained; the queued ones are left out, since the newest groups wait in the queue and
would otherwise make any improving run look like a departure). Each side keeps a fixed-size uniform
reservoir of groups (`log.audit_reservoir_groups`, algorithm R, seeded): memory is bounded whatever
the run's length, and exact while the run has made fewer groups. Staleness keeps running sums and
maxima: exact.

The departure statistic is the two-sample Kolmogorov-Smirnov distance between the two reservoirs,
for lengths and for rewards; above `log.audit_max_ks` (once `log.audit_min_groups` groups were
trained) the run's summary.json says so (`departure`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from asyncgrpo.wire import ScoredGroup

# Why a group was not trained; the identity above adds them up. The first four arrived (and so have
# a length and a reward); the last two never did.
SETTLED_REASONS = ("dropped_stale", "unheld", "filtered", "rejected")
REASONS = SETTLED_REASONS + ("lost", "given_back")
QUANTILES = (10, 50, 90)  # percentiles of a group's mean completion length, sampled and trained

GroupKey = tuple[int, int, int]  # generator id, incarnation, sequence number: unique per admitted group


def ks_distance(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov distance, sup_x |F_a(x) - F_b(x)| of the two empirical
    distribution functions, in [0, 1]; 0 when either sample is empty (nothing to compare)."""
    a, b = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    if a.size == 0 or b.size == 0:
        return 0.0
    # The supremum is reached at a data point: evaluate both step functions at every one.
    points = np.concatenate([a, b])
    fa = np.searchsorted(a, points, side="right") / a.size
    fb = np.searchsorted(b, points, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[int] = QUANTILES) -> list[float]:
    """The `qs` percentiles of `values` (linear interpolation, numpy's default); [] if empty."""
    values = np.asarray(values, dtype=np.float64)
    return [float(v) for v in np.percentile(values, qs)] if values.size else []


class Reservoir:
    """A uniform sample of at most `size` rows of a stream (Vitter's algorithm R), seeded so a run's
    audit is reproducible; every row is kept while fewer than `size` came. Each row has a key, so
    rows can be left out by key (`rows`); the numbers sit in one array, so reading them all is cheap."""

    def __init__(self, size: int, seed: int, columns: int = 2) -> None:
        if size < 1:
            raise ValueError(f"a reservoir holds at least one row, got size={size}")
        self.size, self.seen = size, 0
        self.values = np.empty((size, columns), dtype=np.float64)
        self.keys: list[Any] = []
        self._where: dict[Any, int] = {}  # key -> its row
        self._rng = random.Random(seed)

    def add(self, key: Any, values: Sequence[float]) -> None:
        self.seen += 1
        if len(self.keys) < self.size:
            index = len(self.keys)
            self.keys.append(key)
        else:
            index = self._rng.randrange(self.seen)
            if index >= self.size:
                return
            if self._where.get(self.keys[index]) == index:
                del self._where[self.keys[index]]
            self.keys[index] = key
        self._where[key] = index
        self.values[index] = values

    def rows(self, leave_out: Iterable[Any] = ()) -> np.ndarray:
        """[n, columns]: the rows kept, but those whose key is in `leave_out`."""
        kept = np.ones(len(self.keys), dtype=bool)
        for key in leave_out:
            index = self._where.get(key)
            if index is not None:
                kept[index] = False
        return self.values[:len(self.keys)][kept]


class RunningStat:
    """Count, sum and maximum of a stream of numbers: its mean and max over the run, exactly."""

    def __init__(self) -> None:
        self.count, self.total, self.max = 0, 0.0, 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.max = value if self.count == 1 else max(self.max, value)

    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def group_key(group: ScoredGroup) -> GroupKey:
    return group.generator_id, group.incarnation, group.seq


def group_point(group: ScoredGroup) -> tuple[float, float]:
    """(the group's mean completion length in tokens, its mean reward): what the reservoirs keep."""
    return float(np.mean(group.lengths)), float(np.mean(group.rewards))


class TrainAudit:
    """Counts and bounded distributions of sampled against trained groups; not thread-safe (the
    queue calls it with its lock held)."""

    def __init__(self, reservoir_groups: int, seed: int = 0) -> None:
        self.sampled_points = Reservoir(reservoir_groups, seed)
        self.trained_points = Reservoir(reservoir_groups, seed + 1)
        self.arrived = self.trained = 0
        self.not_trained = dict.fromkeys(SETTLED_REASONS, 0)
        self.sampled_staleness, self.trained_staleness = RunningStat(), RunningStat()
        self.version = 0  # the learner version of the newest take, done or waiting: staleness on arrival counts from it

    def arrive(self, group: ScoredGroup, not_trained: str | None = None) -> None:
        """A group reached the queue (admitted by the registry, before any filter or rejection);
        `not_trained`: the reason it will not be trained, known on arrival (`settle`)."""
        self.arrived += 1
        self.sampled_points.add(group_key(group), group_point(group))
        self.sampled_staleness.add(max(0, self.version - group.version_min))
        if not_trained is not None:
            self.settle(not_trained)

    def settle(self, reason: str, count: int = 1) -> None:
        """`count` groups that arrived will not be trained, for `reason` (one of SETTLED_REASONS)."""
        self.not_trained[reason] += count

    def taking(self, learner_version: int) -> None:
        """The learner asks for a step's groups at `learner_version` (it is at that version from now on)."""
        self.version = max(self.version, learner_version)

    def train(self, groups: Iterable[ScoredGroup], learner_version: int) -> None:
        """The groups a learner step at `learner_version` took."""
        self.taking(learner_version)
        for group in groups:
            self.trained += 1
            self.trained_points.add(group_key(group), group_point(group))
            self.trained_staleness.add(learner_version - group.version_min)

    def stats(self, queued: Iterable[ScoredGroup], lost: int, given_back: int) -> dict[str, float]:
        """audit/* of the run so far: `queued` the groups in the queue now, `lost` and `given_back`
        the groups that never arrived (the module's docstring says whose counts)."""
        queued = list(queued)
        sampled = self.sampled_points.rows(leave_out=[group_key(g) for g in queued])
        trained = self.trained_points.rows()
        stats: dict[str, float] = {
            "audit/sampled": self.arrived + lost + given_back,
            "audit/trained": self.trained,
            "audit/queued": len(queued),
            **{f"audit/not_trained/{reason}": count for reason, count in self.not_trained.items()},
            "audit/not_trained/lost": lost,
            "audit/not_trained/given_back": given_back,
            "audit/sampled_staleness_mean": self.sampled_staleness.mean(),
            "audit/sampled_staleness_max": self.sampled_staleness.max,
            "audit/trained_staleness_mean": self.trained_staleness.mean(),
            "audit/trained_staleness_max": self.trained_staleness.max,
        }
        for side, points in (("sampled", sampled), ("trained", trained)):
            if len(points):
                stats.update({f"audit/{side}_length_p{q}": v for q, v in zip(QUANTILES, percentiles(points[:, 0]))})
                stats[f"audit/{side}_reward_mean"] = float(points[:, 1].mean())
        if len(sampled) and len(trained):
            stats["audit/ks_length"] = ks_distance(sampled[:, 0], trained[:, 0])
            stats["audit/ks_reward"] = ks_distance(sampled[:, 1], trained[:, 1])
        return stats


class NoAudit:
    """The audit of a queue that keeps none (in-process tests, benchmarks): told everything, logs nothing."""

    def arrive(self, group: ScoredGroup, not_trained: str | None = None) -> None:
        pass

    def settle(self, reason: str, count: int = 1) -> None:
        pass

    def taking(self, learner_version: int) -> None:
        pass

    def train(self, groups: Iterable[ScoredGroup], learner_version: int) -> None:
        pass

    def stats(self, queued: Iterable[ScoredGroup], lost: int, given_back: int) -> dict[str, float]:
        return {}


def not_trained_total(stats: dict[str, float]) -> float:
    """The groups not trained, every reason."""
    return sum(stats.get(f"audit/not_trained/{reason}", 0) for reason in REASONS)


def departure(stats: dict[str, float], max_ks: float, min_groups: int) -> str | None:
    """One line when the trained distribution departs from the sampled one: which quantity, by how
    much (its KS distance against `max_ks`, log.audit_max_ks, and the two sides' centres); None
    when neither does, or fewer than `min_groups` (log.audit_min_groups) groups were trained."""
    if stats.get("audit/trained", 0) < min_groups:
        return None
    parts = []
    for name, ks_key, centre in (("group mean completion length", "audit/ks_length", "length_p50"),
                                 ("group mean reward", "audit/ks_reward", "reward_mean")):
        ks = stats.get(ks_key)
        if ks is not None and ks > max_ks:
            parts.append(f"{name} (KS distance {ks:.3f} > log.audit_max_ks={max_ks:g}; "
                         f"{centre} trained {stats.get('audit/trained_' + centre, float('nan')):.3f}, "
                         f"sampled {stats.get('audit/sampled_' + centre, float('nan')):.3f})")
    if not parts:
        return None
    return "trained distribution departs from the sampled one: " + "; ".join(parts)
