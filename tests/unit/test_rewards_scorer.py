"""The Scorer: weighted terms, user functions by dotted path, the error policy, non-blocking submit."""

import concurrent.futures
import math
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.config import load
from asyncgrpo.rewards import reward_term_metrics
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.rewards.user_fn import RewardFnError, load_reward_fn
from asyncgrpo.schema import ConfigError, RewardConfig, RewardTermConfig
from asyncgrpo.tasks import ArithmeticTask, CountdownTask, Problem

ARITHMETIC = ArithmeticTask(num_digits=2, eval_size=500)

USER_REWARDS = '''
import asyncio, math, threading, time

calls = []
release = threading.Event()

def length_bonus(prompt, completion, answer=None, **extra):
    calls.append((prompt, completion, answer, extra))
    return min(len(completion), 10) / 10

async def async_match(prompt, completion, answer=None, **extra):
    await asyncio.sleep(0.01)
    return float(completion.strip() == answer)

def raises(prompt, completion, answer=None, **extra):
    if completion == "boom":
        raise RuntimeError("reward crashed")
    return 1.0

def nan_for_x(prompt, completion, answer=None, **extra):
    return math.nan if completion == "x" else 0.5

def not_a_number(prompt, completion, answer=None, **extra):
    return "high"

def as_bool(prompt, completion, answer=None, **extra):
    return completion == answer

async def slow_async(prompt, completion, answer=None, **extra):
    await asyncio.sleep(30 if completion == "slow" else 0)
    return 1.0

def slow_sync(prompt, completion, answer=None, **extra):
    time.sleep(2 if completion == "slow" else 0)
    return 1.0

def odd_value(prompt, completion, answer=None, **extra):
    # 1e39 is a finite float64 that overflows float32, the rewards' dtype on the wire.
    return {"huge": 1e39, "-huge": -1e39, "nan": math.nan, "inf": math.inf, "text": "0.7", "none": None,
            "complex": 1j, "list": [0.5]}.get(completion, 0.5)

async def async_odd_value(prompt, completion, answer=None, **extra):
    return odd_value(prompt, completion, answer)

def np_values(prompt, completion, answer=None, **extra):
    import numpy
    return {"f32": numpy.float32(0.25), "i64": numpy.int64(1), "true": True}.get(completion, 0.5)

async def gated(prompt, completion, answer=None, **extra):
    while not release.is_set():
        await asyncio.sleep(0.01)
    return 1.0
'''


@pytest.fixture()
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("my_rewards", None)
    module = importlib.import_module("my_rewards")
    yield module
    sys.modules.pop("my_rewards", None)


def problem(answer: str = "85", prompt: str = "37+48=") -> Problem:
    return Problem(id=1, prompt=prompt, answer=answer)


def reward_cfg(*terms: dict, **kwargs) -> RewardConfig:
    return RewardConfig(terms=[RewardTermConfig(**t) for t in terms], **kwargs)


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.sampled_from(["85", "85<eos>", " 85 ", "86", "8", "", "85 5", "x"]), min_size=1, max_size=8))
def test_default_scorer_is_the_tasks_exact_match(texts):
    task = ARITHMETIC
    scorer = Scorer(task, RewardConfig())
    [score] = scorer.submit([problem()], [texts]).result(timeout=0)  # already done: scored inline
    assert score.rewards.dtype == np.float32
    assert score.rewards.tolist() == [task.score(t, problem()) for t in texts]
    assert score.meta() == {} and score.errors == 0 and not score.dropped
    assert scorer._thread is None  # no event-loop thread for the default


def test_weighted_terms_sum_and_are_reported_per_term():
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "exact", "weight": 1.0},
                                                  {"name": "format", "weight": 0.25, "pattern": r"^\s*\d+\s*$"}))
    [score] = scorer.score([problem()], [["85", "86", "eighty"]])
    assert score.rewards.tolist() == [1.25, 0.25, 0.0]
    assert score.terms["exact"].tolist() == [1, 0, 0] and score.terms["format"].tolist() == [1, 1, 0]
    assert score.meta() == {"reward/exact": pytest.approx(1 / 3), "reward/format": pytest.approx(2 / 3),
                            "reward/errors": 0}


