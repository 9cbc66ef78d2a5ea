"""The actors' lifecycle: placement, start (learner ranks, then generators), weight rendezvous,
generator restarts, the generators after the last step (a dead one is left out of the evaluations),
stop. The learner ranks' placement group and actors are made by driver/learner_ranks.py; each
generator is started from its `GeneratorSpec` (asyncgrpo/rollout/spec.py), kept for its restarts.

Placement (asyncgrpo/runtime/placement.py): the named node resources are checked against the cluster
before anything starts; each learner rank's bundle and each generator asks for a share of its
role's resource; once up, every actor's node is recorded in run_dir/actors.json and each generator
on another machine than learner rank 0 is checked to reach it (asyncgrpo/wire/reach.py), before the
weight rendezvous.

Both actor classes are plain Python classes; they become Ray actors here, with `ray.remote`, with a
second concurrency group, `control`: a call there (`control`) runs on its own thread while the
actor's long call (the learner's steps, the generator's run) goes on. Every wait on an actor has a
deadline and fails the run with what it waited for (`get`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from asyncgrpo.composition import (learner_wait_timeout_s, node_resource_roles, save_wait_timeout_s, use_curve,
                                   weights_backend, wire_transport)
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.engine_pool import EnginePool, engine_key
from asyncgrpo.driver.learner_ranks import place_learners, start_learners
from asyncgrpo.driver.remote import control, get, remote_class
from asyncgrpo.runtime.files import write_atomic
from asyncgrpo.runtime.placement import check_node_resources, node_resources
from asyncgrpo.runtime.resources import plan_cores
from asyncgrpo.rewards.errors import one_line
from asyncgrpo.rollout.spec import GeneratorSpec
from asyncgrpo.schema import Config
from asyncgrpo.weights.shm import default_directory as default_shm_directory
from asyncgrpo.weights.shm import remove_directory as remove_shm_directory
from asyncgrpo.weights.shm import remove_stale_slots
from asyncgrpo.wire.reach import check_reach
from asyncgrpo.wire.security import WireKeys
from asyncgrpo.wire.sockets import remove_ipc_endpoint, remove_stale_ipc_dirs


def gpus_per_actor(cfg: Config, gpus_in_cluster: float) -> float:
    """A whole GPU per actor when there are enough, else an equal share (vLLM + learner on one GPU)."""
    if cfg.device != "cuda":
        return 0.0
    actors = cfg.rollout.num_generators + cfg.learner.world_size
    if gpus_in_cluster <= 0:
        raise TrainingFailed("device=cuda but the Ray cluster has no GPU")
    return min(1.0, gpus_in_cluster / actors)


def check_gpu_share(cfg: Config, gpus: float) -> None:
    """NCCL cannot join two processes on one GPU: learner ranks > 1 and the nccl weight backend
    need a whole GPU per actor."""
    if cfg.device != "cuda" or gpus >= 1:
        return
    world_size = cfg.learner.world_size
    if world_size > 1:
        raise TrainingFailed(f"learner.world_size={world_size} needs a whole GPU per learner rank (NCCL cannot put "
                             f"two ranks on one GPU); each actor got {gpus:.2f} GPU here")
    if cfg.weights.backend == "nccl":
        raise TrainingFailed(
            f"weights.backend=nccl needs a GPU per actor (NCCL cannot join two processes on one GPU); each "
            f"actor got {gpus:.2f} GPU here: use weights.backend=zmq")


class Actors:
    """The Ray actors of one run. `start` fills them in as they come up, so `stop` also ends a half-started run."""

    def __init__(self, cfg: Config, model_dir: str) -> None:
        self.cfg, self.model_dir = cfg, model_dir
        self.placement_group: Any = None
        self.learners: list[Any] = []  # every rank; collectives (steps, pushes, probes) call them all
        self.generators: list[Any] = []
        self.endpoints: dict[str, str] = {}  # learner rank 0's bound sockets
        self.weight_address: dict[str, Any] = {}  # learner rank 0's weight transport (WeightSender.join_address)
        self.restarts = [0] * cfg.rollout.num_generators  # per generator; its incarnation is this count
        # What each generator was last started with (`_start_generator`): its restarts start from it.
        self.specs: list[GeneratorSpec] = []
        self._generator_gpus = 0.0
        self._pids: dict[str, Any] = {}  # run_dir/actors.json: pids, cores, nodes, the wire
        # After the last step: generators whose process died (not restarted: nothing is left to
        # generate), and the directory of the final weights a fresh evaluator engine started from.
        self.dead_after_training: set[int] = set()
        self._evaluator_weights: Path | None = None
        self._final_version = 0
        # rollout.engine_pool: generators taken from (and left in) the cluster's pool; kept at `stop`
        # only once the run has ended cleanly (`keep_engines`).
        self.pool = EnginePool(cfg) if cfg.rollout.engine_pool else None
        self._keep_engines = False

    @property
    def learner(self) -> Any:
        """Rank 0: the queue, the weight publisher, the metrics the driver logs."""
        return self.learners[0]

    def start(self, resume: dict[str, Any] | None) -> None:
        """Learner ranks, then (from their endpoints and the resume point) the generators, then the
        weight rendezvous; writes run_dir/actors.json."""
        import ray

        cfg = self.cfg
        check_node_resources(node_resource_roles(cfg), ray.nodes())  # before an actor waits for a node that never comes
        generator_cores, learner_cores = plan_cores(
            cfg.rollout.num_generators, cfg.learner.world_size, cfg.rollout.cpu_cores, cfg.learner.cpu_cores
        )
        gpus = gpus_per_actor(cfg, ray.cluster_resources().get("GPU", 0.0))
        check_gpu_share(cfg, gpus)
        keys = WireKeys.generate(cfg.rollout.num_generators) if use_curve(cfg) else None
        # A run killed with its driver (SIGKILL, OOM) left its slots in RAM and its socket directories:
        # nobody else removes them.
        if weights_backend(cfg) == "shm":
            for path in remove_stale_slots(cfg.weights.shm_dir or default_shm_directory()):
                print(f"[weights] removed a dead run's shared-memory weight slots: {path}", flush=True)
        for path in remove_stale_ipc_dirs():
            print(f"[wire] removed a dead run's socket directory: {path}", flush=True)
        self.placement_group = place_learners(cfg, gpus)  # first: `stop` removes it, even if the start fails
        self.learners = start_learners(cfg, self.model_dir, self.placement_group, gpus, learner_cores,
                                       keys.server() if keys else None)
        endpoints = get(self.learner.endpoints.remote(), cfg.wire.startup_timeout_s, "learner rank 0's endpoints")
        self.endpoints = endpoints
        generator_dir, initial_version = self._resume_learners(resume)
        self._generator_gpus = gpus
        self.specs = [GeneratorSpec.for_run(cfg, i, generator_dir, endpoints, cfg.train.groups_per_step,
                                            generator_cores[i], keys.client(i) if keys else None, initial_version,
                                            base_model_dir=self.model_dir)
                      for i in range(cfg.rollout.num_generators)]
        self.generators = [self._start_generator(spec) for spec in self.specs]
        ready = get([g.ready.remote() for g in self.generators], cfg.wire.startup_timeout_s,
                    "the generators starting (ready)")
        learner_pids = self.on_all_ranks("pid", timeout_s=learner_wait_timeout_s(cfg), all_results=True)
        learner_nodes = self.on_all_ranks("node", timeout_s=learner_wait_timeout_s(cfg), all_results=True)
        generator_nodes = get([g.node.remote() for g in self.generators], cfg.wire.timeout_s, "the generators (node)")
        self._pids = {"learner_pids": learner_pids, "generator_pids": [r["pid"] for r in ready],
                      "generator_cores": generator_cores, "learner_cores": learner_cores,
                      # What plan_cores divided (the driver's own cores): the simulator needs it to
                      # know whether the actors shared cores (unpinned) or each had one.
                      "driver_cores": sorted(os.sched_getaffinity(0)),
                      "learner_nodes": learner_nodes, "generator_nodes": generator_nodes,
                      "wire": {"transport": wire_transport(cfg), "curve": keys is not None,
                               "weights_backend": weights_backend(cfg), "endpoints": endpoints}}
        self._write_pids()  # first: where each actor landed is worth seeing when the check below fails
        check_reach(cfg.wire, wire_transport(cfg), weights_backend(cfg), learner_nodes[0],
                    dict(enumerate(generator_nodes)))
        self._join_weights()

    def _write_pids(self) -> None:
        write_atomic(Path(self.cfg.run_dir) / "actors.json", json.dumps(self._pids, indent=2) + "\n")

    def _resume_learners(self, resume: dict[str, Any] | None) -> tuple[str, int]:
        """Load the checkpoint into every rank; the generators then start from its weights, written in
        Hugging Face format, at its version (learner rank 0's dispatcher knows the prompts used)."""
        cfg = self.cfg
        if resume is None:
            return self.model_dir, 0
        self.on_all_ranks("load_checkpoint", resume["path"], timeout_s=cfg.wire.startup_timeout_s)
        weights_dir = Path(cfg.run_dir).resolve() / f"resume_step_{resume['version']}"
        self.on_all_ranks("export_hf", str(weights_dir), timeout_s=cfg.wire.startup_timeout_s)
        print(f"[resume] {resume['path']} at version {resume['version']}", flush=True)
        return str(weights_dir), int(resume["version"])

    def _start_generator(self, spec: GeneratorSpec) -> Any:
        """The actor of the generator `spec` describes (not waited for), on its own cores, with its own
        wire keys. Ray does not restart it (max_restarts=0): `restart_generator` does, knowing what to resume."""
        from asyncgrpo.rollout.actor import GeneratorActor

        cfg, gpus = self.cfg, self._generator_gpus
        self.specs[spec.generator_id] = spec
        on_node = node_resources(cfg.rollout.node_resource)
        options = {"num_cpus": cfg.rollout.num_cpus_per_generator, "num_gpus": gpus, "max_restarts": 0,
                   **({"resources": on_node} if on_node else {})}
        if self.pool is not None:
            return self.pool.take(spec, engine_key(cfg, spec.model_dir, list(spec.cores), gpus), options)
        return remote_class(GeneratorActor).options(**options).remote(cfg, spec)

    def restart_generator(self, index: int, cause: BaseException) -> Any:
        """Generator `index`'s process died (`cause`): start its next incarnation and bring it back
        into the run (docs/ARCHITECTURE.md, Faults); returns the new process's `run()` reference.
        Fails the run, naming why, beyond `rollout.max_restarts` or with weights.backend=nccl."""
        import ray

        cfg = self.cfg
        reason = one_line(f"{type(cause).__name__}: {cause}")
        if self.restarts[index] >= cfg.rollout.max_restarts:
            raise TrainingFailed(f"generator {index} died ({reason}) and rollout.max_restarts={cfg.rollout.max_restarts} "
                                 f"allows no further restart ({self.restarts[index]} so far)")
        if weights_backend(cfg) == "nccl":
            raise TrainingFailed(f"generator {index} died ({reason}) and weights.backend=nccl cannot take a restarted "
                                 "generator into its weight group (its size is fixed when it forms): use "
                                 "weights.backend=shm or zmq for runs that must survive a generator's death")
        self.restarts[index] += 1
        incarnation = self.restarts[index]
        print(f"[restart] generator {index} died ({reason}); starting it again (restart {incarnation} of at most "
              f"{cfg.rollout.max_restarts})", flush=True)
        timeout_s, startup_s = cfg.wire.timeout_s, cfg.wire.startup_timeout_s
        get(control(self.learner, "generator_down", index), timeout_s, "learner rank 0 (generator_down)")
        ray.kill(self.generators[index], no_restart=True)  # whatever is left of the dead process
        self.generators[index] = generator = self._start_generator(self.specs[index].restarted(incarnation))
        ready = get(generator.ready.remote(), startup_s, f"generator {index} restarting (ready)")
        node = get(generator.node.remote(), timeout_s, f"generator {index} restarting (node)")
        self._pids["generator_nodes"][index] = node
        check_reach(cfg.wire, wire_transport(cfg), weights_backend(cfg), self._pids["learner_nodes"][0],
                    {index: node})
        if self.weight_address:
            get(generator.join_weight_group.remote(self.weight_address), startup_s,
                f"generator {index} joining the weight transport after its restart")
        rejoin = get(control(self.learner, "generator_rejoined", index, incarnation), timeout_s,
                     "learner rank 0 (generator_rejoined)")
        get(generator.rejoin.remote(rejoin["newest_version"], rejoin["save"]), timeout_s, f"generator {index} (rejoin)")
        self._pids["generator_pids"][index] = ready["pid"]
        self._write_pids()
        # Nothing to continue from: it asks for the slots to fill.
        print(f"[restart] generator {index} rejoined: loading version {rejoin['newest_version']}, then asking "
              "for tickets; its predecessor's slots not arrived went to the next asker", flush=True)
        return generator.run.remote()

    # ------------------------------------------------------------------ after the last step

    def generator_reports(self, runs: list[Any], final_version: int) -> list[dict[str, Any]]:
        """Each generator's `run()` result once the learner has told them to stop (at `final_version`),
        with its restarts.
        A generator whose process died after the last step is not restarted (nothing is left to
        generate; the run's result does not depend on it): its entry says why, and the evaluations
        and the probe that follow use another generator (`on_evaluator`)."""
        from ray.exceptions import RayActorError

        self._final_version = final_version
        deadline = time.monotonic() + self.cfg.wire.timeout_s
        reports = []
        for index, run in enumerate(runs):
            what = f"generator {index} (run, after the learner's Shutdown)"
            try:
                report = get(run, max(0.0, deadline - time.monotonic()), what)
            except RayActorError as died:
                report = {"died_after_training": self._dead_after_training(index, died)}
            reports.append({**report, "restarts": self.restarts[index]})
        return reports

    def _dead_after_training(self, index: int, cause: BaseException) -> str:
        import ray

        reason = one_line(f"{type(cause).__name__}: {cause}")
        self.dead_after_training.add(index)
        ray.kill(self.generators[index], no_restart=True)  # whatever is left of it; frees its Ray CPUs
        print(f"[finish] generator {index} died after the last step ({reason}); the run goes on without it",
              flush=True)
        return reason

    def on_evaluator(self, method: str, *args: Any, what: str) -> Any:
        """`method(*args)` on a generator holding the final weights (the evaluations and the probe at
        the end): the first one alive; if none is, a fresh engine started from the learner's final
        weights. One that dies during the call is replaced, once."""
        from ray.exceptions import RayActorError

        for attempt in range(2):
            index = self._evaluator_index()
            try:
                return get(getattr(self.generators[index], method).remote(*args), self.cfg.wire.timeout_s,
                           f"generator {index} ({what})")
            except RayActorError as died:
                if attempt == 1:
                    raise TrainingFailed(f"generator {index} died during the {what} at the end of the run, and so "
                                         f"did the one before it: {one_line(str(died))}") from None
                self._dead_after_training(index, died)
        raise AssertionError("unreachable")

    def _evaluator_index(self) -> int:
        """The first generator alive after the last step; with none left, generator 0 started again
        from the learner's final weights (written to run_dir/evaluator_weights, removed by `stop`)."""
        alive = [i for i in range(len(self.generators)) if i not in self.dead_after_training]
        if alive:
            return alive[0]
        cfg, version = self.cfg, self._final_version
        self._evaluator_weights = Path(cfg.run_dir).resolve() / "evaluator_weights"
        self.on_all_ranks("export_hf", str(self._evaluator_weights), timeout_s=cfg.wire.startup_timeout_s)
        print(f"[finish] no generator left: starting one on the final weights (version {version}) for the "
              "evaluations and the probe", flush=True)
        self.generators[0] = self._start_generator(
            self.specs[0].starting_from(str(self._evaluator_weights), version, incarnation=self.restarts[0] + 1))
        get(self.generators[0].ready.remote(), cfg.wire.startup_timeout_s, "generator 0 starting as the evaluator")
        self.dead_after_training.discard(0)
        return 0

    def take_evaluations(self) -> list[dict[str, Any]]:
        """Generator 0's periodic evaluations (eval.every_steps) since the last call; none while it
        is down (what it had not handed over dies with it)."""
        from ray.exceptions import RayActorError

        if not self.cfg.eval.every_steps or not self.generators or 0 in self.dead_after_training:
            return []
        try:
            return get(control(self.generators[0], "take_evaluations"), self.cfg.wire.timeout_s,
                       "generator 0 (take_evaluations)")
        except RayActorError:
            return []

    def _join_weights(self) -> None:
        """The weight backend's rendezvous, if it has one (an empty address: none): learner rank 0 and
        every generator join one group, together."""
        timeout_s = self.cfg.wire.startup_timeout_s
        address = get(self.learner.weight_join_address.remote(), timeout_s, "learner rank 0's weight join address")
        self.weight_address = address
        if not address:
            return
        joins = [self.learner.wait_for_weight_joins.remote(),
                 *[g.join_weight_group.remote(address) for g in self.generators]]
        get(joins, timeout_s, f"the weight rendezvous at {address} (learner rank 0 and every generator)")

    def on_all_ranks(self, method: str, *args: Any, timeout_s: float, all_results: bool = False) -> Any:
        """Call `method` on every learner rank (a collective); rank 0's result, or every rank's."""
        results = get([getattr(learner, method).remote(*args) for learner in self.learners], timeout_s,
                      f"the learner ranks ({method})")
        return results if all_results else results[0]

    def save_checkpoint(self) -> str:
        """A checkpoint of the learner's current step in run_dir/checkpoints (after the step in
        progress: an actor runs one call at a time); its path."""
        directory = str(Path(self.cfg.run_dir).resolve() / "checkpoints")
        return self.on_all_ranks("save_checkpoint", directory, timeout_s=save_wait_timeout_s(self.cfg))

    def keep_engines(self) -> None:
        """The run ended cleanly: `stop` leaves the generators in the engine pool (if there is one)
        for the next run instead of killing them."""
        self._keep_engines = self.pool is not None

    def stop(self) -> None:
        """Kill every actor started so far (but release pooled generators after a clean run: they
        stay for the next) and free the learners' placement group."""
        import ray

        kill = list(self.learners)
        for index, generator in enumerate(self.generators):
            kept = (self._keep_engines and index not in self.dead_after_training
                    and self.pool is not None and self.pool.release(generator, index))
            if not kept:
                kill.append(generator)
        for actor in kill:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        for endpoint in self.endpoints.values():  # a killed learner leaves its Unix-socket directories
            remove_ipc_endpoint(endpoint)
        for path in self.weight_address.get("shm_paths", [])[:1]:  # and its shared-memory weight slots
            remove_shm_directory(os.path.dirname(path))
        if self._evaluator_weights is not None:
            shutil.rmtree(self._evaluator_weights, ignore_errors=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
