"""Settings a run does not read: keys set away from their default whose feature another setting
turns off (algo.kl.coef with algo.kl.enabled=false, env.max_turns with no env.name, ...).

`asyncgrpo train` names them in one warning line before the run starts, so that a user who meant
them to act learns they did not; they are not refused, because a preset or a recording may carry a
value for a feature it leaves off. A key counts only when its value differs from the structured
config's default (schema.Config): what a preset or the command line changed. Data files named for a
task that makes its own problems are refused instead (config.py, _task_rules): there the run would
train on other prompts than the user's.

Each rule below was checked against the code that reads its keys: nothing else reads them while the
condition holds. Left out on purpose: algo.correction.is_* under algo.mode=bypass with a ratio loss
(the weights do not reach the loss there, but they still give the is/* metrics, ESS included).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.schema import Config, RewardTermConfig
from asyncgrpo.tasks import FILE_TASKS, TASK_PARAMETERS


@dataclass(frozen=True)
class InertWhen:
    """`keys` have no effect while `applies(cfg)`; `because(cfg)` names the setting that turns them off."""

    keys: tuple[str, ...]
    applies: Callable[[Config], bool]
    because: Callable[[Config], str]


def _at(node: Any, key: str) -> Any:
    for name in key.split("."):
        node = getattr(node, name)
    return node


def section_keys(section: str, *, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every leaf key under a dotted section of the schema (nested dataclasses walked), less `but`."""
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            key = f"{prefix}.{f.name}"
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, key)
            elif key not in but:
                keys.append(key)

    walk(_at(Config(), section), section)
    return tuple(keys)


def _judge_terms(cfg: Config) -> bool:
    return "judge" in [term.resolved_kind for term in cfg.reward.terms]


RULES: tuple[InertWhen, ...] = (
    InertWhen(("algo.kl.kind", "algo.kl.coef", "algo.kl.reference_on"), lambda c: not c.algo.kl.enabled,
              lambda c: "algo.kl.enabled=false"),
    InertWhen(section_keys("algo.correction"), lambda c: c.algo.mode == "naive",
              lambda c: "algo.mode=naive applies no rollout correction"),
    InertWhen(("algo.correction.is_threshold", "algo.correction.is_batch_normalize"),
              lambda c: c.algo.correction.is_level is None, lambda c: "algo.correction.is_level is unset: no IS weights"),
    InertWhen(("algo.correction.rs_threshold",), lambda c: c.algo.correction.rs is None,
              lambda c: "algo.correction.rs is unset: no rejection"),
    InertWhen(("algo.clip_c",), lambda c: c.algo.loss_type != "ppo_clip",
              lambda c: f"the dual clip is ppo_clip's; algo.loss_type={c.algo.loss_type}"),
    InertWhen(("algo.m2_threshold",), lambda c: c.algo.loss_type != "m2po",
              lambda c: f"algo.loss_type={c.algo.loss_type}"),
    InertWhen(("algo.norm_constant",), lambda c: c.algo.agg != "seq-mean-token-sum-norm",
              lambda c: f"algo.agg={c.algo.agg}"),
    InertWhen(("algo.overlong_penalty", "algo.overlong_buffer_tokens"), lambda c: c.algo.overlong != "penalty",
              lambda c: f"algo.overlong={c.algo.overlong}"),
    InertWhen(("train.divergence_target",), lambda c: c.train.staleness_control != "divergence",
              lambda c: f"train.staleness_control={c.train.staleness_control}"),
    InertWhen(section_keys("learner.lora", but=("learner.lora.rank",)), lambda c: c.learner.lora.rank == 0,
              lambda c: "learner.lora.rank=0 is full fine-tuning"),
    InertWhen(tuple(f"model.{key}" for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                               "intermediate_size", "warmstart_target_accuracy",
                                               "warmstart_max_seconds")),
              lambda c: bool(c.model.path), lambda c: "model.path: the shape and warm start are the embedded model's"),
    InertWhen(("weights.full_every",), lambda c: not c.weights.delta, lambda c: "weights.delta=false"),
    InertWhen(section_keys("env", but=("env.name",)), lambda c: not c.env.name,
              lambda c: "no env.name: a rollout is one policy turn"),
    InertWhen(section_keys("reward.judge"),
              lambda c: not _judge_terms(c),
              lambda c: "no reward term of kind judge"),
    InertWhen(("log.wandb_project", "log.wandb_mode"), lambda c: not c.log.wandb, lambda c: "log.wandb=false"),
    InertWhen(section_keys("data"), lambda c: c.task.name not in FILE_TASKS,
              lambda c: f"task.name={c.task.name} makes its own problems"),
    *(InertWhen(tuple(f"task.{key}" for key in keys), lambda c, task=task: c.task.name != task,
                lambda c: f"task.name={c.task.name}") for task, keys in TASK_PARAMETERS.items()),
)


# A reward term's field -> the kinds that read it (rewards/scorer.py, _build_term).
TERM_FIELD_KINDS = {"pattern": ("format",), "tolerance": ("numeric", "math"), "fn": ("fn",)}


def inert_settings(cfg: Config) -> list[str]:
    """The changed keys `cfg` does not read, each group with why: ["algo.kl.coef=0.05 (algo.kl.enabled=false)", ...]."""
    default = Config()
    found, named = [], set()  # a key two rules turn off is named once, by the first
    for rule in RULES:
        if not rule.applies(cfg):
            continue
        changed = [key for key in rule.keys if key not in named and _at(cfg, key) != _at(default, key)]
        named.update(changed)
        if changed:
            found.append(f"{', '.join(f'{key}={_at(cfg, key)}' for key in changed)} ({rule.because(cfg)})")
    return found + _inert_term_fields(cfg)


def _inert_term_fields(cfg: Config) -> list[str]:
    """A reward term's pattern, tolerance or fn set on a term of a kind that does not read it."""
    default, found = RewardTermConfig(), []
    for index, term in enumerate(cfg.reward.terms):
        kind = term.resolved_kind
        changed = [f"reward.terms[{index}].{name}={getattr(term, name)}" for name, kinds in TERM_FIELD_KINDS.items()
                   if kind not in kinds and getattr(term, name) != getattr(default, name)]
        if changed:
            found.append(f"{', '.join(changed)} (a term of kind {kind})")
    return found
