"""Fuzzing: mutated and random messages into `decode_group` and into a live queue socket.

The only acceptable outcomes are a decoded message or `WireError`, and for a decoded group an
answer from the learner's `GroupLimits` (trainable, or a reason); the live queue must count every
rejection and still serve valid groups afterwards.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from asyncgrpo.queue.replay_queue import GroupLimits, ReplayQueue, StalenessEviction
from asyncgrpo.wire import (
    Heartbeat,
    Receiver,
    SaveNotice,
    ScoredGroup,
    Sender,
    Shutdown,
    VersionAck,
    WeightsChunk,
    WireError,
    decode,
    decode_group,
    encode,
    example_group,
)

MESSAGES_PER_TARGET = 10_000
MAX_MESSAGE_BYTES = 1 << 20
# Loose enough for every seed group (example_group: ids < 32000, 64 prompt tokens, up to 4 x 40
# completion tokens), so only what a mutation did can break them.
LIMITS = GroupLimits(vocab_size=32000, max_positions=128, max_samples=4)
LIMIT_REASONS = {"empty_prompt", "too_many_samples", "too_long", "token_out_of_vocab"}

INTERESTING = [
    None, True, False, -1, 0, 1, 7, 2**31 - 1, 2**31, 2**62, 2**63, 2**64 - 1, -(2**63), 0.5, -0.0,
    float("nan"), float("inf"), float("-inf"), 1e300, "", "int32", "float32", "x" * 300, b"", b"\x00" * 9,
    [], [0], [-1, 2], [["int32", [1]]], ["int32", [2**40]], {}, {"a": 1}, {"version": [1]},
    msgpack.ExtType(1, b"\x00"),
]

Frames = list[bytes]


def seed_messages(rng: np.random.Generator) -> list[Frames]:
    """Valid messages of every type, as bytes frames."""
    groups = [example_group(int(rng.integers(1, 5)), int(rng.integers(0, 40)), seed=int(rng.integers(1 << 30)))
              for _ in range(6)]
    controls: list[Any] = [
        VersionAck(generator_id=1, version=3),
        Heartbeat(generator_id=2, next_seq=5, version=1),
        Shutdown(reason="done"),
        SaveNotice(version=4, saving=True, timeout_s=1800.0),
        WeightsChunk(version=1, chunk_index=0, num_chunks=1, names=["w"],
                     tensors=[np.ones(6, dtype=np.float32)], dtypes=["float32"], shapes=[[2, 3]], offsets=[0]),
    ]
    return [[bytes(f) for f in encode(message)] for message in groups + controls]


def random_bytes(rng: np.random.Generator, max_len: int) -> bytes:
    return rng.integers(0, 256, size=int(rng.integers(0, max_len + 1)), dtype=np.uint8).tobytes()


def interesting(rng: np.random.Generator) -> Any:
    return INTERESTING[int(rng.integers(len(INTERESTING)))]


def flip_bits(rng: np.random.Generator, frames: Frames) -> Frames:
    index = int(rng.integers(len(frames)))
    data = bytearray(frames[index])
    for _ in range(int(rng.integers(1, 9))):
        if data:
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    return frames[:index] + [bytes(data)] + frames[index + 1:]


def resize_frame(rng: np.random.Generator, frames: Frames) -> Frames:
    index = int(rng.integers(len(frames)))
    data = frames[index]
    if rng.random() < 0.5 and data:
        data = data[: int(rng.integers(len(data)))]
    else:
        data = data + random_bytes(rng, 16)
    return frames[:index] + [data] + frames[index + 1:]


def reshuffle_frames(rng: np.random.Generator, frames: Frames) -> Frames:
    frames = list(frames)
    choice = int(rng.integers(4))
    index = int(rng.integers(len(frames)))
    if choice == 0:
        del frames[index]
    elif choice == 1:
        frames.insert(index, frames[index])
    elif choice == 2:
        frames.append(random_bytes(rng, 32))
    else:
        other = int(rng.integers(len(frames)))
        frames[index], frames[other] = frames[other], frames[index]
    return frames


def parsed_header(frames: Frames) -> dict[str, Any] | None:
    """The header of an earlier mutation's output, if it still is a map."""
    try:
        header = msgpack.unpackb(frames[0], strict_map_key=False)
    except Exception:  # noqa: BLE001 - a previous mutation broke it: any error means "not a map"
        return None
    return header if isinstance(header, dict) else None


