"""`asyncgrpo --help` and `asyncgrpo train --help` list the config groups and the real defaults."""

import dataclasses

import pytest

from asyncgrpo import cli
from asyncgrpo.schema import Config


def help_text(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_lists_every_config_group_and_the_current_defaults(capsys, argv):
    text = help_text(capsys, argv)
    defaults = Config()
    for field in dataclasses.fields(Config):
        if dataclasses.is_dataclass(getattr(defaults, field.name)):
            assert f"  {field.name}.*" in text
    assert f"train.max_steps={defaults.train.max_steps} " in text
    assert f"train.max_staleness={defaults.train.max_staleness} " in text
    assert f"learner.lr={defaults.learner.lr} " in text
    assert f"log.samples_every_steps={defaults.log.samples_every_steps} " in text
    assert "log.tensorboard=false " in text and "log.wandb_mode=offline " in text


def test_every_listed_key_exists_and_every_group_is_described():
    text = cli.config_help()
    for key in cli.COMMON_KEYS:
        assert f"  {key}=" in text, f"{key} is listed in cli.COMMON_KEYS but not in Config"
    for name in cli.GROUP_HELP:
        assert hasattr(Config(), name), f"cli.GROUP_HELP describes {name}.*, which Config does not have"


def test_help_follows_a_changed_default(monkeypatch):
    monkeypatch.setattr(Config, "__init__", _with_max_steps(Config.__init__, 4321))
    assert "train.max_steps=4321 " in cli.config_help()


def _with_max_steps(init, steps):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.train.max_steps = steps
    return patched


def test_plot_is_a_subcommand(capsys):
    assert "RUN_DIR" in help_text(capsys, ["plot", "--help"])


def test_bad_data_is_reported_in_one_line_not_a_traceback(capsys, monkeypatch, tmp_path):
    import asyncgrpo.train
    from asyncgrpo.data.records import DataError

    def bad_data(cfg):
        raise DataError("train.jsonl:3: missing field 'question' (data.strict=true; ...)")

    monkeypatch.setattr(asyncgrpo.train, "train", bad_data)
    assert cli.main(["train", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncgrpo: data error: train.jsonl:3:") and err.count("\n") == 1


def test_help_lists_the_presets(capsys):
    text = help_text(capsys, ["train", "--help"])
    assert "presets (--config-name NAME" in text and "gsm8k_qwen05b_1gpu" in text


def test_every_subcommand_has_a_handler_and_every_handler_a_subcommand():
    subcommands = next(action for action in cli.build_parser()._actions if action.dest == "command")
    assert list(subcommands.choices) == list(cli.COMMANDS)
