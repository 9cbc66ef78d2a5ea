"""Weight sync between learner rank 0 and the generators (interface: `asyncgrpo.weights.base`).

`weights.backend` picks the implementation; `make_sender` / `make_receiver` build it from config.
"""

from __future__ import annotations

import torch

from asyncgrpo.schema import Config
from asyncgrpo.weights.adapters import pushed_spec
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
from asyncgrpo.wire.reach import weights_backend

__all__ = ["BACKENDS", "WeightReceiver", "WeightSender", "WeightTarget", "make_receiver", "make_sender"]


def make_sender(cfg: Config, publisher: Publisher, model_dir: str, device: torch.device) -> WeightSender:
    backend = weights_backend(cfg)
    wire_dtype = wire_dtype_for(cfg.weights.wire_dtype, cfg.rollout.dtype)
    if backend == "nccl":
        return NcclWeightSender(publisher, model_dir, cfg.rollout.num_generators, device,
                                host=advertised_host(cfg.wire.host), timeout_s=cfg.wire.startup_timeout_s,
                                spec=pushed_spec(cfg, model_dir))
    if backend == "shm":
        return ShmWeightSender(publisher, pushed_spec(cfg, model_dir), wire_dtype, cfg.weights.shm_dir or default_directory())
    # A restarted generator gets the newest version again (`republish`): kept only if it can restart.
    # weights.delta keeps the newest push's wire values anyway, which republish sends as a full push.
    delta = DeltaEncoder(cfg.weights.full_every) if cfg.weights.delta else None
    return ZmqWeightSender(publisher, pushed_spec(cfg, model_dir), cfg.weights.chunk_bytes,
                           wire_dtype, keep_newest=cfg.rollout.max_restarts > 0, delta=delta)


def make_receiver(cfg: Config, subscriber: Subscriber, model_dir: str, device: torch.device) -> WeightReceiver:
    backend = weights_backend(cfg)
    if backend == "nccl":
        return NcclWeightReceiver(subscriber, model_dir, device, timeout_s=cfg.wire.startup_timeout_s,
                                  spec=pushed_spec(cfg, model_dir))
    if backend == "shm":
        return ShmWeightReceiver(subscriber, pushed_spec(cfg, model_dir),
                                 wire_dtype_for(cfg.weights.wire_dtype, cfg.rollout.dtype), cfg.wire.timeout_s)
    return ZmqWeightReceiver(subscriber, DeltaBase() if cfg.weights.delta else None)
