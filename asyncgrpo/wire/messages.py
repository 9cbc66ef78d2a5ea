"""Typed messages that cross process boundaries.

Upstream (generator -> learner, one PUSH/PULL stream): `ScoredGroup`, `VersionAck`, `Heartbeat`,
`TicketRequest`.
Downstream (learner -> generators, one PUB/SUB stream): `WeightsChunk`, `Shutdown`, `SaveNotice`;
and to one generator (ROUTER/DEALER): `Grant`.

Arrays are numpy views on the received ZeroMQ frames; nothing here is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

# 2: lengths and rewards moved from array frames into the header.
# 3: heartbeats carry the generator's cumulative report (idle seconds, reward errors, dropped groups).
# 4: a weights chunk carries pieces of tensors (full shape and element offset), so a tensor larger
#    than a message travels in several chunks; heartbeats report rejected weight messages.
# 5: heartbeats carry reward calls and each term's first error (reward outages stop the run).
# 6: groups, acknowledgements and heartbeats carry the generator's incarnation (a restarted process
#    counts again from sequence number 0); groups carry their position in the prompt stream.
# 7: groups carry which completions were truncated (hit rollout.max_new_tokens without stopping), for
#    algo.overlong.
# 8: groups carry a per-token policy mask: which completion tokens the policy sampled (trained) and
#    which an environment inserted (multi-turn episodes; never trained); heartbeats carry environment
#    calls, failed ones and the first failure (environment outages stop the run).
# 9: delta weight pushes (weights.delta): a chunk names the version its pieces apply onto and how each
#    names its changed elements; heartbeats count the deltas a generator could not apply (a lost one).
# `SaveNotice` (type 6), `TicketRequest` (7) and `Grant` (8) came later without a bump: a new type changes no existing layout or meaning
# (an older peer rejects it as unknown_type, never misreads it), and recorded groups stay readable.
SCHEMA_VERSION = 9


class MsgType(IntEnum):
    GROUP = 1
    WEIGHTS = 2
    ACK = 3
    HEARTBEAT = 4
    SHUTDOWN = 5
    SAVE = 6
    TICKETS = 7
    GRANT = 8


@dataclass
class ScoredGroup:
    """n completions of one prompt, with rewards and per-token rollout log-probs.

    Completions are packed end to end: sample i owns `tokens[offsets[i]:offsets[i+1]]`. A
    multi-turn completion is the policy's turns with the environment's observations between them.
    Shapes: prompt_tokens [P] int32; tokens, logprobs, versions, policy_mask [sum(lengths)]
    int32/float32/int32/uint8; lengths, rewards [n] int32/float32; truncated [n] uint8, 1 where the
    completion hit rollout.max_new_tokens without stopping (None when built: no completion truncated).
    policy_mask is 1 where the policy sampled the token (trained, with its log-prob and version) and
    0 where an environment inserted it (never trained; its log-prob holds 0 and its version entry
    is ignored); None when built: every token is the policy's.
    `meta` holds small extras (str -> int, float or str).
    """

    generator_id: int
    seq: int  # per-generator sequence number: 0, 1, 2, ... (gaps mean loss in transit)
    prompt_id: int
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    meta: dict[str, float | int | str] = field(default_factory=dict)
    # Which process of this generator sent it: 0 for the first, +1 per restart. Sequence numbers
    # are per incarnation; the registry drops what a replaced incarnation sends late.
    incarnation: int = 0
    # The prompt's position in the run's prompt stream: with its sender, it names the slot the
    # group fills (the dispatcher's index (holder, position) -> slot).
    pos: int = 0
    # 1 where the completion was cut at rollout.max_new_tokens (vLLM's finish reason `length`):
    # algo.overlong decides what the learner does with those.
    truncated: np.ndarray | None = None
    # 1 where the policy sampled the token, 0 where an environment inserted it (an observation):
    # the learner trains only the policy's tokens (docs/WIRE.md, docs/ALGORITHMS.md).
    policy_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.truncated is None:
            self.truncated = np.zeros(self.lengths.shape[0], dtype=np.uint8)
        if self.policy_mask is None:
            self.policy_mask = np.ones(self.tokens.shape[0], dtype=np.uint8)

    @property
    def group_id(self) -> tuple[int, int]:
        """Unique across a run: sequence numbers are per generator."""
        return (self.generator_id, self.seq)

    @property
    def num_samples(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def policy_tokens(self) -> int:
        """How many tokens the policy sampled (the trained ones)."""
        return int(np.count_nonzero(self.policy_mask))

    def policy_versions(self) -> np.ndarray:
        """The versions of the policy's tokens (an environment's tokens have none that counts)."""
        if self.policy_tokens == self.versions.size:
            return self.versions
        return self.versions[self.policy_mask.astype(bool)]

    @property
    def version_min(self) -> int:
        """The oldest version among the policy's tokens; meta's version when it sampled none."""
        versions = self.policy_versions()
        return int(versions.min()) if versions.size else int(self.meta.get("version", 0))

    @property
    def version_max(self) -> int:
        """The newest version among the policy's tokens; meta's version when it sampled none."""
        versions = self.policy_versions()
        return int(versions.max()) if versions.size else int(self.meta.get("version", 0))

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def completion(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, logprobs, versions) of sample i, as views."""
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.tokens[start:end], self.logprobs[start:end], self.versions[start:end]

    def completion_mask(self, i: int) -> np.ndarray:
        """policy_mask of sample i, as a view."""
        return self.policy_mask[self.offsets[i]:self.offsets[i + 1]]


