"""tools/probe_vllm_lora.py's pure parts, without vLLM: the random PEFT adapter fits the tiny model's
layers, merging it is LoRA's forward, the transformers references it compares vLLM with, and the
ratio arithmetic."""

from __future__ import annotations

import json

import pytest
import torch
from tools import probe_vllm_lora as probe

from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.schema import ModelConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded default model, saved: (directory, config.json, state dict)."""
    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    model = build_model(TinyModelSpec.from_config(ModelConfig()), tokenizer, seed=0)
    save_model(model, tokenizer, directory)
    return directory, json.loads((directory / "config.json").read_text()), model.state_dict()


def test_random_adapter_has_a_and_b_of_every_linear_layer_shaped_to_its_weight(tiny):
    _, config, state = tiny
    adapter = probe.random_adapter(config, 8, seed=0, b_scale=0.05)
    targeted = {probe.base_weight_name(name) for name in adapter}
    linear = {name for name in state if name.endswith(tuple(f".{m}.weight" for m in probe.TARGETS))}
    assert targeted == linear and len(linear) == 7 * config["num_hidden_layers"]
    for name, tensor in adapter.items():
        out_features, in_features = state[probe.base_weight_name(name)].shape
        assert tensor.shape == ((8, in_features) if ".lora_A." in name else (out_features, 8)), name
        assert name.startswith("base_model.model.model.layers.")  # PEFT's names, as vLLM reads them


def test_merged_weight_computes_what_the_lora_forward_computes(tiny):
    _, config, state = tiny
    rank, alpha = 8, 16.0
    adapter = probe.random_adapter(config, rank, seed=1, b_scale=0.05)
    merged = probe.merged_weights(state, adapter, rank, alpha)
    assert set(merged) == {probe.base_weight_name(name) for name in adapter}
    x = torch.randn(5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    stem = "base_model.model.model.layers.1.self_attn.q_proj"
    lora_a, lora_b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
    weight = state["model.layers.1.self_attn.q_proj.weight"]
    # PEFT's LoRA forward: base(x) + lora_B(lora_A(x)) * alpha / r
    expected = x @ weight.T + (alpha / rank) * ((x @ lora_a.T) @ lora_b.T)
    torch.testing.assert_close(x @ merged["model.layers.1.self_attn.q_proj.weight"].T, expected)
    assert not torch.allclose(expected, x @ weight.T, atol=1e-3)  # the adapter changes the layer


def test_written_adapter_directory_holds_peft_config_and_the_tensors(tiny, tmp_path):
    from safetensors.torch import load_file

    _, config, _ = tiny
    adapter = probe.random_adapter(config, 16, seed=2, b_scale=0.05)
    directory = probe.write_adapter(tmp_path / "adapter", adapter, probe.adapter_config(16, 32.0, "base"))
    saved = json.loads((directory / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["bias"]) == (16, 32.0, "none")
    assert set(saved["target_modules"]) == set(probe.TARGETS)
    loaded = load_file(directory / "adapter_model.safetensors")
    assert loaded.keys() == adapter.keys() and all(torch.equal(loaded[k], adapter[k]) for k in adapter)


def test_base_weight_name_refuses_names_that_are_not_lora_weights():
    assert probe.base_weight_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    for bad in ("model.layers.0.mlp.up_proj.weight", "base_model.model.model.layers.0.mlp.up_proj.weight"):
        with pytest.raises(ValueError):
            probe.base_weight_name(bad)


def test_switched_reference_follows_the_first_weights_then_the_second_at_the_split(tiny):
    directory, config, state = tiny
    sequence = [3, 9, 4, 17, 5, 22, 8, 11]
    adapter = probe.random_adapter(config, 8, seed=3, b_scale=0.05)
    merged = probe.merged_weights(state, adapter, 8, 16.0)
    plain, = probe.hf_logprobs(directory, {}, [sequence])
    changed, = probe.hf_logprobs(directory, merged, [sequence])
    same = probe.hf_switched_logprobs(directory, {}, {}, sequence, 5)
    torch.testing.assert_close(torch.from_numpy(same), torch.from_numpy(plain), atol=1e-5, rtol=0)
    switched = probe.hf_switched_logprobs(directory, {}, merged, sequence, 5)
    # Log-probs of tokens 1..4 come from positions 0..3, all before the split: the first weights.
    torch.testing.assert_close(torch.from_numpy(switched[:4]), torch.from_numpy(plain[:4]), atol=1e-5, rtol=0)
    # Later ones mix both (new weights over cached old keys/values): neither model's alone.
    assert abs(switched[-1] - plain[-1]) > 1e-3 and abs(switched[-1] - changed[-1]) > 1e-4


def test_ratios_pair_values_of_the_same_repetition():
    assert probe.paired_ratios([2.0, 3.0, 8.0], [1.0, 3.0, 4.0]) == {"median": 2.0, "min": 1.0, "max": 2.0}
    with pytest.raises(ValueError, match="as many"):
        probe.paired_ratios([1.0], [1.0, 2.0])
    assert probe.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


@pytest.mark.parametrize(("argv", "says"), [
    *(([option, "0"], f"argument {option}: wants an integer >= 1, got '0'")
      for option in ("--versions", "--prompts", "--repeats", "--sequences", "--max-tokens")),
    *((["--b-scale", bad], f"argument --b-scale: wants a finite number > 0, got '{bad}'") for bad in ("nan", "inf")),
    (["--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras must be at least --max-loras"),
    (["--sizes", "tiny,tiny"], "argument --sizes: tiny given twice"),
    (["--sizes", "huge"], "argument --sizes: unknown huge"),
])
def test_bad_arguments_are_refused_by_its_parse(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        probe.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and says in err.strip().splitlines()[-1]


def test_the_defaults_parse_to_one_tiny_size():
    args = probe.parse_args([])
    assert (args.sizes, args.versions, args.b_scale) == (["tiny"], 6, 0.05)
