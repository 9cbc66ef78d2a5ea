"""What the composition roots (docs/ARCHITECTURE.md, "Config sections and their readers") derive
from several config sections at once, in one place for all of them: the driver, each process's
factory (learner/parts.py, rollout/parts.py), config.py's rules and the tools. A part is handed
these values; it never reads the sections they come from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.learner.resume import DISPATCH_KEY, file_sha256
from asyncgrpo.runtime.placement import spans_nodes
from asyncgrpo.runtime.ray_cluster import local_cpus
from asyncgrpo.schema import Config
from asyncgrpo.tasks import FILE_TASKS, TASK_PARAMETERS, Task, make_task
from asyncgrpo.wire.reach import resolve_wire_transport

if TYPE_CHECKING:
    from asyncgrpo.learner.lora import AdapterLayout
    from asyncgrpo.rollout.engine import EngineAdapter


def run_task(cfg: Config, tokenizer: Any | None = None) -> Task:
    """The run's task (tasks.make_task), handed what it takes of the env, model and rollout sections:
    whether the calculator is on (env.name) and the prompt's room, the context beside
    rollout.max_new_tokens."""
    return make_task(cfg, tokenizer, tool=cfg.env.name == "calculator",
                     context_tokens=max(cfg.model.max_positions - cfg.rollout.max_new_tokens, 0))


def actors_span_nodes(cfg: Config) -> bool:
    """Whether a generator may run on another node than learner rank 0 (`runtime.placement.spans_nodes`)."""
    return spans_nodes(cfg.ray.address, cfg.learner.node_resource, cfg.rollout.node_resource)


def wire_transport(cfg: Config) -> str:
    """The transport learner rank 0 binds, ipc or tcp (`wire.reach.resolve_wire_transport`): tcp
    whenever the actors may span nodes."""
    return resolve_wire_transport(cfg.wire, actors_span_nodes(cfg))


def weights_backend(cfg: Config) -> str:
    """`weights.backend` with auto decided (`weights.resolve_backend`, from `wire_transport`)."""
    from asyncgrpo.weights import resolve_backend  # here, not at the top: asyncgrpo.weights imports torch

    return resolve_backend(cfg.weights, wire_transport(cfg))


def pushed_adapters(cfg: Config, model_dir: str) -> AdapterLayout | None:
    """What a LoRA run's pushes carry under weights.lora_push=adapter: the adapters learner.lora puts
    on the model in `model_dir`; None when pushes carry the model."""
    from asyncgrpo.learner.lora import adapter_layout
    from asyncgrpo.weights.adapters import pushes_adapters

    return adapter_layout(model_dir, cfg.learner.lora) if pushes_adapters(cfg.weights, cfg.learner.lora.rank) else None


def engine_adapter(cfg: Config, adapters: AdapterLayout | None, start_dir: str, base_dir: str) -> EngineAdapter | None:
    """A generator engine's adapter under rollout.lora_apply=vllm (None otherwise): `adapters` (the
    run's `pushed_adapters` on the model in `base_dir`, the run's model directory), starting from
    those a resumed run's `start_dir` holds, or from none (B = 0) when it is `base_dir`."""
    if cfg.rollout.lora_apply != "vllm" or adapters is None:
        return None
    from asyncgrpo.learner.lora import adapter_config
    from asyncgrpo.rollout.engine import EngineAdapter
    from asyncgrpo.weights.adapters import initial_adapter

    return EngineAdapter(adapter_config(cfg.learner.lora, list(adapters.shapes), base_dir),
                         initial_adapter(adapters, start_dir, base_dir))


def node_resource_roles(cfg: Config) -> list[tuple[str, str, str, float]]:
    """Per kind of actor (learner rank, generator), the key of its node resource, the resource, and
    the key and number of its CPUs (`runtime.placement.check_node_resources`)."""
    return [("learner.node_resource", cfg.learner.node_resource, "learner.num_cpus_per_rank",
             cfg.learner.num_cpus_per_rank),
            ("rollout.node_resource", cfg.rollout.node_resource, "rollout.num_cpus_per_generator",
             cfg.rollout.num_cpus_per_generator)]


