"""Command-line overrides behave as the README says: an unknown key stops the run (with `+`, `++`
or none), a misspelled one is told the nearest real key, a list key takes a scalar as a one-element
list, Hydra's sweeps and `--cfg job` point at what this CLI has instead, and validation sees the
device that `device=auto` resolved to. Each runs the CLI in-process, as `asyncgrpo train ... --cfg`."""

import contextlib

import pytest
import yaml

from asyncgrpo import cli


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def config_error(capsys, *args: str) -> str:
    """The one stderr line of a refused command line (exit 2, nothing printed on stdout)."""
    code, out, err = run_cli(capsys, *args)
    assert code == 2, (code, out, err)
    assert out == ""
    assert err.startswith("asyncgrpo: config error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("override", "key"), [("+foo=1", "foo"), ("++foo=1", "foo"),
                                                ("+train.max_step=10", "train.max_step"),
                                                ("++rollout.bogus=3", "rollout.bogus")])
def test_an_added_key_the_schema_lacks_is_refused_like_any_unknown_key(capsys, override, key):
    assert f"unknown config key '{key}'" in config_error(capsys, override, "--cfg")


@pytest.mark.parametrize(("override", "nearest"), [
    ("train.max_step=10", "train.max_steps"),
    ("+train.max_step=10", "train.max_steps"),
    ("++train.max_step=10", "train.max_steps"),
    ("algo.kl.coeff=0.1", "algo.kl.coef"),  # nested two deep
    ("trian.max_steps=3", "train.max_steps"),  # the group misspelled
    ("sed=3", "seed"),
])
def test_a_misspelled_key_is_told_the_nearest_real_key(capsys, override, nearest):
    assert f"(did you mean {nearest}?)" in config_error(capsys, override, "--cfg")


def test_a_key_like_no_real_one_gets_no_suggestion(capsys):
    err = config_error(capsys, "+zzzzqqqq=1", "--cfg")
    assert "unknown config key 'zzzzqqqq'" in err and "did you mean" not in err


def test_a_misspelled_field_of_a_list_entry_is_told_the_real_field(capsys):
    err = config_error(capsys, "reward.terms=[{name:task}]", "+reward.terms.0.wieght=2", "--cfg")
    assert "unknown config key 'reward.terms.0.wieght' (did you mean reward.terms.0.weight?)" in err


def test_a_field_of_a_list_entry_can_be_set(capsys):
    code, out, err = run_cli(capsys, "reward.terms=[{name:task}]", "reward.terms.0.weight=2", "--cfg")
    assert code == 0, err
    assert yaml.safe_load(out)["reward"]["terms"][0]["weight"] == 2


def test_a_scalar_for_a_list_key_is_a_one_element_list(capsys):
    code, out, err = run_cli(capsys, "task.name=files", "data.train_files=x.jsonl", "data.eval_files='y z.jsonl'",
                             "--cfg")
    assert code == 0, err
    data = yaml.safe_load(out)["data"]
    assert data["train_files"] == ["x.jsonl"] and data["eval_files"] == ["y z.jsonl"]


def test_a_comma_list_for_a_list_key_is_told_the_bracket_form(capsys):
    err = config_error(capsys, "data.train_files=a.jsonl,b.jsonl", "--cfg")
    assert "data.train_files=[a.jsonl,b.jsonl]" in err


@pytest.mark.parametrize("args", [("-m", "seed=1,2,3"), ("--multirun", "seed=1"), ("train.seed=1,2,3",),
                                  ("seed=1,2,3",), ("seed=range(1,4)",)])
def test_a_sweep_points_at_asyncgrpo_study(capsys, args):
    assert "asyncgrpo study" in config_error(capsys, *args, "--cfg")


@pytest.mark.parametrize("args", [("--cfg", "job"), ("--cfg", "hydra"), ("--cfg", "all"), ("--cfg=job",),
                                  ("train.max_steps=3", "--cfg", "job")])
def test_cfg_with_hydras_argument_points_at_plain_cfg(capsys, args):
    err = config_error(capsys, *args)
    assert "--cfg takes no argument" in err


def _resolve_auto_to_cpu(monkeypatch):
    import asyncgrpo.train

    monkeypatch.setattr(asyncgrpo.train, "resolve_device", lambda device: "cpu" if device == "auto" else device)


def test_check_refuses_bf16_when_auto_resolves_to_cpu(capsys, monkeypatch, tmp_path):
    import asyncgrpo.driver.preflight

    _resolve_auto_to_cpu(monkeypatch)
    # Were the preflight to run, it would pass: only validation on the resolved device refuses bf16.
    monkeypatch.setattr(asyncgrpo.driver.preflight, "check_rewards", lambda cfg: {})
    monkeypatch.setattr(asyncgrpo.driver.preflight, "model_dir_for_check", lambda cfg: contextlib.nullcontext("model"))
    monkeypatch.setattr(asyncgrpo.driver.preflight, "preflight", lambda cfg, model_dir: {})
    monkeypatch.setattr(asyncgrpo.driver.preflight, "format_report", lambda report: "report")
    err = config_error(capsys, "check=true", "learner.mixed_precision=bf16", f"run_dir={tmp_path}")
    assert "learner.mixed_precision" in err and "'bf16'" in err


def test_train_refuses_bf16_when_auto_resolves_to_cpu(capsys, monkeypatch, tmp_path):
    import asyncgrpo.train

    _resolve_auto_to_cpu(monkeypatch)

    def past_validation(cfg):
        raise RuntimeError("the run went on past validation")

    monkeypatch.setattr(asyncgrpo.train, "check_rewards", past_validation)
    err = config_error(capsys, "learner.mixed_precision=bf16", f"run_dir={tmp_path}")
    assert "learner.mixed_precision" in err and "'bf16'" in err


def test_overrides_on_both_sides_of_an_option_all_apply(capsys):
    code, out, err = run_cli(capsys, "train.max_steps=7", "--cfg", "seed=5")
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert (resolved["train"]["max_steps"], resolved["seed"]) == (7, 5)
