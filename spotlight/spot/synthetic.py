"""A seeded synthetic spot trace: preemptions and arrivals as Poisson processes between bounds.

Each present node is preempted at ``preemption_rate`` per node-hour (so n nodes lose one at n x
that rate) while more than ``min_nodes`` are present; a new node arrives at ``arrival_rate`` per
hour while fewer than ``max_nodes`` are. The next event is drawn from the sum of those rates
(exponential gap), which of the two it is from their shares, and which node a preemption takes
uniformly among those present. Additions take the lowest free ``nodeN`` number. The same config
and seed always give the same `Trace` (a private ``random.Random``; no global state).

Correlated bursts: a ``burst_fraction`` share of the preemptions drawn start a burst, in which up
to ``burst_size - 1`` more nodes present (never below ``min_nodes``) are removed at uniform times
within ``burst_window_s`` after it — public spot studies find most co-interruptions of a fleet
within 3 minutes of each other, hence the 180 s default. Burst removals come on top of the
Poisson rate (the rates are re-drawn after each one: the process stays memoryless between events).

Knows the trace representation only; replay.py maps the result onto a run like any file trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from spotlight.errors import ConfigError
from spotlight.spot.traces import CapacityEvent, Trace


@dataclass(kw_only=True, slots=True)
class SyntheticConfig:
    """A synthetic spot trace (recipe table [spot.synthetic], when [spot] says ``trace = "synthetic"``)."""

    seed: int = 0
    """Seed of the generator: the same seed gives the same trace."""
    preemption_rate: float = 0.5
    """Preemptions per node-hour (0.5: a spot node lives 2 h on average), >= 0."""
    arrival_rate: float = 2.0
    """New nodes per hour while below ``max_nodes``, >= 0."""
    min_nodes: int = 0
    """Capacity never drops below this: no preemption while only this many are present."""
    max_nodes: int = 4
    """Capacity never exceeds this (the size of the spot request), >= 1."""
    initial_nodes: int | None = None
    """Nodes present at time 0, in [min_nodes, max_nodes]; None = ``max_nodes``."""
    duration_s: float = 6 * 3600.0
    """Length of the trace in trace seconds, > 0."""
    burst_fraction: float = 0.0
    """Share of drawn preemptions that start a correlated burst, in [0, 1] (0: independent)."""
    burst_size: int = 4
    """Nodes a burst takes at most, the first one included, >= 2."""
    burst_window_s: float = 180.0
    """A burst's other removals land uniformly within this many trace seconds of its first, > 0."""

    def __post_init__(self) -> None:
        for name in ("preemption_rate", "arrival_rate"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"spot.synthetic.{name} must be a finite rate per hour >= 0, got {v}")
        if self.max_nodes < 1:
            raise ConfigError(f"spot.synthetic.max_nodes must be >= 1, got {self.max_nodes}")
        if not 0 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(f"spot.synthetic.min_nodes must be in [0, max_nodes={self.max_nodes}], "
                              f"got {self.min_nodes}")
        if self.initial_nodes is not None and not self.min_nodes <= self.initial_nodes <= self.max_nodes:
            raise ConfigError(f"spot.synthetic.initial_nodes must be in [min_nodes={self.min_nodes}, "
                              f"max_nodes={self.max_nodes}] or unset, got {self.initial_nodes}")
        if not (math.isfinite(self.burst_fraction) and 0 <= self.burst_fraction <= 1):
            raise ConfigError(f"spot.synthetic.burst_fraction must be in [0, 1], got {self.burst_fraction}")
        if self.burst_size < 2:
            raise ConfigError(f"spot.synthetic.burst_size must be >= 2, got {self.burst_size}")
        if not (math.isfinite(self.burst_window_s) and self.burst_window_s > 0):
            raise ConfigError(f"spot.synthetic.burst_window_s must be a finite number of seconds > 0, "
                              f"got {self.burst_window_s}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ConfigError(f"spot.synthetic.duration_s must be a finite number of seconds > 0, "
                              f"got {self.duration_s}")

    def describe(self) -> str:
        bursts = (f", bursts {self.burst_fraction:g} x <= {self.burst_size} in {self.burst_window_s:g} s"
                  if self.burst_fraction > 0 else "")
        return (f"synthetic(seed={self.seed}, preemption_rate={self.preemption_rate:g}/node-h, "
                f"arrival_rate={self.arrival_rate:g}/h, nodes {self.min_nodes}..{self.max_nodes}{bursts})")


def synthetic_trace(config: SyntheticConfig) -> Trace:
    """Draw one trace from ``config`` (deterministic in ``config.seed``)."""
    rng = random.Random(config.seed)
    initial = config.max_nodes if config.initial_nodes is None else config.initial_nodes
    present = [f"node{i}" for i in range(initial)]
    events = [CapacityEvent(0.0, "add", name) for name in present]
    preempt_per_s, arrive_per_s = config.preemption_rate / 3600.0, config.arrival_rate / 3600.0
    t = 0.0
    burst: list[tuple[float, str]] = []  # (time, node) of a burst's pending removals, time-ordered
    while True:
        n = len(present)
        r_preempt = preempt_per_s * n if n > config.min_nodes else 0.0
        r_arrive = arrive_per_s if n < config.max_nodes else 0.0
        total = r_preempt + r_arrive
        if total <= 0 and not burst:
            break
        t_next = t + rng.expovariate(total) if total > 0 else math.inf
        if burst and burst[0][0] < t_next:  # a burst's removal comes first; rates are re-drawn after it
            t, node = burst.pop(0)
            if t >= config.duration_s:
                break
            if node in present and n > config.min_nodes:
                present.remove(node)
                events.append(CapacityEvent(t, "remove", node))
            continue
        t = t_next
        if t >= config.duration_s:
            break
        if rng.random() * total < r_preempt:
            node = present.pop(rng.randrange(n))
            burst = [b for b in burst if b[1] != node]
            events.append(CapacityEvent(t, "remove", node))
            # (no draw when bursts are off: a seed gives the trace it gave before bursts existed)
            if config.burst_fraction > 0 and rng.random() < config.burst_fraction:
                pending = {b[1] for b in burst}
                others = [x for x in present if x not in pending]
                room = max(0, len(present) - config.min_nodes - len(pending))
                for other in rng.sample(others, min(config.burst_size - 1, len(others), room)):
                    burst.append((t + rng.uniform(0, config.burst_window_s), other))
                burst.sort()
        else:
            taken = set(present)
            name = next(f"node{i}" for i in range(config.max_nodes + 1) if f"node{i}" not in taken)
            present.append(name)
            events.append(CapacityEvent(t, "add", name))
    if not events:
        raise ConfigError(f"spot.synthetic: {config.describe()} drew no node in {config.duration_s:g} s; "
                          "raise arrival_rate, initial_nodes or duration_s")
    return Trace(tuple(events), end_s=config.duration_s, source=config.describe(), format="synthetic")