def test_math_and_numeric_terms_run_off_the_callers_thread(monkeypatch):
    from asyncgrpo.rewards import verifiers

    threads: dict[str, set[int]] = {"math": set(), "numeric": set()}
    for term, name in (("math", "math_reward"), ("numeric", "numeric_match")):
        real = getattr(verifiers, name)
        monkeypatch.setattr(verifiers, name, lambda *a, _real=real, _term=term, **k:
                            threads[_term].add(threading.get_ident()) or _real(*a, **k))
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "math"}, {"name": "numeric", "tolerance": 0.01}))
    try:
        [score] = scorer.score([problem("0.5")], [["#### 1/2", "\\boxed{0.501}", "#### 2"]])
        assert score.terms["math"].tolist() == [1, 0, 0]
        assert score.terms["numeric"].tolist() == [1, 1, 0]
        assert threads["math"] and threads["numeric"]
        assert threading.get_ident() not in threads["math"] | threads["numeric"]
    finally:
        scorer.close()


def test_user_fn_by_dotted_path_gets_prompt_completion_answer_and_extra(user_rewards):
    task = CountdownTask(num_numbers=4, max_number=100, eval_size=3)
    target = task.eval_problems()[0]
    scorer = Scorer(task, RewardConfig(fn="my_rewards:length_bonus"))
    try:
        [score] = scorer.score([target], [["abc", "a" * 30]])
        assert score.rewards.tolist() == pytest.approx([0.3, 1.0])
        # The completions are scored on a pool's threads: the calls arrive in any order.
        assert sorted(call[1] for call in user_rewards.calls) == ["a" * 30, "abc"]
        [(prompt, completion, answer, extra)] = [call for call in user_rewards.calls if call[1] == "abc"]
        assert prompt == target.prompt and answer == target.answer and completion == "abc"
        assert extra == {"numbers": target.extra["numbers"], "target": target.extra["target"]}
        assert score.meta() == {"reward/fn": pytest.approx(0.65), "reward/errors": 0}
    finally:
        scorer.close()


def test_raw_prompt_and_no_answer_reach_the_user_fn(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards.length_bonus"))
    templated = Problem(id=2, prompt="<user>write<assistant>", answer="", extra={"raw_prompt": "write", "level": 3})
    try:
        scorer.score([templated], [["x"]])
        assert user_rewards.calls[-1] == ("write", "x", None, {"level": 3})
    finally:
        scorer.close()


def test_async_user_fn_and_mixed_terms(user_rewards):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": "my_rewards:async_match", "weight": 2.0},
                                                  {"name": "task", "weight": 1.0}))
    try:
        scores = scorer.score([problem(), problem("1")], [["85", "0"], ["1", "1"]])
        assert [s.rewards.tolist() for s in scores] == [[3.0, 0.0], [3.0, 3.0]]
    finally:
        scorer.close()


@pytest.mark.parametrize(("fn", "texts", "failed"), [
    ("raises", ["ok", "boom", "ok"], [False, True, False]),
    ("nan_for_x", ["x", "y", "x"], [True, False, True]),
    ("not_a_number", ["a", "b", "c"], [True, True, True]),
])
def test_a_failing_reward_scores_zero_and_is_counted(user_rewards, fn, texts, failed):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": f"my_rewards:{fn}"}, {"name": "task", "weight": 0.0}))
    try:
        [score] = scorer.score([problem()], [texts])
        assert np.isnan(score.terms["fn"]).tolist() == failed
        assert score.errors == sum(failed) and not score.dropped
        assert all(r == (0.0 if f else score.terms["fn"][i]) for i, (r, f) in enumerate(zip(score.rewards, failed)))
        assert score.meta()["reward/errors"] == sum(failed)
        assert scorer.stats_snapshot()["reward/errors"] == sum(failed)
    finally:
        scorer.close()


def test_only_the_first_error_of_each_term_is_kept_and_logged_on_one_line(user_rewards, caplog):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": "my_rewards:raises"},
                                           {"name": "odd", "kind": "fn", "fn": "my_rewards:not_a_number"},
                                           {"name": "task"}))
    try:
        with caplog.at_level("WARNING", logger="asyncgrpo.rewards.scorer"):
            scorer.score([problem()], [["ok", "boom", "boom"]])
            scorer.score([problem()], [["boom"]])
        firsts = scorer.first_errors()
        assert firsts == {"fn": "RuntimeError: reward crashed",
                          "odd": "RewardValueError: returned str 'high', not a number"}  # task never failed
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2 and all("\n" not in m for m in warned)
        assert any("'fn'" in m and "reward crashed" in m for m in warned)
        assert scorer.stats_snapshot()["reward/errors"] == 3 + 4  # fn 2 + 1, odd 3 + 1: all counted
    finally:
        scorer.close()


def test_a_first_error_is_flattened_and_truncated(user_rewards):
    from asyncgrpo.rewards.errors import MAX_ERROR_CHARS, one_line

    assert one_line("a\n  b\tc ") == "a b c"
    long = one_line("x" * 1000)
    assert len(long) == MAX_ERROR_CHARS and long.endswith("...")
    user_rewards.multiline = lambda prompt, completion, answer=None, **extra: (_ for _ in ()).throw(
        ValueError("line one\nline two " + "y" * 500))
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:multiline", timeout_s=5.0))
    try:
        scorer.score([problem()], [["a"]])
        [text] = scorer.first_errors().values()
        assert text.startswith("ValueError: line one line two y") and len(text) == MAX_ERROR_CHARS
    finally:
        scorer.close()


def test_drop_group_policy_drops_only_groups_with_errors(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:raises", on_error="drop_group"))
    try:
        good, bad = scorer.score([problem(), problem()], [["a", "b"], ["a", "boom"]])
        assert not good.dropped and bad.dropped and bad.errors == 1
        assert scorer.stats_snapshot()["reward/groups_dropped"] == 1
    finally:
        scorer.close()


NOT_REAL_NUMBERS = ["huge", "-huge", "nan", "inf", "text", "none", "complex", "list"]


@pytest.mark.parametrize("fn", ["odd_value", "async_odd_value"])
@pytest.mark.parametrize("value", NOT_REAL_NUMBERS)
def test_a_reward_that_is_not_a_float32_number_is_a_counted_error_scored_zero(user_rewards, fn, value):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": f"my_rewards:{fn}"}, {"name": "task", "weight": 0.0}))
    try:
        [score] = scorer.score([problem()], [["ok", value, "ok"]])
        assert score.rewards.tolist() == [0.5, 0.0, 0.5] and np.isfinite(score.rewards).all()
        assert np.isnan(score.terms["fn"]).tolist() == [False, True, False]
        assert score.errors == 1 and not score.dropped and score.meta()["reward/errors"] == 1
        assert scorer.stats_snapshot()["reward/errors"] == 1
        assert scorer.first_errors()["fn"].startswith("RewardValueError: returned ")
    finally:
        scorer.close()


@pytest.mark.parametrize("value", ["huge", "text", "none", "nan"])
def test_drop_group_drops_a_group_whose_reward_is_not_a_float32_number(user_rewards, value):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:odd_value", on_error="drop_group"))
    try:
        good, bad = scorer.score([problem(), problem()], [["a", "b"], ["a", value]])
        assert not good.dropped and bad.dropped and bad.errors == 1
        assert scorer.stats_snapshot()["reward/groups_dropped"] == 1
    finally:
        scorer.close()


def test_a_cheap_term_beyond_float32_is_an_error_of_that_term_inline():
    class HugeTask:  # the task's own check runs inline, not on the scorer's threads
        def score(self, completion: str, problem: Problem) -> float:
            return 1e39 if completion.startswith(("1", "2")) else 1.0

    scorer = Scorer(HugeTask(), RewardConfig())
    [score] = scorer.submit([problem()], [["12", "3", "25"]]).result(timeout=0)
    assert score.rewards.tolist() == [0.0, 1.0, 0.0] and score.errors == 2
    assert list(scorer.first_errors()) == ["task"]
    assert scorer.first_errors()["task"].startswith("RewardValueError: returned 1e+39, beyond float32")


def test_a_weighted_sum_beyond_float32_is_an_error_of_its_terms():
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "exact", "weight": 3e38}, {"name": "format", "weight": 3e38},
                                           {"name": "other", "kind": "exact", "weight": 0.0}))
    [score] = scorer.score([problem()], [["85", "x"]])
    # "85": both terms give 1 and 6e38 overflows float32; "x": 0 + 3e38 fits.
    assert np.isfinite(score.rewards).all() and score.rewards[0] == 0.0
    assert math.isclose(score.rewards[1], 3e38, rel_tol=1e-6)
    assert score.errors == 2 and np.isnan(score.terms["exact"][0]) and np.isnan(score.terms["format"][0])
    assert not np.isnan(score.terms["other"][0])  # weight 0: no part of the overflow
    assert "beyond float32" in scorer.first_errors()["exact"]


