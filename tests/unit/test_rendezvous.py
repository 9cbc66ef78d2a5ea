"""learner/rendezvous.py: the board where rank 0 posts the port it has bound (no Ray: the actor's
methods called directly), and rank 0's socket, bound before anyone is told its port."""

from __future__ import annotations

import asyncio
import socket

from asyncgrpo.learner.rendezvous import PortBoard, meet_rank_zero


def test_a_rank_asking_before_rank_zero_posts_waits_and_gets_the_posted_port():
    async def scenario() -> int:
        board = PortBoard()
        asking = asyncio.ensure_future(board.port())
        await asyncio.sleep(0)
        assert not asking.done()  # nothing posted yet
        await board.post(43123)
        return await asyncio.wait_for(asking, 5)

    assert asyncio.run(scenario()) == 43123


class _Call:
    def __init__(self, fn) -> None:
        self.remote = fn


def test_rank_zero_posts_the_port_of_a_socket_it_already_listens_on(monkeypatch):
    import ray

    posted: list[int] = []
    board = type("Board", (), {"post": _Call(posted.append)})()
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    port, listener = meet_rank_zero(board, 0, "127.0.0.1", 5.0)
    try:
        assert posted == [port] and listener.getsockname() == ("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # already listening: no race left
            pass
    finally:
        listener.close()
