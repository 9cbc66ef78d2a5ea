"""`asyncgrpo train`: one training job, as its phases. The parts live in asyncgrpo.driver:

    prepare      reward functions imported and the judge probed, the device, the model (warm start),
                 the resume point, Ray, the data
    actors       start learner rank(s) and generators, weight rendezvous, stop
    evaluation   eval and probes at the start
    loop         learner.train_steps(k) in chunks; metrics, progress, samples; generators watched
    finish       learner.finish() -> Shutdown; generators load the final weights and return (one
                 that died after the last step is left out: the evaluations use another, or a
                 fresh engine on the final weights)
    evaluation   eval and probes at the end; export
    summary.json written whatever happened
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from asyncgrpo import __version__
from asyncgrpo.config import probe_tolerance, set_resolved_device
from asyncgrpo.composition import learner_wait_timeout_s
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.actors import Actors, gpus_per_actor
from asyncgrpo.driver.evaluation import Probes, check_probe, evaluate, probe_sequences
from asyncgrpo.driver.loop import RemoteLearner, StepsNotLogged, note_audit_departure, note_lost_groups, run_loop
from asyncgrpo.driver.prepare import (
    ACTOR_ENV,
    load_data,
    prepare_model,
    resolve_device,
    resume_point,
    start_ray,
    starting_model,
)
from asyncgrpo.runtime.files import private_dir, write_atomic
from asyncgrpo.runtime.interrupts import interrupts_deferred
from asyncgrpo.runtime.provenance import code_identity
from asyncgrpo.metrics import (
    MetricsSink,
    SampleLogger,
    open_sinks,
    require_sink_packages,
    set_aside_steps_after,
)
from asyncgrpo.driver.preflight import check_rewards, preflight
from asyncgrpo.rollout.evaluations import periodic_eval_line
from asyncgrpo.schema import Config, ConfigError, to_yaml


def train(cfg: Config) -> dict[str, Any]:
    """Run one training job; returns the summary also written to run_dir/summary.json."""
    wall_start = time.monotonic()
    require_sink_packages(cfg.log)  # a missing optional package fails here, before Ray or the model
    # Created 0700, or refused in one line if another user could have planted a checkpoint in it.
    run_dir = Path(cfg.run_dir)
    private_dir(run_dir)
    refuse_used_run_dir(cfg, run_dir)
    keep_earlier_run_files(run_dir)
    summary: dict[str, Any] = {"status": "starting", "run_dir": str(run_dir), "code": code_identity(__version__)}
    metrics: MetricsSink | None = None
    started_ray = False
    # Everything from here on is inside the try: an interrupt at any point of the set-up (importing
    # torch, the warm start, Ray's start, the actors') still writes summary.json and stops what started.
    try:
        set_resolved_device(cfg, resolve_device(cfg.device))  # validated again if auto resolved
        print(f"run_dir: {run_dir.expanduser().absolute()}", flush=True)  # once the config holds; the last line too
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        # First: a reward.fn typo or a judge that is down fails in one line, not after the warm start.
        summary["reward_check"] = check_rewards(cfg)
        resume = resume_point(cfg)
        if resume is not None:  # the steps after the checkpoint are trained again: logged once
            set_aside = set_aside_steps_after(run_dir / "metrics.jsonl", int(resume["version"]))
            if set_aside:
                print(f"[resume] {set_aside} records of steps after {resume['version']} moved to "
                      "metrics.abandoned.jsonl: they are trained again", flush=True)
        metrics = open_sinks(cfg, run_dir)  # metrics.jsonl is appended to: a resumed run continues it
        model_dir = starting_model(cfg, resume, summary)
        summary["preflight"] = preflight(cfg, model_dir)  # bad settings fail here, in one line, before Ray
        started_ray = start_ray(cfg)
        _run_actors(cfg, model_dir, metrics, summary, resume)
        summary["status"] = "finished"
        note_lost_groups(summary, cfg.train.max_lost_fraction)  # finished, but maybe on a selection of its groups
        note_audit_departure(summary, cfg.log.audit_max_ks, cfg.log.audit_min_groups)  # trained against sampled
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except BaseException as err:
        summary["status"] = "failed"
        summary["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        with interrupts_deferred():
            summary["wall_s"] = time.monotonic() - wall_start
            write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=float) + "\n")
            if metrics is not None:
                metrics.close()
            if started_ray:
                import ray

                ray.shutdown()
    return summary


def refuse_used_run_dir(cfg: Config, run_dir: Path) -> None:
    """A fresh run into a directory that holds a run (its metrics.jsonl, its checkpoints/) would
    append its steps to that run's metrics and leave its checkpoints for a later resume=auto to
    pick: refused in one line unless resuming or run_dir_reuse=true asks for it."""
    if cfg.resume or cfg.run_dir_reuse:
        return
    held = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:  # empty: a run that stopped before its first step
        held.append("metrics.jsonl")
    checkpoints = run_dir / "checkpoints"
    # Only saved steps count: an empty directory may be a mount point made for the checkpoints, and
    # LINEAGE.json alone is what a run that saved nothing wrote.
    if checkpoints.is_dir() and any(p.name.startswith("step_") for p in checkpoints.iterdir()):
        held.append("checkpoints")
    if held:
        raise ConfigError(f"run_dir={run_dir} already holds a run ({' and '.join(held)}): pass resume=auto to continue "
                          "it, run_dir_reuse=true to start afresh in it, or choose another run_dir")


def keep_earlier_run_files(run_dir: Path) -> None:
    """A run directory used before (a resumed or restarted run continuing in it) keeps the earlier
    summary.json and config.yaml as summary.<k>.json and config.<k>.yaml, k = 1, 2, ... in order;
    metrics.jsonl and samples.jsonl are appended to instead."""
    earlier = [run_dir / name for name in ("summary.json", "config.yaml") if (run_dir / name).is_file()]
    if not earlier:
        return
    taken = [int(p.suffixes[0][1:]) for p in run_dir.glob("summary.*.json") if p.suffixes[0][1:].isdigit()]
    taken += [int(p.suffixes[0][1:]) for p in run_dir.glob("config.*.yaml") if p.suffixes[0][1:].isdigit()]
    k = max(taken, default=0) + 1
    for path in earlier:
        path.rename(path.with_name(f"{path.stem}.{k}{path.suffix}"))
    print(f"[run_dir] {run_dir} was used before: its {' and '.join(p.name for p in earlier)} kept with suffix .{k}; "
          "metrics.jsonl and samples.jsonl are appended to", flush=True)


def save_on_interrupt(actors: Actors, interrupt: KeyboardInterrupt) -> str | None:
    """The interrupted run's checkpoint, or None if it could not be saved (the reason is printed;
    a second Ctrl-C gives up on it). None too if the steps the learner was taking when `interrupt`
    came were not logged: the checkpoint would hold steps whose metrics are missing."""
    if isinstance(interrupt, StepsNotLogged):
        print(f"[interrupt] no checkpoint: the learner's steps in progress were not logged ({interrupt})", flush=True)
        return None
    print("[interrupt] saving a checkpoint of the current step (Ctrl-C again to skip)", flush=True)
    try:
        path = actors.save_checkpoint()
    except (KeyboardInterrupt, TrainingFailed) as err:
        print(f"[interrupt] no checkpoint: {type(err).__name__}: {err}", flush=True)
        return None
    print(f"[interrupt] checkpoint {path}; continue with resume={Path(path).parent.parent}", flush=True)
    return path


def _run_actors(cfg: Config, model_dir: str, metrics: MetricsSink, summary: dict[str, Any],
                resume: dict[str, Any] | None) -> None:
    """From the data to the export: the phases that need the actors, which stop whatever happens."""
    actors = Actors(cfg, model_dir)
    try:
        eval_problems = load_data(cfg, model_dir, summary)
        actors.start(resume)
        probes = Probes.at_start(actors, eval_problems, model_dir)
        if cfg.eval.at_start:
            start_step = int(resume["version"]) if resume is not None else 0
            summary.update(evaluate(actors, eval_problems, "start", step=start_step, metrics=metrics))
        runs = [generator.run.remote() for generator in actors.generators]  # replaced in place on a restart
        try:
            remote = RemoteLearner(cfg, actors.learners, runs, restart=actors.restart_generator)
            run_loop(cfg, remote, metrics, SampleLogger.from_tokenizer_dir(cfg.run_dir, model_dir), summary, resume,
                     evaluations=actors.take_evaluations)  # none without eval.every_steps
        except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM (preemption): keep what was learned
            if cfg.train.checkpoint_on_interrupt:
                summary["interrupt_checkpoint"] = save_on_interrupt(actors, interrupt)
            raise
        summary["learner"] = actors.on_all_ranks("finish", "training finished", timeout_s=learner_wait_timeout_s(cfg))
        summary["generators"] = actors.generator_reports(runs, final_version=summary["learner"]["version"])
        for record in actors.take_evaluations():  # those of the last chunk's versions
            metrics.write(record)
            print(periodic_eval_line(record), flush=True)
        if cfg.eval.at_end:
            summary.update(evaluate(actors, eval_problems, "end", step=summary["steps"], metrics=metrics))
        summary["probe"] = probes.compare(actors, learner_version=summary["learner"]["version"])
        if cfg.train.export_at_end:
            export_dir = Path(cfg.run_dir).resolve() / "export"
            actors.on_all_ranks("export_hf", str(export_dir), timeout_s=cfg.wire.startup_timeout_s)
            summary["export"] = str(export_dir)
        summary["probe"]["tolerance"] = probe_tolerance(cfg)
        check_probe(summary["probe"], summary["probe"]["tolerance"])
        actors.keep_engines()
        if actors.pool is not None:
            summary["engines_reused"] = sorted(actors.pool.reused)
    finally:
        summary["generator_restarts"] = sum(actors.restarts)
        with interrupts_deferred():
            actors.stop()
