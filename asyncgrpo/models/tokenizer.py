"""Character-level tokenizer: one token per character, loadable by transformers and vLLM."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits and arithmetic for the built-in task, plus punctuation, whitespace and lowercase
# letters so later tasks (comparisons, word answers, multi-line prompts) reuse this vocab
# without changing the token ids of trained models.
CHARACTERS = string.digits + "+-*/%^=<>()[].,:;?!_ \n" + string.ascii_lowercase

# Why byte-level: for a config.json with model_type "qwen2", transformers 5 (and so vLLM,
# which loads through AutoTokenizer) ignores tokenizer_class in tokenizer_config.json and
# rebuilds the tokenizer as Qwen2Tokenizer, which keeps vocab and merges but forces a
# ByteLevel pre-tokenizer and decoder. Storing each character in its byte-level spelling
# ("Ġ" for space, "Ċ" for newline; printable ASCII spells itself) makes that rebuilt
# tokenizer produce the same ids and text as the one built here.
_WHITESPACE_BYTE_LEVEL_SPELLING = {" ": "Ġ", "\n": "Ċ", "\t": "ĉ"}


def _byte_level_spelling(character: str) -> str:
    if character in _WHITESPACE_BYTE_LEVEL_SPELLING:
        return _WHITESPACE_BYTE_LEVEL_SPELLING[character]
    if 0x21 <= ord(character) <= 0x7E:
        return character
    raise ValueError(f"only printable ASCII and space/newline/tab are supported, got {character!r}")


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """Special tokens take ids 0.. in SPECIAL_TOKENS order, then one id per character.

    A BPE model with no merges splits text into single characters; characters outside
    the vocab become ``<unk>`` here (the Qwen2Tokenizer rebuild drops them instead).
    """
    if len(set(characters)) != len(characters):
        raise ValueError("characters must be distinct")
    spellings = [_byte_level_spelling(c) for c in characters]
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *spellings))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
