"""Generators kept alive between runs (`rollout.engine_pool`): vLLM's start-up is most of a short
run, and a study runs a hundred of them one after another on the same engine settings.

The pool is a set of named, detached Ray actors in the cluster at `ray.address`, one per generator
index. A run takes generator i's actor when the run before released it and the engine settings it
was started with (`engine_key`) are this run's, and resets it (`GeneratorActor.reset`: the run's starting weights, seed, prompt
stream, rewards, sockets and counters, on the running engine); otherwise it kills it and starts a
new one under the same name. A run that ends cleanly releases its generators (sockets and reward
threads closed, engine kept); one that fails or is interrupted kills them, as their state is then
unknown. Whoever owns the cluster (asyncgrpo study) ends the pool by stopping the cluster.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from asyncgrpo.driver import TrainingFailed
from asyncgrpo.driver.remote import control, get, remote_class
from asyncgrpo.rollout.spec import GeneratorSpec, engine_settings
from asyncgrpo.schema import Config

# Every pool's actors live in this Ray namespace, apart from the runs' own (anonymous) ones.
POOL_NAMESPACE = "asyncgrpo_engine_pool"
# A model directory's files that fix what vLLM builds; the weights are loaded on every reset.
ENGINE_FILES = ("config.json", "generation_config.json")
# Fields of those files that name where a model came from rather than what it is.
PROVENANCE_FIELDS = ("_name_or_path", "transformers_version")
# How long a killed actor's name may take to be free again.
NAME_RELEASE_S = 30.0


def actor_name(pool: str, index: int) -> str:
    return f"{pool}-generator-{index}"


def engine_key(cfg: Config, model_dir: str, cores: list[int] | None, gpus: float) -> str:
    """What a generator's engine and process were built from, apart from the weights and the run's
    own settings: the model's architecture and generation config, the engine's settings, the cores
    it is pinned to and the Ray resources it holds. Two runs with equal keys can share an engine."""
    model: dict[str, Any] = {}
    for name in ENGINE_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            fields = json.loads(path.read_text())
            model[name] = {k: v for k, v in fields.items() if k not in PROVENANCE_FIELDS}
    r = cfg.rollout
    settings = {
        "model": model, "max_model_len": cfg.model.max_positions, **engine_settings(r),
        "device": cfg.device, "cores": cores, "gpus": gpus,
        "num_cpus": r.num_cpus_per_generator, "node_resource": r.node_resource,
        # vLLM's LoRA path is built into the engine, for adapters of at most its rank.
        "lora_apply": r.lora_apply, "lora_rank": cfg.learner.lora.rank if r.lora_apply == "vllm" else 0,
    }
    return json.dumps(settings, sort_keys=True)


class EnginePool:
    """This run's view of the pool named `cfg.rollout.engine_pool`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.name = cfg, cfg.rollout.engine_pool
        self.reused: set[int] = set()  # generator indices whose engine an earlier run started

    def take(self, spec: GeneratorSpec, key: str, options: dict[str, Any]) -> Any:
        """The actor of the generator `spec` describes, reset for this run if the pool holds one with
        engine key `key`, else a new one under the pool's name (`options`: its Ray resources)."""
        from ray.exceptions import RayActorError

        from asyncgrpo.rollout.actor import GeneratorActor

        index = spec.generator_id
        name, timeout_s = actor_name(self.name, index), self.cfg.wire.startup_timeout_s
        self.reused.discard(index)
        actor = self._lookup(name)
        if actor is not None:
            try:
                # In the control group: a call that a generator left running by a dead driver cannot hold up.
                found = get(control(actor, "reusable_key"), timeout_s, f"pooled generator {index} (reusable_key)")
                if found == key:
                    get(actor.reset.remote(self.cfg, spec), timeout_s, f"pooled generator {index} (reset)")
                    self.reused.add(index)
                    return actor
                why = "was not released by its last run" if not found else "was built for other settings"
                print(f"[engine_pool] generator {index}: the pool's engine {why}; starting a new one", flush=True)
            except (RayActorError, TrainingFailed) as err:
                print(f"[engine_pool] generator {index}: the pool's engine cannot be reused ({type(err).__name__}: "
                      f"{str(err).splitlines()[0] if str(err) else ''}); starting a new one", flush=True)
            self.kill(actor, name)
        actor = remote_class(GeneratorActor).options(name=name, namespace=POOL_NAMESPACE, lifetime="detached",
                                                     **options).remote(self.cfg, spec)
        actor.set_pool_key.remote(key)  # ordered after the constructor, before any call of this run's
        return actor

    def release(self, actor: Any, index: int) -> bool:
        """Leave generator `index` in the pool for the next run (its sockets closed); False if it
        could not be released (then the caller kills it)."""
        from ray.exceptions import RayActorError

        try:
            get(actor.release.remote(), self.cfg.wire.timeout_s, f"pooled generator {index} (release)")
        except (RayActorError, TrainingFailed):
            return False
        return True

    def kill(self, actor: Any, name: str) -> None:
        """Kill a pooled actor and wait until its name can be taken again."""
        import ray

        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + NAME_RELEASE_S
        while self._lookup(name) is not None:
            if time.monotonic() > deadline:
                raise TrainingFailed(f"the engine pool's actor {name} was killed but its name is still taken after "
                                     f"{NAME_RELEASE_S:.0f} s")
            time.sleep(0.2)

    @staticmethod
    def _lookup(name: str) -> Any:
        import ray

        try:
            return ray.get_actor(name, namespace=POOL_NAMESPACE)
        except ValueError:  # no live actor of that name
            return None
