"""ZeroMQ channels: the one transport at each process boundary.

- `Sender` (PUSH, connects) / `Receiver` (PULL, binds): generator -> learner stream of groups,
  acknowledgements and heartbeats.
- `Publisher` (PUB, binds) / `Subscriber` (SUB, connects): learner -> generators stream of weights
  and shutdown.

Every blocking call takes a timeout. Sockets bind to 127.0.0.1 unless the config says otherwise.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import zmq

from asyncgrpo.wire.codec import DEFAULT_MAX_MESSAGE_BYTES, Frame, WireError, decode, encode
from asyncgrpo.wire.messages import Message


class WireTimeout(TimeoutError):
    pass


def _context() -> zmq.Context:
    return zmq.Context.instance()


class _Channel:
    def __init__(self, socket_type: int) -> None:
        self.socket = _context().socket(socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)


class _Bound(_Channel):
    def __init__(self, socket_type: int, host: str) -> None:
        super().__init__(socket_type)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"


class Sender(_Channel):
    """PUSH side: `send` blocks while the receiver's buffers are full, up to `timeout_s`."""

    def __init__(self, endpoint: str, high_water_mark: int = 8) -> None:
        super().__init__(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self.socket.connect(endpoint)
        self.endpoint = endpoint

    def try_send(self, message: Message | Sequence[Frame], timeout_s: float) -> bool:
        """Send within `timeout_s`; False if the receiver did not take it in time."""
        frames = message if isinstance(message, list) else encode(message)
        if self.socket.poll(int(timeout_s * 1000), zmq.POLLOUT) == 0:
            return False
        self.socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        return True

    def send(self, message: Message, timeout_s: float) -> None:
        if not self.try_send(message, timeout_s):
            raise WireTimeout(f"no receiver took a message on {self.endpoint} within {timeout_s:.0f} s")


class Receiver(_Bound):
    """PULL side: decodes, counts malformed messages by reason and keeps serving."""

    def __init__(self, host: str = "127.0.0.1", high_water_mark: int = 8,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__(zmq.PULL, host)
        self.socket.setsockopt(zmq.RCVHWM, high_water_mark)
        self.max_message_bytes = max_message_bytes
        self.rejected: Counter[str] = Counter()

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid message, or None if none arrived within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self.socket.poll(remaining_ms, zmq.POLLIN) == 0:
                return None
            frames = self.socket.recv_multipart(copy=False)
            try:
                return decode(frames, self.max_message_bytes)
            except WireError as err:
                self.rejected[err.reason] += 1


class Publisher(_Bound):
    """PUB side. No high-water mark: a weight push must never be dropped silently."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__(zmq.PUB, host)
        self.socket.setsockopt(zmq.SNDHWM, 0)

    def publish(self, message: Message) -> None:
        self.socket.send_multipart(encode(message), copy=False)


class Subscriber(_Channel):
    def __init__(self, endpoint: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.max_message_bytes = max_message_bytes
        self.rejected: Counter[str] = Counter()

    def recv(self, timeout_s: float) -> Message | None:
        if self.socket.poll(int(timeout_s * 1000), zmq.POLLIN) == 0:
            return None
        frames = self.socket.recv_multipart(copy=False)
        try:
            return decode(frames, self.max_message_bytes)
        except WireError as err:
            self.rejected[err.reason] += 1
            return None
