"""An export never deletes what it did not write: `asyncgrpo export CKPT .` once removed the
working directory."""

import json

import pytest
import torch

from asyncgrpo.cli import main
from asyncgrpo.learner.export import EXPORT_MARKER, write_hf


@pytest.fixture
def model_files(tmp_path):
    directory = tmp_path / "model_files"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"dtype": "float32"}))
    return directory


def test_a_non_empty_directory_is_refused_and_left_alone(model_files, tmp_path):
    target = tmp_path / "work"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an earlier export"):
        write_hf([("w", torch.ones(2))], model_files, target)
    assert (target / "notes.txt").read_text() == "mine"


def test_an_earlier_export_or_an_empty_directory_is_replaced(model_files, tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    write_hf([("w", torch.ones(2))], model_files, target)
    assert (target / EXPORT_MARKER).is_file() and (target / "model.safetensors").is_file()
    write_hf([("w", torch.zeros(3))], model_files, target)
    assert json.loads((target / EXPORT_MARKER).read_text())["bytes"] == 12


def test_the_cli_refuses_the_working_directory_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.py").write_text("print('keep me')")
    assert main(["export", str(tmp_path / "no-run"), "."]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to replace it" in err
    assert (tmp_path / "keep.py").exists()
