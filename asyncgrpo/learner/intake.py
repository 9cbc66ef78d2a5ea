"""Learner rank 0's side of the group stream: before a step, wait for engines that lag too far
behind (`wait_for_generators`), take the step's groups from the `GroupSource`, and meanwhile keep
publishing the newest weights to restarted generators until they load them (`Rejoins`).

`GroupIntake` is what `Learner.step` calls for its `ack_wait` and `gen_wait` phases
(asyncgrpo/learner/learner.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from asyncgrpo.contract import ack_floor, engine_lag_bound
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.sources import GroupSource, QueueTimeout
from asyncgrpo.schema import Config
from asyncgrpo.weights import Publication
from asyncgrpo.weights.base import WeightSender
from asyncgrpo.wire import ScoredGroup

# While a restarted generator has not loaded the newest weights, they are published again this often.
REPUBLISH_EVERY_S = 2.0


# What the wait's bound is called in its timeout message: the settings it comes from.
LAG_BOUND_NAME = "engine_lag_bound(weights.max_backlog_versions, train.max_staleness)"


def wait_for_generators(registry: GeneratorRegistry, source: GroupSource, generator_ids: range, version: int,
                        lag_bound: int, groups_per_step: int, timeout_s: float,
                        on_wait: Callable[[], None] | None = None) -> bool:
    """Hold the update at learner `version` until every generator has loaded a version no more
    than `lag_bound` (`contract.engine_lag_bound`) behind it (`contract.ack_floor`); True if it waited.

    The grants keep a generator's *groups* fresh; this keeps a stalled *engine* from piling up the
    versions it has not loaded (`GroupIntake.wait_for_generators`). A generator
    that is down is not waited for (the registry leaves it out), and while one restarts, or has
    just rejoined, the wait does not time out (`GeneratorRegistry.restart_grace_until`). `on_wait`
    runs at every look (the learner re-publishes weights for a rejoined generator there).
    """
    floor = ack_floor(version, lag_bound)
    if floor <= 0:
        return False
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        registry.check_reports()
        if on_wait is not None:
            on_wait()
        lagging = {g: v for g, v in registry.acked_versions(generator_ids).items() if v < floor}
        # A full step already queued means this step waits on nobody; and a generator blocked on a
        # full socket cannot deliver its acknowledgement until the learner takes (they share the
        # socket). What is trained stays bounded by the grants and the drop at take.
        if not lagging or source.depth >= groups_per_step:
            return waited
        waited = True
        deadline = max(deadline, registry.restart_grace_until(timeout_s))
        if time.monotonic() > deadline:
            raise TimeoutError(f"learner at version {version} waited {timeout_s:.0f} s for generators "
                               f"to load version >= {floor} "
                               f"({LAG_BOUND_NAME}={lag_bound}); acknowledged versions: {lagging}")
        time.sleep(0.0005)


class Rejoins:
    """Restarted generators that have not acknowledged the newest weights yet. The driver's thread
    adds them (`Learner.generator_rejoined`); the step's thread serves them (a ZeroMQ socket belongs
    to one thread), so the table is locked."""

    def __init__(self, registry: GeneratorRegistry | None, weights: WeightSender | None) -> None:
        self.registry, self.weights = registry, weights
        self.awaiting: dict[int, int] = {}  # generator -> the version it must load
        self.next_republish = 0.0  # time.monotonic() of the next publication again
        self.delta_repairs = 0  # weights.delta: generators that missed a delta and were sent a full push
        self._lock = threading.Lock()

    def add(self, generator_id: int, version: int) -> None:
        with self._lock:
            self.awaiting[generator_id] = version
            self.next_republish = 0.0

    def serve(self) -> None:
        """On the step's thread: publish the newest weights again while a rejoined generator has
        not acknowledged them (its subscription may have come up after any one publication)."""
        if self.weights is None or self.registry is None:
            return
        # weights.delta: a generator that missed a delta waits, like a rejoined one, for a full push
        # (republish sends one) of a version newer than the one it holds.
        for generator_id, held in self.registry.take_full_push_requests().items():
            self.delta_repairs += 1
            self.add(generator_id, max(held + 1, self.awaiting.get(generator_id, -1)))
        if not self.awaiting:
            return
        with self._lock:
            acked = self.registry.acked_versions(list(self.awaiting))
            # A generator left out of `acked` is down again: its next rejoin asks anew.
            self.awaiting = {g: v for g, v in self.awaiting.items() if acked.get(g, v) < v}
            if not self.awaiting or time.monotonic() < self.next_republish:
                return
            self.next_republish = time.monotonic() + REPUBLISH_EVERY_S
        self.weights.republish()


class GroupIntake:
    """Rank 0: where each step's groups come from. `registry` None (an offline learner on a list or
    a recording): no generators to wait for or hear from."""

    def __init__(self, cfg: Config, source: GroupSource, registry: GeneratorRegistry | None,
                 weights: WeightSender | None, *, publication: Publication, num_generators: int,
                 timeout_s: float) -> None:
        """`num_generators` (rollout.num_generators) are waited for and heard from; `timeout_s`
        (wire.timeout_s) bounds each wait."""
        self.cfg, self.source, self.registry = cfg, source, registry
        self.publication, self.generators, self.timeout_s = publication, range(num_generators), timeout_s
        self.rejoins = Rejoins(registry, weights)

    def wait_for_generators(self, version: int) -> bool:
        """The `ack_wait` phase of the step at `version`; True if it waited."""
        # Each grant carries the bound (a slot only for weights fresh enough to train
        # it in time): an engine that lags gets no slots until it loads newer weights, and waiting
        # for it at max_staleness would hold every step back to the slowest generator again. It is
        # waited for only when it falls weights.max_backlog_versions (at least max_staleness + 1)
        # behind, stalled: every version it has not loaded waits in its receive buffer.
        if self.registry is None:
            return False
        t, backlog = self.cfg.train, self.publication.max_backlog_versions
        return wait_for_generators(self.registry, self.source, self.generators, version,
                                   engine_lag_bound(t.max_staleness, backlog), t.groups_per_step,
                                   self.timeout_s, on_wait=self.rejoins.serve)

    def take(self, version: int) -> list[ScoredGroup]:
        """The `gen_wait` phase: the step's groups; while waiting, a report that ends the run
        (rejected weights, a reward outage) ends the wait."""
        n, timeout_s = self.cfg.train.groups_per_step, self.timeout_s
        if self.registry is None:
            return self.source.take(n, version, timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            self.registry.check_reports()
            self.rejoins.serve()
            # A generator being restarted sends nothing: vLLM's start may take longer than timeout_s.
            deadline = max(deadline, self.registry.restart_grace_until(timeout_s))
            remaining = deadline - time.monotonic()
            try:
                # Slices of a second at most, so a report that ends the run is heard within one.
                return self.source.take(n, version, min(1.0, max(0.0, remaining)))
            except QueueTimeout as err:
                if remaining <= 1.0:
                    raise QueueTimeout(f"no full step within wire.timeout_s={timeout_s:.0f} s; last {err}") from None

    def generator_metrics(self, pushed_version: int) -> dict[str, float]:
        """What the generators reported; a generator that rejected weights ends the run, since it
        would never load another version, and so do reward errors beyond reward.max_error_rate."""
        if self.registry is None:
            return {}
        self.registry.check_reports()
        acked = self.registry.acked_versions(self.generators)
        return {**self.registry.report_increments(), "weights/rejected": 0.0,
                # Versions pushed that the slowest generator has not loaded yet (bounded by the ack wait);
                # under train.fixed_staleness=k the published version is k behind the learner's.
                "weights/backlog": float(pushed_version - min(acked.values(), default=pushed_version)),
                "weights/published_version": float(pushed_version),
                **({"weights/delta_repairs": float(self.rejoins.delta_repairs)} if self.publication.delta else {})}
