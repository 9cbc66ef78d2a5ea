"""Reading prompt records from local JSONL and Parquet files, with an account of bad records.

Every record carries its source file and 1-based line (JSONL) or row (Parquet) number, so a
skipped record can be found again. Blank JSONL lines are not records and are not counted.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")
# Reasons that mean the data is broken; data.strict=true stops on these. A prompt longer than
# data.max_prompt_tokens (but within the context) is filtered by choice and never stops a run.
BAD_REASONS = ("bad_utf8", "bad_json", "not_object", "missing_field", "empty_prompt", "bad_answer", "too_long")
FILTER_REASONS = ("over_max_prompt_tokens",)


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and line) and the config key."""


@dataclass(frozen=True)
class Record:
    source: str
    line: int
    fields: dict[str, Any] | None  # None when the line could not be read
    problem: str = ""  # why it could not be read: a reason from BAD_REASONS
    detail: str = ""


@dataclass
class DataReport:
    """Counts of kept, skipped and filtered records, with the first few locations of each reason.

    With `strict` (data.strict), the first bad record raises DataError instead of being counted.
    """

    name: str
    strict: bool = field(kw_only=True)
    examples_per_reason: int = 5
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, source: str, line: int, detail: str) -> None:
        if self.strict and reason in BAD_REASONS:
            raise DataError(f"{source}:{line}: {detail} (data.strict=true; set data.strict=false to skip and count bad records)")
        self.skipped[reason] += 1
        locations = self.examples.setdefault(reason, [])
        if len(locations) < self.examples_per_reason:
            locations.append(f"{Path(source).name}:{line}")

    @property
    def bad(self) -> int:
        return sum(n for reason, n in self.skipped.items() if reason in BAD_REASONS)

    @property
    def filtered(self) -> int:
        return sum(n for reason, n in self.skipped.items() if reason in FILTER_REASONS)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "skipped": dict(self.skipped),
                "first_lines": {reason: list(lines) for reason, lines in self.examples.items()}}

    def describe(self) -> str:
        """One line, e.g. `train: kept 7 of 10 records; skipped missing_field=2 (a.jsonl:3, a.jsonl:8), ...`."""
        parts = [f"{reason}={count} ({', '.join(self.examples.get(reason, []))}{', ...' if count > len(self.examples.get(reason, [])) else ''})"
                 for reason, count in sorted(self.skipped.items())]
        return f"{self.name}: kept {self.kept} of {self.read} records" + (f"; skipped {', '.join(parts)}" if parts else "")


def iter_records(path: str | Path) -> Iterator[Record]:
    """The records of one JSONL (optionally gzipped) or Parquet file, by file extension."""
    path = Path(path).expanduser()
    name = path.name.lower()
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if name.endswith(JSONL_SUFFIXES):
        return _jsonl_records(path)
    if name.endswith(PARQUET_SUFFIXES):
        return _parquet_records(path)
    raise DataError(f"{path}: unknown file type (expected {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})")


def _one_line(err: BaseException) -> str:
    """An exception as `Type: text` on one line (pyarrow's texts may span several)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a plain or gzipped file. A damaged gzip stream (truncated, not gzip,
    a bad CRC) or a failing read stops the whole file with one DataError: how many records the rest
    held is unknown, so it cannot be counted as bad records."""
    gzipped = path.name.lower().endswith(".gz")
    line_number = 0
    try:
        with (gzip.open if gzipped else open)(path, "rb") as file:
            for line_number, raw in enumerate(file, start=1):
                yield line_number, raw
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        kind = "damaged gzip data" if gzipped else "cannot be read"
        raise DataError(f"{path}: {kind} after line {line_number} ({_one_line(err)})") from None


def _jsonl_records(path: Path) -> Iterator[Record]:
    source = str(path)
    for line_number, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield Record(source, line_number, None, "bad_utf8", f"not UTF-8 (byte {err.start})")
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            yield Record(source, line_number, None, "bad_json", f"not JSON ({err.msg} at column {err.colno})")
            continue
        except RecursionError:
            yield Record(source, line_number, None, "bad_json", "not usable JSON (nested too deeply to parse)")
            continue
        except ValueError as err:  # valid JSON Python refuses, e.g. an integer over sys.get_int_max_str_digits()
            yield Record(source, line_number, None, "bad_json", f"not usable JSON ({' '.join(str(err).split())})")
            continue
        if not isinstance(value, dict):
            yield Record(source, line_number, None, "not_object", f"a JSON {type(value).__name__}, not an object")
            continue
        yield Record(source, line_number, value)


def _parquet_records(path: Path, batch_rows: int = 1024) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading Parquet needs pyarrow ({err})") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({_one_line(err)})") from None
    row = 0
    # One row group at a time, so that a damaged one can be named; only pyarrow's own work is in
    # the try, not the consumer's handling of the records yielded.
    for group in range(parquet.num_row_groups):
        batches = parquet.iter_batches(batch_size=batch_rows, row_groups=[group])
        while True:
            try:
                batch = next(batches, None)
                rows = None if batch is None else batch.to_pylist()
            except Exception as err:  # pyarrow raises OSError, ArrowInvalid and others for damaged pages
                raise DataError(f"{path}: row group {group} is damaged, after row {row} "
                                f"({_one_line(err)})") from None
            if rows is None:
                break
            for values in rows:
                row += 1
                yield Record(str(path), row, _decode_binary(values))


def _decode_binary(values: dict[str, Any]) -> dict[str, Any]:
    """Binary columns come back as bytes; UTF-8 ones become text, others stay bytes (and fail as prompts)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                pass
        out[key] = value
    return out
