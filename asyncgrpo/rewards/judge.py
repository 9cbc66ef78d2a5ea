"""An LLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint, called with aiohttp.

Each score is one request: the prompt template filled with the question, the completion and the
reference answer; the reply's text is parsed into a score in [0, 1]. Requests share one session,
at most `concurrency` in flight; each has its own timeout; timeouts, connection errors, 429 and
5xx are retried with exponential backoff (a Retry-After header, if longer, is honoured up to
MAX_RETRY_AFTER_S for that one wait). A 4xx, a malformed body or an unparseable reply fails at
once: retrying a deterministic judge would get the same answer.

Each call has a time budget, `call_budget_s`, from its first request: requests are cut to the time
left and a wait that would reach the end of it is not started: the call fails (a reward error,
counted) instead. The generator's wait for a batch's rewards allows each call that budget, so a
judge that keeps asking for time costs reward errors, never the generator's timeout.

Redirects are followed only within the judge's own origin (scheme, host and port): the requests
carry the API key, which must not reach another server. A redirect elsewhere is an error, and a
plain http:// base_url with a key is refused at config validation unless it is loopback
(`key_transport_error`).

`probe_judge` is the driver's check before any actor starts: one short GET <base_url>/models.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from asyncgrpo.schema import JudgeConfig
from asyncgrpo.wire.network import is_loopback

MAX_RETRY_AFTER_S = 30.0
# Same-origin redirects followed per request (a trailing slash, a moved prefix); more is a loop.
MAX_REDIRECTS = 5
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
# The start-up probe waits at most this long (or reward.judge.timeout_s, if shorter): a judge that
# cannot answer a model listing in seconds is down, and start-up should not hang on it.
PROBE_TIMEOUT_S = 5.0
# reward.judge.parser: number (the last number in the reply / max_score) | yes_no, or
# regex:<pattern with one group> (group 1 of the first match / max_score).
JUDGE_PARSERS = ("number", "yes_no")
REGEX_PARSER_PREFIX = "regex:"
_NUMBER = r"-?\d+(?:\.\d+)?"


class JudgeError(RuntimeError):
    """The judge gave no usable score for one completion."""


class JudgeParseError(JudgeError):
    """The judge answered, but its reply holds no score."""


def fill_template(template: str, *, prompt: str, completion: str, answer: str | None) -> str:
    # Plain replacement, not str.format: templates often contain JSON braces.
    return (template.replace("{prompt}", prompt).replace("{completion}", completion)
            .replace("{answer}", "" if answer is None else answer))


def parse_score(reply: str, *, parser: str, max_score: float) -> float:
    """A judge reply as a score in [0, 1]; raises JudgeParseError when there is none.

    `parser` and `max_score` are reward.judge.parser and reward.judge.max_score; an unknown parser
    raises ValueError.

    number: "7", "Score: 7", "7/10", "7 out of 10" -> 0.7 with max_score 10; out-of-range fails.
    yes_no: a reply starting with yes/no, or naming exactly one of them.
    regex:<pattern>: group 1 of the first match, divided by max_score.
    """
    if parser not in JUDGE_PARSERS and not parser.startswith(REGEX_PARSER_PREFIX):
        raise ValueError(f"reward.judge.parser must be one of {', '.join(JUDGE_PARSERS)} or "
                         f"{REGEX_PARSER_PREFIX}<pattern>, got {parser!r}")
    text = reply.strip()
    if parser == "yes_no":
        lowered = text.lower()
        if re.match(r"\W*yes\b", lowered):
            return 1.0
        if re.match(r"\W*no\b", lowered):
            return 0.0
        said_yes, said_no = bool(re.search(r"\byes\b", lowered)), bool(re.search(r"\bno\b", lowered))
        if said_yes != said_no:
            return 1.0 if said_yes else 0.0
        raise JudgeParseError(f"no yes/no in the judge's reply: {text[:80]!r}")
    if parser.startswith(REGEX_PARSER_PREFIX):
        match = re.search(parser[len(REGEX_PARSER_PREFIX):], text, re.DOTALL)
        if not match or match.lastindex is None:
            raise JudgeParseError(f"reward.judge.parser found no match in the judge's reply: {text[:80]!r}")
        value_text = match.group(1)
    else:
        match = (re.search(rf"({_NUMBER})\s*(?:/|out of)\s*\d", text, re.IGNORECASE)
                 or re.search(rf"score\D{{0,20}}?({_NUMBER})", text, re.IGNORECASE))
        if match:
            value_text = match.group(1)
        else:
            numbers = re.findall(_NUMBER, text)
            if not numbers:
                raise JudgeParseError(f"no score in the judge's reply: {text[:80]!r}")
            value_text = numbers[-1]
    try:
        value = float(value_text)
    except ValueError:
        raise JudgeParseError(f"score {value_text!r} in the judge's reply is not a number") from None
    if not 0.0 <= value <= max_score:
        raise JudgeParseError(f"score {value} outside [0, reward.judge.max_score={max_score}]: {text[:80]!r}")
    return value / max_score


def bearer_headers(api_key_env: str, setting: str, error: type[Exception]) -> dict[str, str]:
    """JSON request headers, with `Authorization: Bearer <key>` from the environment variable named
    `api_key_env` when there is one; raises `error` (one line naming the config key `setting`) if
    that variable is unset. Shared by the judge and the HTTP environment (asyncgrpo/envs/http.py)."""
    headers = {"Content-Type": "application/json"}
    if api_key_env:
        key = os.environ.get(api_key_env, "")
        if not key:
            raise error(f"{setting} names {api_key_env!r}, which is not set")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def request_headers(cfg: JudgeConfig) -> dict[str, str]:
    """The judge's request headers, with the API key from reward.judge.api_key_env; raises JudgeError if it is unset."""
    return bearer_headers(cfg.api_key_env, "reward.judge.api_key_env", JudgeError)


