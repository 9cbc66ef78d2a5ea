"""A byte-level BPE tokenizer in Qwen2's format, trained in seconds on a corpus generated here.

Nothing is downloaded: the corpus is GSM8K-style word problems and worked answers from templates,
arithmetic and countdown expressions, ChatML role lines and every printable ASCII character, drawn
from a seeded `random.Random`, so the same seed gives the same vocabulary and merges.

Why Qwen2's exact pipeline (NFC, Qwen's split regex, byte-level with no prefix space): for a model
directory whose config.json says model_type "qwen2", transformers 5 (and so vLLM, which loads
through AutoTokenizer) rebuilds the tokenizer as `Qwen2Tokenizer` from the saved vocabulary and
merges with that pipeline, whatever tokenizer.json says. Training with the same pipeline and saving
a `Qwen2Tokenizer` makes what is trained, what is saved and what every loader rebuilds one tokenizer.
The byte-level alphabet (all 256 bytes) is in the vocabulary, so any text encodes without an
unknown token and decodes back (up to Unicode NFC normalisation, as with Qwen's own tokenizer).
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Ids 0, 1, 2 in this order. eos is <|im_end|> (the end of a chat turn, as in Qwen2.5-Instruct);
# generation stops at either <|im_end|> or <|endoftext|>; padding is <|endoftext|>.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT

DEFAULT_VOCAB_SIZE = 4096
# 256 byte symbols + the special tokens: below this there would be no room for a single merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1

# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5's ChatML template, without tool calls: a default system turn when the messages have none.
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_NAMES = ("Tom", "Anna", "James", "Maria", "Liam", "Olivia", "Noah", "Emma", "Ava", "Lucas", "Mia", "Ethan",
          "Sofia", "Mason", "Chloe", "Jack", "Grace", "Leo", "Zoe", "Ben", "a baker", "a farmer", "the teacher",
          "the store", "a school", "the library", "her brother", "his sister")
_ITEMS = ("apples", "oranges", "muffins", "cookies", "books", "pencils", "marbles", "stickers", "eggs", "cupcakes",
          "tickets", "pages", "flowers", "cards", "boxes", "bottles", "candies", "shirts", "toys", "balloons",
          "chairs", "tables", "cars", "trees", "students", "dollars", "minutes", "hours", "miles", "points")
_PLACES = ("the market", "school", "the park", "the farm", "the bakery", "the zoo", "the office", "the garden")
_TIME = ("day", "week", "month", "hour", "morning", "afternoon", "year")
_VERBS = (("buys", "bought"), ("sells", "sold"), ("gives away", "gave away"), ("finds", "found"),
          ("makes", "made"), ("reads", "read"), ("collects", "collected"), ("eats", "ate"), ("plants", "planted"))
_QUESTIONS = ("How many {item} are left?", "How many {item} does {name} have now?", "What is the total?",
              "How many {item} in all?", "How much money is left, in dollars?", "What is the answer?",
              "How many more {item} does {name} need?", "How many {item} were there at the start?")
_FILLER = ("First, we find the total.", "Then we subtract what was used.", "So the answer is",
           "Let's think step by step.", "Each one costs", "The remaining amount is", "In total there are",
           "We know that", "This means", "Therefore,",
           "Please reason step by step, and put your final answer within \\boxed{}.", "Solve the problem.", "Answer with a number.", "The final answer is")
_ROLES = ("system", "user", "assistant")


def _word_problem(rng: random.Random) -> str:
    name, item, place = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_PLACES)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    present, past = rng.choice(_VERBS)
    name_cap = name[0].upper() + name[1:]
    question = rng.choice(_QUESTIONS).format(item=item, name=name)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    total = value * c
    price = rng.randint(1, 50) + rng.choice((0, 0.25, 0.5, 0.75))
    problem = (f"{name_cap} {present} {a} {item} at {place} every {rng.choice(_TIME)} and {b} more on the weekend. "
               f"Each costs ${price}. After {c} weeks, {question}")
    answer = (f"{name_cap} {past} {a} {op} {b} = <<{a}{op}{b}={value}>>{value} {item}.\n"
              f"{rng.choice(_FILLER)} {value} * {c} = <<{value}*{c}={total}>>{total}.\n#### {total}")
    return problem + "\n" + answer


def _arithmetic(rng: random.Random) -> str:
    digits = rng.randint(1, 4)
    a, b = rng.randint(0, 10**digits - 1), rng.randint(0, 10**digits - 1)
    op = rng.choice("+-*/")
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 2) if b else 0}[op]
    if rng.random() < 0.5:
        return f"{a}{op}{b}={value}"
    numbers = [rng.randint(1, 100) for _ in range(4)]
    return (f"Using the numbers {numbers}, create an equation that equals {rng.randint(1, 200)}. "
            f"<answer>({numbers[0]} + {numbers[1]}) * {numbers[2]} - {numbers[3]}</answer> \\boxed{{{value}}}")


def _chat_lines(rng: random.Random) -> str:
    return f"{rng.choice(_ROLES)}\n{rng.choice(_FILLER)}\n"


def corpus(seed: int, lines: int = 12_000) -> Iterator[str]:
    """The training text, one string per line; the same seed gives the same lines."""
    rng = random.Random(seed)
    printable = string.printable
    for index in range(lines):
        kind = index % 4
        if kind == 0:
            yield _word_problem(rng)
        elif kind == 1:
            yield _arithmetic(rng)
        elif kind == 2:
            yield _chat_lines(rng)
        else:  # printable ASCII in random order and groupings: punctuation runs, mixed case, code-ish text
            yield "".join(rng.choice(printable) for _ in range(rng.randint(8, 40)))


def _pipeline(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_backend(vocab_size: int = DEFAULT_VOCAB_SIZE, *, seed: int = 0) -> Tokenizer:
    """A `tokenizers.Tokenizer` of exactly `vocab_size` tokens (special tokens included) when the
    corpus has enough distinct pairs to merge, else fewer."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocabulary size {vocab_size} is below {MIN_VOCAB_SIZE} (256 bytes + special tokens + 1)")
    backend = _pipeline(Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(seed), trainer=trainer)
    return backend


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, *, seed: int = 0, model_max_length: int = 32_768):
    """A transformers `Qwen2Tokenizer` with the trained vocabulary and merges, the special tokens,
    eos/pad and the ChatML chat template; `save_pretrained` writes what AutoTokenizer and vLLM load."""
    import json

    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    model = json.loads(train_backend(vocab_size, seed=seed).to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]],
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer
