"""The generator's scoring glue (`_scored_group`) with the Scorer, without starting vLLM."""

import numpy as np

from asyncgrpo.config import load
from asyncgrpo.schema import RewardConfig, RewardTermConfig
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.generator import Generator, GeneratorStats
from asyncgrpo.tasks import ArithmeticTask, Problem, make_task


def bare_generator(reward: RewardConfig) -> Generator:
    generator = Generator.__new__(Generator)
    generator.cfg = load([])
    generator.generator_id = 0
    generator.version = 3
    generator.tokenizer = build_char_tokenizer()
    generator.task = make_task(generator.cfg)
    generator.scorer = Scorer(generator.task, reward)
    generator.stats = GeneratorStats()
    return generator


def completions(tokenizer, texts: list[str]) -> list[Completion]:
    out = []
    for text in texts:
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], np.int32)
        out.append(Completion(token_ids=ids, logprobs=np.full(ids.size, -0.5, np.float32), finished=True))
    return out


PROBLEM = ArithmeticTask().problem(ArithmeticTask().problem_id(37, 48))


def test_default_rewards_and_meta_are_as_before():
    generator = bare_generator(load([]).reward)
    group = generator._scored_group(PROBLEM, [1, 2, 3], completions(generator.tokenizer, ["85", "86", "8"]))
    assert group.rewards.tolist() == [1.0, 0.0, 0.0]
    assert group.meta == {"version": 3}


def test_scores_from_submit_are_used_and_terms_reach_meta():
    reward = RewardConfig(terms=[RewardTermConfig(name="task"), RewardTermConfig(name="format", weight=0.5, pattern=r"^\d+$")])
    generator = bare_generator(reward)
    group_completions = completions(generator.tokenizer, ["85", "8x"])
    texts = generator.completion_texts(group_completions)
    assert texts == ["85", "8x"]
    [score] = generator.scorer.submit([PROBLEM], [texts]).result()
    group = generator._scored_group(PROBLEM, [1, 2], group_completions, score)
    assert group.rewards.tolist() == [1.5, 0.0]
    assert group.meta == {"version": 3, "reward/task": 0.5, "reward/format": 0.5, "reward/errors": 0}


def test_a_dropped_group_is_not_built():
    def broken(completion, problem):
        raise RuntimeError("no")

    generator = bare_generator(RewardConfig(on_error="drop_group"))
    generator.task = type("Broken", (), {"score": staticmethod(broken)})()
    generator.scorer = Scorer(generator.task, RewardConfig(on_error="drop_group"))
    assert generator._scored_group(Problem(1, "1+1=", "2"), [1], completions(generator.tokenizer, ["2"])) is None
