"""The recorded-stream file format: every group a learner consumed, in the order it consumed them.

A recording is a directory (`wire.record_dir`):

    recording.json   format version, wire schema, the starting model (model_dir, and the checkpoint
                     when the recording run resumed from one), the first recorded learner version
    config.yaml      the recording run's resolved config, composable: `asyncgrpo replay` loads it
                     with the command line's overrides on top
    stream.bin       PREAMBLE (magic + format, u32le), then records, append-only

    record := length u64le | crc32(length) u32le | crc32(body) u32le | body[length]
    body   := meta_length u32le | meta | frame 0 | frame 1 | ...
    meta   := msgpack map {version, index, count, frames}: the learner's version when it took the
              group, its position in that step's batch, the step's number of groups, and the byte
              length of each wire frame that follows
    frames := the group exactly as received, in the wire codec's frames (asyncgrpo/wire/codec.py
              `encode_group`: msgpack header + raw little-endian arrays, no pickle), so per-token
              versions, behaviour log-probs and rewards are all there

A writer appends a whole step and flushes it (`recorder.StreamRecorder`), so a crash loses at most
the step in progress. A reader (`scan`) stops at a torn tail, which is what a crash leaves: a record
cut short by the end of the file, or a failed checksum with nothing but zeros after it (a file
system may put zeros where data had not reached the disk); it drops an incomplete last step too.
Both are counted, not raised. The length has a checksum of its own, so a corrupted length is found
rather than taken for a record running past the end. A failed checksum with data after it, and a
record that breaks the step structure, are corruption: `RecordingError`, naming the byte offset.

Pure Python over numpy and msgpack: no torch, so the format and its tests are cheap.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from asyncgrpo.wire import SCHEMA_VERSION, ScoredGroup, WireError, decode_group

# 1: the first format.
FORMAT_VERSION = 1
MAGIC = b"AGRPOREC"
PREAMBLE = MAGIC + struct.pack("<I", FORMAT_VERSION)
HEADER_FILE, CONFIG_FILE, STREAM_FILE = "recording.json", "config.yaml", "stream.bin"
# Makes the recorded config.yaml a Hydra primary config over the schema, so `config.load` composes
# it with overrides exactly as it does a preset.
CONFIG_DEFAULTS = "defaults:\n  - asyncgrpo\n  - _self_\n"

_PREFIX = struct.Struct("<QII")  # body length, crc32 of the length, crc32 of the body
_LENGTH = struct.Struct("<Q")
_META_LENGTH = struct.Struct("<I")
# A record's meta is four small fields and one length per frame (a group has six frames).
_MAX_META_BYTES = 1 << 16


class RecordingError(ValueError):
    """A recording that cannot be read or continued; the message is one line and names the
    directory or file and, for a bad record, its byte offset."""


@dataclass(frozen=True)
class RecordMeta:
    version: int  # the learner's version when it took the group
    index: int  # position in that step's batch
    count: int  # groups in that step
    frames: tuple[int, ...]  # byte length of each wire frame


@dataclass(frozen=True)
class RecordedStep:
    """One learner step's groups: where each record starts in the stream file, in batch order."""

    version: int
    offsets: tuple[int, ...]


@dataclass
class StreamIndex:
    """What `scan` found: the complete steps, and what it ignored at the end."""

    steps: list[RecordedStep] = field(default_factory=list)
    end: int = len(PREAMBLE)  # the byte after the last complete step: where a continuing writer truncates
    torn_records: int = 0  # whole records of an incomplete last step, plus a torn record, if any
    torn_bytes: int = 0  # bytes after `end`

    @property
    def num_groups(self) -> int:
        return sum(len(step.offsets) for step in self.steps)


# ----------------------------------------------------------------------------------------- write


