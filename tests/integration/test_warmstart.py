import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.models.tiny import TinyModelSpec
from asyncgrpo.models.warmstart import (
    ensure_warm_model,
    expected_sampled_accuracy,
    measure_accuracy,
    warm_model_cache_key,
)
from asyncgrpo.schema import ModelConfig
from asyncgrpo.tasks import ArithmeticTask

# The embedded model's sizes, as the config gives them to the warm start.
SIZES = {key: getattr(ModelConfig(), key) for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                                      "intermediate_size", "max_positions")}

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "warmstart.json",
}


def test_cache_key_depends_on_every_input() -> None:
    spec, task = TinyModelSpec.from_config(ModelConfig()), ArithmeticTask(num_digits=2, eval_size=500)
    key = warm_model_cache_key(spec, task, seed=0, target_accuracy=0.12)
    assert key == warm_model_cache_key(
        TinyModelSpec.from_config(ModelConfig()), ArithmeticTask(num_digits=2, eval_size=500), seed=0, target_accuracy=0.12
    )
    assert key != warm_model_cache_key(spec, task, seed=1, target_accuracy=0.12)
    assert key != warm_model_cache_key(spec, task, seed=0, target_accuracy=0.2)
    assert key != warm_model_cache_key(
        TinyModelSpec(**{**SIZES, "num_layers": 3}), task, seed=0, target_accuracy=0.12
    )
    assert key != warm_model_cache_key(
        spec, ArithmeticTask(num_digits=2, eval_size=500, split_seed=1), seed=0, target_accuracy=0.12
    )


@pytest.mark.slow
def test_warm_start_reaches_low_target_saves_and_hits_cache(tmp_path: Path) -> None:
    task = ArithmeticTask(num_digits=2, eval_size=500)
    logs: list[str] = []
    kwargs = dict(
        model_kwargs=SIZES, task=task, seed=0, target_accuracy=0.03, max_seconds=120, log=logs.append
    )

    model_dir = ensure_warm_model(tmp_path, **kwargs)

    assert {p.name for p in model_dir.iterdir()} >= EXPECTED_FILES
    assert [p.name for p in tmp_path.iterdir()] == [model_dir.name], "no staging dirs left behind"
    record = json.loads((model_dir / "warmstart.json").read_text())
    assert record["reached_target"] is True
    assert record["seed"] == 0 and record["steps"] > 0 and record["seconds"] > 0
    assert 0.03 <= record["expected_sampled_accuracy"] < 0.5
    assert 0.0 <= record["sampled_accuracy"] < 0.5
    assert 0.0 <= record["greedy_accuracy"] <= 1.0

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    eval_problems = task.eval_problems()
    assert expected_sampled_accuracy(model, tokenizer, eval_problems) == pytest.approx(
        record["expected_sampled_accuracy"], abs=1e-6
    )
    assert (
        measure_accuracy(model, tokenizer, task, eval_problems, greedy=True)
        == record["greedy_accuracy"]
    )

    logs.clear()
    assert ensure_warm_model(tmp_path, **kwargs) == model_dir
    assert logs == []  # taken from the cache: nothing trained or measured again


@pytest.mark.slow
def test_missed_target_is_saved_with_a_warning(tmp_path: Path) -> None:
    logs: list[str] = []
    model_dir = ensure_warm_model(
        tmp_path,
        model_kwargs={**SIZES, "num_layers": 1},
        task=ArithmeticTask(num_digits=2, eval_size=500),
        seed=0,
        target_accuracy=1.0,
        max_seconds=1.0,
        log=logs.append,
    )
    record = json.loads((model_dir / "warmstart.json").read_text())
    assert record["reached_target"] is False
    assert model_dir.name.endswith("-partial-1s"), "a partial warm start must not take the complete entry's name"
    assert (model_dir / "model.safetensors").is_file()
    assert any(line.startswith("WARNING") for line in logs)
