"""Ctrl-C and SIGTERM deferred while something must not be cut half-way (stopping a run's actors
and writing its summary; writing a study's results; logging the steps the learner has taken)."""

from __future__ import annotations

import signal
import socket
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


@contextmanager
def interrupts_held() -> Iterator[None]:
    """A Ctrl-C or SIGTERM that arrives inside the block takes effect as it ends (its handler runs
    then, once per signal), so the block is never cut half-way and the interrupt is not lost. For
    short blocks only: the user waits for it. Main thread only, where signal handlers live."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if signum not in held:
            held.append(signum)

    for signum in previous:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        for signum in held:
            signal.raise_signal(signum)


@contextmanager
def interrupt_signals_noted() -> Iterator[list[int]]:
    """The SIGINT and SIGTERM that arrive inside the block, listed when it ends, whatever their
    handlers did: an exception a handler raises where Python only prints it ("Exception ignored
    in ...": an at-fork hook, a __del__) is lost, and the code goes on as if no signal had come.
    Seen with Ray's SIGTERM handler inside ray.init (raised in logging's at-fork hook): the run went
    on training. The signal module's wakeup fd sees every signal a Python handler is set for.
    Main thread only, where signal handlers live; elsewhere the list stays empty."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    try:
        yield noted
    finally:
        signal.set_wakeup_fd(previous)
        try:
            received = reader.recv(4096)
        except BlockingIOError:
            received = b""
        noted.extend(signum for signum in received if signum in (signal.SIGINT, signal.SIGTERM))
        reader.close()
        writer.close()
