import re

import pytest

from asyncgrpo.config import PROBE_TOLERANCE_16BIT, PROBE_TOLERANCE_FP32, load, probe_tolerance
from asyncgrpo.composition import use_curve
from asyncgrpo.contract import call_sizes
from asyncgrpo.schema import Config, ConfigError, to_yaml


def test_defaults_compose_and_resolve():
    cfg = load([])
    assert isinstance(cfg, Config)
    assert cfg.train.max_staleness == 2
    assert cfg.algo.loss_type == "ppo_clip"
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.2, 0.28)
    assert "${" not in cfg.run_dir


@pytest.mark.parametrize(("overrides", "expected"), [
    ([], PROBE_TOLERANCE_FP32),
    (["rollout.dtype=bfloat16"], PROBE_TOLERANCE_16BIT),
    (["weights.wire_dtype=bfloat16"], PROBE_TOLERANCE_16BIT),  # a float32 engine fed bf16-rounded weights
    (["weights.wire_dtype=float16"], PROBE_TOLERANCE_16BIT),
    (["device=cuda", "learner.mixed_precision=bf16"], PROBE_TOLERANCE_16BIT),
    (["rollout.dtype=bfloat16", "train.probe_tolerance=0.05"], 0.05),  # set: taken as it is
    (["train.probe_tolerance=1e-4"], 1e-4),
])
def test_the_probe_tolerance_is_the_setting_or_when_auto_loose_only_where_something_computes_in_16_bits(
        overrides, expected):
    assert probe_tolerance(load(overrides)) == expected


def test_overrides_apply():
    cfg = load(["train.max_steps=20", "train.max_staleness=0", "run_dir=runs/r", "seed=3"])
    assert (cfg.train.max_steps, cfg.train.max_staleness, cfg.run_dir, cfg.seed) == (20, 0, "runs/r", 3)


