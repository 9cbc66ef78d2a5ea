"""Environment calls on threads, each with a timeout, each failure classified (`EnvCalls`).

A generator's engine must keep decoding while a tool or a service answers, so every environment
call (reset, step) runs on one of `threads` daemon threads and its result is collected later
(`finished`, `wait`). A call that runs past `timeout_s` from when a thread took it is reported as
failed with cause "timeout" and its thread is left to it (a replacement thread takes its place, up
to STUCK_THREADS_FACTOR x threads in all: past that, a call queued longer than `timeout_s` fails
with cause "timeout" too, so every call ends); what it returns later is dropped. A coroutine result
(an async environment) is run to completion on the thread. `background` runs what nobody waits for
(an environment's close).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.envs.base import EnvStep
from asyncgrpo.rewards.errors import one_line

# Threads abandoned to hung calls are replaced, but never beyond this many times the pool's size.
STUCK_THREADS_FACTOR = 4


@dataclass(frozen=True)
class EnvCallResult:
    """What a call gave: `value` (reset's text or EnvStep, step's EnvStep), or a failure's `cause`
    (timeout | exception | invalid | the exception's own `cause` attribute, as the HTTP adapter
    sets) and one-line `error`."""

    value: Any = None
    cause: str = ""
    error: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.cause)


class EnvCallError(RuntimeError):
    """An environment call failed for a reason of the environment's own; `cause` is what the
    generator counts it under (gen/env_errors_<cause>), the message one line. Environments raise it
    (or a subclass) to name their cause; any other exception counts as "exception"."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(one_line(message))
        self.cause = cause

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Rebuilt from both arguments, so it survives pickling (a process boundary) with its cause.
        return type(self), (self.cause, str(self))


def checked_step(value: Any) -> EnvStep:
    """`value` if it is a well-formed EnvStep; else ValueError (counted as cause "invalid")."""
    step = _checked_env_step(value)
    if step.replaces_prompt:
        raise ValueError("replaces_prompt is for reset's answer only (a step cannot change the prompt)")
    return step


def _checked_env_step(value: Any) -> EnvStep:
    if not isinstance(value, EnvStep):
        raise ValueError(f"step returned {type(value).__name__}, not an EnvStep")
    if not isinstance(value.observation, str):
        raise ValueError(f"observation is {type(value.observation).__name__}, not text")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise ValueError(f"reward {value.reward!r} is not a finite number")
    if not all(isinstance(flag, bool) for flag in (value.done, value.bad_action, value.replaces_prompt)):
        raise ValueError("done, bad_action and replaces_prompt must be booleans")
    tokens = value.observation_tokens
    if tokens is not None and not (isinstance(tokens, tuple) and all(type(t) is int and t >= 0 for t in tokens)):
        raise ValueError("observation_tokens must be a tuple of token ids (ints >= 0)")
    return value


def checked_reset(value: Any) -> str | EnvStep:
    """`value` if it is text or a well-formed EnvStep that does not end the episode (it has had no
    turn) and replaces the prompt only with tokens; else ValueError (counted as cause "invalid")."""
    if isinstance(value, EnvStep):
        step = _checked_env_step(value)
        if step.done:
            raise ValueError("reset cannot end the episode (done): it has had no turn")
        if step.replaces_prompt and not step.observation_tokens:
            raise ValueError("replaces_prompt needs the new prompt as observation_tokens (at least one token)")
        return step
    if not isinstance(value, str):
        raise ValueError(f"reset returned {type(value).__name__}, not text or an EnvStep")
    return value


