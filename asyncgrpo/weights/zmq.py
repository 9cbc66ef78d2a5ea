"""Weight sync over ZeroMQ (works on any device): the learner publishes, generators assemble.

A push of version v is a fixed sequence of `WeightsChunk` messages, planned once from the model's
tensor list (`chunk_plan`): each chunk carries at most `chunk_bytes` of payload, and a tensor larger
than that is split into pieces over several chunks, so no message exceeds `wire.max_message_bytes`
whatever the model. Tensors travel in `weights.wire_dtype` (auto: the generators' dtype, so a bf16
engine receives half the bytes) under their Hugging Face names and shapes.

The sender converts (and copies) one tensor at a time and publishes each chunk as soon as it is
full: ZeroMQ's I/O thread sends chunk k while the learner gathers and copies what chunk k+1 needs.
A generator assembles at most one version (the newest it has seen) and keeps at most one complete
version waiting to be loaded: one that falls behind skips straight to the latest weights.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncgrpo.weights.base import StreamReceiver, TensorSpec, WeightTarget
from asyncgrpo.weights.delta import DeltaBase, DeltaEncoder
from asyncgrpo.wire import Publisher, SaveNotice, Shutdown, Subscriber, WeightsChunk

_TORCH_TO_WIRE = {
    torch.float32: ("float32", np.float32),
    torch.float16: ("float16", np.float16),
    torch.bfloat16: ("bfloat16", np.uint16),
    torch.int32: ("int32", np.int32),
    torch.int64: ("int64", np.int64),
}
_WIRE_TO_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "int32": torch.int32, "int64": torch.int64}


# weights.wire_dtype: auto = the generators' engine dtype (rollout.dtype).
WIRE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def tensor_to_wire(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[np.ndarray, str]:
    """A flat private copy of `tensor` on the CPU, in `dtype` (None: its own), as a wire array."""
    # Always a private copy: the frames are sent without copying, by ZeroMQ's I/O thread, after
    # push() returns, while the optimizer updates the parameters (which a full_tensor() on one rank
    # aliases) in place. Without the copy a generator could load a torn mix of two versions.
    tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype, copy=True).contiguous().reshape(-1)
    if tensor.dtype not in _TORCH_TO_WIRE:
        raise TypeError(f"cannot send dtype {tensor.dtype}")
    name, _ = _TORCH_TO_WIRE[tensor.dtype]
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), name
    return tensor.numpy(), name


def wire_to_tensor(array: np.ndarray, wire_dtype: str) -> torch.Tensor:
    with warnings.catch_warnings():
        # The frame is read-only; vLLM copies it into its own parameters, so no copy here.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array.view(np.int16) if wire_dtype == "bfloat16" else array)
    return tensor.view(torch.bfloat16) if wire_dtype == "bfloat16" else tensor


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of tensor `index` (in the spec's order), flattened."""

    index: int
    start: int
    stop: int


