"""Orchestration: start the Ray actors, drive the learner, watch the generators, shut down.

    driver (this process)            Ray actors
    ---------------------            ----------
    prepare model (warm start)
    start learner rank(s)  ------->  Learner: binds the group PULL and weight PUB sockets
    start generators       ------->  Generator x N: vLLM engine, connects to both sockets
    eval at start
    loop: learner.train_steps(k)     generators run freely, throttled by staleness
          write metrics, progress
    learner.finish() -> Shutdown     generators load the final weights and return
    eval at end, summary.json
"""

from __future__ import annotations

import copy
import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from asyncgrpo.config import FILE_TASKS, Config, groups_per_generator, to_yaml, use_curve
from asyncgrpo.metrics import MetricsSink, SampleLogger, open_sinks, require_sink_packages
from asyncgrpo.resources import plan_cores
from asyncgrpo.tasks import Problem, make_task
from asyncgrpo.wire.security import WireKeys

# Quiet, in-process vLLM inside the actors; the driver never imports vLLM.
ACTOR_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class TrainingFailed(RuntimeError):
    pass


def prepare_model(cfg: Config, log=print) -> str:
    if cfg.model.path:
        return str(Path(cfg.model.path).expanduser())
    from asyncgrpo.models.warmstart import ensure_warm_model

    model_kwargs = {
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "num_heads": cfg.model.num_heads,
        "num_kv_heads": cfg.model.num_kv_heads,
        "intermediate_size": cfg.model.intermediate_size,
        "max_positions": cfg.model.max_positions,
    }
    return str(ensure_warm_model(
        Path(cfg.model.cache_dir).expanduser(),
        model_kwargs=model_kwargs,
        task=_task(cfg, endless=True),
        seed=cfg.seed,
        target_accuracy=cfg.model.warmstart_target_accuracy,
        max_seconds=cfg.model.warmstart_max_seconds,
        log=log,
    ))


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gpus_per_actor(cfg: Config, gpus_in_cluster: float) -> float:
    """A whole GPU per actor when there are enough, else an equal share (vLLM + learner on one GPU)."""
    if cfg.device != "cuda":
        return 0.0
    actors = cfg.rollout.num_generators + cfg.learner.world_size
    if gpus_in_cluster <= 0:
        raise TrainingFailed("device=cuda but the Ray cluster has no GPU")
    return min(1.0, gpus_in_cluster / actors)


def _task(cfg: Config, tokenizer_dir: str | None = None, endless: bool = False) -> Any:
    """The configured task. File tasks count prompt tokens with the model's tokenizer (before the
    embedded model exists, with its character tokenizer); `endless` ignores data.epochs (warm start)."""
    if cfg.task.name not in FILE_TASKS:
        return make_task(cfg)
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from asyncgrpo.models.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    if endless:
        cfg = copy.deepcopy(cfg)
        cfg.data.epochs = 0
    return make_task(cfg, tokenizer)


