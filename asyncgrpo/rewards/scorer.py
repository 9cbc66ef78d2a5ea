"""The Scorer: turns completions into rewards, a weighted sum of reward terms, without stalling generation.

    scorer = Scorer(task, cfg.reward)
    future = scorer.submit(problems, texts)   # texts[i] = the completion texts of problems[i]; returns at once
    ...                                       # generate the next batch meanwhile
    for score in future.result():             # one GroupScore per problem, in order
        if score.dropped: ...                 # reward.on_error=drop_group and a term failed: do not send
        rewards, meta = score.rewards, score.meta()

    scorer.score(problems, texts)             # the same, blocking
    scorer.close()                            # stops the event-loop thread and closes HTTP sessions

Threads. Terms that are cheap and built in (task, exact, numeric, format) run inline in submit(),
which then returns an already-completed Future: the default arithmetic run pays no thread hop.
Otherwise the batch runs on the Scorer's own event-loop thread: async user functions and the HTTP
judge as coroutines (at most reward.concurrency / reward.judge.concurrency in flight), sync user
functions and math equivalence on a pool of reward.threads threads, each call bounded by
reward.timeout_s from when a thread takes it (the judge by its own timeout and retries). Async
rewards therefore overlap the caller's next vLLM call; CPU-bound sync rewards overlap it as far as
the GIL allows. A sync call past its timeout cannot be stopped and keeps its thread until it
returns; when every thread of the pool is held so, later calls and those still queued go to a new
pool (a function that hangs on some inputs costs threads, not the run).

Errors. A term that raises, times out, or returns anything but a real number within float32's
range (NaN, inf, 1e39, the string "0.7", None, a complex number) is an error: it counts in
GroupScore.errors (logged as reward/errors) and then reward.on_error applies: `zero` scores that
term 0 for that completion, `drop_group` marks the whole group dropped. Rewards travel as float32,
and the learner rejects a group with a reward beyond it: caught here, such a value is a counted
error of its term, not a group silently lost at the learner. So is a weighted sum beyond float32
(an error of each term in it). bool is an int in Python: True and False score 1 and 0; numpy's
scalars and Fractions are numbers too, a numeric string is not. Nothing raises out of the Scorer
for a failing reward; only a broken config (an unimportable reward.fn) raises, at construction.
The first error of each term is logged (a warning, once per term) and kept (`first_errors()`, on
one line): the generator reports it, and the learner names it when the error rate ends the run
(asyncgrpo/rewards/errors.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.rewards import verifiers
from asyncgrpo.rewards.errors import one_line
from asyncgrpo.rewards.user_fn import is_async_fn, load_reward_fn
from asyncgrpo.schema import RewardConfig, RewardTermConfig
from asyncgrpo.tasks.problem import Problem, Task

log = logging.getLogger(__name__)

# reward.terms[].kind (an empty kind is the term's name): each is built by `_build_term`.
REWARD_KINDS = ("task", "exact", "numeric", "math", "format", "fn", "judge")
# reward.on_error: zero = a failed term scores 0 for that completion; drop_group = the group is not sent.
ON_ERROR_POLICIES = ("zero", "drop_group")

# Keys of Problem.extra that the reward function receives as named arguments would collide with.
_RESERVED_ARGS = ("prompt", "completion", "answer")
_INTERNAL_EXTRA = ("raw_prompt", "raw_answer")
# A reward travels as float32 (GroupScore.rewards, the wire): the learner rejects one beyond it.
FLOAT32_MAX = float(np.finfo(np.float32).max)


class RewardValueError(ValueError):
    """A reward returned something that is not a real number within float32's range."""


@dataclass
class GroupScore:
    """The rewards of one group's completions.

    rewards: float32 [n], the weighted sum of the terms (a failed term counts 0).
    terms: name -> float32 [n], each term's own value, NaN where it failed.
    errors: failed term calls in this group. dropped: reward.on_error=drop_group and errors > 0.
    """

    rewards: np.ndarray
    terms: dict[str, np.ndarray]
    errors: int = 0
    dropped: bool = False
    error_messages: list[str] = field(default_factory=list)
    report_terms: bool = True

    def meta(self) -> dict[str, float | int]:
        """Flat ScoredGroup.meta entries: reward/<term> (mean over the group's completions), reward/errors."""
        if not self.report_terms:
            return {}
        out: dict[str, float | int] = {}
        for name, values in self.terms.items():
            finite = values[np.isfinite(values)]
            if finite.size:
                out[f"reward/{name}"] = float(finite.mean())
        out["reward/errors"] = int(self.errors)
        return out


