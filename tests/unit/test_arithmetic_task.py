import itertools

import pytest

from asyncgrpo.tasks import ArithmeticTask, Problem


def test_prompt_and_answer_format() -> None:
    task = ArithmeticTask(num_digits=2, eval_size=500)
    problem = task.problem(task.problem_id(37, 48))
    assert problem.prompt == "37+48="
    assert problem.answer == "85"


def test_problem_ids_cover_two_digit_operands_once() -> None:
    task = ArithmeticTask(num_digits=2, eval_size=500)
    prompts = {task.problem(i).prompt for i in range(task.num_problems)}
    assert task.num_problems == 90 * 90
    assert len(prompts) == task.num_problems
    assert "10+10=" in prompts and "99+99=" in prompts and "9+10=" not in prompts


def test_eval_split_is_fixed_and_sized() -> None:
    first = ArithmeticTask(num_digits=2, eval_size=500).eval_problems()
    again = ArithmeticTask(num_digits=2, eval_size=500).eval_problems()
    assert len(first) == 500
    assert first == again
    assert len({p.id for p in first}) == 500
    assert ArithmeticTask(num_digits=2, eval_size=500, split_seed=1).eval_problems() != first


def test_train_stream_excludes_eval_and_is_deterministic_by_seed() -> None:
    task = ArithmeticTask(num_digits=2, eval_size=500)
    eval_ids = {p.id for p in task.eval_problems()}
    train_pass = list(itertools.islice(task.train_problems(seed=0), task.num_problems - 500))
    assert {p.id for p in train_pass}.isdisjoint(eval_ids)
    assert len({p.id for p in train_pass}) == len(train_pass)

    same = list(itertools.islice(task.train_problems(seed=0), 50))
    other = list(itertools.islice(task.train_problems(seed=1), 50))
    assert same == train_pass[:50]
    assert other != same


def test_train_stream_is_infinite() -> None:
    task = ArithmeticTask(num_digits=1, eval_size=10)
    problems = list(itertools.islice(task.train_problems(seed=3), 3 * task.num_problems))
    assert len(problems) == 3 * task.num_problems
    assert all(isinstance(p, Problem) for p in problems)


def test_one_digit_operands_include_zero() -> None:
    task = ArithmeticTask(num_digits=1, eval_size=10)
    assert task.num_problems == 100
    assert task.problem(0) == Problem(id=0, prompt="0+0=", answer="0")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("85", 1.0),
        ("85<eos>", 1.0),
        ("85 \n", 1.0),
        ("85<eos><eos>", 1.0),
        ("8", 0.0),
        ("850", 0.0),
        (" 85", 0.0),
        ("85+1", 0.0),
        ("", 0.0),
    ],
)
def test_score_is_exact_match_ignoring_trailing_eos_and_whitespace(
    completion: str, expected: float
) -> None:
    task = ArithmeticTask(num_digits=2, eval_size=500)
    problem = Problem(id=0, prompt="37+48=", answer="85")
    assert task.score(completion, problem) == expected


def test_rejects_eval_size_not_smaller_than_problem_count() -> None:
    with pytest.raises(ValueError):
        ArithmeticTask(num_digits=1, eval_size=100)
