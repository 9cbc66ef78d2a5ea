"""Delta weight pushes (weights.delta): the per-piece encodings, the sender's full/delta cadence and
the receiver's base, a lost delta repaired by a full push, the wire round trip, and the config rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.schema import ConfigError
from asyncgrpo.weights.delta import DeltaBase, DeltaEncoder, apply_piece, encode_piece
from asyncgrpo.weights.zmq import ZmqWeightReceiver, ZmqWeightSender
from asyncgrpo.wire import Heartbeat, WeightsChunk, WireError, decode, encode
from asyncgrpo.wire.messages import DELTA_INDEX, DELTA_MASK, DELTA_VALUES
from tests.unit.test_weights_zmq import ListPublisher, ListSubscriber, Target, model, spec_of


def wire(tensor: torch.Tensor) -> np.ndarray:
    return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


def step(named: list[tuple[str, torch.Tensor]], lr: float, seed: int) -> list[tuple[str, torch.Tensor]]:
    """An Adam-like update: every weight moves by +-lr (most bf16 values stay the same for a small lr)."""
    generator = torch.Generator().manual_seed(seed)
    return [(name, t + lr * torch.randn(t.shape, generator=generator).sign()) for name, t in named]


# ------------------------------------------------------------------------------ encodings


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 400), changed=st.lists(st.integers(0, 399), max_size=400), seed=st.integers(0, 9))
def test_a_piece_applied_onto_its_base_gives_the_new_values_bit_for_bit(size, changed, seed):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    new = old.copy()
    where = np.array(sorted({c % size for c in changed}), dtype=np.int64)
    new[where] ^= rng.integers(1, 1 << 16, where.size, dtype=np.uint16)  # every listed element changes
    encoding, positions, values, count = encode_piece(new, old)
    assert count == where.size
    base = old.copy()
    apply_piece(base, 0, size, encoding, positions, values)
    np.testing.assert_array_equal(base, new)
    # Never larger than the piece itself: a delta piece fits the chunk it was planned in.
    assert values.nbytes + positions.nbytes <= new.nbytes


def test_the_smallest_encoding_is_chosen_for_few_some_and_most_changes():
    old = np.zeros(1024, dtype=np.uint16)
    few, some, most = old.copy(), old.copy(), old.copy()
    few[[3, 700]] = 1
    some[::8] = 1  # 128 of 1,024: a 128-byte mask beats 512 bytes of positions
    most[:1000] = 1
    assert [encode_piece(new, old)[0] for new in (few, some, most)] == [DELTA_INDEX, DELTA_MASK, DELTA_VALUES]


def test_positive_and_negative_zero_count_as_a_change():
    old, new = np.array([0.0], dtype=np.float16), np.array([-0.0], dtype=np.float16)
    assert encode_piece(new, old)[3] == 1


def test_a_piece_whose_positions_leave_its_span_is_refused():
    with pytest.raises(ValueError, match="positions"):
        apply_piece(np.zeros(8, dtype=np.uint16), 0, 4, DELTA_INDEX, np.array([5], dtype=np.int32),
                    np.array([1], dtype=np.uint16))


# --------------------------------------------------------------------------- sender and receiver


def delta_pair(named, chunk_bytes: int = 1 << 12, full_every: int = 20):
    publisher = ListPublisher()
    sender = ZmqWeightSender(publisher, spec_of(named), chunk_bytes, torch.bfloat16, delta=DeltaEncoder(full_every))
    receiver = ZmqWeightReceiver(ListSubscriber([]), DeltaBase())
    return publisher, sender, receiver


def deliver(publisher, receiver, drop=lambda message: False) -> None:
    receiver.subscriber.messages += [m for m in publisher.messages if not drop(m)]
    publisher.messages.clear()
    receiver.poll(0.0)


def assert_holds(target: Target, named) -> None:
    for name, tensor in named:
        np.testing.assert_array_equal(wire(target.loaded[name]), wire(tensor), err_msg=name)


def test_deltas_carry_a_fraction_of_the_bytes_and_rebuild_the_learners_wire_values_exactly():
    named = model([(64, 96), (300,), (40, 40)])  # 300 elements: the second tensor spans chunks
    publisher, sender, receiver = delta_pair(named, chunk_bytes=256)
    target = Target()
    full = sender.push(1, iter(named))
    deliver(publisher, receiver)
    assert receiver.apply_newest(target) == 1
    for version in range(2, 6):
        named = step(named, 1e-4, version)
        sent = sender.push(version, iter(named))
        assert publisher.messages[0].base_version == version - 1
        assert sent < full / 5, (sent, full)
        assert 0 < sender.changed_fraction < 0.2
        deliver(publisher, receiver)
        assert receiver.apply_newest(target) == version
        assert_holds(target, named)


def test_a_full_push_every_full_every_versions():
    named = model([(32, 32)])
    publisher, sender, _ = delta_pair(named, full_every=3)
    kinds = []
    for version in range(1, 8):
        named = step(named, 1e-3, version)
        sender.push(version, iter(named))
        kinds.append("full" if publisher.messages[-1].base_version < 0 else "delta")
        publisher.messages.clear()
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_a_dropped_delta_is_counted_and_the_engine_keeps_its_version_until_a_full_push_repairs_it():
    named = model([(64, 64), (128,)])
    publisher, sender, receiver = delta_pair(named, chunk_bytes=1024)
    target = Target()
    sender.push(1, iter(named))
    deliver(publisher, receiver)
    receiver.apply_newest(target)
    v1 = named
    # Version 2's delta loses one chunk on the way; version 3's delta then names a base it never got.
    named = step(named, 1e-3, 2)
    sender.push(2, iter(named))
    deliver(publisher, receiver, drop=lambda m: m.chunk_index == 1)
    named = step(named, 1e-3, 3)
    sender.push(3, iter(named))
    deliver(publisher, receiver)
    assert receiver.delta_mismatches == 1  # version 3, counted once however many chunks it had
    assert receiver.apply_newest(target) is None
    assert_holds(target, v1)  # the engine still holds version 1 whole: never a torn mix
    # The learner hears of it (heartbeat) and republishes the newest as a full push.
    sender.republish()
    assert all(m.base_version == -1 and m.version == 3 for m in publisher.messages)
    deliver(publisher, receiver)
    assert receiver.apply_newest(target) == 3
    assert_holds(target, named)
    # And deltas apply again onto it.
    named = step(named, 1e-3, 4)
    sender.push(4, iter(named))
    deliver(publisher, receiver)
    assert receiver.apply_newest(target) == 4
    assert_holds(target, named)


def test_a_full_push_of_the_version_whose_delta_is_under_way_replaces_it():
    named = model([(64, 64)])
    publisher, sender, receiver = delta_pair(named, chunk_bytes=1024)
    sender.push(1, iter(named))
    deliver(publisher, receiver)
    named = step(named, 1e-1, 2)
    sender.push(2, iter(named))
    delta = list(publisher.messages)
    publisher.messages.clear()
    sender.republish()  # full version 2
    publisher.messages[:0] = delta[:1]  # the delta's first chunk, then the full push
    deliver(publisher, receiver)
    target = Target()
    assert receiver.apply_newest(target) == 2
    assert_holds(target, named)


def test_a_delta_to_a_receiver_built_without_delta_is_rejected_and_reported():
    named = model([(16, 16)])
    publisher, sender, _ = delta_pair(named)
    sender.push(1, iter(named))
    sender.push(2, iter(step(named, 1e-2, 2)))
    plain = ZmqWeightReceiver(ListSubscriber(publisher.messages))
    plain.poll(0.0)
    assert plain.rejections()[0] == 1 and "weights.delta" in plain.rejections()[1]


# ----------------------------------------------------------------------------------- the wire


def test_a_delta_chunk_round_trips_the_wire():
    chunk = WeightsChunk(version=5, chunk_index=0, num_chunks=1, names=["a", "b", "c"],
                         tensors=[np.array([7, 8], dtype=np.uint16), np.array([9], dtype=np.uint16),
                                  np.arange(4, dtype=np.uint16)],
                         dtypes=["bfloat16"] * 3, shapes=[[100], [20], [4]], offsets=[10, 0, 0], base_version=4,
                         encodings=[DELTA_INDEX, DELTA_MASK, DELTA_VALUES], spans=[50, 20, 4],
                         positions=[np.array([1, 30], dtype=np.int32), np.packbits(np.eye(20, dtype=bool)[3],
                                                                                   bitorder="little"),
                                    np.empty(0, dtype=np.int32)])
    back = decode([bytes(f) for f in encode(chunk)])
    assert (back.base_version, back.encodings, back.spans) == (4, chunk.encodings, chunk.spans)
    for got, want in zip(back.positions + back.tensors, chunk.positions + chunk.tensors):
        np.testing.assert_array_equal(got, want)


def test_a_delta_chunk_whose_span_leaves_its_tensor_is_refused_on_the_wire():
    chunk = WeightsChunk(version=5, chunk_index=0, num_chunks=1, names=["a"], tensors=[np.array([7], dtype=np.uint16)],
                         dtypes=["bfloat16"], shapes=[[10]], offsets=[8], base_version=4, encodings=[DELTA_INDEX],
                         spans=[5], positions=[np.array([0], dtype=np.int32)])
    with pytest.raises(WireError, match="does not fit"):
        decode([bytes(f) for f in encode(chunk)])


def test_a_heartbeats_new_delta_mismatch_asks_for_one_full_push():
    registry = GeneratorRegistry()
    registry.on_heartbeat(Heartbeat(generator_id=0, next_seq=0, version=3, delta_mismatches=1))
    registry.on_heartbeat(Heartbeat(generator_id=0, next_seq=0, version=3, delta_mismatches=1))  # nothing new
    assert registry.take_full_push_requests() == {0: 3}
    assert registry.take_full_push_requests() == {}


# ---------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(("overrides", "message"), [
    (["weights.delta=true"], "16-bit"),  # the toy's engine is float32, so is auto's wire
    (["weights.delta=true", "weights.wire_dtype=bfloat16", "weights.backend=shm"], "local memory copy"),
    (["weights.delta=true", "weights.wire_dtype=bfloat16", "weights.backend=nccl"], "nccl"),
    (["weights.full_every=0"], "weights.full_every"),
])
def test_delta_settings_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load(overrides)
    assert "\n" not in str(err.value)


def test_delta_with_a_16_bit_wire_picks_zmq_over_auto():
    from asyncgrpo.composition import weights_backend

    assert weights_backend(load(["weights.delta=true", "weights.wire_dtype=bfloat16"])) == "zmq"


class CountingSender:
    def __init__(self) -> None:
        self.republished = 0

    def republish(self) -> None:
        self.republished += 1


def test_the_learner_republishes_a_full_push_for_a_generator_that_missed_a_delta_until_it_loads_a_newer_version():
    from asyncgrpo.learner.intake import Rejoins
    from asyncgrpo.wire import VersionAck

    registry, sender = GeneratorRegistry(), CountingSender()
    rejoins = Rejoins(registry, sender)
    registry.on_ack(VersionAck(generator_id=0, version=3))
    rejoins.serve()
    assert sender.republished == 0  # nobody asked
    registry.on_heartbeat(Heartbeat(generator_id=0, next_seq=0, version=3, delta_mismatches=1))
    rejoins.serve()
    assert (sender.republished, rejoins.awaiting, rejoins.delta_repairs) == (1, {0: 4}, 1)
    registry.on_ack(VersionAck(generator_id=0, version=5))  # it loaded the full push
    rejoins.next_republish = 0.0
    rejoins.serve()
    assert (sender.republished, rejoins.awaiting) == (1, {})
