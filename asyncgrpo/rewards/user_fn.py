"""A user reward function named by dotted path: `package.module:function` (or `package.module.function`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any


class RewardFnError(ValueError):
    """The reward function cannot be loaded; the message names the config key and the path."""


def load_reward_fn(path: str, key: str = "reward.fn") -> Callable[..., Any]:
    """Import `path`; the function is called as fn(prompt, completion, answer=None, **extra) -> float."""
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise RewardFnError(f"{key}={path!r} must be package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an import can fail with anything the module raises
        raise RewardFnError(f"{key}={path!r}: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise RewardFnError(f"{key}={path!r}: {module_name!r} has no attribute {attribute!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardFnError(f"{key}={path!r}: {attribute!r} is not callable")
    return fn


def is_async_fn(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
