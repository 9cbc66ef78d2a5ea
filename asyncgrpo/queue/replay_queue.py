"""Bounded replay queue between the ZeroMQ stream and the learner.

A background thread owns the PULL socket: it decodes messages, keeps control messages
(acknowledgements, heartbeats) as per-generator state, answers ticket requests, and files groups.
Which groups are too stale to train on is an `EvictionPolicy`.

Every group that enters is accounted for exactly once:
    received == consumed + dropped_stale + dropped_unheld + depth
Acknowledgements and heartbeats go to the `GeneratorRegistry`, which also checks each group's
sequence number: a group whose number its generator already used (or that a heartbeat declared
lost) does not enter and is counted under `duplicates`; gaps are `lost`; a message of a replaced
incarnation (a restarted generator's old process, arriving late) is `old_incarnation`.

A group that decodes but that the learner's model cannot train on (`GroupLimits`: an empty prompt,
a token id beyond the vocabulary, a sequence beyond the context, more samples than a prompt gets)
does not enter either: it is counted under `wire/rejected/<reason>` beside the messages the codec
rejects, and its sequence number counts as seen, not lost.

Tickets (`dispatcher`; asyncgrpo/queue/dispatch.py, kept by `TicketSlots` in asyncgrpo/queue/slots.py): a generator asks for tickets on the same stream as
its groups (`TicketRequest`, answered through `grants`); a group fills the slot its sender holds
for its prompt, and a take waits for the step's slots, in slot order. The dispatcher grants only
slots the queue can hold beside the next step's, so nothing here waits for room; a group whose slot
is no longer its sender's (lost, then granted again; a replaced process) is counted under
`dropped_unheld`. A dead generator's slots are granted again at once (`generator_down`), and
nothing is lent or dropped at a rejoin: the restarted process just asks.

Without a dispatcher (in-process tests, tools/bench_wire.py) the queue takes groups in arrival
order, whoever sent them; while it is full the receiving thread stops reading, so the senders'
ZeroMQ high-water marks fill and their sends block (docs/WIRE.md).

The queue is one of the learner's `GroupSource`s (asyncgrpo/queue/sources.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from asyncgrpo.contract import trainable
from asyncgrpo.queue.audit import NoAudit, TrainAudit
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.queue.filtering import SignalFilter
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.slots import TicketSlots
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import (
    GrantRouter,
    Heartbeat,
    Receiver,
    Rejections,
    ScoredGroup,
    TicketRequest,
    VersionAck,
)



class QueueFull(TimeoutError):
    """`put` found a queue without a dispatcher full and no room came in time."""


class EvictionPolicy(Protocol):
    """Which groups the queue discards. The queue counts every discard; a policy only decides."""

    def too_stale(self, group: ScoredGroup, learner_version: int) -> bool:
        """True: drop `group` instead of handing it to a learner at `learner_version`."""
        ...


@dataclass(frozen=True)
class StalenessEviction:
    """The built-in policy: drop groups over `max_staleness` versions old at take time (when
    `drop_stale`)."""

    max_staleness: int
    drop_stale: bool

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def too_stale(self, group: ScoredGroup, learner_version: int) -> bool:
        return self.drop_stale and not trainable(group.version_min, learner_version, self.max_staleness)


@dataclass(frozen=True)
class GroupLimits:
    """What the learner's model can train on, beyond what the codec checks (which knows no model).

    Each limit guards against a crash or an unbounded allocation in the learner: the embedding and
    the logits gather index by token id (out of range: an index error on CPU, a device-side assert
    that kills the CUDA context on GPU); the logits that predict the first completion token sit at
    position prompt_len - 1, which an empty prompt does not have; and collate pads every sample of
    a step to the longest sequence, so one oversized sequence or group sizes the whole step, which
    the memory estimate (preflight) bounds by groups_per_step x samples_per_prompt x max_positions.
    """

    vocab_size: int  # rows of the model's embedding and LM head: token ids must be below it
    max_positions: int  # model.max_positions: the generators' context, prompt + completion
    max_samples: int  # rollout.samples_per_prompt: a generator sends exactly this many per group

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.max_positions, self.max_samples) < 1:
            raise ValueError(f"every limit must be >= 1, got {self}")

    def untrainable(self, group: ScoredGroup) -> tuple[str, str] | None:
        """(reason, detail) if the learner cannot train on `group`, else None.

        Fewer samples than `max_samples` pass: advantages are computed per group of any size (a
        group of one gets advantage 0, see docs/ALGORITHMS.md), and so do completions of zero
        tokens: they add nothing to the loss, whose denominators are at least 1.
        """
        if group.prompt_tokens.size == 0:
            return "empty_prompt", "the first completion token has no position to be predicted from"
        if group.num_samples > self.max_samples:
            return "too_many_samples", f"{group.num_samples} samples > rollout.samples_per_prompt={self.max_samples}"
        longest = group.prompt_tokens.size + int(group.lengths.max())
        if longest > self.max_positions:
            return "too_long", f"prompt + completion of {longest} tokens > model.max_positions={self.max_positions}"
        # The codec guarantees ids >= 0; only the upper end needs the model.
        highest = max(int(np.maximum.reduce(ids)) for ids in (group.prompt_tokens, group.tokens) if ids.size)
        if highest >= self.vocab_size:
            return "token_out_of_vocab", f"token id {highest} >= vocabulary size {self.vocab_size}"
        return None


@dataclass
class QueueCounters:
    """The terms of the accounting identity (above), beside the deepest the queue has been."""

    received: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    dropped_unheld: int = 0
    peak_depth: int = 0
    # Outside the identity, like rejected groups: dropped on arrival for all-equal rewards (algo.filter_groups).
    filtered: int = 0

    def stats(self, depth: int, capacity_groups: int) -> dict[str, float]:
        return {
            "queue/depth": depth,
            "queue/peak_depth": self.peak_depth,
            "queue/capacity": capacity_groups,
            "queue/received": self.received,
            "queue/consumed": self.consumed,
            "queue/dropped_stale": self.dropped_stale,
            "queue/dropped_unheld": self.dropped_unheld,
            "queue/filtered": self.filtered,
        }


class ReplayQueue:
    """`receiver` may be None for a queue fed in-process through `put`; `registry` None makes a new one.

    `limits` None admits every group that decodes: for tests and benchmarks whose groups are made
    to be valid; a learner always passes its model's (no default, so none forgets to).
    `dispatcher` (a learner always has one): tickets, answered through `grants` (None: answers are
    dropped, as for a generator not connected; in-process tests); None: groups in arrival order,
    and no `grants`. `signal_filter` (algo.filter_groups; asyncgrpo/queue/filtering.py): a group it
    does not keep is dropped on arrival, counted, and its slot granted again with a new prompt;
    None: every group is kept. `audit`: audit/* (asyncgrpo/queue/audit.py); None: none (a learner's has one).
    """

    def __init__(
        self,
        receiver: Receiver | None,
        capacity_groups: int,
        policy: EvictionPolicy,
        *,
        limits: GroupLimits | None,
        registry: GeneratorRegistry | None = None,
        poll_interval_s: float = 0.05,
        dispatcher: Dispatcher | None = None,
        grants: GrantRouter | None = None,
        signal_filter: SignalFilter | None = None,
        audit: TrainAudit | None = None,
    ) -> None:
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if grants is not None and dispatcher is None:  # nothing would answer through it, or close it
            raise ValueError("a replay queue given grants without a dispatcher: grants answer the dispatcher's tickets")
        self.receiver = receiver
        self.capacity_groups = capacity_groups
        self.policy = policy
        self.limits = limits
        self.signal_filter = signal_filter
        self.audit = audit if audit is not None else NoAudit()
        # One count of rejected messages, whether the codec or the limits rejected them, and
        # whether they came from the socket or through put().
        self.rejected = receiver.rejected if receiver is not None else Rejections("put()")
        self.poll_interval_s = poll_interval_s
        self.registry = registry if registry is not None else GeneratorRegistry()
        self.counters_at_resume: dict[str, float] = {}
        self.counters = QueueCounters()
        # With tickets, groups wait in their slots; without, in `_buffer`, in arrival order.
        self.tickets = TicketSlots(dispatcher, grants) if dispatcher is not None else None
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
                # Wait for room before reading (no dispatcher), so messages stay in ZeroMQ's bounded
                # buffers and the generators' sends block.
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

        Without a dispatcher, waits up to `timeout_s` for room and raises `QueueFull` if none.
        A group outside the limits is counted under `wire/rejected/<reason>`, not raised.
        """
        if not self._put(message, deadline=time.monotonic() + timeout_s):
            raise QueueFull(f"the queue held {self.capacity_groups} groups for {timeout_s:.1f} s")

    def _put(self, message: object, deadline: float | None) -> bool:
        # Outside the lock: a pass over the tokens must not hold up the learner's take.
        problem = self.limits.untrainable(message) if self.limits and isinstance(message, ScoredGroup) else None
        no_signal = (problem is None and self.signal_filter is not None and isinstance(message, ScoredGroup)
                     and not self.signal_filter.keeps(message))
        with self._lock:
            if isinstance(message, ScoredGroup) and (problem is not None or no_signal):
                # Its sequence number was used, so it is not lost; a replay of it is still a duplicate.
                # It takes no room: it never waits for any.
                if self.registry.admit(message.generator_id, message.seq, message.incarnation):
                    self.audit.arrive(message, not_trained="rejected" if problem is not None else "filtered")
                    if problem is not None:
                        self.rejected.record_error(*problem)
                    else:
                        self.counters.filtered += 1
                    if self.tickets is not None:
                        self.tickets.release(message)
            elif isinstance(message, ScoredGroup):
                if not self._wait_for_room(deadline):
                    return False
                self._admit(message)
            elif isinstance(message, VersionAck):
                self.registry.on_ack(message)
            elif isinstance(message, Heartbeat):
                self.registry.on_heartbeat(message)
            elif isinstance(message, TicketRequest):
                if self.tickets is None:
                    self.rejected.record_error("unexpected_type", "a ticket request to a queue without a dispatcher")
                else:
                    self.tickets.answer(message)
            else:
                raise TypeError(f"the replay queue takes groups, acks, heartbeats and ticket requests, "
                                f"not {type(message).__name__}")
        return True

    def _wait_for_room(self, deadline: float | None) -> bool:
        """With the lock held: True once a group may be admitted; False at `deadline` or on stop.
        With tickets always: the dispatcher grants no slot the buffer could not hold."""
        while self.tickets is None and len(self._buffer) >= self.capacity_groups:
            if self._stop.is_set():
                return False
            wait_s = self.poll_interval_s if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                return False
            self._room_made.wait(min(wait_s, self.poll_interval_s))
        return True

    def _admit(self, group: ScoredGroup) -> None:
        """With the lock held: file the group, in its slot or at the end of the buffer."""
        if not self.registry.admit(group.generator_id, group.seq, group.incarnation):
            return  # the stream is ordered: an old sequence number is a replay; or a replaced process's
        self.counters.received += 1
        self.audit.arrive(group)
        if self.tickets is None:
            self._buffer.append(group)
        elif not self.tickets.fill(group):
            self.counters.dropped_unheld += 1
            self.audit.settle("unheld", 1)
            return
        self.counters.peak_depth = max(self.counters.peak_depth, self._depth())
        # With tickets any arrival may complete the step; without, a take waits for its count.
        if self._waiting_takers and (self.tickets is not None or len(self._buffer) >= min(self._waiting_takers)):
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
            self.audit.taking(learner_version)
            while True:
                if self._error is not None:
                    raise RuntimeError("replay queue receiver thread failed") from self._error
                batch = self._take_ready(num_groups, learner_version)
                if batch is not None:
                    self.counters.consumed += num_groups
                    self.audit.train(batch, learner_version)
                    return batch
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeout(self._timeout_message(num_groups, learner_version, timeout_s))
                self._waiting_takers.append(num_groups)
                try:
                    self._groups_ready.wait(remaining)
                finally:
                    self._waiting_takers.remove(num_groups)

    def _take_ready(self, num_groups: int, learner_version: int) -> list[ScoredGroup] | None:
        """With the lock held: the groups, if they are in (tickets: the step's slots, in slot order;
        else the oldest fresh ones); None if not yet. Too-stale groups met are dropped and counted."""
        if self.tickets is not None:
            batch, dropped = self.tickets.take_step(num_groups, learner_version, self.policy.too_stale)
            self.counters.dropped_stale += dropped
            self.audit.settle("dropped_stale", dropped)
            return batch
        return self._pop_fresh(num_groups, learner_version) if len(self._buffer) >= num_groups else None

    def _pop_fresh(self, num_groups: int, learner_version: int) -> list[ScoredGroup] | None:
        """With the lock held, no dispatcher: pop `num_groups` fresh groups in arrival order,
        dropping stale ones on the way; None if the buffer does not hold them yet (the fresh ones
        stay, in order)."""
        batch: list[ScoredGroup] = []
        kept: deque[ScoredGroup] = deque()
        for group in self._buffer:
            if self.policy.too_stale(group, learner_version):
                self.counters.dropped_stale += 1
                self.audit.settle("dropped_stale", 1)
            elif len(batch) < num_groups:
                batch.append(group)
            else:
                kept.append(group)
        self._room_made.notify_all()
        if len(batch) < num_groups:
            self._buffer = deque(batch)
            return None
        self._buffer = kept
        return batch

    # ------------------------------------------------------------------------------- restarts

    def generator_down(self, generator_id: int) -> None:
        """Generator `generator_id`'s process died and a restart is under way: its slots not arrived
        go to the next asker, and its late requests get none."""
        incarnation = self.registry.mark_down(generator_id)
        with self._lock:
            if self.tickets is not None:
                self.tickets.generator_down(generator_id, incarnation)

    def set_admission_bound(self, bound: int) -> None:
        """The dispatcher's bound for new grants (divergence control); without one, nothing is granted."""
        with self._lock:
            if self.tickets is not None:
                self.tickets.set_admission_bound(bound)

    def rejoin(self, generator_id: int, incarnation: int) -> None:
        """Incarnation `incarnation` of the generator is up: the registry follows it. Its
        predecessor's queued groups keep their slots, and it asks for more like any generator."""
        self.registry.rejoin(generator_id, incarnation)

    def _timeout_message(self, num_groups: int, learner_version: int, timeout_s: float) -> str:
        rejected = self.rejected.counts()
        return (
            f"waited {timeout_s:.0f} s for {num_groups} groups at learner version {learner_version}, "
            f"the queue holds {self._depth()} (capacity {self.capacity_groups}); "
            + (self.tickets.waiting_for() if self.tickets is not None else "")
            + f"generators last seen: {self.registry.last_seen()}; lost in transit: {self.registry.lost}; "
            f"rejected messages: {rejected or 'none'}"
            + (f"; {self.counters.filtered} groups dropped for all-equal rewards (algo.filter_groups=true): on a "
               "task where no group's rewards differ (every prompt solved, or none) no step can fill"
               if self.counters.filtered else "")
        )

    def _depth(self) -> int:
        return self.tickets.depth if self.tickets is not None else len(self._buffer)

    @property
    def depth(self) -> int:
        with self._lock:
            return self._depth()

    def stats(self) -> dict[str, float]:
        with self._lock:
            stats = {**self.counters.stats(self._depth(), self.capacity_groups), **self.registry.stats()}
            if self.tickets is not None:
                stats.update(self.tickets.stats())
            queued, lost = (self.tickets.filled.values(), self.tickets.dispatcher.counts["lost"]) if self.tickets \
                else (self._buffer, self.registry.lost)  # lost without tickets: sequence gaps
            stats.update(self.audit.stats(queued, lost, int(self.registry.reported_total("groups_dropped"))))
        rejected = self.rejected.counts()
        stats["wire/rejected"] = sum(rejected.values())
        stats.update({f"wire/rejected/{reason}": count for reason, count in sorted(rejected.items())})
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The counters, for the record, and the dispatcher's state: groups in the buffer are not
        saved (the dispatcher gives their prompts again first); a resumed run's queue counts from
        the resume."""
        state: dict[str, Any] = {"counters": self.stats()}
        if self.tickets is not None:
            with self._lock:
                state["dispatch"] = self.tickets.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters_at_resume = dict(state.get("counters", {}))
        if self.tickets is not None:
            if "dispatch" not in state:
                raise ValueError("the checkpoint was written under the shares dispatch, which was removed: "
                                 "tickets is the only dispatch, and it cannot continue a shares checkpoint")
            with self._lock:
                self.tickets.load_state_dict(state["dispatch"])

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._room_made.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.receiver is not None:
            self.receiver.close()
        if self.tickets is not None:
            self.tickets.close()