def test_numpy_scalars_and_bools_are_numbers(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:np_values"))
    try:
        [score] = scorer.score([problem()], [["f32", "i64", "true"]])
        assert score.rewards.tolist() == [0.25, 1.0, 1.0] and score.errors == 0
    finally:
        scorer.close()


def test_bool_results_count_as_numbers(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:as_bool"))
    try:
        assert scorer.score([problem()], [["85", "84"]])[0].rewards.tolist() == [1.0, 0.0]
    finally:
        scorer.close()


@pytest.mark.parametrize("fn", ["slow_async", "slow_sync"])
def test_a_reward_past_its_timeout_is_an_error_not_a_hang(user_rewards, fn):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn=f"my_rewards:{fn}", timeout_s=0.3))
    try:
        [score] = scorer.score([problem()], [["fast", "slow"]])
        assert score.rewards.tolist() == [1.0, 0.0] and score.errors == 1
        assert "timed out" in score.error_messages[0]
    finally:
        scorer.close()


def test_submit_returns_before_rewards_finish(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:gated"))
    try:
        future = scorer.submit([problem()] * 4, [["a", "b"]] * 4)
        with pytest.raises(concurrent.futures.TimeoutError):
            future.result(timeout=0.2)
        user_rewards.release.set()
        scores = future.result(timeout=10)
        assert len(scores) == 4 and all(s.rewards.tolist() == [1.0, 1.0] for s in scores)
    finally:
        scorer.close()


def test_submit_from_several_threads(user_rewards):
    scorer = Scorer(ARITHMETIC, RewardConfig(fn="my_rewards:async_match"))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: scorer.score([problem(str(i))], [[str(i), "no"]])[0].rewards.tolist(),
                                    range(16)))
        assert results == [[1.0, 0.0]] * 16
    finally:
        scorer.close()


@pytest.mark.parametrize(("path", "message"), [
    ("nonexistent_module_xyz:fn", "cannot import"),
    ("my_rewards:missing", "has no attribute"),
    ("my_rewards:calls", "not callable"),
    ("justaname", "package.module:function"),
])
def test_bad_reward_fn_paths_fail_naming_the_key(user_rewards, path, message):
    with pytest.raises(RewardFnError) as err:
        load_reward_fn(path)
    assert "reward.fn" in str(err.value) and message in str(err.value)


