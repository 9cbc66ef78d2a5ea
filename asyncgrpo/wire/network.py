"""Addresses and ports: what every process that binds or connects needs, and nothing of ZeroMQ."""

from __future__ import annotations

import ipaddress
import socket

# wire.transport: auto = ipc on a loopback host (every peer is on this node), tcp otherwise.
TRANSPORTS = ("auto", "tcp", "ipc")
# wire.curve: auto = on over tcp (loopback included), off over ipc (see `config.use_curve`).
CURVE_MODES = ("auto", "on", "off")
_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a hostname: it may reach beyond this machine
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (another process may still take it before we bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised_host(host: str) -> str:
    """A wildcard bind address as peers on other nodes reach it: this node's address."""
    if host in _WILDCARDS:
        return socket.gethostbyname(socket.gethostname())
    return host


def advertised(endpoint: str) -> str:
    """A bound ZeroMQ endpoint as peers reach it (an ipc:// path is the same for every process on this node)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{advertised_host(host)}:{port}"
