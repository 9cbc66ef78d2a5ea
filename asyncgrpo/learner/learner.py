"""A learner rank: FSDP2 policy, bypass-mode GRPO step, weight push.

Plain Python; `train.py` wraps it in a Ray actor, tests may run it in-process. Rank 0 owns the
replay queue (the PULL socket) and the weight publisher (the PUB socket).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from asyncgrpo import algo
from asyncgrpo.config import Config, LearnerConfig
from asyncgrpo.learner.batch import Batch, collate, completion_logprobs, micro_batch_bounds
from asyncgrpo.replay import ReplayQueue
from asyncgrpo.resources import pin_to_cores
from asyncgrpo.timing import PhaseTimer
from asyncgrpo.weights.zmq import ZmqWeightPusher
from asyncgrpo.wire import Publisher, Receiver
from asyncgrpo.wire.security import CurveServerKeys


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def advertised(endpoint: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]"):
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return f"{scheme}://{host}:{port}"


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
    ) -> None:
        pin_to_cores(cores or [], torch_threads=cfg.learner.torch_threads)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        torch.manual_seed(cfg.seed)
        on_gpu = cfg.device == "cuda" and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if on_gpu else "gloo",
                init_method=f"tcp://127.0.0.1:{master_port or _free_port()}",
                rank=rank,
                world_size=world_size,
            )
        mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.learner.lr,
            betas=tuple(cfg.learner.betas),
            weight_decay=cfg.learner.weight_decay,
        )
        # Frozen starting weights for the KL penalty, unsharded: the reference only runs forward.
        self.reference = None
        if cfg.algo.kl.enabled:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
            self.reference.requires_grad_(False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_multiplier(step, cfg.learner, cfg.train.max_steps)
        )
        self.pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        self.version = 0
        self.samples_consumed = 0
        self.staleness_histogram: dict[int, int] = {}
        self.queue: ReplayQueue | None = None
        self.pusher: ZmqWeightPusher | None = None
        if rank == 0:
            receiver = Receiver(cfg.wire.host, max_message_bytes=cfg.wire.max_message_bytes, curve=curve,
                                insecure=cfg.wire.insecure)
            self.queue = ReplayQueue(
                receiver,
                capacity_groups=cfg.queue.capacity_groups,
                max_staleness=cfg.train.max_staleness,
                drop_stale=cfg.train.stale_policy in ("drop", "both"),
                full_policy=cfg.queue.full_policy,
            ).start()
            self.pusher = ZmqWeightPusher(Publisher(cfg.wire.host, curve=curve, insecure=cfg.wire.insecure))

    def endpoints(self) -> dict[str, str]:
        """Where generators connect; a wildcard bind is advertised under this node's address."""
        assert self.queue is not None and self.pusher is not None
        return {"groups": advertised(self.queue.receiver.endpoint), "weights": advertised(self.pusher.publisher.endpoint)}

    # ------------------------------------------------------------------------------------ the loop

    def train_steps(self, num_steps: int) -> list[dict[str, float]]:
        return [self.step() for _ in range(num_steps)]

    def step(self) -> dict[str, float]:
        """One learner step: take a batch, compute the loss, update, push weights."""
        assert self.queue is not None
        timer = PhaseTimer()
        start = time.perf_counter()
        with timer("gen_wait"):
            groups = self.queue.take(self.cfg.train.groups_per_step, self.version, self.cfg.wire.timeout_s)
        with timer("prepare"):
            batch = collate(groups, self.pad_id).to(self.device)
        with timer("train"):
            metrics = self._update(batch)
        staleness = self.version - batch.group_version_min
        self.version += 1
        with timer("push"):
            if self.version % self.cfg.weights.push_every_steps == 0:
                metrics["perf/push_bytes"] = self.push_weights()
        self.samples_consumed += batch.num_samples
        step_s = time.perf_counter() - start
        for value in staleness.tolist():
            self.staleness_histogram[value] = self.staleness_histogram.get(value, 0) + 1
        metrics.update({
            "step": self.version,
            "samples": self.samples_consumed,
            "reward/mean": batch.rewards.mean().item(),
            "reward/std": batch.rewards.std().item(),
            "staleness/min": staleness.min().item(),
            "staleness/mean": staleness.float().mean().item(),
            "staleness/max": staleness.max().item(),
            "response/length_mean": batch.mask.sum(1).mean().item(),
            "time/step_s": step_s,
            "perf/samples_per_s": batch.num_samples / step_s,
            "perf/tokens_per_s": batch.num_tokens / step_s,
            **timer.metrics(),
            **self.queue.stats(),
        })
        return metrics

    def _update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on the whole batch, accumulated over token-budget micro-batches.

        Loss denominators are the batch's global token and sequence counts, so the update does
        not depend on how the batch is split.
        """
        self.model.train()
        advantages = algo.group_advantages(batch.rewards, batch.group_index, mode=self.cfg.algo.advantage)
        global_tokens = float(batch.mask.sum())
        global_seqs = float((batch.mask.sum(1) > 0).sum())
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[float, dict[str, float]]] = []
        loss_total = pg_total = 0.0
        for start, end in micro_batch_bounds(batch, self.cfg.learner.micro_batch_tokens):
            micro = batch.rows(start, end)
            loss, metrics = self._micro_batch_loss(micro, advantages[start:end], global_tokens, global_seqs)
            loss.backward()
            loss_total += float(loss.detach())
            pg_total += metrics["loss/pg"]  # with global denominators the shares add up
            parts.append((float(micro.mask.sum()), metrics))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.learner.grad_clip_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        metrics = combine_metrics(parts)
        metrics["optim/lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        metrics["optim/grad_norm"] = float(grad_norm)
        metrics["loss/total"] = loss_total
        metrics["loss/pg"] = pg_total
        metrics["perf/micro_batches"] = len(parts)
        return metrics

    def _micro_batch_loss(self, micro: Batch, advantages: torch.Tensor, global_tokens: float,
                          global_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        a, temperature = self.cfg.algo, self.cfg.rollout.temperature
        # Dr.GRPO's constant must not depend on a micro-batch's padding.
        norm_constant = a.norm_constant or float(self.cfg.rollout.max_new_tokens)
        logits = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
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
                ref_logits = self.reference(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
                ref_logp = completion_logprobs(ref_logits, micro.logit_index, micro.targets, temperature)
            kl = algo.aggregate(algo.kl_penalty(logp, ref_logp, kind=a.kl.kind), micro.mask, a.agg,
                                norm_constant=norm_constant, global_num_tokens=global_tokens,
                                global_num_seqs=global_seqs)
            loss = loss + a.kl.coef * kl
            # Each micro-batch's share of the global mean; combine_metrics weights by tokens.
            metrics["loss/kl"] = float(kl.detach()) * global_tokens / max(1.0, float(micro.mask.sum()))
        return loss, metrics

    # ------------------------------------------------------------------------------ weights

    def full_state_dict(self) -> list[tuple[str, torch.Tensor]]:
        """Unsharded parameters under their Hugging Face names (a collective: every rank calls it)."""
        named = []
        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            named.append((name, full.detach()))
        return named

    def push_weights(self) -> int:
        named = self.full_state_dict()
        if self.pusher is None:
            return 0
        return self.pusher.push(self.version, named)

    def finish(self, reason: str = "training finished") -> dict[str, float]:
        """Make sure the generators hold the final weights, then tell them to stop."""
        if self.pusher is not None:
            if self.version % self.cfg.weights.push_every_steps != 0:
                self.push_weights()
            self.pusher.shutdown(reason)
        return self.summary()

    def summary(self) -> dict[str, float]:
        stats = self.queue.stats() if self.queue else {}
        return {
            "version": self.version,
            "samples": self.samples_consumed,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
            **stats,
        }

    # ------------------------------------------------------------------------------ probes

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Log-prob of tokens 1..L-1 of each sequence given its prefix, at the current version."""
        self.model.eval()
        result = []
        for sequence in sequences:
            ids = torch.tensor([sequence], dtype=torch.int64, device=self.device)
            positions = torch.arange(len(sequence) - 1, device=self.device).unsqueeze(0)
            logp = completion_logprobs(self.model(input_ids=ids).logits, positions, ids[:, 1:],
                                       self.cfg.rollout.temperature)
            result.append(logp[0].cpu().numpy().astype(np.float32))
        return result

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        if self.pusher is not None:
            self.pusher.publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def pid(self) -> int:
        return os.getpid()
