"""Weight sync by collective broadcast from learner rank 0 into the generators (`weights.backend=nccl`).

    learner rank 0 (group rank 0)                     generator i (group rank i + 1)
    --------------------------------                  ----------------------------------
    PUB: WeightsChunk(version, "__spec__")   ------>  poll(): version v announced
    broadcast bucket 0, 1, ...   ====== group ====>   apply_newest(): receive every bucket at a safe
                                                      point, load into the running engine, ack

Control (which version, and a fingerprint of the names/shapes/dtypes) travels over the same ZeroMQ
PUB socket as the zmq backend; the tensors travel through a separate process group of the learner's
rank 0 and every generator, created without touching the learner ranks' default torch.distributed
group: on GPU an NCCL communicator (vLLM's PyNcclCommunicator over a StatelessProcessGroup, the
pattern vLLM documents for RLHF weight updates), on CPU a gloo group standing in for it, so the
protocol is tested on machines without GPUs. Every generator must join every broadcast, in order:
a generator never skips a version here (it would leave the others waiting), and the learner's push
returns only when every generator has received it, i.e. at the generators' next safe point.

Both sides know the tensor list from the same Hugging Face model directory (names and shapes of the
state dict, float32, in state-dict order); the announcement carries a fingerprint of that list so a
mismatch fails loudly instead of scrambling weights. Tensors are packed into buckets of at most
`bucket_bytes` so a push is a few large collectives, not one per tensor.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from asyncgrpo.weights.base import (
    StreamReceiver,
    TensorSpec,
    WeightTarget,
    fingerprint,
    model_spec,
)
from asyncgrpo.wire import Publisher, SaveNotice, Shutdown, Subscriber, WeightsChunk
from asyncgrpo.wire.network import listening_socket

SPEC_NAME = "__spec__"


class Broadcaster(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class _GlooBroadcaster:
    """CPU: a gloo group on its own TCPStore (independent of the default process group); rank 0's
    store serves on `listener`, the socket its port was advertised from."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 listener: socket.socket | None) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        if listener is not None:
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=listener.detach(), use_libuv=False)
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.group.broadcast(tensor, src).wait()


class _NcclBroadcaster:
    """GPU: vLLM's NCCL wrapper over a stateless group, so the learner's own NCCL group is untouched."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 device: torch.device, listener: socket.socket | None) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                             store_timeout=int(timeout_s), listen_socket=listener)
        self.communicator = PyNcclCommunicator(group, device=device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.communicator.broadcast(tensor, src=src, stream=torch.cuda.current_stream())


def connect(host: str, port: int, rank: int, world_size: int, device: torch.device,
            timeout_s: float, listener: socket.socket | None = None) -> Broadcaster:
    """Join the weight group (rank 0 = the learner, serving the group's store on `listener`, the
    socket bound to `port`). Blocks until all `world_size` members join."""
    if device.type == "cuda":
        return _NcclBroadcaster(host, port, rank, world_size, timeout_s, device, listener)
    return _GlooBroadcaster(host, port, rank, world_size, timeout_s, listener)


def buckets(spec: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive same-dtype tensors, at most `bucket_bytes` per bucket (or one tensor)."""
    result: list[list[int]] = []
    size = 0
    for index, (_, shape, dtype) in enumerate(spec):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not result or size + nbytes > bucket_bytes or spec[result[-1][-1]][2] != dtype:
            result.append([])
            size = 0
        result[-1].append(index)
        size += nbytes
    return result


