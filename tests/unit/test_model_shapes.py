"""Named model shapes, the locally trained BPE tokenizer, and the model-directory checks (no vLLM here:
the check against vLLM's registry is in tests/integration/test_make_model.py)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
import torch

from asyncgrpo import cli
from asyncgrpo.models import bpe
from asyncgrpo.models.check import ModelDirError, check_model_dir
from asyncgrpo.models.shapes import (
    SHAPES,
    ModelShape,
    get_shape,
    make_model,
    meta_model,
    qwen2_config,
    shape_parameter_count,
)


def analytic_parameters(shape: ModelShape) -> int:
    """Qwen2: q/k/v projections with bias, o_proj and the SwiGLU MLP without, two RMSNorms per layer, a
    final norm, the embedding (and a separate lm_head when not tied)."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    layer = attention + 3 * h * shape.intermediate_size + 2 * h
    head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    return shape.vocab_size * h + shape.num_layers * layer + h + head


# ---- the shape table -------------------------------------------------------------------------

def test_qwen25_05b_is_the_real_shape():
    shape = SHAPES["qwen2.5-0.5b"]
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
            shape.intermediate_size, shape.max_positions) == (151_936, 896, 24, 14, 2, 4_864, 32_768)
    assert shape.tie_word_embeddings and shape.rope_theta == 1e6 and shape.rms_norm_eps == 1e-6
    assert shape.head_dim == 64


def test_two_layer_shape_keeps_widths_and_vocabulary():
    full, two = SHAPES["qwen2.5-0.5b"], SHAPES["qwen2.5-0.5b-2l"]
    assert two.num_layers == 2
    assert {k: v for k, v in two.to_dict().items() if k not in ("name", "description", "num_layers")} == \
        {k: v for k, v in full.to_dict().items() if k not in ("name", "description", "num_layers")}


def test_tiny_fullvocab_has_the_full_vocabulary_and_a_head_dim_vllm_cpu_accepts():
    shape = SHAPES["tiny-fullvocab"]
    assert shape.vocab_size == 151_936
    assert shape.head_dim >= 32 and shape.num_layers == 2 and shape.max_positions == 2_048
    assert shape.vocab_size >= bpe.DEFAULT_VOCAB_SIZE


def test_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny-fullvocab"):
        get_shape("qwen9")


def test_the_config_carries_the_shape():
    config = qwen2_config(SHAPES["qwen2.5-0.5b"], eos_token_id=2)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.max_position_embeddings) == \
        (151_936, 896, 24, 14, 2, 4_864, 32_768)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 1e6
    assert config.eos_token_id == 2 and config.pad_token_id is None


# ---- parameter counts, on the meta device -----------------------------------------------------

@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_on_meta_matches_the_formula(name):
    assert shape_parameter_count(SHAPES[name]) == analytic_parameters(SHAPES[name])


def test_qwen25_05b_has_494m_parameters_counted_without_allocating():
    model = meta_model(qwen2_config(SHAPES["qwen2.5-0.5b"]))
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - 494_000_000) <= 0.01 * 494_000_000
    assert count == 494_032_768
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: counted once


# ---- the tokenizer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tok")
    bpe.train_tokenizer(seed=0, model_max_length=2048).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_tokenizer_size_and_special_tokens(tokenizer):
    assert len(tokenizer) == bpe.DEFAULT_VOCAB_SIZE
    ids = tokenizer.convert_tokens_to_ids(list(bpe.SPECIAL_TOKENS))
    assert ids == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    # Special tokens in text are single ids, never split by BPE.
    assert tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids[0] == 1
    assert tokenizer("<|im_start|>user\nhi<|im_end|>").input_ids[-1] == 2
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


