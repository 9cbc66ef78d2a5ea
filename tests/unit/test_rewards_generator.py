"""The generator's scoring glue: completion texts into the Scorer, its GroupScore into the group
(rollout/groups.py), without starting vLLM."""

import numpy as np
from test_generator import one_turn_group  # the generator's fakes, as the other generator tests import them

from asyncgrpo.config import load

from asyncgrpo.composition import run_task
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.rollout.engine import Completion
from asyncgrpo.rollout.groups import scored_group
from asyncgrpo.rollout.scoring import ScoringBatch
from asyncgrpo.schema import RewardConfig, RewardTermConfig
from asyncgrpo.tasks import Problem

TOKENIZER = build_char_tokenizer()
TASK = run_task(load([]))


def completions(texts: list[str]) -> list[Completion]:
    out = []
    for text in texts:
        ids = np.asarray(TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id], np.int32)
        out.append(Completion(token_ids=ids, logprobs=np.full(ids.size, -0.5, np.float32), finished=True))
    return out


def build(scorer: Scorer, problem: Problem, prompt: list[int], group_completions: list[Completion]):
    """As the generator does: score the episodes' texts, then build the group at loaded version 3."""
    group = one_turn_group(problem.id, prompt, group_completions, version=3, problem=problem)
    [score] = ScoringBatch.submit(scorer, TOKENIZER, [group]).future.result()
    return scored_group(0, group, score, "zero")


PROBLEM = TASK.problem(TASK.problem_id(37, 48))


def test_default_rewards_and_meta_are_as_before():
    group = build(Scorer(TASK, load([]).reward), PROBLEM, [1, 2, 3], completions(["85", "86", "8"]))
    assert group.rewards.tolist() == [1.0, 0.0, 0.0]
    assert group.meta == {"version": 3}


def test_scores_from_submit_are_used_and_terms_reach_meta():
    reward = RewardConfig(terms=[RewardTermConfig(name="task"), RewardTermConfig(name="format", weight=0.5, pattern=r"^\d+$")])
    group_completions = completions(["85", "8x"])
    assert [e.answer_text(TOKENIZER) for e in one_turn_group(1, [1], group_completions, 0).episodes] == ["85", "8x"]
    group = build(Scorer(TASK, reward), PROBLEM, [1, 2], group_completions)
    assert group.rewards.tolist() == [1.5, 0.0]
    assert group.meta == {"version": 3, "reward/task": 0.5, "reward/format": 0.5, "reward/errors": 0}


def test_a_dropped_group_is_not_built():
    def broken(completion, problem):
        raise RuntimeError("no")

    task = type("Broken", (), {"score": staticmethod(broken)})()
    scorer = Scorer(task, RewardConfig(on_error="drop_group"))
    assert build(scorer, Problem(1, "1+1=", "2"), [1], completions(["2"])) is None
    assert scorer.stats_snapshot()["reward/groups_dropped"] == 1


def test_a_reward_beyond_float32_is_an_error_and_its_group_still_decodes_at_the_learner():
    from asyncgrpo.wire import decode_group, encode_group

    class HugeForOnesAndTwos:  # the reward: 1e39 for answers starting with 1 or 2
        def score(self, completion: str, problem: Problem) -> float:
            return 1e39 if completion.startswith(("1", "2")) else 0.5

    scorer = Scorer(HugeForOnesAndTwos(), RewardConfig())
    group = build(scorer, PROBLEM, [1, 2], completions(["12", "85", "2"]))
    assert group.rewards.tolist() == [0.0, 0.5, 0.0]
    group.seq = 0  # as the sender numbers it
    assert decode_group([bytes(f) for f in encode_group(group)]).rewards.tolist() == [0.0, 0.5, 0.0]
    assert scorer.stats_snapshot()["reward/errors"] == 2


def test_a_reward_beyond_float32_drops_its_group_under_drop_group():
    class Huge:
        def score(self, completion: str, problem: Problem) -> float:
            return 1e39

    scorer = Scorer(Huge(), RewardConfig(on_error="drop_group"))
    assert build(scorer, PROBLEM, [1], completions(["12"])) is None
    assert scorer.stats_snapshot() == {"reward/errors": 1, "reward/groups_dropped": 1, "reward/calls": 1}
