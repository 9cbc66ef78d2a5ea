"""LossSettings: validated once when built, and built from every key of the config's algo section."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
from flat_settings import flat_settings

from asyncgrpo.config import load
from asyncgrpo.learner.update import loss_settings
from asyncgrpo.schema import AlgoConfig, ConfigError

# The algo keys the loss does not read, and who does.
READ_ELSEWHERE = {
    "advantage": "update(), for group_advantages",
    "kl.enabled": "loss_settings itself: whether settings.kl is set at all",
    "kl.reference_on": "Policy.from_config, which places the reference",
    "overlong": "overlong_settings(), for apply_overlong (tests/unit/test_update_overlong.py)",
    "overlong_buffer_tokens": "overlong_settings()",
    "overlong_penalty": "overlong_settings()",
    "filter_groups": "learner_parts(), which gives the replay queue its SignalFilter",
}
# A value other than the default for every key the loss reads, so each can be seen to arrive.
OVERRIDES = {
    "mode": "decoupled", "loss_type": "cispo", "clip_low": 1.0, "clip_high": 0.5, "clip_c": 5.0, "m2_threshold": 0.1,
    "agg": "seq-mean-token-sum-norm", "norm_constant": 123.0, "correction.is_level": "sequence",
    "correction.is_threshold": "0.5_3.0", "correction.is_batch_normalize": True, "correction.rs": "token_k1",
    "correction.rs_threshold": 4.0, "kl.kind": "k2", "kl.coef": 0.25,
}


def leaves(settings: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every field of a (nested) dataclass instance."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", value


def test_loss_settings_carry_every_key_of_the_algo_section():
    cfg = load(["algo.kl.enabled=true", *(f"algo.{key}={value}" for key, value in OVERRIDES.items())])
    carried = dict(leaves(loss_settings(cfg, cfg.rollout.max_new_tokens)))
    algo_keys = dict(leaves(cfg.algo))
    # A new algo key fails here until the loss carries it or the list above says who reads it.
    assert carried.keys() == algo_keys.keys() - READ_ELSEWHERE.keys()
    assert carried == {key: algo_keys[key] for key in carried}
    defaults = dict(leaves(AlgoConfig()))
    assert [key for key in carried if carried[key] == defaults[key]] == []


def test_loss_settings_fill_in_the_norm_constant_and_leave_the_kl_penalty_off_by_default():
    cfg = load([])
    settings = loss_settings(cfg, cfg.rollout.max_new_tokens)
    assert cfg.algo.norm_constant is None and settings.norm_constant == float(cfg.rollout.max_new_tokens)
    assert settings.kl is None


def test_an_invalid_combination_is_refused_when_the_settings_are_built_in_one_line():
    keys = {"loss_type": "ppo_clip", "clip_low": 1.0, "clip_high": 0.28, "clip_c": 3.0, "agg": "token-mean",
            "norm_constant": None}
    with pytest.raises(ValueError, match=r"^clip_low must be < 1 \(or exactly 1 with loss_type cispo\), got 1.0$"):
        flat_settings(**keys)
    assert flat_settings(**(keys | {"loss_type": "cispo"})).clip_low == 1.0


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce", "gspo", "cispo"])
@pytest.mark.parametrize("clip_low", [0.2, 0.999, 1.0, 1.5])
def test_config_and_loss_settings_accept_the_same_clip_low(loss_type, clip_low):
    try:
        load([f"algo.loss_type={loss_type}", f"algo.clip_low={clip_low}"])
        config_accepts = True
    except ConfigError:
        config_accepts = False
    try:
        flat_settings(loss_type=loss_type, clip_low=clip_low, clip_high=0.28, clip_c=3.0, agg="token-mean",
                      norm_constant=None)
        settings_accept = True
    except ValueError:
        settings_accept = False
    assert config_accepts == settings_accept == (clip_low < 1 or (clip_low == 1 and loss_type == "cispo"))
