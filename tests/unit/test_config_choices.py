"""Every choice-valued config key is checked against the list of the module that implements it:
each value of that list loads, a value outside it is refused with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.algo import (
    ADVANTAGE_MODES,
    AGG_MODES,
    IS_LEVELS,
    KL_KINDS,
    LOSS_TYPES,
    MODES,
    OVERLONG_MODES,
)
from asyncgrpo.config import load
from asyncgrpo.learner.precision import MIXED_PRECISIONS, REFERENCE_PLACEMENTS
from asyncgrpo.learner.schedule import LR_SCHEDULES
from asyncgrpo.metrics.sinks import WANDB_MODES
from asyncgrpo.contract import STALE_POLICIES
from asyncgrpo.runtime.resources import DEVICES
from asyncgrpo.rewards.judge import JUDGE_PARSERS, REGEX_PARSER_PREFIX
from asyncgrpo.rewards.scorer import ON_ERROR_POLICIES, REWARD_KINDS
from asyncgrpo.schema import Config, ConfigError
from asyncgrpo.tasks import FILE_TASKS, TASK_NAMES
from asyncgrpo.tasks.countdown import MAX_NUMBERS, MIN_NUMBERS
from asyncgrpo.weights.base import BACKENDS
from asyncgrpo.wire.network import CURVE_MODES, TRANSPORTS

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"
JUDGE_TERM = ["reward.terms=[{name: judged, kind: judge}]", "reward.judge.base_url=http://127.0.0.1:9/v1"]

# key -> (the implementing module's list, what the key reads from the loaded Config)
CHOICES = {
    "train.stale_policy": (STALE_POLICIES, lambda cfg: cfg.train.stale_policy),
    "learner.mixed_precision": (MIXED_PRECISIONS, lambda cfg: cfg.learner.mixed_precision),
    "learner.lr_schedule": (LR_SCHEDULES, lambda cfg: cfg.learner.lr_schedule),
    "algo.kl.reference_on": (REFERENCE_PLACEMENTS, lambda cfg: cfg.algo.kl.reference_on),
    "algo.kl.kind": (KL_KINDS, lambda cfg: cfg.algo.kl.kind),
    "algo.advantage": (ADVANTAGE_MODES, lambda cfg: cfg.algo.advantage),
    "algo.loss_type": (LOSS_TYPES, lambda cfg: cfg.algo.loss_type),
    "algo.mode": (MODES, lambda cfg: cfg.algo.mode),
    "algo.agg": (AGG_MODES, lambda cfg: cfg.algo.agg),
    "algo.overlong": (OVERLONG_MODES, lambda cfg: cfg.algo.overlong),
    "algo.correction.is_level": (IS_LEVELS, lambda cfg: cfg.algo.correction.is_level),
    "weights.backend": (BACKENDS, lambda cfg: cfg.weights.backend),
    "wire.curve": (CURVE_MODES, lambda cfg: cfg.wire.curve),
    "wire.transport": (TRANSPORTS, lambda cfg: cfg.wire.transport),
    "device": (DEVICES, lambda cfg: cfg.device),
    "log.wandb_mode": (WANDB_MODES, lambda cfg: cfg.log.wandb_mode),
    "task.name": (TASK_NAMES, lambda cfg: cfg.task.name),
    "reward.on_error": (ON_ERROR_POLICIES, lambda cfg: cfg.reward.on_error),
}

# Values that load only together with other settings (all of them static checks: nothing here
# needs a GPU, a model or a judge to exist).
NEEDS = {
    ("learner.mixed_precision", "bf16"): ["device=cuda"],  # bf16 is refused on device=cpu
    ("task.name", "countdown"): ["model.path=/models/any"],  # its prompts do not fit the tiny model
    ("task.name", "longtail"): ["model.max_positions=256", "rollout.max_new_tokens=200"],  # room for its scratchpads
    ("task.name", "multiply"): ["rollout.max_new_tokens=8", "model.max_positions=64"],  # room for the product
    ("task.name", "guess"): ["env.name=guess", "rollout.max_new_tokens=80", "model.max_positions=96"],  # the game
    ("task.name", "gsm8k"): ["model.path=/models/any", f"data.train_files=[{SAMPLE}]"],
    ("task.name", "files"): [f"data.train_files=[{SAMPLE}]"],
}


def quoted(value: str) -> str:
    """A Hydra override value: quoted, so that '+' (k3+) or '-' (token-mean) stay plain characters."""
    return f"'{value}'"


def assert_refused(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(overrides)
    message = str(err.value)
    assert key in message and "\n" not in message, message


def test_every_list_is_a_non_empty_tuple_of_distinct_strings_holding_config_default():
    default = Config()
    for key, (choices, read) in CHOICES.items():
        assert isinstance(choices, tuple) and choices, key
        assert all(isinstance(value, str) for value in choices) and len(set(choices)) == len(choices), key
        # algo.correction.is_level defaults to null (off), which is not a level.
        assert read(default) is None if key == "algo.correction.is_level" else read(default) in choices, key


@pytest.mark.parametrize(("key", "value"), [(key, value) for key, (choices, _) in CHOICES.items() for value in choices])
def test_each_listed_value_loads(key, value):
    cfg = load([f"{key}={quoted(value)}", *NEEDS.get((key, value), [])])
    assert CHOICES[key][1](cfg) == value


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_a_value_outside_the_list_is_refused_naming_the_key(key):
    choices, _ = CHOICES[key]
    assert "not_a_choice" not in choices
    assert_refused([f"{key}=not_a_choice"], key)


def test_is_level_null_switches_importance_weights_off():
    assert load(["algo.correction.is_level=null"]).algo.correction.is_level is None


def test_file_tasks_are_task_names():
    assert set(FILE_TASKS) <= set(TASK_NAMES)
    for name in FILE_TASKS:  # a file task without files is refused
        assert_refused([f"task.name={name}", "model.path=/models/any"], "data.train_files")


@pytest.mark.parametrize("kind", REWARD_KINDS)
def test_each_reward_kind_loads(kind):
    term = {"fn": "{name: t, kind: fn, fn: 'my_rewards:score'}"}.get(kind, f"{{name: t, kind: {kind}}}")
    extra = JUDGE_TERM[1:] if kind == "judge" else []
    cfg = load([f"reward.terms=[{term}]", *extra])
    assert cfg.reward.terms[0].kind == kind


def test_an_unknown_reward_kind_is_refused_naming_the_term():
    assert_refused(["reward.terms=[{name: t, kind: not_a_choice}]"], "reward.terms[0].kind")
    # With no kind, the name is the kind.
    assert_refused(["reward.terms=[{name: speed}]"], "reward.terms[0].kind")


@pytest.mark.parametrize("parser", [*JUDGE_PARSERS, f"{REGEX_PARSER_PREFIX}<score>(\\d+)</score>"])
def test_each_judge_parser_loads(parser):
    assert load([*JUDGE_TERM, f"reward.judge.parser={quoted(parser)}"]).reward.judge.parser == parser


def test_an_unknown_judge_parser_is_refused():
    assert_refused([*JUDGE_TERM, "reward.judge.parser=not_a_choice"], "reward.judge.parser")


def test_countdown_numbers_within_the_task_range_load_and_outside_are_refused():
    countdown = ["task.name=countdown", "model.path=/models/any"]
    for numbers in (MIN_NUMBERS, MAX_NUMBERS):
        assert load([*countdown, f"task.countdown_numbers={numbers}"]).task.countdown_numbers == numbers
    for numbers in (MIN_NUMBERS - 1, MAX_NUMBERS + 1):
        assert_refused([*countdown, f"task.countdown_numbers={numbers}"], "task.countdown_numbers")
