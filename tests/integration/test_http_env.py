"""The HTTP environment adapter (asyncgrpo/envs/http.py) against a local server speaking its JSON
protocol (docs/ENVIRONMENTS.md, HTTP environments): a whole episode, retries on 5xx and dropped
connections, timeouts, answers that are not the protocol, the bearer key, a server that is down.

The server plays guess-the-number: /reset takes the problem (its answer is the number), each /step
answers "higher", "lower" or "correct" (reward 1, done). `fail` queues what the next requests of a
route get instead (an HTTP status, "drop" to close the connection unanswered, "garbage" for a body
that is not JSON, "fields" for JSON without the protocol's fields, a dict for that answer); `delay_s`
holds every answer.
"""

from __future__ import annotations

import http.server
import json
import pickle
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from one_line import raises_one_line

from asyncgrpo.config import load
from asyncgrpo.envs import make_environment
from asyncgrpo.envs.base import EnvStep
from asyncgrpo.envs.http import CAUSES, EnvCallError, HttpClient, HttpEnvironment, http_spec, json_extras
from asyncgrpo.schema import ConfigError, EnvConfig, EnvHttpConfig
from asyncgrpo.tasks.problem import Problem

STOP = "</guess>"


class GuessServer:
    def __init__(self) -> None:
        self.episodes: dict[str, int] = {}
        self.problems: list[dict[str, Any]] = []
        self.closed: list[str] = []
        self.requests: Counter = Counter()  # path -> requests seen
        self.authorization: list[str | None] = []
        self.fail: dict[str, list[Any]] = {}
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._release = threading.Event()  # ends a held answer early, so the fixture can shut down
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name for the GET handler
                outer._handle(self, None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                outer._handle(self, json.loads(self.rfile.read(length)) if length else None)

            def log_message(self, *args: Any) -> None:  # keep the test output clean
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # A client that gave up (a timeout) closes before a held answer is written: not a failure here.
        self.server.handle_error = lambda request, client_address: None
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _handle(self, request: http.server.BaseHTTPRequestHandler, body: Any) -> None:
        with self._lock:
            self.requests[request.path] += 1
            self.authorization.append(request.headers.get("Authorization"))
            queued = self.fail.get(request.path)
            failure = queued.pop(0) if queued else None
        if self.delay_s:
            self._release.wait(self.delay_s)
        if failure == "drop":
            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)
            return
        if isinstance(failure, int):
            self._send(request, failure, b'{"error": "queued failure"}', {"Retry-After": "0.05"})
            return
        if failure == "garbage":
            self._send(request, 200, b"<html>not json</html>")
            return
        if isinstance(failure, dict):
            self._send(request, 200, json.dumps(failure).encode())
            return
        if failure == "fields":
            self._send(request, 200, json.dumps({"observation": 7, "reward": "high"}).encode())
            return
        answer = self._play(request.path, body)
        self._send(request, 404 if answer is None else 200, json.dumps(answer or {"error": "no route"}).encode())

    def _play(self, path: str, body: Any) -> dict[str, Any] | None:
        if path == "/info":
            return {"stop": [STOP], "name": "guess-http"}
        if path == "/reset":
            with self._lock:
                episode_id = f"ep{len(self.problems)}"
                self.problems.append(body["problem"])
                self.episodes[episode_id] = int(body["problem"]["answer"])
            return {"episode_id": episode_id, "observation": "Guess a number from 0 to 99."}
        if path == "/step":
            target = self.episodes[body["episode_id"]]
            text = body["action"].removesuffix(STOP).strip()
            if not text.isdigit():
                return {"observation": "not a number", "reward": 0, "done": False, "bad_action": True}
            guess = int(text)
            if guess == target:
                return {"observation": "correct", "reward": 1.0, "done": True}
            return {"observation": "higher" if guess < target else "lower", "reward": 0, "done": False}
        if path == "/close":
            with self._lock:
                self.episodes.pop(body["episode_id"])
                self.closed.append(body["episode_id"])
            return {}
        return None

    @staticmethod
    def _send(request: http.server.BaseHTTPRequestHandler, status: int, payload: bytes,
              headers: dict[str, str] | None = None) -> None:
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(payload)))
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.end_headers()
        request.wfile.write(payload)

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture()
def server() -> Iterator[GuessServer]:
    game = GuessServer()
    yield game
    game.close()


