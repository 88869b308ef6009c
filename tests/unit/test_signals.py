"""SIGTERM stops `spotlight run` / `spotlight reserved` / the HTTP reward server like Ctrl-C
(`spotlight.signals.sigterm_as_interrupt`), even when it lands in a finalizer: what a `__del__`
raises is printed and dropped by Python, and a reserved host once ran on after a SIGTERM that
arrived while the collector ran a library's `__del__` (CI, 2026-12-01)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    from spotlight.signals import sigterm_as_interrupt

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, inside the finalizer
            sum(range(10))

    with sigterm_as_interrupt():
        try:
            Finalized()  # dropped at once: __del__ runs, the interrupt raised in it is swallowed
            threading.Event().wait(30)  # the run going on; only a re-sent signal ends this early
            print("ran on", flush=True)
            sys.exit(3)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    print("handler restored:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """
)


def test_sigterm_that_lands_in_a_finalizer_still_stops_the_run():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["interrupted", "handler restored: True"], done.stdout + done.stderr