@dataclass
class RewardTerm:
    """One weighted reward: exactly one of `sync_fn` / `async_fn` is set, both called as (problem, completion)."""

    name: str
    weight: float
    sync_fn: Callable[[Problem, str], float] | None = None
    async_fn: Callable[[Problem, str], Any] | None = None
    # Cheap terms run inline on the caller's thread; the others on the scorer's threads or loop.
    cheap: bool = False
    timeout_s: float | None = None
    judge: Any = None  # a JudgeClient to close with the scorer


def _finite(value: Any) -> float:
    """A term's value as a float, or RewardValueError. Only real numbers: float() would also take
    the string "0.7" (a reward function that forgot to parse) and 0-d arrays."""
    if isinstance(value, (bool, np.bool_)):  # np.bool_ is no numbers.Real
        return float(value)
    if not isinstance(value, numbers.Real):
        raise RewardValueError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction beyond float64
        raise RewardValueError(f"returned {type(value).__name__} {value!r:.60}, beyond float32") from None
    if not math.isfinite(number):
        raise RewardValueError(f"returned {number}")
    if abs(number) > FLOAT32_MAX:
        raise RewardValueError(f"returned {number!r}, beyond float32 (|reward| <= {FLOAT32_MAX:.4g})")
    return number


def _user_arguments(problem: Problem) -> tuple[str, str | None, dict[str, Any]]:
    prompt = problem.extra.get("raw_prompt", problem.prompt)
    answer = problem.answer if problem.answer != "" else None
    extra = {k: v for k, v in problem.extra.items() if k not in _RESERVED_ARGS and k not in _INTERNAL_EXTRA}
    return prompt, answer, extra


def term_configs(cfg: RewardConfig) -> list[RewardTermConfig]:
    """The configured terms; with none configured, the task's own check (or reward.fn alone)."""
    if cfg.terms:
        return list(cfg.terms)
    return [RewardTermConfig(name="fn", kind="fn")] if cfg.fn else [RewardTermConfig(name="task", kind="task")]


def fn_paths(cfg: RewardConfig) -> list[tuple[str, str]]:
    """(config key, package.module:function) of every user function the terms call."""
    paths = []
    for index, term in enumerate(term_configs(cfg)):
        if term.resolved_kind == "fn":
            paths.append((f"reward.terms[{index}].fn", term.fn) if term.fn else ("reward.fn", cfg.fn))
    return paths


def build_terms(task: Task, cfg: RewardConfig) -> list[RewardTerm]:
    return [_build_term(task, cfg, term, index) for index, term in enumerate(term_configs(cfg))]


def _build_term(task: Task, cfg: RewardConfig, term: RewardTermConfig, index: int) -> RewardTerm:
    kind = term.resolved_kind
    name, weight = term.name, float(term.weight)
    if kind == "task":
        return RewardTerm(name, weight, sync_fn=lambda p, c: task.score(c, p), cheap=not getattr(task, "score_is_slow", False),
                          timeout_s=cfg.timeout_s)
    if kind == "exact":
        return RewardTerm(name, weight, sync_fn=lambda p, c: verifiers.exact_match(c, p.answer), cheap=True)
    if kind == "numeric":
        tolerance = term.tolerance
        return RewardTerm(name, weight, sync_fn=lambda p, c: verifiers.numeric_match(c, p.answer, tolerance=tolerance),
                          cheap=True)
    if kind == "math":
        tolerance = term.tolerance
        # sympy can take a while on odd input: off the caller's thread, under a timeout.
        return RewardTerm(name, weight, sync_fn=lambda p, c: verifiers.math_reward(c, p.answer, tolerance=tolerance),
                          timeout_s=cfg.timeout_s)
    if kind == "format":
        pattern = term.pattern or getattr(task, "answer_format", r"\S")
        return RewardTerm(name, weight, sync_fn=lambda p, c: verifiers.format_reward(c, pattern), cheap=True)
    if kind == "fn":
        path = term.fn or cfg.fn
        fn = load_reward_fn(path, key=f"reward.terms[{index}].fn" if term.fn else "reward.fn")

        def call(problem: Problem, completion: str) -> Any:
            prompt, answer, extra = _user_arguments(problem)
            return fn(prompt, completion, answer=answer, **extra)

        if is_async_fn(fn):
            return RewardTerm(name, weight, async_fn=call, timeout_s=cfg.timeout_s)
        return RewardTerm(name, weight, sync_fn=call, timeout_s=cfg.timeout_s)
    if kind == "judge":
        from asyncgrpo.rewards.judge import JudgeClient

        judge = JudgeClient(cfg.judge)

        async def ask(problem: Problem, completion: str) -> float:
            prompt, answer, _ = _user_arguments(problem)
            return await judge.score(prompt, completion, answer)

        return RewardTerm(name, weight, async_fn=ask, timeout_s=None, judge=judge)  # the judge times itself
    raise ValueError(f"reward.terms[{index}].kind: unknown reward kind {kind!r} (one of {', '.join(REWARD_KINDS)})")


