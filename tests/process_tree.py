"""What the integration and end-to-end tests look for in the processes a run leaves: a process and
its descendants, their listening sockets, and whether an address is loopback."""

from __future__ import annotations

import ipaddress

import psutil


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its descendants; [] if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listening(processes: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, name, ip, port) of every listening TCP socket of `processes`."""
    found = []
    for proc in processes:
        try:
            found += [(proc.pid, proc.name(), c.laddr.ip, c.laddr.port)
                      for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
