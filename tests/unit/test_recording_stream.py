"""The recorded-stream format (asyncgrpo/recording/stream.py) and its writer: what goes in comes back
bit for bit, a crash's torn tail is ignored and counted, corruption is found and named by offset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from one_line import raises_one_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgrpo.recording import (
    RecordedSource,
    RecordingError,
    StreamRecorder,
    open_recording,
    scan,
)
from asyncgrpo.recording.stream import (
    HEADER_FILE,
    PREAMBLE,
    STREAM_FILE,
    pack_record,
    read_header,
)
from asyncgrpo.queue.sources import QueueTimeout
from asyncgrpo.wire import ScoredGroup, encode_group, example_group


def groups_of(step: int, count: int = 3) -> list[ScoredGroup]:
    return [example_group(num_samples=2, tokens_per_sample=3 + i, seed=100 * step + i) for i in range(count)]


def record(directory: Path, num_steps: int, count: int = 3, start: int = 0, fsync_every: int = 1,
           model_dir: str = "/") -> list[list[ScoredGroup]]:
    recorder = StreamRecorder(directory, "defaults:\n  - asyncgrpo\n  - _self_\n", model_dir, fsync_every)
    steps = [groups_of(start + k, count) for k in range(num_steps)]
    for k, groups in enumerate(steps):
        recorder.record_step(start + k, groups)
    recorder.close()
    return steps


def same_group(a: ScoredGroup, b: ScoredGroup) -> bool:
    arrays = ("prompt_tokens", "tokens", "logprobs", "versions", "lengths", "rewards", "truncated", "policy_mask")
    return (a.group_id, a.prompt_id, a.meta) == (b.group_id, b.prompt_id, b.meta) and all(
        np.array_equal(getattr(a, name), getattr(b, name)) for name in arrays)


def step_ends(path: Path) -> list[int]:
    """The byte offset just after each complete step."""
    index = scan(path)
    return [step.offsets[0] for step in index.steps[1:]] + [path.stat().st_size]


def test_every_group_comes_back_bit_for_bit_at_the_version_that_took_it(tmp_path):
    steps = record(tmp_path, num_steps=4)
    recording = open_recording(tmp_path)
    assert [step.version for step in recording.index.steps] == [0, 1, 2, 3]
    assert recording.index.torn_records == recording.index.torn_bytes == 0
    source = RecordedSource(recording, recording.index.steps)
    for version, groups in enumerate(steps):
        taken = source.take(3, version, timeout_s=0)
        assert all(same_group(a, b) for a, b in zip(taken, groups, strict=True))
    with pytest.raises(QueueTimeout):
        source.take(3, 4, timeout_s=0)
    source.close()
    header = read_header(tmp_path)
    assert header["start_version"] == 0 and header["model_dir"] == "/" and header["checkpoint"] is None


def test_a_step_is_served_only_to_the_version_that_took_it_and_with_its_group_count(tmp_path):
    record(tmp_path, num_steps=2)
    recording = open_recording(tmp_path)
    source = RecordedSource(recording, recording.index.steps)
    with pytest.raises(RecordingError, match="taken at version 0, the learner is at version 1"):
        source.take(3, 1, timeout_s=0)
    with pytest.raises(RecordingError, match="took 3 groups, train.groups_per_step=4"):
        source.take(4, 0, timeout_s=0)


@pytest.mark.parametrize("cut_back", [1, 5, 17, "one_record"])
def test_a_torn_last_step_is_ignored_and_counted(tmp_path, cut_back):
    record(tmp_path, num_steps=3)
    path = tmp_path / STREAM_FILE
    full = path.read_bytes()
    last = scan(path).steps[-1]
    cut = len(full) - cut_back if cut_back != "one_record" else last.offsets[2]
    path.write_bytes(full[:cut])
    index = scan(path)
    assert [step.version for step in index.steps] == [0, 1]
    assert index.end == last.offsets[0] and index.torn_bytes == cut - last.offsets[0]
    assert index.torn_records == (2 if cut_back == "one_record" else 3)


def test_zeros_where_a_crash_left_no_data_are_a_torn_tail(tmp_path):
    record(tmp_path, num_steps=2)
    path = tmp_path / STREAM_FILE
    full = path.read_bytes()
    last = scan(path).steps[-1]
    # The last step's second record zero-filled, and a few zero blocks after it.
    path.write_bytes(full[:last.offsets[1]] + bytes(len(full) - last.offsets[1] + 8192))
    index = scan(path)
    assert [step.version for step in index.steps] == [0] and index.torn_records == 2


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_corrupted_record_in_the_middle_is_an_error_naming_its_offset(tmp_path, where):
    record(tmp_path, num_steps=3)
    path = tmp_path / STREAM_FILE
    data = bytearray(path.read_bytes())
    offset = scan(path).steps[1].offsets[1]
    data[offset + (40 if where == "body" else 2)] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match=f"record at byte offset {offset}: .*checksum mismatch"):
        scan(path)
    with pytest.raises(RecordingError, match=f"byte offset {offset}"):
        open_recording(tmp_path)


def test_a_missing_or_empty_or_foreign_directory_is_one_line(tmp_path):
    with raises_one_line(RecordingError, match="no such directory"):
        open_recording(tmp_path / "nope")
    with raises_one_line(RecordingError, match="not a recording"):
        open_recording(tmp_path)
    record(tmp_path, num_steps=0)  # nothing recorded: not even opened
    with raises_one_line(RecordingError, match="not a recording"):
        open_recording(tmp_path)


def test_a_recording_with_only_a_torn_step_has_no_complete_step(tmp_path):
    record(tmp_path, num_steps=1)
    path = tmp_path / STREAM_FILE
    path.write_bytes(path.read_bytes()[:-3])
    (tmp_path / "config.yaml").write_text("")
    with pytest.raises(RecordingError, match="no complete step"):
        open_recording(tmp_path)


@pytest.mark.parametrize("key,value,match", [("format", 99, "recording format 99"),
                                             ("wire_schema", 1, "wire schema 1")])
def test_another_format_is_refused(tmp_path, key, value, match):
    record(tmp_path, num_steps=1)
    header = json.loads((tmp_path / HEADER_FILE).read_text())
    header[key] = value
    (tmp_path / HEADER_FILE).write_text(json.dumps(header))
    with pytest.raises(RecordingError, match=match):
        open_recording(tmp_path)


def test_a_stream_of_another_format_is_refused(tmp_path):
    path = tmp_path / STREAM_FILE
    path.write_bytes(PREAMBLE[:-4] + (2).to_bytes(4, "little"))
    with pytest.raises(RecordingError, match="stream format 2"):
        scan(path)
    path.write_bytes(b"something else entirely")
    with pytest.raises(RecordingError, match="not a recorded stream"):
        scan(path)


def test_records_that_break_the_step_structure_are_corruption(tmp_path):
    path = tmp_path / STREAM_FILE
    frames = encode_group(groups_of(0, 1)[0])
    # Step 0 has two of its three groups, then step 1 starts.
    path.write_bytes(PREAMBLE + pack_record(0, 0, 3, frames) + pack_record(0, 1, 3, frames)
                     + pack_record(1, 0, 1, frames))
    with pytest.raises(RecordingError, match="before the step at version 0 has all its 3 groups"):
        scan(path)
    path.write_bytes(PREAMBLE + pack_record(0, 0, 1, frames) + pack_record(2, 0, 1, frames))
    with pytest.raises(RecordingError, match="step at version 2, expected version 1"):
        scan(path)


def test_a_resumed_run_continues_the_recording_from_its_checkpoint_version(tmp_path):
    record(tmp_path, num_steps=4)
    # Resumed from a checkpoint at version 2: steps 2 and 3 were taken by a learner the run went back on.
    resumed = record(tmp_path, num_steps=3, start=2)
    recording = open_recording(tmp_path)
    assert [step.version for step in recording.index.steps] == [0, 1, 2, 3, 4]
    source = RecordedSource(recording, recording.index.steps[2:])
    for version, groups in zip((2, 3, 4), resumed):
        assert all(same_group(a, b) for a, b in zip(source.take(3, version, 0), groups, strict=True))
    source.close()


def test_continuing_past_the_recording_or_from_another_model_is_refused(tmp_path):
    record(tmp_path, num_steps=2)
    with pytest.raises(RecordingError, match="versions 0..1; this learner starts at version 5"):
        record(tmp_path, num_steps=1, start=5)
    with pytest.raises(RecordingError, match="from the model /, this run starts from"):
        record(tmp_path, num_steps=1, start=1, model_dir=str(tmp_path))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_steps=st.integers(1, 4), count=st.integers(1, 3), cut=st.floats(0, 1))
def test_any_truncation_reads_as_the_complete_steps_before_it(tmp_path_factory, num_steps, count, cut):
    directory = tmp_path_factory.mktemp("rec")
    record(directory, num_steps, count)
    path = directory / STREAM_FILE
    full = path.read_bytes()
    ends = step_ends(path)
    length = int(cut * len(full))
    path.write_bytes(full[:length])
    index = scan(path)
    whole = sum(end <= length for end in ends)
    assert [step.version for step in index.steps] == list(range(whole))
    assert index.end + index.torn_bytes == length
    assert index.end == (ends[whole - 1] if whole else len(PREAMBLE) if length >= len(PREAMBLE) else 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_steps=st.integers(2, 4), position=st.floats(0, 1), flip=st.integers(1, 255))
def test_any_flipped_byte_before_the_last_record_is_found(tmp_path_factory, num_steps, position, flip):
    directory = tmp_path_factory.mktemp("rec")
    record(directory, num_steps, count=2)
    path = directory / STREAM_FILE
    data = bytearray(path.read_bytes())
    last_record = scan(path).steps[-1].offsets[-1]
    at = len(PREAMBLE) + int(position * (last_record - len(PREAMBLE) - 1))
    data[at] ^= flip
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError):
        scan(path)
