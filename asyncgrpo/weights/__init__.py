"""Weight sync between learner rank 0 and the generators (interface: `asyncgrpo.weights.base`).

`weights.backend` picks the implementation (`resolve_backend`: auto decided from the resolved wire
transport); `make_sender` / `make_receiver` build it from the weights section and what the
composition roots hand them of the others (learner/parts.py, rollout/parts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncgrpo.learner.lora import AdapterLayout
from asyncgrpo.runtime.placement import ordered_memory_platform
from asyncgrpo.schema import WeightsConfig
from asyncgrpo.weights.adapters import pushed_spec, pushes_adapters
from asyncgrpo.weights.base import (
    BACKENDS,
    WeightReceiver,
    WeightSender,
    WeightTarget,
)
from asyncgrpo.weights.delta import DeltaBase, DeltaEncoder
from asyncgrpo.weights.nccl import NcclWeightReceiver, NcclWeightSender
from asyncgrpo.weights.shm import ShmWeightReceiver, ShmWeightSender, default_directory
from asyncgrpo.weights.zmq import ZmqWeightReceiver, ZmqWeightSender, wire_dtype_for
from asyncgrpo.wire import Publisher, Subscriber
from asyncgrpo.wire.network import advertised_host

__all__ = ["BACKENDS", "Publication", "WeightReceiver", "WeightSender", "WeightTarget", "make_receiver", "make_sender",
           "push_dtype", "resolve_backend"]


def resolve_backend(weights: WeightsConfig, transport: str) -> str:
    """`weights.backend` with auto decided: shared memory when the wire stays on this node
    (`transport`, the resolved wire transport, is ipc) and the machine is x86-64 (the slots' seqlock
    needs its memory ordering), zmq otherwise; zmq with weights.delta (bytes saved matter on a
    network, not in a local copy)."""
    if weights.backend != "auto":
        return weights.backend
    if weights.delta:
        return "zmq"
    return "shm" if transport == "ipc" and ordered_memory_platform() else "zmq"



@dataclass(frozen=True)
class Publication:
    """What the learner's pushes take of the weights section (`publication`)."""

    every_steps: int  # weights.push_every_steps
    delta: bool  # weights.delta: pushes carry changed values; a generator that missed one is repaired
    adapters_only: bool  # a LoRA run's pushes carry the adapters alone (`pushes_adapters`)
    max_backlog_versions: int  # weights.max_backlog_versions: how far a generator lags before it is waited for


def publication(weights: WeightsConfig, lora_rank: int) -> Publication:
    """The learner's `Publication` for a run whose LoRA rank is `lora_rank` (0: full fine-tuning)."""
    return Publication(weights.push_every_steps, weights.delta, pushes_adapters(weights, lora_rank),
                       weights.max_backlog_versions)

def push_dtype(weights: WeightsConfig, backend: str, engine_dtype: str) -> torch.dtype:
    """The dtype floating tensors travel in under `backend` (`resolve_backend`): nccl broadcasts
    float32; zmq and shm send `weights.wire_dtype` (auto: `engine_dtype`, rollout.dtype)."""
    return torch.float32 if backend == "nccl" else wire_dtype_for(weights.wire_dtype, engine_dtype)


def make_sender(weights: WeightsConfig, backend: str, publisher: Publisher, model_dir: str, device: torch.device, *,
                adapters: AdapterLayout | None, engine_dtype: str, num_generators: int, host: str,
                startup_timeout_s: float, max_restarts: int) -> WeightSender:
    """Learner rank 0's sender of `backend` (`resolve_backend`): pushes of the model in `model_dir`,
    or of a LoRA run's `adapters`. `engine_dtype` (rollout.dtype) is what wire_dtype=auto follows;
    nccl forms its group with the `num_generators` on the wire `host` within `startup_timeout_s`."""
    wire_dtype = push_dtype(weights, backend, engine_dtype)
    if backend == "nccl":
        return NcclWeightSender(publisher, model_dir, num_generators, device,
                                host=advertised_host(host), timeout_s=startup_timeout_s,
                                spec=pushed_spec(model_dir, adapters))
    if backend == "shm":
        return ShmWeightSender(publisher, pushed_spec(model_dir, adapters), wire_dtype, weights.shm_dir or default_directory())
    # A restarted generator gets the newest version again (`republish`): kept only if it can restart.
    # weights.delta keeps the newest push's wire values anyway, which republish sends as a full push.
    delta = DeltaEncoder(weights.full_every) if weights.delta else None
    return ZmqWeightSender(publisher, pushed_spec(model_dir, adapters), weights.chunk_bytes,
                           wire_dtype, keep_newest=max_restarts > 0, delta=delta)


def make_receiver(weights: WeightsConfig, backend: str, subscriber: Subscriber, model_dir: str, device: torch.device, *,
                  adapters: AdapterLayout | None, engine_dtype: str, startup_timeout_s: float,
                  timeout_s: float) -> WeightReceiver:
    """A generator's receiver of `backend`, for pushes of the model in `model_dir` or of `adapters`
    (as `make_sender`); shm waits up to `timeout_s` (wire.timeout_s) on a slot, nccl joins its group
    within `startup_timeout_s`."""
    if backend == "nccl":
        return NcclWeightReceiver(subscriber, model_dir, device, timeout_s=startup_timeout_s,
                                  spec=pushed_spec(model_dir, adapters))
    if backend == "shm":
        return ShmWeightReceiver(subscriber, pushed_spec(model_dir, adapters),
                                 push_dtype(weights, backend, engine_dtype), timeout_s)
    return ZmqWeightReceiver(subscriber, DeltaBase() if weights.delta else None)
