"""Spot capacity: traces (read, synthesise, replay onto a run) and cost accounting.

Pure building blocks, each a plain class testable in one process: `traces` reads the public trace
formats into one `Trace`; `synthetic` draws a seeded one; `replay` maps trace time and node counts
onto a run; `cost` counts GPU-seconds per node class and prices them. The fault injector that acts
on a replay, and the wiring into the run loop, live elsewhere.
"""

from spotlight.spot.cost import CostConfig, CostMeter
from spotlight.spot.replay import Replay, ReplayConfig
from spotlight.spot.synthetic import SyntheticConfig, synthetic_trace
from spotlight.spot.traces import CapacityEvent, Trace, events_from_counts, parse_trace, read_trace

__all__ = ["CapacityEvent", "CostConfig", "CostMeter", "Replay", "ReplayConfig", "SyntheticConfig", "Trace",
           "events_from_counts", "parse_trace", "read_trace", "synthetic_trace"]
