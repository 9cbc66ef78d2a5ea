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
from asyncgrpo.wire.sockets import TRANSPORTS


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
    # arithmetic (built in) | countdown (built in) | gsm8k (data.* files, answers after #### or in
    # \boxed{}) | files (data.* files, answers compared as strings). See docs/TASKS.md.
    name: str = "arithmetic"
    num_digits: int = 2
    # Held-out problems (file tasks: at most this many, a fixed subset of data.eval_files, or without
    # eval files up to a fifth of the training records, held out of training).
    eval_size: int = 500
    countdown_numbers: int = 4  # numbers given per countdown problem
    countdown_max_number: int = 100  # numbers are drawn from 1..this


@dataclass
class DataConfig:
    """Prompts from local files, for task.name=gsm8k|files (JSONL or Parquet, by file extension)."""

    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    prompt_field: str = "question"
    answer_field: str = "answer"
    # Wrap each prompt as a user message with the tokenizer's chat template (instruct models).
    chat_template: bool = False
    system_prompt: str = ""
    # Applied to the raw prompt before the chat template; {prompt} is the file's prompt field.
    prompt_template: str = "{prompt}"
    # Prompts longer than this (tokens) are filtered; 0 = the context, model.max_positions - rollout.max_new_tokens.
    max_prompt_tokens: int = 0
    shuffle: bool = True
    # Passes over the training files; 0 = endless.
    epochs: int = 0
    # Stop at the first bad record instead of skipping and counting it.
    strict: bool = False


@dataclass
class RewardTermConfig:
    name: str = "task"  # logged as reward/<name>
    # task (the task's own check) | exact | numeric | math | format | fn | judge; "" = same as name.
    kind: str = ""
    weight: float = 1.0
    fn: str = ""  # kind=fn: package.module:function (default: reward.fn)
    tolerance: float = 1e-6  # kind=numeric: absolute and relative
    pattern: str = ""  # kind=format: a regex the completion must contain (default: the task's answer format)


@dataclass
class JudgeConfig:
    """An OpenAI-compatible chat-completions endpoint that scores completions (kind=judge)."""

    base_url: str = ""  # e.g. http://127.0.0.1:8000/v1; requests go to <base_url>/chat/completions
    model: str = ""
    api_key_env: str = ""  # name of an environment variable holding the API key (never the key itself)
    # Fields: {prompt} {completion} {answer}.
    prompt_template: str = (
        "Rate the response to the question from 0 to 10.\nQuestion: {prompt}\nReference answer: {answer}\n"
        "Response: {completion}\nReply with the score only."
    )
    parser: str = "number"  # number (last number in the reply / max_score) | yes_no | regex:<pattern with one group>
    max_score: float = 10.0
    max_tokens: int = 16
    temperature: float = 0.0
    concurrency: int = 16  # requests in flight
    timeout_s: float = 30.0  # one request
    retries: int = 3  # after the first try, on timeouts, connection errors, 429 and 5xx
    backoff_s: float = 0.5  # first retry delay, doubled each retry


@dataclass
class RewardConfig:
    # Weighted sum of terms; empty = one term, the task's own check (exact match for arithmetic).
    terms: list[RewardTermConfig] = field(default_factory=list)
    # A user reward, fn(prompt, completion, answer=None, **extra) -> float, sync or async;
    # with terms empty it is the only term.
    fn: str = ""
    # A reward that raises, times out or returns NaN/inf: zero = that term scores 0 for that
    # completion; drop_group = the whole group is not sent. Either way reward/errors counts it.
    on_error: str = "zero"  # zero | drop_group
    timeout_s: float = 30.0  # one call of a user fn
    concurrency: int = 64  # user fn calls in flight
    threads: int = 4  # threads for sync user fns and math equivalence
    judge: JudgeConfig = field(default_factory=JudgeConfig)


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
    # Load a weight push mid-generation: generate in segments of inflight_chunk_tokens, load the
    # newest weights between segments, resume each unfinished sequence from what it already has.
    inflight_updates: bool = False
    inflight_chunk_tokens: int = 2


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
    # Fill micro-batches longest rows first, so rows of similar length share one (less padding).
    bucket_by_length: bool = True
    # Recompute each decoder layer's activations in the backward pass instead of storing them.
    activation_checkpointing: bool = False
    # fp32 | bf16 (GPU only: FSDP2 computes in bf16, reduces gradients and keeps weights in fp32).
    mixed_precision: str = "fp32"
    # GPU only: FSDP2 keeps sharded weights, gradients and optimizer state in CPU memory and runs
    # the optimizer step there. On CPU everything already lives in CPU memory (no-op).
    offload_optimizer: bool = False


