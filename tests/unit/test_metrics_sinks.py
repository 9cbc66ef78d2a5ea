"""Metrics sinks write what they are given, and read back as written (JSONL, TensorBoard, offline W&B)."""

import json
from pathlib import Path

import numpy as np
import pytest

from asyncgrpo.config import load
from asyncgrpo.metrics import (
    JsonlSink,
    MultiSink,
    SinkUnavailable,
    numeric_items,
    open_sinks,
    require_sink_packages,
)
from asyncgrpo.metrics import sinks as sinks_module
from asyncgrpo.schema import ConfigError, LogConfig

STEP_RECORDS = [
    {"step": s, "samples": 128 * s, "reward/mean": 0.1 * s, "staleness/max": np.int64(s % 3),
     "loss/pg": np.float32(-0.5), "note": "text is kept in JSONL only"}
    for s in range(1, 4)
]
EVAL_RECORD = {"step": 0, "eval/accuracy": 0.25, "eval/greedy_accuracy": 0.5, "eval/when": "start"}


def test_numeric_items_keeps_numbers_and_drops_step_strings_and_bools():
    record = {"step": 3, "a": 1, "b": np.float32(0.5), "c": "x", "d": True, "e": None}
    assert dict(numeric_items(record)) == {"a": 1.0, "b": 0.5}


def test_jsonl_round_trip_and_append(tmp_path):
    sink = JsonlSink(tmp_path)
    for record in [EVAL_RECORD, *STEP_RECORDS]:
        sink.write(record)
    sink.close()
    JsonlSink(tmp_path).close()  # reopening appends, it does not truncate
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    back = [json.loads(line) for line in lines]
    assert back[0] == EVAL_RECORD
    assert [r["step"] for r in back[1:]] == [1, 2, 3]
    assert back[2]["staleness/max"] == 2 and back[2]["loss/pg"] == -0.5
    assert back[1]["note"] == "text is kept in JSONL only"


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load(["log.tensorboard=true"])
    sink = open_sinks(cfg, tmp_path)
    for record in [EVAL_RECORD, *STEP_RECORDS]:
        sink.write(record)
    sink.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"reward/mean", "samples", "staleness/max", "loss/pg", "eval/accuracy"} <= tags
    assert not {"step", "note", "eval/when"} & tags
    reward = [(e.step, round(e.value, 5)) for e in events.Scalars("reward/mean")]
    assert reward == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25)]
    assert (tmp_path / "metrics.jsonl").exists()  # JSONL is always on


def _wandb_records(path: Path):
    """Records of a .wandb file: a W&B header, then LevelDB-log framing (32 KiB blocks) of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length = int.from_bytes(data[position + 4:position + 6], "little")
        kind = data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_writes_its_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load(["log.wandb=true", "log.wandb_project=unit"])
    assert cfg.log.wandb_mode == "offline"
    sink = open_sinks(cfg, tmp_path)
    for record in [EVAL_RECORD, *STEP_RECORDS]:
        sink.write(record)
    sink.write({"step": 3, "eval/accuracy": 0.75, "eval/when": "end"})
    sink.close()

    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    raw = run_files[0].read_bytes()
    assert b"reward/mean" in raw and b"eval/when" not in raw
    history = {}
    for record in _wandb_records(run_files[0]):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = row
    assert sorted(history) == [0, 1, 2, 3]
    assert history[0]["eval/accuracy"] == 0.25
    assert history[2]["reward/mean"] == pytest.approx(0.2)
    assert history[3]["eval/accuracy"] == 0.75 and history[3]["reward/mean"] == pytest.approx(0.3)


def test_missing_package_is_one_line_naming_key_and_package(monkeypatch):
    real_find_spec = sinks_module.importlib.util.find_spec
    monkeypatch.setattr(sinks_module.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a))
    require_sink_packages(LogConfig())  # nothing enabled: nothing needed
    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        with pytest.raises(SinkUnavailable) as err:
            require_sink_packages(LogConfig(**{key: True}))
        message = str(err.value)
        assert f"log.{key}=true" in message and f"pip install {package}" in message and "\n" not in message
        assert isinstance(err.value, ConfigError)


def test_cli_reports_a_missing_sink_package_before_anything_starts(monkeypatch, capsys):
    from asyncgrpo import cli

    real_find_spec = sinks_module.importlib.util.find_spec
    monkeypatch.setattr(sinks_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    monkeypatch.setattr("asyncgrpo.train.train", lambda cfg: pytest.fail("training started"))
    assert cli.main(["train", "log.wandb=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("asyncgrpo: config error: log.wandb=true needs the 'wandb' package")
    assert len(err.splitlines()) == 1


def test_multisink_closes_every_sink_even_if_one_fails():
    closed = []

    class Sink:
        def __init__(self, name, fail=False):
            self.name, self.fail, self.records = name, fail, []

        def write(self, record, step=None):
            self.records.append((record, step))

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError("disk full")

    a, b, c = Sink("a"), Sink("b", fail=True), Sink("c")
    multi = MultiSink([a, b, c])
    multi.write({"x": 1}, 5)
    assert a.records == b.records == c.records == [({"x": 1}, 5)]
    with pytest.raises(OSError):
        multi.close()
    assert closed == ["a", "b", "c"]


@pytest.mark.parametrize(("override", "key"), [("log.wandb_mode=cloud", "log.wandb_mode"),
                                              ("log.samples_every_steps=-1", "log.samples_every_steps"),
                                              ("log.samples_per_log=0", "log.samples_per_log")])
def test_bad_log_config_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load([override])


def test_a_resume_sets_aside_the_records_of_steps_it_trains_again(tmp_path):
    from asyncgrpo.metrics import set_aside_steps_after

    path = tmp_path / "metrics.jsonl"
    records = [{"eval/accuracy": 0.1}, {"step": 1}, {"step": 2}, {"step": 3}, {"step": 4, "eval/accuracy": 0.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert set_aside_steps_after(path, 2) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    abandoned = tmp_path / "metrics.abandoned.jsonl"
    assert [json.loads(line) for line in abandoned.read_text().splitlines()] == records[3:]
    # A second resume at the same point finds nothing more to move; the file is left as it is.
    assert set_aside_steps_after(path, 2) == 0
    assert set_aside_steps_after(tmp_path / "missing.jsonl", 0) == 0


def test_setting_aside_keeps_a_torn_last_line_and_records_without_a_step(tmp_path):
    from asyncgrpo.metrics import set_aside_steps_after

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 5}\n{"queue/depth": 3}\n{"step": 6, "loss')
    assert set_aside_steps_after(path, 1) == 1
    assert path.read_text() == '{"step": 1}\n{"queue/depth": 3}\n{"step": 6, "loss\n'
