"""Where a generator's messages go: scored groups, version acknowledgements, heartbeats.

In a run it is the PUSH socket to the learner (`asyncgrpo.wire.Sender`); tests pass a list,
benchmarks a collector of encoded frames. With a wire failpoint set (tools/chaos.py), the socket is
wrapped in a `FaultySink` that loses or corrupts every N-th group.
"""

from __future__ import annotations

from typing import Protocol

from asyncgrpo.runtime import faults
from asyncgrpo.wire import Message, ScoredGroup, encode_group


class GroupSink(Protocol):
    def try_send(self, message: Message, timeout_s: float) -> bool:
        """Hand `message` over within `timeout_s`; False if it was not taken (the receiver is full)."""
        ...

    def close(self) -> None: ...


class FaultySink:
    """Wraps a generator's sink to lose or corrupt scored groups on the way (failpoints
    `wire_drop_every` and `wire_corrupt_every`, asyncgrpo/runtime/faults.py; used by tools/chaos.py).

    The generator numbers a group before handing it over, so a dropped group is a gap in its
    sequence numbers, which the learner's registry counts as lost (`queue/lost`). A corrupted group
    has the first byte of its msgpack header flipped, which no decoder can take for a header: the
    learner rejects it (`wire/rejected/bad_header`) and its number is a gap as well. Real transports
    do not flip bytes (TCP checksums its segments, a Unix socket copies memory) and the codec has no
    checksum of its own, so a flip inside an array that stayed in range would go unnoticed; this
    failpoint tests the accounting, not the detection of arbitrary corruption. Acknowledgements and
    heartbeats pass untouched, and the count moves only once a group is taken (a full socket retries
    the same group).
    """

    def __init__(self, sink: GroupSink, drop_every: int = 0, corrupt_every: int = 0) -> None:
        self.sink = sink
        self.drop_every, self.corrupt_every = drop_every, corrupt_every
        self.groups = self.dropped = self.corrupted = 0

    def try_send(self, message: Message, timeout_s: float) -> bool:
        if not isinstance(message, ScoredGroup):
            return self.sink.try_send(message, timeout_s)
        ordinal = self.groups + 1
        if self.drop_every and ordinal % self.drop_every == 0:
            self.groups, self.dropped = ordinal, self.dropped + 1
            return True
        if self.corrupt_every and ordinal % self.corrupt_every == 0:
            frames = encode_group(message)
            header = bytearray(frames[0])
            header[0] ^= 0xFF
            taken = self.sink.try_send([bytes(header), *frames[1:]], timeout_s)  # type: ignore[arg-type]
            self.corrupted += int(taken)
        else:
            taken = self.sink.try_send(message, timeout_s)
        if taken:
            self.groups = ordinal
        return taken

    def close(self) -> None:
        self.sink.close()


def with_faults(sink: GroupSink) -> GroupSink:
    """`sink` itself, or wrapped in a `FaultySink` when a wire failpoint is set."""
    drop_every, corrupt_every = faults.every("wire_drop_every"), faults.every("wire_corrupt_every")
    if not drop_every and not corrupt_every:
        return sink
    return FaultySink(sink, drop_every=drop_every, corrupt_every=corrupt_every)
