"""Calls to Ray actors with a deadline (`get`), and the actor classes' second concurrency group
(`control`): a call there runs on its own thread while the actor's long call goes on."""

from __future__ import annotations

from typing import Any

from asyncgrpo.driver import TrainingFailed


def get(refs: Any, timeout_s: float, what: str) -> Any:
    """`ray.get(refs)` within `timeout_s`; past it the run fails, naming `what` it waited for."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise TrainingFailed(f"no answer from {what} within {timeout_s:.0f} s") from None


# The concurrency group of the calls made while an actor's long call runs (`control`).
CONTROL_GROUP = "control"


def remote_class(cls: type) -> Any:
    """`cls` as a Ray actor class with a `control` concurrency group of one thread."""
    import ray

    return ray.remote(concurrency_groups={CONTROL_GROUP: 1})(cls)


def control(actor: Any, method: str, *args: Any) -> Any:
    """Call `method` on `actor` in its control group: it runs beside the call in progress."""
    return getattr(actor, method).options(concurrency_group=CONTROL_GROUP).remote(*args)
