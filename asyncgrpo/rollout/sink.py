"""Where a generator's messages go: scored groups, version acknowledgements, heartbeats.

In a run it is the PUSH socket to the learner (`asyncgrpo.wire.Sender`); tests pass a list,
benchmarks a collector of encoded frames.
"""

from __future__ import annotations

from typing import Protocol

from asyncgrpo.wire import Message


class GroupSink(Protocol):
    def try_send(self, message: Message, timeout_s: float) -> bool:
        """Hand `message` over within `timeout_s`; False if it was not taken (the receiver is full)."""
        ...

    def close(self) -> None: ...
