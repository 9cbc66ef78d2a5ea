"""Before any actor starts: the device, the model, the resume point, the data, Ray itself."""

from __future__ import annotations

import copy
import os
import signal
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from asyncgrpo.composition import run_record, run_task
from asyncgrpo.runtime import faults
from asyncgrpo.composition import local_cluster_cpus
from asyncgrpo.driver import TrainingFailed
from asyncgrpo.runtime.interrupts import interrupt_signals_noted, interrupts_deferred
from asyncgrpo.runtime.ray_cluster import child_pids, private_token_env, stop_children_started_since
from asyncgrpo.learner.resume import RESUME_AUTO, ResumeRefused, check_compatible
from asyncgrpo.schema import Config
from asyncgrpo.tasks import FILE_TASKS, Problem

# Quiet, in-process vLLM inside the actors; the driver never imports vLLM.
ACTOR_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
if os.environ.get(faults.ENV):  # failpoints act in the actors too (tools/chaos.py)
    ACTOR_ENV[faults.ENV] = os.environ[faults.ENV]


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare_model(cfg: Config, log=print) -> str:
    """The model's directory: model.path, else the embedded model, warm-started once and cached."""
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
        task=load_task(cfg, endless=True),
        seed=cfg.seed,
        target_accuracy=cfg.model.warmstart_target_accuracy,
        max_seconds=cfg.model.warmstart_max_seconds,
        log=log,
    ))


