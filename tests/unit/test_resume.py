"""Resuming: resume=auto finds the newest complete checkpoint in run_dir (or starts fresh), a
checkpoint records the settings that define the prompt streams and a resume that changes them is
refused in one line before Ray starts, a run_dir used before keeps its earlier files, and the
driver's interrupt handling around start-up. Real `checkpoint.save` on a few tensors; no Ray."""

from __future__ import annotations

import json
import os
import shutil
import signal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncgrpo.config import load

from asyncgrpo.composition import run_record
from asyncgrpo.driver import prepare
from asyncgrpo.driver.prepare import (
    interrupt_on_sigterm,
    resume_point,
)
from asyncgrpo.runtime.interrupts import interrupt_signals_noted, interrupts_deferred, interrupts_held
from asyncgrpo.learner import checkpoint
from asyncgrpo.learner.resume import (
    ResumeRefused,
    check_compatible,
    file_sha256,
    record_differences,
)
from asyncgrpo.train import keep_earlier_run_files

# DCP without a process group says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Weights:
    """A ShardedState of two tensors: what the policy hands DCP, reduced."""

    def state_dict(self) -> dict[str, Any]:
        return {"model": {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def config(tmp_path: Path, *overrides: str):
    return load([f"run_dir={tmp_path / 'run'}", *overrides])


def save(cfg, version: int, run: dict[str, Any] | None, keep: int = 0) -> Path:
    model_dir = Path(cfg.run_dir).parent / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return checkpoint.save(Path(cfg.run_dir) / "checkpoints", version, Weights(), {"learner": {"samples": 0}},
                           model_dir=str(model_dir), rank=0, world_size=1, keep=keep, run=run)


def compatible(meta: dict[str, Any], cfg, checkpoint: str, log) -> list[str]:
    """`check_compatible` as the driver calls it (asyncgrpo/driver/prepare.py)."""
    return check_compatible(meta, partial(run_record, cfg), cfg.resume_allow_changes, checkpoint, log)


def refusal(meta: dict[str, Any], cfg) -> str:
    with pytest.raises(ResumeRefused) as err:
        compatible(meta, cfg, "runs/a/checkpoints/step_3", log=lambda line: None)
    message = str(err.value)
    assert "\n" not in message and "resume_allow_changes=true" in message
    return message


# ------------------------------------------------------------------------------- resume=auto


def test_resume_auto_without_a_checkpoint_is_a_fresh_start_and_says_so(tmp_path):
    lines: list[str] = []
    assert resume_point(config(tmp_path, "resume=auto"), log=lines.append) is None
    assert lines == [f"[resume] auto: no complete checkpoint in {tmp_path / 'run' / 'checkpoints'}; a fresh start"]


def test_resume_auto_takes_the_newest_complete_checkpoint_ignoring_tmp_and_unmarked_ones(tmp_path):
    cfg = config(tmp_path, "resume=auto")
    for version in (2, 10, 9):  # numeric order, not the order written nor the names' order
        save(cfg, version, run_record(cfg))
    newest = Path(cfg.run_dir) / "checkpoints" / "step_10"
    # A save killed midway (step_12.tmp, even with every file in it) and one without COMPLETE.
    shutil.copytree(newest, newest.with_name("step_12.tmp"))
    shutil.copytree(newest, newest.with_name("step_11"))
    (newest.with_name("step_11") / checkpoint.MARKER).unlink()
    lines: list[str] = []
    resume = resume_point(cfg, log=lines.append)
    assert resume is not None and resume["path"] == str(newest) and resume["version"] == 10
    assert lines == [f"[resume] auto: continuing from {newest}"]


def test_resume_auto_refuses_a_tampered_newest_checkpoint_rather_than_falling_back(tmp_path):
    cfg = config(tmp_path, "resume=auto")
    save(cfg, 1, run_record(cfg))
    newest = save(cfg, 2, run_record(cfg))
    (newest / "rng" / "rank_0.json").write_text("{}")
    with pytest.raises(checkpoint.CheckpointError, match="rng/rank_0.json"):
        resume_point(cfg, log=lambda line: None)


def test_resume_auto_is_a_valid_config_value_and_a_missing_path_is_not():
    assert load(["resume=auto"]).resume == "auto"
    from asyncgrpo.schema import ConfigError

    with pytest.raises(ConfigError, match="must be auto, a checkpoint directory or a run directory"):
        load(["resume=no/such/run"])


# ---------------------------------------------------------------------------------- lineages


def start(tmp_path: Path, *overrides: str) -> tuple[Any, dict[str, Any] | None]:
    """A run's start as the driver makes it (its config, and its resume point, which also records
    the lineage the run continues); `overrides` name its resume."""
    cfg = config(tmp_path, *overrides)
    return cfg, resume_point(cfg, log=lambda line: None)


def saved_steps(cfg) -> list[int]:
    return [int(p.name.split("_")[1]) for p in checkpoint.complete_checkpoints(Path(cfg.run_dir) / "checkpoints")]


def test_resume_auto_after_resuming_an_older_checkpoint_takes_the_newest_of_that_run_not_the_abandoned_one(tmp_path):
    first, _ = start(tmp_path)
    for version in (2, 4, 6):
        save(first, version, run_record(first))
    older = Path(first.run_dir) / "checkpoints" / "step_2"
    second, resume = start(tmp_path, f"resume={older}")  # back to step 2: steps 3.. again, on another path
    assert resume is not None and resume["version"] == 2
    branch = save(second, 3, run_record(second))
    # Preempted at step 3, restarted with resume=auto: step_3 continues the run, step_6 is abandoned.
    again, resume = start(tmp_path, "resume=auto")
    assert resume is not None and resume["path"] == str(branch)
    assert checkpoint.latest(again.run_dir) == branch  # resume=RUN_DIR and `asyncgrpo export RUN_DIR` alike


def test_resume_auto_before_the_branching_run_saved_takes_the_checkpoint_it_started_from(tmp_path):
    first, _ = start(tmp_path)
    for version in (2, 4):
        save(first, version, run_record(first))
    older = Path(first.run_dir) / "checkpoints" / "step_2"
    start(tmp_path, f"resume={older}")  # killed before its first save
    _, resume = start(tmp_path, "resume=auto")
    assert resume is not None and resume["path"] == str(older)


def test_a_resumed_run_continues_the_lineage_it_resumes_and_a_branch_starts_a_new_one(tmp_path):
    first, _ = start(tmp_path)
    save(first, 2, run_record(first))
    newest = save(first, 4, run_record(first))
    lineage = checkpoint.read_meta(newest)["lineage"]
    assert lineage["from"] is None  # a fresh run
    # resume=auto, resume=RUN_DIR and resume=<its newest checkpoint> take the newest: the lineage goes on.
    for version, how in enumerate(("resume=auto", f"resume={first.run_dir}", "newest"), start=5):
        cfg, resume = start(tmp_path, f"resume={newest}" if how == "newest" else how)
        assert resume is not None and resume["path"] == str(newest), how
        newest = save(cfg, version, run_record(cfg))
        assert checkpoint.read_meta(newest)["lineage"] == lineage, how
    cfg, _ = start(tmp_path, f"resume={newest.with_name('step_2')}")
    branch = checkpoint.read_meta(save(cfg, 3, run_record(cfg)))["lineage"]
    assert branch["id"] != lineage["id"]
    assert branch["from"] == {"path": str(newest.with_name("step_2")), "version": 2, "lineage": lineage["id"]}


def test_pruning_removes_only_the_current_lineages_oldest_checkpoints(tmp_path):
    first, _ = start(tmp_path)
    for version in (2, 4, 6):
        save(first, version, run_record(first), keep=2)
    assert saved_steps(first) == [4, 6]
    second, _ = start(tmp_path, f"resume={Path(first.run_dir) / 'checkpoints' / 'step_4'}")
    # The branch's own step 5 and the step it started from stay; the abandoned step 6 is not its to prune.
    save(second, 5, run_record(second), keep=2)
    assert saved_steps(second) == [4, 5, 6]
    for version in (6, 7):  # its step 6 replaces the abandoned one
        save(second, version, run_record(second), keep=2)
    assert saved_steps(second) == [4, 6, 7]


def test_a_fresh_run_in_a_used_run_dir_starts_a_lineage_of_its_own(tmp_path):
    first, _ = start(tmp_path)
    save(first, 8, run_record(first))
    second, _ = start(tmp_path)  # no resume: it starts over
    mine = save(second, 2, run_record(second), keep=1)
    assert saved_steps(second) == [2, 8]  # the earlier run's step 8 is not pruned by this one's keep
    _, resume = start(tmp_path, "resume=auto")
    assert resume is not None and resume["path"] == str(mine)


def test_checkpoints_from_before_lineages_still_resume_and_are_left_alone_by_pruning(tmp_path):
    legacy = config(tmp_path)
    for version in (2, 4):  # saved with no LINEAGE.json in the directory, as before lineages
        save(legacy, version, run_record(legacy))
    assert checkpoint.read_meta(Path(legacy.run_dir) / "checkpoints" / "step_4")["lineage"] is None
    cfg, resume = start(tmp_path, "resume=auto")  # one legacy lineage: its highest step
    assert resume is not None and resume["version"] == 4
    for version in (5, 6):
        save(cfg, version, run_record(cfg), keep=1)
    assert saved_steps(cfg) == [2, 4, 6]


def test_an_unreadable_lineage_file_is_one_line_naming_it(tmp_path):
    cfg, _ = start(tmp_path)
    save(cfg, 2, run_record(cfg))
    (Path(cfg.run_dir) / "checkpoints" / checkpoint.LINEAGE).write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match=checkpoint.LINEAGE) as err:
        start(tmp_path, "resume=auto")
    assert "\n" not in str(err.value)


# -------------------------------------------------------------------------- the run record


def test_a_checkpoint_written_by_the_learner_records_the_run(tmp_path):
    cfg = config(tmp_path, "rollout.num_generators=2", "seed=5")
    meta = checkpoint.read_meta(save(cfg, 3, run_record(cfg)))
    assert meta["run"] == {"rollout.num_generators": 2, "rollout.dispatch": "tickets", "task.name": "arithmetic",
                           "seed": 5, "task.num_digits": 2, "task.eval_size": 500}


def test_the_same_settings_resume_without_a_word(tmp_path):
    cfg = config(tmp_path)
    lines: list[str] = []
    assert compatible({"run": run_record(cfg)}, cfg, "ckpt", log=lines.append) == [] and lines == []


@pytest.mark.parametrize(("change", "named"), [
    ("rollout.num_generators=2", "rollout.num_generators=2 (the checkpoint's run: 1)"),
    ("task.name=countdown", "task.name='countdown' (the checkpoint's run: 'arithmetic')"),
    ("task.num_digits=3", "task.num_digits=3 (the checkpoint's run: 2)"),
    ("seed=7", "seed=7 (the checkpoint's run: 0)"),
])
def test_each_changed_setting_is_refused_in_one_line_naming_it(tmp_path, change, named):
    saved = {"run": run_record(config(tmp_path))}
    message = refusal(saved, config(tmp_path, change, "model.path=any"))  # countdown needs one; not recorded
    assert named in message
    assert message.count("(the checkpoint's run:") == 1  # another task: only its name, not its parameters


def test_two_changes_are_both_named_on_the_one_line(tmp_path):
    saved = {"run": run_record(config(tmp_path))}
    message = refusal(saved, config(tmp_path, "rollout.num_generators=2", "seed=1"))
    assert "rollout.num_generators=2" in message and "seed=1" in message


def data_config(tmp_path: Path, *files: Path, extra: tuple[str, ...] = ()):
    return config(tmp_path, "task.name=files", f"data.train_files=[{','.join(str(f) for f in files)}]", *extra)


def test_a_data_file_hash_changes_with_its_contents_and_a_changed_file_is_refused(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n')
    before = file_sha256(data)
    saved = {"run": run_record(data_config(tmp_path, data))}
    assert saved["run"]["data.train_files"] == [{"path": str(data.resolve()), "sha256": before}]
    data.write_text('{"question": "1+2=", "answer": "3"}\n')
    assert file_sha256(data) != before
    message = refusal(saved, data_config(tmp_path, data))
    assert f"data.train_files[0] {data.resolve()} has other contents" in message and before[:12] in message


def test_a_moved_data_file_with_the_same_contents_resumes(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n')
    saved = {"run": run_record(data_config(tmp_path, data))}
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(data, moved)
    assert compatible(saved, data_config(tmp_path, moved), "ckpt", log=lambda line: None) == []


def test_another_number_of_data_files_is_refused(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"question": "1+1=", "answer": "2"}\n')
    b.write_text('{"question": "2+2=", "answer": "4"}\n')
    saved = {"run": run_record(data_config(tmp_path, a))}
    assert "data.train_files has 2 file(s), the checkpoint's run had 1" in refusal(saved, data_config(tmp_path, a, b))


def test_resume_allow_changes_goes_on_and_logs_what_differs(tmp_path):
    saved = {"run": run_record(config(tmp_path))}
    lines: list[str] = []
    cfg = config(tmp_path, "rollout.num_generators=2", "resume_allow_changes=true")
    assert compatible(saved, cfg, "ckpt", log=lines.append) == ["rollout.num_generators=2 (the checkpoint's run: 1)"]
    assert len(lines) == 1 and lines[0].startswith("[resume] warning: resuming ckpt despite changes")


def test_a_checkpoint_without_a_run_record_is_refused_unless_allowed(tmp_path):
    tickets = {"format": 3, "states": {"queue": {"counters": {}, "dispatch": {"step": 3}}}}
    message = refusal(tickets, config(tmp_path))
    assert "records no run settings" in message
    lines: list[str] = []
    compatible(tickets, config(tmp_path, "resume_allow_changes=true"), "ckpt", log=lines.append)
    assert len(lines) == 1 and "resuming unchecked" in lines[0]


def test_record_differences_of_equal_records_is_empty():
    record = {"rollout.num_generators": 1, "task.name": "files", "seed": 0, "task.eval_size": 5,
              "data.train_files": [{"path": "/a", "sha256": "00"}]}
    assert record_differences(record, dict(record)) == []


# ------------------------------------------------------------------------------------ the CLI


def test_an_incompatible_resume_exits_2_in_one_line_before_the_model_or_ray_start(tmp_path, capsys, monkeypatch):
    from asyncgrpo import cli, train

    written = config(tmp_path, "rollout.num_generators=2")
    save(written, 4, run_record(written))

    def must_not_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the run went past the resume check")

    monkeypatch.setattr(train, "starting_model", must_not_run)
    monkeypatch.setattr(train, "start_ray", must_not_run)
    code = cli.main(["train", f"run_dir={tmp_path / 'run'}", "resume=auto", "rollout.num_generators=1",
                     "progress=false"])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("asyncgrpo: resume: ") and "rollout.num_generators=1 (the checkpoint's run: 2)" in line
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("ResumeRefused: ")


# ------------------------------------------------------------------------- a run_dir used again


def test_a_run_dir_used_again_keeps_its_earlier_summary_and_config_in_order(tmp_path, capsys):
    run_dir = tmp_path / "run"
    keep_earlier_run_files(run_dir.parent)  # nothing there: nothing moved, nothing said
    run_dir.mkdir()
    assert capsys.readouterr().out == ""
    for segment in ("first", "second"):
        (run_dir / "summary.json").write_text(json.dumps({"status": segment}))
        (run_dir / "config.yaml").write_text(f"seed: {segment}\n")
        (run_dir / "metrics.jsonl").write_text("{}\n")
        keep_earlier_run_files(run_dir)
    assert json.loads((run_dir / "summary.1.json").read_text()) == {"status": "first"}
    assert json.loads((run_dir / "summary.2.json").read_text()) == {"status": "second"}
    assert (run_dir / "config.2.yaml").read_text() == "seed: second\n"
    assert not (run_dir / "summary.json").exists() and (run_dir / "metrics.jsonl").exists()
    assert "kept with suffix .2" in capsys.readouterr().out


# ----------------------------------------------------------------------- interrupts at start-up


@pytest.fixture
def sigterm_interrupts():
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, previous[0])
    signal.signal(signal.SIGINT, previous[1])


def test_an_interrupt_while_stopping_is_reported_and_ignored_then_interrupts_work_again(sigterm_interrupts, capsys):
    with interrupts_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert capsys.readouterr().out.count("ignored: already stopping the run") == 2
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode


def test_an_interrupt_inside_a_held_block_takes_effect_once_as_the_block_ends(sigterm_interrupts):
    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # a repeated notice: one interrupt
            done.append("the whole block")
    assert done == ["the whole block"]
    with interrupts_held():
        pass  # nothing held: nothing raised
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # the handlers are back


def test_sigterm_during_ray_init_is_an_interrupt_and_shuts_down_what_ray_started(sigterm_interrupts, monkeypatch,
                                                                                 tmp_path):
    import ray

    calls: list[str] = []

    def init(**kwargs: Any) -> None:
        calls.append("init")
        signal.signal(signal.SIGTERM, lambda signum, frame: exit(signum))  # as ray.init's own handler does
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        prepare.start_ray(config(tmp_path))
    assert calls == ["init", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) is prepare._raise_interrupt  # ours again, not Ray's


class RaisesInDel:
    """Sends this process `signum` from its __del__: the handler then runs inside __del__, where Python
    prints an exception instead of raising it ("Exception ignored in ..."), as in an at-fork hook."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        sum(range(10))  # a few bytecodes: the handler runs here, inside __del__


def test_a_sigterm_whose_exception_python_drops_inside_ray_init_still_interrupts_the_start(sigterm_interrupts,
                                                                                           monkeypatch, tmp_path):
    # Seen in CI: Ray's handler raised SystemExit inside logging's at-fork hook, Python printed it,
    # and ray.init returned as if no SIGTERM had come: the run trained on, SIGTERM ignored.
    import ray

    calls: list[str] = []

    def init(**kwargs: Any) -> None:
        calls.append("init")
        signal.signal(signal.SIGTERM, lambda signum, frame: exit(signum))  # as ray.init's own handler does
        RaisesInDel(signal.SIGTERM)  # dropped at once: its SystemExit is printed, not raised
        calls.append("init returned")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        prepare.start_ray(config(tmp_path))
    assert calls == ["init", "init returned", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) is prepare._raise_interrupt


def test_interrupt_signals_noted_lists_signals_whose_handler_exception_was_dropped(sigterm_interrupts):
    with interrupt_signals_noted() as noted:
        RaisesInDel(signal.SIGINT)
        RaisesInDel(signal.SIGTERM)
        assert noted == []  # filled in when the block ends
    assert noted == [signal.SIGINT, signal.SIGTERM]
    with interrupt_signals_noted() as quiet:
        pass
    assert quiet == []


# ------------------------------------------------------------- the interrupt checkpoint's steps


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


class InterruptedLearner:
    """A learner whose call of steps `interrupt_at` is in is interrupted in the driver's wait (Ctrl-C):
    the ranks go on and finish that call, whose records `steps_in_progress` then returns (or raises
    `again`: a second Ctrl-C during that wait)."""

    def __init__(self, interrupt_at: int, again: BaseException | None = None) -> None:
        self.version, self.interrupt_at, self.again = 0, interrupt_at, again
        self.in_progress: list[dict[str, float]] = []

    def records(self, k: int) -> list[dict[str, float]]:
        out = []
        for _ in range(k):
            self.version += 1
            out.append({"step": self.version, "samples": 8 * self.version, "reward/mean": 0.5,
                        "staleness/max": 0, "queue/dropped_stale": 0, "loss/pg": 1.0})
        return out

    def train_steps(self, k: int) -> list[dict[str, float]]:
        records = self.records(k)
        if self.version >= self.interrupt_at:
            self.in_progress = records
            raise KeyboardInterrupt("SIGTERM")
        return records

    def steps_in_progress(self) -> list[dict[str, float]]:
        if self.again is not None:
            raise self.again
        records, self.in_progress = self.in_progress, []
        return records

    def recent_samples(self, k: int) -> list[dict[str, Any]]:
        return []


def loop_config(tmp_path: Path, *overrides: str):
    return config(tmp_path, "progress=false", "train.max_steps=100", "train.steps_per_call=4",
                  "log.samples_every_steps=0", *overrides)


def test_an_interrupt_logs_the_steps_of_the_call_in_progress_before_it_checkpoints(tmp_path):
    from asyncgrpo.driver.loop import run_loop
    from asyncgrpo.metrics import SampleLogger

    learner, metrics, summary = InterruptedLearner(interrupt_at=6), ListSink(), {}
    with pytest.raises(KeyboardInterrupt):
        run_loop(loop_config(tmp_path), learner, metrics, SampleLogger(tmp_path, str), summary)
    # The checkpoint saved next is of step 8 (the ranks finish their call): steps 5-8 are logged too.
    assert [r["step"] for r in metrics.records] == list(range(1, 9))
    assert summary["steps"] == 8


@pytest.mark.parametrize("again", [KeyboardInterrupt("SIGINT"), TimeoutError("no learner progress for 60 s")])
def test_when_the_steps_in_progress_cannot_be_logged_no_interrupt_checkpoint_is_saved(tmp_path, again, capsys):
    from asyncgrpo.driver.loop import StepsNotLogged, run_loop
    from asyncgrpo.metrics import SampleLogger
    from asyncgrpo.train import save_on_interrupt

    learner, metrics = InterruptedLearner(interrupt_at=6, again=again), ListSink()
    with pytest.raises(StepsNotLogged) as err:
        run_loop(loop_config(tmp_path), learner, metrics, SampleLogger(tmp_path, str), {})
    assert [r["step"] for r in metrics.records] == [1, 2, 3, 4]

    class Actors:
        def save_checkpoint(self) -> str:
            raise AssertionError("a checkpoint of steps whose metrics are not written")

    assert save_on_interrupt(Actors(), err.value) is None
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[interrupt] no checkpoint")]
    assert type(again).__name__ in line


def test_without_an_interrupt_checkpoint_the_loop_does_not_wait_for_the_steps_in_progress(tmp_path):
    from asyncgrpo.driver.loop import run_loop
    from asyncgrpo.metrics import SampleLogger

    learner = InterruptedLearner(interrupt_at=6, again=AssertionError("waited"))
    with pytest.raises(KeyboardInterrupt) as err:
        run_loop(loop_config(tmp_path, "train.checkpoint_on_interrupt=false"), learner, ListSink(),
                 SampleLogger(tmp_path, str), {})
    assert str(err.value) == "SIGTERM"


def test_remote_learner_steps_in_progress_are_the_interrupted_calls_records(tmp_path, monkeypatch):
    from asyncgrpo.driver import loop

    class Method:
        def remote(self, k: int) -> tuple[str, int]:
            return ("call", k)

    class Rank:
        train_steps = Method()

    waits: list[Any] = []

    def wait_for_ranks(pending: list[Any], runs: list[Any], timeout_s: float, *args: Any) -> list[dict[str, int]]:
        waits.append(list(pending))
        if len(waits) == 1:
            raise KeyboardInterrupt("SIGINT")  # Ctrl-C in the driver's wait
        return [{"step": k} for k in range(1, pending[0][1] + 1)]

    monkeypatch.setattr(loop, "wait_for_ranks", wait_for_ranks)
    remote = loop.RemoteLearner(config(tmp_path), [Rank(), Rank()], runs=[])
    assert remote.steps_in_progress() == []  # no call made
    with pytest.raises(KeyboardInterrupt):
        remote.train_steps(3)
    assert remote.steps_in_progress() == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert waits[1] == waits[0] == [("call", 3), ("call", 3)]  # the same call's results, not a new call
    assert remote.steps_in_progress() == []  # taken once
    # A call whose wait returned, its records not yet logged when the interrupt came: still there.
    assert remote.train_steps(2) == [{"step": 1}, {"step": 2}]
    assert remote.steps_in_progress() == [{"step": 1}, {"step": 2}] and remote.steps_in_progress() == []
    assert waits[-1] == [("call", 2), ("call", 2)]


class SignallingSink(ListSink):
    """Metrics that receive a SIGTERM while writing step `signal_at` (the interrupt arrives after
    the learner's call returned, while its records are being logged)."""

    def __init__(self, signal_at: int) -> None:
        super().__init__()
        self.signal_at = signal_at

    def write(self, record: dict[str, Any], step: int | None = None) -> None:
        if record["step"] == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        super().write(record, step)


class LastCallLearner(InterruptedLearner):
    """Never interrupted in its wait; `steps_in_progress` is the last call's records, logged or not
    (as `RemoteLearner`'s)."""

    def train_steps(self, k: int) -> list[dict[str, float]]:
        self.in_progress = self.records(k)
        return list(self.in_progress)


def test_an_interrupt_while_a_calls_steps_are_logged_logs_each_of_them_once(tmp_path, sigterm_interrupts):
    from asyncgrpo.driver.loop import run_loop
    from asyncgrpo.metrics import SampleLogger

    metrics, summary = SignallingSink(signal_at=6), {}
    with pytest.raises(KeyboardInterrupt):
        run_loop(loop_config(tmp_path), LastCallLearner(interrupt_at=0), metrics, SampleLogger(tmp_path, str), summary)
    # The interrupt's checkpoint is of step 8: steps 1-8 logged, each once.
    assert [r["step"] for r in metrics.records] == list(range(1, 9))
    assert summary["steps"] == 8


def test_a_resumed_run_logs_each_step_once_setting_aside_what_the_crashed_run_logged_after_its_checkpoint(
        tmp_path, monkeypatch):
    """A run that crashed at step 5 after checkpointing at step 3 logged steps 4 and 5; the resume
    trains them again, so metrics.jsonl keeps 1..3 and the resumed run's own 4, 5, ..."""
    import json

    from asyncgrpo import train as train_module

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))

    def run_actors(cfg, model_dir, metrics, summary, resume):
        for step in (4, 5, 6):
            metrics.write({"step": step})

    for name, value in {"resolve_device": lambda device: "cpu", "check_rewards": lambda cfg: {},
                        "resume_point": lambda cfg: {"version": 3, "path": "step_3"},
                        "starting_model": lambda cfg, resume, summary: "model",
                        "preflight": lambda cfg, model_dir: {}, "start_ray": lambda cfg: False,
                        "_run_actors": run_actors}.items():
        monkeypatch.setattr(train_module, name, value)
    train_module.train(load(overrides=[f"run_dir={run_dir}", "progress=false", "resume=auto"]))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    set_aside = [json.loads(line)["step"] for line in (run_dir / "metrics.abandoned.jsonl").read_text().splitlines()]
    assert set_aside == [4, 5]


@pytest.mark.parametrize("allow", ["false", "true"])
def test_a_checkpoint_written_under_shares_is_refused_in_one_line_naming_why(tmp_path, allow):
    cfg = config(tmp_path, f"resume_allow_changes={allow}")
    recorded = {**run_record(cfg), "rollout.dispatch": "shares"}
    unrecorded = {key: value for key, value in run_record(cfg).items() if key != "rollout.dispatch"}
    # Its record says so; a record from before it carried the dispatch, by a queue state without a
    # dispatcher; and a checkpoint without any record predates tickets.
    for meta in ({"run": recorded}, {"run": unrecorded, "states": {"queue": {"counters": {}}}}, {"format": 3}):
        with pytest.raises(ResumeRefused) as err:  # no setting resumes it: its prompts would be skipped
            compatible(meta, cfg, "ckpt", log=lambda line: None)
        message = str(err.value)
        assert "\n" not in message and "ckpt was written under the shares dispatch" in message \
            and "tickets is the only dispatch" in message


def test_a_tickets_checkpoint_resumes_whether_or_not_its_record_names_the_dispatch(tmp_path):
    cfg = config(tmp_path)
    unrecorded = {key: value for key, value in run_record(cfg).items() if key != "rollout.dispatch"}
    for run in ({**unrecorded, "rollout.dispatch": "tickets"}, unrecorded):
        meta = {"run": run, "states": {"queue": {"counters": {}, "dispatch": {"step": 3}}}}
        assert compatible(meta, cfg, "ckpt", log=lambda line: None) == []
