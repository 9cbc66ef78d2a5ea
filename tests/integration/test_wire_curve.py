"""CURVE authentication: the launcher's clients get through, any other peer is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncgrpo.config import load
from asyncgrpo.composition import use_curve
from asyncgrpo.wire import (
    CurveClientKeys,
    CurveKeypair,
    Heartbeat,
    Publisher,
    Receiver,
    Sender,
    Shutdown,
    Subscriber,
    WireKeys,
    is_loopback,
)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
)


@pytest.fixture(scope="module")
def keys() -> WireKeys:
    return WireKeys.generate(num_clients=2)


@pytest.fixture
def receiver(keys: WireKeys) -> Iterator[Receiver]:
    # Bound beyond loopback, which is what requires the keys; the test connects through loopback.
    receiver = Receiver("0.0.0.0", curve=keys.server())
    yield receiver
    receiver.close()


def loopback_endpoint(endpoint: str) -> str:
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


def test_the_launchers_clients_get_through(keys: WireKeys, receiver: Receiver) -> None:
    for index in range(2):
        sender = Sender(loopback_endpoint(receiver.endpoint), curve=keys.client(index))
        try:
            sender.send(Heartbeat(generator_id=index, next_seq=0, version=0), timeout_s=5)
            assert receiver.recv(timeout_s=5) == Heartbeat(generator_id=index, next_seq=0, version=0)
        finally:
            sender.close()


@pytest.mark.parametrize("peer", ["unlisted client key", "no CURVE at all", "wrong server key"])
def test_a_peer_without_the_right_key_is_refused(keys: WireKeys, receiver: Receiver, peer: str) -> None:
    curve = {
        "unlisted client key": CurveClientKeys(CurveKeypair.generate(), keys.server_keypair.public),
        "no CURVE at all": None,
        "wrong server key": WireKeys(CurveKeypair.generate(), keys.client_keypairs).client(0),
    }[peer]
    sender = Sender(loopback_endpoint(receiver.endpoint), curve=curve)
    try:
        # IMMEDIATE: a refused sender has no connection to queue to, so its send times out.
        assert not sender.try_send(Heartbeat(generator_id=9, next_seq=0, version=0), timeout_s=1.0)
        assert receiver.recv(timeout_s=0.5) is None
    finally:
        sender.close()


def test_the_server_sees_an_authentication_failure_then_a_success(keys: WireKeys, receiver: Receiver) -> None:
    monitor = receiver.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(HANDSHAKE_FAILED))
    try:
        unlisted = CurveClientKeys(CurveKeypair.generate(), keys.server_keypair.public)
        for curve, expected in ((unlisted, zmq.EVENT_HANDSHAKE_FAILED_AUTH),
                                (keys.client(0), zmq.EVENT_HANDSHAKE_SUCCEEDED)):
            sender = Sender(loopback_endpoint(receiver.endpoint), curve=curve)
            try:
                assert monitor.poll(5000), "no handshake within 5 s"
                assert recv_monitor_message(monitor)["event"] == expected
            finally:
                sender.close()
    finally:
        receiver.socket.disable_monitor()
        monitor.close(linger=0)


def test_weights_reach_only_authenticated_subscribers(keys: WireKeys) -> None:
    publisher = Publisher("0.0.0.0", curve=keys.server())
    endpoint = loopback_endpoint(publisher.endpoint)
    trusted = Subscriber(endpoint, curve=keys.client(0))
    intruder = Subscriber(endpoint, curve=CurveClientKeys(CurveKeypair.generate(), keys.server_keypair.public))
    eavesdropper = Subscriber(endpoint)
    try:
        deadline = time.monotonic() + 10
        received = None
        while received is None:  # PUB drops messages until the subscription has arrived
            assert time.monotonic() < deadline, "the trusted subscriber never received"
            publisher.publish(Shutdown(reason="stop"))
            received = trusted.recv(timeout_s=0.1)
        assert received == Shutdown(reason="stop")
        publisher.publish(Shutdown(reason="stop"))
        assert intruder.recv(timeout_s=0.5) is None
        assert eavesdropper.recv(timeout_s=0.1) is None
    finally:
        for channel in (trusted, intruder, eavesdropper, publisher):
            channel.close()


def test_two_servers_in_one_process_admit_their_own_clients_only() -> None:
    first, second = WireKeys.generate(1), WireKeys.generate(1)
    receivers = [Receiver(curve=first.server()), Receiver(curve=second.server())]
    try:
        # The first run's client, with the second server's public key, is still not admitted there.
        crossed = Sender(receivers[1].endpoint,
                         curve=CurveClientKeys(first.client_keypairs[0], second.server_keypair.public))
        own = Sender(receivers[1].endpoint, curve=second.client(0))
        try:
            assert not crossed.try_send(Heartbeat(generator_id=1, next_seq=0, version=0), timeout_s=1.0)
            own.send(Heartbeat(generator_id=2, next_seq=0, version=0), timeout_s=5)
            assert receivers[1].recv(timeout_s=5) == Heartbeat(generator_id=2, next_seq=0, version=0)
        finally:
            crossed.close()
            own.close()
    finally:
        for receiver in receivers:
            receiver.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "localhost"])
def test_binding_tcp_needs_keys_or_an_explicit_insecure_loopback_included(host: str) -> None:
    with pytest.raises(ValueError, match="wire.insecure"):
        Receiver(host, transport="tcp")
    with pytest.raises(ValueError, match="wire.insecure"):
        Publisher(host, transport="tcp")
    Receiver(host, transport="tcp", insecure=True).close()
    Publisher(host, transport="tcp", insecure=True).close()


def test_binding_ipc_needs_no_keys() -> None:
    for host in ("127.0.0.1", "localhost"):
        Receiver(host).close()
        Publisher(host, transport="ipc").close()


def test_a_tcp_loopback_run_with_curve_auto_refuses_a_client_without_the_server_key() -> None:
    """The config's decision and the channels together, as the launcher wires them: a local process
    that connects to the learner's loopback TCP port without the run's keys delivers nothing."""
    cfg = load(["wire.transport=tcp"])
    assert use_curve(cfg)
    keys = WireKeys.generate(num_clients=1)
    receiver = Receiver(cfg.wire.host, curve=keys.server(), insecure=cfg.wire.insecure, transport=cfg.wire.transport)
    assert receiver.endpoint.startswith("tcp://127.0.0.1:")
    trusted = Sender(receiver.endpoint, curve=keys.client(0))
    outsiders = [Sender(receiver.endpoint),  # no CURVE at all
                 Sender(receiver.endpoint, curve=CurveClientKeys(CurveKeypair.generate(), keys.server_keypair.public)),
                 Sender(receiver.endpoint, curve=WireKeys(CurveKeypair.generate(), keys.client_keypairs).client(0))]
    try:
        for outsider in outsiders:
            assert not outsider.try_send(Heartbeat(generator_id=9, next_seq=0, version=0), timeout_s=1.0)
        trusted.send(Heartbeat(generator_id=1, next_seq=0, version=0), timeout_s=5)
        assert receiver.recv(timeout_s=5) == Heartbeat(generator_id=1, next_seq=0, version=0)
        assert receiver.recv(timeout_s=0.3) is None  # nothing of the outsiders' arrived
    finally:
        for channel in (*outsiders, trusted, receiver):
            channel.close()


def test_loopback_detection() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "::", "eth0", "example.com"]))


def test_secret_keys_stay_out_of_reprs(keys: WireKeys) -> None:
    assert keys.server_keypair.secret.decode() not in repr(keys)
    assert keys.client_keypairs[0].secret.decode() not in repr(keys.client(0))
