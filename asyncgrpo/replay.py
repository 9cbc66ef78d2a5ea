"""Bounded replay queue between the ZeroMQ stream and the learner.

A background thread owns the PULL socket: it decodes messages, keeps control messages
(acknowledgements, heartbeats) as per-generator state, and appends groups to a buffer of at most
`capacity_groups`. What happens to a full buffer, and which groups are too stale to train on, is
an `EvictionPolicy`. While the policy blocks, the thread stops reading: the receiver's and the
senders' ZeroMQ high-water marks then fill and the generators' sends block, so memory stays
bounded whatever the producer rate (see docs/WIRE.md for the bound).

Every group that enters is accounted for exactly once:
    received == consumed + dropped_stale + dropped_full + depth
A group whose sequence number its generator already used (or that a heartbeat declared lost) does
not enter; it is counted under `duplicates`. Gaps in a generator's sequence numbers are `lost`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from asyncgrpo.wire import Heartbeat, Receiver, ScoredGroup, VersionAck

log = logging.getLogger(__name__)

FULL_POLICIES = ("block", "drop_oldest")


class QueueTimeout(TimeoutError):
    """`take` did not get its groups in time."""


class QueueFull(TimeoutError):
    """`put` found the queue full under a blocking policy and no room came in time."""


class EvictionPolicy(Protocol):
    """Which groups the queue discards. The queue counts every discard; a policy only decides."""

    def too_stale(self, group: ScoredGroup, learner_version: int) -> bool:
        """True: drop `group` instead of handing it to a learner at `learner_version`."""
        ...

    def victim_when_full(self, buffer: Sequence[ScoredGroup]) -> int | None:
        """Index in `buffer` (oldest first) of the group to drop to admit a new one; None: block."""
        ...


@dataclass(frozen=True)
class StalenessEviction:
    """The built-in policy: drop groups over `max_staleness` versions old at take time (when
    `drop_stale`), and when full either block the producers or drop the oldest group."""

    max_staleness: int
    drop_stale: bool = True
    full_policy: str = "block"

    def __post_init__(self) -> None:
        if self.full_policy not in FULL_POLICIES:
            raise ValueError(f"full_policy must be one of {FULL_POLICIES}, got {self.full_policy!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def too_stale(self, group: ScoredGroup, learner_version: int) -> bool:
        return self.drop_stale and learner_version - group.version_min > self.max_staleness

    def victim_when_full(self, buffer: Sequence[ScoredGroup]) -> int | None:
        return 0 if self.full_policy == "drop_oldest" else None


@dataclass
class GeneratorState:
    next_seq: int = 0
    acked_version: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    reported_loss: bool = False


class ReplayQueue:
    """Give either `max_staleness` (with `drop_stale` and `full_policy`) or a custom `policy`.

    `receiver` may be None for a queue fed in-process through `put`.
    """

    def __init__(
        self,
        receiver: Receiver | None,
        capacity_groups: int,
        max_staleness: int | None = None,
        drop_stale: bool = True,
        full_policy: str = "block",
        poll_interval_s: float = 0.05,
        *,
        policy: EvictionPolicy | None = None,
    ) -> None:
        if (max_staleness is None) == (policy is None):
            raise TypeError("give exactly one of max_staleness and policy")
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        self.receiver = receiver
        self.capacity_groups = capacity_groups
        self.policy: EvictionPolicy = (
            policy if policy is not None else StalenessEviction(max_staleness, drop_stale, full_policy)
        )
        self.poll_interval_s = poll_interval_s
        self.generators: dict[int, GeneratorState] = {}
        self.received = self.consumed = self.dropped_stale = self.dropped_full = 0
        self.lost = self.duplicates = self.peak_depth = 0
        self._buffer: deque[ScoredGroup] = deque()
        self._lock = threading.Lock()
        # Two conditions on one lock, so a producer waiting for room and a taker waiting for groups
        # wake only for what they wait for.
        self._groups_ready = threading.Condition(self._lock)
        self._room_made = threading.Condition(self._lock)
        self._waiting_takers: list[int] = []  # batch sizes of the takes now waiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="replay-receiver", daemon=True)
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------- producer side

    def start(self) -> ReplayQueue:
        if self.receiver is None:
            raise RuntimeError("a queue without a receiver is fed only through put()")
        self._thread.start()
        return self

    def _receive_loop(self) -> None:
        assert self.receiver is not None
        try:
            while not self._stop.is_set():
                # Wait for room before reading, so a blocking policy leaves messages in ZeroMQ's
                # bounded buffers and the generators' sends block.
                with self._lock:
                    if not self._wait_for_room(time.monotonic() + self.poll_interval_s):
                        continue
                message = self.receiver.recv(self.poll_interval_s)
                if message is not None and not self._put(message, deadline=None):
                    return  # stopped while waiting for room
        except BaseException as err:  # surfaced to the learner by take()
            with self._lock:
                self._error = err
                self._groups_ready.notify_all()

    def put(self, message: ScoredGroup | VersionAck | Heartbeat, timeout_s: float = 0.0) -> None:
        """Account for one message as if it had arrived on the socket (the receiver thread's path).

        Under a blocking policy, waits up to `timeout_s` for room and raises `QueueFull` if none.
        """
        if not self._put(message, deadline=time.monotonic() + timeout_s):
            raise QueueFull(f"the queue held {self.capacity_groups} groups for {timeout_s:.1f} s")

    def _put(self, message: object, deadline: float | None) -> bool:
        with self._lock:
            if isinstance(message, ScoredGroup):
                if not self._wait_for_room(deadline):
                    return False
                self._admit(message)
            elif isinstance(message, VersionAck):
                state = self._seen(message.generator_id)
                state.acked_version = max(state.acked_version, message.version)
            elif isinstance(message, Heartbeat):
                state = self._seen(message.generator_id)
                # A heartbeat announces how many groups were sent: a gap at the tail is loss too.
                self._skip_to(message.generator_id, state, message.next_seq)
                # It also names the loaded version: an acknowledgement that found the socket full
                # (and was dropped) is made good by the next heartbeat.
                state.acked_version = max(state.acked_version, message.version)
            else:
                raise TypeError(f"the replay queue takes groups, acks and heartbeats, not {type(message).__name__}")
        return True

    def _wait_for_room(self, deadline: float | None) -> bool:
        """With the lock held: True once a group may be admitted; False at `deadline` or on stop."""
        while len(self._buffer) >= self.capacity_groups and self.policy.victim_when_full(self._buffer) is None:
            if self._stop.is_set():
                return False
            wait_s = self.poll_interval_s if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                return False
            self._room_made.wait(min(wait_s, self.poll_interval_s))
        return True

    def _seen(self, generator_id: int) -> GeneratorState:
        state = self.generators.setdefault(generator_id, GeneratorState())
        state.last_seen = time.monotonic()
        return state

    def _skip_to(self, generator_id: int, state: GeneratorState, next_seq: int) -> None:
        missing = next_seq - state.next_seq
        if missing <= 0:
            return
        self.lost += missing
        if not state.reported_loss:
            state.reported_loss = True
            log.warning("generator %d: %d group(s) lost in transit before sequence number %d; "
                        "later losses are only counted under queue/lost", generator_id, missing, next_seq)
        state.next_seq = next_seq

    def _admit(self, group: ScoredGroup) -> None:
        state = self._seen(group.generator_id)
        if group.seq < state.next_seq:
            self.duplicates += 1  # the stream is ordered: an old sequence number is a replay
            return
        self._skip_to(group.generator_id, state, group.seq)
        state.next_seq = group.seq + 1
        self.received += 1
        if len(self._buffer) >= self.capacity_groups:
            victim = self.policy.victim_when_full(self._buffer)
            assert victim is not None, "_wait_for_room made room"
            del self._buffer[victim]
            self.dropped_full += 1
        self._buffer.append(group)
        self.peak_depth = max(self.peak_depth, len(self._buffer))
        if self._waiting_takers and len(self._buffer) >= min(self._waiting_takers):
            self._groups_ready.notify_all()

    # ------------------------------------------------------------------------------- consumer side

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        """`num_groups` groups the policy does not find too stale, oldest first.

        Too-stale groups met on the way are dropped and counted. Raises `QueueTimeout` if the
        groups do not arrive within `timeout_s`; nothing is lost on timeout.
        """
        if not 1 <= num_groups <= self.capacity_groups:
            raise ValueError(f"num_groups must be between 1 and capacity_groups={self.capacity_groups}, "
                             f"got {num_groups}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._error is not None:
                    raise RuntimeError("replay queue receiver thread failed") from self._error
                if len(self._buffer) >= num_groups:
                    batch = self._pop_fresh(num_groups, learner_version)
                    if batch is not None:
                        return batch
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeout(self._timeout_message(num_groups, learner_version, timeout_s))
                self._waiting_takers.append(num_groups)
                try:
                    self._groups_ready.wait(remaining)
                finally:
                    self._waiting_takers.remove(num_groups)

    def _pop_fresh(self, num_groups: int, learner_version: int) -> list[ScoredGroup] | None:
        """With the lock held: pop `num_groups` fresh groups, dropping stale ones on the way, or,
        if the buffer runs out first, put the fresh ones back and return None."""
        batch: list[ScoredGroup] = []
        while self._buffer and len(batch) < num_groups:
            group = self._buffer.popleft()
            if self.policy.too_stale(group, learner_version):
                self.dropped_stale += 1
            else:
                batch.append(group)
        self._room_made.notify_all()
        if len(batch) < num_groups:
            self._buffer.extendleft(reversed(batch))
            return None
        self.consumed += num_groups
        return batch

    def _timeout_message(self, num_groups: int, learner_version: int, timeout_s: float) -> str:
        if self.generators:
            now = time.monotonic()
            seen = ", ".join(f"gen {g}: {now - s.last_seen:.1f} s ago" for g, s in sorted(self.generators.items()))
        else:
            seen = "none ever connected"
        rejected = self.receiver.rejected.counts() if self.receiver is not None else {}
        return (
            f"waited {timeout_s:.0f} s for {num_groups} groups at learner version {learner_version}, "
            f"the queue holds {len(self._buffer)} (capacity {self.capacity_groups}); "
            f"generators last seen: {seen}; lost in transit: {self.lost}; "
            f"rejected messages: {rejected or 'none'}"
        )

    @property
    def depth(self) -> int:
        with self._lock:
            return len(self._buffer)

    def min_acked_version(self) -> int:
        with self._lock:
            return min((s.acked_version for s in self.generators.values()), default=-1)

    def acked_versions(self, generator_ids: Sequence[int]) -> dict[int, int]:
        """The newest weight version each generator acknowledged (-1: none yet)."""
        with self._lock:
            return {g: self.generators[g].acked_version if g in self.generators else -1 for g in generator_ids}

    def stats(self) -> dict[str, float]:
        with self._lock:
            stats: dict[str, float] = {
                "queue/depth": len(self._buffer),
                "queue/peak_depth": self.peak_depth,
                "queue/capacity": self.capacity_groups,
                "queue/received": self.received,
                "queue/consumed": self.consumed,
                "queue/dropped_stale": self.dropped_stale,
                "queue/dropped_full": self.dropped_full,
                "queue/lost": self.lost,
                "queue/duplicates": self.duplicates,
            }
        rejected = self.receiver.rejected.counts() if self.receiver is not None else {}
        stats["wire/rejected"] = sum(rejected.values())
        stats.update({f"wire/rejected/{reason}": count for reason, count in sorted(rejected.items())})
        return stats

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._room_made.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.receiver is not None:
            self.receiver.close()