def test_reward_term_metrics_average_terms_and_leave_errors_to_the_generators_reports():
    class Group:
        def __init__(self, meta):
            self.meta = meta

    groups = [Group({"version": 3, "reward/math": 1.0, "reward/format": 0.5, "reward/errors": 2}),
              Group({"version": 3, "reward/math": 0.0, "reward/format": 1.0, "reward/errors": 1}),
              Group({"version": 3})]
    # reward/errors is the generators' report (it also counts dropped groups), not the batch's.
    assert reward_term_metrics(groups) == {"reward/math": 0.5, "reward/format": 0.75}
    assert reward_term_metrics([Group({"version": 1})]) == {}


def test_group_meta_survives_the_wire_codec():
    from asyncgrpo.wire import ScoredGroup, decode_group, encode_group

    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "exact"}, {"name": "format", "weight": 0.1}))
    [score] = scorer.score([problem()], [["85", "x"]])
    group = ScoredGroup(generator_id=0, seq=0, prompt_id=1, prompt_tokens=np.zeros(3, np.int32),
                        tokens=np.zeros(4, np.int32), logprobs=np.zeros(4, np.float32),
                        versions=np.zeros(4, np.int32), lengths=np.asarray([2, 2], np.int32),
                        rewards=score.rewards, meta={"version": 0, **score.meta()})
    decoded = decode_group([bytes(f) for f in encode_group(group)])
    assert reward_term_metrics([decoded]) == {"reward/exact": 0.5, "reward/format": 1.0}


@pytest.mark.parametrize(("overrides", "key"), [
    (["reward.terms=[{name: speed}]"], "reward.terms[0].kind"),
    (["reward.terms=[{name: mean, kind: exact}]"], "reward.terms[0].name"),
    (["reward.terms=[{name: a, kind: exact}, {name: a, kind: format}]"], "reward.terms"),
    (["reward.terms=[{name: fn}]"], "reward.terms[0].fn"),
    (["reward.fn=pkg.mod:f", "reward.terms=[{name: exact}]"], "reward.fn"),
    (["reward.on_error=ignore"], "reward.on_error"),
    (["reward.terms=[{name: judge}]"], "reward.judge.base_url"),
    (["reward.terms=[{name: judge}]", "reward.judge.base_url=http://h/v1", "reward.judge.parser=vibes"], "reward.judge.parser"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
    (["reward.max_error_rate=1.5"], "reward.max_error_rate"),
    (["reward.max_error_rate=-0.1"], "reward.max_error_rate"),
    (["reward.max_error_rate=nan"], "reward.max_error_rate"),
    (["reward.error_window_steps=0"], "reward.error_window_steps"),
    (["reward.terms=[{name: calls, kind: exact}]"], "reward.terms[0].name"),
])
def test_bad_reward_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_the_default_config_scores_exactly_as_before():
    cfg = load([])
    assert cfg.task.name == "arithmetic" and cfg.reward.terms == [] and cfg.reward.fn == ""
    scorer = Scorer(ARITHMETIC, cfg.reward)
    assert scorer.all_cheap and not scorer.report_terms and [t.name for t in scorer.terms] == ["task"]
    assert math.isclose(scorer.score([problem()], [["85"]])[0].rewards[0], 1.0)


# ------------------------------------------------------------------ how long a batch's rewards may take


def test_cheap_terms_alone_add_nothing_to_the_wait_for_rewards():
    assert Scorer(ARITHMETIC, reward_cfg({"name": "task"}, {"name": "format"})).calls_bound_s(1000) == 0.0


def test_sync_rewards_are_waited_for_in_waves_of_reward_threads(user_rewards):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": "my_rewards:slow_sync"}, threads=4, timeout_s=120.0))
    # 64 calls on 4 threads, each up to 120 s from when a thread takes it: 16 waves, 1,920 s. A bound
    # sized by the judge (16 calls at a time, each within its default budget of 124 s) allowed 496 s
    # and failed such a slow but working reward as a hang.
    assert scorer.calls_bound_s(64) == 16 * 120.0
    assert scorer.calls_bound_s(65) == 17 * 120.0


def test_async_rewards_are_waited_for_in_waves_of_reward_concurrency(user_rewards):
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "fn", "fn": "my_rewards:async_match"}, concurrency=8, timeout_s=5.0))
    assert scorer.calls_bound_s(8) == 5.0
    assert scorer.calls_bound_s(9) == 10.0


