"""The HTTP judge against a real local aiohttp server speaking /v1/chat/completions.

One server plays every scenario, chosen by the request's `model`: a correct judge, a slow one,
one failing with 5xx before answering, one always down, one rate-limiting, one rate-limiting for
longer than a call may wait, one answering nonsense, one rejecting the request, one requiring an API key.
"""

import asyncio
import threading
from collections import Counter

import numpy as np
import pytest
from aiohttp import web

from asyncgrpo.rewards.judge import JudgeError, probe_judge
from asyncgrpo.rewards.scorer import Scorer
from asyncgrpo.schema import JudgeConfig, RewardConfig, RewardTermConfig
from asyncgrpo.tasks import ArithmeticTask, Problem

TEMPLATE = "QUESTION={prompt}|RESPONSE={completion}|REFERENCE={answer}"


class JudgeServer:
    def __init__(self) -> None:
        self.requests: Counter = Counter()  # (model, completion) -> requests seen
        self.in_flight = 0
        self.max_in_flight = 0
        self.delay_s = 0.0
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(10), "judge test server did not start"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @staticmethod
    def reply(content: str) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "judge"}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body["model"]
        fields = dict(part.split("=", 1) for part in body["messages"][0]["content"].split("|"))
        key = (model, fields["RESPONSE"])
        with self._lock:
            self.requests[key] += 1
            seen = self.requests[key]
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.headers.append(dict(request.headers))
        try:
            await asyncio.sleep(self.delay_s)
            verdict = "Score: 10" if fields["RESPONSE"].strip() == fields["REFERENCE"] else "Score: 2"
            if model == "slow":
                await asyncio.sleep(1.0)  # well past the client timeout; short so shutdown is quick
            if model == "flaky" and seen <= 2:
                return web.Response(status=500, text="overloaded")
            if model == "down":
                return web.Response(status=503, text="down")
            if model == "ratelimit" and seen == 1:
                return web.Response(status=429, headers={"Retry-After": "0"})
            if model == "busy":
                return web.Response(status=429, headers={"Retry-After": "30"})
            if model == "nonsense":
                return self.reply("I would rather not say.")
            if model == "reject":
                return web.Response(status=400, text="bad request")
            if model == "badjson":
                return web.Response(status=200, text="<html>proxy error</html>")
            if model == "auth" and request.headers.get("Authorization") != "Bearer sekrit":
                return web.Response(status=401, text="no key")
            return self.reply(verdict)
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.fixture(scope="module")
def server():
    judge_server = JudgeServer()
    yield judge_server
    judge_server.close()


@pytest.fixture(autouse=True)
def reset(server):
    server.requests.clear()
    server.max_in_flight = 0
    server.delay_s = 0.0
    server.headers.clear()


def make_scorer(server: JudgeServer, model: str, on_error: str = "zero", **judge) -> Scorer:
    settings = dict(base_url=server.base_url, model=model, prompt_template=TEMPLATE, timeout_s=2.0, retries=2,
                    backoff_s=0.01, concurrency=4)
    settings.update(judge)
    cfg = RewardConfig(terms=[RewardTermConfig(name="judge")], on_error=on_error, judge=JudgeConfig(**settings))
    return Scorer(ArithmeticTask(num_digits=2, eval_size=500), cfg)


PROBLEM = Problem(id=7, prompt="37+48=", answer="85")


def test_scores_come_from_the_judges_reply(server):
    scorer = make_scorer(server, "ok")
    try:
        [score] = scorer.score([PROBLEM], [["85", "86", " 85 "]], timeout_s=10)
        assert score.rewards.tolist() == pytest.approx([1.0, 0.2, 1.0])
        assert score.errors == 0 and score.meta() == {"reward/judge": pytest.approx(0.733333, abs=1e-5), "reward/errors": 0}
    finally:
        scorer.close()


def test_concurrency_is_limited_and_scoring_overlaps_the_caller(server):
    server.delay_s = 0.1
    scorer = make_scorer(server, "ok", concurrency=3)
    try:
        future = scorer.submit([PROBLEM] * 4, [[str(80 + i) for i in range(6)]] * 4)
        # submit returned before the judge answered (24 requests of 0.1 s each): the caller is free
        # to generate meanwhile.
        assert not future.done()
        scores = future.result(timeout=30)
        assert [s.rewards.tolist().count(1.0) for s in scores] == [1, 1, 1, 1]
        assert 1 < server.max_in_flight <= 3  # requests overlapped, never more than judge.concurrency
    finally:
        scorer.close()


def test_a_slow_judge_times_out_retries_and_counts_errors(server):
    scorer = make_scorer(server, "slow", timeout_s=0.2, retries=1)
    try:
        [score] = scorer.score([PROBLEM], [["85", "1"]], timeout_s=10)
        assert score.rewards.tolist() == [0.0, 0.0] and score.errors == 2 and not score.dropped
        assert np.isnan(score.terms["judge"]).all()
        assert score.meta() == {"reward/errors": 2}
        assert server.requests[("slow", "85")] == 2  # the first try and one retry
        assert "failed 2 tries" in score.error_messages[0] and "TimeoutError" in score.error_messages[0]
    finally:
        scorer.close()


def test_server_errors_are_retried_with_backoff_until_an_answer(server):
    scorer = make_scorer(server, "flaky", retries=3)
    try:
        [score] = scorer.score([PROBLEM], [["85", "9"]], timeout_s=10)
        assert score.rewards.tolist() == pytest.approx([1.0, 0.2]) and score.errors == 0
        assert server.requests[("flaky", "85")] == 3
        judge = scorer.terms[0].judge
        assert judge.retries == 4 and judge.failures == 0
    finally:
        scorer.close()


