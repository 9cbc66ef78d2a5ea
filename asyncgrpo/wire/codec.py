"""msgpack + raw-frame codec for every message type.

A message is a ZeroMQ multipart message: frame 0 is a msgpack header (a map with the schema
version, the message type, scalar fields and one descriptor `[dtype, shape]` per array), frames
1.. are the arrays' raw little-endian bytes in descriptor order. Decoding returns numpy views on
the frames (no copy). Anything malformed raises `WireError` and nothing else: the header is
parsed by msgpack with size limits and no extension types, so no input can execute code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from asyncgrpo.wire.messages import (
    SCHEMA_VERSION,
    Heartbeat,
    Message,
    MsgType,
    ScoredGroup,
    Shutdown,
    VersionAck,
    WeightsChunk,
)

MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
MAX_NDIM = 8

# Wire dtype name -> numpy dtype of the frame. bfloat16 has no numpy dtype: it travels as uint16.
_WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}

_GROUP_ARRAYS = ("prompt_tokens", "tokens", "logprobs", "versions", "lengths", "rewards")
_GROUP_DTYPES = ("int32", "int32", "float32", "int32", "int32", "float32")

Frame = bytes | memoryview


class WireError(ValueError):
    """A message that does not follow the wire schema; `reason` is a short machine-readable kind."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------- encode


def _array_frame(array: np.ndarray, wire_dtype: str) -> tuple[list[Any], memoryview]:
    expected = _WIRE_DTYPES[wire_dtype]
    array = np.ascontiguousarray(array, dtype=expected)
    return [wire_dtype, list(array.shape)], memoryview(array).cast("B")


def _pack(header: dict[str, Any], arrays: Sequence[tuple[np.ndarray, str]]) -> list[Frame]:
    descriptors, frames = [], []
    for array, wire_dtype in arrays:
        descriptor, frame = _array_frame(array, wire_dtype)
        descriptors.append(descriptor)
        frames.append(frame)
    header = {"v": SCHEMA_VERSION, **header, "a": descriptors}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def encode(message: Message) -> list[Frame]:
    """Frames for any message type."""
    if isinstance(message, ScoredGroup):
        return encode_group(message)
    if isinstance(message, WeightsChunk):
        header = {
            "t": int(MsgType.WEIGHTS),
            "version": message.version,
            "chunk": message.chunk_index,
            "chunks": message.num_chunks,
            "names": list(message.names),
        }
        return _pack(header, list(zip(message.tensors, message.dtypes, strict=True)))
    if isinstance(message, VersionAck):
        return _pack({"t": int(MsgType.ACK), "gen": message.generator_id, "version": message.version}, [])
    if isinstance(message, Heartbeat):
        header = {
            "t": int(MsgType.HEARTBEAT),
            "gen": message.generator_id,
            "next_seq": message.next_seq,
            "version": message.version,
        }
        return _pack(header, [])
    if isinstance(message, Shutdown):
        return _pack({"t": int(MsgType.SHUTDOWN), "reason": message.reason}, [])
    raise TypeError(f"not a wire message: {type(message).__name__}")


def encode_group(group: ScoredGroup) -> list[Frame]:
    """Frames of a scored group: header + six array frames."""
    header = {
        "t": int(MsgType.GROUP),
        "gen": group.generator_id,
        "seq": group.seq,
        "prompt_id": group.prompt_id,
        "vmin": group.version_min,
        "vmax": group.version_max,
        "meta": dict(group.meta),
    }
    arrays = [(getattr(group, name), dtype) for name, dtype in zip(_GROUP_ARRAYS, _GROUP_DTYPES)]
    return _pack(header, arrays)


# ----------------------------------------------------------------------------------------- decode


def _field(header: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in header:
        raise WireError("missing_field", key)
    value = header[key]
    # bool is an int subclass; a boolean where a number belongs is malformed.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise WireError("bad_field", f"{key} is a boolean")
    if not isinstance(value, kind):
        raise WireError("bad_field", f"{key} has type {type(value).__name__}")
    return value


def _int_field(header: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = _field(header, key, int)
    if value < minimum or value >= 1 << 62:
        raise WireError("bad_field", f"{key}={value} out of range")
    return value


def _frame_view(frame: Any) -> memoryview:
    try:
        view = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    except TypeError as err:
        raise WireError("bad_frame", str(err)) from None
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _arrays(header: dict[str, Any], frames: Sequence[Any]) -> list[np.ndarray]:
    descriptors = _field(header, "a", list)
    if len(descriptors) != len(frames):
        raise WireError("frame_count", f"header describes {len(descriptors)} arrays, got {len(frames)} frames")
    arrays = []
    for index, (descriptor, frame) in enumerate(zip(descriptors, frames)):
        if not (isinstance(descriptor, list) and len(descriptor) == 2):
            raise WireError("bad_descriptor", f"array {index}")
        wire_dtype, shape = descriptor
        if wire_dtype not in _WIRE_DTYPES:
            raise WireError("bad_dtype", f"array {index}: {wire_dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise WireError("bad_shape", f"array {index}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise WireError("bad_shape", f"array {index}: {shape}")
        dtype = _WIRE_DTYPES[wire_dtype]
        view = _frame_view(frame)
        if math.prod(shape) * dtype.itemsize != view.nbytes:
            raise WireError("size_mismatch", f"array {index}: shape {shape} x {dtype} != {view.nbytes} bytes")
        arrays.append(np.frombuffer(view, dtype=dtype).reshape(shape))
    return arrays


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse frames into a typed message; raises `WireError` on anything malformed."""
    if not frames:
        raise WireError("empty", "no frames")
    total = 0
    for frame in frames:
        total += _frame_view(frame).nbytes
    if total > max_message_bytes:
        raise WireError("too_large", f"{total} bytes > limit {max_message_bytes}")
    head = _frame_view(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise WireError("header_too_large", f"{head.nbytes} bytes")
    try:
        header = msgpack.unpackb(
            head, raw=False, strict_map_key=True, ext_hook=_refuse_ext
        )
    except WireError:
        raise
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"{type(err).__name__}: {err}") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header is not a map")
    if header.get("v") != SCHEMA_VERSION:
        raise WireError("schema_version", f"got {header.get('v')!r}, expected {SCHEMA_VERSION}")
    kind = _field(header, "t", int)
    arrays = _arrays(header, frames[1:])
    if kind == MsgType.GROUP:
        return _decode_group(header, arrays)
    if kind == MsgType.WEIGHTS:
        return _decode_weights(header, arrays)
    if arrays:
        raise WireError("frame_count", f"message type {kind} carries no arrays")
    if kind == MsgType.ACK:
        return VersionAck(generator_id=_int_field(header, "gen"), version=_int_field(header, "version"))
    if kind == MsgType.HEARTBEAT:
        return Heartbeat(
            generator_id=_int_field(header, "gen"),
            next_seq=_int_field(header, "next_seq"),
            version=_int_field(header, "version"),
        )
    if kind == MsgType.SHUTDOWN:
        return Shutdown(reason=_field(header, "reason", str))
    raise WireError("unknown_type", str(kind))


def decode_group(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ScoredGroup:
    """Decode frames that must hold a scored group."""
    message = decode(frames, max_message_bytes)
    if not isinstance(message, ScoredGroup):
        raise WireError("unexpected_type", type(message).__name__)
    return message


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError("bad_header", f"msgpack extension type {code} is not allowed")


def _decode_group(header: dict[str, Any], arrays: list[np.ndarray]) -> ScoredGroup:
    if len(arrays) != len(_GROUP_ARRAYS):
        raise WireError("frame_count", f"a group has {len(_GROUP_ARRAYS)} arrays, got {len(arrays)}")
    descriptors = header["a"]
    for name, dtype, descriptor, array in zip(_GROUP_ARRAYS, _GROUP_DTYPES, descriptors, arrays):
        if descriptor[0] != dtype or array.ndim != 1:
            raise WireError("bad_dtype", f"{name} must be a 1-d {dtype} array")
    prompt_tokens, tokens, logprobs, versions, lengths, rewards = arrays
    if lengths.size == 0:
        raise WireError("bad_lengths", "a group has no samples")
    if (lengths < 0).any():
        raise WireError("bad_lengths", "negative completion length")
    if int(lengths.sum(dtype=np.int64)) != tokens.size:
        raise WireError("bad_lengths", f"lengths sum to {int(lengths.sum())}, tokens has {tokens.size}")
    if logprobs.size != tokens.size or versions.size != tokens.size:
        raise WireError("bad_lengths", "tokens, logprobs and versions differ in length")
    if rewards.size != lengths.size:
        raise WireError("bad_lengths", "one reward per sample")
    if not np.isfinite(logprobs).all() or (logprobs > 0).any():
        raise WireError("bad_logprobs", "log-probs must be finite and <= 0")
    if not np.isfinite(rewards).all():
        raise WireError("bad_rewards", "rewards must be finite")
    vmin, vmax = _int_field(header, "vmin"), _int_field(header, "vmax")
    if versions.size and (int(versions.min()) != vmin or int(versions.max()) != vmax):
        raise WireError("bad_versions", "vmin/vmax disagree with per-token versions")
    meta = _field(header, "meta", dict)
    if not all(isinstance(k, str) and isinstance(v, int | float | str) for k, v in meta.items()):
        raise WireError("bad_field", "meta must map str to int, float or str")
    meta = dict(meta)
    meta.setdefault("version", vmin)
    return ScoredGroup(
        generator_id=_int_field(header, "gen"),
        seq=_int_field(header, "seq"),
        prompt_id=_int_field(header, "prompt_id"),
        prompt_tokens=prompt_tokens,
        tokens=tokens,
        logprobs=logprobs,
        versions=versions,
        lengths=lengths,
        rewards=rewards,
        meta=meta,
    )


def _decode_weights(header: dict[str, Any], arrays: list[np.ndarray]) -> WeightsChunk:
    names = _field(header, "names", list)
    if len(names) != len(arrays) or not all(isinstance(n, str) for n in names):
        raise WireError("bad_field", "one string name per weight array")
    num_chunks = _int_field(header, "chunks", minimum=1)
    chunk_index = _int_field(header, "chunk")
    if chunk_index >= num_chunks:
        raise WireError("bad_field", f"chunk {chunk_index} of {num_chunks}")
    return WeightsChunk(
        version=_int_field(header, "version"),
        chunk_index=chunk_index,
        num_chunks=num_chunks,
        names=names,
        tensors=arrays,
        dtypes=[d[0] for d in header["a"]],
    )


def example_group(num_samples: int = 8, tokens_per_sample: int = 512, seed: int = 0) -> ScoredGroup:
    """A valid random group, for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    lengths = np.full(num_samples, tokens_per_sample, dtype=np.int32)
    total = int(lengths.sum())
    version = int(rng.integers(0, 100))
    return ScoredGroup(
        generator_id=int(rng.integers(0, 8)),
        seq=int(rng.integers(0, 1 << 20)),
        prompt_id=int(rng.integers(0, 1 << 30)),
        prompt_tokens=rng.integers(0, 32000, size=64, dtype=np.int32),
        tokens=rng.integers(0, 32000, size=total, dtype=np.int32),
        logprobs=-rng.exponential(1.0, size=total).astype(np.float32),
        versions=np.full(total, version, dtype=np.int32),
        lengths=lengths,
        rewards=rng.integers(0, 2, size=num_samples).astype(np.float32),
    )