def pack_record(version: int, index: int, count: int, frames: Sequence[bytes | memoryview]) -> bytes:
    """One record: length and checksum prefix, meta, the frames."""
    if not (0 <= index < count and version >= 0):
        raise ValueError(f"need 0 <= index < count and version >= 0, got {version=} {index=} {count=}")
    views = [memoryview(frame).cast("B") for frame in frames]
    meta = msgpack.packb({"version": version, "index": index, "count": count,
                          "frames": [view.nbytes for view in views]}, use_bin_type=True)
    body = b"".join([_META_LENGTH.pack(len(meta)), meta, *views])
    return _PREFIX.pack(len(body), zlib.crc32(_LENGTH.pack(len(body))), zlib.crc32(body)) + body


# ------------------------------------------------------------------------------------------ read


class _Torn(Exception):
    """The record at this offset is the torn tail a crash left."""


def _zeros_from(file: BinaryIO, offset: int) -> bool:
    """Whether everything from `offset` to the end of the file is zero bytes."""
    file.seek(offset)
    while chunk := file.read(1 << 20):
        if chunk.count(0) != len(chunk):
            return False
    return True


def _read_body(file: BinaryIO, offset: int, size: int, name: str) -> tuple[bytes, int]:
    """The body of the record at `offset` and the offset after it; `_Torn` for a torn tail."""
    file.seek(offset)
    prefix = file.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise _Torn
    length, length_crc, crc = _PREFIX.unpack(prefix)
    if zlib.crc32(prefix[:_LENGTH.size]) != length_crc:
        if _zeros_from(file, offset):
            raise _Torn
        raise RecordingError(f"{name}: record at byte offset {offset}: length checksum mismatch (the file is corrupted)")
    end = offset + _PREFIX.size + length
    if end > size:
        raise _Torn
    body = file.read(length)
    if zlib.crc32(body) != crc:
        if end == size or _zeros_from(file, end):  # a write the crash cut short, or zeros in its place
            raise _Torn
        raise RecordingError(f"{name}: record at byte offset {offset}: checksum mismatch (the file is corrupted)")
    return body, end


