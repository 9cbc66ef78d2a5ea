"""A learner rank: FSDP2 policy, bypass-mode GRPO step, weight push.

Plain Python; `train.py` wraps it in a Ray actor, tests may run it in-process. Rank 0 owns the
replay queue (the PULL socket) and the weight publisher (the PUB socket).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from asyncgrpo import algo
from asyncgrpo.schema import Config, LearnerConfig
from asyncgrpo.learner.batch import (
    Batch,
    broadcast_batch,
    collate,
    completion_logprobs,
    micro_batch_plan,
    rank_shares,
)
from asyncgrpo.replay import ReplayQueue
from asyncgrpo.resources import pin_to_cores
from asyncgrpo.rewards.metrics import reward_term_metrics
from asyncgrpo.timing import PhaseTimer
from asyncgrpo.weights import WeightSender
from asyncgrpo.weights.zmq import ZmqWeightPusher
from asyncgrpo.wire import Publisher, Receiver, ScoredGroup
from asyncgrpo.wire.security import CurveServerKeys


# ScoredGroup.meta field (cumulative per generator) -> the per-step metric of its increase.
GENERATOR_COUNTERS = {
    "gen_idle_s": "time/gen_idle_s",
    "gen_reward_errors": "reward/errors",
    "gen_reward_groups_dropped": "reward/groups_dropped",
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def advertised_host(host: str) -> str:
    """A wildcard bind address as peers on other nodes reach it: this node's address."""
    if host in ("0.0.0.0", "*", "[::]"):
        import socket

        return socket.gethostbyname(socket.gethostname())
    return host


