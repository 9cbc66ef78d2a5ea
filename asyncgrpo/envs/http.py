"""An environment served over HTTP with a JSON protocol (env.name=http, env.http.*).

The server may be written in any language; docs/ENVIRONMENTS.md, HTTP environments, is its
protocol. Once per generator, `http_spec` asks GET <base_url>/info for the texts that end a policy
turn; each episode is then one `HttpEnvironment`: POST /reset with the problem, POST /step with each
turn's text, POST /close at the end (best effort).

Requests follow the LLM judge's rules (asyncgrpo/rewards/judge.py, whose helpers they share): each
try bounded by env.http.timeout_s; timeouts, connection errors, 429 and 5xx retried env.http.retries
times with exponential backoff from env.http.backoff_s (a Retry-After, if longer, honoured for that
wait); any other 4xx and an answer that is not the protocol's JSON fail at once, since the same
request would get the same answer. One call (reset or step) never takes longer than
env.timeout_s, the generator's limit on it: tries are cut to the time left and a wait that would
end past it is not started. A failure raises `EnvCallError`, whose `cause` (timeout | http | invalid
| connection) the generator counts (gen/env_errors_<cause>, asyncgrpo/envs/calls.py).

The bearer token comes from the variable named by env.http.api_key_env; config validation refuses
it over plain http:// to a host other than loopback, and so does `http_spec`. Redirects are never
followed (a POST must not turn into a GET, nor the key go elsewhere): a 3xx fails the call.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPException
from typing import Any

from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
from asyncgrpo.envs.calls import EnvCallError  # an HTTP call's failure: its cause is one of CAUSES
from asyncgrpo.rewards.errors import one_line
from asyncgrpo.rewards.judge import (
    backoff_wait_s,
    bearer_headers,
    key_transport_error,
    retry_after_s,
    retry_budget_s,
    retryable_status,
)
from asyncgrpo.schema import ConfigError, EnvConfig
from asyncgrpo.tasks.problem import Problem

# EnvCallError.cause: no answer in time | an HTTP status that is an error | an answer that is not the
# protocol's | the server could not be reached or dropped the connection.
CAUSES = ("timeout", "http", "invalid", "connection")
# Of an error answer's body, this much goes into the error text.
MAX_BODY_CHARS = 200


class _Retryable(Exception):
    """A try that may succeed if repeated: a timeout, a connection error, HTTP 429 or 5xx."""

    def __init__(self, cause: str, failure: str, retry_after: float = 0.0) -> None:
        super().__init__(failure)
        self.cause, self.retry_after_s = cause, retry_after


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # urllib would turn a redirected POST into a GET and send the key wherever it points; returning
    # None makes the 3xx an HTTPError instead.
    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        return None


@dataclass
class HttpClient:
    """JSON requests to one environment server with env.http's retries; shared by a generator's
    episodes (it holds no per-episode state). `sleep` and `clock` stand in for time.sleep and
    time.monotonic in tests."""

    base_url: str
    headers: dict[str, str]
    timeout_s: float  # env.http.timeout_s: one try
    retries: int  # env.http.retries
    backoff_s: float  # env.http.backoff_s
    budget_s: float  # one call, all its tries and waits: min(env.timeout_s, retry_budget_s of env.http)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        # No proxy from the process environment: the server is named by env.http.base_url alone.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())

    @classmethod
    def from_config(cls, cfg: EnvConfig) -> HttpClient:
        """The client of env.http; raises ConfigError (one line) for a key that is unset or may not
        travel to env.http.base_url."""
        http = cfg.http
        insecure = key_transport_error(http.base_url, http.api_key_env, "env.http.api_key_env")
        if insecure:
            raise ConfigError(f"env.http.base_url {insecure} (got {http.base_url!r})")
        headers = bearer_headers(http.api_key_env, "env.http.api_key_env", ConfigError)
        return cls(http.base_url, headers, http.timeout_s, http.retries, http.backoff_s,
                   min(cfg.timeout_s, retry_budget_s(http.timeout_s, http.retries, http.backoff_s)))

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """`method` <base_url><route> with `body` as JSON -> the answer's JSON, retried; raises EnvCallError."""
        url = self.base_url + route
        deadline = self.clock() + self.budget_s
        last = _Retryable("timeout", "no try made")
        for attempt in range(self.retries + 1):
            if attempt:
                wait = backoff_wait_s(self.backoff_s, attempt, last.retry_after_s)
                if self.clock() + wait >= deadline:
                    raise EnvCallError(last.cause, f"{method} {url} gave up after {attempt} tries: the next wait, "
                                                   f"{wait:.2f} s, would end past the call's {self.budget_s:g}-s "
                                                   f"budget (env.timeout_s); last: {last}")
                self.sleep(wait)
            left = deadline - self.clock()
            if left <= 0:
                raise EnvCallError(last.cause, f"{method} {url} gave up after {attempt} tries: no time left of the "
                                               f"call's {self.budget_s:g}-s budget (env.timeout_s); last: {last}")
            try:
                return self._try(method, url, body, min(self.timeout_s, left))
            except _Retryable as failure:
                last = failure
        raise EnvCallError(last.cause, f"{method} {url} failed {self.retries + 1} tries (env.http.retries="
                                       f"{self.retries}, timeout_s={self.timeout_s:g}); last: {last}")

    def _try(self, method: str, url: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """One request -> its JSON; raises _Retryable or EnvCallError (an answer a retry would not change)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers=self.headers, method=method)
        try:
            with self._opener.open(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            text, failure = _error_body(err), f"answered HTTP {err.code}"
            if retryable_status(err.code):
                raise _Retryable("http", failure, retry_after_s(err.headers.get("Retry-After"))) from None
            raise EnvCallError("http", f"{method} {url} {failure}: {text!r}") from None
        except urllib.error.URLError as err:
            reason = err.reason
            cause = "timeout" if isinstance(reason, TimeoutError) else "connection"
            raise _Retryable(cause, f"{type(reason).__name__}: {reason}") from None
        except TimeoutError as err:  # the answer did not come in time
            raise _Retryable("timeout", f"TimeoutError: {err}") from None
        except (OSError, HTTPException) as err:  # reset or closed mid-answer
            raise _Retryable("connection", f"{type(err).__name__}: {err}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise EnvCallError("invalid", f"{method} {url} answered a body that is not JSON: "
                                          f"{raw[:MAX_BODY_CHARS]!r}") from None

    def notify(self, route: str, body: dict[str, Any]) -> None:
        """POST `body` to <base_url><route> once, ignoring any failure (a courtesy to the server)."""
        try:
            self._try("POST", self.base_url + route, body, min(self.timeout_s, self.budget_s))
        except Exception:  # noqa: BLE001 - best effort: the server may be gone already
            pass


def _error_body(err: urllib.error.HTTPError) -> str:
    """The start of an error answer's body, for the error text ("" if it cannot be read)."""
    try:
        with err:
            return err.read(MAX_BODY_CHARS).decode(errors="replace")
    except Exception:  # noqa: BLE001 - the status alone still says what happened
        return ""


def _field(answer: Any, name: str, kind: type | tuple[type, ...], what: str, url: str) -> Any:
    """`answer[name]` if it is of `kind`, else EnvCallError("invalid") naming the field."""
    value = answer.get(name) if isinstance(answer, dict) else None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise EnvCallError("invalid", f"{url} answered without {what} in {name!r}: "
                                      f"{one_line(repr(answer), MAX_BODY_CHARS)}")
    return value


def json_extras(extra: dict[str, Any]) -> dict[str, Any]:
    """The entries of Problem.extra a JSON body can carry (a tensor or an object stays home)."""
    kept = {}
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue
        if isinstance(key, str):
            kept[key] = value
    return kept


class HttpEnvironment:
    """One episode on the server: `reset` opens it (the server names it), `step` plays a turn,
    `close` ends it. Calls are sequential (the generator makes one at a time per episode)."""

    def __init__(self, client: HttpClient) -> None:
        self.client = client
        self.episode_id: str | None = None

    def reset(self, problem: Problem) -> str:
        body = {"problem": {"id": problem.id, "prompt": problem.prompt, "answer": problem.answer,
                            "extra": json_extras(problem.extra)}}
        url = self.client.base_url + "/reset"
        answer = self.client.call("POST", "/reset", body)
        episode_id = _field(answer, "episode_id", str, "an episode id (text)", url)
        observation = _field(answer, "observation", str, "an observation (text)", url)
        self.episode_id = episode_id
        return observation

    def step(self, action: str) -> EnvStep:
        if self.episode_id is None:
            raise EnvCallError("invalid", "step before a successful reset: the server named no episode")
        url = self.client.base_url + "/step"
        answer = self.client.call("POST", "/step", {"episode_id": self.episode_id, "action": action})
        observation = _field(answer, "observation", str, "an observation (text)", url)
        reward = float(_field(answer, "reward", (int, float), "a reward (a number)", url))
        if not math.isfinite(reward):
            raise EnvCallError("invalid", f"{url} answered a reward that is not finite: {reward}")
        done = _field(answer, "done", bool, "done (true or false)", url)
        bad_action = _field(answer, "bad_action", bool, "bad_action (true or false)", url) \
            if isinstance(answer, dict) and "bad_action" in answer else False
        return EnvStep(observation=observation, reward=reward, done=done, bad_action=bad_action)

    def close(self) -> None:
        """Tell the server the episode is over: one try, never raises (the episode's result stands
        whatever the server does with it)."""
        if self.episode_id is None:
            return
        episode_id, self.episode_id = self.episode_id, None
        self.client.notify("/close", {"episode_id": episode_id})


def fetch_info(client: HttpClient) -> tuple[str, tuple[str, ...]]:
    """GET <base_url>/info -> (the environment's name, its stop texts); raises ConfigError (one line
    naming env.http.base_url) when the server cannot be reached or answers something else."""
    where = f"env.http.base_url={client.base_url!r}"
    try:
        info = client.call("GET", "/info")
    except EnvCallError as err:
        raise ConfigError(f"{where}: the environment server cannot be reached or refused GET /info "
                          f"({err.cause}: {err}); start it or fix the URL") from None
    stop = info.get("stop") if isinstance(info, dict) else None
    # An empty list would never call the server: turns end only at eos or the token budget, which end the episode.
    if not isinstance(stop, list) or not stop or not all(isinstance(text, str) and text for text in stop):
        raise ConfigError(f"{where}: GET /info must answer "
                          f"{{\"stop\": [one or more non-empty texts], \"name\": text}}, "
                          f"got {one_line(repr(info), MAX_BODY_CHARS)}")
    name = info.get("name")
    return (name if isinstance(name, str) and name else "http"), tuple(stop)


def http_spec(cfg: EnvConfig) -> EnvironmentSpec:
    """The environment served at env.http.base_url: its stop texts asked once (GET /info), then
    one `HttpEnvironment` per episode. Raises ConfigError (one line) for a server that is down or
    does not speak the protocol, and for a key that is unset or may not travel there."""
    client = HttpClient.from_config(cfg)
    name, stop = fetch_info(client)
    return EnvironmentSpec(name=name, new=lambda: HttpEnvironment(client), stop=stop)