def _parse_meta(body: bytes, offset: int, name: str) -> tuple[RecordMeta, int]:
    """The record's meta and where its frames start in `body`."""
    def bad(why: str) -> RecordingError:
        return RecordingError(f"{name}: record at byte offset {offset}: {why}")

    if len(body) < _META_LENGTH.size:
        raise bad("shorter than its meta length")
    (meta_length,) = _META_LENGTH.unpack_from(body)
    start = _META_LENGTH.size + meta_length
    if meta_length > _MAX_META_BYTES or start > len(body):
        raise bad(f"meta of {meta_length} bytes does not fit the record")
    try:
        raw = msgpack.unpackb(body[_META_LENGTH.size:start], raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise bad(f"unreadable meta ({type(err).__name__})") from None
    ints = ("version", "index", "count")
    if not isinstance(raw, dict) or not all(type(raw.get(key)) is int for key in ints) \
            or not isinstance(raw.get("frames"), list) or not all(type(n) is int and n >= 0 for n in raw["frames"]):
        raise bad("meta is not {version, index, count, frames}")
    meta = RecordMeta(raw["version"], raw["index"], raw["count"], tuple(raw["frames"]))
    if not (meta.version >= 0 and 0 <= meta.index < meta.count):
        raise bad(f"version {meta.version}, index {meta.index} of {meta.count}")
    if start + sum(meta.frames) != len(body):
        raise bad(f"frames of {sum(meta.frames)} bytes in a body of {len(body) - start}")
    return meta, start


def _group(body: bytes, meta: RecordMeta, start: int, offset: int, name: str) -> ScoredGroup:
    view = memoryview(body)
    frames = []
    for length in meta.frames:
        frames.append(view[start:start + length])
        start += length
    try:
        # The recording holds what the learner accepted: any size it took decodes here.
        return decode_group(frames, max_message_bytes=len(body))
    except WireError as err:
        raise RecordingError(f"{name}: record at byte offset {offset}: not a scored group ({err})") from None


def read_group(file: BinaryIO, offset: int, name: str = STREAM_FILE) -> ScoredGroup:
    """The group recorded at `offset` (one of a `RecordedStep`'s offsets)."""
    size = file.seek(0, 2)
    try:
        body, _ = _read_body(file, offset, size, name)
    except _Torn:
        raise RecordingError(f"{name}: no whole record at byte offset {offset}") from None
    meta, start = _parse_meta(body, offset, name)
    return _group(body, meta, start, offset, name)


def scan(path: Path, start_version: int | None = None, check_groups: bool = True) -> StreamIndex:
    """Index the stream file's complete steps; ignore (and count) a torn tail and an incomplete last
    step. Steps must be consecutive versions (from `start_version` if given). `check_groups` also
    decodes every group, so a stream that would fail half-way through a replay fails here instead."""
    name = str(path)
    index = StreamIndex()
    with path.open("rb") as file:
        size = file.seek(0, 2)
        file.seek(0)
        preamble = file.read(len(PREAMBLE))
        if len(preamble) < len(PREAMBLE) and PREAMBLE.startswith(preamble):
            index.torn_bytes = size  # created, and the crash came before the preamble was whole
            index.end = 0
            return index
        if preamble[:len(MAGIC)] != MAGIC or len(preamble) < len(PREAMBLE):
            raise RecordingError(f"{name}: not a recorded stream (no {MAGIC.decode()} preamble)")
        (found,) = struct.unpack("<I", preamble[len(MAGIC):])
        if found != FORMAT_VERSION:
            raise RecordingError(f"{name}: stream format {found}, this asyncgrpo reads format {FORMAT_VERSION}")
        offset, pending, pending_count = len(PREAMBLE), [], 0
        pending_version = -1
        expected = start_version
        while offset < size:
            try:
                body, end = _read_body(file, offset, size, name)
            except _Torn:
                index.torn_records += 1
                break
            meta, start = _parse_meta(body, offset, name)
            if check_groups:
                _group(body, meta, start, offset, name)
            if meta.index == 0:
                if pending:  # the previous step was cut short, yet records follow
                    raise RecordingError(f"{name}: record at byte offset {offset}: a step starts before the step "
                                         f"at version {pending_version} has all its {pending_count} groups")
                if expected is not None and meta.version != expected:
                    raise RecordingError(f"{name}: record at byte offset {offset}: step at version {meta.version}, "
                                         f"expected version {expected}")
                pending, pending_count, pending_version = [offset], meta.count, meta.version
            elif meta.version != pending_version or meta.count != pending_count or meta.index != len(pending):
                raise RecordingError(f"{name}: record at byte offset {offset}: group {meta.index} of {meta.count} at "
                                     f"version {meta.version} does not continue the step before it")
            else:
                pending.append(offset)
            offset = end
            if len(pending) == pending_count:
                index.steps.append(RecordedStep(pending_version, tuple(pending)))
                index.end, pending, expected = offset, [], pending_version + 1
        index.torn_records += len(pending)  # an incomplete last step
        index.torn_bytes = size - index.end
    return index


# ---------------------------------------------------------------------------------------- header


def read_header(directory: Path) -> dict[str, Any]:
    """recording.json, checked: a missing directory or header, or another format, is one line."""
    if not directory.is_dir():
        raise RecordingError(f"{directory}: no such directory")
    path = directory / HEADER_FILE
    if not path.is_file():
        raise RecordingError(f"{directory}: not a recording (no {HEADER_FILE}; record one with wire.record_dir=DIR)")
    try:
        header = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecordingError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise RecordingError(f"{path}: not a JSON object")
    if header.get("format") != FORMAT_VERSION:
        raise RecordingError(f"{path}: recording format {header.get('format')!r}, this asyncgrpo reads "
                             f"format {FORMAT_VERSION}")
    if header.get("wire_schema") != SCHEMA_VERSION:
        raise RecordingError(f"{path}: groups recorded in wire schema {header.get('wire_schema')!r}, this asyncgrpo "
                             f"decodes schema {SCHEMA_VERSION}")
    if type(header.get("start_version")) is not int or not isinstance(header.get("model_dir"), str):
        raise RecordingError(f"{path}: start_version or model_dir missing")
    if not isinstance(header.get("checkpoint"), (str, type(None))):
        raise RecordingError(f"{path}: checkpoint must be a path or null (got {header['checkpoint']!r})")
    return header
