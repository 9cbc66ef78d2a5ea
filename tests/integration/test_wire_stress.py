"""Stress: 4 producer processes x 5,000 groups into a small queue with a slow consumer.

The accounting identity must hold exactly, no group may be consumed twice, nothing may be lost on
loopback, and the queue may never hold more than its capacity.

Over ipc the producers stay connected until the consumer has everything: a Unix socket whose
writer exits reports a hang-up, and libzmq then drops the connection with what the reader had not
read yet (docs/WIRE.md, "Transport"); TCP delivers it, so there the producers exit right away.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import zmq

from asyncgrpo.queue.replay_queue import ReplayQueue, StalenessEviction
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import Heartbeat, Receiver, Sender, example_group

PRODUCERS = 4
GROUPS_PER_PRODUCER = 5_000
TOTAL = PRODUCERS * GROUPS_PER_PRODUCER
CAPACITY = 8
BATCH = 4
LEARNER_VERSION = 5
MAX_STALENESS = 2
VERSION_CYCLE = 7  # group seq carries version seq % 7: versions 0, 1, 2 are too stale at version 5
TIMEOUT_S = 120.0


def produce(endpoint: str, generator_id: int, count: int, done: Any = None) -> None:
    sender = Sender(endpoint, high_water_mark=4)
    group = example_group(num_samples=2, tokens_per_sample=8, seed=generator_id)
    group.generator_id = generator_id
    for seq in range(count):
        group.seq = seq
        group.versions[:] = seq % VERSION_CYCLE
        sender.send(group, timeout_s=TIMEOUT_S)
    sender.send(Heartbeat(generator_id=generator_id, next_seq=count, version=0), timeout_s=TIMEOUT_S)
    if done is not None:
        done.wait(TIMEOUT_S)
    sender.close(linger_s=TIMEOUT_S)  # deliver everything before the process exits
    zmq.Context.instance().term()


def too_stale(seq: int) -> bool:
    return LEARNER_VERSION - seq % VERSION_CYCLE > MAX_STALENESS


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_accounting_is_exact_under_four_producers_and_a_slow_consumer(transport: str) -> None:
    # The queue's accounting, not authentication, is under test: tcp without CURVE.
    queue = ReplayQueue(Receiver(high_water_mark=4, transport=transport, insecure=True), CAPACITY,
                        StalenessEviction(MAX_STALENESS, drop_stale=True),
                        limits=None, poll_interval_s=0.01).start()
    spawn = mp.get_context("spawn")
    done = spawn.Event() if transport == "ipc" else None
    producers = [spawn.Process(target=produce, args=(queue.receiver.endpoint, g, GROUPS_PER_PRODUCER, done))
                 for g in range(PRODUCERS)]
    consumed: list[tuple[int, int]] = []
    deepest = 0
    try:
        for producer in producers:
            producer.start()
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, f"consumer timed out: {queue.stats()}"
            deepest = max(deepest, queue.depth)
            try:
                batch = queue.take(BATCH, LEARNER_VERSION, timeout_s=0.2)
            except QueueTimeout:
                stats = queue.stats()
                if stats["queue/received"] + stats["queue/lost"] == TOTAL:
                    break
                continue
            assert all(not too_stale(g.seq) for g in batch)
            consumed.extend(g.group_id for g in batch)
            time.sleep(0.0005)  # the slow learner
        while True:  # the last groups, fewer than a batch
            try:
                consumed.extend(g.group_id for g in queue.take(1, LEARNER_VERSION, timeout_s=0.2))
            except QueueTimeout:
                break
        if done is not None:
            done.set()
        for producer in producers:
            producer.join(timeout=30)
            assert producer.exitcode == 0
        stats = queue.stats()
    finally:
        for producer in producers:
            if producer.is_alive():
                producer.kill()
        queue.close()

    assert stats["queue/received"] == TOTAL, stats
    assert stats["queue/lost"] == 0 and stats["queue/duplicates"] == 0 and stats["wire/rejected"] == 0, stats
    assert stats["queue/depth"] == 0, stats
    assert stats["queue/received"] == (
        stats["queue/consumed"] + stats["queue/dropped_stale"] + stats["queue/dropped_unheld"] + stats["queue/depth"])
    assert len(consumed) == stats["queue/consumed"] == len(set(consumed)), "a group was consumed twice"
    assert deepest <= CAPACITY and stats["queue/peak_depth"] <= CAPACITY, (deepest, stats)
    stale_sent = PRODUCERS * sum(too_stale(seq) for seq in range(GROUPS_PER_PRODUCER))
    assert stats["queue/dropped_stale"] == stale_sent
    assert stats["queue/consumed"] == TOTAL - stale_sent
