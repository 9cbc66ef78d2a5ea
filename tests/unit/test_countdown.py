"""The countdown task: generated problems are solvable, and the check is exact and safe."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.tasks import CountdownTask
from asyncgrpo.tasks.countdown import countdown_reward


@settings(max_examples=200, deadline=None)
@given(problem_id=st.integers(0, 2**31 - 1), num_numbers=st.integers(2, 6))
def test_every_problem_is_solved_by_its_reference_equation(problem_id, num_numbers):
    task = CountdownTask(num_numbers=num_numbers, max_number=100, eval_size=10)
    problem = task.problem(problem_id)
    numbers, target = problem.extra["numbers"], problem.extra["target"]
    assert len(numbers) == num_numbers and all(1 <= n <= 100 for n in numbers)
    assert 1 <= target <= 1000
    assert str(numbers) in problem.prompt and str(target) in problem.prompt
    assert task.score(f"reasoning...\n<answer>{problem.answer}</answer>", problem) == 1.0
    assert task.problem(problem_id) == problem


def test_eval_split_is_fixed_and_training_never_repeats_it():
    task = CountdownTask(num_numbers=4, max_number=100, eval_size=50)
    held = task.eval_problems()
    assert held == CountdownTask(num_numbers=4, max_number=100, eval_size=50).eval_problems() and len(held) == 50
    keys = {(tuple(sorted(p.extra["numbers"])), p.extra["target"]) for p in held}
    train = list(itertools.islice(task.train_problems(seed=0), 300))
    assert not keys & {(tuple(sorted(p.extra["numbers"])), p.extra["target"]) for p in train}
    assert train[:20] == list(itertools.islice(task.train_problems(seed=0), 20))
    assert train[:20] != list(itertools.islice(task.train_problems(seed=1), 20))


@pytest.mark.parametrize(("answer", "score"), [
    ("(25 - 7) * 3", 1.0),
    ("3 * (25 - 7)", 1.0),
    ("(25 - 7) * 3 = 54", 1.0),
    ("(25-7)*3", 1.0),
    ("25 - 7 * 3", 0.0),  # wrong value
    ("(25 - 7) * 3 + 0", 0.0),  # a number not given
    ("(25 - 7) * 3 * 1", 0.0),
    ("25 * 3 - 7 - 7 - 7", 0.0),  # reuses a number
    ("(25 - 7) * 3.0", 0.0),  # not an integer literal
    ("-(7 - 25) * 3", 0.0),  # unary minus is not an operation
    ("__import__('os').getpid()", 0.0),
    ("(25 - 7) ** 3", 0.0),
    ("", 0.0),
])
def test_check_requires_each_number_once_and_the_exact_value(answer, score):
    assert countdown_reward(f"<answer>{answer}</answer>", [25, 7, 3], 54) == score


def test_division_is_exact_and_the_last_answer_counts():
    assert countdown_reward("<answer>(6 / 4) * 2</answer>", [6, 4, 2], 3) == 1.0
    assert countdown_reward("<answer>4 / (6 - 6)</answer>", [4, 6, 6], 1) == 0.0
    assert countdown_reward("<answer>1 + 2</answer> then <answer>1 * 2</answer>", [1, 2], 3) == 0.0
    assert countdown_reward("no tags: 1 + 2", [1, 2], 3) == 0.0


def test_make_task_builds_countdown_from_config():
    task = run_task(load(["task.name=countdown", "model.path=/m", "task.countdown_numbers=3",
                           "task.countdown_max_number=20", "task.eval_size=7"]))
    assert isinstance(task, CountdownTask) and len(task.eval_problems()) == 7
    assert all(max(p.extra["numbers"]) <= 20 and len(p.extra["numbers"]) == 3 for p in task.eval_problems())
