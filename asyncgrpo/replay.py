"""Bounded replay queue between the ZeroMQ stream and the learner.

A background thread owns the PULL socket: it decodes messages, keeps control messages
(acknowledgements, heartbeats) as per-generator state, and appends groups to a buffer of at most
`capacity_groups`. What happens to a full buffer, and which groups are too stale to train on, is
an `EvictionPolicy`. While the policy blocks, the thread stops reading: the receiver's and the
senders' ZeroMQ high-water marks then fill and the generators' sends block, so memory stays
bounded whatever the producer rate (see docs/WIRE.md for the bound).

Every group that enters is accounted for exactly once:
    received == consumed + dropped_stale + dropped_full + dropped_restart + dropped_unheld + depth
Acknowledgements and heartbeats go to the `GeneratorRegistry`, which also checks each group's
sequence number: a group whose number its generator already used (or that a heartbeat declared
lost) does not enter and is counted under `duplicates`; gaps are `lost`; a message of a replaced
incarnation (a restarted generator's old process, arriving late) is `old_incarnation`.

A group that decodes but that the learner's model cannot train on (`GroupLimits`: an empty prompt,
a token id beyond the vocabulary, a sequence beyond the context, more samples than a prompt gets)
does not enter either: it is counted under `wire/rejected/<reason>` beside the messages the codec
rejects, and its sequence number counts as seen, not lost.

Shares (under a throttling stale policy, `shares` from `config.groups_per_generator`): each step
takes exactly its share of groups from each generator, each generator's oldest first. Group k of a
generator with share q is then trained at learner version k // q exactly, whatever the relative
speeds of the generators, which is what the generators' throttle (`rollout.generator.throttle_limit`)
relies on to bound staleness; a faster generator's groups wait here for the slower one's. Taking
whatever arrived first instead would train a slow generator's groups later than k // q, beyond the bound.

Restarts (`generator_down`, `rejoin`; the driver says when, through the learner). While generator i
is down its share is filled by its own queued groups (while on schedule) and then lent by the
others: their next groups, consumed *earlier* than their k // q, which the bound allows. A lender
must still be able to deliver its own share at every later step, which its throttle allows only
`lend_steps` = max_staleness - push_every_steps + 1 steps ahead, so it lends at most that many
steps of its share; at the rejoin each lender is told what it lent (`Rejoin.leads`), its throttle
moves its count on by as much and it regains its lead. When i's next incarnation rejoins, i's groups
still queued are dropped (`dropped_restart`): it continues from the registry's consumption position,
so it generates them again, and every prompt is still trained once. From the next take on, at
version B (`Rejoin.base_version`), the queue takes i's share again; the newcomer counts its groups
from B x q_i, so its group k is again trained at k // q_i exactly.

Tickets (rollout.dispatch=tickets, `dispatcher`; asyncgrpo/dispatch.py): no shares. A generator asks
for tickets on the same stream as its groups (`TicketRequest`, answered through `grants`); a group
fills the slot its sender holds for its prompt, and a take waits for the step's slots, in slot order.
The dispatcher grants only slots the buffer can hold beside the next step's, so nothing here waits
for room; a group whose slot is no longer its sender's (lost, then granted again; a replaced process)
is counted under `dropped_unheld`. A dead generator's slots are granted again at once
(`generator_down`), and nothing is lent or dropped at a rejoin: the restarted process just asks.

The learner takes groups from a `GroupSource`: this queue, or a `ListSource` of fixed groups
(tests, offline benchmarks).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from asyncgrpo import faults
from asyncgrpo.dispatch import Dispatcher
from asyncgrpo.registry import GeneratorRegistry
from asyncgrpo.wire import (
    Grant,
    GrantRouter,
    Heartbeat,
    Receiver,
    Rejections,
    ScoredGroup,
    TicketRequest,
    VersionAck,
    holder_identity,
)

# queue.full_policy: block the producers, or drop the oldest group to admit a new one.
FULL_POLICIES = ("block", "drop_oldest")
# train.stale_policy: throttle = generators wait rather than run more than train.max_staleness
# versions ahead; drop = the queue drops groups that are too stale at take time; both.
STALE_POLICIES = ("throttle", "drop", "both")
THROTTLING_STALE_POLICIES = ("throttle", "both")
DROPPING_STALE_POLICIES = ("drop", "both")


@dataclass(frozen=True)
class Rejoin:
    """What a restarted generator needs to know (`ReplayQueue.rejoin`), and what its peers do."""

    position: int  # where its prompt stream continues: past the newest group consumed from it
    base_version: int  # the first learner version that takes its share again: it counts from base x share
    dropped: int  # its predecessor's groups dropped from the queue (generated again from `position`)
    leads: dict[int, int]  # lender -> every group it has lent so far: its throttle counts on by as much


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
    drop_stale: bool
    full_policy: str

    def __post_init__(self) -> None:
        if self.full_policy not in FULL_POLICIES:
            raise ValueError(f"full_policy must be one of {FULL_POLICIES}, got {self.full_policy!r}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def too_stale(self, group: ScoredGroup, learner_version: int) -> bool:
        return self.drop_stale and learner_version - group.version_min > self.max_staleness

    def victim_when_full(self, buffer: Sequence[ScoredGroup]) -> int | None:
        return 0 if self.full_policy == "drop_oldest" else None


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


class GroupSource(Protocol):
    """Where the learner takes its groups from."""

    @property
    def depth(self) -> int:
        """Groups ready to be taken."""

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        """`num_groups` groups fit to train on at `learner_version`, oldest first; raises
        `QueueTimeout` if they do not come within `timeout_s`."""

    def stats(self) -> dict[str, float]:
        """Counters for the step metrics (queue/*, wire/*)."""

    def close(self) -> None: ...


class ListSource:
    """A fixed list of groups, taken in order (tests and offline benchmarks)."""

    def __init__(self, groups: Sequence[ScoredGroup]) -> None:
        self._groups = deque(groups)
        self.consumed = 0

    @property
    def depth(self) -> int:
        return len(self._groups)

    def take(self, num_groups: int, learner_version: int, timeout_s: float) -> list[ScoredGroup]:
        if len(self._groups) < num_groups:
            raise QueueTimeout(f"the list holds {len(self._groups)} groups, {num_groups} asked for")
        self.consumed += num_groups
        return [self._groups.popleft() for _ in range(num_groups)]

    def stats(self) -> dict[str, float]:
        return {"queue/depth": len(self._groups), "queue/consumed": self.consumed}

    def close(self) -> None:
        pass


class ReplayQueue:
    """`receiver` may be None for a queue fed in-process through `put`; `registry` None makes a new one.

    `limits` None admits every group that decodes: for tests and benchmarks whose groups are made
    to be valid; a learner always passes its model's (no default, so none forgets to).
    """

    def __init__(
        self,
        receiver: Receiver | None,
        capacity_groups: int,
        policy: EvictionPolicy,
        *,
        limits: GroupLimits | None,
        shares: Sequence[int] | None,
        registry: GeneratorRegistry | None = None,
        poll_interval_s: float = 0.05,
        lend_steps: int = 0,
        dispatcher: Dispatcher | None = None,
        grants: GrantRouter | None = None,
    ) -> None:
        """`lend_steps`: how many steps of its share a generator may lend to a down one (module
        docstring; 0: none, the learner waits for the restart). `dispatcher` (with `shares` None):
        tickets instead of shares, answered through `grants` (None: answers are dropped, as for a
        generator not connected; in-process tests)."""
        if dispatcher is not None and shares is not None:
            raise ValueError("a queue takes either shares or tickets, not both")
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if shares is not None and (not shares or min(shares) < 0 or sum(shares) > capacity_groups):
            raise ValueError(f"shares must be >= 0 and sum to at most capacity_groups={capacity_groups}, got {shares}")
        # Groups per step from generator i (None: any generator, first come first served).
        self.shares = list(shares) if shares is not None else None
        self.receiver = receiver
        self.capacity_groups = capacity_groups
        self.policy = policy
        self.limits = limits
        # One count of rejected messages, whether the codec or the limits rejected them, and
        # whether they came from the socket or through put().
        self.rejected = receiver.rejected if receiver is not None else Rejections("put()")
        self.poll_interval_s = poll_interval_s
        self.registry = registry if registry is not None else GeneratorRegistry()
        self.counters_at_resume: dict[str, float] = {}
        self.received = self.consumed = self.dropped_stale = self.dropped_full = self.peak_depth = 0
        self.dropped_restart = self.dropped_unheld = 0
        self.dispatcher, self.grants = dispatcher, grants
        self._filled: dict[int, ScoredGroup] = {}  # tickets: slot -> its group, not taken yet
        self._ticketed_answers = 0  # tickets: answers carrying tickets, for failpoint grant_drop_every
        # Shares only: per generator, groups consumed beyond its shares over the steps (> 0: lent to a
        # down generator; < 0: a down generator's steps that came short), and how much of what it
        # lent its throttle has been told (`Rejoin.leads`).
        generators = len(self.shares) if self.shares is not None else 0
        self._ahead = [0] * generators
        self._told = [0] * generators
        self._lend_limit = [max(0, lend_steps) * q for q in self.shares or []]
        # The learner version of the take in progress, and of the last one returned (`next_take_version`).
        self._take_version: int | None = None
        self._last_take_version: int | None = None
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
        A group outside the limits is counted under `wire/rejected/<reason>`, not raised.
        """
        if not self._put(message, deadline=time.monotonic() + timeout_s):
            raise QueueFull(f"the queue held {self.capacity_groups} groups for {timeout_s:.1f} s")

    def _put(self, message: object, deadline: float | None) -> bool:
        # Outside the lock: a pass over the tokens must not hold up the learner's take.
        problem = self.limits.untrainable(message) if self.limits and isinstance(message, ScoredGroup) else None
        if problem is None and self.shares is not None and isinstance(message, ScoredGroup) \
                and not 0 <= message.generator_id < len(self.shares):
            # Nothing would ever take it: it would hold a place in the buffer for good.
            problem = ("unknown_generator", f"generator {message.generator_id} of {len(self.shares)}")
        with self._lock:
            if isinstance(message, ScoredGroup) and problem is not None:
                # Its sequence number was used, so it is not lost; a replay of it is still a duplicate.
                # It takes no room: it never waits for any.
                if self.registry.admit(message.generator_id, message.seq, message.incarnation):
                    self.rejected.record_error(*problem)
                    self.registry.write_off(message.generator_id, message.incarnation)
                    self._release_unfilled(message)
            elif isinstance(message, ScoredGroup):
                if not self._wait_for_room(deadline):
                    return False
                self._admit(message)
            elif isinstance(message, VersionAck):
                self.registry.on_ack(message)
            elif isinstance(message, Heartbeat):
                self.registry.on_heartbeat(message)
            elif isinstance(message, TicketRequest):
                self._answer(message)
            else:
                raise TypeError(f"the replay queue takes groups, acks, heartbeats and ticket requests, "
                                f"not {type(message).__name__}")
        return True

    def _wait_for_room(self, deadline: float | None) -> bool:
        """With the lock held: True once a group may be admitted; False at `deadline` or on stop.
        With tickets always: the dispatcher grants no slot the buffer could not hold."""
        while self.dispatcher is None and len(self._buffer) >= self.capacity_groups and self.policy.victim_when_full(self._buffer) is None:
            if self._stop.is_set():
                return False
            wait_s = self.poll_interval_s if deadline is None else deadline - time.monotonic()
            if wait_s <= 0:
                return False
            self._room_made.wait(min(wait_s, self.poll_interval_s))
        return True

    def _admit(self, group: ScoredGroup) -> None:
        if not self.registry.admit(group.generator_id, group.seq, group.incarnation):
            return  # the stream is ordered: an old sequence number is a replay; or a replaced process's
        self.received += 1
        if self.dispatcher is not None:
            self._fill(group)
            return
        if len(self._buffer) >= self.capacity_groups:
            victim = self.policy.victim_when_full(self._buffer)
            assert victim is not None, "_wait_for_room made room"
            dropped = self._buffer[victim]
            del self._buffer[victim]
            self.dropped_full += 1
            self.registry.write_off(dropped.generator_id, dropped.incarnation)
        self._buffer.append(group)
        self.peak_depth = max(self.peak_depth, len(self._buffer))
        if self._waiting_takers and len(self._buffer) >= min(self._waiting_takers):
            self._groups_ready.notify_all()

    # ------------------------------------------------------------------------------- tickets

    def _answer(self, request: TicketRequest) -> None:
        """With the lock held: a generator's ticket request (its report first), answered at once."""
        if self.dispatcher is None:
            self.rejected.record_error("unexpected_type", "a ticket request under rollout.dispatch=shares")
            return
        holder = (request.generator_id, request.incarnation)
        grant, tickets = self.dispatcher.request(holder, request.version, request.wanted, request.newest_grant,
                                                 request.unsent, request.given_back)
        if self.grants is not None and not (tickets and self._answer_lost()):
            # Not delivered (the process is gone): its next request, if any, reports it unreceived.
            self.grants.send_to(holder_identity(*holder), Grant(request.request, grant, [t.slot for t in tickets],
                                                                [t.position for t in tickets]))

    def _answer_lost(self) -> bool:
        """Failpoint grant_drop_every: whether this answer carrying tickets is to be lost on the way."""
        every = faults.every("grant_drop_every")
        if not every:
            return False
        self._ticketed_answers += 1
        return self._ticketed_answers % every == 0

    def _fill(self, group: ScoredGroup) -> None:
        """With the lock held: the group fills the slot its sender holds for its prompt, if it still does."""
        assert self.dispatcher is not None
        holder = (group.generator_id, group.incarnation)
        slot = self.dispatcher.slot_of(holder, group.pos)
        if slot is None or not self.dispatcher.arrived(holder, slot):
            self.dropped_unheld += 1
            return
        self._filled[slot] = group
        self.peak_depth = max(self.peak_depth, len(self._filled))
        if self._waiting_takers:
            self._groups_ready.notify_all()

    def _release_unfilled(self, group: ScoredGroup) -> None:
        """With the lock held: a rejected group's slot is granted again (not its prompt: it was
        rejected for what it is)."""
        if self.dispatcher is not None:
            slot = self.dispatcher.slot_of((group.generator_id, group.incarnation), group.pos)
            if slot is not None:
                self.dispatcher.release(slot)

    def _take_step(self, num_groups: int, learner_version: int) -> list[ScoredGroup] | None:
        """With the lock held, tickets: the step's groups in slot order once all are in; None before.
        A group of the step too stale for the policy is dropped and its slot granted again."""
        d = self.dispatcher
        assert d is not None
        if num_groups != d.groups_per_step:
            raise ValueError(f"with tickets a take is one step of {d.groups_per_step} groups, not {num_groups}")
        if d.step != learner_version:
            raise RuntimeError(f"the learner takes at version {learner_version} but the dispatcher is at step "
                               f"{d.step}: every version takes exactly one step of slots")
        for slot in d.step_slots():
            group = self._filled.get(slot)
            if group is not None and self.policy.too_stale(group, learner_version):
                del self._filled[slot]
                d.release(slot)
                self.dropped_stale += 1
                self.registry.write_off(group.generator_id, group.incarnation)
        if not d.ready():
            return None
        batch = [self._filled.pop(slot) for slot, _, _ in d.take()]
        self.consumed += num_groups
        self.registry.on_consumed(batch)
        return batch

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
            self._take_version = learner_version
            try:
                while True:
                    if self._error is not None:
                        raise RuntimeError("replay queue receiver thread failed") from self._error
                    if self.dispatcher is not None:
                        batch = self._take_step(num_groups, learner_version)
                        if batch is not None:
                            self._last_take_version = learner_version
                            return batch
                    elif len(self._buffer) >= num_groups:
                        batch = self._pop_fresh(num_groups, learner_version)
                        if batch is not None:
                            self._last_take_version = learner_version
                            return batch
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueTimeout(self._timeout_message(num_groups, learner_version, timeout_s))
                    self._waiting_takers.append(num_groups)
                    try:
                        self._groups_ready.wait(remaining)
                    finally:
                        self._waiting_takers.remove(num_groups)
            finally:
                self._take_version = None

    def _pop_fresh(self, num_groups: int, learner_version: int) -> list[ScoredGroup] | None:
        """With the lock held: pop `num_groups` fresh groups (each generator's share, with shares,
        a down generator's lent by the others), dropping stale ones on the way; None if the buffer
        does not hold them yet (the fresh ones stay, in order)."""
        wanted = self._wanted(num_groups)
        down = self.registry.down_generators() if wanted is not None else set()
        batch: list[ScoredGroup] = []
        kept: deque[ScoredGroup] = deque()
        for group in self._buffer:
            g = group.generator_id
            if self.policy.too_stale(group, learner_version):
                self.dropped_stale += 1
                self.registry.write_off(g, group.incarnation)
            elif len(batch) < num_groups and (wanted is None or (wanted[g] > 0 and self._on_schedule(g, down))):
                batch.append(group)
                if wanted is not None:
                    wanted[g] -= 1
            else:
                kept.append(group)
        lent = self._borrow(wanted, down, batch, kept) if down else []
        self._room_made.notify_all()
        if len(batch) < num_groups:
            self._buffer = deque(group for group in self._buffer if not self.policy.too_stale(group, learner_version))
            return None
        if lent:
            taken = {id(group) for group in lent}
            kept = deque(group for group in kept if id(group) not in taken)
        self._buffer = kept
        for g, share in enumerate(self.shares or []):
            self._ahead[g] += sum(1 for group in batch if group.generator_id == g) - share
        self.consumed += num_groups
        self.registry.on_consumed(batch)
        return batch

    def _on_schedule(self, generator_id: int, down: set[int]) -> bool:
        """A down generator's own groups are taken only while none of its steps came short: a group
        that arrives after its share was lent out would be trained later than k // q."""
        return generator_id not in down or self._ahead[generator_id] >= 0

    def _borrow(self, wanted: list[int], down: set[int], batch: list[ScoredGroup],
                kept: deque[ScoredGroup]) -> list[ScoredGroup]:
        """With the lock held: fill the down generators' missing shares with the other generators'
        next groups (their own share already taken), oldest first, each lender within its limit;
        appended to `batch`, and returned."""
        missing = sum(wanted[g] for g in down)
        room = [self._lend_limit[g] - (self._ahead[g] - self._told[g]) for g in range(len(wanted))]
        lent: list[ScoredGroup] = []
        for group in kept:
            if len(lent) == missing:
                break
            g = group.generator_id
            if g not in down and wanted[g] == 0 and room[g] > 0:
                room[g] -= 1
                lent.append(group)
        batch.extend(lent)
        return lent

    def _wanted(self, num_groups: int) -> list[int] | None:
        if self.shares is None:
            return None
        if num_groups != sum(self.shares):
            raise ValueError(f"with shares {self.shares} a take is one step of {sum(self.shares)} groups, "
                             f"not {num_groups}")
        return list(self.shares)

    # ------------------------------------------------------------------------------- restarts

    def generator_down(self, generator_id: int) -> None:
        """Generator `generator_id`'s process died and a restart is under way: its share may be lent."""
        incarnation = self.registry.mark_down(generator_id)
        with self._lock:
            if self.dispatcher is not None:  # its slots go to whoever asks next; its late requests get none
                self.dispatcher.generator_down(generator_id, incarnation)
            self._groups_ready.notify_all()  # a waiting take may be complete with lent groups

    def rejoin(self, generator_id: int, incarnation: int, learner_version: int) -> Rejoin:
        """Incarnation `incarnation` of the generator is up (module docstring): drop its predecessor's
        queued groups, take its share again from the next take on; where it starts, and what each
        lender lent. `learner_version`: the learner's version now (before any take it is the next)."""
        with self._lock:
            if self.dispatcher is not None:  # its queued groups hold their slots; it just asks for more
                return Rejoin(position=self.registry.rejoin(generator_id, incarnation),
                              base_version=self._next_take_version(learner_version), dropped=0, leads={})
            mine = [group for group in self._buffer if group.generator_id == generator_id]
            if mine:
                self._buffer = deque(group for group in self._buffer if group.generator_id != generator_id)
                self.dropped_restart += len(mine)
                self._room_made.notify_all()
            position = self.registry.rejoin(generator_id, incarnation)
            leads: dict[int, int] = {}
            if self.shares is not None:
                self._ahead[generator_id] = self._told[generator_id] = 0
                down = self.registry.down_generators()  # told when they rejoin, as newcomers (lead 0)
                for g, ahead in enumerate(self._ahead):
                    if g not in down and ahead > self._told[g]:
                        self._told[g] = leads[g] = ahead
            return Rejoin(position=position, base_version=self._next_take_version(learner_version),
                          dropped=len(mine), leads=leads)

    def _next_take_version(self, learner_version: int) -> int:
        """With the lock held: the learner version of the first take still to pop groups."""
        if self._take_version is not None:
            return self._take_version
        if self._last_take_version is not None:
            return self._last_take_version + 1  # the learner trains on it, then takes at the next version
        return learner_version

    def _timeout_message(self, num_groups: int, learner_version: int, timeout_s: float) -> str:
        rejected = self.rejected.counts()
        return (
            f"waited {timeout_s:.0f} s for {num_groups} groups at learner version {learner_version}, "
            f"the queue holds {self._depth()} (capacity {self.capacity_groups}); "
            + (f"the step still misses slots {self.dispatcher.missing()}; " if self.dispatcher is not None else "")
            + ("the run's prompts ran out (data.epochs): groups dropped on the way took prompts the last steps "
               "needed; " if self.dispatcher is not None and not self.dispatcher.prompts_left() else "")
            + f"generators last seen: {self.registry.last_seen()}; lost in transit: {self.registry.lost}; "
            f"rejected messages: {rejected or 'none'}"
        )

    def _depth(self) -> int:
        return len(self._filled) if self.dispatcher is not None else len(self._buffer)

    @property
    def depth(self) -> int:
        with self._lock:
            return self._depth()

    def stats(self) -> dict[str, float]:
        with self._lock:
            stats: dict[str, float] = {
                "queue/depth": self._depth(),
                "queue/peak_depth": self.peak_depth,
                "queue/capacity": self.capacity_groups,
                "queue/received": self.received,
                "queue/consumed": self.consumed,
                "queue/dropped_stale": self.dropped_stale,
                "queue/dropped_full": self.dropped_full,
                "queue/dropped_restart": self.dropped_restart,
                **self.registry.stats(),
            }
            if self.dispatcher is not None:
                stats["queue/dropped_unheld"] = self.dropped_unheld
                stats.update({f"dispatch/{key}": value for key, value in self.dispatcher.counts.items()})
        rejected = self.rejected.counts()
        stats["wire/rejected"] = sum(rejected.values())
        stats.update({f"wire/rejected/{reason}": count for reason, count in sorted(rejected.items())})
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The counters, for the record: groups in the buffer are not saved (their generators'
        prompt positions are, in the registry; with tickets, the dispatcher's state gives their
        prompts again first); a resumed run's queue counts from the resume."""
        state: dict[str, Any] = {"counters": self.stats()}
        if self.dispatcher is not None:
            with self._lock:
                state["dispatch"] = self.dispatcher.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters_at_resume = dict(state.get("counters", {}))
        if self.dispatcher is not None:
            if "dispatch" not in state:
                raise ValueError("the checkpoint was written under rollout.dispatch=shares: resume it with "
                                 "rollout.dispatch=shares")
            with self._lock:
                self.dispatcher = self.dispatcher.restored(state["dispatch"])

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._room_made.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.receiver is not None:
            self.receiver.close()
        if self.grants is not None:
            self.grants.close()
