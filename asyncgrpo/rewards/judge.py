"""An LLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint, called with aiohttp.

Each score is one request: the prompt template filled with the question, the completion and the
reference answer; the reply's text is parsed into a score in [0, 1]. Requests share one session,
at most `concurrency` in flight; each has its own timeout; timeouts, connection errors, 429 and
5xx are retried with exponential backoff (a Retry-After header, if longer, is honoured up to
MAX_RETRY_AFTER_S). A 4xx, a malformed body or an unparseable reply fails at once: retrying a
deterministic judge would get the same answer.

`probe_judge` is the driver's check before any actor starts: one short GET <base_url>/models.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from typing import Any

from asyncgrpo.schema import JudgeConfig

MAX_RETRY_AFTER_S = 30.0
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


def request_headers(cfg: JudgeConfig) -> dict[str, str]:
    """The judge's request headers, with the API key from reward.judge.api_key_env; raises JudgeError if it is unset."""
    headers = {"Content-Type": "application/json"}
    if cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            raise JudgeError(f"reward.judge.api_key_env names {cfg.api_key_env!r}, which is not set")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def probe_judge(cfg: JudgeConfig) -> dict[str, Any]:
    """One GET <base_url>/models: any HTTP answer shows the judge is up (a server without that
    route answers 404, which is still an answer), except 401/403, a key it refuses. Raises
    JudgeError, on one line, when the judge cannot be reached or refuses the key."""
    import urllib.error
    import urllib.request

    url = cfg.base_url.rstrip("/") + "/models"
    request = urllib.request.Request(url, headers=request_headers(cfg), method="GET")
    # No proxy from the environment, as for the scoring requests (aiohttp ignores those variables).
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
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


class JudgeClient:
    """Scores completions with the judge; use from one event loop (the Scorer's)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self._session: Any = None
        self._semaphore: asyncio.Semaphore | None = None
        self.requests = 0
        self.retries = 0
        self.failures = 0

    async def _ensure_session(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.cfg.concurrency), headers=request_headers(self.cfg))
            self._semaphore = asyncio.Semaphore(self.cfg.concurrency)
        return self._session

    async def score(self, prompt: str, completion: str, answer: str | None) -> float:
        import aiohttp

        session = await self._ensure_session()
        assert self._semaphore is not None
        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": fill_template(
                self.cfg.prompt_template, prompt=prompt, completion=completion, answer=answer)}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        last_failure = ""
        delay = self.cfg.backoff_s
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                self.retries += 1
                # Jitter keeps many failed requests from retrying in lock step.
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay *= 2
            async with self._semaphore:
                self.requests += 1
                try:
                    async with session.post(self.url, json=body, timeout=timeout) as response:
                        if response.status == 429 or response.status >= 500:
                            last_failure = f"HTTP {response.status}"
                            delay = max(delay, _retry_after_s(response.headers.get("Retry-After")))
                            continue
                        if response.status >= 400:
                            text = (await response.text())[:200]
                            self.failures += 1
                            raise JudgeError(f"judge {self.url} answered HTTP {response.status}: {text!r}")
                        data = await response.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    last_failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                    continue
                except ValueError as err:  # body is not JSON
                    self.failures += 1
                    raise JudgeError(f"judge {self.url} sent a body that is not JSON ({err})") from None
            try:
                reply = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                self.failures += 1
                raise JudgeError(f"judge {self.url} reply has no choices[0].message.content") from None
            try:
                return parse_score(str(reply or ""), parser=self.cfg.parser, max_score=self.cfg.max_score)
            except JudgeParseError:
                self.failures += 1
                raise
        self.failures += 1
        raise JudgeError(f"judge {self.url} failed {self.cfg.retries + 1} tries (reward.judge.retries="
                         f"{self.cfg.retries}, timeout_s={self.cfg.timeout_s}); last: {last_failure}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _retry_after_s(header: str | None) -> float:
    try:
        return min(max(float(header), 0.0), MAX_RETRY_AFTER_S) if header else 0.0
    except ValueError:
        return 0.0
