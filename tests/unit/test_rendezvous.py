"""learner/rendezvous.py: the board where rank 0 posts the port it has bound (no Ray: the actor's
methods called directly), and rank 0's socket, bound before anyone is told its port."""

from __future__ import annotations

import asyncio
import socket

import pytest

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


def _board_that_never_answers(monkeypatch):
    import ray
    from ray.exceptions import GetTimeoutError

    def never(ref, timeout=None):
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", never)
    return type("Board", (), {"post": _Call(lambda port: None), "port": _Call(lambda: None)})()


def test_rank_zero_whose_post_is_not_taken_in_time_fails_in_one_line(monkeypatch):
    board = _board_that_never_answers(monkeypatch)
    with pytest.raises(RuntimeError, match=r"^learner rank 0: the rendezvous board took no port within 3 s$"):
        meet_rank_zero(board, 0, "127.0.0.1", 3.0)


def test_rank_zero_closes_its_listening_socket_when_the_board_is_dead(monkeypatch):
    import ray
    from ray.exceptions import RayActorError

    opened: list[socket.socket] = []
    real_socket = socket.socket

    def recording_socket(*args, **kwargs):
        opened.append(real_socket(*args, **kwargs))
        return opened[-1]

    def dead(ref, timeout=None):
        raise RayActorError()

    monkeypatch.setattr(socket, "socket", recording_socket)
    monkeypatch.setattr(ray, "get", dead)
    board = type("Board", (), {"post": _Call(lambda port: None)})()
    with pytest.raises(RayActorError):
        meet_rank_zero(board, 0, "127.0.0.1", 3.0)
    assert len(opened) == 1 and opened[0].fileno() == -1  # closed, not left listening


def test_a_rank_waiting_for_a_port_never_posted_fails_in_one_line(monkeypatch):
    board = _board_that_never_answers(monkeypatch)
    with pytest.raises(RuntimeError, match=r"^learner rank 2: rank 0 posted no rendezvous port within 3 s$"):
        meet_rank_zero(board, 2, "127.0.0.1", 3.0)


def test_two_ranks_meet_through_the_store_rank_zero_serves_on_its_bound_socket():
    import threading
    from datetime import timedelta

    from asyncgrpo.learner.rendezvous import rank_store
    from asyncgrpo.wire.network import listening_socket

    listener = listening_socket("127.0.0.1")
    port = listener.getsockname()[1]
    stores: dict[int, object] = {}
    serving = threading.Thread(target=lambda: stores.setdefault(
        0, rank_store("127.0.0.1", port, 0, 2, timedelta(seconds=30), listener)))
    serving.start()
    stores[1] = rank_store("127.0.0.1", port, 1, 2, timedelta(seconds=30))
    serving.join(30)
    assert stores[0].port == port  # the socket rank 0 was handed, not one it bound elsewhere
    stores[0].set("greeting", "from rank 0")
    assert stores[1].get("greeting") == b"from rank 0"


def test_a_single_rank_store_binds_a_loopback_port_the_kernel_picks():
    from datetime import timedelta

    from asyncgrpo.learner.rendezvous import rank_store

    store = rank_store("127.0.0.1", 0, 0, 1, timedelta(seconds=30))
    assert store.port > 0
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass
