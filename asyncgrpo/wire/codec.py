"""msgpack + raw-frame codec for every message type. The format is specified in docs/WIRE.md.

A message is a ZeroMQ multipart message: frame 0 is a msgpack header (a map with the schema
version, the message type, scalar and small list fields, and one descriptor `[dtype, shape]` per
array), frames 1.. are the arrays' raw little-endian bytes in descriptor order. Decoding returns
numpy views on the frames (no copy). Anything malformed raises `WireError` and nothing else: the
header is parsed by msgpack with size limits and no extension types, so no input can execute code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from asyncgrpo.wire.messages import (
    DELTA_INDEX,
    DELTA_MASK,
    DELTA_VALUES,
    SCHEMA_VERSION,
    Grant,
    Heartbeat,
    Message,
    MsgType,
    SaveNotice,
    ScoredGroup,
    Shutdown,
    TicketRequest,
    VersionAck,
    WeightsChunk,
)

MAX_HEADER_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
MAX_ARRAYS = 1 << 16
MAX_NDIM = 8
# Larger integers are nonsense for every field and would overflow int64 arithmetic downstream.
_MAX_INT = 1 << 62
# A heartbeat's rejection reason is for a person to read, not a payload.
MAX_REJECTION_CHARS = 300
_MAX_DIM = (1 << 31) - 1
# Slots listed in one ticket request or grant: a generator holds at most the queue's capacity.
MAX_TICKETS = 1 << 16
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Wire dtype name -> numpy dtype of the frame. bfloat16 has no numpy dtype: it travels as uint16.
_WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}

# The array frames of a scored group, in order. Lengths and rewards are tiny: they ride in the header.
# The policy mask is one byte a token: a twelfth of what tokens, log-probs and versions take.
_GROUP_ARRAYS = (("prompt_tokens", "int32"), ("tokens", "int32"), ("logprobs", "float32"), ("versions", "int32"),
                 ("policy_mask", "uint8"))

Frame = bytes | memoryview


class WireError(ValueError):
    """A message that does not follow the wire schema; `reason` is a short machine-readable kind."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ----------------------------------------------------------------------------------------- encode


def _pack(header: dict[str, Any], arrays: Sequence[tuple[np.ndarray, str]]) -> list[Frame]:
    descriptors, frames = [], []
    for array, wire_dtype in arrays:
        array = np.ascontiguousarray(array, dtype=_WIRE_DTYPES[wire_dtype])
        descriptors.append([wire_dtype, list(array.shape)])
        frames.append(memoryview(array.reshape(-1)).cast("B"))
    header = {"v": SCHEMA_VERSION, **header, "a": descriptors}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def encode(message: Message) -> list[Frame]:
    """Frames for any message type. Array frames are views on the message's arrays (no copy)."""
    if isinstance(message, ScoredGroup):
        return encode_group(message)
    if isinstance(message, WeightsChunk):
        header = {
            "t": int(MsgType.WEIGHTS),
            "version": int(message.version),
            "chunk": int(message.chunk_index),
            "chunks": int(message.num_chunks),
            "names": list(message.names),
            "shapes": [[int(d) for d in shape] for shape in message.shapes],
            "offsets": [int(o) for o in message.offsets],
            "base": int(message.base_version),
        }
        arrays = list(zip(message.tensors, message.dtypes, strict=True))
        if message.is_delta:
            # The values first (one per name, as in a full push), then the positions of the pieces that have some.
            header["enc"] = [int(e) for e in message.encodings]
            header["spans"] = [int(n) for n in message.spans]
            arrays += [(positions, "int32" if enc == DELTA_INDEX else "uint8")
                       for enc, positions in zip(message.encodings, message.positions, strict=True) if enc != DELTA_VALUES]
        return _pack(header, arrays)
    if isinstance(message, VersionAck):
        return _pack({"t": int(MsgType.ACK), "gen": int(message.generator_id), "inc": int(message.incarnation),
                      "version": int(message.version)}, [])
    if isinstance(message, Heartbeat):
        header = {
            "t": int(MsgType.HEARTBEAT),
            "gen": int(message.generator_id),
            "inc": int(message.incarnation),
            "next_seq": int(message.next_seq),
            "version": int(message.version),
            "idle_s": float(message.idle_s),
            "reward_errors": int(message.reward_errors),
            "groups_dropped": int(message.groups_dropped),
            "weights_rejected": int(message.weights_rejected),
            "rejection": str(message.rejection)[:MAX_REJECTION_CHARS],
            "reward_calls": int(message.reward_calls),
            "reward_first_errors": {str(term): str(text)[:MAX_REJECTION_CHARS]
                                    for term, text in message.reward_first_errors.items()},
            "env_calls": int(message.env_calls),
            "env_errors": int(message.env_errors),
            "env_first_error": str(message.env_first_error)[:MAX_REJECTION_CHARS],
            "delta_mismatches": int(message.delta_mismatches),
        }
        return _pack(header, [])
    if isinstance(message, Shutdown):
        return _pack({"t": int(MsgType.SHUTDOWN), "reason": message.reason}, [])
    if isinstance(message, SaveNotice):
        return _pack({"t": int(MsgType.SAVE), "version": int(message.version), "saving": bool(message.saving),
                      "timeout_s": float(message.timeout_s)}, [])
    if isinstance(message, TicketRequest):
        return _pack({"t": int(MsgType.TICKETS), "gen": int(message.generator_id), "inc": int(message.incarnation),
                      "request": int(message.request), "version": int(message.version),
                      "wanted": int(message.wanted), "newest_grant": int(message.newest_grant),
                      "unsent": [int(s) for s in message.unsent],
                      "given_back": [int(s) for s in message.given_back]}, [])
    if isinstance(message, Grant):
        return _pack({"t": int(MsgType.GRANT), "request": int(message.request), "grant": int(message.grant),
                      "slots": [int(s) for s in message.slots],
                      "positions": [int(p) for p in message.positions]}, [])
    raise TypeError(f"not a wire message: {type(message).__name__}")


def encode_group(group: ScoredGroup) -> list[bytes | memoryview]:
    """Frames of a scored group: header + prompt_tokens, tokens, logprobs, versions, policy_mask."""
    header = {
        "t": int(MsgType.GROUP),
        "gen": int(group.generator_id),
        "inc": int(group.incarnation),
        "seq": int(group.seq),
        "pos": int(group.pos),
        "prompt_id": int(group.prompt_id),
        "vmin": group.version_min,
        "vmax": group.version_max,
        "lengths": np.asarray(group.lengths, dtype=np.int64).tolist(),
        # float32 -> Python float is exact, so the round trip is lossless.
        "rewards": np.asarray(group.rewards, dtype=np.float32).tolist(),
        "truncated": np.asarray(group.truncated, dtype=np.uint8).tolist(),
        "meta": dict(group.meta),
    }
    return _pack(header, [(getattr(group, name), dtype) for name, dtype in _GROUP_ARRAYS])


# ----------------------------------------------------------------------------------------- decode


_MISSING = object()


def _field(header: dict[str, Any], key: str, kind: type) -> Any:
    # Exact types: msgpack yields exactly int, float, str, bytes, list, dict, bool or None, and a
    # boolean (an int subclass) where a number belongs is malformed.
    value = header.get(key, _MISSING)
    if type(value) is not kind:
        if value is _MISSING:
            raise WireError("missing_field", key)
        raise WireError("bad_field", f"{key} has type {type(value).__name__}, expected {kind.__name__}")
    return value


def _int_field(header: dict[str, Any], key: str, minimum: int = 0) -> int:
    value = _field(header, key, int)
    if not minimum <= value < _MAX_INT:
        raise WireError("bad_field", f"{key}={value} out of range")
    return value


def _seconds_field(header: dict[str, Any], key: str) -> float:
    value = _field(header, key, float)
    if not 0.0 <= value < float(_MAX_INT):  # also rejects NaN
        raise WireError("bad_field", f"{key}={value} out of range")
    return value


def _frame_view(frame: Any) -> memoryview:
    """A flat byte view of a zmq.Frame, bytes, memoryview or other contiguous buffer."""
    try:
        view = memoryview(getattr(frame, "buffer", frame))
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as err:  # not a buffer, or a non-contiguous one
        raise WireError("bad_frame", str(err)) from None


def _arrays(header: dict[str, Any], views: Sequence[memoryview]) -> list[np.ndarray]:
    descriptors = _field(header, "a", list)
    if len(descriptors) != len(views):
        raise WireError("frame_count", f"header describes {len(descriptors)} arrays, got {len(views)} frames")
    arrays = []
    for index, (descriptor, view) in enumerate(zip(descriptors, views)):
        if type(descriptor) is not list or len(descriptor) != 2:
            raise WireError("bad_descriptor", f"array {index}")
        wire_dtype, shape = descriptor
        dtype = _WIRE_DTYPES.get(wire_dtype) if type(wire_dtype) is str else None
        if dtype is None:
            raise WireError("bad_dtype", f"array {index}: {wire_dtype!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise WireError("bad_shape", f"array {index}")
        count = 1
        for dim in shape:
            if type(dim) is not int or not 0 <= dim <= _MAX_DIM:
                raise WireError("bad_shape", f"array {index}: {shape}")
            count *= dim
        if count * dtype.itemsize != view.nbytes:
            raise WireError("size_mismatch", f"array {index}: shape {shape} x {dtype} != {view.nbytes} bytes")
        array = np.frombuffer(view, dtype=dtype)
        arrays.append(array if len(shape) == 1 else array.reshape(shape))
    return arrays


def _parse_header(head: memoryview) -> dict[str, Any]:
    if head.nbytes > MAX_HEADER_BYTES:
        raise WireError("header_too_large", f"{head.nbytes} bytes > limit {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except WireError:
        raise
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"{type(err).__name__}: {err}") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header is not a map")
    version = header.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise WireError("schema_version", f"got {version!r}, expected {SCHEMA_VERSION}")
    return header


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError("bad_header", f"msgpack extension type {code} is not allowed")


def decode(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse frames into a typed message; raises `WireError` on anything malformed."""
    if not isinstance(frames, list | tuple):
        raise WireError("bad_frame", f"expected a sequence of frames, got {type(frames).__name__}")
    if not frames:
        raise WireError("empty", "no frames")
    if len(frames) > 1 + MAX_ARRAYS:
        raise WireError("frame_count", f"{len(frames)} frames > limit {1 + MAX_ARRAYS}")
    views = [_frame_view(frame) for frame in frames]
    total = sum(view.nbytes for view in views)
    if total > max_message_bytes:
        raise WireError("too_large", f"{total} bytes > limit {max_message_bytes}")
    header = _parse_header(views[0])
    kind = _field(header, "t", int)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise WireError("unknown_type", str(kind))
    return decoder(header, _arrays(header, views[1:]))


def max_frames(accepts: Sequence[type]) -> int:
    """The most frames a valid message of any of the types `accepts` can have: the header and its
    arrays (a group's five, a weight chunk's up to MAX_ARRAYS, none for the control messages). A
    receiver stops reading a message past this count."""
    arrays = {ScoredGroup: len(_GROUP_ARRAYS), WeightsChunk: MAX_ARRAYS}
    return 1 + max((arrays.get(kind, 0) for kind in accepts), default=0)


def decode_group(frames: Sequence[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ScoredGroup:
    """Decode frames that must hold a scored group; raises `WireError` on anything else."""
    message = decode(frames, max_message_bytes)
    if not isinstance(message, ScoredGroup):
        raise WireError("unexpected_type", type(message).__name__)
    return message


def _no_arrays(kind: str, arrays: list[np.ndarray]) -> None:
    if arrays:
        raise WireError("frame_count", f"a {kind} message carries no arrays, got {len(arrays)}")


def _decode_group(header: dict[str, Any], arrays: list[np.ndarray]) -> ScoredGroup:
    if len(arrays) != len(_GROUP_ARRAYS):
        raise WireError("frame_count", f"a group has {len(_GROUP_ARRAYS)} arrays, got {len(arrays)}")
    for (name, dtype), descriptor, array in zip(_GROUP_ARRAYS, header["a"], arrays):
        if descriptor[0] != dtype:
            raise WireError("bad_dtype", f"{name} must be {dtype}, got {descriptor[0]}")
        if array.ndim != 1:
            raise WireError("bad_shape", f"{name} must be 1-d, got shape {list(array.shape)}")
    prompt_tokens, tokens, logprobs, versions, policy_mask = arrays

    lengths = _field(header, "lengths", list)
    if not lengths:
        raise WireError("bad_lengths", "a group has no samples")
    if not all(type(n) is int and 0 <= n <= _MAX_DIM for n in lengths):
        raise WireError("bad_lengths", "a completion length is not an integer, negative or too large")
    if sum(lengths) != tokens.size:
        raise WireError("bad_lengths", f"lengths sum to {sum(lengths)}, tokens has {tokens.size}")
    if logprobs.size != tokens.size or versions.size != tokens.size:
        raise WireError("bad_lengths", "tokens, logprobs and versions differ in length")
    if policy_mask.size != tokens.size:
        raise WireError("bad_policy_mask", f"{policy_mask.size} policy mask entries for {tokens.size} tokens")
    if policy_mask.size and np.maximum.reduce(policy_mask) > 1:
        raise WireError("bad_policy_mask", "policy mask entries must be 0 or 1")

    rewards = _field(header, "rewards", list)
    if len(rewards) != len(lengths):
        raise WireError("bad_rewards", f"{len(rewards)} rewards for {len(lengths)} samples")
    # NaN fails both comparisons, infinities and float32 overflow fail one.
    if not all(type(r) is float and -_FLOAT32_MAX <= r <= _FLOAT32_MAX for r in rewards):
        raise WireError("bad_rewards", "rewards must be finite floats within float32 range")

    truncated = _field(header, "truncated", list)
    if len(truncated) != len(lengths) or not all(type(t) is int and t in (0, 1) for t in truncated):
        raise WireError("bad_truncated", f"truncated must be one 0 or 1 per sample ({len(lengths)})")

    if (tokens.size and np.minimum.reduce(tokens) < 0) or (prompt_tokens.size and np.minimum.reduce(prompt_tokens) < 0):
        raise WireError("bad_tokens", "negative token id")
    # min/max propagate NaN and the comparisons are then False: two passes find NaN, inf and > 0.
    if logprobs.size and not (np.minimum.reduce(logprobs) > -np.inf and np.maximum.reduce(logprobs) <= 0):
        raise WireError("bad_logprobs", "log-probs must be finite and <= 0")
    meta = _group_meta(header, versions, policy_mask)
    return ScoredGroup(
        generator_id=_int_field(header, "gen"),
        seq=_int_field(header, "seq"),
        prompt_id=_int_field(header, "prompt_id"),
        prompt_tokens=prompt_tokens,
        tokens=tokens,
        logprobs=logprobs,
        versions=versions,
        lengths=np.array(lengths, dtype=np.int32),
        rewards=np.array(rewards, dtype=np.float32),
        meta=meta,
        incarnation=_int_field(header, "inc"),
        pos=_int_field(header, "pos"),
        truncated=np.array(truncated, dtype=np.uint8),
        policy_mask=policy_mask,
    )


def _group_meta(header: dict[str, Any], versions: np.ndarray, policy_mask: np.ndarray) -> dict[str, Any]:
    """A group's meta, checked with its header's vmin/vmax against the policy tokens' versions
    (an environment's tokens carry no version that counts)."""
    vmin, vmax = _int_field(header, "vmin"), _int_field(header, "vmax")
    if vmin > vmax:
        raise WireError("bad_versions", f"vmin={vmin} > vmax={vmax}")
    if policy_mask.size and np.minimum.reduce(policy_mask) == 0:
        versions = versions[policy_mask.astype(bool)]
    if versions.size and (np.minimum.reduce(versions) != vmin or np.maximum.reduce(versions) != vmax):
        raise WireError("bad_versions", "vmin/vmax disagree with the policy tokens' versions")

    meta = _field(header, "meta", dict)
    if not all(type(k) is str and type(v) in (int, float, str) for k, v in meta.items()):
        raise WireError("bad_field", "meta must map str to int, float or str")
    # The learner averages meta numbers into its metrics (reward/<term>): NaN or inf would poison
    # them, and float32 range keeps a step's sum of them finite.
    if not all(-_FLOAT32_MAX <= v <= _FLOAT32_MAX for v in meta.values() if type(v) is float):
        raise WireError("bad_meta", "meta floats must be finite and within float32 range")
    # With no policy tokens, version_min/max read meta["version"] (set to vmin if absent): it must be
    # vmin, not a string or a float that int() cannot take.
    if not versions.size and (meta.setdefault("version", vmin) != vmin or type(meta["version"]) is not int):
        raise WireError("bad_versions",
                        f"meta version {meta['version']!r} of a group without policy tokens != vmin={vmin}")
    return meta


def _decode_weights(header: dict[str, Any], arrays: list[np.ndarray]) -> WeightsChunk:
    names = _field(header, "names", list)
    base = _int_field(header, "base", minimum=-1)
    values = arrays[:len(names)]
    if not all(type(n) is str for n in names) or (len(names) != len(arrays) if base < 0 else len(names) > len(arrays)):
        raise WireError("bad_field", "one string name per weight array")
    num_chunks = _int_field(header, "chunks", minimum=1)
    chunk_index = _int_field(header, "chunk")
    if chunk_index >= num_chunks:
        raise WireError("bad_field", f"chunk {chunk_index} of {num_chunks}")
    shapes, offsets = _field(header, "shapes", list), _field(header, "offsets", list)
    if len(shapes) != len(names) or len(offsets) != len(names):
        raise WireError("bad_field", "one shape and one offset per weight array")
    delta = _decode_delta(header, names, values, arrays[len(names):]) if base >= 0 else ([], [], [])
    spans = delta[1] or [array.size for array in values]
    for shape, offset, span, array in zip(shapes, offsets, spans, values):
        if type(shape) is not list or not all(type(d) is int and 0 <= d < _MAX_INT for d in shape):
            raise WireError("bad_field", "a weight shape is a list of sizes")
        if type(offset) is not int or array.ndim != 1 or not 0 <= offset <= offset + span <= math.prod(shape):
            raise WireError("bad_field", f"a weight piece of {span} elements at {offset} does not fit {shape}")
    return WeightsChunk(
        version=_int_field(header, "version"),
        chunk_index=chunk_index,
        num_chunks=num_chunks,
        names=names,
        tensors=values,
        dtypes=[d[0] for d in header["a"][:len(names)]],
        shapes=shapes,
        offsets=offsets,
        base_version=base,
        encodings=delta[0],
        spans=delta[1],
        positions=delta[2],
    )


def _decode_delta(header: dict[str, Any], names: list[str], values: list[np.ndarray],
                  extra: list[np.ndarray]) -> tuple[list[int], list[int], list[np.ndarray]]:
    """A delta chunk's encodings, spans and positions (one per piece; empty positions for
    DELTA_VALUES), checked against each other: whether the positions stay inside their span and
    the mask's popcount matches is the receiver's check (it needs the data)."""
    encodings, spans = _field(header, "enc", list), _field(header, "spans", list)
    if len(encodings) != len(names) or len(spans) != len(names):
        raise WireError("bad_field", "one encoding and one span per delta piece")
    if not all(e in (DELTA_VALUES, DELTA_INDEX, DELTA_MASK) and type(e) is int for e in encodings):
        raise WireError("bad_field", f"delta encodings must be {DELTA_VALUES}, {DELTA_INDEX} or {DELTA_MASK}")
    if not all(type(n) is int and 0 <= n < _MAX_INT for n in spans):
        raise WireError("bad_field", "a delta span is a size")
    if len(extra) != sum(e != DELTA_VALUES for e in encodings):
        raise WireError("frame_count", "one positions array per delta piece that is not all values")
    positions, extras = [], iter(extra)
    for enc, span, array in zip(encodings, spans, values):
        if array.ndim != 1:
            raise WireError("bad_shape", "delta values must be 1-d")
        if enc == DELTA_VALUES:
            positions.append(np.empty(0, dtype=np.int32))
            if array.size != span:
                raise WireError("bad_field", f"a delta piece of all values has {array.size} values for a span of {span}")
            continue
        where = next(extras)
        want = (np.dtype("<i4"), array.size) if enc == DELTA_INDEX else (np.dtype("u1"), -(-span // 8))
        if where.ndim != 1 or where.dtype != want[0] or where.size != want[1] or array.size > span:
            raise WireError("bad_field", f"delta positions ({where.dtype}, {where.size}) do not fit "
                                         f"{array.size} values in a span of {span}")
        positions.append(where)
    return encodings, spans, positions


def _decode_ack(header: dict[str, Any], arrays: list[np.ndarray]) -> VersionAck:
    _no_arrays("ack", arrays)
    return VersionAck(generator_id=_int_field(header, "gen"), version=_int_field(header, "version"),
                      incarnation=_int_field(header, "inc"))


def _decode_heartbeat(header: dict[str, Any], arrays: list[np.ndarray]) -> Heartbeat:
    _no_arrays("heartbeat", arrays)
    first_errors = _field(header, "reward_first_errors", dict)
    if not all(type(term) is str and type(text) is str for term, text in first_errors.items()):
        raise WireError("bad_field", "reward_first_errors must map term names to texts")
    return Heartbeat(
        generator_id=_int_field(header, "gen"),
        next_seq=_int_field(header, "next_seq"),
        version=_int_field(header, "version"),
        idle_s=_seconds_field(header, "idle_s"),
        reward_errors=_int_field(header, "reward_errors"),
        groups_dropped=_int_field(header, "groups_dropped"),
        weights_rejected=_int_field(header, "weights_rejected"),
        rejection=_field(header, "rejection", str)[:MAX_REJECTION_CHARS],
        reward_calls=_int_field(header, "reward_calls"),
        reward_first_errors={term: text[:MAX_REJECTION_CHARS] for term, text in first_errors.items()},
        incarnation=_int_field(header, "inc"),
        env_calls=_int_field(header, "env_calls"),
        env_errors=_int_field(header, "env_errors"),
        env_first_error=_field(header, "env_first_error", str)[:MAX_REJECTION_CHARS],
        delta_mismatches=_int_field(header, "delta_mismatches"),
    )


def _decode_shutdown(header: dict[str, Any], arrays: list[np.ndarray]) -> Shutdown:
    _no_arrays("shutdown", arrays)
    return Shutdown(reason=_field(header, "reason", str))


def _decode_save(header: dict[str, Any], arrays: list[np.ndarray]) -> SaveNotice:
    _no_arrays("save notice", arrays)
    saving, timeout_s = _field(header, "saving", bool), _seconds_field(header, "timeout_s")
    # A save announced without a bound would stretch no wait; an end with one is a confused sender.
    if saving != (timeout_s > 0):
        raise WireError("bad_field", f"timeout_s={timeout_s} must be > 0 exactly when saving (saving={saving})")
    return SaveNotice(version=_int_field(header, "version"), saving=saving, timeout_s=timeout_s)


def _index_list(header: dict[str, Any], key: str) -> list[int]:
    values = _field(header, key, list)
    if len(values) > MAX_TICKETS or not all(type(v) is int and 0 <= v < _MAX_INT for v in values):
        raise WireError("bad_field", f"{key} must be at most {MAX_TICKETS} non-negative integers")
    return values


def _decode_tickets(header: dict[str, Any], arrays: list[np.ndarray]) -> TicketRequest:
    _no_arrays("ticket request", arrays)
    return TicketRequest(generator_id=_int_field(header, "gen"), incarnation=_int_field(header, "inc"),
                         request=_int_field(header, "request"), version=_int_field(header, "version"),
                         wanted=_int_field(header, "wanted"), newest_grant=_int_field(header, "newest_grant"),
                         unsent=_index_list(header, "unsent"), given_back=_index_list(header, "given_back"))


def _decode_grant(header: dict[str, Any], arrays: list[np.ndarray]) -> Grant:
    _no_arrays("grant", arrays)
    slots, positions = _index_list(header, "slots"), _index_list(header, "positions")
    if len(slots) != len(positions):
        raise WireError("bad_field", f"{len(slots)} slots for {len(positions)} positions")
    return Grant(request=_int_field(header, "request"), grant=_int_field(header, "grant"), slots=slots,
                 positions=positions)


_DECODERS: dict[int, Callable[[dict[str, Any], list[np.ndarray]], Message]] = {
    MsgType.GROUP: _decode_group,
    MsgType.WEIGHTS: _decode_weights,
    MsgType.ACK: _decode_ack,
    MsgType.HEARTBEAT: _decode_heartbeat,
    MsgType.SHUTDOWN: _decode_shutdown,
    MsgType.SAVE: _decode_save,
    MsgType.TICKETS: _decode_tickets,
    MsgType.GRANT: _decode_grant,
}


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
        meta={"version": version},
        truncated=rng.integers(0, 2, size=num_samples).astype(np.uint8),  # drawn late: earlier fields keep their values
        policy_mask=_example_policy_mask(rng, lengths),  # drawn last, for the same reason
    )


def _example_policy_mask(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    """Each completion: a policy turn, then from its middle an observation of up to 3 tokens and the
    policy again, so every completion starts and ends with the policy's tokens (all its versions
    are the group's one version, so vmin/vmax hold either way)."""
    masks = []
    for length in lengths.tolist():
        mask = np.ones(length, dtype=np.uint8)
        if length >= 3:
            start = length // 2
            mask[start:min(length - 1, start + int(rng.integers(1, 4)))] = 0
        masks.append(mask)
    return np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8)