class Scorer:
    """Rewards for groups of completions; see the module docstring for the threading and error contract."""

    def __init__(self, task: Task, cfg: RewardConfig) -> None:
        if cfg.on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"reward.on_error must be one of {', '.join(ON_ERROR_POLICIES)}, got {cfg.on_error!r}")
        self.cfg = cfg
        self.task = task
        self.terms = build_terms(task, cfg)
        self.all_cheap = all(term.cheap for term in self.terms)
        self._weights = np.asarray([term.weight for term in self.terms], dtype=np.float64)[:, None]
        # The default (the task's own check alone) logs nothing beyond reward/mean, as before.
        self.report_terms = not (len(self.terms) == 1 and self.terms[0].name == "task" and self.terms[0].weight == 1.0
                                 and not cfg.terms)
        self.drop_on_error = cfg.on_error == "drop_group"
        self.stats = {"reward/errors": 0, "reward/groups_dropped": 0, "reward/calls": 0}
        self._first_errors: dict[str, str] = {}
        self._stats_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        # Sync calls of the current pool still running past their timeout (`_abandon`), and how many
        # pools were given up on because every thread was held so.
        self._held: set[concurrent.futures.Future] = set()
        self.pools_replaced = 0
        self._call_limit: asyncio.Semaphore | None = None
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------------------------ API

    def submit(self, problems: Sequence[Problem], completions: Sequence[Sequence[str]]
               ) -> concurrent.futures.Future[list[GroupScore]]:
        """Start scoring; the Future resolves to one GroupScore per problem, in order. Never blocks on rewards."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completion lists")
        if self.all_cheap:
            future: concurrent.futures.Future[list[GroupScore]] = concurrent.futures.Future()
            try:
                future.set_result([self._score_inline(p, texts) for p, texts in zip(problems, completions)])
            except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(err)
            return future
        loop = self._ensure_loop()
        return asyncio.run_coroutine_threadsafe(self._score_batch(list(problems), [list(c) for c in completions]), loop)

    def score(self, problems: Sequence[Problem], completions: Sequence[Sequence[str]],
              timeout_s: float | None = None) -> list[GroupScore]:
        """submit() and wait; `timeout_s` None waits as long as the terms' own timeouts allow."""
        return self.submit(problems, completions).result(timeout=timeout_s)

    def calls_bound_s(self, calls: int) -> float:
        """The most `calls` completions' rewards may take, each term being called once per completion.
        Each kind of call waits on its own limit: sync terms on reward.threads threads, each call
        within reward.timeout_s from when a thread takes it; async user fns reward.concurrency at a
        time within reward.timeout_s; each judge term reward.judge.concurrency at a time within a
        judge call's budget (judge.call_budget_s). Summed, so generous: it only catches a hang.
        Cheap terms run inline and add nothing."""
        from asyncgrpo.rewards.judge import call_budget_s

        def waves(in_flight: int) -> int:
            return -(-calls // max(1, in_flight))

        bound = 0.0
        for term in self.terms:
            if term.cheap:
                continue
            if term.judge is not None:
                bound += waves(self.cfg.judge.concurrency) * call_budget_s(self.cfg.judge)
            elif term.async_fn is not None:
                bound += waves(self.cfg.concurrency) * float(self.cfg.timeout_s)
            else:
                bound += waves(self.cfg.threads) * float(self.cfg.timeout_s)
        return bound

    def stats_snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def first_errors(self) -> dict[str, str]:
        """term name -> its first error, on one line (terms that never failed are absent)."""
        with self._stats_lock:
            return dict(self._first_errors)

    def close(self, timeout_s: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        judges = [term.judge for term in self.terms if term.judge is not None]

        async def shutdown() -> None:
            for judge in judges:
                await judge.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=timeout_s)
        except Exception:  # closing is best effort; the process may be on its way out
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout_s)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        self._loop = self._thread = self._threads = None

    def __del__(self) -> None:  # best effort: a daemon thread would die with the process anyway
        try:
            self.close(timeout_s=1.0)
        except Exception:
            pass

    # ---------------------------------------------------------------------------- internals

    def _record(self, errors: int, dropped: bool, calls: int) -> None:
        with self._stats_lock:
            self.stats["reward/errors"] += errors
            self.stats["reward/groups_dropped"] += int(dropped)
            self.stats["reward/calls"] += calls

    def _error(self, term: RewardTerm, text: str) -> str:
        """Keep and log a term's first error (a failing judge fails thousands of calls alike);
        returns the message for GroupScore.error_messages."""
        with self._stats_lock:
            first = term.name not in self._first_errors
            if first:
                self._first_errors[term.name] = short = one_line(text)
        if first:
            log.warning("reward term %r failed for the first time: %s (reward.on_error=%s; further errors are "
                        "counted under reward/errors)", term.name, short, self.cfg.on_error)
        return f"{term.name}: {text}"

    def _finish(self, values: np.ndarray, messages: list[str]) -> GroupScore:
        """values: [terms, n] with NaN for failures -> the group's GroupScore."""
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found below, not warned about
            weighted = np.where(np.isfinite(values), values, 0.0) * self._weights
            sums = weighted.sum(axis=0)
        # Each term fits float32 (`_finite`), their weighted sum may not: an error of every term in
        # it, so that the completion scores what its other terms (weight 0 or failed) do, 0.
        for j in np.flatnonzero(~(np.abs(sums) <= FLOAT32_MAX)):
            for i in np.flatnonzero(weighted[:, j] != 0.0):
                values[i, j] = np.nan
                messages.append(self._error(self.terms[i], f"RewardValueError: the weighted sum of the terms, "
                                                           f"{sums[j]:.4g}, is beyond float32"))
        failed = ~np.isfinite(values)
        errors = int(failed.sum())
        rewards = (np.where(failed, 0.0, values) * self._weights).sum(axis=0).astype(np.float32)
        dropped = self.drop_on_error and errors > 0
        self._record(errors, dropped, values.size)
        return GroupScore(rewards=rewards, terms={t.name: values[i].astype(np.float32) for i, t in enumerate(self.terms)},
                          errors=errors, dropped=dropped, error_messages=messages[:3], report_terms=self.report_terms)

    def _score_inline(self, problem: Problem, texts: Sequence[str]) -> GroupScore:
        values = np.empty((len(self.terms), len(texts)), dtype=np.float64)
        messages: list[str] = []
        for i, term in enumerate(self.terms):
            assert term.sync_fn is not None
            for j, text in enumerate(texts):
                try:
                    values[i, j] = _finite(term.sync_fn(problem, text))
                except Exception as err:  # a failing reward never kills the run
                    values[i, j] = np.nan
                    messages.append(self._error(term, f"{type(err).__name__}: {err}"))
        return self._finish(values, messages)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._threads = concurrent.futures.ThreadPoolExecutor(self.cfg.threads, thread_name_prefix="reward")
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    self._call_limit = asyncio.Semaphore(self.cfg.concurrency)
                    started.set()
                    loop.run_forever()

                self._thread = threading.Thread(target=serve, name="reward-loop", daemon=True)
                self._thread.start()
                if not started.wait(timeout=30.0):
                    raise RuntimeError("the reward event-loop thread did not start within 30 s")
                self._loop = loop
            return self._loop

    def _abandon(self, call: concurrent.futures.Future) -> None:
        """Note a sync call still running past its timeout. A function that never returns on some
        inputs would otherwise take the pool's threads one by one, after which every call only
        queues and times out (and the run stops on the error rate): once every thread of the pool
        is held so, later calls go to a fresh pool, and the held threads are left to finish, or not.
        Called on the event-loop thread; the set's add and discard are atomic, so the worker thread
        that finishes a held call may discard it without a lock."""
        held = self._held
        held.add(call)
        call.add_done_callback(held.discard)  # a call that returns after all frees its thread
        if len(held) < self.cfg.threads:
            return
        stuck, self._threads = self._threads, concurrent.futures.ThreadPoolExecutor(
            self.cfg.threads, thread_name_prefix="reward")
        self._held = set()
        self.pools_replaced += 1
        if stuck is not None:  # its queued calls are cancelled, and `_call_on_thread` submits them again
            stuck.shutdown(wait=False, cancel_futures=True)
        log.warning("reward.threads=%d threads are all held by reward calls running past reward.timeout_s=%s s; "
                    "later calls go to a new pool (%d so far), the held threads stay until their calls return",
                    self.cfg.threads, self.cfg.timeout_s, self.pools_replaced)

    async def _call_on_thread(self, term: RewardTerm, problem: Problem, text: str) -> Any:
        """term.sync_fn(problem, text) on the pool. reward.timeout_s counts from when a thread takes
        the call, not from its submission: a call queued behind slow ones is not failed for their
        time. A call still queued when its pool is given up on (`_abandon` cancels what it holds)
        moves to the new pool. A call past its timeout is abandoned, not stopped (threads cannot be
        killed): it counts as an error and its thread returns to the pool when the call ends."""
        assert term.sync_fn is not None
        loop = asyncio.get_running_loop()
        while True:
            assert self._threads is not None, "the scorer is closed"
            started: asyncio.Future[None] = loop.create_future()

            def run(started: asyncio.Future[None] = started) -> Any:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                    loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
                return term.sync_fn(problem, text)

            call = self._threads.submit(run)
            result = asyncio.wrap_future(call)
            try:
                await asyncio.wait({started, result}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                call.cancel()
                raise
            if not call.cancelled():
                break
            started.cancel()  # its pool was replaced before a thread took it: submit it again
        try:
            return await asyncio.wait_for(asyncio.shield(result), term.timeout_s)
        except asyncio.TimeoutError:
            if not call.cancel():  # it had started: its thread stays busy until it returns
                self._abandon(call)
            raise

    async def _score_batch(self, problems: list[Problem], completions: list[list[str]]) -> list[GroupScore]:
        return list(await asyncio.gather(*(self._score_group(p, texts) for p, texts in zip(problems, completions))))

    async def _score_group(self, problem: Problem, texts: list[str]) -> GroupScore:
        calls = [(i, j) for i in range(len(self.terms)) for j in range(len(texts))]
        results = await asyncio.gather(*(self._call(self.terms[i], problem, texts[j]) for i, j in calls))
        values = np.empty((len(self.terms), len(texts)), dtype=np.float64)
        messages = []
        for (i, j), (value, message) in zip(calls, results):
            values[i, j] = value
            if message:
                messages.append(message)
        return self._finish(values, messages)

    async def _call(self, term: RewardTerm, problem: Problem, text: str) -> tuple[float, str]:
        try:
            if term.cheap:
                assert term.sync_fn is not None
                return _finite(term.sync_fn(problem, text)), ""
            if term.async_fn is not None:
                assert self._call_limit is not None
                # The judge limits its own requests (reward.judge.concurrency); user fns share reward.concurrency.
                async with self._call_limit if term.judge is None else contextlib.nullcontext():
                    return _finite(await asyncio.wait_for(term.async_fn(problem, text), term.timeout_s)), ""
            return _finite(await self._call_on_thread(term, problem, text)), ""
        except asyncio.TimeoutError:
            return math.nan, self._error(term, f"timed out after {term.timeout_s} s (reward.timeout_s)")
        except Exception as err:  # a failing reward never kills the run
            return math.nan, self._error(term, f"{type(err).__name__}: {err}")
