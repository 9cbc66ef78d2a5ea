"""The structured config: the one place where defaults live.

Dataclasses registered in Hydra's ConfigStore; YAML under `configs/` and command-line overrides
only change values. Unknown keys fail (OmegaConf struct mode). Units are in the names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from asyncgrpo.wire.security import is_loopback


@dataclass
class ModelConfig:
    # A Hugging Face model directory; empty = the embedded tiny Qwen2, built and warm-started locally.
    path: str = ""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 192
    max_positions: int = 32
    # The supervised warm start stops at this held-out sampled accuracy (RL from ~4% does not learn).
    warmstart_target_accuracy: float = 0.12
    warmstart_max_seconds: float = 180.0
    cache_dir: str = "~/.cache/asyncgrpo"


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    num_digits: int = 2
    eval_size: int = 500


@dataclass
class RolloutConfig:
    num_generators: int = 1
    samples_per_prompt: int = 8
    max_new_tokens: int = 5
    temperature: float = 1.0
    # Prompts per vLLM call; 0 means one learner step's worth per generator.
    groups_per_call: int = 0
    kv_cache_gib: float = 0.25
    dtype: str = "float32"
    # Cores for each generator ("auto": core i for generator i on a CPU machine; "" = no pinning).
    cpu_cores: str = "auto"
    num_cpus_per_generator: float = 1.0
    # Share of the GPU memory vLLM may use for weights and activations (device=cuda).
    gpu_memory_utilization: float = 0.3


@dataclass
class LearnerConfig:
    world_size: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip_norm: float = 1.0
    # Adam's first steps move every weight by ~lr; without warm-up one step at lr=1e-3 wiped out
    # the warm-started tiny model (sampled accuracy 19% -> 0.6%).
    warmup_steps: int = 50
    lr_schedule: str = "constant"  # constant | cosine (to min_lr_ratio * lr at train.max_steps)
    min_lr_ratio: float = 0.1
    torch_threads: int = 1
    cpu_cores: str = "auto"  # "auto": the cores the generators leave free
    num_cpus_per_rank: float = 1.0
    # Tokens per rank per forward pass; 0 = the whole step in one pass.
    micro_batch_tokens: int = 0


@dataclass
class KLConfig:
    enabled: bool = False
    kind: str = "k3"
    coef: float = 0.001


@dataclass
class CorrectionConfig:
    is_level: str | None = None  # None | token | sequence
    is_threshold: Any = 2.0  # float U (truncation) or "L_U" (masking)
    is_batch_normalize: bool = False
    rs: str | None = None  # e.g. "token_k1,seq_max_k2"
    rs_threshold: Any = None


@dataclass
class AlgoConfig:
    advantage: str = "grpo"  # grpo | drgrpo | rloo
    loss_type: str = "ppo_clip"  # ppo_clip | reinforce
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    agg: str = "token-mean"
    norm_constant: float | None = None
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)


@dataclass
class TrainConfig:
    max_steps: int = 1200
    # Stop early after this much training wall-clock (0 = no limit); eval and start-up not included.
    max_train_minutes: float = 0.0
    groups_per_step: int = 16
    max_staleness: int = 2  # policy versions
    stale_policy: str = "both"  # throttle | drop | both
    steps_per_call: int = 10  # learner steps per driver round trip (progress granularity)


@dataclass
class QueueConfig:
    capacity_groups: int = 64
    full_policy: str = "block"  # block | drop_oldest


@dataclass
class WireConfig:
    host: str = "127.0.0.1"
    # CURVE authentication of every socket: auto = on when wire.host is not a loopback address.
    # The launcher generates the keys and hands each process its own.
    curve: str = "auto"  # auto | on | off
    # Binding beyond loopback without authentication must be asked for explicitly.
    insecure: bool = False
    max_message_bytes: int = 256 << 20
    # Every cross-process wait fails loudly after this long.
    timeout_s: float = 120.0
    # Actor start-up (vLLM engine start is the slow part).
    startup_timeout_s: float = 600.0


@dataclass
class WeightsConfig:
    backend: str = "zmq"
    push_every_steps: int = 1


@dataclass
class EvalConfig:
    at_start: bool = True
    at_end: bool = True


@dataclass
class RayConfig:
    address: str = ""  # empty: start a local cluster
    num_cpus: int = 0  # for a local cluster; 0 = all cores


@dataclass
class Config:
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    # auto: cuda when the driver sees an NVIDIA GPU (vLLM and the learner then share the GPUs
    # through Ray's GPU resources, with NCCL between learner ranks), else cpu.
    device: str = "auto"
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)


CONFIG_NAME = "asyncgrpo"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=CONFIG_NAME, node=Config)


def _one_line(err: BaseException) -> str:
    """Hydra wraps the informative OmegaConf error; report that one, on one line, with its key."""
    cause = err.__cause__ or err
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    message = lines[0] if lines else type(cause).__name__
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), "")
    if message.startswith("Key '") and " not in " in message:
        return f"unknown config key '{key or message.split(chr(39))[1]}'"
    return f"{key}: {message}" if key and key not in message else message


def load(overrides: list[str] | None = None, config_name: str = "default",
         config_dir: str | Path | None = None) -> Config:
    """Compose defaults + `configs/<config_name>.yaml` + overrides into a validated `Config`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    directory = Path(config_dir or CONFIG_DIR).expanduser().resolve()
    try:
        with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
            composed = compose(config_name=config_name, overrides=list(overrides or []))
        OmegaConf.resolve(composed)
        cfg: Config = OmegaConf.to_object(composed)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(_one_line(err)) from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Reject configs that cannot work, before anything starts. Messages name the key."""

    def require(ok: bool, key: str, why: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"{key} {why} (got {value!r})")

    r, t, q, learner = cfg.rollout, cfg.train, cfg.queue, cfg.learner
    require(r.samples_per_prompt >= 2, "rollout.samples_per_prompt", "must be >= 2: GRPO compares samples of a prompt", r.samples_per_prompt)
    require(1 <= r.num_generators <= t.groups_per_step, "rollout.num_generators",
            f"must be between 1 and train.groups_per_step={t.groups_per_step}", r.num_generators)
    require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens)
    require(r.temperature > 0, "rollout.temperature", "must be > 0 (log-probs of greedy sampling are not a distribution)", r.temperature)
    require(r.groups_per_call >= 0, "rollout.groups_per_call", "must be >= 0", r.groups_per_call)
    require(t.max_staleness >= 0, "train.max_staleness", "must be >= 0", t.max_staleness)
    require(t.groups_per_step >= 1, "train.groups_per_step", "must be >= 1", t.groups_per_step)
    require(t.max_steps >= 1, "train.max_steps", "must be >= 1", t.max_steps)
    require(t.steps_per_call >= 1, "train.steps_per_call", "must be >= 1", t.steps_per_call)
    require(t.max_train_minutes >= 0, "train.max_train_minutes", "must be >= 0", t.max_train_minutes)
    require(t.stale_policy in ("throttle", "drop", "both"), "train.stale_policy", "must be throttle, drop or both", t.stale_policy)
    require(q.capacity_groups >= t.groups_per_step, "queue.capacity_groups", f"must hold at least one step (train.groups_per_step={t.groups_per_step})", q.capacity_groups)
    require(q.full_policy in ("block", "drop_oldest"), "queue.full_policy", "must be block or drop_oldest", q.full_policy)
    require(learner.world_size == 1, "learner.world_size", "must be 1 for now (multi-rank learners are not wired up yet)",
            learner.world_size)
    require(learner.lr > 0, "learner.lr", "must be > 0", learner.lr)
    require(learner.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0", learner.warmup_steps)
    require(learner.lr_schedule in ("constant", "cosine"), "learner.lr_schedule", "must be constant or cosine", learner.lr_schedule)
    require(0 <= learner.min_lr_ratio <= 1, "learner.min_lr_ratio", "must be in [0, 1]", learner.min_lr_ratio)
    require(learner.micro_batch_tokens >= 0, "learner.micro_batch_tokens", "must be >= 0", learner.micro_batch_tokens)
    require(cfg.weights.backend == "zmq", "weights.backend", "supports only zmq so far", cfg.weights.backend)
    require(cfg.weights.push_every_steps >= 1, "weights.push_every_steps", "must be >= 1", cfg.weights.push_every_steps)
    require(cfg.wire.timeout_s > 0, "wire.timeout_s", "must be > 0", cfg.wire.timeout_s)
    require(cfg.wire.curve in ("auto", "on", "off"), "wire.curve", "must be auto, on or off", cfg.wire.curve)
    require(use_curve(cfg) or cfg.wire.insecure or is_loopback(cfg.wire.host), "wire.curve",
            f"is off while wire.host={cfg.wire.host!r} binds beyond loopback: set wire.insecure=true to allow "
            "unauthenticated sockets", cfg.wire.curve)
    require(cfg.algo.advantage in ("grpo", "drgrpo", "rloo"), "algo.advantage", "must be grpo, drgrpo or rloo", cfg.algo.advantage)
    require(cfg.algo.loss_type in ("ppo_clip", "reinforce"), "algo.loss_type", "must be ppo_clip or reinforce", cfg.algo.loss_type)
    require(cfg.algo.clip_low > 0 and cfg.algo.clip_high > 0, "algo.clip_low/clip_high", "must be > 0", (cfg.algo.clip_low, cfg.algo.clip_high))
    require(cfg.algo.clip_c > 1, "algo.clip_c", "must be > 1", cfg.algo.clip_c)
    require(cfg.algo.agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
            "algo.agg", "is not a known aggregation", cfg.algo.agg)
    require(cfg.algo.correction.is_level in (None, "token", "sequence"), "algo.correction.is_level", "must be null, token or sequence", cfg.algo.correction.is_level)
    from asyncgrpo.algo import KL_KINDS

    require(cfg.algo.kl.kind in KL_KINDS, "algo.kl.kind", f"must be one of {sorted(KL_KINDS)}", cfg.algo.kl.kind)
    require(cfg.algo.kl.coef >= 0, "algo.kl.coef", "must be >= 0", cfg.algo.kl.coef)
    require(cfg.task.name == "arithmetic", "task.name", "must be arithmetic (the only built-in task so far)", cfg.task.name)
    require(cfg.seed >= 0, "seed", "must be >= 0", cfg.seed)
    require(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda", cfg.device)


def use_curve(cfg: Config) -> bool:
    return cfg.wire.curve == "on" or (cfg.wire.curve == "auto" and not is_loopback(cfg.wire.host))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def groups_per_generator(cfg: Config) -> list[int]:
    """How one step's groups are shared among generators (the throttle's per-generator quota)."""
    n, total = cfg.rollout.num_generators, cfg.train.groups_per_step
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


