"""A seeded synthetic spot trace: preemptions and arrivals as Poisson processes between bounds.

Each present node is preempted at ``preemption_rate`` per node-hour (so n nodes lose one at n x
that rate) while more than ``min_nodes`` are present; a new node arrives at ``arrival_rate`` per
hour while fewer than ``max_nodes`` are. The next event is drawn from the sum of those rates
(exponential gap), which of the two it is from their shares, and which node a preemption takes
uniformly among those present. Additions take the lowest free ``nodeN`` number. The same config
and seed always give the same `Trace` (a private ``random.Random``; no global state).

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
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ConfigError(f"spot.synthetic.duration_s must be a finite number of seconds > 0, "
                              f"got {self.duration_s}")

    def describe(self) -> str:
        return (f"synthetic(seed={self.seed}, preemption_rate={self.preemption_rate:g}/node-h, "
                f"arrival_rate={self.arrival_rate:g}/h, nodes {self.min_nodes}..{self.max_nodes})")


def synthetic_trace(config: SyntheticConfig) -> Trace:
    """Draw one trace from ``config`` (deterministic in ``config.seed``)."""
    rng = random.Random(config.seed)
    initial = config.max_nodes if config.initial_nodes is None else config.initial_nodes
    present = [f"node{i}" for i in range(initial)]
    events = [CapacityEvent(0.0, "add", name) for name in present]
    preempt_per_s, arrive_per_s = config.preemption_rate / 3600.0, config.arrival_rate / 3600.0
    t = 0.0
    while True:
        n = len(present)
        r_preempt = preempt_per_s * n if n > config.min_nodes else 0.0
        r_arrive = arrive_per_s if n < config.max_nodes else 0.0
        total = r_preempt + r_arrive
        if total <= 0:
            break
        t += rng.expovariate(total)
        if t >= config.duration_s:
            break
        if rng.random() * total < r_preempt:
            events.append(CapacityEvent(t, "remove", present.pop(rng.randrange(n))))
        else:
            taken = set(present)
            name = next(f"node{i}" for i in range(config.max_nodes + 1) if f"node{i}" not in taken)
            present.append(name)
            events.append(CapacityEvent(t, "add", name))
    if not events:
        raise ConfigError(f"spot.synthetic: {config.describe()} drew no node in {config.duration_s:g} s; "
                          "raise arrival_rate, initial_nodes or duration_s")
    return Trace(tuple(events), end_s=config.duration_s, source=config.describe(), format="synthetic")