def local_cluster_cpus(cfg: Config, address: str) -> int | None:
    """The logical CPUs of the Ray cluster a run of `cfg` gets on this machine when it runs on one
    started at `address` ("": the run's own local cluster, driver/prepare.py; a study's engine
    cluster, study/runner.py): `ray.num_cpus` or all cores, at least what the generators and the
    learner ranks ask for (`runtime.ray_cluster.local_cpus`). None when it joins another cluster
    (another `ray.address`)."""
    if cfg.ray.address != address:
        return None
    actor_cpus = (cfg.rollout.num_generators * cfg.rollout.num_cpus_per_generator
                  + cfg.learner.world_size * cfg.learner.num_cpus_per_rank)
    return local_cpus(cfg.ray.num_cpus, actor_cpus)


def run_record(cfg: Config) -> dict[str, Any]:
    """The settings that define the generators' prompt streams, keyed by their config keys (so a
    difference names the key), which a checkpoint records and a resume is checked against
    (asyncgrpo/learner/resume.py). File tasks: each training file's path and SHA-256, in order (the
    order is the stream's); file paths may change between runs, contents may not."""
    task = cfg.task
    record: dict[str, Any] = {
        "rollout.num_generators": cfg.rollout.num_generators,
        # No longer a setting: recorded so that a checkpoint of the removed shares dispatch, whose
        # record says shares or (older) nothing, is told apart.
        DISPATCH_KEY: "tickets",
        "task.name": task.name,
        "seed": cfg.seed,  # seeds each built-in stream, and the shuffle of file tasks
    }
    for name in (*TASK_PARAMETERS.get(task.name, ()), "eval_size"):
        record[f"task.{name}"] = getattr(task, name)
    if task.name in FILE_TASKS:
        files = [str(Path(p).expanduser().resolve()) for p in cfg.data.train_files]
        record["data.train_files"] = [{"path": p, "sha256": file_sha256(p)} for p in files]
    return record


def use_curve(cfg: Config) -> bool:
    """Whether the learner's sockets use CURVE. auto: on over tcp (`wire_transport`: also
    whenever actors may span nodes), loopback included (any local user can connect there), off over
    ipc (a socket file in a 0700 directory: only this user can).
    `wire.insecure` never turns CURVE off; it only permits `wire.curve=off` over tcp."""
    return cfg.wire.curve == "on" or (cfg.wire.curve == "auto" and wire_transport(cfg) == "tcp")


def learner_wait_timeout_s(cfg: Config) -> float:
    """How long anyone waits on a learner rank (a collective between ranks, the driver on a step):
    rank 0 may first wait for generator acknowledgements and then for a batch, each up to
    `wire.timeout_s`, while the others already wait for that batch."""
    return 2 * cfg.wire.timeout_s + 60.0


def saves_checkpoints(cfg: Config) -> bool:
    """Whether the learner may save a checkpoint during the run (periodically, or at an interrupt)."""
    return cfg.train.save_every_steps > 0 or cfg.train.checkpoint_on_interrupt


def steps_wait_timeout_s(cfg: Config) -> float:
    """How long the driver waits on the learner's `train_steps` call: a periodic checkpoint save
    inside it may take `train.checkpoint_timeout_s` on top."""
    save_s = cfg.train.checkpoint_timeout_s if cfg.train.save_every_steps > 0 else 0.0
    return learner_wait_timeout_s(cfg) + save_s


def save_wait_timeout_s(cfg: Config) -> float:
    """How long the driver waits on the learner's `save_checkpoint` call: an actor runs one call at a
    time, so the interrupt's save starts once the `train_steps` call in progress has ended."""
    return steps_wait_timeout_s(cfg) + cfg.train.checkpoint_timeout_s


def collective_timeout_s(cfg: Config) -> float:
    """How long a learner rank waits in a collective: the other ranks wait for rank 0's batch while
    rank 0 waits for a restarted generator (`rollout.max_restarts`), whose start is bounded by
    `wire.startup_timeout_s`, not by `wire.timeout_s`; and in a checkpoint save's barriers one rank
    waits while another writes (DCP's shards, rank 0's manifest hashes every file), up to
    `train.checkpoint_timeout_s` (one collective waits for one of these, never both)."""
    restart_s = cfg.wire.startup_timeout_s if cfg.rollout.max_restarts > 0 else 0.0
    save_s = cfg.train.checkpoint_timeout_s if saves_checkpoints(cfg) else 0.0
    return learner_wait_timeout_s(cfg) + max(restart_s, save_s)