def call_budget_s(cfg: JudgeConfig) -> float:
    """The most one score() call may take from its first request: every try's timeout and the
    nominal backoff. The generator's wait for a batch's rewards (rollout/scoring.py:
    score_timeout_s) allows this per wave of reward.judge.concurrency calls."""
    return retry_budget_s(cfg.timeout_s, cfg.retries, cfg.backoff_s)


def retry_budget_s(timeout_s: float, retries: int, backoff_s: float) -> float:
    """The most a call retried this way may take from its first request: every try's timeout and the
    nominal backoff; a judge call's (`call_budget_s`) and one HTTP environment call's (env.http)."""
    return timeout_s * (retries + 1) + backoff_s * 2 ** retries


def retryable_status(status: int) -> bool:
    """An HTTP status worth another try: 429 (rate limited) and 5xx (the server's trouble). Any
    other 4xx would get the same answer again."""
    return status == 429 or status >= 500


def backoff_wait_s(backoff_s: float, retry: int, retry_after_s: float) -> float:
    """The wait before retry number `retry` (1 for the first): `backoff_s` doubled per retry, with
    jitter so that many failed requests do not retry in lock step; a Retry-After is a floor for
    this wait only, so it does not compound with the backoff."""
    return max(backoff_s * 2 ** (retry - 1) * (0.5 + random.random()), retry_after_s)


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in; a port that is not a number is None."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port