@pytest.mark.parametrize("text", [
    "Tom buys 37 apples at the market. How many apples are left?\n#### 42",
    "  leading and trailing  spaces\t\ttabs\r\nwindows line",
    "".join(chr(c) for c in range(32, 127)),
    "ünïcödé, 中文, emoji 🙂 and a zero-width\u200bjoiner",
    "\\boxed{3/4} <answer>(1 + 2) * 3</answer> x**2 >= 10",
])
def test_any_text_round_trips(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert max(ids) < len(tokenizer)


def test_the_bpe_merged_something(tokenizer):
    text = "How many apples are left? The answer is"
    assert len(tokenizer(text).input_ids) < len(text.encode()) / 2.5


def test_chat_template_renders_chatml(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tokenize=False)
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_the_split_is_qwen2s_own():
    # transformers rebuilds a qwen2 directory's tokenizer with this regex; training with another
    # would make the loaded tokenizer differ from the trained one.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert bpe.QWEN2_SPLIT_REGEX == PRETOKENIZE_REGEX


def test_training_is_deterministic_for_a_seed():
    assert bpe.train_backend(1000, seed=3).to_str() == bpe.train_backend(1000, seed=3).to_str()
    assert bpe.train_backend(1000, seed=3).to_str() != bpe.train_backend(1000, seed=4).to_str()
    assert bpe.train_backend(1000, seed=3).get_vocab_size() == 1000


def test_vocabulary_below_the_byte_alphabet_is_refused():
    with pytest.raises(ValueError, match="below"):
        bpe.train_backend(bpe.MIN_VOCAB_SIZE - 1)


# ---- make-model's bad input (the real run is tests/integration/test_make_model.py) ------------

def test_an_unknown_shape_is_one_line_listing_the_table(tmp_path, capsys):
    assert cli.main(["make-model", "qwen9", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(name in err for name in SHAPES)
    assert not (tmp_path / "m").exists()


def test_cli_default_vocabulary_is_documented_with_its_value(capsys):
    with pytest.raises(SystemExit):
        cli.main(["make-model", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"= {bpe.DEFAULT_VOCAB_SIZE}" in text
    assert all(name in text for name in SHAPES)


def test_non_empty_out_dir_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_model("tiny-fullvocab", tmp_path)
    assert cli.main(["make-model", "tiny-fullvocab", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncgrpo: make-model: ") and err.count("\n") == 1 and "not an empty directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("argv, message", [
    (["make-model", "qwen9", "X"], "unknown shape 'qwen9'"),
    (["make-model", "tiny-fullvocab", "X", "--vocab-train-size", "100"], "below"),
    (["make-model", "tiny-fullvocab", "X", "--vocab-train-size", "200000"], "exceeds"),
])
def test_bad_make_model_arguments_exit_2_in_one_line(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / "out") if a == "X" else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ---- model-directory checks on small fake directories -----------------------------------------

FAKE = ModelShape(name="fake", description="", vocab_size=8_192, hidden_size=64, num_layers=1, num_heads=2,
                  num_kv_heads=1, intermediate_size=128, max_positions=512)
QWEN2 = {"Qwen2ForCausalLM"}


def fake_dir(root: Path, tokenizer_dir: Path | None, **overrides) -> Path:
    """config.json of the FAKE shape (with overrides) and, unless None, the tokenizer's files."""
    import dataclasses

    directory = root / "model"
    directory.mkdir()
    config = qwen2_config(dataclasses.replace(FAKE, **overrides), eos_token_id=2)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(directory)
    if tokenizer_dir is not None:
        for file in tokenizer_dir.iterdir():
            (directory / file.name).write_bytes(file.read_bytes())
    return directory


def one_line_error(directory, needed=None, supported=QWEN2) -> str:
    with pytest.raises(ModelDirError) as err:
        check_model_dir(directory, needed, supported_architectures=supported)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model directory {directory}")
    return message


def test_a_good_directory_is_described_without_loading_weights(tmp_path, tokenizer_dir):
    info = check_model_dir(fake_dir(tmp_path, tokenizer_dir), 512, supported_architectures=QWEN2)
    assert (info.vocab_size, info.tokenizer_size, info.hidden_size, info.num_layers, info.max_positions) == \
        (8_192, 4_096, 64, 1, 512)
    assert info.num_parameters == analytic_parameters(FAKE)
    assert info.largest_tensor == "model.embed_tokens.weight" and info.largest_tensor_shape == (8_192, 64)
    assert info.largest_tensor_bytes == 8_192 * 64 * 4
    assert info.dtype == "float32" and info.tie_word_embeddings and info.architecture == "Qwen2ForCausalLM"
    assert json.dumps(info.to_dict())


def test_largest_tensor_of_the_real_shape(tmp_path, tokenizer_dir):
    shape = SHAPES["qwen2.5-0.5b"]
    directory = fake_dir(tmp_path, tokenizer_dir, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                         intermediate_size=shape.intermediate_size, max_positions=shape.max_positions)
    info = check_model_dir(directory, None, supported_architectures=QWEN2)
    assert info.num_parameters == 494_032_768
    assert info.largest_tensor_shape == (151_936, 896) and info.largest_tensor_bytes == 544_538_624


def test_no_tokenizer(tmp_path):
    assert "no tokenizer" in one_line_error(fake_dir(tmp_path, None))


def test_a_tokenizer_that_does_not_load(tmp_path, tokenizer_dir):
    directory = fake_dir(tmp_path, tokenizer_dir)
    (directory / "tokenizer.json").write_text("{not json")
    assert "tokenizer does not load" in one_line_error(directory)


def test_tokenizer_larger_than_the_embedding(tmp_path, tokenizer_dir):
    message = one_line_error(fake_dir(tmp_path, tokenizer_dir, vocab_size=1_000))
    assert "4096 tokens" in message and "1000 rows" in message


def test_context_shorter_than_needed(tmp_path, tokenizer_dir):
    directory = fake_dir(tmp_path, tokenizer_dir, max_positions=512)
    message = one_line_error(directory, needed=513)
    assert "512 positions" in message and "513 needed" in message
    assert check_model_dir(directory, 512, supported_architectures=QWEN2).max_positions == 512
    assert check_model_dir(directory, None, supported_architectures=QWEN2).max_positions == 512


def test_architecture_vllm_cannot_load(tmp_path, tokenizer_dir):
    assert "vLLM cannot load architecture Qwen2ForCausalLM" in one_line_error(
        fake_dir(tmp_path, tokenizer_dir), supported={"LlamaForCausalLM"})


def test_config_without_architectures(tmp_path, tokenizer_dir):
    directory = fake_dir(tmp_path, tokenizer_dir)
    config = json.loads((directory / "config.json").read_text())
    del config["architectures"]
    (directory / "config.json").write_text(json.dumps(config))
    assert "names no architectures" in one_line_error(directory)


def test_missing_directory_missing_or_broken_config(tmp_path, tokenizer_dir):
    assert "not a directory" in one_line_error(tmp_path / "nowhere")
    directory = fake_dir(tmp_path, tokenizer_dir)
    (directory / "config.json").write_text("{")
    assert "config.json does not load" in one_line_error(directory)
    (directory / "config.json").unlink()
    assert "no config.json" in one_line_error(directory)


def test_model_dir_error_is_a_value_error():
    assert issubclass(ModelDirError, ValueError)


def test_meta_builds_leave_no_real_tensors():
    # The whole point of counting on meta: nothing of the model's size is allocated.
    model = meta_model(qwen2_config(SHAPES["qwen2.5-0.5b-2l"]))
    assert all(t.device == torch.device("meta") for t in model.state_dict().values())
