"""Transport choice: ipc on a loopback host by default, tcp beyond; CURVE works over both."""

from __future__ import annotations

import os
import stat

import pytest
import zmq

from asyncgrpo.wire import (
    CurveClientKeys,
    CurveKeypair,
    Grant,
    GrantDealer,
    GrantRouter,
    Heartbeat,
    Publisher,
    Receiver,
    Sender,
    Shutdown,
    Subscriber,
    WireKeys,
    encode,
    example_group,
    holder_identity,
)
from asyncgrpo.wire.sockets import DOWNSTREAM_TYPES, UPSTREAM_TYPES, _Receiving, resolve_transport


def test_auto_is_ipc_on_loopback_and_tcp_beyond() -> None:
    assert resolve_transport("auto", "127.0.0.1") == "ipc"
    assert resolve_transport("auto", "localhost") == "ipc"
    assert resolve_transport("auto", "0.0.0.0") == "tcp"
    assert resolve_transport("tcp", "127.0.0.1") == "tcp"
    with pytest.raises(ValueError, match="only this node"):
        resolve_transport("ipc", "0.0.0.0")
    with pytest.raises(ValueError, match="transport must be"):
        resolve_transport("shm", "127.0.0.1")


def test_a_loopback_receiver_listens_on_a_private_unix_socket_removed_at_close() -> None:
    receiver = Receiver()
    assert receiver.transport == "ipc" and receiver.endpoint.startswith("ipc://")
    directory = os.path.dirname(receiver.endpoint.removeprefix("ipc://"))
    # Only this user can connect: the directory is 0700.
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    receiver.close()
    assert not os.path.exists(directory)
    tcp = Receiver(transport="tcp", insecure=True)
    assert tcp.endpoint.startswith("tcp://127.0.0.1:")
    tcp.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_groups_and_weights_cross_both_transports(transport: str) -> None:
    # The transport alone: tcp without CURVE must be asked for (CURVE over tcp: test_wire_curve.py).
    receiver = Receiver(transport=transport, insecure=True)
    publisher = Publisher(transport=transport, insecure=True)
    sender, subscriber = Sender(receiver.endpoint), Subscriber(publisher.endpoint)
    try:
        group = example_group(num_samples=4, tokens_per_sample=1024)
        sender.send(group, timeout_s=5)
        received = receiver.recv(timeout_s=5)
        assert received is not None and received.group_id == group.group_id
        assert (received.tokens == group.tokens).all() and (received.logprobs == group.logprobs).all()
        message = None
        for _ in range(100):  # PUB drops messages until the subscription has arrived
            publisher.publish(Shutdown(reason="stop"))
            message = subscriber.recv(timeout_s=0.05)
            if message is not None:
                break
        assert message == Shutdown(reason="stop")
    finally:
        for channel in (sender, subscriber, receiver, publisher):
            channel.close()