def test_rate_limit_is_retried(server):
    scorer = make_scorer(server, "ratelimit")
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.rewards.tolist() == [1.0] and server.requests[("ratelimit", "85")] == 2
    finally:
        scorer.close()


def test_a_judge_that_stays_down_drops_the_group_under_drop_group(server):
    scorer = make_scorer(server, "down", on_error="drop_group", retries=2)
    try:
        [score] = scorer.score([PROBLEM], [["85", "1"]], timeout_s=10)
        assert score.dropped and score.errors == 2
        assert server.requests[("down", "85")] == 3
        assert "HTTP 503" in score.error_messages[0]
        assert scorer.stats_snapshot() == {"reward/errors": 2, "reward/groups_dropped": 1, "reward/calls": 2}
    finally:
        scorer.close()


@pytest.mark.parametrize(("model", "message"), [
    ("nonsense", "no score in the judge's reply"),
    ("reject", "HTTP 400"),
    ("badjson", "not JSON"),
])
def test_unusable_answers_fail_at_once_without_retries(server, model, message):
    scorer = make_scorer(server, model, retries=3)
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.errors == 1 and score.rewards.tolist() == [0.0]
        assert message in score.error_messages[0]
        assert server.requests[(model, "85")] == 1
    finally:
        scorer.close()


def test_api_key_comes_from_the_named_environment_variable(server, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sekrit")
    scorer = make_scorer(server, "auth", api_key_env="TEST_JUDGE_KEY")
    try:
        assert scorer.score([PROBLEM], [["85"]], timeout_s=10)[0].rewards.tolist() == [1.0]
        assert server.headers[-1]["Authorization"] == "Bearer sekrit"
    finally:
        scorer.close()


def test_a_missing_api_key_is_an_error_naming_the_variable(server, monkeypatch):
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    scorer = make_scorer(server, "auth", api_key_env="TEST_JUDGE_KEY")
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.errors == 1 and "TEST_JUDGE_KEY" in score.error_messages[0]
    finally:
        scorer.close()


def test_an_unreachable_judge_is_an_error_not_a_hang():
    cfg = RewardConfig(terms=[RewardTermConfig(name="judge")], judge=JudgeConfig(
        base_url="http://127.0.0.1:9/v1", model="m", timeout_s=1.0, retries=1, backoff_s=0.01))
    scorer = Scorer(ArithmeticTask(num_digits=2, eval_size=500), cfg)
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.errors == 1 and "failed 2 tries" in score.error_messages[0]
    finally:
        scorer.close()


def test_the_start_up_probe_finds_a_running_judge_and_no_dead_one(server):
    assert probe_judge(JudgeConfig(base_url=server.base_url, model="m")) == {
        "url": f"{server.base_url}/models", "status": 200}
    with pytest.raises(JudgeError, match="the judge cannot be reached") as err:
        probe_judge(JudgeConfig(base_url="http://127.0.0.1:9/v1", model="m", timeout_s=1.0))
    assert "\n" not in str(err.value)


def redirect_scorer(base_url: str) -> Scorer:
    cfg = RewardConfig(terms=[RewardTermConfig(name="judge")], judge=JudgeConfig(
        base_url=base_url, model="m", prompt_template=TEMPLATE, api_key_env="TEST_JUDGE_KEY", timeout_s=2.0,
        retries=2, backoff_s=0.01))
    return Scorer(ArithmeticTask(num_digits=2, eval_size=500), cfg)


def test_a_redirect_to_another_origin_is_a_counted_error_and_the_key_never_reaches_it(redirecting_judge, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sekrit")
    scorer = redirect_scorer(redirecting_judge.base_url)
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.errors == 1 and score.rewards.tolist() == [0.0]
        assert "to another origin" in score.error_messages[0] and redirecting_judge.other_origin in score.error_messages[0]
        # Not retried (the answer would be the same), and nothing reached the other origin.
        assert redirecting_judge.seen == [("front", "POST", "/v1/chat/completions", "Bearer sekrit")]
    finally:
        scorer.close()


def test_a_redirect_within_the_judges_own_origin_is_followed_with_the_key(redirecting_judge, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sekrit")
    scorer = redirect_scorer(f"{redirecting_judge.origin}/same/v1")
    try:
        [score] = scorer.score([PROBLEM], [["85"]], timeout_s=10)
        assert score.errors == 0 and score.rewards.tolist() == [1.0]
        assert redirecting_judge.seen[-1] == ("front", "POST", "/ok/v1/chat/completions", "Bearer sekrit")
    finally:
        scorer.close()


def test_a_retry_after_beyond_the_calls_budget_is_a_counted_error_within_its_deadline(server):
    # Budget of one call: timeout_s * (retries + 1) + backoff_s * 2**retries = 0.5 * 4 + 0.01 * 8 = 2.08 s;
    # the judge asks for 30 s. Waiting would outlast the batch's reward timeout (the caller's 10 s
    # here), so the call gives up at once and counts a reward error.
    scorer = make_scorer(server, "busy", timeout_s=0.5, retries=3, backoff_s=0.01)
    try:
        [score] = scorer.score([PROBLEM], [["85", "1"]], timeout_s=10)
        assert score.errors == 2 and score.rewards.tolist() == [0.0, 0.0]
        assert "Retry-After" in score.error_messages[0] and "HTTP 429" in score.error_messages[0]
        assert server.requests[("busy", "85")] == 1
    finally:
        scorer.close()
