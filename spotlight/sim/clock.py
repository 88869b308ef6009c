"""The simulation's virtual clock and its discrete-event loop.

``VirtualClock`` is a callable returning the virtual time (seconds), so it is what the production
cores take as their ``clock`` (``RequestQueueCore``, ``GroupScheduler``, ``ControllerCore``,
``SpotAccount``, ``FaultInjector``). ``call_at`` / ``call_later`` schedule a callback; ``run``
pops them in time order (ties in scheduling order) and moves the clock to each one's time before
calling it. Time never goes back; a callback scheduled in the past runs at the current time.

Knows time and callbacks only: no processes, threads, sockets or asyncio.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Timer:
    """A scheduled callback; ``cancel`` makes the loop skip it."""

    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """Virtual seconds from ``start``; see the module docstring."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def __call__(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(max(float(when), self.now), callback)
        heapq.heappush(self._heap, (timer.when, next(self._seq), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.call_at(self.now + max(0.0, delay), callback)

    def run(self, until: Callable[[], bool] | None = None, end: float | None = None) -> None:
        """Run callbacks in time order until ``until()`` holds (checked after each one), no
        callback is left, or the next one is past ``end`` (the clock then stops at ``end``)."""
        while self._heap and not (until is not None and until()):
            when, _, timer = self._heap[0]
            if end is not None and when > end:
                self.now = max(self.now, end)
                return
            heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self.now = when
            self.events_run += 1
            timer.callback()
        if end is not None and not (until is not None and until()):
            self.now = max(self.now, end)
