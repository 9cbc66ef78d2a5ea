"""`asyncgrpo make-model tiny-fullvocab DIR` through the real CLI: transformers and vLLM (CPU) load the
directory as it is, and vLLM's log-probs over the 151,936-token vocabulary equal transformers'."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Engine in this process: starts faster than a separate engine-core process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 1e-3
SHAPE = "tiny-fullvocab"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("made") / SHAPE
    result = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "make-model", SHAPE, str(directory), "--seed", "0"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["shape"] == SHAPE and summary["path"] == str(directory)
    assert summary["parameters"] == 19_776_896 and summary["tokenizer_size"] == 4_096
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    pytest.importorskip("vllm")
    from asyncgrpo.rollout.engine import VLLMEngine

    engine = VLLMEngine(str(model_dir), seed=0, max_model_len=256, dtype="float32", kv_cache_gib=0.25,
                        gpu_memory_utilization=0.3, max_running_seqs=256, prefix_caching=True)
    yield engine
    del engine
    gc.collect()


def test_the_directory_has_what_loaders_read(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == 151_936
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is True
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0] and generation["pad_token_id"] == 0
    assert not {"temperature", "top_p", "top_k", "repetition_penalty"} & set(generation)
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118 - safe_open is not a dict == {"F32"}


def test_transformers_loads_it(model_dir, reference, tokenizer):
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and len(tokenizer) == 4_096
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert reference.config.vocab_size == 151_936 and reference.dtype == torch.float32
    assert sum(p.numel() for p in reference.parameters()) == 19_776_896
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17+25?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_check_model_dir_with_vllms_registry(model_dir, tmp_path):
    from asyncgrpo.models.check import ModelDirError, check_model_dir

    info = check_model_dir(model_dir, 2_048)
    assert (info.architecture, info.num_parameters, info.tokenizer_size) == ("Qwen2ForCausalLM", 19_776_896, 4_096)
    assert info.largest_tensor_shape == (151_936, 128)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, foreign / name)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelDirError, match="vLLM cannot load architecture NoSuchModelForCausalLM") as err:
        check_model_dir(foreign, None)
    assert "\n" not in str(err.value)


def first_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1)


def test_vllm_generates_and_its_logprobs_equal_transformers(engine, reference, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17+25?"}],
                                           add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt).input_ids
    (completions,) = engine.generate([prompt_ids], n=4, max_tokens=6, temperature=1.0, seed=0)
    expected = first_token_logprobs(reference, prompt_ids)
    # Random weights: nearly uniform over 151,936 ids, but not flat, so a wrong model shows.
    assert expected.max() - expected.min() > 1.0
    for completion in completions:
        assert 1 <= len(completion.token_ids) <= 6
        first = int(completion.token_ids[0])
        assert abs(float(completion.logprobs[0]) - float(expected[first])) < LOGPROB_TOLERANCE
    sequences = [prompt_ids + [int(t) for t in c.token_ids] for c in completions]
    for sequence, got in zip(sequences, engine.sequence_logprobs(sequences, temperature=1.0), strict=True):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([sequence])).logits[0, :-1]
        want = logits.log_softmax(-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(got), want, atol=LOGPROB_TOLERANCE, rtol=0)


def test_vllm_tokenizes_and_detokenizes_with_the_directorys_tokenizer(engine, tokenizer):
    from vllm import SamplingParams

    text = "Tom buys 37 apples. <|im_start|>user\nHow many?<|im_end|>"
    (output,) = engine.llm.generate([text], SamplingParams(max_tokens=4, temperature=1.0, seed=0), use_tqdm=False)
    assert list(output.prompt_token_ids) == tokenizer(text).input_ids
    # Most sampled ids lie beyond the 4,096-token tokenizer (the embedding has 151,936 rows); they
    # decode to nothing rather than failing.
    assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
