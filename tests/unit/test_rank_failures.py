"""How the driver ends a run whose learner rank fails outside its own code (tools/chaos.py found both
as a Ray traceback in summary.json's `error`): a rank's process that dies, and a full disk under a
checkpoint save. Each is a `TrainingFailed` with one line naming the rank and the cause."""

from __future__ import annotations

import pytest

from asyncgrpo.driver import TrainingFailed


def failing_get(error: BaseException):
    def get(ref):
        raise error

    return get


def test_a_rank_whose_process_died_fails_the_run_in_one_line_naming_it(monkeypatch):
    import ray
    from ray.exceptions import ActorDiedError

    from asyncgrpo.driver.loop import get_rank_result

    died = ActorDiedError()
    # What Ray says of a SIGKILLed actor: its details on the lines after the first.
    died.args = (("The actor died unexpectedly before finishing this task.\n\tclass_name: LearnerActor\n\tpid: 5640\n"
                  "The actor is dead because its worker process has died."),)
    monkeypatch.setattr(ActorDiedError, "__str__", lambda self: self.args[0])
    monkeypatch.setattr(ray, "get", failing_get(died))
    with pytest.raises(TrainingFailed) as failed:
        get_rank_result(object(), rank=1)
    message = str(failed.value)
    assert "\n" not in message and failed.value.__cause__ is None
    assert message.startswith("learner rank 1 (pid 5640) died: "
                              "The actor died unexpectedly before finishing this task; ")
    assert "resume=auto" in message


def test_a_full_disk_in_a_rank_fails_the_run_in_one_line_naming_the_error(monkeypatch):
    import ray
    from ray.exceptions import RayTaskError

    from asyncgrpo.driver.loop import get_rank_result

    full = OSError(28, "No space left on device", "/runs/a/checkpoints/step_150.tmp/dcp")
    wrapped = RayTaskError("LearnerActor.train_steps", "Traceback (most recent call last):\n  ...", full)
    monkeypatch.setattr(ray, "get", failing_get(wrapped.as_instanceof_cause()))
    with pytest.raises(TrainingFailed) as failed:
        get_rank_result(object())
    assert str(failed.value) == ("learner rank 0: OSError: [Errno 28] No space left on device: "
                                 "'/runs/a/checkpoints/step_150.tmp/dcp'")


def test_the_cli_prints_a_training_failure_as_its_one_line_reason_without_a_traceback(monkeypatch, tmp_path, capsys):
    import asyncgrpo.train
    from asyncgrpo import cli

    def train(cfg):
        raise TrainingFailed("learner rank 0 (pid 7) died: gone; resume=auto continues")

    monkeypatch.setattr(asyncgrpo.train, "train", train)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)  # leave pytest's own handlers alone
    assert cli.main(["train", f"run_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == ("asyncgrpo: training failed: TrainingFailed: "
                           f"learner rank 0 (pid 7) died: gone; resume=auto continues (run_dir: {tmp_path})")


def test_an_unexpected_failure_ends_on_one_line_that_names_the_run_dir(monkeypatch, tmp_path, capsys):
    import asyncgrpo.train
    from asyncgrpo import cli

    def train(cfg):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(asyncgrpo.train, "train", train)
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)
    assert cli.main(["train", f"run_dir={tmp_path}"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"asyncgrpo: training failed: RuntimeError: something broke (run_dir: {tmp_path})"
