"""The structured config schema: the one place where defaults live.

Dataclasses registered in Hydra's ConfigStore; YAML under `asyncgrpo/configs/` and command-line
overrides only change values. An unknown key fails in one line, with `+` or `++` too, naming the
nearest real key (`asyncgrpo.config.checked_overrides`); a removed key says what replaced it.
Units are in the names.

A leaf: it imports no other asyncgrpo module, nor torch or ZeroMQ, so every part can import its own
section of the config. Loading and validation live in `asyncgrpo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


@dataclass
class ModelConfig:
    # A Hugging Face model directory; empty = the embedded tiny Qwen2, built and warm-started locally.
    # Set: the toy values below nobody set give way to the "your model" profile (MODEL_PROFILE_*).
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
    # arithmetic (built in) | countdown (built in) | longtail (built in: addition worked column by column,
    # heavy-tailed lengths) | multiply (built in: a*b, with the calculator tool when env.name=calculator) |
    # guess (built in: guess the number, needs env.name=guess) | gsm8k (data.* files, answers after #### or
    # in \boxed{}) | files (data.* files, answers compared as strings). See docs/TASKS.md.
    name: str = "arithmetic"
    num_digits: int = 2
    # Held-out problems (file tasks: at most this many, a fixed subset of data.eval_files, or without
    # eval files up to a fifth of the training records, held out of training).
    eval_size: int = 500
    countdown_numbers: int = 4  # numbers given per countdown problem
    countdown_max_number: int = 100  # numbers are drawn from 1..this
    # longtail: both operands of a problem have d digits, d drawn from min..max digits with probability
    # proportional to d^-exponent; a completion is about 10*d tokens, so these set the length distribution
    # (the defaults: median 21, p99 140, longest 161 tokens; docs/TASKS.md, longtail).
    longtail_min_digits: int = 2
    longtail_max_digits: int = 16
    longtail_exponent: float = 2.5
    # multiply: digits of the left and right operand (123*45: 3 and 2); the product is beyond the embedded
    # model unaided, so the calculator tool (env.name=calculator) is what makes it learnable.
    multiply_left_digits: int = 3
    multiply_right_digits: int = 2
    # guess: the secret is drawn from 1..this; a binary search needs ceil(log2(this)) + 1 guesses (env.max_turns).
    guess_max: int = 64


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

    @property
    def resolved_kind(self) -> str:
        """The kind the term scores by: `kind`, or its name when kind is ""."""
        return self.kind or self.name


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
    # A reward that raises, times out or returns anything but a real number within float32
    # (NaN, inf, 1e39, "0.7", None; True/False are 1/0): zero = that term scores 0 for that
    # completion; drop_group = the whole group is not sent. Either way reward/errors counts it.
    on_error: str = "zero"  # zero | drop_group
    # Beyond this share of failed reward calls (completions x terms) over the last
    # error_window_steps learner steps (and the one in progress), the run fails with each failing
    # term's first error: a judge that is down stops the run instead of training on zeros.
    # 1 = never stop.
    max_error_rate: float = 0.5
    error_window_steps: int = 20
    timeout_s: float = 30.0  # one call of a user fn (a sync one from when a thread takes it)
    concurrency: int = 64  # user fn calls in flight
    threads: int = 4  # threads for sync user fns and math equivalence
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class EnvHttpConfig:
    """env.name=http: an environment served over HTTP with a JSON protocol (asyncgrpo/envs/http.py,
    docs/ENVIRONMENTS.md)."""

    base_url: str = ""  # e.g. http://127.0.0.1:8100; episodes are POSTed to <base_url>/reset and /step
    api_key_env: str = ""  # name of an environment variable holding a bearer token (never the token itself)
    # One request; with the retries and their backoff well within env.timeout_s, which bounds the call.
    timeout_s: float = 2.0
    retries: int = 3  # after the first try, on timeouts, connection errors, 429 and 5xx
    backoff_s: float = 0.2  # first retry delay, doubled each retry


@dataclass
class AgentEnvConfig:
    """env.name=agent: your own agent code drives each episode through an OpenAI-compatible chat
    endpoint that the generator serves on loopback (asyncgrpo/envs/agent.py, docs/ENVIRONMENTS.md,
    Bring your own agent)."""

    # package.module:function, called once per episode on a thread of its own as
    # fn(problem: dict, base_url: str, api_key: str) -> float (sync or async); its return value is
    # added to the episode's reward (reward/env).
    fn: str = ""
    # A Jinja chat template rendering the agent's messages into tokens; "" = the tokenizer's own
    # (a model without one, like the embedded toy, needs this set).
    chat_template: str = ""


@dataclass
class EnvConfig:
    """Multi-turn episodes: the policy's turns and an environment's answers (asyncgrpo/envs/,
    docs/ENVIRONMENTS.md). Read by asyncgrpo/envs and the generator's episode runner."""

    # "" = none: a rollout is the policy's one turn. calculator (a tool for arithmetic: the policy
    # writes [expression], the environment answers =value) | guess (guess the number, answered
    # higher/lower) | http (env.http) | agent (your agent code over a chat endpoint: env.agent).
    name: str = ""
    # Policy turns per episode at most; the episode ends after the last one whatever it wrote.
    max_turns: int = 4
    # One environment call (reset or step), from when a thread takes it; beyond it the call counts
    # as an error (gen/env_errors_timeout).
    timeout_s: float = 10.0
    # Environment calls in flight per generator: a call waiting on a tool or a service holds a thread,
    # so latency is hidden only while every episode waiting can wait at once (a generator runs up to
    # rollout.max_running_seqs sequences, and more episodes than that while some wait).
    threads: int = 256
    # A call that raises, times out or answers something that is not an EnvStep: zero = the episode
    # ends there and its reward is 0 (its tokens so far are still trained, against the group's
    # others); drop_group = the group is not sent (its slot goes to another prompt). Counted either
    # way, per cause (gen/env_errors_*).
    on_error: str = "zero"  # zero | drop_group
    # Beyond this share of failed environment calls over the last error_window_steps learner steps
    # (and the one in progress) the run fails with the first error: an environment that is down
    # stops the run instead of training on zeros. 1 = never stop.
    max_error_rate: float = 0.5
    error_window_steps: int = 20
    # Added to every environment step call (seconds; benchmarks inject a tool's latency with it).
    latency_s: float = 0.0
    http: EnvHttpConfig = field(default_factory=EnvHttpConfig)
    agent: AgentEnvConfig = field(default_factory=AgentEnvConfig)


