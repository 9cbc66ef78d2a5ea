"""Parsing an LLM judge's reply into a score, filling its prompt template, and its retries kept
within each call's time budget (on a virtual clock)."""

import asyncio
import random

import pytest

from asyncgrpo.rewards.judge import JudgeClient, JudgeError, JudgeParseError, call_budget_s, fill_template, parse_score
from asyncgrpo.schema import JudgeConfig


@pytest.mark.parametrize(("reply", "parser", "score"), [
    ("7", "number", 0.7),
    ("Score: 8", "number", 0.8),
    ("I'd give it 6/10.", "number", 0.6),
    ("9 out of 10, minor issues in step 2", "number", 0.9),
    ("Step 3 is wrong. Final score: 2", "number", 0.2),
    ("10", "number", 1.0),
    ("0.5", "number", 0.05),
    ("Yes, correct.", "yes_no", 1.0),
    ("no", "yes_no", 0.0),
    ("The response is correct: yes", "yes_no", 1.0),
    ("<score>4</score>", "regex:<score>(\\d+)</score>", 0.4),
])
def test_replies_parse_to_scores(reply, parser, score):
    assert parse_score(reply, parser=parser, max_score=10) == pytest.approx(score)


@pytest.mark.parametrize(("reply", "parser"), [
    ("I cannot judge this.", "number"),
    ("Score: 85", "number"),  # outside [0, max_score]
    ("", "number"),
    ("maybe", "yes_no"),
    ("hard to say: yes or no", "yes_no"),
    ("score 4", "regex:<score>(\\d+)</score>"),
])
def test_unparseable_replies_raise(reply, parser):
    with pytest.raises(JudgeParseError):
        parse_score(reply, parser=parser, max_score=10)



def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reward.judge.parser"):
        parse_score("7", parser="numbr", max_score=10)


def test_template_fills_fields_and_leaves_other_braces_alone():
    template = 'Q: {prompt}\nA: {completion}\nRef: {answer}\nReply as JSON {"score": n}'
    filled = fill_template(template, prompt="2+2?", completion="4", answer=None)
    assert filled == 'Q: 2+2?\nA: 4\nRef: \nReply as JSON {"score": n}'


class VirtualJudge:
    """A stand-in for the judge's HTTP session on a virtual clock: each request takes `request_s`
    (or its whole timeout, then times out, with `hang`) and answers `status` with `retry_after`."""

    def __init__(self, *, status: int = 429, retry_after: str | None = "30", request_s: float = 1.0,
                 hang: bool = False) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.timeouts: list[float] = []
        self.status, self.retry_after, self.request_s, self.hang = status, retry_after, request_s, hang

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def post(self, url, *, timeout, **kwargs):
        judge = self
        judge.timeouts.append(timeout.total)

        class Response:
            status = judge.status
            headers = {} if judge.retry_after is None else {"Retry-After": judge.retry_after}

            async def __aenter__(self):
                if judge.hang:
                    judge.now += timeout.total
                    raise asyncio.TimeoutError()
                judge.now += min(judge.request_s, timeout.total)
                return self

            async def __aexit__(self, *exc):
                return False

        return Response()


def score_on(judge: VirtualJudge, cfg: JudgeConfig) -> JudgeClient:
    client = JudgeClient(cfg, session=judge, clock=judge.clock, sleep=judge.sleep)
    with pytest.raises(JudgeError) as err:
        asyncio.run(client.score("2+2?", "4", "4"))
    assert "\n" not in str(err.value) and client.failures == 1
    return client


def test_the_default_budget_is_what_the_reported_batch_timeout_allows_one_call():
    # 16 calls (one wave) got 244 s: wire.timeout_s 120 + one call's 30 * 4 + 0.5 * 2**3 = 124 s.
    assert call_budget_s(JudgeConfig()) == 124.0


def test_retry_after_waits_never_outlast_the_calls_budget_nor_compound(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 0.999)  # the longest jitter
    judge, cfg = VirtualJudge(retry_after="30", request_s=1.0), JudgeConfig()
    client = score_on(judge, cfg)
    assert judge.now <= call_budget_s(cfg) and sum(judge.sleeps) <= call_budget_s(cfg)
    # A Retry-After is a floor for one wait, not the base of the exponential backoff.
    assert judge.sleeps and max(judge.sleeps) <= 30.0
    assert client.requests == cfg.retries + 1


def test_a_retry_after_longer_than_the_time_left_gives_up_at_once_without_sleeping():
    judge, cfg = VirtualJudge(retry_after="30", request_s=0.1), JudgeConfig(timeout_s=2.0, retries=3, backoff_s=0.01)
    score_on(judge, cfg)
    assert judge.sleeps == [] and judge.now == pytest.approx(0.1)


def test_timeouts_and_backoff_stay_within_the_budget_and_requests_get_only_the_time_left(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 0.999)
    judge, cfg = VirtualJudge(hang=True), JudgeConfig(timeout_s=30.0, retries=6, backoff_s=10.0)
    score_on(judge, cfg)
    budget = call_budget_s(cfg)
    assert judge.now <= budget + 1e-9 and sum(judge.sleeps) + sum(judge.timeouts) <= budget + 1e-9
    assert all(0 < total <= cfg.timeout_s for total in judge.timeouts)