def advertised(endpoint: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":  # an ipc:// path is node-local and the same for every process on this node
        return endpoint
    host, _, port = rest.rpartition(":")
    return f"{scheme}://{advertised_host(host)}:{port}"


def combine_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge per-micro-batch metrics: max of maxima, min of minima, token-weighted mean otherwise."""
    if len(parts) == 1:
        return dict(parts[0][1])
    total = sum(weight for weight, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [(weight, metrics[key]) for weight, metrics in parts if key in metrics]
        if key.endswith("/max"):
            merged[key] = max(v for _, v in values)
        elif key.endswith("/min"):
            merged[key] = min(v for _, v in values)
        else:
            merged[key] = sum(w * v for w, v in values) / total
    return merged


def lr_multiplier(step: int, learner: LearnerConfig, total_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to `min_lr_ratio`."""
    if step < learner.warmup_steps:
        return (step + 1) / learner.warmup_steps
    if learner.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - learner.warmup_steps) / max(1, total_steps - learner.warmup_steps))
    return learner.min_lr_ratio + (1 - learner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def collective_timeout_s(cfg: Config) -> float:
    """How long a rank waits in a collective: rank 0 may first wait for generator acks and then for
    a batch (each up to `wire.timeout_s`) while the others already wait for that batch."""
    return 2 * cfg.wire.timeout_s + 60.0


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; biases and norm scales do not (decaying a norm scale towards 0 only hurts)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def reduce_metrics(parts: list[tuple[float, dict[str, float]]], sums: dict[str, float], world_size: int,
                   device: torch.device) -> dict[str, float]:
    """`combine_metrics` over every rank's micro-batches, plus `sums` added up over ranks.

    Every rank must call it (collectives) with the same keys; a rank whose micro-batches were all
    padding passes weight-0 parts.
    """
    if world_size == 1:
        return {**combine_metrics(parts), **sums}
    keys = sorted(parts[0][1])
    maxima = [k for k in keys if k.endswith("/max")]
    minima = [k for k in keys if k.endswith("/min")]
    means = [k for k in keys if k not in maxima and k not in minima]
    real = [(w, m) for w, m in parts if w > 0]
    total = [sum(w for w, _ in real)] + [sum(w * m[k] for w, m in real) for k in means] + [sums[k] for k in sorted(sums)]
    counts = torch.tensor([len(keys), -len(keys)], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if counts[0] != len(keys) or -counts[1] != len(keys):
        raise RuntimeError(f"learner ranks logged different metrics (this rank: {len(keys)} keys)")
    summed = torch.tensor(total, dtype=torch.float64, device=device)
    high = torch.tensor([max((m[k] for _, m in real), default=-math.inf) for k in maxima] or [0.0],
                        dtype=torch.float64, device=device)
    low = torch.tensor([min((m[k] for _, m in real), default=math.inf) for k in minima] or [0.0],
                       dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    values = summed.tolist()
    weight = values[0] or 1.0
    merged = {k: v / weight for k, v in zip(means, values[1:1 + len(means)])}
    merged.update(zip(maxima, high.tolist()))
    merged.update(zip(minima, low.tolist()))
    merged.update(zip(sorted(sums), values[1 + len(means):]))
    return merged


class Learner:
    def __init__(
        self,
        cfg: Config,
        model_dir: str,
        rank: int = 0,
        world_size: int = 1,
        master_port: int | None = None,
        cores: list[int] | None = None,
        curve: CurveServerKeys | None = None,
        master_addr: str = "127.0.0.1",
    ) -> None:
        pin_to_cores(cores or [], torch_threads=cfg.learner.torch_threads)
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.rank, self.world_size, self.model_dir = cfg, rank, world_size, model_dir
        torch.manual_seed(cfg.seed)
        on_gpu = cfg.device == "cuda" and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self._bf16 = cfg.learner.mixed_precision == "bf16"
        if self._bf16 and not on_gpu:
            raise ValueError("learner.mixed_precision=bf16 needs a GPU; this learner runs on CPU")
        # A group set up by the caller (a test running several learners in one process) is left to it.
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(
                "nccl" if on_gpu else "gloo",
                init_method=f"tcp://{master_addr}:{master_port or _free_port()}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout_s(cfg)),
            )
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"expected {rank} of {world_size}")
        mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        if cfg.learner.activation_checkpointing:
            # Non-reentrant checkpointing composes with FSDP2's hooks (the reentrant one re-runs them).
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._shard(self.model, mesh, offload=cfg.learner.offload_optimizer and on_gpu)
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, cfg.learner.weight_decay),
            lr=cfg.learner.lr,
            betas=tuple(cfg.learner.betas),
            weight_decay=cfg.learner.weight_decay,
        )
        # Frozen starting weights for the KL penalty; forward only, no optimizer state.
        self.reference = None
        self.reference_device = self.device
        if cfg.algo.kl.enabled:
            reference_dtype = torch.bfloat16 if self._bf16 else torch.float32
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=reference_dtype).eval()
            self.reference.requires_grad_(False)
            if cfg.algo.kl.reference_on == "cpu":
                # A full copy on each rank in CPU memory: no GPU memory, no collectives, slower forward.
                self.reference_device = torch.device("cpu")
            else:
                self._shard(self.reference.to(self.device), mesh, offload=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(step, cfg.learner, cfg.train.max_steps)
        )
        self.pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        self.version = 0
        self.samples_consumed = 0
        self.staleness_histogram: dict[int, int] = {}
        self.ack_waits = 0
        self.idle_s = 0.0
        self._first_step_start = 0.0
        self.busy_until = 0.0
        self._generator_counters: dict[tuple[int, str], float] = {}
        self.queue: ReplayQueue | None = None
        self.pusher: WeightSender | None = None
        if rank == 0:
            receiver = Receiver(cfg.wire.host, max_message_bytes=cfg.wire.max_message_bytes, curve=curve,
                                insecure=cfg.wire.insecure, transport=cfg.wire.transport)
            self.queue = ReplayQueue(
                receiver,
                capacity_groups=cfg.queue.capacity_groups,
                max_staleness=cfg.train.max_staleness,
                drop_stale=cfg.train.stale_policy in ("drop", "both"),
                full_policy=cfg.queue.full_policy,
            ).start()
            publisher = Publisher(cfg.wire.host, curve=curve, insecure=cfg.wire.insecure, transport=cfg.wire.transport)
            if cfg.weights.backend == "nccl":
                from asyncgrpo.weights.nccl import NcclWeightSender

                self.pusher = NcclWeightSender(publisher, model_dir, cfg.rollout.num_generators, self.device,
                                               host=advertised_host(cfg.wire.host),
                                               timeout_s=cfg.wire.startup_timeout_s)
            else:
                self.pusher = ZmqWeightPusher(publisher)

    def _shard(self, model: torch.nn.Module, mesh, offload: bool) -> None:
        """FSDP2: each decoder layer is one unit (gathered just for its forward and backward), the root
        holds the rest (embeddings, final norm, LM head)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        options = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self._bf16 else MixedPrecisionPolicy(),
            "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        }
        for layer in model.model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Each rank's loss is its share of the global loss (global denominators), so the
                # gradients must be summed over ranks, not averaged.
                module.set_gradient_divide_factor(1.0)
                # A plain SUM (gloo has no pre-multiplied sum, and with factor 1 there is nothing to scale).
                module.set_force_sum_reduction_for_comms(True)

    def weight_group_address(self) -> dict[str, object]:
        """weights.backend=nccl: where generators join the weight group (rank 0 = this learner)."""
        return self.pusher.address()  # type: ignore[union-attr]

    def connect_weight_group(self) -> None:
        """weights.backend=nccl: join the weight group; returns when every generator has joined."""
        self.pusher.connect()  # type: ignore[union-attr]

    def endpoints(self) -> dict[str, str]:
        """Where generators connect; a wildcard bind is advertised under this node's address."""
        assert self.queue is not None and self.pusher is not None
        return {"groups": advertised(self.queue.receiver.endpoint), "weights": advertised(self.pusher.publisher.endpoint)}

    # ------------------------------------------------------------------------------------ the loop

    def train_steps(self, num_steps: int) -> list[dict[str, float]]:
        """`num_steps` steps; every rank calls it (the driver uses rank 0's metrics)."""
        records = []
        for _ in range(num_steps):
            metrics = self.step()
            every = self.cfg.train.save_every_steps
            if every and self.version % every == 0:
                start = time.perf_counter()
                self.save_checkpoint(Path(self.cfg.run_dir) / "checkpoints")
                metrics["time/checkpoint_s"] = time.perf_counter() - start
            records.append(metrics)
        return records

    def step(self) -> dict[str, float]:
        """One learner step: wait for lagging generators, take a batch, update, push weights.

        Rank 0 waits, takes the groups and sends the collated batch to the other ranks; only its
        metrics carry the queue's and the generators' numbers.
        """
        timer = PhaseTimer()
        start = time.perf_counter()
        self._first_step_start = self._first_step_start or start
        groups = None
        if self.rank == 0:
            assert self.queue is not None
            with timer("ack_wait"):
                self._wait_for_generator_versions()
            with timer("gen_wait"):
                groups = self.queue.take(self.cfg.train.groups_per_step, self.version, self.cfg.wire.timeout_s)
            self._last_taken = (self.version, groups)  # for recent_samples(): what the driver shows
        metrics = self.train_on(groups, timer)
        step_s = time.perf_counter() - start
        self.idle_s += timer.seconds["ack_wait"] + timer.seconds["gen_wait"]
        self.busy_until = time.perf_counter()
        metrics.update({
            "time/step_s": step_s,
            "perf/samples_per_s": metrics["perf/samples"] / step_s,
            "perf/tokens_per_s": metrics["perf/tokens"] / step_s,
            "learner/ack_waits": self.ack_waits,
            **timer.metrics(),
        })
        if self.queue is not None and groups is not None:
            metrics.update(self._generator_deltas(groups))
            metrics.update(self.queue.stats())
        return metrics

    def train_on(self, groups: list[ScoredGroup] | None, timer: PhaseTimer | None = None) -> dict[str, float]:
        """Update on `groups` and push the new version (also used on cached groups by the benchmark).

        Every rank calls it: rank 0 collates `groups` and broadcasts the batch; the other ranks
        ignore their `groups` argument (None is fine) and receive rank 0's batch.
        """
        timer = timer or PhaseTimer()
        with timer("prepare"):
            batch = collate(groups, self.pad_id) if self.rank == 0 else None
            if self.world_size > 1:
                batch = broadcast_batch(batch, self.device)
            else:
                batch = batch.to(self.device)
        with timer("train"):
            metrics = self._update(batch)
        staleness = self.version - batch.group_version_min
        self.version += 1
        with timer("push"):
            if self.version % self.cfg.weights.push_every_steps == 0:
                metrics["perf/push_bytes"] = self.push_weights()
        self.samples_consumed += batch.num_samples
        for value in staleness.tolist():
            self.staleness_histogram[value] = self.staleness_histogram.get(value, 0) + 1
        metrics.update({
            "step": self.version,
            "samples": self.samples_consumed,
            "perf/samples": batch.num_samples,
            "perf/tokens": batch.num_tokens,
            "reward/mean": batch.rewards.mean().item(),
            "reward/std": batch.rewards.std().item(),
            "staleness/min": staleness.min().item(),
            "staleness/mean": staleness.float().mean().item(),
            "staleness/max": staleness.max().item(),
            "response/length_mean": batch.mask.sum(1).mean().item(),
        })
        if groups is not None:
            metrics.update(reward_term_metrics(groups))  # reward/<term> means, reward/errors (weighted terms)
        return metrics

    def train_alone(self, frames: list[list[bytes]], num_steps: int) -> dict[str, float]:
        """Benchmark: `num_steps` steps on cached groups (no queue, no waiting), pushes included.

        Each group is relabelled with the current version, so staleness is 0 as in a sync run.
        """
        from asyncgrpo.wire import decode_group

        groups = [decode_group(f) for f in frames]
        per_step = self.cfg.train.groups_per_step
        seconds = 0.0
        samples = tokens = 0
        for step in range(num_steps):
            batch = [groups[(step * per_step + i) % len(groups)] for i in range(per_step)]
            for group in batch:
                group.versions = np.full_like(group.versions, self.version)
            start = time.perf_counter()
            metrics = self.train_on(batch)
            seconds += time.perf_counter() - start
            samples += int(metrics["perf/samples"])
            tokens += int(metrics["perf/tokens"])
        return {"seconds": seconds, "steps": num_steps, "samples": samples, "tokens": tokens}

    def _wait_for_generator_versions(self) -> None:
        """Hold the update until every generator has loaded a version within `max_staleness` of ours.

        The throttle keeps a generator's *groups* fresh; this keeps its *engine* fresh: a generator
        stuck in a long call (or slow to load) cannot fall further behind than the bound.
        """
        assert self.queue is not None
        floor = self.version - self.cfg.train.max_staleness
        if floor <= 0:
            return
        generator_ids = range(self.cfg.rollout.num_generators)
        deadline = time.monotonic() + self.cfg.wire.timeout_s
        waited = False
        while True:
            acked = self.queue.acked_versions(generator_ids)
            lagging = {g: v for g, v in acked.items() if v < floor}
            # A full step already queued means this step waits on nobody; and a generator blocked on
            # a full queue cannot deliver its acknowledgement until the learner takes (they share
            # the socket). What is trained stays bounded by the throttle and the drop at take.
            if not lagging or self.queue.depth >= self.cfg.train.groups_per_step:
                return
            if not waited:
                waited = True
                self.ack_waits += 1
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"learner at version {self.version} waited {self.cfg.wire.timeout_s:.0f} s for generators to "
                    f"load version >= {floor} (max_staleness={self.cfg.train.max_staleness}); "
                    f"acknowledged versions: {lagging}"
                )
            time.sleep(0.0005)

    def _generator_deltas(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """What the generators counted since the previous step: idle seconds (throttle, weights, full
        queue), reward errors and groups dropped by the reward policy.

        Each group carries its generator's cumulative counters (`GENERATOR_COUNTERS`) as of its
        send, so what was counted for a group that never arrived (a dropped one) still shows.
        """
        deltas = dict.fromkeys(GENERATOR_COUNTERS.values(), 0.0)
        for group in groups:
            for field, metric in GENERATOR_COUNTERS.items():
                value = float(group.meta.get(field, 0.0))
                previous = self._generator_counters.get((group.generator_id, field), 0.0)
                if value > previous:
                    deltas[metric] += value - previous
                    self._generator_counters[(group.generator_id, field)] = value
        return deltas

    def _update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the whole batch, accumulated over token-budget micro-batches.

        Every rank holds the whole batch: advantages and the loss denominators (the batch's global
        token and sequence counts) come from all of it, so the update depends neither on how the
        batch is split into micro-batches nor on the number of ranks. Each rank then trains on its
        share of the groups; FSDP2 sums the gradients over ranks.
        """
        self.model.train()
        advantages = algo.group_advantages(batch.rewards, batch.group_index, mode=self.cfg.algo.advantage)
        global_tokens = float(batch.mask.sum())
        global_seqs = float((batch.mask.sum(1) > 0).sum())
        lengths = batch.attention_mask.sum(1).tolist()
        learner = self.cfg.learner
        plans = [micro_batch_plan(lengths, rows, learner.micro_batch_tokens, learner.bucket_by_length)
                 for rows in rank_shares(batch, self.world_size)]
        mine = plans[self.rank]
        # Each forward and backward is a collective under FSDP2: every rank runs as many micro-batches
        # as the busiest one, a rank that runs out repeats a row with its loss multiplied by 0.
        num_micro = max(1, max(len(plan) for plan in plans))
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[float, dict[str, float]]] = []
        loss_total = pg_total = 0.0
        for i in range(num_micro):
            rows = mine[i] if i < len(mine) else [0]
            index = torch.tensor(rows, dtype=torch.int64, device=batch.rewards.device)
            micro = batch.select(index)
            loss, metrics = self._micro_batch_loss(micro, advantages.index_select(0, index), global_tokens, global_seqs)
            if i >= len(mine):
                (loss * 0.0).backward()
                parts.append((0.0, metrics))
                continue
            loss.backward()
            loss_total += float(loss.detach())
            pg_total += metrics["loss/pg"]  # with global denominators the shares add up
            parts.append((float(micro.mask.sum()), metrics))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), learner.grad_clip_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        metrics = reduce_metrics(parts, {"loss/total": loss_total, "loss/pg": pg_total}, self.world_size,
                                 self.device)
        metrics["optim/lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        metrics["optim/grad_norm"] = float(grad_norm)
        metrics["perf/micro_batches"] = num_micro
        return metrics

    def _micro_batch_loss(self, micro: Batch, advantages: torch.Tensor, global_tokens: float,
                          global_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        a, temperature = self.cfg.algo, self.cfg.rollout.temperature
        # Dr.GRPO's constant must not depend on a micro-batch's padding.
        norm_constant = a.norm_constant or float(self.cfg.rollout.max_new_tokens)
        logits = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, use_cache=False).logits
        logp = completion_logprobs(logits, micro.logit_index, micro.targets, temperature)
        loss, metrics = algo.bypass_policy_loss(
            logp,
            micro.rollout_logp,
            advantages.unsqueeze(1) * micro.mask,
            micro.mask,
            loss_type=a.loss_type,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            clip_c=a.clip_c,
            agg=a.agg,
            norm_constant=norm_constant,
            is_level=a.correction.is_level,
            is_threshold=a.correction.is_threshold,
            is_batch_normalize=a.correction.is_batch_normalize,
            rs=a.correction.rs,
            rs_threshold=a.correction.rs_threshold,
            global_num_tokens=global_tokens,
            global_num_seqs=global_seqs,
        )
        if self.reference is not None:
            with torch.no_grad():
                on = self.reference_device
                ref_logits = self.reference(input_ids=micro.input_ids.to(on), attention_mask=micro.attention_mask.to(on),
                                            use_cache=False).logits
                ref_logp = completion_logprobs(ref_logits, micro.logit_index.to(on), micro.targets.to(on),
                                               temperature).to(logp.device)
            kl = algo.aggregate(algo.kl_penalty(logp, ref_logp, kind=a.kl.kind), micro.mask, a.agg,
                                norm_constant=norm_constant, global_num_tokens=global_tokens,
                                global_num_seqs=global_seqs)
            loss = loss + a.kl.coef * kl
            # Each micro-batch's share of the global mean; combine_metrics weights by tokens.
            metrics["loss/kl"] = float(kl.detach()) * global_tokens / max(1.0, float(micro.mask.sum()))
        return loss, metrics

    # ------------------------------------------------------------------------------ weights

    def full_state_dict(self) -> list[tuple[str, torch.Tensor]]:
        """Unsharded parameters under their Hugging Face names, on rank 0; [] on the other ranks.

        A collective: every rank calls it. Tensors are gathered one at a time, so a rank other than
        0 never holds more than one full tensor.
        """
        named = []
        for name, tensor in self.model.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                if tensor.device != self.device:  # sharded weights offloaded to CPU memory
                    tensor = tensor.to(self.device)
                tensor = tensor.full_tensor()
            if self.rank == 0:
                named.append((name, tensor.detach()))
        return named

    def push_weights(self) -> int:
        named = self.full_state_dict()
        if self.pusher is None:
            return 0
        return self.pusher.push(self.version, named)

    def finish(self, reason: str = "training finished") -> dict[str, float]:
        """Make sure the generators hold the final weights, then tell them to stop (every rank calls it:
        the final push gathers the weights)."""
        if self.version % self.cfg.weights.push_every_steps != 0:
            self.push_weights()
        if self.pusher is not None:
            self.pusher.shutdown(reason)
        return self.summary()

    def summary(self) -> dict[str, float]:
        stats = self.queue.stats() if self.queue else {}
        active_s = self.busy_until - self._first_step_start
        return {
            "version": self.version,
            "samples": self.samples_consumed,
            "idle_s": self.idle_s,
            "idle_frac": self.idle_s / active_s if active_s > 0 else 0.0,
            "ack_waits": self.ack_waits,
            "bytes_pushed": self.pusher.bytes_pushed if self.pusher else 0,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            **stats,
        }

    # ------------------------------------------------------------------------------ probes

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Log-prob of tokens 1..L-1 of each sequence given its prefix, at the current version.

        Every rank calls it (each forward gathers the sharded weights); all ranks return the same.
        """
        self.model.eval()
        result = []
        for sequence in sequences:
            ids = torch.tensor([sequence], dtype=torch.int64, device=self.device)
            positions = torch.arange(len(sequence) - 1, device=self.device).unsqueeze(0)
            logp = completion_logprobs(self.model(input_ids=ids, use_cache=False).logits, positions, ids[:, 1:],
                                       self.cfg.rollout.temperature)
            result.append(logp[0].cpu().numpy().astype(np.float32))
        return result

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        if self.pusher is not None:
            self.pusher.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # --------------------------------------------------------------------- checkpoint and export

    def save_checkpoint(self, directory: str | Path) -> str:
        """A sharded checkpoint in `directory`/step_<version> (every rank calls it); returns its path."""
        from asyncgrpo.learner import checkpoint

        return str(checkpoint.save(self, Path(directory)))

    def load_checkpoint(self, path: str | Path) -> dict:
        """Continue from a checkpoint (every rank calls it, any world size); returns its meta."""
        from asyncgrpo.learner import checkpoint

        return checkpoint.load(self, Path(path))

    def export_hf(self, outdir: str | Path) -> str:
        """The current policy in Hugging Face format (every rank calls it; rank 0 writes)."""
        from asyncgrpo.export import write_hf

        named = self.full_state_dict()
        if self.rank == 0:
            write_hf(named, self.model_dir, Path(outdir))
        return str(outdir)

    def pid(self) -> int:
        return os.getpid()

    def recent_samples(self, num_groups: int) -> list[dict]:
        """The first `num_groups` groups of the last step, as token ids, for the driver to decode and log."""
        version, groups = getattr(self, "_last_taken", (0, []))
        samples = []
        for group in groups[:num_groups]:
            completions = [group.completion(i) for i in range(group.num_samples)]
            samples.append({
                "prompt_id": int(group.prompt_id),
                "generator_id": int(group.generator_id),
                "prompt_tokens": group.prompt_tokens.tolist(),
                "completions": [tokens.tolist() for tokens, _, _ in completions],
                "rewards": group.rewards.astype(float).tolist(),
                # The oldest weights that sampled each completion (all of it, unless a push landed mid-sequence).
                "versions": [int(versions.min()) if versions.size else group.version_min for _, _, versions in completions],
                "staleness": version - group.version_min,
            })
        return samples
