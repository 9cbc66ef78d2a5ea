"""A task whose prompts and reference answers come from local JSONL/Parquet files (data.*).

The reference answer is the answer field as text; the task's own check is exact match of the
stripped completion. Subclasses (gsm8k) parse the answer field and check differently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncgrpo.data import (
    DataError,
    DataReport,
    FieldMap,
    PromptFormat,
    epoch_stream,
    load_problems,
    split_holdout,
)
from asyncgrpo.rewards import verifiers
from asyncgrpo.schema import DataConfig
from asyncgrpo.tasks.problem import Problem

# Without data.eval_files, at most this share of the training records is held out for evaluation.
MAX_HOLDOUT_SHARE = 0.2


class FileTask:
    name = "files"
    answer_format = r"\S"

    def __init__(self, data: DataConfig, *, eval_size: int, tokenizer: Any | None = None,
                 context_tokens: int = 0, split_seed: int = 0) -> None:
        """Loads and checks every file now, so bad data fails (or is counted) before anything starts.

        `tokenizer` counts prompt tokens for the length filter and applies the chat template;
        without one, prompts are not length-filtered. `context_tokens` is the prompt budget
        within the model's context (model.max_positions - rollout.max_new_tokens). `eval_size` is
        task.eval_size (no default here: config's is the only one).
        """
        self.data = data
        self.split_seed = split_seed
        fields = FieldMap(prompt=data.prompt_field, answer=data.answer_field)
        prompt_format = PromptFormat(template=data.prompt_template, chat_template=data.chat_template,
                                     system_prompt=data.system_prompt)
        common = dict(fields=fields, prompt_format=prompt_format, tokenizer=tokenizer, context_tokens=context_tokens,
                      max_prompt_tokens=data.max_prompt_tokens, parse_answer=self.parse_answer)
        self.train_report = DataReport("data.train_files", strict=data.strict)
        train = load_problems(data.train_files, report=self.train_report, **common)
        self.eval_report: DataReport | None = None
        if data.eval_files:
            self.eval_report = DataReport("data.eval_files", strict=data.strict)
            held_out = load_problems(data.eval_files, report=self.eval_report, first_id=self.train_report.read, **common)
            if not held_out:
                raise DataError(f"no usable record in data.eval_files: {self.eval_report.describe()}")
            if len(held_out) > eval_size:  # a fixed subset keeps start/end evaluation affordable
                held_out = split_holdout(held_out, eval_size, seed=split_seed)[1]
        else:
            size = min(eval_size, int(len(train) * MAX_HOLDOUT_SHARE))
            if size < 1 and len(train) >= 2:
                size = 1
            train, held_out = split_holdout(train, size, seed=split_seed) if size >= 1 else (train, [])
        if not train:
            raise DataError(f"no usable training record: {self.train_report.describe()}" + self._length_hint(context_tokens))
        self._train = train
        self._eval = held_out

    @staticmethod
    def _length_hint(context_tokens: int) -> str:
        return (f" (prompts may have at most {context_tokens} tokens: raise model.max_positions or lower "
                "rollout.max_new_tokens)") if context_tokens else ""

    # Subclasses turn the answer field into the reference answer; None marks the record bad.
    def parse_answer(self, raw: str) -> str | None:
        text = raw.strip()
        return text or None

    def score(self, completion_text: str, problem: Problem) -> float:
        return verifiers.exact_match(completion_text, problem.answer)

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Seeded shuffle per epoch; data.epochs passes (0 = endless), then the stream ends."""
        return epoch_stream(self._train, seed=seed, epochs=self.data.epochs, shuffle=self.data.shuffle)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    @property
    def num_train_problems(self) -> int:
        return len(self._train)

    @property
    def max_answer_chars(self) -> int:
        return max((len(p.answer) for p in [*self._train, *self._eval]), default=1)

    def report(self) -> dict[str, Any]:
        out = {"train": self.train_report.as_dict(), "train_problems": len(self._train), "eval_problems": len(self._eval)}
        if self.eval_report is not None:
            out["eval"] = self.eval_report.as_dict()
        return out

    def describe(self) -> str:
        lines = [self.train_report.describe()]
        if self.eval_report is not None:
            lines.append(self.eval_report.describe())
        else:
            lines.append(f"eval: {len(self._eval)} problems held out of data.train_files (no data.eval_files)")
        return "; ".join(lines)

    def settings(self) -> dict[str, Any]:
        """Everything that determines the problems (a cache key for the warm start): fields, templates, file contents."""
        digest = hashlib.sha256()
        for path in [*self.data.train_files, "--eval--", *self.data.eval_files]:
            if path == "--eval--":
                digest.update(b"--eval--")
                continue
            with Path(path).expanduser().open("rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
        return {"task": self.name, "files_sha256": digest.hexdigest()[:16], "prompt_field": self.data.prompt_field,
                "answer_field": self.data.answer_field, "prompt_template": self.data.prompt_template,
                "chat_template": self.data.chat_template, "max_prompt_tokens": self.data.max_prompt_tokens,
                "eval_problems": len(self._eval), "split_seed": self.split_seed}
