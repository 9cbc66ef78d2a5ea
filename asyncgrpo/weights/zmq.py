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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncgrpo.weights.base import StreamReceiver, TensorSpec, WeightTarget
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
                 wire_dtype: torch.dtype, keep_newest: bool = False) -> None:
        """`keep_newest`: hold the newest push's chunks for `republish` (a copy of the weights in the
        wire dtype, in this process's memory), for generators that may restart."""
        self.publisher = publisher
        self.keep_newest = keep_newest
        self.newest: list[WeightsChunk] = []
        self.endpoint = publisher.endpoint
        self.spec = list(spec)
        self.wire_dtype = wire_dtype
        self.plan = chunk_plan([math.prod(shape) for _, shape, _ in self.spec], wire_dtype.itemsize, chunk_bytes)
        self.bytes_pushed = 0

    @property
    def payload_bytes(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.spec) * self.wire_dtype.itemsize

    def join_address(self) -> dict[str, Any]:
        return {}  # subscribers connect to `endpoint`; nothing else to join

    def wait_for_joins(self) -> None:
        pass

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Publish every tensor as version `version`, consuming `named_tensors` (which may be a
        generator that gathers lazily) tensor by tensor; returns the payload bytes sent."""
        tensors = iter(named_tensors)
        arrays: dict[int, tuple[np.ndarray, str]] = {}
        chunks: list[WeightsChunk] = []
        total = 0
        for chunk_index, pieces in enumerate(self.plan):
            names, parts, dtypes, shapes, offsets = [], [], [], [], []
            for piece in pieces:
                if piece.index not in arrays:
                    arrays[piece.index] = self._next_array(tensors, piece.index)
                array, wire_dtype = arrays[piece.index]
                name, shape, _ = self.spec[piece.index]
                names.append(name)
                parts.append(array[piece.start:piece.stop])
                dtypes.append(wire_dtype)
                shapes.append(list(shape))
                offsets.append(piece.start)
                if piece.stop == array.size:
                    del arrays[piece.index]  # the frames keep what is still being sent alive
            chunk = WeightsChunk(version=version, chunk_index=chunk_index, num_chunks=len(self.plan), names=names,
                                 tensors=parts, dtypes=dtypes, shapes=shapes, offsets=offsets)
            self.publisher.publish(chunk)
            if self.keep_newest:  # the pieces are private copies (tensor_to_wire): safe to send again
                chunks.append(chunk)
            total += sum(part.nbytes for part in parts)
        if self.keep_newest:
            self.newest = chunks
        self.bytes_pushed += total
        return total

    def republish(self) -> None:
        """Publish the newest push again (a subscriber that connected since received none of it);
        the generators that already hold it skip it."""
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
    chunks_seen: set[int] = field(default_factory=set)
    tensors: dict[str, tuple[np.ndarray, str, list[int]]] = field(default_factory=dict)  # name -> flat, dtype, shape
    filled: dict[str, int] = field(default_factory=dict)  # name -> elements received

    def add(self, chunk: WeightsChunk) -> None:
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
    complete one. A chunk it cannot use is counted under `rejections` (reported to the learner)."""

    def __init__(self, subscriber: Subscriber) -> None:
        super().__init__(subscriber)
        self._assembly: _Assembly | None = None
        self.latest: tuple[int, list[tuple[str, torch.Tensor]]] | None = None

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
        if assembly is None or chunk.version > assembly.version:
            assembly = self._assembly = _Assembly(chunk.version, chunk.num_chunks)  # a newer push replaces a partial one
        if chunk.num_chunks != assembly.num_chunks:
            raise ValueError(f"weights version {chunk.version}: chunk counts {chunk.num_chunks} and {assembly.num_chunks}")
        if chunk.chunk_index in assembly.chunks_seen:
            return False
        assembly.add(chunk)
        if not assembly.complete:
            return False
        self.latest = (chunk.version, assembly.named_tensors())
        self.newest_version = chunk.version
        self._assembly = None
        return True

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
