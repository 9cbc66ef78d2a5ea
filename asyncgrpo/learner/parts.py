"""Build a learner rank's parts from config: the process group, the policy, and on rank 0 the
replay queue with its generator registry and the weight sender (with their sockets)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from asyncgrpo.composition import (collective_timeout_s, pushed_adapters, run_record, run_task, weights_backend,
                                   wire_transport)
from asyncgrpo.queue.dispatch import Dispatcher
from asyncgrpo.learner.policy import Policy
from asyncgrpo.learner.publication import VersionRing
from asyncgrpo.learner.rendezvous import meet_rank_zero, rank_store
from asyncgrpo.learner.update import overlong_settings
from asyncgrpo.queue.audit import TrainAudit
from asyncgrpo.queue.filtering import SignalFilter
from asyncgrpo.recording.recorder import StreamRecorder, recording_config
from asyncgrpo.queue.registry import GeneratorRegistry
from asyncgrpo.queue.sources import GroupSource
from asyncgrpo.contract import DROPPING_STALE_POLICIES, THROTTLING_STALE_POLICIES
from asyncgrpo.queue.replay_queue import (
    GroupLimits,
    ReplayQueue,
    StalenessEviction,
)
from asyncgrpo.runtime.resources import pin_to_cores
from asyncgrpo.rewards.errors import ErrorWindow
from asyncgrpo.schema import Config
from asyncgrpo.tasks import run_stream_length
from asyncgrpo.weights import make_sender, publication
from asyncgrpo.wire import GrantRouter, Publisher, Receiver
from asyncgrpo.wire.network import advertised, is_loopback
from asyncgrpo.wire.security import CurveServerKeys


@dataclass
class LearnerParts:
    arguments: dict[str, Any]  # Learner's constructor arguments
    endpoints: dict[str, str]  # rank 0: where generators connect ({} on other ranks)


def learner_device(cfg: Config) -> torch.device:
    if cfg.device == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_process_group(cfg: Config, device: torch.device, rank: int, world_size: int, master_addr: str,
                       master_port: int | None, listener: socket.socket | None = None) -> bool:
    """The learner ranks' default group; True if this call created it (a test running several
    learners in one process sets it up itself, and it is left to it). `master_port`: rank 0's
    rendezvous port, None for a single rank, which meets nobody: its store listens on loopback, on
    a port the kernel picks as it binds (a port chosen beforehand may be taken meanwhile).
    `listener`: rank 0's socket already bound to `master_port` (learner/rendezvous.py); without
    one, rank 0 binds `master_port` itself."""
    created = not dist.is_initialized()
    if created:
        backend, timeout = "nccl" if device.type == "cuda" else "gloo", timedelta(seconds=collective_timeout_s(cfg))
        if world_size > 1 and master_port is None:
            raise ValueError(f"{world_size} learner ranks need rank 0's rendezvous port (master_port)")
        if is_loopback(master_addr):  # a run on one node: gloo's sockets on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if world_size == 1:
            store = rank_store("127.0.0.1", 0, 0, 1, timeout)
        else:
            store = rank_store(master_addr, master_port, rank, world_size, timeout, listener)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"expected {rank} of {world_size}")
    return created


def group_limits(cfg: Config, model: torch.nn.Module) -> GroupLimits:
    """What `model` (a Hugging Face causal LM, sharded or not) can train on under `cfg`."""
    # Token ids index the input embedding and the logits (the LM head's rows): the smaller bounds both.
    rows = [model.get_input_embeddings().num_embeddings]
    head = model.get_output_embeddings()
    if head is not None:
        rows.append(head.out_features)
    return GroupLimits(vocab_size=min(rows), max_positions=cfg.model.max_positions,
                       max_samples=cfg.rollout.samples_per_prompt)


def held_dtype(cfg: Config) -> torch.dtype:
    """The dtype the resolved weights backend pushes floating tensors in (`weights.push_dtype`)."""
    from asyncgrpo.weights import push_dtype

    return push_dtype(cfg.weights, weights_backend(cfg), cfg.rollout.dtype)


def version_ring(cfg: Config) -> VersionRing | None:
    """The learner's delayed publication for `train.fixed_staleness` >= 1, holding its copies in
    the dtype the weights travel in; None when the newest weights are pushed (off, or 0)."""
    k = cfg.train.fixed_staleness
    return VersionRing(k, held_dtype(cfg)) if k >= 1 else None


def stream_recorder(cfg: Config, model_dir: str) -> StreamRecorder | None:
    """Rank 0's recorder of the groups it takes, into `wire.record_dir` (None: nothing recorded)."""
    wire = cfg.wire
    if not wire.record_dir:
        return None
    return StreamRecorder(wire.record_dir, recording_config(cfg), model_dir, wire.record_fsync_every_steps)


def outside_sections(cfg: Config) -> dict[str, Any]:
    """The `Learner`'s arguments from sections other than its own (docs/ARCHITECTURE.md, "Config
    sections and their readers")."""
    return {"max_new_tokens": cfg.rollout.max_new_tokens,
            "publication": publication(cfg.weights, cfg.learner.lora.rank),
            "num_generators": cfg.rollout.num_generators, "timeout_s": cfg.wire.timeout_s}