@dataclass
class KLConfig:
    enabled: bool = False
    kind: str = "k3"
    coef: float = 0.001
    # Where the frozen reference (the starting weights) lives: same = sharded with FSDP2 like the
    # policy, on the learner's device; cpu = a full copy in CPU memory (saves GPU memory, slower).
    reference_on: str = "same"


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
    # Write a sharded checkpoint to run_dir/checkpoints/step_<N> every this many learner steps; 0 = never.
    save_every_steps: int = 0
    keep_checkpoints: int = 0  # newest complete checkpoints kept; 0 = all
    # Write the final policy in Hugging Face format to run_dir/export.
    export_at_end: bool = True


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
    # auto = ipc (Unix socket, about half the kernel cost of TCP loopback) when wire.host is loopback,
    # tcp otherwise. ipc needs every process on this node, and drops what a generator sent but the
    # learner had not read yet if that generator exits meanwhile; tcp delivers it. See docs/WIRE.md.
    transport: str = "auto"  # auto | tcp | ipc
    max_message_bytes: int = 256 << 20
    # Every cross-process wait fails loudly after this long.
    timeout_s: float = 120.0
    # Actor start-up (vLLM engine start is the slow part).
    startup_timeout_s: float = 600.0


@dataclass
class WeightsConfig:
    # zmq: chunks over a ZeroMQ PUB socket (any device). nccl: versions announced over ZeroMQ, tensors
    # broadcast from learner rank 0 into every generator over NCCL (one GPU per actor; on CPU a gloo
    # group stands in, for tests). See asyncgrpo/weights/__init__.py.
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
class LogConfig:
    # run_dir/metrics.jsonl is always written; these add sinks (pip install 'asyncgrpo[track]').
    tensorboard: bool = False  # event files under run_dir/tensorboard
    wandb: bool = False
    wandb_project: str = "asyncgrpo"
    # offline needs no network or account; `wandb sync run_dir/wandb/offline-run-*` uploads later.
    wandb_mode: str = "offline"  # offline | online
    # Every this many learner steps, print a few prompts with completions and rewards and append
    # them to run_dir/samples.jsonl; 0 = never.
    samples_every_steps: int = 100
    samples_per_log: int = 4  # prompts (groups) per log, each with all its completions


