"""SIGTERM as Ctrl-C, for processes whose main thread runs synchronous code (`spotlight run`,
`spotlight reserved`, the HTTP reward server): a launcher's or an orchestrator's stop request leaves
through the same `KeyboardInterrupt` path as Ctrl-C, so `finally` blocks tear child processes and
sockets down in order. (Actors on an asyncio loop use `loop.add_signal_handler` instead.)"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside it, SIGTERM leaves like Ctrl-C, so a runtime tears its processes down in order.

    What a finalizer raises (`__del__`, a weakref callback, run whenever the collector runs) is
    printed and dropped ("Exception ignored in ..."), so an interrupt that lands in one would be
    lost and the run would go on. The unraisable hook sees it go by and sends the signal again from
    another thread, which the main thread handles once it is out of the finalizer."""
    def again() -> None:  # from a new thread, without waiting for it: the main thread goes on
        _thread.start_new_thread(os.kill, (os.getpid(), signal.SIGTERM))

    def stop(_signum, frame):
        while frame is not None:  # in the hook below: what it raises is dropped too
            if frame.f_code is unraisable.__code__:
                return again()
            frame = frame.f_back
        raise KeyboardInterrupt

    previous = sys.unraisablehook

    def unraisable(info) -> None:
        if isinstance(info.exc_value, KeyboardInterrupt) and signal.getsignal(signal.SIGTERM) is stop:
            again()
        else:
            previous(info)

    handler = signal.signal(signal.SIGTERM, stop)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)
        sys.unraisablehook = previous
