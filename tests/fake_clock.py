"""``FakeClock``: a clock the test moves by hand, for the cores that take ``clock=`` (the queue,
the cost meter, the spot parts). `from fake_clock import FakeClock` (tests/ is on sys.path through
its conftest)."""

from __future__ import annotations


class FakeClock:
    """A callable returning ``t``; a test advances it by assigning ``clock.t`` (or ``+=``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
