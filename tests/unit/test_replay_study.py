"""Replay studies (`command: replay`): each cell replays each recording, the runs pair by recording;
the report's paired-vs-unpaired comparison (`stats.pairing_gain`); and a replay's evaluation schedule."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from asyncgrpo.learner.parts import stream_recorder
from asyncgrpo.driver.replay import _train
from asyncgrpo.config import load
from asyncgrpo.study.runner import RUN_RECORD, StudyError, check_earlier_runs, run_command
from asyncgrpo.study.spec import Spec, SpecError
from asyncgrpo.study.stats import pairing_gain, t_quantile
from asyncgrpo.wire import example_group


def make_recording(directory: Path, groups_per_step: int = 2) -> Path:
    """A one-step recording (the replay study only composes configs from it here)."""
    cfg = load([f"train.groups_per_step={groups_per_step}", f"wire.record_dir={directory}"])
    recorder = stream_recorder(cfg, "/")
    recorder.record_step(0, [example_group(2, 3, seed=i) for i in range(groups_per_step)])
    recorder.close()
    return directory


def replay_spec(recordings: list[str], **changes) -> dict:
    spec = {
        "name": "pairs",
        "command": "replay",
        "recordings": recordings,
        "base": ["train.max_steps=5"],
        "grid": {"correction": {"bypass": {"algo.mode": "bypass"}, "naive": {"algo.mode": "naive"}}},
        "baseline": {"correction": "bypass"},
    }
    spec.update(changes)
    return {k: v for k, v in spec.items() if v is not None}


def test_a_replay_study_runs_every_cell_on_every_recording_as_asyncgrpo_replay(tmp_path):
    recordings = [str(make_recording(tmp_path / f"rec{i}")) for i in range(2)]
    spec = Spec.parse(replay_spec(recordings))
    spec.check_configs()
    plans = spec.runs(tmp_path / "study")
    assert [(p.cell.values["correction"], p.seed, str(p.recording)) for p in plans] == [
        ("bypass", 0, recordings[0]), ("naive", 0, recordings[0]),
        ("bypass", 1, recordings[1]), ("naive", 1, recordings[1])]
    command = run_command(plans[1], before=["ray.address=127.0.0.1:1"])
    # A replay of its recording with the cell's overrides; no engine cluster (a replay starts no generator).
    assert command[:5] == [sys.executable, "-m", "asyncgrpo.cli", "replay", recordings[0]]
    assert "algo.mode='naive'" in command and "train.max_steps=5" in command and "seed=0" in command
    assert f"run_dir='{plans[1].run_dir}'" in command and not any(a.startswith("ray.") for a in command)
    # A train study's command is unchanged.
    train = Spec.parse({"name": "t", "grid": {"algo.mode": ["naive"]}, "seeds": [3]}).runs(tmp_path)[0]
    assert run_command(train, before=["x=1"])[3:7] == ["train", "--config-name", "default", "x=1"]


def test_a_replay_spec_round_trips_through_the_study_dirs_spec_yaml(tmp_path):
    spec = Spec.parse(replay_spec(["/r/a", "/r/b"]))
    again = Spec.parse(yaml.safe_load(yaml.safe_dump(spec.to_dict())))
    assert (again.command, again.recordings, again.seeds, again.baseline) == ("replay", ["/r/a", "/r/b"], [0, 1],
                                                                             {"correction": "bypass"})


@pytest.mark.parametrize("changes, named", [
    ({"command": "eval"}, "command must be one of train, replay"),
    ({"seeds": [0, 1]}, "seeds: a replay study runs each cell once per recording"),
    ({"recordings": None}, "missing key 'recordings'"),
    ({"recordings": []}, "recordings must be a non-empty list"),
    ({"recordings": ["/r/a", "/r/a"]}, "recordings must be distinct"),
    ({"config_name": "longtail"}, "config_name: a replay's config is its recording's"),
    ({"command": None, "seeds": [0]}, "recordings: only with command: replay"),
    ({"recording": ["/r/a"]}, "unknown key 'recording'"),
])
def test_replay_spec_errors_are_one_line_naming_the_key(changes, named):
    with pytest.raises(SpecError, match=named) as caught:
        Spec.parse(replay_spec(**{"recordings": ["/r/a", "/r/b"], **changes}))
    assert "\n" not in str(caught.value)


def test_a_missing_recording_or_one_a_cell_cannot_replay_fails_before_any_run(tmp_path):
    with pytest.raises(SpecError, match=r"recordings: .*nowhere") as caught:
        Spec.parse(replay_spec([str(tmp_path / "nowhere")])).check_configs()
    assert "\n" not in str(caught.value)
    good, other = make_recording(tmp_path / "a"), make_recording(tmp_path / "b", groups_per_step=3)
    spec = Spec.parse(replay_spec([str(good), str(other)], base=["train.groups_per_step=2"]))
    with pytest.raises(SpecError, match=r"cell correction=bypass, recording .*b: .*took 3 groups per step"):
        spec.check_configs()


def test_a_finished_replay_of_another_recording_is_refused_when_the_spec_changes(tmp_path):
    plan = Spec.parse(replay_spec(["/r/a"])).runs(tmp_path)[0]
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "summary.json").write_text(json.dumps({"status": "finished"}))
    record = {"cell": plan.cell.values, "seed": 0, "config_name": plan.config_name, "recording": "/r/other",
              "overrides": list(plan.overrides)}
    (plan.run_dir / RUN_RECORD).write_text(json.dumps(record))
    with pytest.raises(StudyError, match="differing: recording /r/a, recording /r/other"):
        check_earlier_runs([plan])
    (plan.run_dir / RUN_RECORD).write_text(json.dumps({**record, "recording": "/r/a"}))
    check_earlier_runs([plan])


def test_pairing_gain_is_the_ratio_of_the_unpaired_to_the_paired_variance_on_known_values():
    # var(A) = 4, var(B) = 9, A - B = [1, 0, -1]: var 1, so pairing divides the variance by 13.
    gain = pairing_gain({0: 2.0, 1: 4.0, 2: 6.0}, {0: 1.0, 1: 4.0, 2: 7.0})
    assert gain.n == 3 and gain.variance_ratio == pytest.approx(13.0)
    assert gain.paired.mean == gain.unpaired.mean == pytest.approx(0.0)
    assert gain.paired.half_width == pytest.approx(t_quantile(0.975, 2) * math.sqrt(1 / 3))
    welch_df = 2 * 13 ** 2 / (4 ** 2 + 9 ** 2)
    assert gain.unpaired.half_width == pytest.approx(t_quantile(0.975, welch_df) * math.sqrt(13 / 3))


def test_pairing_gain_is_infinite_for_a_constant_shift_and_absent_below_two_pairs():
    assert pairing_gain({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.5, 1: 1.5, 2: 3.5}).variance_ratio == math.inf
    # Pairs need both sides: key 2 has no baseline, key 1 a missing value.
    single = pairing_gain({0: 1.0, 1: None, 2: 3.0}, {0: 0.0, 1: 1.0})
    assert single.n == 1 and single.variance_ratio is None and single.paired.mean == 1.0


class FakeLearner:
    def __init__(self) -> None:
        self.version = 0

    def train_steps(self, num_steps: int) -> list[dict]:
        self.version += num_steps
        return [{"step": self.version}]


class FakeEvaluator:
    def __init__(self, every: int) -> None:
        self.every, self.calls = every, []

    def evaluate(self, learner, when, step, metrics) -> dict:
        self.calls.append((when, step))
        return {f"eval_accuracy_{when}": 0.5}

    def after_step(self, learner, metrics) -> None:
        if self.every and learner.version % self.every == 0:
            self.calls.append(("periodic", learner.version))


class ListSink:
    def __init__(self) -> None:
        self.records = []

    def write(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("at_start, at_end, every, steps, expected", [
    (True, True, 2, 5, [("start", 0), ("periodic", 2), ("periodic", 4), ("end", 5)]),
    # The last step's weights are evaluated once: as the end's evaluation.
    (False, True, 2, 4, [("periodic", 2), ("end", 4)]),
    (False, False, 2, 4, [("periodic", 2), ("periodic", 4)]),
    (False, True, 0, 5, [("end", 5)]),
    (False, False, 0, 5, []),
])
def test_a_replay_evaluates_when_the_eval_keys_say(at_start, at_end, every, steps, expected):
    cfg = load([f"eval.at_start={str(at_start).lower()}", f"eval.at_end={str(at_end).lower()}",
                f"eval.every_steps={every}", "progress=false"])
    evaluator = FakeEvaluator(every)
    entries = _train(cfg, FakeLearner(), steps, evaluator, ListSink(), 0.0)
    assert evaluator.calls == expected
    assert ("eval_accuracy_end" in entries) == at_end and ("eval_accuracy_start" in entries) == at_start


def test_a_replay_studys_report_gives_paired_and_unpaired_intervals_and_the_variance_ratio(tmp_path):
    from asyncgrpo.study.report import aggregate

    spec = Spec.parse(replay_spec(["/r/a", "/r/b", "/r/c"]))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    # By recording: bypass 0.2, 0.4, 0.6 (var 0.04); naive 0.3, 0.4, 0.5 (var 0.01); naive - bypass
    # 0.1, 0, -0.1 (var 0.01): pairing divides the variance by (0.04 + 0.01) / 0.01 = 5.
    accuracy = {"bypass": [0.2, 0.4, 0.6], "naive": [0.3, 0.4, 0.5]}
    for plan in spec.runs(tmp_path):
        plan.run_dir.mkdir(parents=True)
        end = accuracy[plan.cell.values["correction"]][plan.seed]
        (plan.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval/accuracy": end}) + "\n")
        (plan.run_dir / "summary.json").write_text(json.dumps(
            {"status": "finished", "steps": 5, "eval_accuracy_end": end, "eval_greedy_accuracy_end": end}))
    aggregate(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "`asyncgrpo replay` of one recording" in report and "preset `" not in report
    assert "**Replays**" in report and "**Engines" not in report
    section = report.split("## Paired on identical samples against independent runs")[1]
    row = next(line for line in section.splitlines() if line.startswith("| naive | held-out acc. end |"))
    assert row.split(" | ")[2:4] == ["3", "+0.000 [-0.248, 0.248]"] and row.endswith("| 5.00 |")
