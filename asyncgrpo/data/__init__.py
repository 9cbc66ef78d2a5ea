"""Prompt data from local files: JSONL/Parquet records, field mapping, templates, filtering, epochs."""

from asyncgrpo.data.prompts import (
           FieldMap,
           PromptFormat,
           absolute_paths,
           epoch_stream,
           load_problems,
           split_holdout,
)
from asyncgrpo.data.records import (
           BAD_REASONS,
           DataError,
           DataReport,
           Record,
           iter_records,
)

__all__ = ["BAD_REASONS", "DataError", "DataReport", "FieldMap", "PromptFormat", "Record", "absolute_paths",
           "epoch_stream", "iter_records", "load_problems", "split_holdout"]
