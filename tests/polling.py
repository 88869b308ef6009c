"""Bounded polling of another process's state, for the fault tests: a commit appearing in the
store, a node's registration, a queue counter — things no event in this process announces
(`from polling import wait_for`; tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import time


def wait_for(cond, timeout: float, what: str, every: float = 0.02):
    """`cond()`'s first truthy value, polled every `every` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
