"""ZeroMQ channels: the one transport at each process boundary.

- `Sender` (PUSH, connects) / `Receiver` (PULL, binds): generator -> learner stream of groups,
  acknowledgements and heartbeats.
- `Publisher` (PUB, binds) / `Subscriber` (SUB, connects): learner -> generators stream of weights
  and shutdown.

Every blocking call takes a timeout. A bound TCP socket, loopback included, needs CURVE keys
(see security.py) or, explicitly, `insecure=True`; an ipc socket sits in a private 0700 directory
and needs neither. A receiving channel rejects and counts any malformed or wrong-direction message
and keeps serving.

Transport: a bound channel on a loopback host listens on a Unix-domain socket (`ipc://`) by
default (`transport="auto"`), which costs the kernel about half of what TCP loopback does per byte;
`tcp` everywhere else. Connecting channels take whatever endpoint string they are given.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter

import zmq

from asyncgrpo.runtime.files import owned_private_dir, remove_stale_owned_dirs
from asyncgrpo.wire.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Frame,
    WireError,
    decode,
    encode,
    max_frames,
)
from asyncgrpo.wire.messages import (
    Grant,
    Heartbeat,
    Message,
    SaveNotice,
    ScoredGroup,
    Shutdown,
    TicketRequest,
    VersionAck,
    WeightsChunk,
)
from asyncgrpo.wire.network import TRANSPORTS, is_loopback
from asyncgrpo.wire.security import (
    CurveClientKeys,
    CurveServerKeys,
    make_curve_client,
    make_curve_server,
)

log = logging.getLogger(__name__)

UPSTREAM_TYPES = (ScoredGroup, VersionAck, Heartbeat, TicketRequest)
DOWNSTREAM_TYPES = (WeightsChunk, Shutdown, SaveNotice)

# A Unix socket path must fit sockaddr_un.sun_path (108 bytes on Linux, 104 on macOS).
_MAX_IPC_PATH = 100


def resolve_transport(transport: str, host: str) -> str:
    """The transport a channel bound on `host` uses: `auto` is ipc for a loopback host (every peer
    is on this node then, and a Unix socket is cheaper than TCP loopback), tcp otherwise."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        return "ipc" if is_loopback(host) and zmq.has("ipc") else "tcp"
    if transport == "ipc":
        if not zmq.has("ipc"):
            raise ValueError("this libzmq has no ipc transport: use transport=tcp")
        if not is_loopback(host):
            raise ValueError(f"transport=ipc reaches only this node, but host={host!r} is meant for other "
                             "nodes: use transport=tcp or auto, or a loopback host")
    return transport


IPC_DIR_PREFIX = "asyncgrpo-wire-"


def remove_ipc_endpoint(endpoint: str) -> None:
    """Remove the private directory of a bound ipc:// endpoint, for a process that outlived the one
    that bound it (a killed actor runs no finaliser). Anything else is left alone."""
    scheme, _, path = endpoint.partition("://")
    directory = os.path.dirname(path)
    if scheme == "ipc" and os.path.basename(directory).startswith(IPC_DIR_PREFIX):
        shutil.rmtree(directory, ignore_errors=True)


def ipc_parents() -> tuple[str, ...]:
    """Where the wire's socket directories are made: the temporary directory, else /tmp (a path short
    enough for a Unix socket)."""
    return tuple(dict.fromkeys((tempfile.gettempdir(), "/tmp")))


def remove_stale_ipc_dirs() -> list[str]:
    """The socket directories this user's dead runs left (a learner killed with its driver runs no
    clean-up), removed; never a live process's or another user's."""
    return [path for parent in ipc_parents() for path in remove_stale_owned_dirs(parent, IPC_DIR_PREFIX)]


def _private_ipc_dir() -> str:
    """A fresh directory for one socket file, named after this process (files.owned_private_dir).
    mkdtemp makes it mode 0700, so only this user (and root) can connect: stricter than TCP
    loopback, which any local user can reach."""
    for parent in ipc_parents():
        directory = owned_private_dir(IPC_DIR_PREFIX, parent=parent)
        if len(directory) + 2 <= _MAX_IPC_PATH:
            return directory
        os.rmdir(directory)
    raise ValueError(f"no temporary directory with a path short enough for a Unix socket ({directory!r})")


class WireTimeout(TimeoutError):
    pass


