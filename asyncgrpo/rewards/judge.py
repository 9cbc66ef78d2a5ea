"""An LLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint, called with aiohttp.

Each score is one request: the prompt template filled with the question, the completion and the
reference answer; the reply's text is parsed into a score in [0, 1]. Requests share one session,
at most `concurrency` in flight; each has its own timeout; timeouts, connection errors, 429 and
5xx are retried with exponential backoff (a Retry-After header, if longer, is honoured up to
MAX_RETRY_AFTER_S). A 4xx, a malformed body or an unparseable reply fails at once: retrying a
deterministic judge would get the same answer.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
from typing import Any

from asyncgrpo.schema import JudgeConfig

MAX_RETRY_AFTER_S = 30.0
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

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env, "")
            if not key:
                raise JudgeError(f"reward.judge.api_key_env names {self.cfg.api_key_env!r}, which is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    async def _ensure_session(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.cfg.concurrency), headers=self._headers())
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