def resume_point(cfg: Config, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """The checkpoint `resume` names (its meta, with `path`), or None for a fresh run. resume=auto:
    the newest checkpoint of the run directory's current lineage (learner/checkpoint.py), or None if
    there is none. Refuses (in one line, before Ray starts) a checkpoint that fails its manifest or
    was written by a run whose prompt streams this one cannot continue (asyncgrpo/learner/resume.py). Once
    accepted, records in run_dir/checkpoints the lineage this run continues: the current one if it
    resumes that lineage's newest checkpoint, else a new one (a fresh start, or a branch from an
    older checkpoint), so its saves neither prune nor hide behind the checkpoints of another line."""
    from asyncgrpo.learner.checkpoint import (
        latest,
        newest,
        read_meta,
        start_lineage,
        verify,
    )

    directory = Path(cfg.run_dir).expanduser().resolve() / "checkpoints"
    if not cfg.resume:
        start_lineage(directory, None, continues=False)
        return None
    current = newest(directory)  # a save killed midway (step_<N>.tmp) is not one
    if cfg.resume == RESUME_AUTO:
        if current is None:
            log(f"[resume] auto: no complete checkpoint in {directory}; a fresh start")
            start_lineage(directory, None, continues=True)
            return None
        path = current
        log(f"[resume] auto: continuing from {path}")
    else:
        path = latest(cfg.resume)  # raises with a clear message if no complete checkpoint is there
    verify(path)  # here, in one line before Ray starts, rather than wrapped in every rank's error
    meta = read_meta(path)
    # differences only with resume_allow_changes=true
    changes = check_compatible(meta, partial(run_record, cfg), cfg.resume_allow_changes, path, log)
    start_lineage(directory, path, continues=path == current)
    return {**meta, "path": str(path), "changes": changes}


def starting_model(cfg: Config, resume: dict[str, Any] | None, summary: dict[str, Any]) -> str:
    """The run's starting weights (the KL reference and the architecture), noted in `summary`."""
    model_dir = prepare_model(cfg)
    if resume is not None:
        summary["resumed_from"] = resume["path"]
        if resume.get("changes"):
            summary["resume_changes"] = resume["changes"]
        # The KL reference and the architecture are the run's starting weights, not the checkpoint's.
        if Path(resume["model_dir"]).is_dir():
            model_dir = resume["model_dir"]
        check_adapter(cfg, resume, model_dir)
    summary["model_dir"] = model_dir
    return model_dir


def check_adapter(cfg: Config, resume: dict[str, Any], model_dir: str) -> None:
    """A LoRA checkpoint continues only with its own learner.lora.* settings on its own base model
    (and full fine-tuning only from full fine-tuning): refused in one line, before Ray starts."""
    from asyncgrpo.learner.lora import LoraError, check_adapter_resume

    try:
        check_adapter_resume(resume.get("states") or {}, cfg.learner.lora, model_dir, resume["path"])
    except LoraError as err:
        raise ResumeRefused(str(err)) from None


def load_task(cfg: Config, tokenizer_dir: str | None = None, endless: bool = False) -> Any:
    """The configured task. File tasks count prompt tokens with the model's tokenizer (before the
    embedded model exists, with its character tokenizer); `endless` ignores data.epochs (warm start)."""
    if cfg.task.name not in FILE_TASKS:
        return run_task(cfg)
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from asyncgrpo.models.tokenizer import build_char_tokenizer

        tokenizer = build_char_tokenizer()
    if endless:
        cfg = copy.deepcopy(cfg)
        cfg.data.epochs = 0
    return run_task(cfg, tokenizer)


def load_data(cfg: Config, model_dir: str, summary: dict[str, Any]) -> list[Problem]:
    """Load the task, which checks the data files: bad data fails (or is counted) before actors start.
    Makes the data paths absolute and fits train.max_steps to finite data (both in `cfg`); the eval problems."""
    from asyncgrpo.data import absolute_paths

    cfg.data.train_files = absolute_paths(cfg.data.train_files)
    cfg.data.eval_files = absolute_paths(cfg.data.eval_files)
    task = load_task(cfg, model_dir)
    if hasattr(task, "describe"):
        print(f"[data] {task.describe()}", flush=True)
        summary["data"] = task.report()
        fit_steps_to_data(cfg, task.num_train_problems)
    return task.eval_problems()


def steps_in_data(cfg: Config, num_train_problems: int) -> int | None:
    """Full steps that data.epochs over the training prompts fill (the generators read one stream);
    None for endless data (epochs = 0)."""
    if cfg.data.epochs <= 0:
        return None
    return num_train_problems * cfg.data.epochs // cfg.train.groups_per_step


def fit_steps_to_data(cfg: Config, num_train_problems: int) -> None:
    """With data.epochs > 0 the prompts run out: stop at the last full step instead of waiting forever."""
    available = steps_in_data(cfg, num_train_problems)
    if available is None:
        return
    if available < 1:
        raise TrainingFailed(f"data.epochs={cfg.data.epochs} over {num_train_problems} training prompts is less "
                             f"than one step of train.groups_per_step={cfg.train.groups_per_step} groups")
    if cfg.train.max_steps > available:
        print(f"[data] {cfg.data.epochs} epoch(s) of {num_train_problems} prompts fill {available} steps: "
              f"train.max_steps {cfg.train.max_steps} -> {available}", flush=True)
        cfg.train.max_steps = available


def start_ray(cfg: Config) -> bool:
    """Connect to ray.address, or start a local cluster; True if this call started Ray (then the
    driver shuts it down), False if it was already running."""
    local = not cfg.ray.address
    if local:
        # A local cluster otherwise takes the machine's network address and listens on every
        # interface (seen with Ray 2.60); with this, read when Ray is imported, it binds 127.0.0.1.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if local:
        # The cluster's processes and the actors inherit the token; only this run knows it.
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        os.environ.update(private_token_env())
        reload_ray_auth()
    before = child_pids() if local else set()
    try:
        with interrupt_signals_noted() as noted:
            ray.init(
                address=cfg.ray.address or None,
                num_cpus=local_cluster_cpus(cfg, ""),  # None when joining ray.address
                include_dashboard=False,
                log_to_driver=True,
                runtime_env={"env_vars": ACTOR_ENV},
                **({"_node_ip_address": "127.0.0.1"} if local else {}),
            )
        interrupt_on_sigterm()  # ray.init installs its own SIGTERM handler, which exits at once
        if noted:  # its exception was raised where Python drops it (interrupt_signals_noted)
            raise KeyboardInterrupt(signal.Signals(noted[0]).name)
    except BaseException as err:
        interrupt_on_sigterm()
        # Interrupted (or failed) half-way: the caller only shuts down a Ray this call started.
        with interrupts_deferred():
            ray.shutdown()
            left = stop_children_started_since(before) if local else []
        if left:
            print(f"[ray] stopped what the interrupted start left running: {', '.join(left)}", flush=True)
        if isinstance(err, SystemExit) and err.code == signal.SIGTERM:
            # Ray's handler (installed early in ray.init) raises SystemExit(SIGTERM): a preemption
            # notice during start-up is an interrupt like any other (status interrupted, exit 130).
            raise KeyboardInterrupt(signal.Signals.SIGTERM.name) from None
        raise
    return True


def reload_ray_auth() -> None:
    """Ray reads the authentication mode when it is imported and keeps the token it first loads:
    without this a driver that imported Ray before (or ran a cluster before, in the same process)
    would present no token, or an old one, to the cluster it starts with the new one."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def interrupt_on_sigterm() -> None:
    """SIGTERM (a scheduler's notice of preemption) raises KeyboardInterrupt, as Ctrl-C does: the
    run checkpoints, writes its summary and stops its actors. Only the main thread can do this."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)