def probe_sequences(problems: list[Problem], tokenizer_dir: str, count: int = 4) -> list[list[int]]:
    """Fixed prompt+answer sequences on which generator and learner log-probs are compared."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for p in problems[:count]]


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job; returns the summary also written to run_dir/summary.json."""
    import ray

    wall_start = time.monotonic()
    require_sink_packages(cfg.log)  # a missing optional package fails here, before Ray or the model
    cfg.device = resolve_device(cfg.device)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    summary: dict[str, Any] = {"status": "starting", "run_dir": str(run_dir)}
    metrics = open_sinks(cfg, run_dir)
    started_ray = False
    try:
        resume = _resume_point(cfg)
        model_dir = prepare_model(cfg)
        if resume is not None:
            summary["resumed_from"] = resume["path"]
            # The KL reference and the architecture are the run's starting weights, not the checkpoint's.
            if Path(resume["model_dir"]).is_dir():
                model_dir = resume["model_dir"]
        summary["model_dir"] = model_dir
        if not ray.is_initialized():
            ray.init(
                address=cfg.ray.address or None,
                num_cpus=_local_cpus(cfg) if not cfg.ray.address else None,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": ACTOR_ENV},
            )
            started_ray = True
        job = _Job(cfg, model_dir, metrics, summary, resume)
        job.run()
        summary["status"] = "finished"
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except BaseException as err:
        summary["status"] = "failed"
        summary["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        summary["wall_s"] = time.monotonic() - wall_start
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
        metrics.close()
        if started_ray:
            ray.shutdown()
    return summary


def _resume_point(cfg: Config) -> dict[str, Any] | None:
    """The checkpoint `resume` names (its meta, with `path`), or None for a fresh run."""
    if not cfg.resume:
        return None
    from asyncgrpo.learner.checkpoint import latest, read_meta

    path = latest(cfg.resume)  # raises with a clear message if no complete checkpoint is there
    return {**read_meta(path), "path": str(path)}


def _local_cpus(cfg: Config) -> int:
    """Logical CPUs of a local Ray cluster: all cores, but at least what the actors ask for (Ray's
    CPU counts only admit actors; pinning to physical cores is resources.plan_cores' job)."""
    import math
    import os

    wanted = math.ceil(cfg.rollout.num_generators * cfg.rollout.num_cpus_per_generator
                       + cfg.learner.world_size * cfg.learner.num_cpus_per_rank)
    return max(cfg.ray.num_cpus or os.cpu_count() or 1, wanted)


def _master_address(pg: Any) -> str:
    """Where rank 0's rendezvous listens: loopback when every rank is on the driver's node."""
    import ray
    from ray.util import placement_group_table

    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    if set(bundle_nodes.values()) == {ray.get_runtime_context().get_node_id()}:
        return "127.0.0.1"
    addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    return addresses[bundle_nodes[0]]


class _Job:
    """The actors of one run and the driver loop over them."""

    def __init__(self, cfg: Config, model_dir: str, metrics: MetricsSink, summary: dict[str, Any],
                 resume: dict[str, Any] | None = None) -> None:
        self.cfg, self.model_dir, self.metrics, self.summary = cfg, model_dir, metrics, summary
        self.resume = resume
        self.sample_logger: SampleLogger | None = None
        self.learner = None  # rank 0: the queue, the weight publisher, the metrics the driver logs
        self.learners: list[Any] = []  # every rank; collectives (steps, pushes, probes) call them all
        self.placement_group = None
        self.generators: list[Any] = []

    def run(self) -> None:
        import ray

        cfg = self.cfg
        try:
            # Loading the task checks the data files: bad data fails (or is counted) before actors start.
            from asyncgrpo.data import absolute_paths

            cfg.data.train_files, cfg.data.eval_files = absolute_paths(cfg.data.train_files), absolute_paths(cfg.data.eval_files)
            task = _task(cfg, self.model_dir)
            if hasattr(task, "describe"):
                print(f"[data] {task.describe()}", flush=True)
                self.summary["data"] = task.report()
                self._fit_steps_to_data(task.num_train_problems)
            eval_problems = task.eval_problems()
            self._start_actors()
            probes = probe_sequences(eval_problems, self.model_dir)
            start_logp = ray.get(self.generators[0].sequence_logprobs.remote(probes))
            if cfg.eval.at_start:
                self._evaluate(eval_problems, "start", step=0)
            runs = [g.run.remote() for g in self.generators]
            self._learn(runs)
            self.summary["learner"] = self._on_all_ranks("finish", timeout_s=cfg.wire.timeout_s)
            generator_stats = ray.get(runs, timeout=cfg.wire.timeout_s)
            self.summary["generators"] = generator_stats
            if cfg.eval.at_end:
                self._evaluate(eval_problems, "end", step=self.summary["steps"])
            self._compare_probes(probes, start_logp)
            if cfg.train.export_at_end:
                export_dir = Path(cfg.run_dir).resolve() / "export"
                self._on_all_ranks("export_hf", str(export_dir), timeout_s=cfg.wire.startup_timeout_s)
                self.summary["export"] = str(export_dir)
        finally:
            self._stop_actors()

    # -------------------------------------------------------------------------------- actors

    def _start_actors(self) -> None:
        import ray

        from asyncgrpo.learner.learner import Learner
        from asyncgrpo.rollout.generator import Generator

        cfg = self.cfg
        generator_cores, learner_cores = plan_cores(
            cfg.rollout.num_generators, cfg.learner.world_size, cfg.rollout.cpu_cores, cfg.learner.cpu_cores
        )
        gpus = gpus_per_actor(cfg, ray.cluster_resources().get("GPU", 0.0))
        keys = WireKeys.generate(cfg.rollout.num_generators) if use_curve(cfg) else None
        self._start_learners(Learner, gpus, learner_cores, keys.server() if keys else None)
        endpoints = ray.get(self.learner.endpoints.remote(), timeout=cfg.wire.startup_timeout_s)
        generator_dir, initial_version, skips = self._resume_learners()
        quotas = groups_per_generator(cfg)
        self.generators = [
            ray.remote(Generator).options(
                num_cpus=cfg.rollout.num_cpus_per_generator, num_gpus=gpus,
                max_restarts=0,
            ).remote(cfg, i, generator_dir, endpoints["groups"], endpoints["weights"], quotas[i], generator_cores[i],
                     keys.client(i) if keys else None, initial_version=initial_version, skip_problems=skips[i])
            for i in range(cfg.rollout.num_generators)
        ]
        ready = ray.get([g.ready.remote() for g in self.generators], timeout=cfg.wire.startup_timeout_s)
        if cfg.weights.backend == "nccl":
            self._connect_weight_group(gpus)
        learner_pids = ray.get([learner.pid.remote() for learner in self.learners], timeout=cfg.wire.timeout_s)
        actors = {"learner_pids": learner_pids, "generator_pids": [r["pid"] for r in ready],
                  "generator_cores": generator_cores, "learner_cores": learner_cores}
        (Path(cfg.run_dir) / "actors.json").write_text(json.dumps(actors, indent=2) + "\n")

    def _fit_steps_to_data(self, num_train_problems: int) -> None:
        """With data.epochs > 0 the prompts run out: stop at the last full step instead of waiting forever.

        Each generator streams its own shard, so a shard's remainder smaller than its quota is lost."""
        cfg = self.cfg
        if cfg.data.epochs <= 0:
            return
        per_generator = num_train_problems // cfg.rollout.num_generators * cfg.data.epochs
        available = min(per_generator // quota for quota in groups_per_generator(cfg))
        if available < 1:
            raise TrainingFailed(f"data.epochs={cfg.data.epochs} over {num_train_problems} training prompts is less "
                                 f"than one step of train.groups_per_step={cfg.train.groups_per_step} groups")
        if cfg.train.max_steps > available:
            print(f"[data] {cfg.data.epochs} epoch(s) of {num_train_problems} prompts fill {available} steps: "
                  f"train.max_steps {cfg.train.max_steps} -> {available}", flush=True)
            cfg.train.max_steps = available

    def _connect_weight_group(self, gpus_per_actor: float) -> None:
        """weights.backend=nccl: learner rank 0 and every generator join one broadcast group, together."""
        import ray

        if self.cfg.device == "cuda" and gpus_per_actor < 1:
            raise TrainingFailed(
                f"weights.backend=nccl needs a GPU per actor (NCCL cannot join two processes on one GPU); each "
                f"actor got {gpus_per_actor:.2f} GPU here: use weights.backend=zmq")
        address = ray.get(self.learner.weight_group_address.remote(), timeout=self.cfg.wire.startup_timeout_s)
        joins = [self.learner.connect_weight_group.remote(),
                 *[g.connect_weight_group.remote(address) for g in self.generators]]
        ray.get(joins, timeout=self.cfg.wire.startup_timeout_s)

    def _stop_actors(self) -> None:
        import ray

        for actor in [*self.generators, *self.learners]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)

    def _start_learners(self, learner_class: type, gpus: float, cores: list[list[int]], curve: Any) -> None:
        """`learner.world_size` ranks, one placement-group bundle each, packed onto as few nodes as
        possible; they form their own torch.distributed group through rank 0's address."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncgrpo.learner.learner import _free_port

        cfg = self.cfg
        world_size = cfg.learner.world_size
        if cfg.device == "cuda" and world_size > 1 and gpus < 1:
            raise TrainingFailed(f"learner.world_size={world_size} needs a whole GPU per learner rank (NCCL cannot put "
                                 f"two ranks on one GPU); each actor got {gpus:.2f} GPU here")
        bundle = {"CPU": cfg.learner.num_cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=cfg.wire.startup_timeout_s)
        master_addr, master_port = _master_address(self.placement_group), _free_port()
        # Actors get absolute paths (checkpoints): their working directory need not be the driver's.
        actor_cfg = copy.deepcopy(cfg)
        actor_cfg.run_dir = str(Path(cfg.run_dir).resolve())
        self.learners = [
            ray.remote(learner_class).options(
                num_cpus=cfg.learner.num_cpus_per_rank, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=rank),
            ).remote(actor_cfg, self.model_dir, rank, world_size, master_port, cores[rank],
                     curve if rank == 0 else None, master_addr=master_addr)
            for rank in range(world_size)
        ]
        self.learner = self.learners[0]

    def _resume_learners(self) -> tuple[str, int, list[int]]:
        """Load the checkpoint into every rank; the generators then start from its weights, written in
        Hugging Face format, at its version, past the prompts already used."""
        cfg = self.cfg
        if self.resume is None:
            return self.model_dir, 0, [0] * cfg.rollout.num_generators
        self._on_all_ranks("load_checkpoint", self.resume["path"], timeout_s=cfg.wire.startup_timeout_s)
        weights_dir = Path(cfg.run_dir).resolve() / f"resume_step_{self.resume['version']}"
        self._on_all_ranks("export_hf", str(weights_dir), timeout_s=cfg.wire.startup_timeout_s)
        positions = self.resume.get("generators", {})
        skips = [int(positions.get(str(i), {}).get("groups_received", 0)) for i in range(cfg.rollout.num_generators)]
        print(f"[resume] {self.resume['path']} at version {self.resume['version']}", flush=True)
        return str(weights_dir), int(self.resume["version"]), skips

    def _on_all_ranks(self, method: str, *args: Any, timeout_s: float) -> Any:
        """Call `method` on every learner rank (a collective); rank 0's result."""
        import ray

        return ray.get([getattr(learner, method).remote(*args) for learner in self.learners], timeout=timeout_s)[0]

    # ---------------------------------------------------------------------------- learn loop

    def _learn(self, runs: list[Any]) -> None:
        import ray
        from tqdm import tqdm

        cfg = self.cfg
        budget_s = cfg.train.max_train_minutes * 60 or float("inf")
        recent_rewards: deque[float] = deque(maxlen=20)
        staleness_max = 0
        # A resumed run goes on from the checkpoint's step up to train.max_steps in all.
        steps = start_steps = int(self.resume["version"]) if self.resume else 0
        samples = start_samples = int(self.resume["samples"]) if self.resume else 0
        records: list[dict[str, float]] = []
        samples_every = cfg.log.samples_every_steps
        next_samples_step = (steps // samples_every + 1) * samples_every if samples_every else 0
        train_start = time.monotonic()
        bar = tqdm(total=cfg.train.max_steps, initial=steps, disable=not cfg.progress, unit="step", dynamic_ncols=True)
        try:
            while steps < cfg.train.max_steps and time.monotonic() - train_start < budget_s:
                chunk = min(cfg.train.steps_per_call, cfg.train.max_steps - steps)
                pending = [learner.train_steps.remote(chunk) for learner in self.learners]
                records = self._wait(pending, runs, timeout_s=cfg.wire.timeout_s * 2 + 30)
                for record in records:
                    record["time/wall_s"] = time.monotonic() - train_start
                    self.metrics.write(record)
                    recent_rewards.append(record["reward/mean"])
                    staleness_max = max(staleness_max, int(record["staleness/max"]))
                steps, samples = int(records[-1]["step"]), int(records[-1]["samples"])
                elapsed = time.monotonic() - train_start
                bar.update(len(records))
                bar.set_postfix(reward=f"{sum(recent_rewards) / len(recent_rewards):.3f}",
                                samples_s=f"{(samples - start_samples) / elapsed:.0f}", stale=staleness_max, refresh=False)
                # Steps arrive in chunks of train.steps_per_call: log at the first boundary past each multiple.
                if samples_every and steps >= next_samples_step:
                    self._log_samples(steps)
                    next_samples_step = (steps // samples_every + 1) * samples_every
        finally:
            bar.close()
            train_s = time.monotonic() - train_start
            self.summary.update({
                "steps": steps,
                "samples": samples,
                "train_s": train_s,
                "samples_per_s": (samples - start_samples) / train_s if train_s > 0 else 0.0,
                "staleness_max": staleness_max,
            })
            if start_steps:
                self.summary["resumed_at_step"] = start_steps
                # The queue of this run counts from the resume (its identity holds per run); the
                # checkpointed run's counters are kept beside them.
                self.summary["queue_at_resume"] = self.resume["counters"]["queue"]
            if records:
                last = records[-1]
                self.summary["groups_dropped_stale"] = int(last["queue/dropped_stale"])
                self.summary["queue"] = {k: v for k, v in last.items() if k.startswith(("queue/", "wire/"))}

    def _log_samples(self, step: int) -> None:
        """A few prompts of the last step with their completions: printed, and kept in samples.jsonl."""
        import ray
        from tqdm import tqdm

        if self.sample_logger is None:
            self.sample_logger = SampleLogger.from_tokenizer_dir(self.cfg.run_dir, self.model_dir)
        groups = ray.get(self.learner.recent_samples.remote(self.cfg.log.samples_per_log),
                         timeout=self.cfg.wire.timeout_s)
        # tqdm.write keeps the progress bar intact below the table.
        tqdm.write(self.sample_logger.log(step, groups))

    def _wait(self, pending: list[Any], runs: list[Any], timeout_s: float) -> list[dict[str, float]]:
        """Rank 0's result once every rank is done, failing loudly if a generator or a rank dies first."""
        import ray

        waiting = list(pending)
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready, _ = ray.wait([*waiting, *runs], num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TrainingFailed(f"no learner progress for {timeout_s:.0f} s")
            for run in runs:
                if run in ready:
                    ray.get(run)  # re-raises the generator's own error
                    raise TrainingFailed("a generator stopped before the learner asked it to")
            for ref in ready:
                ray.get(ref)  # re-raises a rank's own error
                waiting.remove(ref)
        return ray.get(pending[0])

    # -------------------------------------------------------------------------------- eval

    def _evaluate(self, problems: list[Problem], when: str, step: int) -> None:
        import ray

        generator = self.generators[0]
        sampled = ray.get(generator.evaluate.remote(problems, 1.0), timeout=self.cfg.wire.timeout_s)
        greedy = ray.get(generator.evaluate.remote(problems, 0.0), timeout=self.cfg.wire.timeout_s)
        self.summary[f"eval_accuracy_{when}"] = sampled
        self.summary[f"eval_greedy_accuracy_{when}"] = greedy
        self.metrics.write({"step": step, "eval/accuracy": sampled, "eval/greedy_accuracy": greedy, "eval/when": when})
        print(f"[eval {when}] sampled accuracy {sampled:.3f}, greedy {greedy:.3f}", flush=True)

    def _compare_probes(self, probes: list[list[int]], start_logp: list[Any]) -> None:
        """Generator (vLLM) and learner log-probs of fixed sequences at the final version."""
        import numpy as np
        import ray

        generator_logp = ray.get(self.generators[0].sequence_logprobs.remote(probes))
        learner_logp = self._on_all_ranks("sequence_logprobs", probes, timeout_s=self.cfg.wire.timeout_s)
        self.summary["probe"] = {
            "generator_version": ray.get(self.generators[0].loaded_version.remote()),
            "learner_version": self.summary["learner"]["version"],
            "max_abs_diff_vs_learner": max(float(np.abs(g - l).max()) for g, l in zip(generator_logp, learner_logp)),
            "max_abs_change_since_start": max(float(np.abs(g - s).max()) for g, s in zip(generator_logp, start_logp)),
        }
