"""A sync reward function that never returns on some inputs (tools/chaos.py's reward_hang): each hung
call is one timed-out error, and it costs a thread, not the scorer. Before, reward.threads hangs
held every thread of the pool and every later call queued until it timed out: an error rate of 1
and a run stopped for a function that failed on a handful of inputs."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.schema import RewardConfig
from asyncgrpo.tasks import ArithmeticTask

HANGING = '''
import threading

release = threading.Event()

def reward(prompt, completion, answer=None, **extra):
    if completion == "hang":
        release.wait()  # never set until the test ends
    return 1.0
'''


@pytest.fixture()
def hanging(tmp_path, monkeypatch):
    (tmp_path / "hanging_reward.py").write_text(textwrap.dedent(HANGING))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hanging_reward", raising=False)  # each test's own `release`
    import hanging_reward

    yield hanging_reward
    hanging_reward.release.set()  # let the held threads go


def test_hung_calls_time_out_and_later_calls_still_score(hanging):
    task = ArithmeticTask(num_digits=2, eval_size=10)
    scorer = Scorer(task, RewardConfig(fn="hanging_reward:reward", timeout_s=0.3, threads=2))
    problem = task.eval_problems()[:1]
    try:
        for _ in range(3):  # three hangs, more than the pool's two threads
            score = scorer.score(problem, [["hang"]], timeout_s=10)[0]
            assert score.errors == 1
        assert scorer.pools_replaced == 1
        for _ in range(5):  # scored, none timed out: the hung threads hold no one up
            score = scorer.score(problem, [["12", "7"]], timeout_s=10)[0]
            assert score.errors == 0 and list(score.rewards) == [1.0, 1.0]
        assert "timed out after 0.3 s (reward.timeout_s)" in scorer.first_errors()["fn"]
    finally:
        scorer.close()


def test_a_slow_call_that_returns_after_its_timeout_gives_its_thread_back(hanging):
    task = ArithmeticTask(num_digits=2, eval_size=10)
    scorer = Scorer(task, RewardConfig(fn="hanging_reward:reward", timeout_s=0.2, threads=2))
    problem = task.eval_problems()[:1]
    try:
        assert scorer.score(problem, [["hang"]], timeout_s=10)[0].errors == 1
        hanging.release.set()  # the held call returns: the pool has both threads again
        deadline = time.monotonic() + 5
        while scorer._held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not scorer._held and scorer.pools_replaced == 0
    finally:
        scorer.close()


def test_calls_queued_behind_hung_threads_move_to_the_new_pool_and_score(hanging):
    # Two hangs take both threads; the two calls queued behind them used to wait in the given-up
    # pool until they timed out too (tools/chaos.py's reward_hang: 9 hangs cost 265 errors).
    task = ArithmeticTask(num_digits=2, eval_size=10)
    scorer = Scorer(task, RewardConfig(fn="hanging_reward:reward", timeout_s=0.3, threads=2))
    problem = task.eval_problems()[:1]
    try:
        score = scorer.score(problem, [["hang", "hang", "12", "7"]], timeout_s=10)[0]
        assert scorer.pools_replaced == 1
        assert score.errors == 2, score.error_messages
        assert list(score.rewards) == [0.0, 0.0, 1.0, 1.0]
    finally:
        scorer.close()


SLOW = '''
import time

def reward(prompt, completion, answer=None, **extra):
    time.sleep(0.4)
    return 1.0
'''


def test_time_queued_behind_other_calls_does_not_count_against_the_timeout(tmp_path, monkeypatch):
    # One thread, five calls of 0.4 s each under a 1.2 s timeout: the last waits 1.6 s in the queue,
    # more than the timeout, and still scores, because reward.timeout_s bounds a call's own run
    # (each run leaves 0.8 s of slack for a loaded machine).
    (tmp_path / "slow_reward.py").write_text(textwrap.dedent(SLOW))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_reward", raising=False)
    task = ArithmeticTask(num_digits=2, eval_size=10)
    scorer = Scorer(task, RewardConfig(fn="slow_reward:reward", timeout_s=1.2, threads=1))
    problem = task.eval_problems()[:1]
    try:
        score = scorer.score(problem, [["a", "b", "c", "d", "e"]], timeout_s=30)[0]
        assert score.errors == 0, score.error_messages
        assert list(score.rewards) == [1.0] * 5
    finally:
        scorer.close()
