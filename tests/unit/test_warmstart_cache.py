"""The warm start's cache: a model stopped by max_seconds before its target never stands in for a
complete one (tests and tools that cap the warm start at a few seconds share the user's cache)."""

import json
from pathlib import Path

import pytest

import asyncgrpo.models.warmstart as warmstart
from asyncgrpo.models.tiny import TinyModelSpec
from asyncgrpo.schema import ModelConfig
from asyncgrpo.tasks import ArithmeticTask

SIZES = {key: getattr(ModelConfig(), key) for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                      "intermediate_size", "max_positions")}


@pytest.fixture
def trainings(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replaces the training with one that reaches the target iff max_seconds >= 10; records calls."""
    calls: list[dict] = []

    def fake_train_and_save(directory, model_spec, task, seed, target_accuracy, max_seconds, log):
        record = {"reached_target": max_seconds >= 10, "seed": seed, "max_seconds": max_seconds,
                  "expected_sampled_accuracy": 0.1, "sampled_accuracy": 0.1, "greedy_accuracy": 0.1,
                  "steps": 1, "seconds": 1.0}
        (directory / warmstart.WARMSTART_RECORD).write_text(json.dumps(record))
        calls.append(record)
        return record

    monkeypatch.setattr(warmstart, "_train_and_save", fake_train_and_save)
    return calls


def warm(cache: Path, max_seconds: float, seed: int = 0) -> Path:
    return warmstart.ensure_warm_model(cache, model_kwargs=SIZES, task=ArithmeticTask(num_digits=2, eval_size=500),
                                       seed=seed, target_accuracy=0.12, max_seconds=max_seconds, log=lambda _: None)


def test_partial_warm_start_is_not_reused_by_a_run_with_a_longer_budget(tmp_path: Path, trainings: list) -> None:
    partial = warm(tmp_path, max_seconds=5)
    complete = warm(tmp_path, max_seconds=180)
    assert partial != complete
    assert [c["max_seconds"] for c in trainings] == [5, 180], "the partial model was reused for max_seconds=180"
    assert json.loads((complete / warmstart.WARMSTART_RECORD).read_text())["reached_target"] is True


def test_complete_warm_start_serves_every_budget_without_training_again(tmp_path: Path, trainings: list) -> None:
    complete = warm(tmp_path, max_seconds=180)
    assert warm(tmp_path, max_seconds=5) == complete
    assert warm(tmp_path, max_seconds=60) == complete
    assert len(trainings) == 1


def test_partial_warm_start_is_reused_only_with_the_same_budget(tmp_path: Path, trainings: list) -> None:
    first = warm(tmp_path, max_seconds=5)
    assert warm(tmp_path, max_seconds=5) == first
    assert warm(tmp_path, max_seconds=6) != first
    assert [c["max_seconds"] for c in trainings] == [5, 6]
    key = warmstart.warm_model_cache_key(TinyModelSpec(**SIZES), ArithmeticTask(num_digits=2, eval_size=500), 0, 0.12)
    assert first.name == warmstart.partial_entry_name(key, 5)
    assert not (tmp_path / f"tiny-qwen2-{key}").exists(), "a partial model took the complete entry's name"


def test_entry_without_reached_target_is_not_taken_as_complete(tmp_path: Path, trainings: list) -> None:
    key = warmstart.warm_model_cache_key(TinyModelSpec(**SIZES), ArithmeticTask(num_digits=2, eval_size=500), 0, 0.12)
    poisoned = tmp_path / f"tiny-qwen2-{key}"
    poisoned.mkdir()
    (poisoned / warmstart.WARMSTART_RECORD).write_text(json.dumps({"reached_target": False}))
    warm(tmp_path, max_seconds=5)
    assert len(trainings) == 1