class Rejections:
    """Malformed messages by reason. The first of each reason is logged; the rest only counted."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.first_error = ""  # the first rejection's text, for a report to whoever must act on it
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # the receiving thread records while the learner reads

    def record(self, err: WireError) -> None:
        with self._lock:
            first = err.reason not in self._counts
            self._counts[err.reason] += 1
            self.first_error = self.first_error or str(err)
        if first:
            log.warning("rejected a malformed message on %s (%s); later ones of this kind are only counted "
                        "under wire/rejected", self.endpoint, err)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def record_error(self, reason: str, detail: str) -> None:
        """A message that decoded but could not be used (e.g. an inconsistent weight chunk)."""
        self.record(WireError(reason, detail))


def _context() -> zmq.Context:
    return zmq.Context.instance()


class _Channel:
    def __init__(self, socket_type: int, options: dict[int, int]) -> None:
        self.socket = _context().socket(socket_type)
        # Options must precede bind and connect: libzmq copies them into each listener and
        # connection then, and ignores later changes for those.
        self.socket.setsockopt(zmq.LINGER, 0)
        for option, value in options.items():
            self.socket.setsockopt(option, value)

    def close(self, linger_s: float = 0.0) -> None:
        """Close; `linger_s` > 0 gives queued outgoing messages that long to leave."""
        if not self.socket.closed:
            self.socket.close(linger=int(linger_s * 1000))


class _Bound(_Channel):
    def __init__(self, socket_type: int, options: dict[int, int], host: str, curve: CurveServerKeys | None,
                 insecure: bool, transport: str) -> None:
        self.transport = resolve_transport(transport, host)
        # Any local user can connect to TCP loopback, so only file permissions (ipc) stand in for keys.
        if curve is None and not insecure and self.transport == "tcp":
            raise ValueError(
                f"refusing to bind tcp on {host!r} without authentication: pass CURVE keys "
                "(asyncgrpo.wire.WireKeys) or set wire.insecure=true"
            )
        super().__init__(socket_type, options)
        if curve is not None:
            make_curve_server(self.socket, curve)
        if self.transport == "ipc":
            directory = _private_ipc_dir()
            # Removed at close, or when this object is collected or the process exits without one.
            self._remove_ipc_dir = weakref.finalize(self, shutil.rmtree, directory, True)
            self.socket.bind(f"ipc://{directory}/s")
        else:
            if ":" in host:
                self.socket.setsockopt(zmq.IPV6, 1)
                host = f"[{host}]"
            self.socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self, linger_s: float = 0.0) -> None:
        super().close(linger_s)
        if self.transport == "ipc":
            self._remove_ipc_dir()


class _Connected(_Channel):
    def __init__(self, socket_type: int, options: dict[int, int], endpoint: str, curve: CurveClientKeys | None) -> None:
        super().__init__(socket_type, options)
        if curve is not None:
            make_curve_client(self.socket, curve)
        self.socket.connect(endpoint)
        self.endpoint = endpoint


class _Receiving:
    """Shared receive path of Receiver and Subscriber."""

    socket: zmq.Socket
    endpoint: str

    def _init_receiving(self, max_message_bytes: int, accepts: tuple[type, ...]) -> None:
        self.max_message_bytes = max_message_bytes
        self.accepts = accepts
        self.max_frames = max_frames(accepts)
        self.rejected = Rejections(self.endpoint)
        # One poller for the channel's life: Socket.poll builds a new one per call, and a
        # non-blocking recv that finds nothing raises zmq.Again; the receiver usually waits for
        # the next message, so each of those would be paid once per message.
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid message, or None if none arrived within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            # poll(0) still reports a message that is already there.
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._poller.poll(remaining_ms):
                return None
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            try:
                frames = self._rest_of_message(frame)
                message = decode(frames, self.max_message_bytes)
                if not isinstance(message, self.accepts):
                    raise WireError("unexpected_type", f"{type(message).__name__} on {self.endpoint}")
            except WireError as err:
                self.rejected.record(err)
                continue
            return message

    def _rest_of_message(self, first: zmq.Frame) -> list[zmq.Frame]:
        """The frames of the message that begins with `first`; raises WireError (`too_many_frames`,
        `too_large`) once it has more frames than any message this channel takes, or more bytes
        than max_message_bytes (MAXMSGSIZE bounds a frame, not a message). The rest of such a
        message is still read off the socket, so that it cannot pass for the next message, but each
        frame is released as it arrives: the count of frames held stays bounded whatever the peer sent."""
        frames, size, frame = [first], len(first), first
        # ZeroMQ delivers a multipart message whole: the other frames are already here. Frame.more
        # instead of recv_multipart's getsockopt(RCVMORE) per frame, which costs more than the frame.
        while frame.more:
            frame = self.socket.recv(copy=False)
            frames.append(frame)
            size += len(frame)
            if len(frames) > self.max_frames or size > self.max_message_bytes:
                break
        else:
            return frames
        count = len(frames)
        frames.clear()
        while frame.more:
            frame = self.socket.recv(copy=False)
            count += 1
            size += len(frame)
        if count > self.max_frames:
            raise WireError("too_many_frames", f"{count} frames > limit {self.max_frames}")
        raise WireError("too_large", f"{size} bytes > limit {self.max_message_bytes}")


class Sender(_Connected):
    """PUSH side: `send` blocks while the receiver's buffers are full, up to `timeout_s`."""

    def __init__(self, endpoint: str, high_water_mark: int = 8, curve: CurveClientKeys | None = None) -> None:
        # IMMEDIATE: queue only toward a completed (authenticated) connection, so an unreachable or
        # refusing receiver shows up as a send timeout instead of messages piling up for nobody.
        super().__init__(zmq.PUSH, {zmq.SNDHWM: high_water_mark, zmq.IMMEDIATE: 1}, endpoint, curve)

    def try_send(self, message: Message | list[Frame], timeout_s: float) -> bool:
        """Send within `timeout_s`; False if the receiver did not take it in time."""
        frames = message if isinstance(message, list) else encode(message)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:  # high-water mark reached, or no connection yet
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or self.socket.poll(remaining_ms, zmq.POLLOUT) == 0:
                    return False

    def send(self, message: Message | list[Frame], timeout_s: float) -> None:
        if not self.try_send(message, timeout_s):
            raise WireTimeout(f"no receiver took a message on {self.endpoint} within {timeout_s:.0f} s")


