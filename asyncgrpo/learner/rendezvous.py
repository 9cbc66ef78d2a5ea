"""How several learner ranks find rank 0's rendezvous port without anyone choosing it beforehand.

Rank 0 binds a listening socket on a port the kernel picks as it binds, posts that port on a
`PortBoard` (a Ray actor with no CPU), and hands the socket to its TCPStore; the other ranks read
the port from the board and connect. A port found free by the driver and bound later by rank 0
could be taken in between (and on another node it was never checked at all).
"""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta
from typing import Any

from asyncgrpo.wire.network import listening_socket


class PortBoard:
    """Rank 0's rendezvous port, posted once; `port` waits until then (a Ray async actor)."""

    def __init__(self) -> None:
        self._port: int | None = None
        self._posted = asyncio.Event()

    async def post(self, port: int) -> None:
        self._port = port
        self._posted.set()

    async def port(self) -> int:
        await self._posted.wait()
        assert self._port is not None
        return self._port


def meet_rank_zero(board: Any, rank: int, master_addr: str, timeout_s: float) -> tuple[int, socket.socket | None]:
    """Rank 0: its listening socket on `master_addr`, bound and posted on `board`, with its port.
    Any other rank: the port rank 0 posted (no socket). Raises RuntimeError (one line) when the
    board does not answer within `timeout_s` (rank 0's post, or the port the others wait for)."""
    import ray
    from ray.exceptions import GetTimeoutError

    if rank == 0:
        listener = listening_socket(master_addr, 0)
        port = listener.getsockname()[1]
        try:
            ray.get(board.post.remote(port), timeout=timeout_s)
        except BaseException as error:  # the board's actor dead too: no socket left listening
            listener.close()
            if isinstance(error, GetTimeoutError):
                raise RuntimeError(f"learner rank 0: the rendezvous board took no port within {timeout_s:.0f} s") \
                    from None
            raise
        return port, listener
    try:
        return int(ray.get(board.port.remote(), timeout=timeout_s)), None
    except GetTimeoutError:
        raise RuntimeError(f"learner rank {rank}: rank 0 posted no rendezvous port within {timeout_s:.0f} s") from None


def rank_store(host: str, port: int, rank: int, world_size: int | None, timeout: timedelta,
               listener: socket.socket | None = None) -> Any:
    """A rank's rendezvous store at `host`:`port`: rank 0 serves it on `listener`, or on a socket it
    binds there itself (a TCPStore binds every interface unless handed a socket; port 0: the kernel
    picks a free one as it binds, so no other process can take it in between); the others connect.
    world_size None: rank 0 waits for nobody (a spawner's store, its ranks connecting later)."""
    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if listener is None:
        listener = listening_socket(host, port)
    return dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())


def spawner_store(timeout: timedelta, host: str = "127.0.0.1") -> Any:
    """A rendezvous store for ranks this process is about to spawn, served here on a loopback port
    the kernel picks as it binds (`store.port`): no port is chosen before it is held. Keep it
    until the ranks have finished."""
    return rank_store(host, 0, 0, None, timeout)


def join_spawner_store(port: int, rank: int, world_size: int, timeout: timedelta, host: str = "127.0.0.1") -> None:
    """In a spawned rank: the gloo default group, met through the spawner's store at `port`."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