@dataclass
class Config:
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    # Continue from a checkpoint: a checkpoint directory (step_<N>) or a run directory (its newest
    # complete checkpoint); empty = a fresh run.
    resume: str = ""
    # auto: cuda when the driver sees an NVIDIA GPU (vLLM and the learner then share the GPUs
    # through Ray's GPU resources, with NCCL between learner ranks), else cpu.
    device: str = "auto"
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    log: LogConfig = field(default_factory=LogConfig)


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
    require(learner.world_size >= 1, "learner.world_size", "must be >= 1", learner.world_size)
    require(learner.mixed_precision in ("fp32", "bf16"), "learner.mixed_precision", "must be fp32 or bf16",
            learner.mixed_precision)
    require(learner.mixed_precision == "fp32" or cfg.device != "cpu", "learner.mixed_precision",
            "bf16 needs a GPU (device=cuda or auto on a GPU machine)", learner.mixed_precision)
    require(cfg.algo.kl.reference_on in ("same", "cpu"), "algo.kl.reference_on", "must be same or cpu",
            cfg.algo.kl.reference_on)
    require(t.save_every_steps >= 0, "train.save_every_steps", "must be >= 0 (0 = never)", t.save_every_steps)
    require(t.keep_checkpoints >= 0, "train.keep_checkpoints", "must be >= 0 (0 = all)", t.keep_checkpoints)
    require(not cfg.resume or Path(cfg.resume).expanduser().is_dir(), "resume",
            "must be a checkpoint directory or a run directory", cfg.resume)
    require(learner.lr > 0, "learner.lr", "must be > 0", learner.lr)
    require(learner.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0", learner.warmup_steps)
    require(learner.lr_schedule in ("constant", "cosine"), "learner.lr_schedule", "must be constant or cosine", learner.lr_schedule)
    require(0 <= learner.min_lr_ratio <= 1, "learner.min_lr_ratio", "must be in [0, 1]", learner.min_lr_ratio)
    require(learner.micro_batch_tokens >= 0, "learner.micro_batch_tokens", "must be >= 0", learner.micro_batch_tokens)
    require(cfg.weights.backend in ("zmq", "nccl"), "weights.backend", "must be zmq or nccl", cfg.weights.backend)
    require(cfg.rollout.inflight_chunk_tokens >= 1, "rollout.inflight_chunk_tokens", "must be >= 1",
            cfg.rollout.inflight_chunk_tokens)
    require(cfg.weights.push_every_steps >= 1, "weights.push_every_steps", "must be >= 1", cfg.weights.push_every_steps)
    # Generators only ever hold pushed versions (multiples of k): with k > max_staleness + 1 the
    # throttle and the acknowledgement bound would wait for a version that is never pushed.
    require(cfg.weights.push_every_steps <= cfg.train.max_staleness + 1, "weights.push_every_steps",
            f"must be <= train.max_staleness + 1 = {cfg.train.max_staleness + 1}", cfg.weights.push_every_steps)
    require(cfg.wire.timeout_s > 0, "wire.timeout_s", "must be > 0", cfg.wire.timeout_s)
    require(cfg.wire.curve in ("auto", "on", "off"), "wire.curve", "must be auto, on or off", cfg.wire.curve)
    require(cfg.wire.transport in TRANSPORTS, "wire.transport", f"must be one of {', '.join(TRANSPORTS)}",
            cfg.wire.transport)
    require(cfg.wire.transport != "ipc" or is_loopback(cfg.wire.host), "wire.transport",
            f"ipc reaches only this node, but wire.host={cfg.wire.host!r} is for other nodes: use tcp or auto",
            cfg.wire.transport)
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
    _validate_task_data_reward(cfg, require)
    require(cfg.seed >= 0, "seed", "must be >= 0", cfg.seed)
    require(cfg.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda", cfg.device)
    require(cfg.log.wandb_mode in ("offline", "online"), "log.wandb_mode", "must be offline or online", cfg.log.wandb_mode)
    require(cfg.log.samples_every_steps >= 0, "log.samples_every_steps", "must be >= 0 (0 = off)", cfg.log.samples_every_steps)
    require(cfg.log.samples_per_log >= 1, "log.samples_per_log", "must be >= 1", cfg.log.samples_per_log)


def _validate_task_data_reward(cfg: Config, require: Any) -> None:
    task, data, reward = cfg.task, cfg.data, cfg.reward
    require(task.name in TASK_NAMES, "task.name", f"must be one of {', '.join(TASK_NAMES)}", task.name)
    require(task.eval_size >= 1, "task.eval_size", "must be >= 1", task.eval_size)
    if task.name == "countdown":
        require(2 <= task.countdown_numbers <= 6, "task.countdown_numbers", "must be between 2 and 6", task.countdown_numbers)
        require(task.countdown_max_number >= 2, "task.countdown_max_number", "must be >= 2", task.countdown_max_number)
    if task.name in FILE_TASKS:
        require(bool(data.train_files), "data.train_files", f"must list at least one JSONL or Parquet file for task.name={task.name}",
                data.train_files)
    require(task.name not in ("countdown", "gsm8k") or bool(cfg.model.path), "model.path",
            f"must name a Hugging Face model directory for task.name={task.name}: the embedded tiny model has a "
            f"{cfg.model.max_positions}-token context and a character vocabulary, so every {task.name} prompt would be "
            "filtered as too long", cfg.model.path)
    require("{prompt}" in data.prompt_template, "data.prompt_template", "must contain {prompt}", data.prompt_template)
    require(data.max_prompt_tokens >= 0, "data.max_prompt_tokens", "must be >= 0 (0 = the context)", data.max_prompt_tokens)
    require(data.epochs >= 0, "data.epochs", "must be >= 0 (0 = endless)", data.epochs)
    require(reward.on_error in ("zero", "drop_group"), "reward.on_error", "must be zero or drop_group", reward.on_error)
    require(reward.timeout_s > 0, "reward.timeout_s", "must be > 0", reward.timeout_s)
    require(reward.concurrency >= 1, "reward.concurrency", "must be >= 1", reward.concurrency)
    require(reward.threads >= 1, "reward.threads", "must be >= 1", reward.threads)
    names = [term.name for term in reward.terms]
    require(len(set(names)) == len(names), "reward.terms", "must have distinct names", names)
    for i, term in enumerate(reward.terms):
        kind = term.kind or term.name
        require(kind in REWARD_KINDS, f"reward.terms[{i}].kind", f"must be one of {', '.join(REWARD_KINDS)}", kind)
        require(term.name not in ("mean", "std", "errors") and term.name.isidentifier(), f"reward.terms[{i}].name",
                "must be an identifier other than mean, std or errors (it is logged as reward/<name>)", term.name)
        require(term.weight == term.weight, f"reward.terms[{i}].weight", "must be a number", term.weight)
        require(kind != "fn" or bool(term.fn or reward.fn), f"reward.terms[{i}].fn", "must be package.module:function (or set reward.fn)", term.fn)
        require(term.tolerance >= 0, f"reward.terms[{i}].tolerance", "must be >= 0", term.tolerance)
    kinds = [term.kind or term.name for term in reward.terms]
    require(not reward.fn or not reward.terms or "fn" in kinds, "reward.fn",
            "is set but no reward.terms entry has kind fn (with reward.terms set, add {name: fn} to use it)", reward.fn)
    if "judge" in kinds:
        judge = reward.judge
        require(judge.base_url.startswith(("http://", "https://")), "reward.judge.base_url", "must be an http(s) URL", judge.base_url)
        require(judge.concurrency >= 1, "reward.judge.concurrency", "must be >= 1", judge.concurrency)
        require(judge.timeout_s > 0, "reward.judge.timeout_s", "must be > 0", judge.timeout_s)
        require(judge.retries >= 0, "reward.judge.retries", "must be >= 0", judge.retries)
        require(judge.backoff_s >= 0, "reward.judge.backoff_s", "must be >= 0", judge.backoff_s)
        require(judge.max_score > 0, "reward.judge.max_score", "must be > 0", judge.max_score)
        require(judge.parser in ("number", "yes_no") or judge.parser.startswith("regex:"), "reward.judge.parser",
                "must be number, yes_no or regex:<pattern>", judge.parser)


TASK_NAMES = ("arithmetic", "countdown", "gsm8k", "files")
FILE_TASKS = ("gsm8k", "files")
REWARD_KINDS = ("task", "exact", "numeric", "math", "format", "fn", "judge")


def use_curve(cfg: Config) -> bool:
    return cfg.wire.curve == "on" or (cfg.wire.curve == "auto" and not is_loopback(cfg.wire.host))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def groups_per_generator(cfg: Config) -> list[int]:
    """How one step's groups are shared among generators (the throttle's per-generator quota)."""
    n, total = cfg.rollout.num_generators, cfg.train.groups_per_step
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