@pytest.mark.parametrize(
    ("override", "named_key"),
    [
        ("foo=1", "foo"),
        ("rollout.bogus=3", "rollout.bogus"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt"),
        ("train.max_staleness=-1", "train.max_staleness"),
        ("queue.capacity_groups=4", "queue.capacity_groups"),
        ("train.max_steps=abc", "train.max_steps"),
        ("wire.curve=maybe", "wire.curve"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("algo.advantage=ppo", "algo.advantage"),
        ("rollout.num_generators=17", "rollout.num_generators"),
        ("learner.world_size=0", "learner.world_size"),
        ("learner.mixed_precision=fp8", "learner.mixed_precision"),
        ("algo.kl.reference_on=disk", "algo.kl.reference_on"),
        ("train.save_every_steps=-1", "train.save_every_steps"),
        ("train.checkpoint_timeout_s=0", "train.checkpoint_timeout_s"),
        ("train.checkpoint_timeout_s=inf", "train.checkpoint_timeout_s"),
        ("resume=/no/such/checkpoint", "resume"),
        ("algo.kl.kind=k9", "algo.kl.kind"),
        ("device=tpu", "device"),
        ("weights.push_every_steps=4", "weights.push_every_steps"),  # > max_staleness + 1 = 3
        ("algo.clip_low=1", "algo.clip_low"),  # a ratio floor of 0: only cispo's IS weight may have none
        ("algo.overlong=drop", "algo.overlong"),
        ("algo.overlong_buffer_tokens=-1", "algo.overlong_buffer_tokens"),
        ("algo.overlong_buffer_tokens=6", "algo.overlong_buffer_tokens"),  # > rollout.max_new_tokens = 5
        ("algo.overlong_penalty=-0.5", "algo.overlong_penalty"),
        ("algo.overlong_penalty=nan", "algo.overlong_penalty"),
        ("algo.m2_threshold=0", "algo.m2_threshold"),
        ("algo.m2_threshold=inf", "algo.m2_threshold"),
        ("train.probe_tolerance=-0.1", "train.probe_tolerance"),
        # Values the learner, the engine or the warm start would only refuse (or misuse) once running.
        ("learner.grad_clip_norm=-1", "learner.grad_clip_norm"),  # clip_grad_norm_ would flip every gradient
        ("learner.grad_clip_norm=0", "learner.grad_clip_norm"),  # ... or zero them
        ("learner.grad_clip_norm=nan", "learner.grad_clip_norm"),
        ("learner.betas=[0.9]", "learner.betas"),
        ("learner.betas=[0.9,1.5]", "learner.betas"),
        ("learner.weight_decay=-1", "learner.weight_decay"),
        ("learner.lr=inf", "learner.lr"),
        ("learner.torch_threads=-4", "learner.torch_threads"),
        ("learner.num_cpus_per_rank=0", "learner.num_cpus_per_rank"),
        ("rollout.gpu_memory_utilization=7", "rollout.gpu_memory_utilization"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("algo.clip_high=inf", "algo.clip_high"),
        ("algo.kl.coef=inf", "algo.kl.coef"),
        ("algo.norm_constant=-1", "algo.norm_constant"),
        ("algo.correction.rs=bogus", "algo.correction.rs"),
        ("algo.correction.is_threshold=-1", "algo.correction.is_threshold"),
        ("algo.correction.is_threshold='3_2'", "algo.correction.is_threshold"),  # L > U
        ("model.hidden_size=0", "model.hidden_size"),
        ("model.num_layers=-1", "model.num_layers"),
        ("model.num_heads=3", "model.num_heads"),  # 64 is not a multiple of 3
        ("model.num_kv_heads=3", "model.num_kv_heads"),
        ("model.warmstart_target_accuracy=5", "model.warmstart_target_accuracy"),
        ("task.num_digits=0", "task.num_digits"),
        ("task.num_digits=1", "task.eval_size"),  # 500 held out of 100 problems
        ("seed=99999999999999999999999", "seed"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(override, named_key):
    with pytest.raises(ConfigError) as err:
        load([override])
    message = str(err.value)
    assert named_key in message
    assert "\n" not in message


@pytest.mark.parametrize("overrides", [["wire.transport=tcp"], ["wire.transport=tcp", "wire.host=localhost"],
                                       ["wire.host=0.0.0.0"], ["wire.host=0.0.0.0", "wire.insecure=true"]])
def test_curve_auto_is_on_for_every_tcp_endpoint_loopback_included(overrides):
    assert use_curve(load(overrides))


def test_curve_auto_is_off_over_ipc_and_curve_on_forces_it_there():
    assert not use_curve(load([]))  # loopback host, transport auto -> ipc
    assert not use_curve(load(["wire.transport=ipc"]))
    assert use_curve(load(["wire.curve=on"]))


@pytest.mark.parametrize("overrides", [["wire.transport=tcp"], ["wire.host=0.0.0.0"]])
def test_curve_off_over_tcp_without_insecure_fails_with_one_line_naming_the_keys(overrides):
    with pytest.raises(ConfigError) as err:
        load([*overrides, "wire.curve=off"])
    message = str(err.value)
    assert "\n" not in message
    assert all(key in message for key in ("wire.curve", "wire.transport", "wire.host", "wire.insecure"))


@pytest.mark.parametrize("overrides", [["wire.transport=tcp"], ["wire.host=0.0.0.0"]])
def test_curve_off_over_tcp_is_allowed_with_insecure(overrides):
    assert not use_curve(load([*overrides, "wire.curve=off", "wire.insecure=true"]))


def test_curve_off_over_ipc_needs_no_insecure():
    assert not use_curve(load(["wire.curve=off"]))


def test_resolved_yaml_round_trips():
    cfg = load(["train.max_steps=7"])
    assert "max_steps: 7" in to_yaml(cfg)


@pytest.mark.parametrize(("groups", "generators"), [(16, 1), (16, 3), (5, 5), (7, 2)])
def test_a_steps_groups_are_spread_evenly_over_the_generators(groups, generators):
    cfg = load([f"train.groups_per_step={groups}", f"rollout.num_generators={generators}",
                f"queue.capacity_groups={4 * groups}"])
    quotas = call_sizes(cfg.rollout.groups_per_call, cfg.rollout.num_generators, cfg.train.groups_per_step)
    assert sum(quotas) == groups and len(quotas) == generators and max(quotas) - min(quotas) <= 1





def test_no_signature_default_shadows_config():
    """Parameters that carry a config key have no default of their own: config's is the only one."""
    import inspect

    from asyncgrpo import algo
    from asyncgrpo.data.prompts import (
        FieldMap,
        PromptFormat,
        epoch_stream,
        load_problems,
    )
    from asyncgrpo.data.records import DataReport
    from asyncgrpo.learner.batch import micro_batch_plan
    from asyncgrpo.metrics.sinks import WandbSink
    from asyncgrpo.models.tiny import TinyModelSpec
    from asyncgrpo.models.warmstart import ensure_warm_model
    from asyncgrpo.runtime.resources import pin_to_cores, plan_cores
    from asyncgrpo.rewards import verifiers
    from asyncgrpo.rewards.judge import parse_score
    from asyncgrpo.rollout.engine import VLLMEngine
    from asyncgrpo.tasks import ArithmeticTask, CountdownTask
    from asyncgrpo.tasks.files import FileTask

    policy = ["loss_type", "clip_low", "clip_high", "clip_c", "agg", "norm_constant"]
    correction = ["is_level", "is_threshold", "is_batch_normalize", "rs", "rs_threshold"]
    mode = ["mode"]
    config_parameters = {
        algo.group_advantages: ["mode"],
        algo.aggregate: ["norm_constant"],
        algo.LossSettings: mode + policy,
        algo.CorrectionSettings: correction,
        algo.KLSettings: ["kind", "coef"],
        algo.rollout_correction: correction,
        algo.kl_penalty: ["kind"],
        algo.OverlongSettings: ["mode", "max_new_tokens", "buffer_tokens", "penalty"],
        algo.overlong_penalty: ["max_new_tokens", "buffer_tokens", "penalty"],
        verifiers.numeric_match: ["tolerance"],
        verifiers.math_equivalent: ["tolerance"],
        verifiers.math_reward: ["tolerance"],
        parse_score: ["parser", "max_score"],
        ArithmeticTask: ["num_digits", "eval_size"],
        CountdownTask: ["num_numbers", "max_number", "eval_size"],
        FileTask: ["eval_size"],
        FieldMap: ["prompt", "answer"],
        PromptFormat: ["template", "chat_template", "system_prompt"],
        DataReport: ["strict"],
        load_problems: ["max_prompt_tokens"],
        epoch_stream: ["epochs", "shuffle"],
        TinyModelSpec: ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"],
        ensure_warm_model: ["target_accuracy", "max_seconds"],
        VLLMEngine: ["dtype", "kv_cache_gib", "gpu_memory_utilization"],
        VLLMEngine.sequence_logprobs: ["temperature"],
        WandbSink: ["project", "mode"],
        plan_cores: ["generator_spec", "learner_spec"],
        pin_to_cores: ["torch_threads"],
        micro_batch_plan: ["bucket_by_length"],
    }
    shadowing = [f"{getattr(target, '__qualname__', target)}({name}=...)"
                 for target, names in config_parameters.items()
                 for name in names
                 if inspect.signature(target).parameters[name].default is not inspect.Parameter.empty]
    assert not shadowing


def test_a_context_without_room_for_a_prompt_is_refused():
    with pytest.raises(ConfigError, match="model.max_positions must leave room for a prompt"):
        load(["model.max_positions=16", "rollout.max_new_tokens=16"])


def test_cispo_alone_may_drop_the_floor_of_its_is_weight():
    cfg = load(["algo.loss_type=cispo", "algo.clip_low=1"])
    assert (cfg.algo.loss_type, cfg.algo.clip_low) == ("cispo", 1.0)
    with pytest.raises(ConfigError, match="algo.clip_low"):
        load(["algo.loss_type=cispo", "algo.clip_low=1.5"])


def test_mode_defaults_to_bypass():
    assert load([]).algo.mode == "bypass"


def test_a_generator_pinned_to_more_cores_than_its_ray_cpus_is_refused_on_cpu_before_vllm_would_stop():
    with pytest.raises(ConfigError, match=r"rollout.num_cpus_per_generator must be >= 2 on CPU"):
        load(["device=cpu", "rollout.cpu_cores=0-1", "rollout.num_cpus_per_generator=1"])
    assert load(["device=cpu", "rollout.cpu_cores=0-1", "rollout.num_cpus_per_generator=2"]).rollout.cpu_cores == "0-1"
    assert load(["device=cpu", "rollout.cpu_cores=0", "rollout.num_cpus_per_generator=1"]).rollout.cpu_cores == "0"


@pytest.mark.parametrize("override", ["rollout.dispatch=tickets", "rollout.dispatch=shares",
                                      "rollout.generator_shares=[8,8]", "queue.full_policy=block"])
def test_a_removed_dispatch_key_in_an_override_is_one_line_saying_tickets_is_the_only_dispatch(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        load([override])
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{key} was removed") and "tickets is the only dispatch" in message


def test_a_removed_dispatch_key_in_a_preset_is_one_line_saying_tickets_is_the_only_dispatch(tmp_path):
    (tmp_path / "old.yaml").write_text("defaults:\n  - asyncgrpo\n  - _self_\nrollout:\n  dispatch: shares\n")
    with pytest.raises(ConfigError) as err:
        load([], config_name="old", config_dir=tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith("rollout.dispatch was removed") \
        and "tickets is the only dispatch" in message


def _functions_calling_require() -> set[str]:
    """The module-level functions of asyncgrpo/config.py that check something themselves: they call
    `require`, or hand it to a check of asyncgrpo/contract.py."""
    import ast
    import inspect

    from asyncgrpo import config

    tree = ast.parse(inspect.getsource(config))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(isinstance(name, ast.Name) and name.id == "require" for name in ast.walk(node))}


def test_every_validation_rule_is_a_documented_function_in_the_list_and_validate_runs_each_in_order(monkeypatch):
    import inspect

    from asyncgrpo import config

    listed = [rule.__name__ for rule in config.VALIDATION_RULES]
    assert len(listed) == len(set(listed)), listed
    for rule in config.VALIDATION_RULES:
        assert inspect.isfunction(rule) and getattr(config, rule.__name__, None) is rule, rule
        assert (rule.__doc__ or "").strip(), f"{rule.__name__} has no docstring"
    # A rule written but left out of the list would never run.
    assert _functions_calling_require() == set(listed)
    ran = []
    monkeypatch.setattr(config, "VALIDATION_RULES",
                        tuple(lambda cfg, name=name: ran.append(name) for name in listed))
    config.validate(Config())
    assert ran == listed


@pytest.mark.parametrize(("overrides", "first_key"), [
    # The staleness settings are checked where each section's checks always had them: a fault of
    # an earlier section is reported before them, and they before a later one.
    (["learner.lr=0", "weights.push_every_steps=5"], "learner.lr"),
    (["train.max_steps=0", "train.stale_policy=never"], "train.max_steps"),
    (["train.max_train_minutes=-1", "train.stale_policy=never"], "train.max_train_minutes"),
    (["train.stale_policy=never", "queue.capacity_groups=1"], "train.stale_policy"),
    (["train.max_staleness=-1", "train.max_steps=0"], "train.max_staleness"),
    (["weights.backend=bogus", "weights.max_backlog_versions=0"], "weights.backend"),
    (["rollout.inflight_chunk_tokens=0", "weights.push_every_steps=0"], "rollout.inflight_chunk_tokens"),
    (["weights.push_every_steps=5", "weights.max_backlog_versions=0"], "weights.max_backlog_versions"),
    (["weights.push_every_steps=5", "weights.wire_dtype=bogus"], "weights.push_every_steps"),
])
def test_of_two_faults_the_one_checked_first_is_reported(overrides, first_key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert str(err.value).split(" ", 1)[0] == first_key, str(err.value)


@pytest.mark.parametrize(("text", "said"), [
    ("defaults: [asyncgrpo, _self_]\ntrain: {max_steps: [3\n", "line 3, column 1: expected ',' or ']'"),
    ("defaults: [asyncgrpo, _self_]\ntrain:\n  max_steps: 3\n  max_steps: 4\n", "line 4, column 3: found duplicate key"),
    ("train:\n  max_steps: 3\n", "is not an asyncgrpo preset: it must start with `defaults: [asyncgrpo, _self_]`"),
    ("", "is not an asyncgrpo preset"),
])
def test_a_preset_that_is_not_yaml_or_not_a_preset_is_refused_in_one_line_naming_it(tmp_path, text, said):
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load([], config_name="mine", config_dir=tmp_path)
    message = str(err.value)
    assert str(tmp_path / "mine.yaml") in message and said in message and "\n" not in message


@pytest.mark.parametrize(("overrides", "said"), [
    (["reward.judge.base_url='http://[::1/v1'"], "reward.judge.base_url must be an http(s) URL (Invalid IPv6 URL)"),
    (["reward.judge.base_url='http://127.0.0.1:abc/v1'"], "reward.judge.base_url must be an http(s) URL (Port could"),
    (["reward.judge.base_url=http:///v1"], "reward.judge.base_url must be an http(s) URL (no host)"),
    (["reward.judge.parser='regex:(['"], "reward.judge.parser must hold a regular expression with a group (unterminated"),
    (["reward.judge.parser='regex:[0-9]+'"], "reward.judge.parser must hold a regular expression with a group (it has no group"),
])
def test_a_judge_url_or_score_pattern_no_request_could_use_is_refused_naming_the_key(overrides, said):
    with pytest.raises(ConfigError) as err:
        load(["reward.terms=[{name: j, kind: judge}]", "reward.judge.base_url=http://127.0.0.1:1/v1", *overrides])
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("terms", "said"), [
    ("[{name: t, kind: task, weight: inf}]", "reward.terms[0].weight must be a finite number"),
    ("[{name: f, kind: format, pattern: '(['}]", "reward.terms[0].pattern must be a regular expression (unterminated"),
])
def test_a_reward_term_that_would_fail_every_call_is_refused_naming_it(terms, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        load([f"reward.terms={terms}"])


def test_a_preset_value_of_the_wrong_type_says_what_was_wrong_on_one_line(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults: [asyncgrpo, _self_]\nlearner:\n  lr: banana\n")
    with pytest.raises(ConfigError) as err:
        load([], config_name="mine", config_dir=tmp_path)
    assert "learner.lr" in str(err.value) and "Value 'banana' of type 'str' could not be converted to Float" in str(err.value)
    assert "\n" not in str(err.value)  # OmegaConf's own message has several lines: config._one_line joins them


@pytest.mark.parametrize(("override", "key"), [("model.num_heads=3", "model.num_heads"),
                                               ("model.num_kv_heads=3", "model.num_kv_heads")])
def test_a_head_count_that_does_not_divide_is_named_itself(override, key):
    with pytest.raises(ConfigError) as err:
        load([override])
    assert str(err.value).startswith(f"{key} must divide ")


def test_an_embedded_model_whose_head_dim_vllm_cpu_attention_cannot_run_is_refused_on_cpu_only():
    # 64 / 4 = 16 channels per head: vLLM on CPU stops at engine start; on a GPU the size is fine.
    with pytest.raises(ConfigError) as err:
        load(["device=cpu", "model.num_heads=4", "model.num_kv_heads=1"])
    assert str(err.value).startswith("model.num_heads gives model.hidden_size / model.num_heads = head_dim 16: ")
    assert load(["device=cuda", "model.num_heads=4", "model.num_kv_heads=1"]).model.num_heads == 4
    assert load(["device=cpu", "model.path=/some/model", "model.num_heads=4"]).model.num_heads == 4  # its own sizes
