"""Addresses and ports: what every process that binds or connects needs, and nothing of ZeroMQ."""

from __future__ import annotations

import ipaddress
import socket
import sys

# wire.transport: auto = ipc on a loopback host (every peer is on this node), tcp otherwise.
TRANSPORTS = ("auto", "tcp", "ipc")
# wire.curve: auto = on over tcp (loopback included), off over ipc (see `composition.use_curve`).
CURVE_MODES = ("auto", "on", "off")
_WILDCARDS = ("0.0.0.0", "*", "[::]", "::")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a hostname: it may reach beyond this machine
        return False


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` and listening (port 0: one the system chooses as it
    binds), to be held from the moment its port is advertised until a store takes it over: nothing
    else can take the port in between (a port found free and bound later could be, and was:
    EADDRINUSE)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
    return listener


# Any address outside this machine: connecting a UDP socket to it sends nothing, it only makes the
# kernel pick the interface that routes off this machine.
_PROBE_ADDRESS = ("10.254.254.254", 1)


def advertised_host(host: str) -> str:
    """A wildcard bind address as peers on other nodes reach it: this node's address."""
    if host in _WILDCARDS:
        return node_address()
    return host


def node_address() -> str:
    """This machine's address as other nodes reach it: in a Ray process, the node address the
    cluster itself uses; else the address of the interface that routes off this machine, and
    loopback on a machine without a route (only local peers then). Never the hostname's address:
    Debian and Ubuntu map the hostname to 127.0.1.1 in /etc/hosts, which no other node reaches."""
    ray = sys.modules.get("ray")  # only if this process already uses Ray: importing it costs seconds
    if ray is not None and ray.is_initialized():
        from ray.util import get_node_ip_address

        return get_node_ip_address()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_PROBE_ADDRESS)
            address = probe.getsockname()[0]
    except OSError:  # no route off this machine
        return "127.0.0.1"
    return "127.0.0.1" if is_loopback(address) or address in _WILDCARDS else address


def advertised(endpoint: str) -> str:
    """A bound ZeroMQ endpoint as peers reach it (an ipc:// path is the same for every process on this node)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{advertised_host(host)}:{port}"
