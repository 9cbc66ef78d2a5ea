"""Transport choice: ipc on a loopback host by default, tcp beyond; CURVE works over both."""

from __future__ import annotations

import os
import stat

import pytest

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
    example_group,
    holder_identity,
)
from asyncgrpo.wire.sockets import resolve_transport


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