def chunk_plan(numels: Sequence[int], itemsize: int, chunk_bytes: int) -> list[list[Piece]]:
    """Tensors (by element count, in order) packed into chunks of at most `chunk_bytes` payload;
    a tensor that does not fit in what is left of a chunk continues in the next ones."""
    per_chunk = max(1, chunk_bytes // itemsize)
    chunks: list[list[Piece]] = [[]]
    room = per_chunk
    for index, numel in enumerate(numels):
        start = 0
        while True:
            if room == 0 and start < numel:
                chunks.append([])
                room = per_chunk
            stop = min(numel, start + room)
            chunks[-1].append(Piece(index, start, stop))
            room -= stop - start
            start = stop
            if start >= numel:
                break
    return chunks


def wire_dtype_for(setting: str, engine_dtype: str) -> torch.dtype:
    """`weights.wire_dtype` as a torch dtype; auto follows the engine (`rollout.dtype`)."""
    name = engine_dtype if setting == "auto" else setting
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class ZmqWeightSender:
    """Learner side (rank 0). `spec`: the names, shapes and dtypes of every push, in order."""

    def __init__(self, publisher: Publisher, spec: Sequence[TensorSpec], chunk_bytes: int,
                 wire_dtype: torch.dtype, keep_newest: bool = False, delta: DeltaEncoder | None = None) -> None:
        """`keep_newest`: hold the newest push's chunks for `republish` (a copy of the weights in the
        wire dtype, in this process's memory), for generators that may restart. `delta`: push only
        what changed (weights.delta; a 16-bit wire dtype); it keeps the newest push's wire values,
        so `republish` works with it whatever `keep_newest`."""
        self.publisher = publisher
        self.keep_newest = keep_newest
        self.delta = delta
        self.newest: list[WeightsChunk] = []
        self.endpoint = publisher.endpoint
        self.spec = list(spec)
        self.wire_dtype = wire_dtype
        self.plan = chunk_plan([math.prod(shape) for _, shape, _ in self.spec], wire_dtype.itemsize, chunk_bytes)
        self.bytes_pushed = 0

    @property
    def payload_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.spec) * self.wire_dtype.itemsize

    @property
    def changed_fraction(self) -> float:
        """weights.delta: the fraction of elements whose wire value changed in the last push."""
        return self.delta.changed_fraction if self.delta is not None else 1.0

    def request_full(self) -> None:
        """weights.delta: make the next push a full one."""
        if self.delta is not None:
            self.delta.request_full()

    def join_address(self) -> dict[str, Any]:
        return {}  # subscribers connect to `endpoint`; nothing else to join

    def wait_for_joins(self) -> None:
        pass

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Publish every tensor as version `version`, consuming `named_tensors` (which may be a
        generator that gathers lazily) tensor by tensor; returns the payload bytes sent. With
        weights.delta, only what changed since the previous push, unless a full push is due."""
        tensors = iter(named_tensors)
        full = self.delta is None or self.delta.next_is_full()
        total = self._publish(version, lambda index: self._next_array(tensors, index), full,
                              keep=self.keep_newest and self.delta is None, track=self.delta is not None)
        if self.delta is not None:
            self.delta.pushed(version, full)
        self.bytes_pushed += total
        return total

    def _publish(self, version: int, array_of: Callable[[int], tuple[np.ndarray, str]], full: bool,
                 keep: bool, track: bool = False) -> int:
        """Publish `version` chunk by chunk, taking each tensor's wire array from `array_of(index)`
        when its first piece is due; a delta (not `full`) against `self.delta`'s previous push.
        `keep`: hold the chunks for `republish`; `track`: each tensor becomes the next delta's base.
        Returns the payload bytes."""
        arrays: dict[int, tuple[np.ndarray, str]] = {}
        chunks: list[WeightsChunk] = []
        total = 0
        for chunk_index, pieces in enumerate(self.plan):
            chunk = WeightsChunk(version=version, chunk_index=chunk_index, num_chunks=len(self.plan), names=[],
                                 tensors=[], dtypes=[], shapes=[], offsets=[],
                                 base_version=-1 if full else self.delta.base_version)
            for piece in pieces:
                if piece.index not in arrays:
                    arrays[piece.index] = array_of(piece.index)
                array, wire_dtype = arrays[piece.index]
                name, shape, _ = self.spec[piece.index]
                part = array[piece.start:piece.stop]
                if not full:
                    encoding, positions, part = self.delta.encode(piece.index, piece.start, part)
                    chunk.encodings.append(encoding)
                    chunk.spans.append(piece.stop - piece.start)
                    chunk.positions.append(positions)
                    total += positions.nbytes
                chunk.names.append(name)
                chunk.tensors.append(part)
                chunk.dtypes.append(wire_dtype)
                chunk.shapes.append(list(shape))
                chunk.offsets.append(piece.start)
                total += part.nbytes
                if piece.stop == array.size:
                    if track:
                        self.delta.keep(piece.index, array, wire_dtype, full)
                    del arrays[piece.index]  # the frames keep what is still being sent alive
            self.publisher.publish(chunk)
            if keep:  # the pieces are private copies (tensor_to_wire): safe to send again
                chunks.append(chunk)
        if keep:
            self.newest = chunks
        return total

    def republish(self) -> None:
        """Publish the newest push again (a subscriber that connected since received none of it);
        the generators that already hold it skip it. With weights.delta, as a full push built from
        the kept wire values (a delta would need a base the newcomer lacks)."""
        if self.delta is not None:
            if self.delta.base_version >= 0:
                self._publish(self.delta.base_version, self.delta.previous.__getitem__, full=True, keep=False)
            return
        if not self.keep_newest:
            raise RuntimeError("republish needs a ZmqWeightSender built with keep_newest=True")
        for chunk in self.newest:
            self.publisher.publish(chunk)

    def _next_array(self, tensors: Iterable[tuple[str, torch.Tensor]], index: int) -> tuple[np.ndarray, str]:
        name, tensor = next(tensors)  # type: ignore[call-overload]
        want_name, want_shape, _ = self.spec[index]
        if name != want_name or tuple(tensor.shape) != tuple(want_shape):
            raise ValueError(f"weight push: got {name} {tuple(tensor.shape)} where the model has "
                             f"{want_name} {tuple(want_shape)}")
        return tensor_to_wire(tensor, self.wire_dtype if tensor.is_floating_point() else None)

    def shutdown(self, reason: str) -> None:
        self.publisher.publish(Shutdown(reason=reason))

    def announce(self, notice: SaveNotice) -> None:
        self.publisher.publish(notice)

    def close(self) -> None:
        self.publisher.close()


@dataclass
class _Assembly:
    """One version being received: each tensor's pieces copied into a flat buffer (or kept as the
    frame itself when one piece is the whole tensor)."""

    version: int
    num_chunks: int
    base_version: int = -1  # a delta onto that version (weights.delta): its pieces wait in `deltas`
    chunks_seen: set[int] = field(default_factory=set)
    tensors: dict[str, tuple[np.ndarray, str, list[int]]] = field(default_factory=dict)  # name -> flat, dtype, shape
    filled: dict[str, int] = field(default_factory=dict)  # name -> elements received
    # name, offset, span, encoding, positions, values: applied all at once when the delta is complete
    deltas: list[tuple[str, int, int, int, np.ndarray, np.ndarray]] = field(default_factory=list)

    def add(self, chunk: WeightsChunk) -> None:
        if chunk.is_delta:
            self.deltas += zip(chunk.names, chunk.offsets, chunk.spans, chunk.encodings, chunk.positions, chunk.tensors)
            self.chunks_seen.add(chunk.chunk_index)
            return
        for name, part, dtype, shape, offset in zip(chunk.names, chunk.tensors, chunk.dtypes, chunk.shapes,
                                                    chunk.offsets):
            numel = math.prod(shape)
            if name not in self.tensors:
                whole = offset == 0 and part.size == numel
                self.tensors[name] = (part if whole else np.empty(numel, dtype=part.dtype), dtype, shape)
            flat, known_dtype, known_shape = self.tensors[name]
            if known_dtype != dtype or list(known_shape) != list(shape):
                raise ValueError(f"weights version {self.version}: {name} changed shape or dtype between chunks")
            if flat is not part:
                flat[offset:offset + part.size] = part
            self.filled[name] = self.filled.get(name, 0) + part.size
        self.chunks_seen.add(chunk.chunk_index)

    @property
    def complete(self) -> bool:
        return len(self.chunks_seen) == self.num_chunks

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        missing = [name for name, (flat, _, _) in self.tensors.items() if self.filled[name] != flat.size]
        if missing:
            raise ValueError(f"weights version {self.version}: pieces of {missing[:3]} are missing or overlap")
        return [(name, wire_to_tensor(flat, dtype).view(*shape)) for name, (flat, dtype, shape) in self.tensors.items()]


class ZmqWeightReceiver(StreamReceiver):
    """Generator side: drains the subscription, assembles the newest version, keeps the newest
    complete one. A chunk it cannot use is counted under `rejections` (reported to the learner).
    With `delta` (weights.delta) it keeps that version's wire values to apply the next delta onto;
    a delta onto another version (one was lost) is skipped and counted (`delta_mismatches`, which
    the heartbeat reports: learner rank 0 then publishes a full push) and the engine keeps its
    weights meanwhile: it never loads a mix of two versions."""

    def __init__(self, subscriber: Subscriber, delta: DeltaBase | None = None) -> None:
        super().__init__(subscriber)
        self._assembly: _Assembly | None = None
        self.latest: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.delta = delta

    @property
    def delta_mismatches(self) -> int:
        return self.delta.mismatches if self.delta is not None else 0

    def join(self, address: dict[str, Any]) -> None:
        pass  # the subscription is the whole transport

    def _on_chunk(self, chunk: WeightsChunk) -> bool:
        try:
            return self._add(chunk)
        except ValueError as err:
            self._assembly = None
            self.subscriber.rejected.record_error("inconsistent_weights", str(err))
            return False

    def _add(self, chunk: WeightsChunk) -> bool:
        assembly = self._assembly
        if chunk.version <= self.newest_version or (assembly is not None and chunk.version < assembly.version):
            return False  # older than what we have: skipped
        if chunk.is_delta and not self._delta_applies(chunk):
            if assembly is not None and chunk.version > assembly.version:
                self._assembly = None  # that older push lost chunks: it will never complete
            return False
        # A newer push replaces a partial one; so does a full push of the version whose delta is under way.
        if (assembly is None or chunk.version > assembly.version
                or (assembly.base_version >= 0 and not chunk.is_delta)):
            assembly = self._assembly = _Assembly(chunk.version, chunk.num_chunks, chunk.base_version)
        elif chunk.base_version != assembly.base_version:
            return False  # a delta of the version whose full push is under way: the full one will do
        if chunk.num_chunks != assembly.num_chunks:
            raise ValueError(f"weights version {chunk.version}: chunk counts {chunk.num_chunks} and {assembly.num_chunks}")
        if chunk.chunk_index in assembly.chunks_seen:
            return False
        assembly.add(chunk)
        if not assembly.complete:
            return False
        self._assembly = None
        self.latest = (chunk.version, self._complete(assembly))
        self.newest_version = chunk.version
        return True

    def _delta_applies(self, chunk: WeightsChunk) -> bool:
        """A delta chunk: whether this receiver holds its base version (else counted as a mismatch)."""
        if self.delta is None:
            raise ValueError(f"weights version {chunk.version}: a delta push, but this generator keeps no base "
                             "(weights.delta differs between learner and generator)")
        if chunk.base_version == self.delta.version:
            return True
        self.delta.mismatch(chunk.version)
        return False

    def _complete(self, assembly: _Assembly) -> list[tuple[str, torch.Tensor]]:
        """The tensors of a version just completed; with weights.delta it becomes the base."""
        if self.delta is None:
            return assembly.named_tensors()
        if assembly.base_version < 0:
            named = assembly.named_tensors()
            self.delta.replace(assembly.version, assembly.tensors)
            return named
        try:
            self.delta.apply(assembly.version, assembly.deltas)
        except ValueError:
            self.delta.drop()
            raise
        return [(name, wire_to_tensor(flat, dtype).view(*shape)) for name, (flat, dtype, shape) in self.delta.tensors.items()]

    def take_latest(self) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        latest, self.latest = self.latest, None
        return latest

    def apply_newest(self, target: WeightTarget) -> int | None:
        latest = self.take_latest()
        if latest is None:
            return None
        version, named_tensors = latest
        target.load_weights(named_tensors)
        return version

    def close(self) -> None:
        self.subscriber.close()
