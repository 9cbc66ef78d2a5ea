"""Bounded replay queue between the ZeroMQ stream and the learner.

A background thread owns the PULL socket: it decodes messages, keeps control messages
(acknowledgements, heartbeats) as per-generator state, and appends groups to a bounded buffer.
When the buffer is full it either stops reading (`full_policy="block"`: ZeroMQ's high-water marks
then block the generators) or evicts the oldest group (`"drop_oldest"`).

Every group that arrives is accounted for exactly once:
    received == consumed + dropped_stale + dropped_full + depth
and gaps in a generator's sequence numbers are counted as `lost`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from asyncgrpo.wire import Heartbeat, Receiver, ScoredGroup, VersionAck


class QueueTimeout(TimeoutError):
    pass


@dataclass
class GeneratorState:
    next_seq: int = 0
    acked_version: int = -1
    last_seen: float = field(default_factory=time.monotonic)


class ReplayQueue:
    def __init__(
        self,
        receiver: Receiver,
        capacity_groups: int,
        max_staleness: int,
        drop_stale: bool = True,
        full_policy: str = "block",
        poll_interval_s: float = 0.05,
    ) -> None:
        if full_policy not in ("block", "drop_oldest"):
            raise ValueError(f"full_policy must be 'block' or 'drop_oldest', got {full_policy!r}")
        self.receiver = receiver
        self.capacity_groups = capacity_groups
        self.max_staleness = max_staleness
        self.drop_stale = drop_stale
        self.full_policy = full_policy
        self.poll_interval_s = poll_interval_s
        self.generators: dict[int, GeneratorState] = {}
        self.received = self.consumed = self.dropped_stale = self.dropped_full = self.lost = 0
        self.duplicates = 0
        self._buffer: deque[ScoredGroup] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="replay-receiver", daemon=True)
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------- producer side

    def start(self) -> "ReplayQueue":
        self._thread.start()
        return self

    def _receive_loop(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    while self._full() and self.full_policy == "block" and not self._stop.is_set():
                        self._cond.wait(self.poll_interval_s)
                message = self.receiver.recv(self.poll_interval_s)
                if message is not None:
                    self._accept(message)
        except BaseException as err:  # surfaced to the learner by take()
            self._error = err
            with self._cond:
                self._cond.notify_all()

    def _full(self) -> bool:
        return len(self._buffer) >= self.capacity_groups

    def put(self, message: ScoredGroup | VersionAck | Heartbeat) -> None:
        """Account for one message; used by the receiver thread and by in-process tests."""
        self._accept(message)

    def _accept(self, message: object) -> None:
        with self._cond:
            if isinstance(message, ScoredGroup):
                state = self.generators.setdefault(message.generator_id, GeneratorState())
                state.last_seen = time.monotonic()
                if message.seq < state.next_seq:
                    self.duplicates += 1  # the stream is ordered: an old sequence number is a replay
                    return
                self.lost += message.seq - state.next_seq
                state.next_seq = message.seq + 1
                self.received += 1
                if self._full():
                    self._buffer.popleft()
                    self.dropped_full += 1
                self._buffer.append(message)
                self._cond.notify_all()
            elif isinstance(message, VersionAck):
                state = self.generators.setdefault(message.generator_id, GeneratorState())
                state.acked_version = max(state.acked_version, message.version)
                state.last_seen = time.monotonic()
            elif isinstance(message, Heartbeat):
                state = self.generators.setdefault(message.generator_id, GeneratorState())
                state.last_seen = time.monotonic()
                # A heartbeat announces how many groups were sent: a gap at the tail is loss too.
                if message.next_seq > state.next_seq:
                    self.lost += message.next_seq - state.next_seq
                    state.next_seq = message.next_seq

    # ------------------------------------------------------------------------------- consumer side

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        """`num_groups` groups no more than `max_staleness` versions old, oldest first.

        Too-stale groups met on the way are dropped and counted (when `drop_stale`).
        Raises `QueueTimeout` if they do not arrive within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        batch: list[ScoredGroup] = []
        with self._cond:
            while len(batch) < num_groups:
                if self._error is not None:
                    raise RuntimeError("replay queue receiver thread failed") from self._error
                if self._buffer:
                    group = self._buffer.popleft()
                    self._cond.notify_all()
                    if self.drop_stale and learner_version - group.version_min > self.max_staleness:
                        self.dropped_stale += 1
                        continue
                    batch.append(group)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._buffer.extendleft(reversed(batch))  # put back: nothing is lost on timeout
                    raise QueueTimeout(
                        f"waited {timeout_s:.0f} s for {num_groups} groups, got {len(batch)}; "
                        f"generators last seen: {self._last_seen_summary()}; "
                        f"rejected messages: {dict(self.receiver.rejected) or 'none'}"
                    )
                self._cond.wait(min(remaining, self.poll_interval_s * 4))
            self.consumed += len(batch)
        return batch

    def _last_seen_summary(self) -> str:
        if not self.generators:
            return "none ever connected"
        now = time.monotonic()
        return ", ".join(f"gen {g}: {now - s.last_seen:.1f} s ago" for g, s in sorted(self.generators.items()))

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._buffer)

    def min_acked_version(self) -> int:
        with self._cond:
            return min((s.acked_version for s in self.generators.values()), default=-1)

    def stats(self) -> dict[str, float]:
        with self._cond:
            stats = {
                "queue/depth": len(self._buffer),
                "queue/received": self.received,
                "queue/consumed": self.consumed,
                "queue/dropped_stale": self.dropped_stale,
                "queue/dropped_full": self.dropped_full,
                "queue/lost": self.lost,
                "queue/duplicates": self.duplicates,
            }
        stats["wire/rejected"] = sum(self.receiver.rejected.values())
        return stats

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.receiver.close()
