"""Verifiable tasks: problems with a prompt, a reference answer and the task's own check.

The interface is `Task` and `Problem` (asyncgrpo/tasks/problem.py). `make_task(cfg, ...)` builds the
configured task (the composition roots' `composition.run_task` hands it what it takes of other sections); `run_stream` is the run's one stream of training problems, which every generator
reads at the positions it is granted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncgrpo.tasks.arithmetic import ArithmeticTask
from asyncgrpo.tasks.countdown import CountdownTask
from asyncgrpo.tasks.guess import GuessTask
from asyncgrpo.tasks.longtail import LongtailTask
from asyncgrpo.tasks.multiply import MultiplyTask
from asyncgrpo.tasks.problem import Problem, Task

if TYPE_CHECKING:
    from asyncgrpo.schema import Config

__all__ = ["FILE_TASKS", "TASK_NAMES", "TASK_PARAMETERS", "ArithmeticTask", "CountdownTask", "GuessTask", "LongtailTask", "MultiplyTask",
           "Problem", "Task", "make_task", "run_stream"]

# task.name: each is built by `make_task`; the file tasks read their problems from data.* files.
TASK_NAMES = ("arithmetic", "countdown", "longtail", "multiply", "guess", "gsm8k", "files")
FILE_TASKS = ("gsm8k", "files")
# The task.* keys each built-in task's problems depend on beside task.eval_size (every task's), as
# `make_task` reads them: a resume is checked against them (composition.run_record), and another
# task's are named as unread (inert_settings).
TASK_PARAMETERS = {
    "arithmetic": ("num_digits",),
    "countdown": ("countdown_numbers", "countdown_max_number"),
    "longtail": ("longtail_min_digits", "longtail_max_digits", "longtail_exponent"),
    "multiply": ("multiply_left_digits", "multiply_right_digits"),
    "guess": ("guess_max",),
}


def make_task(cfg: Config, tokenizer: Any | None = None, *, tool: bool, context_tokens: int) -> Task:
    """The task of `cfg.task.name` (task.*, data.*). File tasks load (and check) their files now;
    `tokenizer`, if given, counts prompt tokens for the length filter (at most `context_tokens`, the
    context beside rollout.max_new_tokens) and applies data.chat_template. `tool`: the calculator
    environment is on (env.name), so a multiply task's references are episodes with it. The
    composition roots pass both (composition.run_task)."""
    name = cfg.task.name
    if name == "arithmetic":
        return ArithmeticTask(num_digits=cfg.task.num_digits, eval_size=cfg.task.eval_size)
    if name == "countdown":
        return CountdownTask(num_numbers=cfg.task.countdown_numbers, max_number=cfg.task.countdown_max_number,
                             eval_size=cfg.task.eval_size)
    if name == "longtail":
        return LongtailTask(min_digits=cfg.task.longtail_min_digits, max_digits=cfg.task.longtail_max_digits,
                            exponent=cfg.task.longtail_exponent, eval_size=cfg.task.eval_size)
    if name == "multiply":
        # The references are episodes with the calculator when it is on, plain products when not.
        return MultiplyTask(left_digits=cfg.task.multiply_left_digits, right_digits=cfg.task.multiply_right_digits,
                            eval_size=cfg.task.eval_size, tool=tool)
    if name == "guess":
        return GuessTask(max_number=cfg.task.guess_max, eval_size=cfg.task.eval_size)
    if name in FILE_TASKS:
        from asyncgrpo.tasks.files import FileTask
        from asyncgrpo.tasks.gsm8k import GSM8KTask

        task_class = GSM8KTask if name == "gsm8k" else FileTask
        return task_class(cfg.data, eval_size=cfg.task.eval_size, tokenizer=tokenizer, context_tokens=context_tokens)
    raise ValueError(f"task.name must be one of {', '.join(TASK_NAMES)}, got {name!r}")


def run_stream(task: Task, cfg: Config) -> Iterator[Problem]:
    """The run's one stream of training problems: every generator builds it alike and reads the
    positions it is granted. Built-in tasks: an endless stream seeded by the seed. File tasks: one
    seeded shuffle per epoch; the stream ends after data.epochs."""
    from asyncgrpo.tasks.files import FileTask

    if isinstance(task, FileTask):
        return task.train_problems(seed=cfg.seed)
    return task.train_problems(seed=cfg.seed * 1000)


def run_stream_length(task: Task, cfg: Config) -> int | None:
    """How many problems `run_stream` yields: a file task's prompts times data.epochs; None when
    endless (a built-in task, or data.epochs = 0)."""
    from asyncgrpo.tasks.files import FileTask

    if isinstance(task, FileTask) and cfg.data.epochs > 0:
        return task.num_train_problems * cfg.data.epochs
    return None
