"""Weight pushes of any size over ZeroMQ: the chunk plan, the sender's chunks and the receiver's
assembly, with an in-process publisher and subscriber (lists); the real sockets in the last test."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.weights.zmq import (
    ZmqWeightReceiver,
    ZmqWeightSender,
    chunk_plan,
    wire_dtype_for,
)
from asyncgrpo.wire import Publisher, Shutdown, Subscriber, WeightsChunk, decode, encode
from asyncgrpo.wire.sockets import Rejections


class ListPublisher:
    """Keeps what was published, encoded and decoded as the wire would."""

    endpoint = "inproc://test"

    def __init__(self) -> None:
        self.messages: list[object] = []

    def publish(self, message: object) -> None:
        self.messages.append(decode([bytes(frame) for frame in encode(message)]))

    def close(self) -> None:
        pass


class ListSubscriber:
    def __init__(self, messages: list[object]) -> None:
        self.messages = list(messages)
        self.rejected = Rejections("inproc://test")

    def recv(self, timeout_s: float) -> object | None:
        return self.messages.pop(0) if self.messages else None

    def close(self) -> None:
        pass


class Target:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors) -> None:
        self.loaded = {name: tensor.clone() for name, tensor in named_tensors}


def model(sizes: list[tuple[int, ...]], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.weight", torch.randn(*shape, generator=generator)) for i, shape in enumerate(sizes)]


def spec_of(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in named]


def push_and_receive(named, chunk_bytes: int, wire_dtype=torch.float32, version: int = 1):
    publisher = ListPublisher()
    sender = ZmqWeightSender(publisher, spec_of(named), chunk_bytes, wire_dtype)
    sent = sender.push(version, iter(named))  # a generator: gathered lazily, tensor by tensor
    receiver = ZmqWeightReceiver(ListSubscriber(publisher.messages))
    assert receiver.poll(0.0)
    target = Target()
    assert receiver.apply_newest(target) == version
    return publisher.messages, sent, target.loaded


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 5000), min_size=1, max_size=12), chunk_elements=st.integers(1, 3000))
def test_the_chunk_plan_covers_every_tensor_once_in_order_within_the_chunk_size(numels, chunk_elements):
    plan = chunk_plan(numels, itemsize=4, chunk_bytes=chunk_elements * 4)
    assert all(sum(p.stop - p.start for p in chunk) <= chunk_elements for chunk in plan)
    assert all(chunk for chunk in plan)
    pieces = [p for chunk in plan for p in chunk]
    for index, numel in enumerate(numels):
        mine = [p for p in pieces if p.index == index]
        assert mine[0].start == 0 and mine[-1].stop == numel
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
    assert [p.index for p in pieces] == sorted(p.index for p in pieces)


def test_a_tensor_larger_than_a_chunk_is_split_and_reassembled_exactly():
    named = model([(300, 40), (7,), (2, 3), (1000,)])
    chunk_bytes = 4096
    messages, sent, loaded = push_and_receive(named, chunk_bytes)
    chunks = [m for m in messages if isinstance(m, WeightsChunk)]
    assert len(chunks) > 12 and all(sum(t.nbytes for t in c.tensors) <= chunk_bytes for c in chunks)
    assert sent == sum(t.numel() for _, t in named) * 4
    assert list(loaded) == [name for name, _ in named]
    for name, tensor in named:
        assert torch.equal(loaded[name], tensor), name


def test_bfloat16_on_the_wire_halves_the_bytes():
    named = model([(64, 64), (64,)])
    _, sent32, _ = push_and_receive(named, 1 << 20, torch.float32)
    _, sent16, loaded = push_and_receive(named, 1 << 20, torch.bfloat16)
    assert sent16 * 2 == sent32
    assert loaded["layer0.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded["layer0.weight"].float(), named[0][1], atol=0.02, rtol=0.01)


def test_wire_dtype_auto_follows_the_engine():
    assert wire_dtype_for("auto", "bfloat16") == torch.bfloat16
    assert wire_dtype_for("auto", "float32") == torch.float32
    assert wire_dtype_for("float32", "bfloat16") == torch.float32


def test_a_push_that_does_not_match_the_model_is_refused():
    named = model([(4, 4), (4,)])
    sender = ZmqWeightSender(ListPublisher(), spec_of(named), 1 << 20, torch.float32)
    with pytest.raises(ValueError, match="layer1.weight"):
        sender.push(1, iter([named[0], ("layer1.weight", torch.zeros(5))]))


def test_a_newer_push_replaces_a_partial_one_and_stale_chunks_are_skipped():
    named_v1, named_v2 = model([(50, 20)], seed=1), model([(50, 20)], seed=2)
    first, second = ListPublisher(), ListPublisher()
    ZmqWeightSender(first, spec_of(named_v1), 1000, torch.float32).push(1, named_v1)
    ZmqWeightSender(second, spec_of(named_v2), 1000, torch.float32).push(2, named_v2)
    # Half of version 1, all of version 2, then the rest of version 1 (late) and a duplicate.
    half = len(first.messages) // 2
    stream = first.messages[:half] + second.messages + first.messages[half:] + second.messages[:1]
    receiver = ZmqWeightReceiver(ListSubscriber(stream))
    receiver.poll(0.0)
    target = Target()
    assert receiver.apply_newest(target) == 2 and receiver.apply_newest(target) is None
    assert torch.equal(target.loaded["layer0.weight"], named_v2[0][1])
    assert receiver._assembly is None  # nothing of version 1 is kept
    assert receiver.rejections() == (0, "")


def test_an_inconsistent_push_is_rejected_counted_and_reported():
    named = model([(40, 10)])
    publisher = ListPublisher()
    ZmqWeightSender(publisher, spec_of(named), 400, torch.float32).push(3, named)
    bad = publisher.messages[1]
    bad.num_chunks += 1  # disagrees with the chunks before it
    receiver = ZmqWeightReceiver(ListSubscriber(publisher.messages))
    assert not receiver.poll(0.0)
    count, reason = receiver.rejections()
    assert count == 1 and "chunk counts" in reason
    assert receiver.apply_newest(Target()) is None


def test_shutdown_is_heard():
    receiver = ZmqWeightReceiver(ListSubscriber([Shutdown(reason="done")]))
    assert receiver.poll(0.0) and receiver.shutdown_reason == "done"


def test_a_push_larger_than_the_message_limit_crosses_real_sockets():
    max_message_bytes, chunk_bytes = 1 << 20, 256 << 10
    named = model([(600, 1000), (3,)])  # 2.4 MB: larger than a message
    assert named[0][1].numel() * 4 > max_message_bytes
    publisher = Publisher()
    subscriber = Subscriber(publisher.endpoint, max_message_bytes=max_message_bytes)
    try:
        sender = ZmqWeightSender(publisher, spec_of(named), chunk_bytes, torch.float32)
        receiver = ZmqWeightReceiver(subscriber)
        deadline = time.monotonic() + 30
        version = 0
        while receiver.newest_version < 0:  # a PUB/SUB subscription takes a moment to start
            assert time.monotonic() < deadline, "no push arrived"
            version += 1
            sender.push(version, named)
            receiver.poll(0.5)
        target = Target()
        assert receiver.apply_newest(target) >= 1
        assert all(torch.equal(target.loaded[name], t) for name, t in named)
        assert receiver.rejections() == (0, "")
        assert len(sender.plan) >= math.ceil(named[0][1].numel() * 4 / chunk_bytes)
    finally:
        subscriber.close()
        publisher.close()


def test_a_chunk_over_the_receivers_limit_is_rejected_with_its_reason():
    named = model([(200, 100)])  # 80 kB in one chunk
    publisher = Publisher()
    subscriber = Subscriber(publisher.endpoint, max_message_bytes=16 << 10)
    try:
        sender = ZmqWeightSender(publisher, spec_of(named), 1 << 20, torch.float32)
        receiver = ZmqWeightReceiver(subscriber)
        deadline = time.monotonic() + 30
        while receiver.rejections()[0] == 0:
            assert time.monotonic() < deadline, "nothing was rejected"
            sender.push(1, named)
            receiver.poll(0.5)
        count, reason = receiver.rejections()
        assert count >= 1 and "too_large" in reason
        assert receiver.newest_version == -1
    finally:
        subscriber.close()
        publisher.close()


def test_pieces_are_views_on_one_private_copy():
    tensor = torch.arange(10, dtype=torch.float32)
    publisher = ListPublisher()
    sender = ZmqWeightSender(publisher, [("w", (10,), torch.float32)], 16, torch.float32)
    sender.push(1, [("w", tensor)])
    tensor += 1  # the optimizer updates in place after push() returns
    receiver = ZmqWeightReceiver(ListSubscriber(publisher.messages))
    receiver.poll(0.0)
    target = Target()
    receiver.apply_newest(target)
    assert np.array_equal(target.loaded["w"].numpy(), np.arange(10, dtype=np.float32))


def test_a_republish_gives_a_late_subscriber_the_newest_push_and_nothing_new_to_one_that_has_it():
    named = model([(300, 17), (5,)])
    publisher = ListPublisher()
    sender = ZmqWeightSender(publisher, spec_of(named), 4096, torch.float32, keep_newest=True)
    sender.republish()
    assert publisher.messages == []  # nothing pushed yet: generators start from that version anyway
    early = ZmqWeightReceiver(ListSubscriber([]))
    for version in (1, 2):
        sender.push(version, iter([(n, t + version) for n, t in named]))
    early.subscriber.messages.extend(publisher.messages)
    assert early.poll(0.0) and early.apply_newest(Target()) == 2
    publisher.messages.clear()
    sender.republish()  # a restarted generator subscribed after version 2 went out
    late = ZmqWeightReceiver(ListSubscriber(list(publisher.messages)))
    target = Target()
    assert late.poll(0.0) and late.apply_newest(target) == 2
    assert all(torch.equal(target.loaded[n], t + 2) for n, t in named)
    early.subscriber.messages.extend(publisher.messages)
    assert not early.poll(0.0) and early.apply_newest(Target()) is None


def test_a_sender_that_keeps_nothing_cannot_republish():
    sender = ZmqWeightSender(ListPublisher(), spec_of(model([(4,)])), 4096, torch.float32)
    with pytest.raises(RuntimeError, match="keep_newest"):
        sender.republish()
