"""The driver's training loop, with an in-process learner: chunks, metrics, summary, resume."""

import json

import pytest

from asyncgrpo.driver.loop import Progress, SampleSchedule, run_loop
from asyncgrpo.metrics import SampleLogger


class ListSink:
    def __init__(self):
        self.records = []

    def write(self, record, step=None):
        self.records.append(dict(record))

    def close(self):
        pass


class FakeLearner:
    """train_steps(k) returns k step records; `fail_at` raises at that step, as a dead rank would."""

    def __init__(self, version=0, fail_at=None):
        self.version, self.fail_at, self.calls = version, fail_at, []

    def train_steps(self, k):
        self.calls.append(k)
        records = []
        for _ in range(k):
            self.version += 1
            if self.version == self.fail_at:
                raise RuntimeError("rank 1 died")
            records.append({"step": self.version, "samples": 8 * self.version, "reward/mean": 0.1 * self.version,
                            "staleness/max": self.version % 3, "queue/dropped_stale": self.version // 4,
                            "queue/size": 2, "wire/bytes": 10, "loss": 1.0})
        return records

    def recent_samples(self, k):
        return []


def config(tmp_path, *overrides):
    from asyncgrpo.config import load

    return load([f"run_dir={tmp_path}", "progress=false", *overrides])


def never_logs(tmp_path):
    return SampleLogger(tmp_path, lambda ids: pytest.fail("no samples were due"))


def test_loop_asks_for_chunks_up_to_max_steps_and_writes_every_record(tmp_path):
    cfg = config(tmp_path, "train.max_steps=10", "train.steps_per_call=4", "log.samples_every_steps=0")
    learner, metrics, summary = FakeLearner(), ListSink(), {}
    run_loop(cfg, learner, metrics, never_logs(tmp_path), summary)
    assert learner.calls == [4, 4, 2]
    assert [r["step"] for r in metrics.records] == list(range(1, 11))
    walls = [r["time/wall_s"] for r in metrics.records]
    assert walls == sorted(walls)  # since the run started: never back
    assert summary["steps"] == 10 and summary["samples"] == 80
    assert summary["staleness_max"] == 2
    assert summary["groups_dropped_stale"] == 2
    assert summary["queue"] == {"queue/dropped_stale": 2, "queue/size": 2, "wire/bytes": 10}
    assert "resumed_at_step" not in summary and not (tmp_path / "samples.jsonl").exists()


def test_a_resumed_loop_goes_on_from_the_checkpoint_step(tmp_path):
    cfg = config(tmp_path, "train.max_steps=10", "train.steps_per_call=4", "log.samples_every_steps=0")
    resume = {"version": 6, "states": {"learner": {"samples": 48}, "queue": {"counters": {"queue/consumed": 96}}}}
    learner, summary = FakeLearner(version=6), {}
    run_loop(cfg, learner, ListSink(), never_logs(tmp_path), summary, resume)
    assert learner.calls == [4]
    assert summary["steps"] == 10 and summary["samples"] == 80
    assert summary["resumed_at_step"] == 6 and summary["queue_at_resume"] == {"queue/consumed": 96}


def test_a_failing_step_still_leaves_the_loops_figures_in_the_summary(tmp_path):
    cfg = config(tmp_path, "train.max_steps=10", "train.steps_per_call=2", "log.samples_every_steps=0")
    summary = {}
    with pytest.raises(RuntimeError, match="rank 1 died"):
        run_loop(cfg, FakeLearner(fail_at=5), ListSink(), never_logs(tmp_path), summary)
    assert summary["steps"] == 4 and summary["samples"] == 32 and "train_s" in summary


def test_sample_schedule_is_due_at_the_first_boundary_past_each_multiple():
    schedule = SampleSchedule(every=5)
    assert [step for step in (4, 8, 12, 16, 20, 23) if schedule.due(step)] == [8, 12, 16, 20]
    assert not any(SampleSchedule(every=0).due(step) for step in range(100))
    resumed = SampleSchedule(every=5, steps=10)  # a resumed run logs at the next multiple past its step
    assert not resumed.due(14) and resumed.due(15)


def test_progress_postfix_is_the_recent_mean_reward_and_the_worst_staleness():
    progress = Progress()
    progress.add([{"step": i, "samples": 4 * i, "reward/mean": float(i), "staleness/max": 0 if i < 30 else 3,
                   "queue/dropped_stale": 0}
                  for i in range(1, 41)])
    postfix = progress.postfix()
    assert postfix["reward"] == f"{sum(range(21, 41)) / 20:.3f}"  # the last 20 steps
    assert postfix["stale"] == 3
    assert json.dumps(progress.summary(None))


class DiedError(Exception):
    """Stands in for Ray's ActorDiedError."""


@pytest.mark.parametrize(("overrides", "reason"), [
    (["rollout.max_restarts=0"], r"generator 1 died \(DiedError: killed\) and rollout.max_restarts=0 allows no further"),
    (["weights.backend=nccl"], r"generator 1 died .* weights.backend=nccl cannot take a restarted generator"),
])
def test_a_restart_that_cannot_be_made_fails_the_run_naming_why(tmp_path, overrides, reason):
    from asyncgrpo.driver import TrainingFailed
    from asyncgrpo.driver.actors import Actors

    actors = Actors(config(tmp_path, "rollout.num_generators=2", "train.groups_per_step=2", *overrides), "model")
    with pytest.raises(TrainingFailed, match=reason):
        actors.restart_generator(1, DiedError("killed"))
    assert actors.restarts == [0, 0]  # nothing was started


def test_periodic_evaluations_are_written_after_the_chunk_that_brought_them(tmp_path):
    cfg = config(tmp_path, "train.max_steps=8", "train.steps_per_call=4", "log.samples_every_steps=0",
                 "eval.every_steps=2")
    learner, metrics = FakeLearner(), ListSink()
    handed = iter([[{"step": 2, "eval/accuracy": 0.5, "eval/greedy_accuracy": 0.6, "eval/when": "periodic"}],
                   [{"step": 4, "eval/accuracy": 0.7, "eval/greedy_accuracy": 0.8, "eval/when": "periodic"},
                    {"step": 6, "eval/accuracy": 0.75, "eval/greedy_accuracy": 0.8, "eval/when": "periodic"}]])
    run_loop(cfg, learner, metrics, never_logs(tmp_path), {}, evaluations=lambda: next(handed))
    written = [(r.get("eval/when", "step"), r["step"]) for r in metrics.records]
    assert written == [*[("step", s) for s in range(1, 5)], ("periodic", 2),
                       *[("step", s) for s in range(5, 9)], ("periodic", 4), ("periodic", 6)]