class Receiver(_Bound, _Receiving):
    """PULL side: decodes, rejects and counts malformed messages by reason, keeps serving."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        high_water_mark: int = 8,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveServerKeys | None = None,
        insecure: bool = False,
        transport: str = "auto",
    ) -> None:
        # MAXMSGSIZE: libzmq drops a peer that sends a single frame over the limit before allocating it.
        options = {zmq.RCVHWM: high_water_mark, zmq.MAXMSGSIZE: max_message_bytes}
        super().__init__(zmq.PULL, options, host, curve, insecure, transport)
        self._init_receiving(max_message_bytes, UPSTREAM_TYPES)


class Publisher(_Bound):
    """PUB side. No high-water mark: a weight push must never be dropped silently."""

    def __init__(self, host: str = "127.0.0.1", curve: CurveServerKeys | None = None, insecure: bool = False,
                 transport: str = "auto") -> None:
        super().__init__(zmq.PUB, {zmq.SNDHWM: 0}, host, curve, insecure, transport)

    def publish(self, message: Message) -> None:
        self.socket.send_multipart(encode(message), copy=False)


class Subscriber(_Connected, _Receiving):
    def __init__(
        self,
        endpoint: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        curve: CurveClientKeys | None = None,
    ) -> None:
        # No MAXMSGSIZE here: the publisher is the learner, and a weight chunk over the limit should
        # be rejected with a logged reason rather than silently drop the connection.
        super().__init__(zmq.SUB, {zmq.RCVHWM: 0}, endpoint, curve)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._init_receiving(max_message_bytes, DOWNSTREAM_TYPES)


def holder_identity(generator_id: int, incarnation: int) -> bytes:
    """The ZeroMQ routing id of a generator's ticket channel: one per process of it."""
    return f"g{generator_id}.{incarnation}".encode()


class GrantRouter(_Bound):
    """Learner rank 0's side of the ticket channel: answers each generator by its routing id. A grant for a generator not connected (dead, or not yet there) is
    dropped: the generator asks again, reporting the newest grant it received."""

    def __init__(self, host: str = "127.0.0.1", curve: CurveServerKeys | None = None, insecure: bool = False,
                 transport: str = "auto") -> None:
        super().__init__(zmq.ROUTER, {zmq.ROUTER_MANDATORY: 1, zmq.SNDHWM: 64}, host, curve, insecure, transport)

    def send_to(self, identity: bytes, grant: Grant) -> bool:
        try:
            self.socket.send_multipart([identity, *encode(grant)], copy=False, flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):  # unroutable (not connected) or its buffer full
            return False


class GrantDealer(_Connected, _Receiving):
    """A generator's side of the ticket channel: receives the grants for its routing id."""

    def __init__(self, endpoint: str, identity: bytes, curve: CurveClientKeys | None = None) -> None:
        super().__init__(zmq.DEALER, {zmq.ROUTING_ID: identity}, endpoint, curve)  # type: ignore[dict-item]
        self._init_receiving(1 << 20, (Grant,))