@dataclass
class WeightsChunk:
    """Pieces of the policy's state dict at `version`; a push is `num_chunks` of these.

    Piece i is elements [offsets[i], offsets[i] + tensors[i].size) of tensor `names[i]` flattened,
    whose full shape is `shapes[i]`: a tensor larger than a chunk is split over several chunks.

    A delta push (`base_version` >= 0, weights.delta) carries only the elements whose wire value
    changed since version `base_version`, which the receiver must hold: piece i then spans
    `spans[i]` elements from `offsets[i]`, `tensors[i]` holds the changed values and
    `encodings[i]` says how they are placed (DELTA_VALUES: all the span's values, `positions[i]`
    empty; DELTA_INDEX: `positions[i]` int32 positions within the span, increasing; DELTA_MASK:
    `positions[i]` a uint8 bitmask of the span, little-endian bit order).
    """

    version: int
    chunk_index: int
    num_chunks: int
    names: list[str]
    tensors: list[np.ndarray]  # 1-D; bfloat16 travels as uint16 with dtype name "bfloat16"
    dtypes: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    base_version: int = -1  # -1: a full push; else a delta onto that version (weights.delta)
    encodings: list[int] = field(default_factory=list)  # per piece, delta only: DELTA_*
    spans: list[int] = field(default_factory=list)  # per piece, delta only: elements it covers
    positions: list[np.ndarray] = field(default_factory=list)  # per piece, delta only: see above

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0


# How a delta piece places its changed values (WeightsChunk.encodings).
DELTA_VALUES, DELTA_INDEX, DELTA_MASK = 0, 1, 2


@dataclass
class VersionAck:
    generator_id: int
    version: int
    incarnation: int = 0


@dataclass
class Heartbeat:
    """A generator's periodic report: how many groups it has sent (`next_seq`), which weights it
    has loaded, and its cumulative counters, which the learner logs as per-step increases."""

    generator_id: int
    next_seq: int
    version: int
    idle_s: float = 0.0  # waiting on the throttle, on rewards, on new weights or on a full queue
    reward_errors: int = 0  # reward terms that failed (reward/errors)
    # groups not sent because a reward or an environment call failed under reward/env.on_error=drop_group
    groups_dropped: int = 0
    weights_rejected: int = 0  # weight messages this generator could not accept
    rejection: str = ""  # the first reason, for the learner's error message
    reward_calls: int = 0  # reward term calls made (completions x terms): the error rate's denominator
    # term name -> its first error, so a run that fails on the error rate says why
    reward_first_errors: dict[str, str] = field(default_factory=dict)
    incarnation: int = 0  # its counters are this incarnation's: a restarted process counts from 0
    env_calls: int = 0  # environment calls made (resets and steps): the env error rate's denominator
    env_errors: int = 0  # of those, the ones that failed (any cause: raised, timed out, invalid)
    env_first_error: str = ""  # the first failure's text, so a run that fails on the env error rate says why
    # delta weight pushes it could not apply because it did not hold their base version (one was
    # lost on the way): not fatal; an increase asks learner rank 0 for a full push (weights.delta)
    delta_mismatches: int = 0


@dataclass
class Shutdown:
    reason: str


@dataclass
class SaveNotice:
    """Learner rank 0 is saving a checkpoint of `version` (`saving`): no new weights and no room on the
    group queue for up to `timeout_s` seconds from receipt (train.checkpoint_timeout_s); or
    (`saving` false, `timeout_s` 0) that save is over. A duration, not a time: clocks differ across nodes."""

    version: int
    saving: bool
    timeout_s: float


@dataclass
class TicketRequest:
    """A generator holding weights `version` asks for up to `wanted` tickets (asyncgrpo/queue/dispatch.py).
    Sent on the groups stream, after every group sent so far, it is also a report: the newest grant
    received (`newest_grant`; a later one never reached it), the tickets granted and not sent yet
    (`unsent`; any other ticket of those grants that has not arrived was lost in transit) and the
    tickets whose groups it will not send (`given_back`: rewards failed, reward.on_error=drop_group),
    each named by its prompt's position (a ticket's slot may move: Dispatcher.fill_early).
    `request` numbers the requests of this incarnation: only the grant answering the newest counts."""

    generator_id: int
    incarnation: int
    request: int
    version: int
    wanted: int
    newest_grant: int
    unsent: list[int] = field(default_factory=list)
    given_back: list[int] = field(default_factory=list)


@dataclass
class Grant:
    """The answer to request `request`: grant number `grant` (0 and no tickets: nothing now, ask
    again with newer weights or once the learner has taken a step), one (slot, prompt position)
    per ticket."""

    request: int
    grant: int
    slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


Message = ScoredGroup | WeightsChunk | VersionAck | Heartbeat | Shutdown | SaveNotice | TicketRequest | Grant
