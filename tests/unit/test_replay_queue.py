"""The replay queue without a dispatcher (groups in arrival order): exact accounting, loss and duplicate
detection, the stale policy, timeouts. With one: tests/unit/test_replay_tickets.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from asyncgrpo.queue.replay_queue import QueueFull, ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import (
    Heartbeat,
    Receiver,
    ScoredGroup,
    Sender,
    VersionAck,
    encode,
    example_group,
)

ACCOUNTING_KEYS = ("queue/consumed", "queue/dropped_stale", "queue/dropped_unheld", "queue/depth")


def group(generator_id: int = 0, seq: int = 0, version: int = 0, reward: float = 1.0) -> ScoredGroup:
    g = example_group(num_samples=2, tokens_per_sample=3, seed=seq)
    g.generator_id, g.seq = generator_id, seq
    g.versions[:] = version
    g.rewards[:] = reward
    return g


def assert_accounted(queue: ReplayQueue) -> dict[str, float]:
    stats = queue.stats()
    assert stats["queue/received"] == sum(stats[key] for key in ACCOUNTING_KEYS), stats
    assert stats["queue/depth"] <= stats["queue/peak_depth"] <= stats["queue/capacity"], stats
    return stats


def eviction(max_staleness: int, drop_stale: bool = True) -> StalenessEviction:
    return StalenessEviction(max_staleness, drop_stale=drop_stale)


def in_process_queue(capacity: int = 4, max_staleness: int = 2, drop_stale: bool = True) -> ReplayQueue:
    """A queue without a dispatcher: groups in arrival order."""
    return ReplayQueue(None, capacity, eviction(max_staleness, drop_stale), limits=None)


def test_stats_keep_the_keys_the_learner_logs() -> None:
    stats = in_process_queue().stats()
    for key in ("queue/depth", "queue/received", "queue/consumed", "queue/dropped_stale", "queue/dropped_unheld",
                "queue/lost", "queue/duplicates", "wire/rejected"):
        assert key in stats


def test_groups_come_out_oldest_first_and_are_counted() -> None:
    queue = in_process_queue(capacity=4)
    for seq in range(3):
        queue.put(group(seq=seq))
    assert [g.seq for g in queue.take(2, learner_version=0, timeout_s=1)] == [0, 1]
    stats = assert_accounted(queue)
    assert (stats["queue/received"], stats["queue/consumed"], stats["queue/depth"]) == (3, 2, 1)


def test_a_full_queue_refuses_a_put_without_counting_it() -> None:
    queue = in_process_queue(capacity=2)
    queue.put(group(seq=0))
    queue.put(group(seq=1))
    with pytest.raises(QueueFull):
        queue.put(group(seq=2), timeout_s=0.0)
    stats = assert_accounted(queue)
    assert stats["queue/received"] == 2
    queue.take(1, learner_version=0, timeout_s=1)
    queue.put(group(seq=2))  # the refused group may be offered again: it was never seen
    assert assert_accounted(queue)["queue/duplicates"] == 0


def test_a_put_into_a_full_queue_waits_for_a_take_in_another_thread() -> None:
    queue = in_process_queue(capacity=1)
    queue.put(group(seq=0))
    taker = threading.Timer(0.05, queue.take, kwargs={"num_groups": 1, "learner_version": 0, "timeout_s": 5})
    taker.start()
    queue.put(group(seq=1), timeout_s=5)
    taker.join()
    assert assert_accounted(queue)["queue/consumed"] == 1


def test_too_stale_groups_are_dropped_at_take_time_not_at_put_time() -> None:
    queue = in_process_queue(capacity=8, max_staleness=1)
    for seq, version in enumerate([0, 1, 2, 0, 2]):
        queue.put(group(seq=seq, version=version))
    assert assert_accounted(queue)["queue/dropped_stale"] == 0  # staleness is relative to the taker
    taken = queue.take(3, learner_version=2, timeout_s=1)
    assert [(g.seq, g.version_min) for g in taken] == [(1, 1), (2, 2), (4, 2)]
    stats = assert_accounted(queue)
    assert (stats["queue/dropped_stale"], stats["queue/consumed"], stats["queue/depth"]) == (2, 3, 0)


def test_stale_groups_are_kept_when_dropping_is_off() -> None:
    queue = in_process_queue(max_staleness=0, drop_stale=False)
    queue.put(group(seq=0, version=0))
    assert queue.take(1, learner_version=10, timeout_s=1)[0].version_min == 0
    assert assert_accounted(queue)["queue/dropped_stale"] == 0


def test_take_waits_past_stale_groups_and_keeps_fresh_ones_for_later() -> None:
    queue = in_process_queue(capacity=4, max_staleness=0)
    queue.put(group(seq=0, version=5))
    queue.put(group(seq=1, version=3))
    with pytest.raises(QueueTimeout):
        queue.take(2, learner_version=5, timeout_s=0.05)
    stats = assert_accounted(queue)
    assert (stats["queue/dropped_stale"], stats["queue/depth"]) == (1, 1)
    queue.put(group(seq=2, version=5))
    assert [g.seq for g in queue.take(2, learner_version=5, timeout_s=1)] == [0, 2]


def test_take_timeout_says_what_it_waited_for_and_loses_nothing() -> None:
    queue = in_process_queue(capacity=4)
    queue.put(group(generator_id=7, seq=0))
    with pytest.raises(QueueTimeout) as raised:
        queue.take(2, learner_version=0, timeout_s=0.05)
    message = str(raised.value)
    assert "for 2 groups" in message and "holds 1" in message and "gen 7" in message
    assert assert_accounted(queue)["queue/depth"] == 1


def test_take_timeout_on_an_empty_queue_says_no_generator_connected() -> None:
    with pytest.raises(QueueTimeout, match="none ever connected"):
        in_process_queue().take(1, learner_version=0, timeout_s=0.01)


def test_take_more_than_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity_groups=4"):
        in_process_queue(capacity=4).take(5, learner_version=0, timeout_s=1)


def test_sequence_gaps_count_as_lost_per_generator() -> None:
    queue = in_process_queue(capacity=16)
    for generator_id, seq in [(0, 0), (0, 1), (0, 4), (1, 0), (1, 2), (0, 5)]:
        queue.put(group(generator_id, seq))
    stats = assert_accounted(queue)
    assert (stats["queue/received"], stats["queue/lost"], stats["queue/duplicates"]) == (6, 3, 0)


def test_heartbeat_reveals_loss_at_the_tail() -> None:
    queue = in_process_queue(capacity=16)
    queue.put(group(seq=0))
    queue.put(Heartbeat(generator_id=0, next_seq=3, version=0))
    assert queue.stats()["queue/lost"] == 2
    queue.put(Heartbeat(generator_id=0, next_seq=3, version=0))  # nothing new
    assert queue.stats()["queue/lost"] == 2


def test_repeated_or_late_sequence_numbers_are_duplicates_and_never_enter() -> None:
    queue = in_process_queue(capacity=16)
    queue.put(group(seq=0))
    queue.put(group(seq=0))
    queue.put(group(seq=3))
    queue.put(group(seq=1))  # declared lost by the gap: arriving now, it is a replay
    stats = assert_accounted(queue)
    assert (stats["queue/received"], stats["queue/duplicates"], stats["queue/lost"]) == (2, 2, 2)


def test_loss_is_logged_once_per_generator(caplog: pytest.LogCaptureFixture) -> None:
    queue = in_process_queue(capacity=16)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.queue.replay_queue"):
        for seq in (0, 2, 4, 6):
            queue.put(group(seq=seq))
    assert queue.stats()["queue/lost"] == 3
    assert len([r for r in caplog.records if "lost in transit" in r.getMessage()]) == 1


def test_acks_track_each_generators_loaded_version() -> None:
    queue = in_process_queue()
    assert queue.registry.acked_versions([0, 1]) == {0: -1, 1: -1}
    queue.put(VersionAck(generator_id=0, version=3))
    queue.put(VersionAck(generator_id=1, version=2))
    queue.put(VersionAck(generator_id=0, version=1))  # late ack: versions never go back
    assert queue.registry.acked_versions([0, 1]) == {0: 3, 1: 2}


def test_put_refuses_downstream_messages() -> None:
    with pytest.raises(TypeError):
        in_process_queue().put("not a message")  # type: ignore[arg-type]


def test_policy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="capacity_groups"):
        ReplayQueue(None, 0, eviction(1), limits=None)
    with pytest.raises(ValueError, match="max_staleness"):
        eviction(-1)


def test_a_live_queue_rejects_malformed_messages_logs_each_kind_once_and_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = ReplayQueue(Receiver(), 4, eviction(1000), limits=None, poll_interval_s=0.01).start()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    sender = Sender(queue.receiver.endpoint)
    try:
        raw.connect(queue.receiver.endpoint)
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.wire.sockets"):
            for _ in range(3):
                raw.send_multipart([b"\xc1 not msgpack"])
            raw.send_multipart(encode(group())[:-1])  # a frame short
            sender.send(group(seq=0), timeout_s=5)
            taken = queue.take(1, learner_version=0, timeout_s=5)
            # Two connections: the receiver takes from them in turn, so the valid group may be
            # served before the last malformed ones are read.
            deadline = time.monotonic() + 5
            while queue.stats()["wire/rejected"] < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert taken[0].seq == 0
        stats = assert_accounted(queue)
        assert stats["wire/rejected"] == 4
        assert stats["wire/rejected/bad_header"] == 3 and stats["wire/rejected/frame_count"] == 1
        warnings = [r.getMessage() for r in caplog.records if "rejected a malformed message" in r.getMessage()]
        assert len(warnings) == 2
    finally:
        raw.close(linger=0)
        sender.close()
        queue.close()


def test_a_live_queue_without_a_dispatcher_stops_reading_when_full() -> None:
    queue = ReplayQueue(Receiver(high_water_mark=1), 2, eviction(1000), limits=None, poll_interval_s=0.01).start()
    sender = Sender(queue.receiver.endpoint, high_water_mark=1)
    # Big groups, so that the kernel's socket buffers between the two high-water marks hold few.
    big = example_group(num_samples=2, tokens_per_sample=1 << 16)
    big.generator_id = 0
    try:
        sent = 0
        deadline = time.monotonic() + 10
        while True:
            big.seq = sent
            if not sender.try_send(big, timeout_s=0.2):
                break
            sent += 1
            assert time.monotonic() < deadline, "the sender never blocked"
        assert queue.depth == 2
        # Beyond the queue: one message at each high-water mark, a few in the kernel's socket
        # buffers (a few MB at most). Before options preceded bind, libzmq's default of 1000 applied.
        assert 2 <= sent <= 20
        taken = 0
        while taken < sent:
            taken += len(queue.take(1, learner_version=0, timeout_s=5))
        stats = assert_accounted(queue)
        assert (stats["queue/received"], stats["queue/consumed"]) == (sent, sent)
    finally:
        sender.close()
        queue.close()
