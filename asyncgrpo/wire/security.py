"""ZeroMQ CURVE authentication for TCP sockets, loopback included (and ipc ones on request). See docs/WIRE.md.

The launcher makes one `WireKeys`: a server keypair for the learner's bound sockets and one client
keypair per generator. The learner gets `keys.server()`, generator i gets `keys.client(i)`. A bound
socket with CURVE keys consults a ZAP authenticator (one thread per ZeroMQ context) that admits
only the listed client public keys; a peer without one fails the handshake and never gets a frame
through. Keys are Z85-encoded bytes, as `zmq.curve_keypair()` makes them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class CurveKeypair:
    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeypair:
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)


@dataclass(frozen=True)
class CurveServerKeys:
    """What a bound socket (Receiver, Publisher) needs: its keypair and the clients it admits."""

    keypair: CurveKeypair
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True)
class CurveClientKeys:
    """What a connecting socket (Sender, Subscriber) needs: its keypair and the server's public key."""

    keypair: CurveKeypair
    server_public: bytes


@dataclass(frozen=True)
class WireKeys:
    """Every key of one run, made by the launcher and handed out per process."""

    server_keypair: CurveKeypair
    client_keypairs: tuple[CurveKeypair, ...]

    @classmethod
    def generate(cls, num_clients: int) -> WireKeys:
        return cls(CurveKeypair.generate(), tuple(CurveKeypair.generate() for _ in range(num_clients)))

    def server(self) -> CurveServerKeys:
        return CurveServerKeys(self.server_keypair, frozenset(k.public for k in self.client_keypairs))

    def client(self, index: int) -> CurveClientKeys:
        return CurveClientKeys(self.client_keypairs[index], self.server_keypair.public)



class _AllowedKeys:
    """ZAP credentials provider: the auth thread calls `callback` with the client's Z85 public key."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


_authenticator: ThreadAuthenticator | None = None
_authenticator_lock = threading.Lock()
_domain_numbers = itertools.count()


def _running_authenticator(context: zmq.Context) -> ThreadAuthenticator:
    global _authenticator
    with _authenticator_lock:
        if _authenticator is None or _authenticator.context is not context or not _authenticator.is_alive():
            _authenticator = ThreadAuthenticator(context)
            _authenticator.start()
        return _authenticator


def make_curve_server(socket: zmq.Socket, keys: CurveServerKeys) -> None:
    """Before bind: make `socket` a CURVE server that admits only `keys.allowed_clients`."""
    if not keys.allowed_clients:
        raise ValueError("a CURVE server needs at least one allowed client public key")
    authenticator = _running_authenticator(socket.context)
    # One ZAP domain per socket, so two servers in one process can admit different clients.
    # Domains are never unregistered: the auth thread reads the table concurrently.
    domain = f"asyncgrpo-{next(_domain_numbers)}"
    authenticator.configure_curve_callback(domain, credentials_provider=_AllowedKeys(keys.allowed_clients))
    socket.curve_secretkey = keys.keypair.secret
    socket.curve_publickey = keys.keypair.public
    socket.curve_server = True
    socket.zap_domain = domain.encode()


def make_curve_client(socket: zmq.Socket, keys: CurveClientKeys) -> None:
    """Before connect: authenticate `socket` to the server whose public key is `keys.server_public`."""
    socket.curve_secretkey = keys.keypair.secret
    socket.curve_publickey = keys.keypair.public
    socket.curve_serverkey = keys.server_public
