"""The longtail task: worked additions whose completion lengths are heavy-tailed, checked on the answer alone."""

import itertools
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.schema import ConfigError
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.tasks import LongtailTask
from asyncgrpo.tasks.longtail import scratchpad
from asyncgrpo.tasks.problem import reference_completion


def default_task() -> LongtailTask:
    return run_task(load(["task.name=longtail", "model.max_positions=256", "rollout.max_new_tokens=200"]))


def test_default_lengths_are_heavy_tailed_in_the_embedded_tokenizer():
    """Over 4,000 drawn training problems, the reference completions (what the warm start imitates and
    the policy writes) measured in tokens of the embedded model's tokenizer: p99 at least 4x the
    median, and the longest at least 150 tokens."""
    tokenizer = build_char_tokenizer()
    problems = list(itertools.islice(default_task().train_problems(seed=0), 4000))
    lengths = sorted(len(ids) for ids in tokenizer([reference_completion(p) for p in problems],
                                                   add_special_tokens=False).input_ids)
    median, p99 = statistics.median(lengths), lengths[int(0.99 * len(lengths))]
    assert p99 >= 4 * median, (median, p99)
    assert lengths[-1] >= 150, lengths[-1]


def test_the_scratchpad_is_one_line_per_column_then_the_sum():
    assert scratchpad(457, 368) == "7+8+0=15\n5+6+1=12\n4+3+1=08\n825"
    assert scratchpad(95, 17) == "5+7+0=12\n9+1+1=11\n112"


@settings(max_examples=200, deadline=None)
@given(problem_id=st.integers(0, 2**31 - 1))
def test_every_reference_completion_scores_one_and_ends_with_the_sum(problem_id):
    task = LongtailTask(min_digits=2, max_digits=16, exponent=2.5, eval_size=10)
    problem = task.problem(problem_id)
    left, right = (int(x) for x in problem.prompt.removesuffix("=").split("+"))
    assert len(str(left)) == len(str(right)) and 2 <= len(str(left)) <= 16
    assert problem.answer == str(left + right)
    reference = reference_completion(problem)
    assert reference.endswith("\n" + problem.answer) and len(reference) <= task.max_answer_chars
    assert task.score(reference, problem) == 1.0
    assert task.problem(problem_id) == problem


@pytest.mark.parametrize(("completion", "score"), [
    ("3+4+0=07\n1+2+0=03\n37", 1.0),
    ("37", 1.0),  # the scratchpad is not graded, only the final answer
    ("3+4+0=07\n37\n", 1.0),
    ("3+4+0=07\n37<eos>", 1.0),
    ("3+4+0=07\n  37  ", 1.0),
    ("3+4+0=07\n037", 0.0),  # not the exact number
    ("37\n3+4+0=07", 0.0),  # the answer must be the last line
    ("3+4+0=07\n1+2+0=03\n", 0.0),  # a scratchpad without the answer
    ("3+4+0=07\n1+2+0=03\n=37", 0.0),
    ("the answer is 37", 0.0),
    ("3+4+0=07\n36", 0.0),
    ("", 0.0),
    ("\n\n\n", 0.0),
    ("<eos><eos>", 0.0),
    ("9" * 5000, 0.0),
    ("\x00\ufffd37", 0.0),
])
def test_check_wants_the_exact_sum_alone_on_the_last_line(completion, score):
    task = LongtailTask(min_digits=2, max_digits=4, exponent=1.0, eval_size=5)
    problem = task.problem(0)
    problem = type(problem)(id=0, prompt="13+24=", answer="37")
    assert task.score(completion, problem) == score


def test_eval_split_is_fixed_and_training_never_repeats_it():
    task = default_task()
    held = task.eval_problems()
    assert held == default_task().eval_problems() and len(held) == 500
    held_prompts = {p.prompt for p in held}
    train = list(itertools.islice(task.train_problems(seed=0), 5000))
    assert not held_prompts & {p.prompt for p in train}
    # The short problems repeat (8,100 two-digit pairs), so this is the skip at work, not luck.
    assert sum(1 for i in range(500, 20000) if task.problem(i).prompt in held_prompts) > 0
    assert train[:20] == list(itertools.islice(task.train_problems(seed=0), 20))
    assert train[:20] != list(itertools.islice(task.train_problems(seed=1), 20))


def test_digit_limits_and_a_context_too_short_for_the_longest_problem_are_refused():
    base = ["task.name=longtail", "model.max_positions=256", "rollout.max_new_tokens=200"]
    for override, key in (("task.longtail_min_digits=1", "task.longtail_min_digits"),
                          ("task.longtail_max_digits=19", "task.longtail_max_digits"),
                          ("task.longtail_exponent=-1", "task.longtail_exponent"),
                          ("model.max_positions=220", "model.max_positions")):
        with pytest.raises(ConfigError) as err:
            load([*base, override])
        assert key in str(err.value) and "\n" not in str(err.value)
    # 2 * 16 + 2 = 34 prompt tokens beside 200 fit in 234.
    assert load([*base, "model.max_positions=234"]).model.max_positions == 234


def test_the_preset_runs_longtail_with_room_for_its_longest_completion():
    cfg = load(config_name="longtail")
    task = run_task(cfg)
    assert cfg.task.name == "longtail" and not cfg.model.path
    assert cfg.rollout.max_new_tokens >= task.max_answer_chars + 1  # the longest reference and its eos
