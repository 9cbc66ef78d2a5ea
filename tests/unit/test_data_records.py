"""Reading JSONL/Parquet prompt files and accounting for bad records."""

import gzip
import json
from pathlib import Path

import pytest

from asyncgrpo.data import (
    DataError,
    DataReport,
    FieldMap,
    PromptFormat,
    iter_records,
    load_problems,
)
from asyncgrpo.models.tokenizer import build_char_tokenizer

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "gsm8k_sample.jsonl"
# The prompt as it is in the file: no template around it, no chat template.
PLAIN = PromptFormat(template="{prompt}", chat_template=False, system_prompt="")
QUESTION_ANSWER = FieldMap(prompt="question", answer="answer")


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def bad_file(tmp_path: Path) -> Path:
    """One record of each kind of bad data, numbered by line."""
    return write_lines(tmp_path / "mixed.jsonl", [
        json.dumps({"question": "1+1=", "answer": "2"}).encode(),        # 1 good
        json.dumps({"answer": "3"}).encode(),                            # 2 missing prompt field
        json.dumps({"question": "   ", "answer": "4"}).encode(),         # 3 empty prompt
        b'{"question": "caf\xe9", "answer": "5"}',                       # 4 not UTF-8 (latin-1 byte)
        b'{"question": "2+2=", "answer": ',                              # 5 not JSON
        b"[1, 2, 3]",                                                    # 6 not an object
        b"",                                                             # 7 blank: not a record
        json.dumps({"question": "3+3=", "answer": "6"}).encode(),        # 8 good
        json.dumps({"question": "9" * 40 + "+1=", "answer": "x"}).encode(),  # 9 too long for 32 tokens
        json.dumps({"question": "4+4="}).encode(),                       # 10 missing answer field
    ])


def load(path: Path, strict: bool = False, max_prompt_tokens: int = 0, **kwargs) -> tuple[list, DataReport]:
    report = DataReport("data.train_files", strict=strict)
    problems = load_problems([str(path)], report=report, fields=QUESTION_ANSWER, prompt_format=PLAIN,
                             max_prompt_tokens=max_prompt_tokens, tokenizer=build_char_tokenizer(), context_tokens=27,
                             **kwargs)
    return problems, report


def test_bad_records_are_skipped_and_counted_with_their_lines(tmp_path):
    problems, report = load(bad_file(tmp_path))
    assert [p.prompt for p in problems] == ["1+1=", "3+3="]
    assert report.read == 9 and report.kept == 2  # the blank line is not a record
    assert dict(report.skipped) == {"missing_field": 2, "empty_prompt": 1, "bad_utf8": 1, "bad_json": 1,
                                    "not_object": 1, "too_long": 1}
    assert report.examples["missing_field"] == ["mixed.jsonl:2", "mixed.jsonl:10"]
    assert report.examples["bad_utf8"] == ["mixed.jsonl:4"]
    assert report.examples["too_long"] == ["mixed.jsonl:9"]
    line = report.describe()
    assert "kept 2 of 9" in line and "bad_utf8=1 (mixed.jsonl:4)" in line and "\n" not in line


def test_a_lone_surrogate_escape_no_utf8_can_hold_is_a_counted_bad_utf8_record(tmp_path):
    path = write_lines(tmp_path / "escapes.jsonl", [
        b'{"question": "\\ud800", "answer": "2"}',             # 1 a lone surrogate in the prompt
        b'{"question": "1+1=", "answer": "\\udfff"}',           # 2 ... in the answer
        b'{"question": "\\ud83d\\ude00 2+2=", "answer": "4"}',  # 3 a surrogate pair: one character, kept
    ])
    problems, report = load(path)
    assert [p.answer for p in problems] == ["4"]
    assert report.skipped == {"bad_utf8": 2} and report.examples["bad_utf8"] == ["escapes.jsonl:1", "escapes.jsonl:2"]


def test_only_the_first_few_lines_are_kept_per_reason(tmp_path):
    path = write_lines(tmp_path / "many.jsonl", [b"{}"] * 12 + [json.dumps({"question": "q", "answer": "a"}).encode()])
    _, report = load(path)
    assert report.skipped["missing_field"] == 12
    assert report.examples["missing_field"] == [f"many.jsonl:{i}" for i in range(1, 6)]
    assert report.describe().endswith("many.jsonl:5, ...)")


@pytest.mark.parametrize(("line", "reason_text"), [
    (b'{"answer": "3"}', "no field 'question'"),
    (b'{"question": "", "answer": "3"}', "empty"),
    (b'{"question": "caf\xe9", "answer": "3"}', "not UTF-8"),
    (b'{"question": ', "not JSON"),
    (json.dumps({"question": "9" * 40, "answer": "1"}).encode(), "does not fit the context"),
])
def test_strict_stops_at_the_first_bad_record_naming_file_and_line(tmp_path, line, reason_text):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"question": "1+1=", "answer": "2"}).encode(), line])
    with pytest.raises(DataError) as err:
        load(path, strict=True)
    message = str(err.value)
    assert f"{path}:2:" in message and reason_text in message and "data.strict" in message
    assert "\n" not in message


