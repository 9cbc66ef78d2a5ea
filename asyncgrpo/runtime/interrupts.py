"""Ctrl-C and SIGTERM deferred while something must not be cut half-way (stopping a run's actors
and writing its summary; writing a study's results; logging the steps the learner has taken)."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def _interrupt_handler(handler: Callable[[int, object], None]) -> Iterator[bool]:
    """`handler` for SIGINT and SIGTERM inside the block, the previous handlers restored after it;
    yields whether it was installed (only in the main thread, where signal handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, handler)
    try:
        yield True
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler_before is None else handler_before)  # None: not set from Python


@contextmanager
def interrupts_deferred(notice: str = "[interrupt] {signal} ignored: already stopping the run") -> Iterator[None]:
    """Another Ctrl-C or SIGTERM (an impatient user, a scheduler repeating its notice) would abort
    the block half-way and leave processes or a torn file behind: it is reported (`notice`, with
    {signal} filled in) and ignored instead. Main thread only, where signal handlers live."""
    def report(signum: int, frame: object) -> None:
        print(notice.format(signal=signal.Signals(signum).name), flush=True)

    with _interrupt_handler(report):
        yield


@contextmanager
def interrupts_held() -> Iterator[None]:
    """A Ctrl-C or SIGTERM that arrives inside the block takes effect as it ends (its handler runs
    then, once per signal), so the block is never cut half-way and the interrupt is not lost (a
    block that raises passes its own error on instead). For short blocks only: the user waits for
    it. Main thread only, where signal handlers live."""
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if signum not in held:
            held.append(signum)

    with _interrupt_handler(hold):
        yield
    for signum in held:  # the previous handlers are back: each runs now
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
