"""Ctrl-C and SIGTERM deferred while something must not be cut half-way (stopping a run's actors
and writing its summary; writing a study's results)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_deferred(notice: str = "[interrupt] {signal} ignored: already stopping the run") -> Iterator[None]:
    """Another Ctrl-C or SIGTERM (an impatient user, a scheduler repeating its notice) would abort
    the block half-way and leave processes or a torn file behind: it is reported (`notice`, with
    {signal} filled in) and ignored instead. Main thread only, where signal handlers live."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def report(signum: int, frame: object) -> None:
        print(notice.format(signal=signal.Signals(signum).name), flush=True)

    for signum in previous:
        signal.signal(signum, report)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