class NcclWeightSender:
    """Learner rank 0. `wait_for_joins()` must run while every generator runs `NcclWeightReceiver.join()`."""

    def __init__(self, publisher: Publisher, model_dir: str, num_generators: int, device: torch.device,
                 host: str, timeout_s: float, bucket_bytes: int = 256 << 20,
                 spec: list[TensorSpec] | None = None) -> None:
        self.publisher, self.device, self.timeout_s = publisher, device, timeout_s
        self.endpoint = publisher.endpoint
        self.world_size = num_generators + 1
        self.listener = listening_socket(host)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.spec = model_spec(model_dir) if spec is None else spec  # spec: a LoRA run's adapters
        self.buckets = buckets(self.spec, bucket_bytes)
        self.group: Broadcaster | None = None
        self.bytes_pushed = 0

    def join_address(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "world_size": self.world_size}

    def wait_for_joins(self) -> None:
        self.group = connect(self.host, self.port, 0, self.world_size, self.device, self.timeout_s, self.listener)

    def push(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.group is None:
            raise RuntimeError("weights.backend=nccl: push before the weight group was connected")
        named = list(named_tensors)
        got = [(name, tuple(t.shape)) for name, t in named]
        want = [(name, shape) for name, shape, _ in self.spec]
        if got != want:
            raise ValueError(f"weights.backend=nccl: the learner's state dict does not match {len(want)} tensors "
                             f"of the model directory (first difference: "
                             f"{next((g, w) for g, w in zip(got + [None] * len(want), want) if g != w)})")
        announcement = fingerprint(self.spec)
        self.publisher.publish(WeightsChunk(version=version, chunk_index=0, num_chunks=1, names=[SPEC_NAME],
                                            tensors=[announcement], dtypes=["int64"], shapes=[[announcement.size]],
                                            offsets=[0]))
        total = 0
        for bucket in self.buckets:
            flat = torch.cat([named[i][1].detach().to(self.device, torch.float32).reshape(-1) for i in bucket])
            self.group.broadcast(flat, src=0)
            total += flat.numel() * flat.element_size()
        self.bytes_pushed += total
        return total

    def shutdown(self, reason: str) -> None:
        self.publisher.publish(Shutdown(reason=reason))

    def announce(self, notice: SaveNotice) -> None:
        self.publisher.publish(notice)

    def republish(self) -> None:
        # The group's size is fixed when it forms: a new process cannot join it (the driver refuses
        # restarts with this backend before it gets here).
        raise RuntimeError("weights.backend=nccl cannot take a restarted generator into its weight group")

    def close(self) -> None:
        self.publisher.close()


class NcclWeightReceiver(StreamReceiver):
    """Generator side: announcements over the subscription, tensors through the weight group."""

    def __init__(self, subscriber: Subscriber, model_dir: str, device: torch.device, timeout_s: float,
                 bucket_bytes: int = 256 << 20, spec: list[TensorSpec] | None = None) -> None:
        super().__init__(subscriber)
        self.device, self.timeout_s = device, timeout_s
        self.bucket_bytes = bucket_bytes
        self.spec = model_spec(model_dir) if spec is None else spec  # spec: a LoRA run's adapters
        self.expected_fingerprint = fingerprint(self.spec)
        self.buckets: list[list[int]] | None = None
        self.group: Broadcaster | None = None
        self.announced: list[int] = []  # versions announced and not yet received, in order

    def join(self, address: dict[str, Any]) -> None:
        """`address` from `NcclWeightSender.join_address`, plus this generator's group `rank` (>= 1)."""
        self.buckets = buckets(self.spec, self.bucket_bytes)
        self.group = connect(address["host"], address["port"], address["rank"], address["world_size"],
                             self.device, self.timeout_s)

    def _on_chunk(self, message: WeightsChunk) -> bool:
        if message.names != [SPEC_NAME] or not np.array_equal(message.tensors[0], self.expected_fingerprint):
            raise ValueError("weights.backend=nccl: the learner announced a different tensor list than "
                             "this generator's model directory holds")
        self.announced.append(message.version)
        return True

    def apply_newest(self, target: WeightTarget) -> int | None:
        """Receive every announced version in order (each is a collective every member must join);
        load only the newest into `target`."""
        if not self.announced:
            return None
        if self.group is None or self.buckets is None:
            raise RuntimeError("weights.backend=nccl: weights announced before the weight group was connected")
        named: list[tuple[str, torch.Tensor]] = []
        while self.announced:
            version = self.announced.pop(0)
            named = []
            for bucket in self.buckets:
                shapes = [self.spec[i][1] for i in bucket]
                sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
                flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
                self.group.broadcast(flat, src=0)
                for i, part, shape in zip(bucket, flat.split(sizes), shapes):
                    named.append((self.spec[i][0], part.view(shape)))
        target.load_weights(named)
        self.newest_version = version
        return version

    def close(self) -> None:
        self.subscriber.close()

