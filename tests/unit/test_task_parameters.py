"""tasks.TASK_PARAMETERS names exactly the task.* keys each built-in task's problems depend on, as
`make_task` reads them: a resume is refused when one changes (composition.run_record) and another
task's are named as unread (inert_settings), so the table must agree with the code."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from asyncgrpo.composition import run_record
from asyncgrpo.learner.resume import ResumeRefused, check_compatible, record_differences
from asyncgrpo.schema import Config, TaskConfig
from asyncgrpo.tasks import FILE_TASKS, TASK_NAMES, TASK_PARAMETERS, make_task

BUILT_IN = [name for name in TASK_NAMES if name not in FILE_TASKS]
# Every task's, or what picks the task.
COMMON = ("name", "eval_size")
PARAMETER_KEYS = [f.name for f in dataclasses.fields(TaskConfig) if f.name not in COMMON]


def first_problems(cfg, count: int = 30) -> tuple[list[str], list[str]]:
    task = make_task(cfg, tool=False, context_tokens=1024)
    train = [p.prompt for p in itertools.islice(task.train_problems(seed=0), count)]
    return train, [p.prompt for p in task.eval_problems()[:count]]


def config_of(task: str) -> Config:
    """The schema's defaults with `task` (not validated: some tasks need a model the test has no use for)."""
    cfg = Config()
    cfg.task.name = task
    return cfg


def changed(value):
    return value * 1.5 if isinstance(value, float) else value + 1


def test_every_built_in_task_has_its_parameters_listed_and_every_parameter_key_belongs_to_one_task():
    assert set(TASK_PARAMETERS) == set(BUILT_IN)
    listed = [key for keys in TASK_PARAMETERS.values() for key in keys]
    assert sorted(listed) == sorted(PARAMETER_KEYS)


@pytest.mark.parametrize(("task", "key"), list(itertools.product(BUILT_IN, PARAMETER_KEYS)))
def test_a_task_parameter_changes_the_tasks_problems_exactly_when_it_is_listed_for_the_task(task, key):
    cfg = config_of(task)
    before = first_problems(cfg)
    setattr(cfg.task, key, changed(getattr(cfg.task, key)))
    assert (first_problems(cfg) != before) == (key in TASK_PARAMETERS[task])


@pytest.mark.parametrize("task", BUILT_IN)
def test_a_resume_is_refused_when_a_listed_parameter_of_its_task_changed(task):
    cfg = config_of(task)
    saved = run_record(cfg)
    for key in TASK_PARAMETERS[task]:
        other = config_of(task)
        setattr(other.task, key, changed(getattr(other.task, key)))
        assert [d.split("=")[0] for d in record_differences(saved, run_record(other))] == [f"task.{key}"]


def test_a_checkpoint_whose_record_predates_a_tasks_parameters_resumes_with_them_named_not_checked():
    # multiply and guess runs recorded only task.eval_size before TASK_PARAMETERS listed their keys.
    cfg = config_of("multiply")
    record = run_record(cfg)
    older = {key: value for key, value in record.items() if not key.startswith("task.multiply_")}
    lines: list[str] = []
    assert check_compatible({"run": older}, lambda: record, False, "step_3", lines.append) == []
    assert lines == ["[resume] warning: step_3's run record predates task.multiply_left_digits, "
                     "task.multiply_right_digits: not checked"]
    # Recorded, a changed value is refused as before.
    other = config_of("multiply")
    other.task.multiply_left_digits += 1
    with pytest.raises(ResumeRefused, match="task.multiply_left_digits=4"):
        check_compatible({"run": record}, lambda: run_record(other), False, "step_3", lines.append)
