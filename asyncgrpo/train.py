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

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from asyncgrpo.config import Config, groups_per_generator, to_yaml, use_curve
from asyncgrpo.resources import plan_cores
from asyncgrpo.tasks import ArithmeticTask, Problem
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
        task=_task(cfg),
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


def _task(cfg: Config) -> ArithmeticTask:
    return ArithmeticTask(num_digits=cfg.task.num_digits, eval_size=cfg.task.eval_size)


def probe_sequences(problems: list[Problem], tokenizer_dir: str, count: int = 4) -> list[list[int]]:
    """Fixed prompt+answer sequences on which generator and learner log-probs are compared."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [tokenizer(p.prompt + p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for p in problems[:count]]


class MetricsWriter:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        self.file.close()


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job; returns the summary also written to run_dir/summary.json."""
    import ray

    wall_start = time.monotonic()
    cfg.device = resolve_device(cfg.device)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    summary: dict[str, Any] = {"status": "starting", "run_dir": str(run_dir)}
    metrics = MetricsWriter(run_dir)
    started_ray = False
    try:
        model_dir = prepare_model(cfg)
        summary["model_dir"] = model_dir
        if not ray.is_initialized():
            ray.init(
                address=cfg.ray.address or None,
                num_cpus=(cfg.ray.num_cpus or None) if not cfg.ray.address else None,
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": ACTOR_ENV},
            )
            started_ray = True
        job = _Job(cfg, model_dir, metrics, summary)
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


class _Job:
    """The actors of one run and the driver loop over them."""

    def __init__(self, cfg: Config, model_dir: str, metrics: MetricsWriter, summary: dict[str, Any]) -> None:
        self.cfg, self.model_dir, self.metrics, self.summary = cfg, model_dir, metrics, summary
        self.learner = None
        self.generators: list[Any] = []

    def run(self) -> None:
        import ray

        cfg = self.cfg
        try:
            self._start_actors()
            eval_problems = _task(cfg).eval_problems()
            probes = probe_sequences(eval_problems, self.model_dir)
            start_logp = ray.get(self.generators[0].sequence_logprobs.remote(probes))
            if cfg.eval.at_start:
                self._evaluate(eval_problems, "start", step=0)
            runs = [g.run.remote() for g in self.generators]
            self._learn(runs)
            self.summary["learner"] = ray.get(self.learner.finish.remote(), timeout=cfg.wire.timeout_s)
            generator_stats = ray.get(runs, timeout=cfg.wire.timeout_s)
            self.summary["generators"] = generator_stats
            if cfg.eval.at_end:
                self._evaluate(eval_problems, "end", step=self.summary["steps"])
            self._compare_probes(probes, start_logp)
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
        self.learner = ray.remote(Learner).options(
            num_cpus=cfg.learner.num_cpus_per_rank, num_gpus=gpus, max_restarts=0,
        ).remote(cfg, self.model_dir, 0, 1, None, learner_cores[0], keys.server() if keys else None)
        endpoints = ray.get(self.learner.endpoints.remote(), timeout=cfg.wire.startup_timeout_s)
        quotas = groups_per_generator(cfg)
        self.generators = [
            ray.remote(Generator).options(
                num_cpus=cfg.rollout.num_cpus_per_generator, num_gpus=gpus,
                max_restarts=0,
            ).remote(cfg, i, self.model_dir, endpoints["groups"], endpoints["weights"], quotas[i], generator_cores[i],
                     keys.client(i) if keys else None)
            for i in range(cfg.rollout.num_generators)
        ]
        ready = ray.get([g.ready.remote() for g in self.generators], timeout=cfg.wire.startup_timeout_s)
        actors = {"learner_pids": [ray.get(self.learner.pid.remote())], "generator_pids": [r["pid"] for r in ready],
                  "generator_cores": generator_cores, "learner_cores": learner_cores}
        (Path(cfg.run_dir) / "actors.json").write_text(json.dumps(actors, indent=2) + "\n")

    def _stop_actors(self) -> None:
        import ray

        for actor in [*self.generators, self.learner]:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    # ---------------------------------------------------------------------------- learn loop

    def _learn(self, runs: list[Any]) -> None:
        import ray
        from tqdm import tqdm

        cfg = self.cfg
        budget_s = cfg.train.max_train_minutes * 60 or float("inf")
        recent_rewards: deque[float] = deque(maxlen=20)
        staleness_max = steps = samples = 0
        train_start = time.monotonic()
        bar = tqdm(total=cfg.train.max_steps, disable=not cfg.progress, unit="step", dynamic_ncols=True)
        try:
            while steps < cfg.train.max_steps and time.monotonic() - train_start < budget_s:
                chunk = min(cfg.train.steps_per_call, cfg.train.max_steps - steps)
                pending = self.learner.train_steps.remote(chunk)
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
                                samples_s=f"{samples / elapsed:.0f}", stale=staleness_max, refresh=False)
        finally:
            bar.close()
            train_s = time.monotonic() - train_start
            self.summary.update({
                "steps": steps,
                "samples": samples,
                "train_s": train_s,
                "samples_per_s": samples / train_s if train_s > 0 else 0.0,
                "staleness_max": staleness_max,
            })
            if steps:
                last = records[-1]
                self.summary["groups_dropped_stale"] = int(last["queue/dropped_stale"])
                self.summary["queue"] = {k: v for k, v in last.items() if k.startswith(("queue/", "wire/"))}

    def _wait(self, pending: Any, runs: list[Any], timeout_s: float) -> list[dict[str, float]]:
        """The learner's result, failing loudly if a generator dies or exits first."""
        import ray

        ready, _ = ray.wait([pending, *runs], num_returns=1, timeout=timeout_s)
        if not ready:
            raise TrainingFailed(f"no learner progress for {timeout_s:.0f} s")
        for run in runs:
            if run in ready:
                ray.get(run)  # re-raises the generator's own error
                raise TrainingFailed("a generator stopped before the learner asked it to")
        return ray.get(pending)

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
        learner_logp = ray.get(self.learner.sequence_logprobs.remote(probes))
        self.summary["probe"] = {
            "generator_version": ray.get(self.generators[0].loaded_version.remote()),
            "learner_version": self.summary["learner"]["version"],
            "max_abs_diff_vs_learner": max(float(np.abs(g - l).max()) for g, l in zip(generator_logp, learner_logp)),
            "max_abs_change_since_start": max(float(np.abs(g - s).max()) for g, s in zip(generator_logp, start_logp)),
        }