def env_config(base_url: str, **http: Any) -> EnvConfig:
    """env.name=http at `base_url`, with tiny timeouts and backoff unless `http` says otherwise."""
    settings = {"timeout_s": 2.0, "retries": 2, "backoff_s": 0.01, **http}
    return EnvConfig(name="http", http=EnvHttpConfig(base_url=base_url, **settings))


def recording_environment(cfg: EnvConfig) -> tuple[HttpEnvironment, list[float]]:
    """An environment whose client records its backoff waits instead of sleeping them."""
    waits: list[float] = []
    client = HttpClient.from_config(cfg)
    client.sleep = waits.append
    return HttpEnvironment(client), waits


PROBLEM = Problem(7, "Guess the number.", "42", extra={"raw": "Guess", "numbers": [4, 2], "handle": object()})


def test_a_whole_episode_resets_steps_and_closes_through_the_protocol(server):
    spec = make_environment(env_config(server.base_url))
    assert spec is not None and (spec.name, spec.stop) == ("guess-http", (STOP,))
    env = spec.new()
    assert env.reset(PROBLEM) == "Guess a number from 0 to 99."
    # Only JSON-able extras travel; the rest stays in the generator.
    assert server.problems == [{"id": 7, "prompt": "Guess the number.", "answer": "42",
                                "extra": {"raw": "Guess", "numbers": [4, 2]}}]
    assert env.step("50" + STOP) == EnvStep("lower", 0.0, False, False)
    assert env.step("x" + STOP) == EnvStep("not a number", 0.0, False, True)
    assert env.step("42" + STOP) == EnvStep("correct", 1.0, True, False)
    env.close()
    assert server.closed == ["ep0"] and server.episodes == {}
    env.close()  # a second close sends nothing
    assert server.requests["/close"] == 1
    assert server.requests == Counter({"/info": 1, "/reset": 1, "/step": 3, "/close": 1})


def test_two_503s_are_retried_with_growing_backoff_and_the_third_try_answers(server):
    env, waits = recording_environment(env_config(server.base_url, retries=2, backoff_s=0.01))
    env.reset(PROBLEM)
    server.fail["/step"] = [503, 503]
    assert env.step("10" + STOP).observation == "higher"
    assert server.requests["/step"] == 3
    # backoff_s doubled per retry, with jitter in [0.5, 1.5); the server's Retry-After (0.05 s) is
    # a floor for each wait.
    assert len(waits) == 2 and all(wait >= 0.05 for wait in waits)
    server.fail["/step"] = [503, 503]
    env.client.retries = 1
    with pytest.raises(EnvCallError, match=r"failed 2 tries .* last: answered HTTP 503") as failed:
        env.step("10" + STOP)
    assert failed.value.cause == "http"


def test_a_dropped_connection_is_retried(server):
    env, _ = recording_environment(env_config(server.base_url))
    server.fail["/reset"] = ["drop"]
    assert env.reset(PROBLEM) == "Guess a number from 0 to 99."
    assert server.requests["/reset"] == 2


def test_a_server_slower_than_the_timeout_fails_with_cause_timeout_after_the_retries(server):
    env, waits = recording_environment(env_config(server.base_url, timeout_s=0.05, retries=1))
    server.delay_s = 1.0
    with pytest.raises(EnvCallError) as failed:
        env.reset(PROBLEM)
    assert failed.value.cause == "timeout" and "failed 2 tries" in str(failed.value)
    assert server.requests["/reset"] == 2 and len(waits) == 1


def test_a_call_never_outlasts_env_timeout_s(server):
    """The generator gives up on a call after env.timeout_s: the adapter stops trying by then too."""
    cfg = env_config(server.base_url, timeout_s=0.05, retries=50, backoff_s=0.01)
    cfg.timeout_s = 0.2
    env, _ = recording_environment(cfg)
    server.fail["/reset"] = [500] * 1000
    with pytest.raises(EnvCallError, match="budget \\(env.timeout_s\\)") as failed:
        env.reset(PROBLEM)
    assert failed.value.cause == "http"
    assert env.client.budget_s == 0.2


@pytest.mark.parametrize(("failure", "message"), [("garbage", "not JSON"), ("fields", "without an observation")])
def test_an_answer_outside_the_protocol_is_invalid_at_once(server, failure, message):
    env, _ = recording_environment(env_config(server.base_url))
    env.reset(PROBLEM)
    server.fail["/step"] = [failure]
    with pytest.raises(EnvCallError, match=message) as failed:
        env.step("1" + STOP)
    assert failed.value.cause == "invalid" and "\n" not in str(failed.value)
    assert server.requests["/step"] == 1


