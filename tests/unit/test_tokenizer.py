import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncgrpo.models.tiny import TinyModelSpec, build_model, save_model
from asyncgrpo.models.tokenizer import (
    CHARACTERS,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    build_char_tokenizer,
)
from asyncgrpo.schema import ModelConfig

SAMPLE_TEXT = "37+48=85\n(9*7) - 2 = ab?"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_one_token_per_character(tokenizer) -> None:
    ids = tokenizer(SAMPLE_TEXT, add_special_tokens=False).input_ids
    assert len(ids) == len(SAMPLE_TEXT)
    assert tokenizer("37+48=").input_ids == [tokenizer.convert_tokens_to_ids(c) for c in "37+48="]


def test_vocab_is_specials_then_characters(tokenizer) -> None:
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS)
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 1
    assert tokenizer.bos_token_id is None


def test_decode_concatenates_characters_without_spaces(tokenizer) -> None:
    ids = tokenizer(SAMPLE_TEXT).input_ids
    assert tokenizer.decode(ids) == SAMPLE_TEXT
    with_eos = [*tokenizer("85").input_ids, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == "85"
    assert tokenizer.decode(with_eos) == "85<eos><pad>"


def test_no_special_tokens_are_added_to_prompts(tokenizer) -> None:
    assert (
        tokenizer("1+1=", add_special_tokens=True).input_ids
        == tokenizer("1+1=", add_special_tokens=False).input_ids
    )


def test_unknown_character_maps_to_unk(tokenizer) -> None:
    assert tokenizer("Z", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_rejects_non_ascii_characters() -> None:
    with pytest.raises(ValueError):
        build_char_tokenizer("0123é")


def test_auto_tokenizer_in_model_dir_matches(tokenizer, tmp_path: Path) -> None:
    # Next to a qwen2 config.json, transformers rebuilds the tokenizer as Qwen2Tokenizer;
    # ids and decoded text must not change.
    spec = dataclasses.replace(TinyModelSpec.from_config(ModelConfig()), num_layers=1, intermediate_size=32)
    model = build_model(spec, tokenizer, seed=0)
    save_model(model, tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(SAMPLE_TEXT).input_ids
    assert loaded(SAMPLE_TEXT).input_ids == ids
    assert loaded.decode(ids) == SAMPLE_TEXT
    assert loaded.convert_ids_to_tokens(ids) == tokenizer.convert_ids_to_tokens(ids)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert len(loaded) == len(tokenizer)