def test_strict_does_not_stop_on_a_chosen_length_filter(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"question": q, "answer": "1"}).encode()
                                                 for q in ("1+1=", "11+11=", "111+111=")])
    problems, report = load(path, strict=True, max_prompt_tokens=6)
    assert [p.prompt for p in problems] == ["1+1=", "11+11="]
    assert report.skipped == {"over_max_prompt_tokens": 1} and report.filtered == 1 and report.bad == 0


def test_field_names_are_configurable_and_other_fields_reach_extra(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"problem": "2+3=", "solution": 5, "level": 2}).encode()])
    report = DataReport("t", strict=False)
    [problem] = load_problems([str(path)], report=report, fields=FieldMap(prompt="problem", answer="solution"),
                              prompt_format=PromptFormat(template="Q: {prompt}", chat_template=False, system_prompt=""),
                              max_prompt_tokens=0)
    assert problem.prompt == "Q: 2+3=" and problem.answer == "5"
    assert problem.extra == {"level": 2, "raw_prompt": "2+3=", "raw_answer": 5}


def test_no_answer_field_means_no_reference_answer(tmp_path):
    path = write_lines(tmp_path / "data.jsonl", [json.dumps({"question": "write a poem"}).encode()])
    [problem] = load_problems([str(path)], report=DataReport("t", strict=False), fields=FieldMap(prompt="question", answer=""),
                              prompt_format=PLAIN, max_prompt_tokens=0)
    assert problem.answer == ""


def test_parquet_and_gzipped_jsonl_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    parquet = tmp_path / "sample.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=5)
    gz = tmp_path / "sample.jsonl.gz"
    with gzip.open(gz, "wb") as file:
        file.write(SAMPLE.read_bytes())
    from_jsonl = [r.fields for r in iter_records(SAMPLE)]
    assert [r.fields for r in iter_records(parquet)] == from_jsonl
    assert [r.fields for r in iter_records(gz)] == from_jsonl
    assert [r.line for r in iter_records(parquet)] == list(range(1, len(rows) + 1))


def test_parquet_rows_are_checked_like_lines(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"question": ["1+1=", None, ""], "answer": ["2", "3", "4"]})
    pq.write_table(table, tmp_path / "d.parquet")
    problems, report = load(tmp_path / "d.parquet")
    assert [p.prompt for p in problems] == ["1+1="]
    assert report.examples == {"missing_field": ["d.parquet:2"], "empty_prompt": ["d.parquet:3"]}


@pytest.mark.parametrize("name", ["data.csv", "missing.jsonl"])
def test_unknown_or_missing_files_fail_naming_the_file(tmp_path, name):
    if name.endswith(".csv"):
        (tmp_path / name).write_text("a,b\n")
    with pytest.raises(DataError, match=name):
        list(iter_records(tmp_path / name))


def test_a_damaged_parquet_file_fails_naming_it(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet"):
        list(iter_records(tmp_path / "bad.parquet"))


def gzipped_sample() -> bytes:
    return gzip.compress(SAMPLE.read_bytes())


@pytest.mark.parametrize(("damage", "cause"), [
    (lambda data: data[: len(data) // 2], "truncated"),
    (lambda data: b"not gzip at all\n", "not gzip"),
    # A flipped byte in the trailer: the CRC no longer matches the data.
    (lambda data: data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:], "bad CRC"),
], ids=["truncated", "not_gzip", "bad_crc"])
def test_a_damaged_gzip_file_fails_in_one_line_naming_it(tmp_path, damage, cause):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(damage(gzipped_sample()))
    with pytest.raises(DataError, match="broken.jsonl.gz") as raised:
        load(path)
    assert "\n" not in str(raised.value), cause


def test_a_damaged_parquet_row_group_fails_in_one_line_naming_the_file_and_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"question": [f"{i}+1=" * 5 for i in range(200)], "answer": [str(i) for i in range(200)]}),
                   path, row_group_size=100)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    # The footer still reads, so the file opens; the second row group's compressed pages do not.
    data[start + 20: start + column.total_compressed_size - 4] = b"\xab" * (column.total_compressed_size - 24)
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"damaged.parquet.*row group 1") as raised:
        load(path)
    assert "\n" not in str(raised.value)


def test_json_nested_too_deep_or_an_integer_too_long_is_a_counted_bad_record(tmp_path):
    path = write_lines(tmp_path / "deep.jsonl", [
        json.dumps({"question": "1+1=", "answer": "2"}).encode(),
        b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b', "answer": "2"}',  # RecursionError in json
        b'{"question": "2+2=", "answer": ' + b"7" * 5000 + b"}",  # over Python's int digit limit: ValueError
    ])
    problems, report = load(path)
    assert [p.prompt for p in problems] == ["1+1="]
    assert dict(report.skipped) == {"bad_json": 2}
    assert report.examples["bad_json"] == ["deep.jsonl:2", "deep.jsonl:3"]
    with pytest.raises(DataError, match=r"deep.jsonl:2: .*nested") as raised:
        load(path, strict=True)
    assert "\n" not in str(raised.value)