def test_judge_calls_are_waited_for_in_waves_of_the_judges_concurrency_each_within_its_budget():
    from asyncgrpo.rewards.judge import call_budget_s
    from asyncgrpo.schema import JudgeConfig

    judge = JudgeConfig(concurrency=4, timeout_s=2.0, retries=2, backoff_s=0.5)
    scorer = Scorer(ARITHMETIC, reward_cfg({"name": "judge"}, judge=judge, timeout_s=1.0))
    assert call_budget_s(judge) == 2.0 * 3 + 0.5 * 4
    assert scorer.calls_bound_s(9) == 3 * call_budget_s(judge)


def test_every_slow_term_adds_its_own_waves_to_the_wait_for_rewards(user_rewards):
    terms = ({"name": "judge"}, {"name": "fn", "fn": "my_rewards:slow_sync"}, {"name": "task"})
    scorer = Scorer(ARITHMETIC, reward_cfg(*terms, threads=2, timeout_s=3.0))
    judge_only = Scorer(ARITHMETIC, reward_cfg({"name": "judge"}, threads=2, timeout_s=3.0))
    assert scorer.calls_bound_s(4) == judge_only.calls_bound_s(4) + 2 * 3.0


# ------------------------------------------------------------------ a reward function's signature

SIGNATURES = '''
import functools
import sys
def no_args(): return 1.0
def two_args(prompt, completion): return 1.0
def with_extra(prompt, completion, answer=None, **extra): return 1.0
def answer_positional(prompt, completion, answer): return 1.0
def everything(*args, **kwargs): return 1.0
class NeedsAnArgument:
    def __init__(self, x): pass
def record_fields(prompt, completion, answer, numbers, target): return 1.0  # countdown's fields by name
def keyword_only(prompt, completion, *, answer=None, numbers, target): return 1.0
def inject_context(f):
    @functools.wraps(f)  # the wrapper's own signature is what is called
    def wrapper(*args, **kwargs): return f("context", *args, **kwargs)
    return wrapper
@inject_context
def decorated(context, prompt, completion, answer=None, **extra): return 1.0
def positional_only(prompt, completion, answer, /): return 1.0
'''


@pytest.fixture()
def signatures(tmp_path, monkeypatch):
    (tmp_path / "signatures.py").write_text(SIGNATURES)
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("name", ["with_extra", "answer_positional", "everything", "record_fields", "keyword_only",
                                  "decorated"])
def test_a_reward_function_that_takes_prompt_completion_and_answer_loads(signatures, name):
    assert callable(load_reward_fn(f"signatures:{name}"))


@pytest.mark.parametrize(("name", "said"), [
    ("no_args", "no_args() cannot be called as fn(prompt, completion, answer=None, **extra) (too many positional"),
    ("two_args", "two_args(prompt, completion) cannot be called as fn(prompt, completion, answer=None, **extra) "
                 "(got an unexpected keyword argument 'answer')"),
    ("NeedsAnArgument", "NeedsAnArgument(x) cannot be called as"),
    ("positional_only", "('answer' parameter is positional only, but was passed as a keyword)"),
])
def test_a_reward_function_whose_signature_cannot_take_the_call_is_refused_at_load(signatures, name, said):
    with pytest.raises(RewardFnError) as err:
        load_reward_fn(f"signatures:{name}")
    assert said in str(err.value) and str(err.value).startswith(f"reward.fn='signatures:{name}': ")


def test_a_module_that_exits_on_import_is_a_load_error_not_the_end_of_the_process(signatures):
    with pytest.raises(RewardFnError, match=r"cannot import 'exits_on_import' \(SystemExit: 3\)"):
        load_reward_fn("exits_on_import:f")
