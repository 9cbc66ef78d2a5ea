"""wire.record_* validation, and the replay's config: the recording's config.yaml with the command
line's overrides on top, and what a replay cannot change."""

from __future__ import annotations

import json

import pytest

from one_line import raises_one_line

from asyncgrpo import cli
from asyncgrpo.config import load, replay_config
from asyncgrpo.schema import ConfigError
from asyncgrpo.learner.parts import stream_recorder
from asyncgrpo.recording import StreamRecorder, open_recording, scan
from asyncgrpo.recording.stream import CONFIG_DEFAULTS, HEADER_FILE, STREAM_FILE
from asyncgrpo.wire import example_group


def make_recording(directory, *overrides: str):
    """A one-step recording made under these overrides; (the recording run's config, the recording)."""
    cfg = load(["train.groups_per_step=2", "algo.clip_high=0.3", f"wire.record_dir={directory}", *overrides])
    recorder = stream_recorder(cfg, "/")
    recorder.record_step(0, [example_group(2, 3, seed=i) for i in range(2)])
    recorder.close()
    return cfg, open_recording(directory)


def test_record_fsync_every_steps_must_be_positive():
    with pytest.raises(ConfigError, match="wire.record_fsync_every_steps must be >= 1"):
        load(["wire.record_fsync_every_steps=0"])


def test_a_fresh_run_may_not_record_over_a_recording_but_a_resumed_one_continues_it(tmp_path):
    make_recording(tmp_path)
    with pytest.raises(ConfigError, match="wire.record_dir already holds a recording"):
        load([f"wire.record_dir={tmp_path}"])
    assert load([f"wire.record_dir={tmp_path}", "resume=auto"]).wire.record_dir == str(tmp_path)


def test_the_recorded_config_composes_with_overrides(tmp_path):
    _, recording = make_recording(tmp_path, "seed=7")
    cfg = replay_config(recording, ["algo.mode=decoupled", "algo.correction.is_level=token"])
    assert (cfg.algo.mode, cfg.algo.correction.is_level, cfg.algo.clip_high, cfg.seed) == ("decoupled", "token", 0.3, 7)
    # Not recorded into, not resumed, one rank, its own run directory inside the recording.
    assert cfg.wire.record_dir == "" and cfg.resume == "" and cfg.learner.world_size == 1
    assert cfg.run_dir.startswith(str(tmp_path / "replay-"))


def test_without_overrides_the_replay_config_is_the_recording_runs(tmp_path):
    original, recording = make_recording(tmp_path, "seed=7", "reward.terms=[{name:math},{name:fmt,kind:format}]")
    cfg = replay_config(recording, [f"run_dir={original.run_dir}"])
    cfg.wire.record_dir = original.wire.record_dir
    assert cfg == original


@pytest.mark.parametrize("override,match", [
    ("train.groups_per_step=3", "the recording took 2 groups per step"),
    ("learner.world_size=2", "a replay runs one learner rank"),
    ("resume=auto", "a replay starts from the recording's starting weights"),
    ("algo.mode=nonsense", "algo.mode must be one of"),
    ("algo.filter_groups=true", "algo.filter_groups: a replay trains the recorded groups"),
])
def test_what_a_replay_cannot_change_is_refused_in_one_line(tmp_path, override, match):
    _, recording = make_recording(tmp_path)
    with raises_one_line(ConfigError, match=match):
        replay_config(recording, [override])


def test_recording_into_the_recording_being_replayed_is_refused(tmp_path):
    _, recording = make_recording(tmp_path)
    with pytest.raises(ConfigError, match="already holds a recording"):
        replay_config(recording, [f"wire.record_dir={tmp_path}"])


# ------------------------------------------------------------------------- `asyncgrpo replay` refusals


def replay_refusal(capsys, *argv: str) -> str:
    """`asyncgrpo replay ...` exits 2 with one line on stderr (before any model is loaded); that line."""
    assert cli.main(["replay", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_replay_of_a_missing_or_empty_directory_exits_2_in_one_line(tmp_path, capsys):
    assert "no such directory" in replay_refusal(capsys, str(tmp_path / "nope"))
    assert "not a recording" in replay_refusal(capsys, str(tmp_path))


def test_replay_of_a_corrupted_record_exits_2_naming_its_offset(tmp_path, capsys):
    recorder = StreamRecorder(tmp_path, CONFIG_DEFAULTS, "/", 1)
    for version in range(3):
        recorder.record_step(version, [example_group(2, 3, seed=version)])
    recorder.close()
    stream = tmp_path / STREAM_FILE
    data = bytearray(stream.read_bytes())
    offset = scan(stream).steps[1].offsets[0]
    data[offset + 50] ^= 1
    stream.write_bytes(bytes(data))
    line = replay_refusal(capsys, str(tmp_path))
    assert line.startswith("asyncgrpo: replay: ") and f"record at byte offset {offset}: checksum mismatch" in line


def test_replay_of_another_format_or_without_its_starting_model_exits_2_in_one_line(tmp_path, capsys):
    make_recording(tmp_path)
    header_path = tmp_path / HEADER_FILE
    header = json.loads(header_path.read_text())
    header_path.write_text(json.dumps({**header, "model_dir": str(tmp_path / "gone")}))
    line = replay_refusal(capsys, str(tmp_path))
    assert "starting model" in line and "is gone" in line
    header_path.write_text(json.dumps({**header, "format": 0}))
    assert "recording format 0" in replay_refusal(capsys, str(tmp_path))


def test_replay_with_a_bad_override_exits_2_in_one_line(tmp_path, capsys):
    make_recording(tmp_path)
    assert "config error: algo.mode must be one of" in replay_refusal(capsys, str(tmp_path), "algo.mode=nope")
    assert "unknown config key" in replay_refusal(capsys, str(tmp_path), "algo.nope=1")


@pytest.mark.parametrize(("change", "said"), [
    ({"checkpoint": 5}, "checkpoint must be a path or null (got 5)"),
    ({"model_dir": ""}, "the recording run's starting model '' is gone"),
    ({"model_dir": "EMPTY"}, "the recording run's starting model: model directory EMPTY: no config.json"),
])
def test_a_recording_header_whose_starting_point_is_not_a_model_exits_2_in_one_line(tmp_path, capsys, change, said):
    recording = tmp_path / "recording"
    make_recording(recording)
    (tmp_path / "empty").mkdir()
    header_path = recording / HEADER_FILE
    header = json.loads(header_path.read_text())
    change = {key: str(tmp_path / "empty") if value == "EMPTY" else value for key, value in change.items()}
    header_path.write_text(json.dumps({**header, **change}))
    assert said.replace("EMPTY", str(tmp_path / "empty")) in replay_refusal(capsys, str(recording))
