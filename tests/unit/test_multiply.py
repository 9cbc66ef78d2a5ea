"""The multiply task: references that are calculator episodes with the tool and bare products without,
a held-out split, and a score on the last line only."""

import itertools

import pytest

from one_line import raises_one_line
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.envs import make_environment
from asyncgrpo.schema import ConfigError, EnvConfig
from asyncgrpo.tasks import MultiplyTask
from asyncgrpo.tasks.multiply import tool_trace
from asyncgrpo.tasks.problem import Problem, reference_completion, reference_segments

from episode_replay import replay

PRESET = ["task.name=multiply", "rollout.max_new_tokens=32", "model.max_positions=64"]


def task(tool: bool, eval_size: int = 500) -> MultiplyTask:
    return MultiplyTask(left_digits=3, right_digits=2, eval_size=eval_size, tool=tool)


def test_with_the_tool_the_reference_is_the_call_the_calculators_answer_and_the_product():
    assert tool_trace(123, 45) == ("[123*45]=5535\n5535", ((8, 14),))
    problem = task(tool=True).problem(7)
    left, right = (int(x) for x in problem.prompt.removesuffix("=").split("*"))
    product = str(left * right)
    assert reference_segments(problem) == [(f"[{left}*{right}]", True), (f"={product}\n", False), (product, True)]


def test_without_the_tool_the_reference_is_the_product_alone():
    problem = task(tool=False).problem(7)
    left, right = (int(x) for x in problem.prompt.removesuffix("=").split("*"))
    assert reference_completion(problem) == problem.answer == str(left * right)
    assert reference_segments(problem) == [(problem.answer, True)]


@settings(max_examples=300, deadline=None)
@given(problem_id=st.integers(0, 2**31 - 1), left_digits=st.integers(1, 9), right_digits=st.integers(1, 9))
def test_every_tool_reference_replays_exactly_under_the_calculator_and_scores_one(problem_id, left_digits, right_digits):
    """The call, fed to the calculator as the episode runner would (the turn ends at "]"), gives back the
    reference's observation; the policy's last turn is the product; the lengths fit max_answer_chars."""
    multiply = MultiplyTask(left_digits=left_digits, right_digits=right_digits, eval_size=1, tool=True)
    problem = multiply.problem(problem_id)
    left, right = (int(x) for x in problem.prompt.removesuffix("=").split("*"))
    assert (len(str(left)), len(str(right))) == (left_digits, right_digits)
    episode = replay(make_environment(EnvConfig(name="calculator")), problem)
    assert episode.bad_actions == 0 and not episode.done and episode.turns == 2
    assert multiply.score(episode.last_turn, problem) == 1.0
    assert len(reference_completion(problem)) <= multiply.max_answer_chars
    assert multiply.problem(problem_id) == problem


def test_max_answer_chars_is_reached_by_the_largest_operands():
    assert task(tool=True).max_answer_chars == len(tool_trace(999, 99)[0])
    assert task(tool=False).max_answer_chars == len(str(999 * 99))


def test_training_never_draws_a_held_out_problem_and_the_split_is_the_same_for_every_seed():
    multiply = task(tool=True)
    held_out = {p.prompt for p in multiply.eval_problems()}
    assert len(held_out) > 490  # independent draws: a few of the 81,000 prompts come twice
    assert [p.prompt for p in task(tool=False).eval_problems()] == [p.prompt for p in multiply.eval_problems()]
    for seed in (0, 1):
        drawn = list(itertools.islice(multiply.train_problems(seed), 3000))
        assert not held_out & {p.prompt for p in drawn}
    assert [p.prompt for p in itertools.islice(multiply.train_problems(0), 50)] != \
        [p.prompt for p in itertools.islice(multiply.train_problems(1), 50)]


def test_training_skips_held_out_prompts_when_ids_collide_on_a_small_grid():
    # 1x1 digits: 100 problems, 20 held out, so many training draws repeat a held-out prompt.
    small = MultiplyTask(left_digits=1, right_digits=1, eval_size=20, tool=False)
    held_out = {p.prompt for p in small.eval_problems()}
    drawn = {p.prompt for p in itertools.islice(small.train_problems(0), 2000)}
    assert not held_out & drawn and len(drawn) > 50


@pytest.mark.parametrize(("text", "score"), [
    ("5535", 1.0), ("5535\n", 1.0), ("5535<eos>", 1.0), ("[123*45]=5535\n5535", 1.0),
    ("[123*45]", 0.0),  # a call as the last turn: no answer
    ("=5535\n", 0.0),  # an observation's text is not an answer
    ("5536", 0.0), ("05535", 0.0), ("", 0.0),
])
def test_the_score_is_the_last_line_against_the_product(text, score):
    assert task(tool=True).score(text, Problem(id=0, prompt="123*45=", answer="5535")) == score


def test_the_tool_flag_follows_env_name_and_changes_the_settings():
    with_tool = run_task(load([*PRESET, "env.name=calculator"]))
    without = run_task(load(PRESET))
    assert with_tool.tool and with_tool.environment == "calculator"
    assert not without.tool and without.environment == ""
    assert with_tool.settings() != without.settings()  # so their warm starts are cached apart


@pytest.mark.parametrize(("overrides", "key"), [
    (["task.multiply_left_digits=0"], "task.multiply_left_digits"),
    (["task.multiply_right_digits=10"], "task.multiply_right_digits"),
    (["task.multiply_left_digits=1", "task.multiply_right_digits=1", "task.eval_size=50"], "task.eval_size"),
    (["env.name=calculator", "rollout.max_new_tokens=16"], "rollout.max_new_tokens"),
    (["env.name=calculator", "model.max_positions=32"], "model.max_positions"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(overrides, key):
    with raises_one_line(ConfigError, match=key.replace(".", r"\.")):
        load([*PRESET, *overrides])
