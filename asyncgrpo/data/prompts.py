"""Turning file records into Problems: field mapping, prompt template, chat template, length filter.

Then `epoch_stream` serves them: a seeded shuffle per epoch, a fixed number of passes (or endless).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from asyncgrpo.data.records import DataError, DataReport, iter_records
from asyncgrpo.tasks.problem import Problem

T = TypeVar("T")
# Answer parsers return None for a reference answer they cannot use (counted as bad_answer).
AnswerParser = Callable[[str], "str | None"]


@dataclass(frozen=True, kw_only=True)
class PromptFormat:
    """How a record's prompt field becomes the text the model sees: data.prompt_template,
    data.chat_template and data.system_prompt (no defaults here: config's are the only ones)."""

    template: str
    chat_template: bool
    system_prompt: str

    def render(self, raw_prompt: str, tokenizer: Any | None) -> str:
        text = self.template.replace("{prompt}", raw_prompt)
        if not self.chat_template:
            return text
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise DataError("data.chat_template=true but the tokenizer has no chat template (use a chat/instruct model)")
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": text}]
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - a broken template raises whatever jinja makes of it
            raise DataError(f"data.chat_template=true but the model's chat template does not render: "
                            f"{type(err).__name__}: {' '.join(str(err).split())[:200]}") from None


@dataclass(frozen=True, kw_only=True)
class FieldMap:
    """Which record fields hold the prompt and the answer: data.prompt_field and data.answer_field."""

    prompt: str
    answer: str  # "" = records carry no reference answer


def load_problems(
    files: Sequence[str],
    *,
    report: DataReport,
    fields: FieldMap,
    prompt_format: PromptFormat,
    max_prompt_tokens: int,
    tokenizer: Any | None = None,
    context_tokens: int = 0,
    parse_answer: AnswerParser | None = None,
    first_id: int = 0,
) -> list[Problem]:
    """Problems from `files` in file order; bad and over-long records are skipped into `report`.

    `context_tokens` (prompt budget within the model's context; 0 = unknown) makes longer prompts
    bad data; `max_prompt_tokens` (data.max_prompt_tokens, 0 = no limit) filters by choice. Both need
    a tokenizer to count tokens.
    Ids number all records read (kept or not) from `first_id`, so an id names a file position.
    """
    candidates: list[tuple[int, str, int, str, str, dict[str, Any]]] = []
    record_index = first_id
    for path in files:
        for record in iter_records(path):
            report.read += 1
            record_index += 1
            if record.fields is None:
                report.skip(record.problem, record.source, record.line, record.detail)
                continue
            values = record.fields
            raw_prompt = values.get(fields.prompt)
            if raw_prompt is None:
                report.skip("missing_field", record.source, record.line,
                            f"no field {fields.prompt!r} (data.prompt_field; fields here: {', '.join(sorted(values)) or 'none'})")
                continue
            if isinstance(raw_prompt, bytes) or (isinstance(raw_prompt, str) and not _encodable(raw_prompt)):
                # A JSON escape can make a str no UTF-8 holds (a lone surrogate, "\ud800"): the
                # tokenizer and the wire could not carry it.
                report.skip("bad_utf8", record.source, record.line, f"field {fields.prompt!r} is not UTF-8 text")
                continue
            if not isinstance(raw_prompt, str) or not raw_prompt.strip():
                report.skip("empty_prompt", record.source, record.line, f"field {fields.prompt!r} is empty or not text")
                continue
            answer = ""
            if fields.answer:
                raw_answer = values.get(fields.answer)
                if raw_answer is None:
                    report.skip("missing_field", record.source, record.line,
                                f"no field {fields.answer!r} (data.answer_field; fields here: {', '.join(sorted(values))})")
                    continue
                parsed = (parse_answer or _plain_answer)(raw_answer if isinstance(raw_answer, str) else str(raw_answer))
                if parsed is not None and not _encodable(parsed):
                    report.skip("bad_utf8", record.source, record.line, f"field {fields.answer!r} is not UTF-8 text")
                    continue
                if parsed is None:
                    report.skip("bad_answer", record.source, record.line,
                                f"field {fields.answer!r} holds no usable reference answer: {str(raw_answer)[-60:]!r}")
                    continue
                answer = parsed
            extra = {k: v for k, v in values.items() if k not in (fields.prompt, fields.answer)}
            extra["raw_prompt"] = raw_prompt
            if fields.answer:
                extra["raw_answer"] = values[fields.answer]
            candidates.append((record_index - 1, record.source, record.line, prompt_format.render(raw_prompt, tokenizer),
                               answer, extra))

    lengths = _token_counts(tokenizer, [c[3] for c in candidates]) if tokenizer is not None else None
    problems = []
    for position, (problem_id, source, line, prompt, answer, extra) in enumerate(candidates):
        if lengths is not None:
            length = lengths[position]
            if context_tokens and length > context_tokens:
                report.skip("too_long", source, line, f"prompt of {length} tokens does not fit the context "
                            f"({context_tokens} tokens = model.max_positions - rollout.max_new_tokens)")
                continue
            if max_prompt_tokens and length > max_prompt_tokens:
                report.skip("over_max_prompt_tokens", source, line, f"prompt of {length} tokens > data.max_prompt_tokens")
                continue
        problems.append(Problem(id=problem_id, prompt=prompt, answer=answer, extra=extra))
    report.kept += len(problems)
    return problems


def absolute_paths(paths: Sequence[str]) -> list[str]:
    """Paths as the driver sees them, so actors with another working directory find the same files."""
    return [str(Path(path).expanduser().resolve()) for path in paths]


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _plain_answer(text: str) -> str | None:
    text = text.strip()
    return text or None


def _token_counts(tokenizer: Any, prompts: list[str], chunk: int = 1024) -> list[int]:
    counts: list[int] = []
    for start in range(0, len(prompts), chunk):
        ids = tokenizer(prompts[start:start + chunk], add_special_tokens=False)["input_ids"]
        counts.extend(len(row) for row in ids)
    return counts


def split_holdout(problems: list[T], size: int, seed: int = 0) -> tuple[list[T], list[T]]:
    """(train, held out): a fixed random `size` items held out, both in their original order."""
    chosen = set(random.Random(f"holdout:{seed}").sample(range(len(problems)), size))
    return ([p for i, p in enumerate(problems) if i not in chosen], [p for i, p in enumerate(problems) if i in chosen])


def epoch_stream(items: Sequence[T], *, seed: int, epochs: int, shuffle: bool) -> Iterator[T]:
    """Each epoch: every item once, in a seeded order. `epochs` (data.epochs) 0 is endless;
    `shuffle` is data.shuffle (no defaults here: config's are the only ones).
    Deterministic: the same (seed, epoch) always gives the same order.
    """
    if not items:  # endless epochs of nothing would never yield
        raise DataError("there are no training prompts to stream")
    epoch = 0
    while epochs == 0 or epoch < epochs:
        order = list(range(len(items)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        for index in order:
            yield items[index]
        epoch += 1
