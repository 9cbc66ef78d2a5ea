"""Guess the number: the environment's answers, the binary-search references, the held-out problems, the score."""

import math

import pytest

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.envs import make_environment
from asyncgrpo.envs.guess import CORRECT, HIGHER, LOWER, NOT_A_NUMBER
from asyncgrpo.schema import ConfigError, EnvConfig
from asyncgrpo.tasks import GuessTask
from asyncgrpo.tasks.guess import binary_search_trace, max_turns
from asyncgrpo.tasks.problem import Problem

from episode_replay import replay


def game(secret: int):
    spec = make_environment(EnvConfig(name="guess"))
    env = spec.new()
    assert env.reset(Problem(id=0, prompt="guess 1-64:", answer=str(secret))) == ""
    return spec, env


def test_the_environment_answers_higher_lower_and_correct_which_ends_the_episode_with_reward_one():
    spec, env = game(37)
    assert spec.stop == ("\n",)
    answers = [env.step(action) for action in ("32\n", "48\n", "37\n")]
    assert [a.observation for a in answers] == [HIGHER, LOWER, CORRECT]
    assert [(a.reward, a.done, a.bad_action) for a in answers] == [(0.0, False, False), (0.0, False, False),
                                                                   (1.0, True, False)]


@pytest.mark.parametrize("action", ["\n", "abc\n", "3 2\n", "-5\n", "1e3\n", "32 or 33\n", "9" * 12 + "\n", "٣\n"])
def test_a_turn_that_is_not_one_number_is_answered_with_a_question_mark_and_counted_bad(action):
    _, env = game(37)
    step = env.step(action)
    assert (step.observation, step.reward, step.done, step.bad_action) == (NOT_A_NUMBER, 0.0, False, True)


def test_spaces_around_the_number_are_allowed():
    _, env = game(37)
    assert env.step(" 37 \n").observation == CORRECT


def test_the_reference_is_a_binary_search_from_the_middle():
    assert binary_search_trace(37, 64)[0] == ("32\nhigher\n48\nlower\n40\nlower\n36\nhigher\n38\nlower\n"
                                             "37\ncorrect\n")
    assert binary_search_trace(32, 64)[0] == "32\ncorrect\n"


@pytest.mark.parametrize("max_number", [2, 3, 10, 64, 100, 1000])
def test_every_reference_replays_exactly_under_the_environment_within_max_turns(max_number):
    """The policy's pieces of each reference, fed to the environment as an episode runs (a turn ends at the
    stop text), give back the reference character for character, its observations where it marks them,
    the game won on the last turn, and at most ceil(log2 N) + 1 turns."""
    task = GuessTask(max_number=max_number, eval_size=max_number)
    spec = make_environment(EnvConfig(name="guess"))
    assert max_turns(max_number) == math.ceil(math.log2(max_number)) + 1
    for problem in task.eval_problems():
        episode = replay(spec, problem)
        assert episode.done and episode.reward == 1.0 and episode.bad_actions == 0
        assert episode.turns <= max_turns(max_number)
        assert task.score(episode.last_turn, problem) == 1.0


def test_held_out_problems_cycle_through_every_secret_and_training_draws_them_all():
    task = GuessTask(max_number=64, eval_size=500)
    secrets = [int(p.answer) for p in task.eval_problems()]
    assert secrets[:64] == list(range(1, 65)) and len(secrets) == 500
    assert {p.prompt for p in task.eval_problems()} == {"guess 1-64:"}
    stream = task.train_problems(seed=0)
    drawn = [next(stream) for _ in range(2000)]
    assert {int(p.answer) for p in drawn} == set(range(1, 65))
    assert min(p.id for p in drawn) >= 500  # ids above the held-out ones


@pytest.mark.parametrize(("text", "score"), [
    ("37\n", 1.0), ("37", 1.0), ("037\n", 1.0), ("37<eos>", 1.0),
    ("36\n", 0.0), ("correct\n", 0.0), ("\n", 0.0), ("", 0.0), ("37 38\n", 0.0),
])
def test_the_score_is_the_last_turns_number_against_the_secret(text, score):
    assert GuessTask(max_number=64, eval_size=10).score(text, Problem(id=36, prompt="guess 1-64:", answer="37")) == score


def test_the_config_builds_the_task_and_refuses_it_without_its_environment():
    overrides = ["task.name=guess", "rollout.max_new_tokens=80", "model.max_positions=96"]
    task = run_task(load([*overrides, "env.name=guess"]))
    assert isinstance(task, GuessTask) and task.max_number == 64 and task.environment == "guess"
    with pytest.raises(ConfigError, match="env.name"):
        load(overrides)
    with pytest.raises(ConfigError, match="env.name"):
        load(["env.name=guess"])  # the game on another task's problems
    with pytest.raises(ConfigError, match="task.guess_max"):
        load([*overrides, "env.name=guess", "task.guess_max=1"])
    with pytest.raises(ConfigError, match="rollout.max_new_tokens"):
        load(["task.name=guess", "env.name=guess", "rollout.max_new_tokens=40", "model.max_positions=96"])
