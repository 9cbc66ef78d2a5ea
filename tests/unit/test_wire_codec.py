"""The wire codec: lossless zero-copy round trips, and `WireError` (only) for every malformed input."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import asyncgrpo.wire
from asyncgrpo.wire import (
    SCHEMA_VERSION,
    Grant,
    Heartbeat,
    MsgType,
    ScoredGroup,
    Shutdown,
    TicketRequest,
    VersionAck,
    WeightsChunk,
    WireError,
    decode,
    decode_group,
    encode,
    encode_group,
    example_group,
)
from asyncgrpo.wire.codec import MAX_ARRAYS, MAX_HEADER_BYTES, MAX_REJECTION_CHARS, max_frames

INT62 = st.integers(0, (1 << 62) - 1)
FLOAT32 = {"width": 32, "allow_nan": False, "allow_infinity": False}
FLOAT32_MAX = float(np.finfo(np.float32).max)


@st.composite
def scored_groups(draw: st.DrawFn) -> ScoredGroup:
    lengths = draw(hnp.arrays(np.int32, draw(st.integers(1, 6)), elements=st.integers(0, 24)))
    total = int(lengths.sum())
    vmin = draw(st.integers(0, (1 << 31) - 2))
    vmax = draw(st.integers(vmin, min(vmin + 5, (1 << 31) - 1)))
    versions = draw(hnp.arrays(np.int32, total, elements=st.integers(vmin, vmax)))
    meta = draw(st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.floats(-FLOAT32_MAX, FLOAT32_MAX), st.text()),
        max_size=3,
    ))
    # Drawn last: 1 = the policy sampled the token, 0 = an environment inserted it (its version is
    # ignored, so anything goes there; the header's vmin/vmax are the policy tokens' extremes).
    policy_mask = draw(hnp.arrays(np.uint8, total, elements=st.integers(0, 1)))
    policy = np.flatnonzero(policy_mask)
    env_versions = draw(hnp.arrays(np.int32, total, elements=st.integers(-(1 << 31), (1 << 31) - 1)))
    versions = np.where(policy_mask == 1, versions, env_versions).astype(np.int32)
    if policy.size:
        versions[policy[0]], versions[policy[-1]] = vmin, vmax
    if not policy.size and "version" in meta:  # without policy tokens, meta's version is the group's version
        meta["version"] = vmin
    return ScoredGroup(
        generator_id=draw(INT62),
        seq=draw(INT62),
        prompt_id=draw(INT62),
        prompt_tokens=draw(hnp.arrays(np.int32, draw(st.integers(0, 16)), elements=st.integers(0, (1 << 31) - 1))),
        tokens=draw(hnp.arrays(np.int32, total, elements=st.integers(0, (1 << 31) - 1))),
        logprobs=draw(hnp.arrays(np.float32, total, elements=st.floats(max_value=0.0, **FLOAT32))),
        versions=versions,
        lengths=lengths,
        rewards=draw(hnp.arrays(np.float32, lengths.size, elements=st.floats(**FLOAT32))),
        meta=meta,
        incarnation=draw(INT62),
        pos=draw(INT62),
        truncated=draw(hnp.arrays(np.uint8, lengths.size, elements=st.integers(0, 1))),
        policy_mask=policy_mask,
    )


def assert_same_group(decoded: ScoredGroup, original: ScoredGroup) -> None:
    assert decoded.group_id == original.group_id
    assert (decoded.incarnation, decoded.pos) == (original.incarnation, original.pos)
    assert decoded.prompt_id == original.prompt_id
    for name in ("prompt_tokens", "tokens", "logprobs", "versions", "lengths", "rewards", "truncated", "policy_mask"):
        got, want = getattr(decoded, name), getattr(original, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert (decoded.version_min, decoded.version_max) == (original.version_min, original.version_max)
    expected_meta = dict(original.meta)
    if not original.policy_tokens:
        expected_meta.setdefault("version", original.version_min)
    assert decoded.meta == expected_meta


def shares_memory_with_frames(array: np.ndarray, frames: list[Any]) -> bool:
    return any(np.shares_memory(array, np.frombuffer(getattr(f, "buffer", f), dtype=np.uint8)) for f in frames)


@settings(max_examples=100, deadline=None)
@given(scored_groups())
def test_round_trip_is_lossless_and_zero_copy(group: ScoredGroup) -> None:
    frames = [bytes(frame) for frame in encode_group(group)]  # as received: fresh buffers
    decoded = decode_group(frames)
    assert_same_group(decoded, group)
    for name in ("prompt_tokens", "tokens", "logprobs", "versions", "policy_mask"):
        array = getattr(decoded, name)
        assert array.size == 0 or shares_memory_with_frames(array, frames), name


def test_arrays_decoded_from_zmq_frames_are_views_numpy_and_torch() -> None:
    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        group = example_group(num_samples=4, tokens_per_sample=4096)
        push.send_multipart(encode_group(group), copy=False)
        assert pull.poll(5000)
        frames = pull.recv_multipart(copy=False)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
    decoded = decode_group(frames)
    assert_same_group(decoded, group)
    for name in ("tokens", "logprobs", "versions"):
        array = getattr(decoded, name)
        assert shares_memory_with_frames(array, frames), name
        assert torch.from_numpy(array).data_ptr() == array.ctypes.data


def test_encode_sends_views_of_the_groups_arrays() -> None:
    group = example_group()
    _, prompt, tokens, logprobs, versions, policy_mask = encode_group(group)
    for frame, array in ((prompt, group.prompt_tokens), (tokens, group.tokens), (logprobs, group.logprobs),
                         (versions, group.versions), (policy_mask, group.policy_mask)):
        assert np.shares_memory(np.frombuffer(frame, dtype=np.uint8), array)


def test_example_group_is_valid_and_seeded() -> None:
    group = example_group(num_samples=8, tokens_per_sample=512, seed=3)
    assert group.num_samples == 8 and group.tokens.size == 8 * 512
    assert_same_group(decode_group(encode_group(group)), group)
    np.testing.assert_array_equal(example_group(seed=3).tokens, group.tokens)
    assert not np.array_equal(example_group(seed=4).tokens, group.tokens)


@pytest.mark.parametrize("message", [
    VersionAck(generator_id=3, version=7),
    VersionAck(generator_id=3, version=7, incarnation=2),
    Heartbeat(generator_id=1, next_seq=42, version=5),
    Heartbeat(generator_id=1, next_seq=0, version=5, incarnation=3),
    Heartbeat(generator_id=1, next_seq=42, version=5, reward_errors=3, reward_calls=64,
              reward_first_errors={"judge": "JudgeError: judge failed 4 tries", "fn": "KeyError: 'x'"}),
    Shutdown(reason="training finished"),
    TicketRequest(generator_id=2, incarnation=1, request=9, version=4, wanted=8, newest_grant=3),
    TicketRequest(generator_id=0, incarnation=0, request=1, version=0, wanted=2, newest_grant=0,
                  unsent=[5, 7], given_back=[6]),
    Grant(request=9, grant=4),
    Grant(request=9, grant=4, slots=[16, 17], positions=[30, 31]),
])
def test_control_messages_round_trip(message: Any) -> None:
    assert decode(encode(message)) == message


@pytest.mark.parametrize("first_errors", [{"judge": 3}, {"judge": ["text"]}, [["judge", "text"]], "judge: text"])
def test_a_heartbeat_whose_first_errors_are_not_texts_by_term_is_refused(first_errors: Any) -> None:
    head, *frames = encode(Heartbeat(generator_id=0, next_seq=0, version=0))
    header = msgpack.unpackb(head)
    header["reward_first_errors"] = first_errors
    with pytest.raises(WireError) as raised:
        decode([msgpack.packb(header), *frames])
    assert raised.value.reason == "bad_field"


@pytest.mark.parametrize(("message", "field", "value"), [
    (TicketRequest(0, 0, 1, 0, 2, 0), "unsent", [-1]),
    (TicketRequest(0, 0, 1, 0, 2, 0), "given_back", ["3"]),
    (TicketRequest(0, 0, 1, 0, 2, 0), "unsent", list(range(70000))),
    (TicketRequest(0, 0, 1, 0, 2, 0), "wanted", -2),
    (Grant(1, 1, [3], [4]), "positions", [4, 5]),
    (Grant(1, 1, [3], [4]), "slots", 3),
])
def test_a_malformed_ticket_request_or_grant_is_refused_as_a_bad_field(message, field, value) -> None:
    frames = encode(message)
    header = msgpack.unpackb(frames[0])
    header[field] = value
    with pytest.raises(WireError, match="bad_field"):
        decode([msgpack.packb(header), *frames[1:]])


def test_a_heartbeats_first_errors_are_truncated_like_its_rejection() -> None:
    beat = decode(encode(Heartbeat(generator_id=0, next_seq=0, version=0, reward_first_errors={"judge": "x" * 5000})))
    assert len(beat.reward_first_errors["judge"]) == MAX_REJECTION_CHARS


def test_weights_chunk_round_trips_bfloat16_and_pieces() -> None:
    weight = torch.randn(3, 5, dtype=torch.bfloat16)
    chunk = WeightsChunk(
        version=4, chunk_index=1, num_chunks=2, names=["a.weight", "b.bias"],
        tensors=[weight.view(torch.int16).numpy().view(np.uint16).reshape(-1), np.arange(2, dtype=np.float32)],
        dtypes=["bfloat16", "float32"], shapes=[[3, 5], [7]], offsets=[0, 5],
    )
    decoded = decode(encode(chunk))
    assert isinstance(decoded, WeightsChunk)
    assert (decoded.version, decoded.chunk_index, decoded.num_chunks, decoded.names, decoded.dtypes,
            decoded.shapes, decoded.offsets) == (4, 1, 2, ["a.weight", "b.bias"], ["bfloat16", "float32"],
                                                 [[3, 5], [7]], [0, 5])
    restored = torch.from_numpy(decoded.tensors[0].view(np.int16)).view(torch.bfloat16).view(3, 5)
    assert torch.equal(restored, weight)
    np.testing.assert_array_equal(decoded.tensors[1], np.arange(2, dtype=np.float32))


@pytest.mark.parametrize(("shapes", "offsets", "why"), [
    ([[4]], [3], "does not fit"),  # 2 elements at offset 3 of a 4-element tensor
    ([[1]], [0], "does not fit"),
    ([[4]], [-1], "does not fit"),
    ([[4], [4]], [0], "one shape and one offset"),
    ([["4"]], [0], "list of sizes"),
])
def test_a_weight_piece_that_does_not_fit_its_tensor_is_rejected(shapes, offsets, why) -> None:
    chunk = WeightsChunk(version=1, chunk_index=0, num_chunks=1, names=["w"], tensors=[np.ones(2, np.float32)],
                         dtypes=["float32"], shapes=[[4]], offsets=[0])
    frames = encode(chunk)
    header = msgpack.unpackb(frames[0])
    header["shapes"], header["offsets"] = shapes, offsets
    with pytest.raises(WireError, match=why):
        decode([msgpack.packb(header), *frames[1:]])


# ------------------------------------------------------------------------------- malformed input


def group_frames(**header_changes: Any) -> list[Any]:
    """A valid group's frames with header fields replaced (a value of `...` deletes the field)."""
    frames = [bytes(frame) for frame in encode_group(example_group(num_samples=2, tokens_per_sample=4))]
    header = msgpack.unpackb(frames[0])
    for key, value in header_changes.items():
        if value is ...:
            del header[key]
        else:
            header[key] = value
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def with_array(index: int, array: np.ndarray) -> list[Any]:
    """A valid group's frames with array frame `index` (0 = prompt_tokens) replaced, same shape."""
    frames = group_frames()
    frames[1 + index] = array.tobytes()
    return frames


