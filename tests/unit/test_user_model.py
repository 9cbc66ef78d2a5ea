"""A user's own model (model.path) is safe: the embedded toy's values that make no sense for it are
replaced by the documented "your model" profile unless the preset or the command line set them,
`check=true` reads the data files, and a fresh run into a used run_dir is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from asyncgrpo import train as train_module
from asyncgrpo.cli import main
from asyncgrpo.config import load
from asyncgrpo.models.bpe import train_tokenizer
from asyncgrpo.models.shapes import SHAPES, qwen2_config
from asyncgrpo.schema import MODEL_PROFILE_LR, MODEL_PROFILE_MAX_NEW_TOKENS, MODEL_PROFILE_MAX_POSITIONS, Config

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(300, seed=0)


def model_dir(directory: Path, shape: str, tokenizer) -> Path:
    """A model directory of `shape` (config and tokenizer, no weights: nothing here reads them)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(SHAPES[shape], eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def resolved(capsys, *args: str) -> tuple[dict, str]:
    code = main(["train", *args, "--cfg"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return yaml.safe_load(out), err


def test_a_user_model_gets_the_profile_instead_of_the_toy_values(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "qwen2.5-0.5b", tokenizer)
    cfg, err = resolved(capsys, f"model.path={model}")
    context = min(SHAPES["qwen2.5-0.5b"].max_positions, MODEL_PROFILE_MAX_POSITIONS)
    assert cfg["model"]["max_positions"] == context
    assert cfg["rollout"]["max_new_tokens"] == MODEL_PROFILE_MAX_NEW_TOKENS
    assert cfg["learner"]["micro_batch_tokens"] == context
    assert cfg["learner"]["lr"] == MODEL_PROFILE_LR
    lines = [line for line in err.splitlines() if "model.max_positions" in line]
    assert len(lines) == 1 and "rollout.max_new_tokens" in lines[0] and "override" in lines[0]


def test_keys_set_on_the_command_line_are_kept_with_a_user_model(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "qwen2.5-0.5b", tokenizer)
    cfg, err = resolved(capsys, f"model.path={model}", "model.max_positions=256", "rollout.max_new_tokens=5",
                        "learner.lr=2e-4")
    assert cfg["model"]["max_positions"] == 256
    assert cfg["rollout"]["max_new_tokens"] == 5  # the toy's value, asked for by name: kept
    assert cfg["learner"]["lr"] == 2e-4
    assert cfg["learner"]["micro_batch_tokens"] == 256  # not set: the profile's, one full sequence


def test_a_short_context_model_gets_completions_that_leave_room_for_a_prompt(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    cfg, _ = resolved(capsys, f"model.path={model}", "model.max_positions=128")
    assert cfg["rollout"]["max_new_tokens"] == 64  # at most half the context


def test_a_preset_written_for_a_model_keeps_its_values(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "qwen2.5-0.5b", tokenizer)
    cfg, err = resolved(capsys, "--config-name", "gsm8k_qwen05b_1gpu", f"model.path={model}")
    assert (cfg["model"]["max_positions"], cfg["rollout"]["max_new_tokens"]) == (1024, 512)
    assert (cfg["learner"]["micro_batch_tokens"], cfg["learner"]["lr"]) == (16384, 1e-6)
    assert "model.max_positions" not in err


def test_the_embedded_default_resolves_as_before(capsys):
    cfg, err = resolved(capsys, "run_dir=runs/x")
    expected = Config()
    assert cfg["model"]["max_positions"] == expected.model.max_positions
    assert cfg["rollout"]["max_new_tokens"] == expected.rollout.max_new_tokens
    assert cfg["learner"]["micro_batch_tokens"] == expected.learner.micro_batch_tokens
    assert cfg["learner"]["lr"] == expected.learner.lr
    assert err == ""


def test_a_model_path_without_a_readable_config_gets_the_capped_context(capsys):
    cfg = load(["model.path=/nonexistent/model"])
    assert cfg.model.max_positions == MODEL_PROFILE_MAX_POSITIONS
    assert "/nonexistent/model" in capsys.readouterr().err


class Stop(Exception):
    pass


def stop_after_config(monkeypatch) -> None:
    """train() stops right after writing config.yaml (where reward functions are checked)."""
    def stop(cfg):
        raise Stop("stopped by the test")

    monkeypatch.setattr(train_module, "check_rewards", stop)


def test_the_run_dir_config_shows_the_profile_and_the_run_names_its_run_dir(tmp_path, tokenizer, capsys,
                                                                               monkeypatch):
    model = model_dir(tmp_path / "m", "qwen2.5-0.5b", tokenizer)
    stop_after_config(monkeypatch)
    run_dir = tmp_path / "run"
    main(["train", f"model.path={model}", f"run_dir={run_dir}", "device=cpu"])
    out, _ = capsys.readouterr()
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["rollout"]["max_new_tokens"] == MODEL_PROFILE_MAX_NEW_TOKENS
    assert f"run_dir: {run_dir}" in out.splitlines()
    assert any(line.startswith("[config] model.path is your own model") for line in out.splitlines())


@pytest.mark.parametrize("used_by", ["metrics.jsonl", "checkpoints"])
def test_a_fresh_run_into_a_used_run_dir_is_refused_in_one_line(tmp_path, capsys, monkeypatch, used_by):
    stop_after_config(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    if used_by == "checkpoints":
        (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    else:
        (run_dir / used_by).write_text("{}\n")
    code = main(["train", f"run_dir={run_dir}", "device=cpu"])
    _, err = capsys.readouterr()
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "resume=auto" in err and "run_dir_reuse=true" in err and str(run_dir) in err
    assert not (run_dir / "config.yaml").exists()  # refused before anything was written


@pytest.mark.parametrize("left", ["empty checkpoints directory", "lineage only", "empty metrics"])
def test_a_run_dir_that_holds_no_trained_step_is_taken_by_a_fresh_run(tmp_path, capsys, monkeypatch, left):
    """An empty checkpoints/ (a mount point made for them), the LINEAGE.json or the empty metrics.jsonl
    of a run that stopped before its first step: nothing a fresh run would mix with."""
    stop_after_config(monkeypatch)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True, mode=0o700)
    if left == "lineage only":
        (run_dir / "checkpoints" / "LINEAGE.json").write_text("{}\n")
    if left == "empty metrics":
        (run_dir / "metrics.jsonl").write_text("")
    main(["train", f"run_dir={run_dir}", "device=cpu"])
    assert (run_dir / "config.yaml").is_file()  # it went on past the run_dir check


@pytest.mark.parametrize("allow", ["resume=auto", "run_dir_reuse=true"])
def test_a_used_run_dir_is_taken_when_resuming_or_asked(tmp_path, capsys, monkeypatch, allow):
    stop_after_config(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    main(["train", f"run_dir={run_dir}", "device=cpu", allow])
    assert (run_dir / "config.yaml").is_file()  # it went on past the run_dir check


def check(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", *args, "check=true"])
    out, err = capsys.readouterr()
    return code, out, err


def gsm8k_args(model: Path, tmp_path: Path, train_file: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", "task.name=gsm8k", f"data.train_files=[{train_file}]", "task.eval_size=2",
            "model.max_positions=256", "rollout.max_new_tokens=64", "device=cpu", f"weights.shm_dir={tmp_path}",
            f"run_dir={tmp_path}/run", *extra]


def test_check_reports_the_data_files(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    code, out, err = check(capsys, *gsm8k_args(model, tmp_path, SAMPLE))
    assert code == 0, err
    assert "data.train_files: kept" in out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["data"]["train"]["read"] == 16


def test_check_refuses_a_missing_data_file_in_one_line(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    missing = tmp_path / "nope.jsonl"
    code, _, err = check(capsys, *gsm8k_args(model, tmp_path, missing))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and str(missing) in err and "no such file" in err


def test_check_refuses_bad_records_under_strict_in_one_line(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(SAMPLE.read_text() + "{not json\n")
    code, _, err = check(capsys, *gsm8k_args(model, tmp_path, bad, "data.strict=true"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "bad.jsonl:17" in err


def test_check_refuses_prompts_longer_than_the_context_naming_how_many_and_the_longest(tmp_path, tokenizer, capsys):
    model = model_dir(tmp_path / "m", "tiny-fullvocab", tokenizer)
    long = tmp_path / "long.jsonl"
    shutil.copy(SAMPLE, long)
    with long.open("a") as file:
        for words in (400, 300):
            file.write(json.dumps({"question": " ".join(["seven"] * words), "answer": "#### 7"}) + "\n")
    code, _, err = check(capsys, *gsm8k_args(model, tmp_path, long))
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "2 prompts" in err and "longest" in err and "model.max_positions=256" in err