def edit_header(rng: np.random.Generator, frames: Frames) -> Frames:
    header = parsed_header(frames)
    if header is None:
        return flip_bits(rng, frames)
    keys = list(header) + ["extra"]
    key = keys[int(rng.integers(len(keys)))]
    action = rng.random()
    if action < 0.15:
        header.pop(key, None)
    elif action < 0.4 and isinstance(header.get(key), list) and header[key]:
        items = header[key]
        position = int(rng.integers(len(items)))
        items[position] = interesting(rng) if rng.random() < 0.7 else [items[position], interesting(rng)]
    else:
        header[key] = interesting(rng)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def edit_descriptor(rng: np.random.Generator, frames: Frames) -> Frames:
    header = parsed_header(frames)
    if header is None or not isinstance(header.get("a"), list) or not header["a"]:
        return edit_header(rng, frames)
    descriptor = header["a"][int(rng.integers(len(header["a"])))]
    if not (isinstance(descriptor, list) and len(descriptor) == 2):
        return edit_header(rng, frames)
    if rng.random() < 0.5:
        descriptor[0] = ["int32", "int64", "uint8", "float32", "float16", "bfloat16", "complex", 3][int(rng.integers(8))]
    else:
        descriptor[1] = [int(rng.integers(-2, 50))] if rng.random() < 0.7 else interesting(rng)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def poison_array(rng: np.random.Generator, frames: Frames) -> Frames:
    if len(frames) < 2:
        return flip_bits(rng, frames)
    index = int(rng.integers(1, len(frames)))
    data = bytearray(frames[index])
    if len(data) >= 4:
        value = [np.float32(np.nan), np.float32(np.inf), np.float32(0.25), np.int32(-5), np.int32(2**31 - 1)][
            int(rng.integers(5))]
        offset = 4 * int(rng.integers(len(data) // 4))
        data[offset:offset + 4] = np.array([value]).tobytes()[:4]
    return frames[:index] + [bytes(data)] + frames[index + 1:]


def random_message(rng: np.random.Generator, frames: Frames) -> Frames:
    header: Any = {str(k): interesting(rng) for k in ("v", "t", "gen", "a")[: int(rng.integers(5))]}
    if rng.random() < 0.5:
        header["v"], header["t"] = 2, int(rng.integers(0, 7))
    head = msgpack.packb(header, use_bin_type=True) if rng.random() < 0.7 else random_bytes(rng, 64)
    return [head] + [random_bytes(rng, 64) for _ in range(int(rng.integers(0, 6)))]


MUTATORS: list[Callable[[np.random.Generator, Frames], Frames]] = [
    flip_bits, resize_frame, reshuffle_frames, edit_header, edit_descriptor, poison_array, random_message,
]


def fuzzed_messages(seed: int, count: int) -> Iterator[tuple[str, Frames]]:
    rng = np.random.default_rng(seed)
    seeds = seed_messages(rng)
    for _ in range(count):
        frames = seeds[int(rng.integers(len(seeds)))]
        mutator = MUTATORS[int(rng.integers(len(MUTATORS)))]
        for _ in range(int(rng.integers(1, 3))):  # sometimes stack two mutations
            frames = mutator(rng, frames) if frames else random_message(rng, frames)
        yield mutator.__name__, frames or [b""]  # ZeroMQ has no message of zero frames


def classify(frames: Frames) -> str:
    """What the receiving side must make of a message: 'group', 'control' or 'rejected'."""
    try:
        message = decode(frames, MAX_MESSAGE_BYTES)
    except WireError:
        return "rejected"
    if isinstance(message, ScoredGroup):
        return "group"
    return "control" if isinstance(message, VersionAck | Heartbeat) else "rejected"  # downstream type upstream


def test_fuzzed_input_decodes_or_raises_wire_error_and_the_limits_name_a_reason() -> None:
    outcomes = {"decoded": 0, "rejected": 0, "untrainable": 0}
    crashes = []
    for mutator, frames in fuzzed_messages(seed=1, count=MESSAGES_PER_TARGET):
        try:
            group = decode_group(frames, MAX_MESSAGE_BYTES)
        except WireError:
            outcomes["rejected"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - any other exception is the failure being hunted
            crashes.append(f"{mutator}: {type(err).__name__}: {err}")
            continue
        try:
            problem = LIMITS.untrainable(group)
        except Exception as err:  # noqa: BLE001 - the limits must answer for anything that decodes
            crashes.append(f"{mutator}, limits: {type(err).__name__}: {err}")
            continue
        assert problem is None or problem[0] in LIMIT_REASONS, problem
        outcomes["untrainable" if problem else "decoded"] += 1
    assert not crashes, f"{len(crashes)} crashes, e.g. {crashes[:5]}"
    assert sum(outcomes.values()) == MESSAGES_PER_TARGET
    assert outcomes["rejected"] > MESSAGES_PER_TARGET // 2, outcomes
    assert outcomes["untrainable"] > 0, outcomes


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def take_until(queue: ReplayQueue, wanted: set[tuple[int, int]], timeout_s: float) -> dict[tuple[int, int], ScoredGroup]:
    found: dict[tuple[int, int], ScoredGroup] = {}
    deadline = time.monotonic() + timeout_s
    while not wanted <= found.keys():
        for group in queue.take(1, learner_version=0, timeout_s=max(0.1, deadline - time.monotonic())):
            found[group.group_id] = group
    return found


def send_valid_groups_and_check_they_are_served(queue: ReplayQueue, count: int = 8) -> None:
    generator_id = next(i for i in itertools.count(1 << 61) if i not in queue.registry.generators)  # fresh sequence
    originals = []
    sender = Sender(queue.receiver.endpoint)
    try:
        for seq in range(count):
            group = example_group(num_samples=4, tokens_per_sample=16, seed=seq)
            group.generator_id, group.seq = generator_id, seq
            sender.send(group, timeout_s=10)
            originals.append(group)
        served = take_until(queue, {g.group_id for g in originals}, timeout_s=20)
    finally:
        sender.close()
    for original in originals:
        np.testing.assert_array_equal(served[original.group_id].tokens, original.tokens)
        np.testing.assert_array_equal(served[original.group_id].logprobs, original.logprobs)


@pytest.fixture
def live_queue() -> Iterator[ReplayQueue]:
    receiver = Receiver(max_message_bytes=MAX_MESSAGE_BYTES, high_water_mark=64)
    # No limits: `classify` mirrors the codec alone (whether an untrainable group is rejected or a
    # duplicate depends on the sequence numbers before it).
    # Room for every fuzzed group that happens to be valid: a full queue would block the stream.
    queue = ReplayQueue(receiver, 1 << 20, StalenessEviction(1 << 40, drop_stale=True), limits=None,
                        poll_interval_s=0.01).start()
    yield queue
    queue.close()


def test_live_queue_counts_every_fuzzed_message_and_keeps_serving(live_queue: ReplayQueue) -> None:
    expected = {"group": 0, "control": 0, "rejected": 0}
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(live_queue.receiver.endpoint)
    try:
        for _, frames in fuzzed_messages(seed=2, count=MESSAGES_PER_TARGET):
            expected[classify(frames)] += 1
            push.send_multipart(frames)
        # Several frames each under the limit, together over it.
        half = b"\x00" * (MAX_MESSAGE_BYTES // 2 + 1)
        push.send_multipart([msgpack.packb({"v": 2, "t": 1}), half, half])
        expected["rejected"] += 1

        def all_arrived() -> bool:
            stats = live_queue.stats()
            # A valid group is received, a duplicate, or (a fuzzed incarnation below one seen before)
            # a late group of a replaced generator process.
            return (stats["wire/rejected"] == expected["rejected"]
                    and stats["queue/received"] + stats["queue/duplicates"] + stats["queue/old_incarnation"]
                    == expected["group"])

        wait_for(all_arrived, timeout_s=60)
    finally:
        push.close(linger=0)
    stats = live_queue.stats()
    assert stats["queue/received"] == (
        stats["queue/consumed"] + stats["queue/dropped_stale"] + stats["queue/dropped_unheld"] + stats["queue/depth"])
    assert stats["wire/rejected/too_large"] >= 1
    assert expected["rejected"] > MESSAGES_PER_TARGET // 2, expected
    send_valid_groups_and_check_they_are_served(live_queue)


def test_a_frame_over_the_limit_drops_only_its_connection(live_queue: ReplayQueue) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(live_queue.receiver.endpoint)
    try:
        # libzmq refuses the frame before allocating it and drops the connection; nothing reaches
        # the decoder, so nothing is counted; the sender's gap would show up as `lost`.
        push.send_multipart([b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        time.sleep(0.2)
        assert live_queue.stats()["queue/received"] == 0
    finally:
        push.close(linger=0)
    send_valid_groups_and_check_they_are_served(live_queue)