def http_url_error(url: str) -> str | None:
    """Why `url` is not an http(s) URL with a host and a valid port (what a request needs), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError as err:
        return str(err)
    if parts.scheme.lower() not in ("http", "https"):
        return "not http:// or https://"
    if not parts.hostname:
        return "no host"
    return None if port is None or port > 0 else "port 0"


def same_origin(url: str, other: str) -> bool:
    return origin(url) == origin(other) and origin(url)[2] is not None


def key_transport_error(base_url: str, api_key_env: str, setting: str) -> str | None:
    """Why the API key in the variable `api_key_env` (the config key `setting`) may not go to
    `base_url` (plain http to a host other than loopback, where anyone on the path reads it), or None."""
    if not api_key_env or origin(base_url)[0] != "http" or is_loopback(origin(base_url)[1]):
        return None
    return (f"is plain http:// to a host other than loopback, which would send the key in "
            f"{setting}={api_key_env!r} unencrypted: use https:// (plain http is allowed only on "
            f"127.0.0.0/8, ::1 and localhost)")


def _redirect_refused(status: int, target: str) -> str:
    return (f"redirected (HTTP {status}) to another origin, {target}: not followed, so the key and the "
            f"requests stay with the judge; set reward.judge.base_url to where the judge is")


def probe_judge(cfg: JudgeConfig) -> dict[str, Any]:
    """One GET <base_url>/models: any HTTP answer shows the judge is up (a server without that
    route answers 404, which is still an answer), except 401/403, a key it refuses. Raises
    JudgeError, on one line, when the judge cannot be reached or refuses the key."""
    import urllib.error
    import urllib.request

    url = cfg.base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url, headers=request_headers(cfg), method="GET")

    class SameOriginRedirects(urllib.request.HTTPRedirectHandler):
        # urllib would send every header, the key included, to wherever the redirect points.
        def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
            if not same_origin(req.full_url, newurl):
                fp.close()
                raise JudgeError(f"reward.judge.base_url={cfg.base_url!r}: GET {req.full_url} was "
                                 f"{_redirect_refused(code, newurl)}")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    # No proxy from the environment, as for the scoring requests (aiohttp ignores those variables).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), SameOriginRedirects())
    try:
        with opener.open(request, timeout=min(PROBE_TIMEOUT_S, cfg.timeout_s)) as response:
            status = int(response.status)
    except urllib.error.HTTPError as err:
        status = int(err.code)
    except (urllib.error.URLError, OSError, ValueError) as err:  # refused, unknown host, timed out, bad URL
        reason = getattr(err, "reason", err)
        raise JudgeError(f"reward.judge.base_url={cfg.base_url!r}: the judge cannot be reached "
                         f"(GET {url}: {type(reason).__name__}: {reason}); start it or fix the URL") from None
    if status in (401, 403):
        raise JudgeError(f"reward.judge.base_url={cfg.base_url!r}: the judge refused the request (GET {url}: HTTP "
                         f"{status}); check the key in reward.judge.api_key_env={cfg.api_key_env!r}")
    return {"url": url, "status": status}


class _Retryable(Exception):
    """A try that may succeed if repeated: a timeout, a connection error, HTTP 429 or 5xx."""

    def __init__(self, failure: str, retry_after_s: float = 0.0) -> None:
        super().__init__(failure)
        self.retry_after_s = retry_after_s


class JudgeClient:
    """Scores completions with the judge; use from one event loop (the Scorer's).

    `session`, `clock` and `sleep` stand in for the aiohttp session, time.monotonic and
    asyncio.sleep in tests (a virtual clock)."""

    def __init__(self, cfg: JudgeConfig, *, session: Any = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.settings = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.budget_s = call_budget_s(cfg)
        self._session: Any = session
        self._semaphore: asyncio.Semaphore | None = None
        self._clock, self._sleep = clock, sleep
        self.requests = 0
        self.retries = 0
        self.failures = 0

    async def _ensure_session(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.settings.concurrency), headers=request_headers(self.settings))
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.settings.concurrency)
        return self._session

    async def score(self, prompt: str, completion: str, answer: str | None) -> float:
        """The judge's score in [0, 1]; raises JudgeError (one line) when there is none, at the
        latest `call_budget_s` after the first request."""
        try:
            return await self._score(prompt, completion, answer)
        except JudgeError:
            self.failures += 1
            raise

    async def _score(self, prompt: str, completion: str, answer: str | None) -> float:
        session = await self._ensure_session()
        assert self._semaphore is not None
        body = {
            "model": self.settings.model,
            "messages": [{"role": "user", "content": fill_template(
                self.settings.prompt_template, prompt=prompt, completion=completion, answer=answer)}],
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
        }
        # The budget counts from the first request, not from the wait for a slot: calls queued
        # behind reward.judge.concurrency others are allowed for in the batch's timeout by waves.
        deadline: float | None = None
        last = _Retryable("")
        for attempt in range(self.settings.retries + 1):
            if attempt:
                assert deadline is not None
                wait = backoff_wait_s(self.settings.backoff_s, attempt, last.retry_after_s)
                left = deadline - self._clock()
                if wait >= left:
                    raise JudgeError(self._gave_up(attempt, f"the next wait, {wait:.1f} s, is beyond the "
                                                            f"{max(left, 0.0):.1f} s left", last))
                self.retries += 1
                await self._sleep(wait)
            async with self._semaphore:
                now = self._clock()
                deadline = now + self.budget_s if deadline is None else deadline
                if deadline - now <= 0:
                    raise JudgeError(self._gave_up(attempt, "no time left for another try", last))
                self.requests += 1
                try:
                    data = await self._post(session, body, deadline)
                except _Retryable as failure:
                    last = failure
                    continue
            try:
                reply = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise JudgeError(f"judge {self.url} reply has no choices[0].message.content") from None
            return parse_score(str(reply or ""), parser=self.settings.parser, max_score=self.settings.max_score)
        raise JudgeError(f"judge {self.url} failed {self.settings.retries + 1} tries (reward.judge.retries="
                         f"{self.settings.retries}, timeout_s={self.settings.timeout_s}); last: {last}")

    def _gave_up(self, tries: int, why: str, last: _Retryable) -> str:
        return (f"judge {self.url} gave up after {tries} tries: {why} of the call's {self.budget_s:g}-s budget "
                f"(reward.judge.timeout_s={self.settings.timeout_s} x (retries={self.settings.retries} + 1) + backoff); "
                f"last: {last}" + (f" (Retry-After {last.retry_after_s:g} s)" if last.retry_after_s else ""))

    async def _post(self, session: Any, body: dict[str, Any], deadline: float) -> Any:
        """One try, following redirects within the judge's origin: the reply's JSON. Raises
        _Retryable or JudgeError (an answer that a retry would not change)."""
        import aiohttp

        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            left = deadline - self._clock()
            if left <= 0:
                raise _Retryable("asyncio.TimeoutError (the call's budget ran out)")
            timeout = aiohttp.ClientTimeout(total=min(self.settings.timeout_s, left))
            try:
                async with session.post(url, json=body, timeout=timeout, allow_redirects=False) as response:
                    if response.status in REDIRECT_STATUSES:
                        target = urllib.parse.urljoin(url, response.headers.get("Location", ""))
                        if not same_origin(url, target):
                            raise JudgeError(f"judge {url} {_redirect_refused(response.status, target)}")
                        url = target
                        continue
                    if retryable_status(response.status):
                        raise _Retryable(f"HTTP {response.status}", retry_after_s(response.headers.get("Retry-After")))
                    if response.status >= 400:
                        text = (await response.text())[:200]
                        raise JudgeError(f"judge {url} answered HTTP {response.status}: {text!r}")
                    return await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                raise _Retryable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__) from None
            except ValueError as err:  # body is not JSON
                raise JudgeError(f"judge {url} sent a body that is not JSON ({err})") from None
        raise JudgeError(f"judge {self.url} redirected more than {MAX_REDIRECTS} times within its origin")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def retry_after_s(header: str | None) -> float:
    """A Retry-After header's seconds, at most MAX_RETRY_AFTER_S; 0 for none or an HTTP date."""
    try:
        return min(max(float(header), 0.0), MAX_RETRY_AFTER_S) if header else 0.0
    except ValueError:
        return 0.0