class EnvCalls:
    """Runs environment calls on threads; each call is named by a hashable key of the caller's."""

    def __init__(self, threads: int, timeout_s: float, latency_s: float) -> None:
        """`threads`, `timeout_s`, `latency_s`: env.threads, env.timeout_s, env.latency_s (an
        injected delay before each step call, for benchmarks)."""
        self.timeout_s, self.latency_s = timeout_s, latency_s
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued: dict[Hashable, float] = {}  # key -> when it was submitted, until a thread takes it
        self._started: dict[Hashable, float] = {}  # key -> when a thread took it (monotonic)
        self._pending = 0
        self._threads = threads
        self._threads_left = threads * STUCK_THREADS_FACTOR
        self._threads_started = 0
        self._hung = 0  # threads held by a call reported as timed out

    def _start_thread(self) -> None:
        if self._threads_left <= 0:
            return
        self._threads_left -= 1
        self._threads_started += 1
        threading.Thread(target=self._work, name="env-call", daemon=True).start()

    def submit(self, key: Hashable, call: Callable[..., Any], check: Callable[[Any], Any], *args: Any,
               step: bool = False) -> None:
        """Run `call(*args)` (its coroutine awaited) and `check` its value on a thread; `step`: an
        environment's step, which the injected latency delays (a reset is not)."""
        self._pending += 1
        with self._lock:
            self._queued[key] = time.monotonic()
            # Threads start as calls need them, up to `threads` not held by a hung call.
            live = self._threads_started - self._hung
            more = len(self._queued) + len(self._started) > live and live < self._threads
        if more:
            self._start_thread()
        self._todo.put((key, call, check, args, step))

    def background(self, call: Callable[[], Any]) -> None:
        """Run `call()` on a thread, its result and failure ignored (an environment's close: it must
        not hold up the generator's loop, nor count)."""
        if self._threads_started == 0:
            self._start_thread()
        self._todo.put((_BACKGROUND, call, None, (), False))

    def _work(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            key, call, check, args, step = item
            if key is _BACKGROUND:
                with contextlib.suppress(Exception):
                    call()
                continue
            with self._lock:
                if self._queued.pop(key, None) is None:
                    continue  # timed out in the queue
                self._started[key] = time.monotonic()
            result = self._run(call, check, args, self.latency_s if step else 0.0)
            with self._lock:
                if self._started.pop(key, None) is None:
                    continue  # reported as timed out already
            self._done.put((key, result))

    def _run(self, call: Callable[..., Any], check: Callable[[Any], Any], args: tuple,
             delay_s: float) -> EnvCallResult:
        try:
            if delay_s > 0:
                time.sleep(delay_s)
            value = call(*args)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
        except Exception as err:  # noqa: BLE001 - an environment's failure is counted, never raised here
            cause = getattr(err, "cause", "") or "exception"
            return EnvCallResult(cause=str(cause), error=one_line(f"{type(err).__name__}: {err}"))
        try:
            return EnvCallResult(value=check(value))
        except ValueError as err:
            return EnvCallResult(cause="invalid", error=one_line(str(err)))

    def _expire(self) -> list[tuple[Hashable, EnvCallResult]]:
        now, expired = time.monotonic(), []
        with self._lock:
            for key, started in list(self._started.items()):
                if now - started > self.timeout_s:
                    del self._started[key]
                    error = f"no answer within env.timeout_s={self.timeout_s:g} s"
                    expired.append((key, EnvCallResult(cause="timeout", error=error)))
            hung_calls = len(expired)
            if self._threads_left <= 0:  # no thread will be replaced: a queued call may never start
                for key, queued in list(self._queued.items()):
                    if now - queued > self.timeout_s:
                        del self._queued[key]
                        error = (f"not started within env.timeout_s={self.timeout_s:g} s: every thread is held "
                                 "by a call that never returned")
                        expired.append((key, EnvCallResult(cause="timeout", error=error)))
        self._hung += hung_calls
        for _ in range(hung_calls):
            self._start_thread()  # the hung call keeps its thread
        return expired

    def finished(self, wait_s: float = 0.0) -> list[tuple[Hashable, EnvCallResult]]:
        """The calls that ended (answered, failed or timed out) since the last call; waits up to
        `wait_s` for the first one when none has."""
        results = self._expire()
        if not results and wait_s > 0 and self._pending:
            try:
                results.append(self._done.get(timeout=min(wait_s, self.timeout_s)))
            except queue.Empty:
                results = self._expire()
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._pending -= len(results)
        return results

    @property
    def pending(self) -> int:
        """Calls submitted whose result has not been collected."""
        return self._pending

    def close(self) -> None:
        """Stop the idle threads (a hung call's thread is a daemon and ends with the process)."""
        for _ in range(self._threads_started):
            self._todo.put(None)


# The key of a call whose result nobody collects (`EnvCalls.background`).
_BACKGROUND = object()


async def _awaited(value: Any) -> Any:
    return await value
