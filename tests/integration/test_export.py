"""The policy exported in Hugging Face format loads with transformers and scores like the learner.

Both ways: from the running learner (end of a run) and from a checkpoint on disk via the CLI.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from learner_fixtures import fixed_groups, make_model_dir, step_groups

from asyncgrpo.config import load
from asyncgrpo.learner.batch import collate, completion_logprobs
from asyncgrpo.learner.learner import Learner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def transformers_logprobs(directory, sequences):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    assert AutoTokenizer.from_pretrained(directory).pad_token_id is not None
    result = []
    with torch.no_grad():
        for sequence in sequences:
            ids = torch.tensor([sequence])
            positions = torch.arange(len(sequence) - 1).unsqueeze(0)
            result.append(completion_logprobs(model(input_ids=ids).logits, positions, ids[:, 1:], 1.0)[0].numpy())
    return result


def test_export_loads_with_transformers_and_matches_the_learner(model_dir, tmp_path):
    learner = Learner.from_config(load(["learner.warmup_steps=0", "learner.lr=1e-2"]), model_dir)
    try:
        for groups in step_groups(2):
            learner.train_on(groups)
        batch = collate(fixed_groups(num_groups=2, samples=2, seed=7), learner.pad_id)
        sequences = [row[mask.bool()].tolist() for row, mask in zip(batch.input_ids, batch.attention_mask)]
        expected = learner.sequence_logprobs(sequences)
        from_learner = learner.export_hf(tmp_path / "export")
        checkpoint = learner.save_checkpoint(tmp_path / "checkpoints")
    finally:
        learner.close()

    result = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "export", str(tmp_path), str(tmp_path / "cli")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("cli")

    start = transformers_logprobs(model_dir, sequences)
    for directory in (from_learner, tmp_path / "cli"):
        files = {p.name for p in Path(directory).iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files, files
        assert json.loads((Path(directory) / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
        got = transformers_logprobs(directory, sequences)
        worst = max(float(abs(g - e).max()) for g, e in zip(got, expected))
        moved = max(float(abs(g - s).max()) for g, s in zip(got, start))
        print(f"{directory}: max |log-prob difference| vs learner {worst:.2e}; moved from start by {moved:.2e}")
        assert worst < 1e-5
        assert moved > 1e-3  # the trained weights, not the starting ones
    assert checkpoint.endswith("step_2")