def make_dispatcher(cfg: Config, positions_end: int | None) -> Dispatcher:
    """Learner rank 0's dispatcher; `positions_end`: the run's one
    stream's length (finite data), or None."""
    return Dispatcher(cfg.train.groups_per_step, cfg.train.max_staleness,
                      throttle=cfg.train.stale_policy in THROTTLING_STALE_POLICIES,
                      capacity_groups=cfg.queue.capacity_groups, end_step=cfg.train.max_steps,
                      positions_end=positions_end, fixed_staleness=cfg.train.fixed_staleness >= 0)


def learner_parts(cfg: Config, model_dir: str, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                  master_port: int | None = None, cores: list[int] | None = None,
                  curve: CurveServerKeys | None = None, port_board: Any | None = None) -> LearnerParts:
    """Rank `rank`'s parts. Several ranks meet at `master_addr`:`master_port`, or, given a
    `port_board` (learner/rendezvous.py), at the port rank 0 binds and posts there."""
    from transformers import AutoTokenizer

    pin_to_cores(cores or [], torch_threads=cfg.learner.torch_threads, set_num_threads=torch.set_num_threads)
    device = learner_device(cfg)
    listener = None
    if port_board is not None:
        master_port, listener = meet_rank_zero(port_board, rank, master_addr, cfg.wire.startup_timeout_s)
    owns_group = join_process_group(cfg, device, rank, world_size, master_addr, master_port, listener)
    policy = Policy.from_config(cfg, model_dir, device, rank, world_size, cfg.rollout.temperature)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    arguments: dict[str, Any] = {
        "cfg": cfg, "policy": policy, "model_dir": model_dir, "rank": rank, "world_size": world_size,
        "pad_id": tokenizer.pad_token_id, "owns_process_group": owns_group,
        "ring": version_ring(cfg), "run_record": partial(run_record, cfg), "source": None, "registry": None,
        "weights": None, **outside_sections(cfg),
    }
    if rank != 0:
        return LearnerParts(arguments, {})
    wire = cfg.wire
    # auto decided from the whole config (tcp when actors may span nodes), not from wire.host alone.
    transport = wire_transport(cfg)
    registry = GeneratorRegistry(ErrorWindow.from_config(cfg.reward),
                                 ErrorWindow(cfg.env.max_error_rate, cfg.env.error_window_steps))
    receiver = Receiver(wire.host, max_message_bytes=wire.max_message_bytes, curve=curve, insecure=wire.insecure,
                        transport=transport)
    eviction = StalenessEviction(cfg.train.max_staleness, drop_stale=cfg.train.stale_policy in DROPPING_STALE_POLICIES)
    # Finite data: the generators read the run's one stream, so its end is where grants stop.
    dispatcher = make_dispatcher(cfg, run_stream_length(run_task(cfg, tokenizer), cfg) if cfg.data.epochs > 0 else None)
    grants = GrantRouter(wire.host, curve=curve, insecure=wire.insecure, transport=transport)
    # DAPO's dynamic sampling
    signal_filter = SignalFilter(overlong_settings(cfg, cfg.rollout.max_new_tokens)) if cfg.algo.filter_groups else None
    queue = ReplayQueue(receiver, cfg.queue.capacity_groups, eviction, limits=group_limits(cfg, policy.model),
                        registry=registry, dispatcher=dispatcher, grants=grants, signal_filter=signal_filter,
                        audit=TrainAudit(cfg.log.audit_reservoir_groups, seed=cfg.seed)).start()
    publisher = Publisher(wire.host, curve=curve, insecure=wire.insecure, transport=transport)
    weights = make_sender(cfg.weights, weights_backend(cfg), publisher, model_dir, device,
                          adapters=pushed_adapters(cfg, model_dir), engine_dtype=cfg.rollout.dtype,
                          num_generators=cfg.rollout.num_generators, host=wire.host,
                          startup_timeout_s=wire.startup_timeout_s, max_restarts=cfg.rollout.max_restarts)
    recorder = stream_recorder(cfg, model_dir)
    arguments.update(source=queue, registry=registry, weights=weights, recorder=recorder)
    # A wildcard bind is advertised under this node's address as the cluster knows it (network.py).
    endpoints = {"groups": advertised(receiver.endpoint), "weights": advertised(publisher.endpoint),
                 "tickets": advertised(grants.endpoint)}
    return LearnerParts(arguments, endpoints)


def offline_learner_parts(cfg: Config, model_dir: str, source: GroupSource,
                          recorder: StreamRecorder | None = None) -> LearnerParts:
    """A learner of one rank on `source`, with no generators, no weight pushes and no sockets
    (`asyncgrpo replay`: a `recording.RecordedSource`)."""
    from transformers import AutoTokenizer

    # The thread count fixes the reduction order.
    pin_to_cores([], torch_threads=cfg.learner.torch_threads, set_num_threads=torch.set_num_threads)
    device = learner_device(cfg)
    owns_group = join_process_group(cfg, device, 0, 1, "127.0.0.1", None)
    try:
        policy = Policy.from_config(cfg, model_dir, device, 0, 1, cfg.rollout.temperature)
        pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    except BaseException:
        if owns_group:
            dist.destroy_process_group()
        raise
    return LearnerParts({"cfg": cfg, "policy": policy, "model_dir": model_dir, "pad_id": pad_id, "rank": 0,
                         "world_size": 1, "source": source, "registry": None, "weights": None,
                         "owns_process_group": owns_group, "recorder": recorder, "run_record": partial(run_record, cfg),
                         **outside_sections(cfg)}, {})