def test_a_404_is_not_retried(server):
    env, waits = recording_environment(env_config(server.base_url))
    server.fail["/reset"] = [404]
    with pytest.raises(EnvCallError, match="answered HTTP 404") as failed:
        env.reset(PROBLEM)
    assert failed.value.cause == "http" and server.requests["/reset"] == 1 and waits == []


def test_every_request_carries_the_bearer_key(server, monkeypatch):
    monkeypatch.setenv("TEST_ENV_KEY", "sekrit")
    env = http_spec(env_config(server.base_url, api_key_env="TEST_ENV_KEY")).new()
    env.reset(PROBLEM)
    env.step("42" + STOP)
    env.close()
    assert server.authorization == ["Bearer sekrit"] * 4


def test_no_key_is_sent_without_api_key_env(server):
    http_spec(env_config(server.base_url)).new().reset(PROBLEM)
    assert server.authorization == [None, None]


def test_an_unset_key_variable_is_one_line_naming_it(server, monkeypatch):
    monkeypatch.delenv("TEST_ENV_KEY", raising=False)
    with pytest.raises(ConfigError, match="^env.http.api_key_env names 'TEST_ENV_KEY', which is not set$"):
        http_spec(env_config(server.base_url, api_key_env="TEST_ENV_KEY"))
    assert server.requests["/info"] == 0


def test_a_key_over_plain_http_beyond_loopback_is_refused_before_any_request(monkeypatch):
    monkeypatch.setenv("TEST_ENV_KEY", "sekrit")
    with pytest.raises(ConfigError, match="^env.http.base_url is plain http:// .*TEST_ENV_KEY") as refused:
        http_spec(env_config("http://10.0.0.7:8100", api_key_env="TEST_ENV_KEY"))
    assert "\n" not in str(refused.value)


def test_config_validation_refuses_a_key_over_plain_http_beyond_loopback():
    base = ["env.name=http", "env.http.api_key_env=TEST_ENV_KEY"]
    with pytest.raises(ConfigError, match="^env.http.base_url is plain http://"):
        load([*base, "env.http.base_url=http://env.internal:8100"])
    assert load([*base, "env.http.base_url=https://env.internal"]).env.http.base_url == "https://env.internal"
    assert load([*base, "env.http.base_url=http://127.0.0.1:8100"]).env.name == "http"


@pytest.fixture()
def dead_port() -> Iterator[int]:
    """A port bound but not listening: connecting is refused, and nothing else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_server_that_is_down_is_one_line_naming_the_url(dead_port):
    base_url = f"http://127.0.0.1:{dead_port}"
    with pytest.raises(ConfigError) as down:
        http_spec(env_config(base_url, retries=1))
    message = str(down.value)
    assert "\n" not in message and message.startswith(f"env.http.base_url={base_url!r}: ")
    assert "connection" in message and "GET /info" in message


def test_an_info_answer_outside_the_protocol_is_one_line_naming_the_url(server):
    server.fail["/info"] = ["fields"]
    with raises_one_line(ConfigError, match=r"^env.http.base_url='http://127.0.0.1:\d+': GET /info must answer"):
        http_spec(env_config(server.base_url))
    server.fail["/info"] = [404]
    with raises_one_line(ConfigError, match=r"^env.http.base_url='http://127.0.0.1:\d+': .*HTTP 404"):
        http_spec(env_config(server.base_url))


def test_an_info_answer_without_stop_texts_is_refused_since_no_turn_would_call_the_server(server):
    server.fail["/info"] = [{"stop": [], "name": "silent"}]
    with pytest.raises(ConfigError, match=r"GET /info must answer \{\"stop\": \[one or more non-empty texts\]"):
        http_spec(env_config(server.base_url))
    assert http_spec(env_config(server.base_url)).stop == (STOP,)


def test_close_never_raises_when_the_server_is_gone(server):
    env = http_spec(env_config(server.base_url)).new()
    env.reset(PROBLEM)
    server.close()
    env.close()


def test_only_json_extras_travel_and_causes_are_the_documented_ones():
    assert json_extras({"a": 1, "b": float("nan"), "c": {1, 2}, "d": {"e": [1, "x"]}}) == {"a": 1, "d": {"e": [1, "x"]}}
    assert CAUSES == ("timeout", "http", "invalid", "connection")


def test_a_call_error_keeps_its_cause_across_a_process_boundary():
    copy = pickle.loads(pickle.dumps(EnvCallError("timeout", "GET x\nfailed")))
    assert (copy.cause, str(copy)) == ("timeout", "GET x failed")
