"""A user reward function named by dotted path: `package.module:function` (or `package.module.function`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class RewardFnError(ValueError):
    """The reward function cannot be loaded; the message names the config key and the path."""


@dataclass(frozen=True)
class Call:
    """How a loaded function is called, for checking its signature at load: `described` for the
    message, sample `args` and `kwargs`; `more_keywords`: the call passes further keyword arguments
    (a reward function's **extra, a record's other fields), so a parameter left unbound by these but
    passable by keyword may be filled by them."""

    described: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    more_keywords: bool


# How the scorer calls a reward function (rewards/scorer.py).
REWARD_CALL = Call("fn(prompt, completion, answer=None, **extra)", ("prompt", "completion"), {"answer": None}, True)


def load_reward_fn(path: str, key: str = "reward.fn", call: Call = REWARD_CALL) -> Callable[..., Any]:
    """Import `path`, a callable whose signature takes `call` (by default a reward function's:
    fn(prompt, completion, answer=None, **extra) -> float). Raises RewardFnError, one line naming
    `key`, for anything else, a module that exits on import included."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise RewardFnError(f"{key}={path!r} must be package.module:function")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as err:  # an import can fail with anything the module raises, or exit
        raise RewardFnError(f"{key}={path!r}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise RewardFnError(f"{key}={path!r}: {module_name!r} has no attribute {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardFnError(f"{key}={path!r}: {attribute!r} is not callable")
    problem = signature_problem(fn, call)
    if problem:
        signature, why = problem
        raise RewardFnError(f"{key}={path!r}: {attribute}{signature} cannot be called as {call.described} ({why})")
    return fn


def signature_problem(fn: Callable[..., Any], call: Call) -> tuple[str, str] | None:
    """Why `fn` cannot take `call` (its signature, the reason), or None; None too where it has no
    signature to read (some builtins). The signature is fn's own, not that of what a decorator wraps."""
    try:
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    try:
        bound = signature.bind_partial(*call.args, **call.kwargs)
    except TypeError as err:
        return str(signature), str(err)
    fillable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) if call.more_keywords else ()
    missing = [p.name for p in signature.parameters.values()
               if p.name not in bound.arguments and p.default is inspect.Parameter.empty
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD, *fillable)]
    return (str(signature), f"missing a required argument: {missing[0]!r}") if missing else None


def is_async_fn(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