@dataclass
class RolloutConfig:
    # Each asks learner rank 0 for the next slots of the training order as it is ready, within the
    # staleness budget, so a faster one makes more (asyncgrpo/queue/dispatch.py, docs/ARCHITECTURE.md, Dispatch).
    num_generators: int = 1
    samples_per_prompt: int = 8
    max_new_tokens: int = 5
    temperature: float = 1.0
    # Prompts per vLLM call (tickets asked for at once); 0 means a step's groups spread evenly over
    # the generators.
    groups_per_call: int = 0
    kv_cache_gib: float = 0.25
    dtype: str = "float32"
    # Cores for each generator ("auto": core i for generator i on a CPU machine; "" = no pinning).
    cpu_cores: str = "auto"
    num_cpus_per_generator: float = 1.0
    # Share of the GPU memory vLLM may use for weights and activations (device=cuda).
    gpu_memory_utilization: float = 0.3
    # Keep the engine full: admit granted prompts whenever sequences finish and send each group the
    # moment its samples are done, while the others decode on. false: the call-batched baseline,
    # which admits a call's prompts only into an empty engine, so each call waits for its slowest
    # sample (tools/bench_tail.py measures one against the other).
    continuous: bool = True
    # Sequences the engine runs at once (vLLM's max_num_seqs); the generator admits a group only
    # while its samples fit.
    max_running_seqs: int = 256
    # Load a weight push between two engine steps while sequences run (they continue on their KV
    # cache; each token records the version that sampled it). false: a push waits until the running
    # sequences finish (no new ones are admitted meanwhile), so every completion has one version.
    inflight_updates: bool = False
    # LoRA runs with adapter pushes only (learner.lora.rank > 0, weights.lora_push=adapter): how a
    # generator applies a push. merge: into its weights (W + alpha/r * B @ A for every targeted
    # layer, from a kept copy of their base); the engine then decodes at its plain speed. vllm: the
    # engine runs vLLM's LoRA path (enable_lora; every request through one adapter, which each push
    # replaces in place): no base copy and no layer rewritten per push, so a push lands in
    # milliseconds, but decoding goes through the adapter (on CPU 30-48% slower; docs/LORA.md).
    lora_apply: str = "merge"  # merge | vllm
    # A generator whose process dies (killed, out of memory, a vLLM crash) is started again, at most
    # this many times per generator; one more death fails the run. 0: the first death fails it.
    # weights.backend=nccl cannot take a new process into its group: there a death fails the run.
    max_restarts: int = 3
    # A Ray custom resource that marks the nodes generators may run on ("" = any node). Each
    # generator asks for asyncgrpo.runtime.placement.NODE_RESOURCE_SHARE (0.001) of it, so a node started
    # with `ray start --resources='{"NAME": 1}'` takes many. Set: the wire is tcp with CURVE and
    # weights go over zmq unless wire.transport / weights.backend say otherwise.
    node_resource: str = ""
    # Keep the generators' engines between runs in the Ray cluster at ray.address, as a pool of this
    # name (letters, digits, '_', '-'): a run takes the pool's generators when their engine settings
    # match (model architecture, rollout engine settings, cores), loads its own starting weights and
    # seed into them, and leaves them running when it finishes; a run that fails or is interrupted
    # kills them. asyncgrpo study sets it (docs/STUDIES.md). "" = each run starts and kills its own.
    engine_pool: str = ""


