"""Weight sync over ZeroMQ (works on any device): the learner publishes, generators assemble.

A push of version v is a sequence of `WeightsChunk` messages of at most `chunk_bytes` each, in
Hugging Face parameter names and shapes. A generator keeps only the newest complete version: a
generator that falls behind skips straight to the latest weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from asyncgrpo.weights.base import WeightTarget
from asyncgrpo.wire import Publisher, Shutdown, Subscriber, WeightsChunk

_TORCH_TO_WIRE = {
    torch.float32: ("float32", np.float32),
    torch.float16: ("float16", np.float16),
    torch.bfloat16: ("bfloat16", np.uint16),
    torch.int32: ("int32", np.int32),
    torch.int64: ("int64", np.int64),
}
_WIRE_TO_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "int32": torch.int32, "int64": torch.int64}


def tensor_to_wire(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    # Always a private copy: the frames are sent without copying, by ZeroMQ's I/O thread, after
    # push() returns, while the optimizer updates the parameters (which a full_tensor() on one rank
    # aliases) in place. Without the copy a generator could load a torn mix of two versions.
    tensor = tensor.detach().to("cpu", copy=True).contiguous()
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


class ZmqWeightSender:
    """Learner side (rank 0)."""

    def __init__(self, publisher: Publisher, chunk_bytes: int = 64 << 20) -> None:
        self.publisher = publisher
        self.endpoint = publisher.endpoint
        self.chunk_bytes = chunk_bytes
        self.bytes_pushed = 0

    def join_address(self) -> dict[str, Any]:
        return {}  # subscribers connect to `endpoint`; nothing else to join

    def wait_for_joins(self) -> None:
        pass

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Publish all tensors as version `version`; returns the bytes sent."""
        chunks: list[list[tuple[str, np.ndarray, str]]] = [[]]
        size = 0
        for name, tensor in named_tensors:
            array, wire_dtype = tensor_to_wire(tensor)
            if chunks[-1] and size + array.nbytes > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append((name, array, wire_dtype))
            size += array.nbytes
        total = 0
        for index, chunk in enumerate(chunks):
            self.publisher.publish(WeightsChunk(
                version=version, chunk_index=index, num_chunks=len(chunks),
                names=[c[0] for c in chunk], tensors=[c[1] for c in chunk], dtypes=[c[2] for c in chunk],
            ))
            total += sum(c[1].nbytes for c in chunk)
        self.bytes_pushed += total
        return total

    def shutdown(self, reason: str) -> None:
        self.publisher.publish(Shutdown(reason=reason))

    def close(self) -> None:
        self.publisher.close()


class ZmqWeightReceiver:
    """Generator side: drains the subscription, keeps the newest complete version."""

    def __init__(self, subscriber: Subscriber) -> None:
        self.subscriber = subscriber
        self._partial: dict[int, list[WeightsChunk | None]] = {}
        self.latest: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.newest_version = -1
        self.shutdown_reason: str | None = None

    def join(self, address: dict[str, Any]) -> None:
        pass  # the subscription is the whole transport

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Read what has arrived (waiting up to `timeout_s` for the first message).

        Returns True if a new complete version or a shutdown arrived.
        """
        changed = False
        wait = timeout_s
        while (message := self.subscriber.recv(wait)) is not None:
            wait = 0.0
            if isinstance(message, Shutdown):
                self.shutdown_reason = message.reason
                changed = True
            elif isinstance(message, WeightsChunk):
                changed |= self._add(message)
        return changed

    def _add(self, chunk: WeightsChunk) -> bool:
        if chunk.version <= self.newest_version:
            return False
        slots = self._partial.setdefault(chunk.version, [None] * chunk.num_chunks)
        if len(slots) != chunk.num_chunks:
            raise ValueError(f"weights version {chunk.version}: inconsistent chunk count")
        slots[chunk.chunk_index] = chunk
        if any(slot is None for slot in slots):
            return False
        named = [(name, wire_to_tensor(array, dtype))
                 for slot in slots for name, array, dtype in zip(slot.names, slot.tensors, slot.dtypes)]
        self.latest = (chunk.version, named)
        self.newest_version = chunk.version
        self._partial = {v: s for v, s in self._partial.items() if v > chunk.version}
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