def test_curve_over_ipc_admits_only_the_launchers_clients() -> None:
    keys = WireKeys.generate(num_clients=1)
    receiver = Receiver(curve=keys.server(), transport="ipc")
    trusted = Sender(receiver.endpoint, curve=keys.client(0))
    intruder = Sender(receiver.endpoint, curve=CurveClientKeys(CurveKeypair.generate(), keys.server_keypair.public))
    plain = Sender(receiver.endpoint)
    try:
        assert not intruder.try_send(Heartbeat(generator_id=9, next_seq=0, version=0), timeout_s=1.0)
        assert not plain.try_send(Heartbeat(generator_id=8, next_seq=0, version=0), timeout_s=0.5)
        trusted.send(Heartbeat(generator_id=1, next_seq=0, version=0), timeout_s=5)
        assert receiver.recv(timeout_s=5) == Heartbeat(generator_id=1, next_seq=0, version=0)
        assert receiver.recv(timeout_s=0.3) is None
    finally:
        for channel in (trusted, intruder, plain, receiver):
            channel.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_grant_reaches_only_the_generator_process_it_is_addressed_to_over_curve(transport: str) -> None:
    keys = WireKeys.generate(num_clients=2)
    router = GrantRouter(curve=keys.server(), transport=transport)
    first = GrantDealer(router.endpoint, holder_identity(0, 0), curve=keys.client(0))
    second = GrantDealer(router.endpoint, holder_identity(1, 0), curve=keys.client(1))
    try:
        grant = Grant(request=3, grant=2, slots=[8, 9], positions=[20, 21])
        sent = False
        for _ in range(100):  # a routing id is known once its connection is up
            sent = router.send_to(holder_identity(1, 0), grant)
            if sent:
                break
            second.recv(timeout_s=0.05)
        assert sent
        assert second.recv(timeout_s=5) == grant
        assert first.recv(timeout_s=0.3) is None
        # A process that is not (or no longer) connected: the grant is dropped, not queued for nobody.
        assert not router.send_to(holder_identity(1, 1), grant)
    finally:
        for channel in (first, second, router):
            channel.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_an_authenticated_message_of_too_many_frames_or_bytes_is_counted_and_the_next_one_received(
        transport: str) -> None:
    # The peer holds valid CURVE keys: the limits, not the handshake, must stop it.
    keys = WireKeys.generate(num_clients=1)
    receiver = Receiver(max_message_bytes=1 << 16, curve=keys.server(), transport=transport)
    sender = Sender(receiver.endpoint, curve=keys.client(0))
    try:
        group = example_group(num_samples=2, tokens_per_sample=8)
        header = encode(group)[0]
        # Every frame is empty, so only their number is wrong: an upstream message has at most 5.
        sender.send([header, *([b""] * 1000)], timeout_s=5)
        # Each frame is under MAXMSGSIZE (libzmq would drop the connection otherwise); together over the limit.
        sender.send([header, *([b"\x00" * 40_000] * 3)], timeout_s=5)
        sender.send(group, timeout_s=5)
        received = receiver.recv(timeout_s=10)
        assert received is not None and received.group_id == group.group_id
        assert (received.tokens == group.tokens).all()
        assert receiver.rejected.counts() == {"too_many_frames": 1, "too_large": 1}
    finally:
        sender.close()
        receiver.close()


class _CountedFrame:
    """Stands in for a zmq.Frame received with copy=False, counting how many are alive at once."""

    live = 0
    peak = 0

    def __init__(self, data: bytes, more: bool) -> None:
        self.buffer = memoryview(data)
        self.more = more
        _CountedFrame.live += 1
        _CountedFrame.peak = max(_CountedFrame.peak, _CountedFrame.live)

    def __len__(self) -> int:
        return self.buffer.nbytes

    def __del__(self) -> None:
        _CountedFrame.live -= 1


class _ScriptedSocket:
    """A socket whose one multipart message is `frames`, readable by poll (a pipe with data) until it is read."""

    def __init__(self, frames: list[bytes]) -> None:
        self._frames = iter([(data, index < len(frames) - 1) for index, data in enumerate(frames)])
        self._read_fd, self._write_fd = os.pipe()
        os.write(self._write_fd, b"x")

    def fileno(self) -> int:
        return self._read_fd

    def recv(self, flags: int = 0, copy: bool = True) -> _CountedFrame:
        try:
            data, more = next(self._frames)
        except StopIteration:
            raise zmq.Again() from None
        if not more:  # nothing left: poll must stop reporting this socket readable
            os.read(self._read_fd, 1)
        return _CountedFrame(data, more)

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


@pytest.mark.parametrize(("accepts", "frames", "reason"), [
    # An upstream channel: a valid message has at most a header and 5 arrays.
    (UPSTREAM_TYPES, [encode(Shutdown(reason="x"))[0], *([b""] * 500)], "too_many_frames"),
    # A weights channel takes up to 65,537 frames: the byte limit (4 KiB here) must stop it.
    (DOWNSTREAM_TYPES, [encode(Shutdown(reason="x"))[0], *([b"\x00" * 1024] * 500)], "too_large"),
])
def test_frames_past_a_limit_are_released_as_they_arrive_not_gathered(
        accepts: tuple[type, ...], frames: list[bytes], reason: str) -> None:
    channel = _Receiving()
    socket = _ScriptedSocket(frames)
    channel.socket, channel.endpoint = socket, "scripted"  # type: ignore[assignment]
    channel._init_receiving(4096, accepts)
    _CountedFrame.live = _CountedFrame.peak = 0
    try:
        assert channel.recv(timeout_s=0.2) is None
    finally:
        socket.close()
    assert channel.rejected.counts() == {reason: 1}
    # The whole message was read off the socket (nothing of it is left to be misread as the next
    # message), but only the frames up to the limit were held at once.
    assert next(socket._frames, None) is None
    assert _CountedFrame.peak <= 8
