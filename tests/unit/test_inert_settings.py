"""Settings set away from their default while another setting turns their feature off are named,
with why, in one warning line of `asyncgrpo train` (asyncgrpo/inert_settings.py); a default value,
a feature that is on and the shipped presets name none (the example study specs: tests/unit/test_study.py)."""

from pathlib import Path

import pytest

from asyncgrpo import cli
from asyncgrpo.config import CONFIG_DIR, load
from asyncgrpo.inert_settings import RULES, inert_settings
from asyncgrpo.schema import Config

FILE_TASK_OVERRIDES = ["data.train_files=[x.jsonl]", "model.path=/models/any"]


def quiet_load(overrides: list[str], config_name: str = "default") -> Config:
    return load(overrides, config_name=config_name, log=lambda _: None)


@pytest.mark.parametrize(("overrides", "named"), [
    (["algo.kl.coef=0.05"], "algo.kl.coef=0.05 (algo.kl.enabled=false)"),
    (["algo.mode=naive", "algo.correction.is_level=token"], "algo.correction.is_level=token (algo.mode=naive"),
    (["algo.mode=decoupled", "algo.correction.is_threshold=3.0"], "algo.correction.is_threshold=3.0 (algo.correction.is_level is unset"),
    (["algo.mode=naive", "algo.correction.is_threshold=3.0"], "algo.correction.is_threshold=3.0 (algo.mode=naive"),  # once
    (["algo.correction.rs_threshold=0.5"], "algo.correction.rs_threshold=0.5 (algo.correction.rs is unset"),
    (["algo.loss_type=gspo", "algo.clip_c=5"], "algo.clip_c=5.0 (the dual clip is ppo_clip's"),
    (["algo.m2_threshold=0.1"], "algo.m2_threshold=0.1 (algo.loss_type=ppo_clip)"),
    (["algo.norm_constant=100"], "algo.norm_constant=100"),
    (["algo.overlong_penalty=0.5"], "algo.overlong_penalty=0.5 (algo.overlong=keep)"),
    (["train.divergence_target=0.02"], "train.divergence_target=0.02 (train.staleness_control=versions)"),
    (["learner.lora.alpha=32", "learner.lora.target_modules=[q_proj]"],
     "learner.lora.alpha=32.0, learner.lora.target_modules=['q_proj'] (learner.lora.rank=0"),
    (["weights.full_every=5"], "weights.full_every=5 (weights.delta=false)"),
    (["model.path=/models/any", "model.hidden_size=128"], "model.hidden_size=128 (model.path"),
    (["env.max_turns=6", "env.agent.fn=m:f"], "env.max_turns=6, env.agent.fn=m:f (no env.name"),
    (["reward.judge.base_url=http://127.0.0.1:1/v1"], "reward.judge.base_url=http://127.0.0.1:1/v1 (no reward term of kind judge)"),
    # The judge's limits size the generator's wait for rewards only where a term is a judge.
    (["reward.judge.timeout_s=600", "reward.judge.concurrency=1"],
     "reward.judge.concurrency=1, reward.judge.timeout_s=600.0 (no reward term of kind judge)"),
    (["log.wandb_mode=online"], "log.wandb_mode=online (log.wandb=false)"),
    (["data.chat_template=true"], "data.chat_template=True (task.name=arithmetic makes its own problems)"),
    (["task.longtail_max_digits=8"], "task.longtail_max_digits=8 (task.name=arithmetic)"),
    (["reward.terms=[{name: exact, pattern: 'x+'}, {name: format, pattern: 'y'}]"],
     "reward.terms[0].pattern=x+ (a term of kind exact)"),
])
def test_a_changed_key_whose_feature_is_off_is_named_with_why(overrides, named):
    inert = inert_settings(quiet_load(overrides))
    assert len(inert) == 1 and inert[0].startswith(named), inert


@pytest.mark.parametrize("overrides", [
    ["algo.kl.enabled=true", "algo.kl.coef=0.05"],
    ["algo.mode=decoupled", "algo.correction.is_level=token"],
    ["algo.loss_type=reinforce", "algo.correction.is_level=token"],  # reinforce takes the IS weights
    ["algo.mode=bypass", "algo.correction.rs=token_k1", "algo.correction.rs_threshold=2.0"],  # rejection acts under bypass
    ["algo.loss_type=m2po", "algo.m2_threshold=0.1"],
    ["learner.lora.rank=4", "learner.lora.alpha=32"],
    ["weights.delta=true", "weights.full_every=5", "weights.backend=zmq", "weights.wire_dtype=bfloat16"],
    ["algo.kl.coef=0.001"],  # the default, typed out: not a change
    ["algo.correction.is_level=token"],  # under bypass's clip the weights give the is/* metrics only
    ["reward.terms=[{name: judge}]", "reward.judge.base_url=http://127.0.0.1:1/v1", "reward.judge.timeout_s=600",
     "reward.judge.concurrency=1"],
    ["model.hidden_size=128"],
    ["reward.terms=[{name: n, kind: numeric, tolerance: 0.01}, {name: f, kind: format, pattern: 'y'}]"],
])
def test_a_key_whose_feature_is_on_or_that_keeps_its_default_is_not_named(overrides):
    assert inert_settings(quiet_load(overrides)) == []


def test_every_rule_names_keys_of_the_schema():
    default = Config()
    for rule in RULES:
        assert rule.keys
        for key in rule.keys:
            node = default
            for name in key.split("."):
                assert hasattr(node, name), key
                node = getattr(node, name)


@pytest.mark.parametrize("preset", sorted(p.stem for p in Path(CONFIG_DIR).glob("*.yaml")))
def test_a_shipped_preset_sets_nothing_it_does_not_read(preset):
    # A file task's preset names example paths; these stand in for the user's.
    needs_files = preset in ("gsm8k_qwen05b_1gpu", "qwen7b_8gpu_judge")
    assert inert_settings(quiet_load(FILE_TASK_OVERRIDES if needs_files else [], preset)) == []


def test_train_warns_in_one_stderr_line_and_still_runs_the_command(capsys):
    code = cli.main(["train", "algo.kl.coef=0.05", "log.wandb_mode=online", "--cfg"])
    out, err = capsys.readouterr()
    assert code == 0 and "kl:" in out
    assert err == ("asyncgrpo: warning: set but not read by this run: algo.kl.coef=0.05 (algo.kl.enabled=false); "
                   "log.wandb_mode=online (log.wandb=false)\n")