@dataclass
class LoraConfig:
    """learner.lora: LoRA adapters on the policy (asyncgrpo/learner/lora.py, PEFT's layout)."""

    # The adapters' rank; 0 = full fine-tuning (no adapters). At most min(in, out) of every targeted layer.
    rank: int = 0
    # The update is scaled by alpha / rank (PEFT's lora_alpha); > 0.
    alpha: float = 16.0
    # Dropout on the adapter path's input while training, in [0, 1) (the frozen base path has none).
    dropout: float = 0.0
    # Module-name suffixes to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj),
    # matched in the decoder layers as PEFT matches them; all-linear = every nn.Linear of the decoder
    # layers; lm_head = the LM head (only when named, as in PEFT; refused for a head tied to the
    # embeddings). The embeddings are never adapted. E.g. [all-linear, lm_head].
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class LearnerConfig:
    world_size: int = 1
    # Chosen for the embedded default (README, "The embedded default"): over 2,000 steps 2e-4 beat
    # 1e-4 and 3e-4 on held-out accuracy; with a 50-step warm-up.
    lr: float = 2e-4
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
    # Optimizer steps per learner step (PPO's mini-batches; verl's ppo_mini_batch_size as a count):
    # the step's groups dealt into this many shares, each its own loss mean and optimizer step. The
    # step stays one policy version (one push), the proximal anchor of algo.mode=decoupled|naive is
    # the weights before the first, and the lr schedule steps once. 1 = one step per batch.
    mini_batches: int = 1
    # Fill micro-batches longest rows first, so rows of similar length share one (less padding).
    bucket_by_length: bool = True
    # Recompute each decoder layer's activations in the backward pass instead of storing them.
    activation_checkpointing: bool = False
    # fp32 | bf16 (GPU only: FSDP2 computes in bf16, reduces gradients and keeps weights in fp32).
    mixed_precision: str = "fp32"
    # GPU only: FSDP2 keeps sharded weights, gradients and optimizer state in CPU memory and runs
    # the optimizer step there. On CPU everything already lives in CPU memory (no-op).
    offload_optimizer: bool = False
    # A Ray custom resource that marks the nodes learner ranks may run on ("" = any node): each
    # rank's placement-group bundle asks for 0.001 of it (see rollout.node_resource).
    node_resource: str = ""
    # LoRA: with lora.rank > 0 only adapters train (optimizer state for them alone), the KL reference
    # is the policy with its adapters off, and pushes carry the merged weights.
    lora: LoraConfig = field(default_factory=LoraConfig)


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
    # The old policy (PPO anchor): bypass = the generator's log-probs, no recompute pass;
    # decoupled = the learner's weights at the start of the step (one forward pass without gradient)
    # with IS weights pi_prox / mu per algo.correction.*; naive = that anchor, no rollout correction.
    mode: str = "bypass"  # bypass | decoupled | naive
    # gspo: sequence-level ratio (the paper's objective with agg=seq-mean-token-mean); cispo: clipped,
    # detached IS weight times logp (clip_low/clip_high clip the weight; clip_low=1 = no floor);
    # m2po: the unclipped ratio, less the tokens whose removal bounds the second moment (m2_threshold).
    loss_type: str = "ppo_clip"  # ppo_clip | reinforce | gspo | cispo | m2po
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    # loss_type=m2po: the bound on the mean squared log-ratio (log pi - log pi_old)^2 of the tokens
    # where a clip could bind (tau_M2; the paper's 0.04 in every one of its runs).
    m2_threshold: float = 0.04
    agg: str = "token-mean"
    norm_constant: float | None = None
    kl: KLConfig = field(default_factory=KLConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # Completions cut at rollout.max_new_tokens without stopping (truncated; docs/ALGORITHMS.md):
    # keep = trained like any other; mask = their tokens carry no loss (their rewards still count in
    # their groups' baselines); penalty = DAPO's soft overlong punishment added to every completion's
    # reward before the advantages, by length (also to completions that stopped inside the window).
    overlong: str = "keep"  # keep | mask | penalty
    # algo.overlong=penalty: the window before rollout.max_new_tokens, in tokens, over which the
    # penalty falls linearly from 0 to -algo.overlong_penalty; 0 = a fifth of rollout.max_new_tokens
    # (at least 1; DAPO's 4,096 of 20,480).
    overlong_buffer_tokens: int = 0
    # algo.overlong=penalty: the reward subtracted from a completion of rollout.max_new_tokens tokens.
    overlong_penalty: float = 1.0
    # DAPO's dynamic sampling: learner rank 0's queue drops a group whose rewards (after the overlong
    # penalty) are all equal on arrival, since it has advantage 0, and grants its slot again with a
    # new prompt, so every step is full of groups with signal; counted (queue/filtered). A task where
    # no group has signal then fails after wire.timeout_s, naming the filter.
    filter_groups: bool = False


@dataclass
class TrainConfig:
    # The embedded default's 2,000 steps (256,000 samples) take about 3 minutes on 2 CPU cores.
    max_steps: int = 2000
    # Stop early after this much training wall-clock (0 = no limit); eval and start-up not included.
    max_train_minutes: float = 0.0
    groups_per_step: int = 16
    max_staleness: int = 2  # policy versions
    stale_policy: str = "both"  # throttle | drop | both
    # k >= 0: every group is trained exactly k versions after the weights that sampled it (after a
    # warm-up of k steps), and max_staleness is set to k. For k >= 1 the learner publishes the
    # weights of version v + 1 - k once step v's groups are taken (so step v + 1 is generated while
    # step v trains); k = 0 pushes each version after its update. -1 = off.
    fixed_staleness: int = -1
    # How the admission bound is set (docs/ALGORITHMS.md, Divergence-gated staleness): versions = it is
    # max_staleness; divergence = the learner moves it within [min_staleness, max_staleness], one version
    # at a time, to the largest staleness whose measured divergence holds divergence_target. Either
    # way a group is trainable up to max_staleness (the staleness contract). Needs a throttling
    # stale_policy, max_staleness >= 1 and no fixed_staleness.
    staleness_control: str = "versions"  # versions | divergence
    # The lowest admission bound divergence control may set (and the one it starts from); <= max_staleness.
    min_staleness: int = 0
    # What divergence control holds: kl = the mean per-token k3 KL of the current policy against the
    # sampling one; ess = the normalised importance-sampling effective sample size, in (0, 1].
    divergence_metric: str = "kl"  # kl | ess
    # The divergence_metric's value to hold at the bound: a k3 KL per token (> 0) under kl, the lowest
    # normalised ESS to keep (in (0, 1]) under ess.
    divergence_target: float = 0.01
    # A group whose mean per-token k3 KL (current policy against the sampling one) exceeds this is
    # handled by divergence_cap_action, under either staleness_control; 0 = no cap.
    divergence_cap: float = 0.0
    # drop = the capped group's tokens add nothing to the loss (as rejected tokens, they still count in
    # its denominators); downweight = its loss is scaled by divergence_cap / its mean k3.
    divergence_cap_action: str = "drop"  # drop | downweight
    steps_per_call: int = 10  # learner steps per driver round trip (progress granularity)
    # Write a sharded checkpoint to run_dir/checkpoints/step_<N> every this many learner steps; 0 = never.
    save_every_steps: int = 0
    # Newest complete checkpoints of the run's lineage kept (learner/checkpoint.py: the checkpoint a
    # resumed run started from and an abandoned line's are not pruned); 0 = all.
    keep_checkpoints: int = 0
    # How long one checkpoint save (periodic, or at an interrupt) may take: learner rank 0 announces
    # each save to the generators, whose waits for weights or queue room then last up to this instead
    # of wire.timeout_s; the driver's wait on the learner and the learner ranks' collectives allow it too.
    checkpoint_timeout_s: float = 1800.0
    # Write the final policy in Hugging Face format to run_dir/export.
    export_at_end: bool = True
    # On Ctrl-C or SIGTERM (a scheduler's notice of preemption), save a checkpoint of the current
    # step into run_dir/checkpoints before stopping; `resume=RUN_DIR` continues from it.
    checkpoint_on_interrupt: bool = True
    # The end-of-run probe: vLLM's and the learner's log-probs of fixed sequences at the final
    # version may differ by at most this much per token, else the run fails (the generators would
    # not be sampling with the learner's weights). 0 = auto (`config.probe_tolerance`): 1e-3 when the
    # engine (rollout.dtype), the wire (weights.wire_dtype) and the learner (learner.mixed_precision)
    # all compute in 32 bits; 0.2 when any is 16-bit, where rounding alone moves log-probs by more
    # than 1e-3 (a bfloat16 wire into a float32 engine: 0.0154 on the embedded model) and a
    # fixed 1e-3 would fail every such run at its end.
    probe_tolerance: float = 0.0
    # A run that finishes having lost more than this share of the groups its generators made
    # (rejected at the learner, lost on the wire, dropped for reward errors) still ends `finished`,
    # but summary.json gets a one-line `warning` (and `groups_lost`): it trained on a selection of
    # its prompts. 1 = never warn.
    max_lost_fraction: float = 0.05


@dataclass
class QueueConfig:
    # Slots are granted only while the queue can hold them beside the next step's: it never fills.
    capacity_groups: int = 64


@dataclass
class WireConfig:
    # Where learner rank 0 binds its sockets. Across machines: an address of the learner's node the
    # others reach, or 0.0.0.0 (advertised as Ray's address of that node, never 127.0.1.1).
    host: str = "127.0.0.1"
    # CURVE authentication of the learner's sockets: auto = on over tcp (loopback included: any local
    # user can connect there), off over ipc (a socket file in a 0700 directory). The launcher
    # generates the keys and hands each process its own.
    curve: str = "auto"  # auto | on | off
    # A TCP socket without CURVE (wire.curve=off over tcp) must be asked for explicitly. It permits,
    # never disables: CURVE is off only with wire.curve=off.
    insecure: bool = False
    # auto = ipc (Unix socket, about half the kernel cost of TCP loopback) when wire.host is loopback,
    # tcp otherwise, and tcp whenever actors may run on several nodes (ray.address or a
    # node_resource set: asyncgrpo/wire/reach.py). ipc needs every process on this node, and drops
    # what a generator sent but the learner had not read yet if that generator exits meanwhile; tcp
    # delivers it. See docs/WIRE.md.
    transport: str = "auto"  # auto | tcp | ipc
    max_message_bytes: int = 256 << 20
    # Every cross-process wait fails loudly after this long.
    timeout_s: float = 120.0
    # Actor start-up (vLLM engine start is the slow part).
    startup_timeout_s: float = 600.0
    # Record every group the learner consumes, as received, with the learner's version when it took
    # it, into this directory (asyncgrpo/recording/); `asyncgrpo replay DIR` trains on it again.
    # "" = off. A directory that already holds a recording is continued only by a resumed run.
    record_dir: str = ""
    # Each recorded step is flushed (a killed process loses nothing recorded); every this many steps
    # it is also fsync'd: a crash of the machine loses at most this many steps.
    record_fsync_every_steps: int = 1


@dataclass
class WeightsConfig:
    # auto: shm when every generator is on learner rank 0's node (the wire transport resolves to
    # ipc), zmq otherwise. shm: tensors copied into shared memory, the generators load from it (one
    # host).
    # zmq: chunks over a ZeroMQ PUB socket (any device, any node). nccl: versions announced over
    # ZeroMQ, tensors broadcast from learner rank 0 into every generator over NCCL (one GPU per actor;
    # on CPU a gloo group stands in, for tests). See asyncgrpo/weights/__init__.py.
    backend: str = "auto"
    # shm: where the two version slots live (RAM-backed is the point); "" = /dev/shm, else the temp dir.
    shm_dir: str = ""
    push_every_steps: int = 1
    # zmq: payload bytes per message; a larger tensor is split over several. With its header it
    # must fit wire.max_message_bytes (checked at start).
    chunk_bytes: int = 64 << 20
    # zmq and shm: the dtype tensors travel in. auto = rollout.dtype (a bf16 engine receives half the bytes).
    wire_dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # Before a step the learner waits while a live generator's engine is more than this many
    # versions behind it, and never less than train.max_staleness + 1.
    # Each version pushed and not yet loaded waits in that generator's receive buffer (zmq: a whole
    # model each), so a stalled engine cannot pile them up; one merely slower never lags this far.
    max_backlog_versions: int = 4
    # zmq only: a push carries only the elements whose wire value changed since the previous push
    # (positions + values, or a bitmask + values, per piece, whichever is smaller; docs/WIRE.md, Delta
    # pushes). Needs a 16-bit weights.wire_dtype (after auto resolves): after one optimizer step most
    # bf16/fp16 values are unchanged, few fp32 ones are. Costs one copy of the model in the wire dtype
    # on learner rank 0's CPU (the previous push) and one in each generator process (the version a
    # delta applies onto). With weights.backend=auto it picks zmq; shm is refused (a push there is a
    # local memory copy: fewer bytes save nothing), and so is nccl (a broadcast of whole tensors
    # between GPUs; it keeps no copy to diff against).
    delta: bool = False
    # weights.delta: every this many versions a full push instead of a delta, so an engine whose
    # base went wrong unnoticed is whole again within this many versions; 1 = every push full. A
    # generator that misses a delta asks for a full push at once (its heartbeat), and one that
    # restarts gets one, whatever this says.
    full_every: int = 20
    # LoRA runs only (learner.lora.rank > 0; inert under full fine-tuning). adapter: a push carries
    # the adapters alone (A and B of every targeted layer, in weights.wire_dtype), and each generator
    # merges them into its own copy of the base's targeted layers (asyncgrpo/weights/adapters.py):
    # about rank * (in + out) / (in * out) of the bytes. merged: the learner pushes the full merged
    # weights, as under full fine-tuning; choose it for a generator engine that cannot take
    # adapter pushes (one that is not built by this project's generator, e.g. a peer inference server).
    lora_push: str = "adapter"  # adapter | merged


@dataclass
class EvalConfig:
    at_start: bool = True
    at_end: bool = True
    # Also during training: generator 0 evaluates (sampled and greedy, on the same held-out problems)
    # the first weights it loads of each version at or past a multiple of this; written to
    # metrics.jsonl as eval/when=periodic at that version's step. It pauses generator 0's sampling
    # meanwhile. 0 = at the start and the end only.
    every_steps: int = 0


@dataclass
class RayConfig:
    # "" starts a local cluster on this machine; auto or HOST:PORT joins a running one (`ray start`).
    # Joining: the wire is tcp with CURVE and weights go over zmq unless wire.transport /
    # weights.backend say otherwise (generators may run on other nodes than the learner).
    address: str = ""
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
    # The trained-vs-sampled audit (audit/*; asyncgrpo/queue/audit.py): summary.json's audit says the
    # trained groups depart from the sampled ones when the two-sample Kolmogorov-Smirnov distance of
    # their mean completion lengths, or of their mean rewards, exceeds this (0..1)...
    audit_max_ks: float = 0.1
    # ...once at least this many groups were trained (below it the distance is mostly noise).
    audit_min_groups: int = 100
    # Groups kept per side (sampled, trained) for the audit's quantiles and distances: a uniform
    # reservoir sample, so memory stays bounded over any run (exact while fewer groups came).
    audit_reservoir_groups: int = 4096


# seed is below this: the engines' sampling seeds derive from it, and numpy's take 32 bits.
SEED_LIMIT = 2**32


@dataclass
class Config:
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0  # in [0, SEED_LIMIT)
    # Continue from a checkpoint: a checkpoint directory (step_<N>) or a run directory (its newest
    # complete checkpoint); empty = a fresh run. auto = the newest complete checkpoint in
    # run_dir/checkpoints if there is one, else a fresh run: a restarted job (a preemption, a crash)
    # goes on in the same run_dir with the same command line (metrics.jsonl is appended to).
    resume: str = ""
    # A checkpoint records rollout.num_generators, the task (name, parameters, seed) and the SHA-256
    # of each data.train_files file; resuming with any of them changed, or from a checkpoint without
    # that record, is refused before Ray starts: each generator's saved prompt position would name
    # other prompts. true = resume anyway, logging what differs (asyncgrpo/learner/resume.py).
    resume_allow_changes: bool = False
    # A fresh run (resume empty) into a run_dir that already holds a run (a non-empty metrics.jsonl,
    # a step in checkpoints/) is refused before anything starts; true = start afresh in it anyway (its
    # summary.json and config.yaml are kept as .<k>, metrics.jsonl and samples.jsonl appended to).
    run_dir_reuse: bool = False
    # auto: cuda when the driver sees an NVIDIA GPU (vLLM and the learner then share the GPUs
    # through Ray's GPU resources, with NCCL between learner ranks), else cpu.
    device: str = "auto"
    progress: bool = True
    # Check the config against the model and this machine (asyncgrpo/driver/preflight.py: model directory,
    # weight-push plan, KV cache, memory estimate, a file task's data files and prompt lengths),
    # print the report and exit; nothing heavy starts.
    check: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    log: LogConfig = field(default_factory=LogConfig)


# The "your model" profile (asyncgrpo/config.py, apply_model_profile). With model.path set, each of
# model.max_positions, rollout.max_new_tokens, learner.micro_batch_tokens and learner.lr that is
# still at the embedded toy's default above and set neither by the preset file nor on the command
# line takes the profile's value (a note says which: stdout, stderr under --cfg): the toy's 32-token context,
# 5-token completions, whole-step forward passes and lr=2e-4 make no sense for a real model.
# A model whose context is no longer than the toy's keeps the toy's values.
MODEL_PROFILE_MAX_POSITIONS = 4096  # model.max_positions = min(config.json's max_position_embeddings, this)
MODEL_PROFILE_MAX_NEW_TOKENS = 512  # rollout.max_new_tokens, at most half of model.max_positions
MODEL_PROFILE_LR = 1e-6  # learner.lr, as the presets for real models use
# learner.micro_batch_tokens = model.max_positions: one full-length sequence per forward pass.

CONFIG_NAME = "asyncgrpo"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data; the repository's configs/ links here


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=CONFIG_NAME, node=Config)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
