"""A user reward function named by dotted path: `package.module:function` (or `package.module.function`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


class RewardFnError(ValueError):
    """The reward function cannot be loaded; the message names the config key and the path."""


# How a reward function is called (scorer.py): its signature must take these, or it fails every call.
REWARD_CALL = "fn(prompt, completion, answer=None, **extra)"
_REWARD_ARGS: tuple[tuple[Any, ...], dict[str, Any]] = (("prompt", "completion"), {"answer": None})


def load_reward_fn(path: str, key: str = "reward.fn",
                   call: tuple[str, tuple[tuple[Any, ...], dict[str, Any]]] = (REWARD_CALL, _REWARD_ARGS)
                   ) -> Callable[..., Any]:
    """Import `path`, a callable whose signature takes `call` (a description, and sample positional and
    keyword arguments; by default a reward function's: fn(prompt, completion, answer=None, **extra) -> float).
    Raises RewardFnError, one line naming `key`, for anything else, a module that exits on import included."""
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
    described, (args, kwargs) = call
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none to check
        return fn
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise RewardFnError(f"{key}={path!r}: {attribute}{signature} cannot be called as {described} ({err})") from None
    return fn


def is_async_fn(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