def with_descriptor(index: int, descriptor: Any) -> list[Any]:
    header = msgpack.unpackb(group_frames()[0])
    header["a"][index] = descriptor
    return group_frames(a=header["a"])


def with_policy_mask(values: list[int], dtype: str = "uint8", shape: list[int] | None = None) -> list[Any]:
    """A valid group's frames (8 tokens) with the policy mask frame and its descriptor replaced."""
    array = np.asarray(values, dtype=np.dtype(dtype))
    header = msgpack.unpackb(group_frames()[0])
    header["a"][4] = [dtype, shape if shape is not None else [array.size]]
    frames = group_frames(a=header["a"])
    frames[5] = array.tobytes()
    return frames


def tokenless_group_frames(**header_changes: Any) -> list[Any]:
    """A valid group of two empty completions (version 7 in meta and vmin/vmax), header fields replaced."""
    group = example_group(num_samples=2, tokens_per_sample=0)
    group.meta["version"] = 7
    frames = [bytes(frame) for frame in encode_group(group)]
    header = msgpack.unpackb(frames[0])
    header.update(header_changes)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def lengths_of(frames: list[Any]) -> list[int]:
    return msgpack.unpackb(frames[0])["lengths"]


MALFORMED: dict[str, tuple[Callable[[], list[Any]], str]] = {
    "no frames": (lambda: [], "empty"),
    "not a frame list": (lambda: b"\x81", "bad_frame"),
    "a frame that is not a buffer": (lambda: [group_frames()[0], 3, b"", b"", b""], "bad_frame"),
    "truncated: last frame missing": (lambda: group_frames()[:-1], "frame_count"),
    "extra frame": (lambda: group_frames() + [b"\x00" * 4], "frame_count"),
    "array frame one byte short": (lambda: group_frames()[:-1] + [group_frames()[-1][:-1]], "size_mismatch"),
    "garbage header": (lambda: [b"\xc1garbage"] + group_frames()[1:], "bad_header"),
    "header with trailing bytes": (lambda: [group_frames()[0] + b"\x00"] + group_frames()[1:], "bad_header"),
    "header is a list": (lambda: [msgpack.packb([1, 2])] + group_frames()[1:], "bad_header"),
    "msgpack extension type": (lambda: group_frames(meta=msgpack.ExtType(1, b"x")), "bad_header"),
    "header over the size limit": (lambda: group_frames(meta={"pad": "x" * MAX_HEADER_BYTES}), "header_too_large"),
    "old schema version": (lambda: group_frames(v=SCHEMA_VERSION - 1), "schema_version"),
    "schema version as bool": (lambda: group_frames(v=True), "schema_version"),
    "no schema version": (lambda: group_frames(v=...), "schema_version"),
    "unknown type": (lambda: group_frames(t=99), "unknown_type"),
    "type as string": (lambda: group_frames(t="group"), "bad_field"),
    "unknown dtype": (lambda: with_descriptor(1, ["complex64", [8]]), "bad_dtype"),
    "dtype that mismatches the field": (lambda: with_descriptor(1, ["float32", [8]]), "bad_dtype"),
    "shape that mismatches the frame": (lambda: with_descriptor(1, ["int32", [9]]), "size_mismatch"),
    "negative dimension": (lambda: with_descriptor(1, ["int32", [-8]]), "bad_shape"),
    "2-d tokens": (lambda: with_descriptor(1, ["int32", [2, 4]]), "bad_shape"),
    "too many dimensions": (lambda: with_descriptor(1, ["int32", [1] * 9]), "bad_shape"),
    "descriptor not a pair": (lambda: with_descriptor(1, ["int32"]), "bad_descriptor"),
    "negative length": (lambda: group_frames(lengths=[-4, 12]), "bad_lengths"),
    "lengths that miss the tokens": (lambda: group_frames(lengths=[4, 5]), "bad_lengths"),
    "no samples": (lambda: group_frames(lengths=[], rewards=[]), "bad_lengths"),
    "fractional length": (lambda: group_frames(lengths=[4.0, 4]), "bad_lengths"),
    "one reward for two samples": (lambda: group_frames(rewards=[1.0]), "bad_rewards"),
    "one truncation flag for two samples": (lambda: group_frames(truncated=[1]), "bad_truncated"),
    "a truncation flag of 2": (lambda: group_frames(truncated=[0, 2]), "bad_truncated"),
    "boolean truncation flags": (lambda: group_frames(truncated=[True, False]), "bad_truncated"),
    "truncation flags as a string": (lambda: group_frames(truncated="01"), "bad_field"),
    "no truncation flags": (lambda: group_frames(truncated=...), "missing_field"),
    "NaN reward": (lambda: group_frames(rewards=[float("nan"), 0.0]), "bad_rewards"),
    "infinite reward": (lambda: group_frames(rewards=[float("inf"), 0.0]), "bad_rewards"),
    "reward beyond float32": (lambda: group_frames(rewards=[1e300, 0.0]), "bad_rewards"),
    "a policy mask one entry short": (lambda: with_policy_mask([1] * 7), "bad_policy_mask"),
    "a policy mask one entry long": (lambda: with_policy_mask([1] * 9), "bad_policy_mask"),
    "a policy mask entry of 2": (lambda: with_policy_mask([1, 1, 2, 1, 1, 1, 0, 1]), "bad_policy_mask"),
    "a policy mask entry of 255": (lambda: with_policy_mask([1, 1, 255, 1, 1, 1, 0, 1]), "bad_policy_mask"),
    "a policy mask of int32": (lambda: with_policy_mask([1] * 8, dtype="int32"), "bad_dtype"),
    "a 2-d policy mask": (lambda: with_policy_mask([1] * 8, shape=[2, 4]), "bad_shape"),
    "no policy mask (four arrays, as schema 7 sent)": (
        lambda: group_frames(a=msgpack.unpackb(group_frames()[0])["a"][:4])[:5], "frame_count"),
    "NaN log-prob": (lambda: with_array(2, np.array([0, -1, np.nan, 0, 0, 0, 0, 0], np.float32)), "bad_logprobs"),
    "-inf log-prob": (lambda: with_array(2, np.array([0, -np.inf, 0, 0, 0, 0, 0, 0], np.float32)), "bad_logprobs"),
    "positive log-prob": (lambda: with_array(2, np.array([0, 0.5, 0, 0, 0, 0, 0, 0], np.float32)), "bad_logprobs"),
    "negative token id": (lambda: with_array(1, np.array([1, 2, -3, 4, 5, 6, 7, 8], np.int32)), "bad_tokens"),
    "vmin above the tokens' versions": (lambda: group_frames(vmin=1000, vmax=1000), "bad_versions"),
    "vmin > vmax": (lambda: group_frames(vmax=0, vmin=1), "bad_versions"),
    "missing generator id": (lambda: group_frames(gen=...), "missing_field"),
    "negative sequence number": (lambda: group_frames(seq=-1), "bad_field"),
    "missing incarnation": (lambda: group_frames(inc=...), "missing_field"),
    "negative incarnation": (lambda: group_frames(inc=-1), "bad_field"),
    "boolean incarnation": (lambda: group_frames(inc=False), "bad_field"),
    "missing stream position": (lambda: group_frames(pos=...), "missing_field"),
    "negative stream position": (lambda: group_frames(pos=-1), "bad_field"),
    "fractional stream position": (lambda: group_frames(pos=1.0), "bad_field"),
    "boolean prompt id": (lambda: group_frames(prompt_id=True), "bad_field"),
    "huge prompt id": (lambda: group_frames(prompt_id=1 << 63), "bad_field"),
    "meta with a list value": (lambda: group_frames(meta={"x": [1]}), "bad_field"),
    "NaN meta number": (lambda: group_frames(meta={"reward/accuracy": float("nan")}), "bad_meta"),
    "infinite meta number": (lambda: group_frames(meta={"reward/accuracy": float("-inf")}), "bad_meta"),
    "meta number beyond float32": (lambda: group_frames(meta={"reward/accuracy": 1e39}), "bad_meta"),
    "no tokens, meta version a string": (lambda: tokenless_group_frames(meta={"version": "7"}), "bad_versions"),
    "no tokens, meta version a float": (lambda: tokenless_group_frames(meta={"version": 7.0}), "bad_versions"),
    "no tokens, meta version != vmin": (lambda: tokenless_group_frames(meta={"version": 8}), "bad_versions"),
    "control message with an array": (
        lambda: [msgpack.packb({"v": SCHEMA_VERSION, "t": int(MsgType.ACK), "gen": 0, "version": 0,
                                "a": [["int32", [1]]]}), b"\x00" * 4], "frame_count"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_group_raises_wire_error_with_reason(case: str) -> None:
    make_frames, reason = MALFORMED[case]
    with pytest.raises(WireError) as raised:
        decode_group(make_frames())
    assert raised.value.reason == reason, raised.value


def multi_turn_group() -> ScoredGroup:
    """Two completions [policy, policy, env, env, policy] and [policy, env]: the policy sampled at
    versions 5 and 6, the environment's tokens carry versions 1 and 9 (ignored) and log-prob 0."""
    return ScoredGroup(
        generator_id=1, seq=2, prompt_id=3, prompt_tokens=np.array([4, 5], np.int32),
        tokens=np.arange(10, 17, dtype=np.int32),
        logprobs=np.array([-0.5, -0.25, 0, 0, -1.0, -2.0, 0], np.float32),
        versions=np.array([5, 5, 1, 9, 6, 6, 1], np.int32),
        lengths=np.array([5, 2], np.int32), rewards=np.array([1.0, 0.0], np.float32),
        meta={"version": 6}, policy_mask=np.array([1, 1, 0, 0, 1, 1, 0], np.uint8))


def test_version_min_and_max_and_the_header_ignore_the_environments_tokens() -> None:
    group = multi_turn_group()
    assert (group.version_min, group.version_max, group.policy_tokens) == (5, 6, 4)
    decoded = decode_group(encode_group(group))
    assert_same_group(decoded, group)
    assert decoded.completion_mask(0).tolist() == [1, 1, 0, 0, 1] and decoded.completion_mask(1).tolist() == [1, 0]


@pytest.mark.parametrize(("vmin", "vmax"), [(1, 6), (5, 9), (1, 9)])
def test_a_header_whose_vmin_or_vmax_counts_an_environment_token_is_refused(vmin, vmax) -> None:
    frames = [bytes(frame) for frame in encode_group(multi_turn_group())]
    header = msgpack.unpackb(frames[0])
    header["vmin"], header["vmax"] = vmin, vmax
    with pytest.raises(WireError) as raised:
        decode_group([msgpack.packb(header), *frames[1:]])
    assert raised.value.reason == "bad_versions"


def test_a_group_of_environment_tokens_only_takes_its_version_from_meta() -> None:
    group = multi_turn_group()
    group.policy_mask = np.zeros(7, np.uint8)
    group.meta = {"version": 7}
    decoded = decode_group(encode_group(group))
    assert (decoded.version_min, decoded.version_max, decoded.policy_tokens) == (7, 7, 0)
    frames = [bytes(frame) for frame in encode_group(group)]
    header = msgpack.unpackb(frames[0])
    header["meta"] = {"version": 5}  # meta's version must be the header's
    with pytest.raises(WireError) as raised:
        decode_group([msgpack.packb(header), *frames[1:]])
    assert raised.value.reason == "bad_versions"


def test_a_group_built_without_a_policy_mask_is_all_policy_tokens() -> None:
    group = example_group(num_samples=2, tokens_per_sample=4)
    built = ScoredGroup(generator_id=0, seq=0, prompt_id=0, prompt_tokens=group.prompt_tokens, tokens=group.tokens,
                        logprobs=group.logprobs, versions=group.versions, lengths=group.lengths,
                        rewards=group.rewards)
    assert built.policy_mask.dtype == np.uint8 and built.policy_mask.tolist() == [1] * 8
    assert decode_group(encode_group(built)).policy_tokens == 8


def test_a_tokenless_group_takes_its_version_from_vmin_when_meta_has_none() -> None:
    group = decode_group(tokenless_group_frames(meta={}))
    assert (group.version_min, group.version_max, group.meta) == (7, 7, {"version": 7})


@settings(max_examples=50, deadline=None)
@given(st.floats().filter(lambda x: not -FLOAT32_MAX <= x <= FLOAT32_MAX), st.text(max_size=8))
def test_any_non_finite_or_float32_overflowing_meta_number_is_rejected_as_bad_meta(value: float, key: str) -> None:
    with pytest.raises(WireError) as raised:
        decode_group(group_frames(meta={"version": 0, key: value}))
    assert raised.value.reason == "bad_meta"


def test_message_over_the_configured_limit_is_rejected() -> None:
    frames = encode_group(example_group(num_samples=8, tokens_per_sample=512))
    total = sum(len(frame) if isinstance(frame, bytes) else frame.nbytes for frame in frames)
    assert decode_group(frames, max_message_bytes=total).tokens.size == 8 * 512
    with pytest.raises(WireError) as raised:
        decode_group(frames, max_message_bytes=total - 1)
    assert raised.value.reason == "too_large"


def test_decode_group_refuses_a_valid_control_message() -> None:
    with pytest.raises(WireError) as raised:
        decode_group(encode(Heartbeat(generator_id=0, next_seq=1, version=0)))
    assert raised.value.reason == "unexpected_type"


def test_non_contiguous_buffer_is_a_wire_error() -> None:
    frames = group_frames()
    frames[1] = memoryview(np.zeros(16, dtype=np.int32))[::2]
    with pytest.raises(WireError):
        decode_group(frames)


def test_wire_package_has_no_code_path_that_executes_data() -> None:
    executes_data = re.compile(r"\b(pickle|cloudpickle|marshal|shelve)\b|\beval\(|\bexec\(")
    package = Path(asyncgrpo.wire.__file__).parent
    for source in package.glob("*.py"):
        assert not executes_data.search(source.read_text()), source.name


def test_a_killed_binders_ipc_directory_is_removed_and_nothing_else(tmp_path) -> None:
    from asyncgrpo.wire.sockets import IPC_DIR_PREFIX, remove_ipc_endpoint

    mine = tmp_path / f"{IPC_DIR_PREFIX}abc"
    mine.mkdir()
    (mine / "s").write_text("")
    other = tmp_path / "data"
    other.mkdir()
    (other / "s").write_text("")
    remove_ipc_endpoint(f"ipc://{other}/s")
    remove_ipc_endpoint("tcp://127.0.0.1:5555")
    remove_ipc_endpoint(f"ipc://{mine}/s")
    assert not mine.exists() and (other / "s").exists()


def test_max_frames_is_the_header_and_the_most_arrays_a_taken_type_carries() -> None:
    # A receiver stops reading a message past this count, so it must admit every valid message.
    assert max_frames((ScoredGroup, VersionAck, Heartbeat, TicketRequest)) == len(encode(example_group())) == 6
    assert max_frames((WeightsChunk, Shutdown)) == 1 + MAX_ARRAYS
    assert max_frames((Grant,)) == len(encode(Grant(request=0, grant=0, slots=[1], positions=[2]))) == 1
