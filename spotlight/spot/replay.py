"""Replay mapping: a trace's time and node counts onto a run's time and local spot nodes.

Time: run seconds = (trace seconds - ``start_s``) x ``trace_hour_s`` / 3600, so the default
``trace_hour_s = 60`` plays one trace hour in one run minute; durations carried by the cloud (a
spot notice's warning, AWS 120 s, GCP 30 s) scale the same way (`Replay.scale_s`). Nodes: the
trace's capacity count maps to local spot nodes by a stated rule: ``cap`` (min(count, max_nodes))
or ``proportional`` (round(count x factor), halves up). The mapped step function gives named local
events (``spot0, spot1, ...``, lowest free number added, highest present removed): with a count
mapping, node identities of a named trace are not kept, only how many are present.
`Replay.describe` states both rules in one line, for the run to print at start.

A pure mapping: no clock, no processes. The fault injector sleeps until each event's run time and
acts; the run prints `describe()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotlight.errors import ConfigError
from spotlight.spot.traces import CapacityEvent, Trace, events_from_counts

NODE_RULES = ("cap", "proportional")


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    """How a trace is replayed (recipe section [spot])."""

    trace_hour_s: float = 60.0
    """Run seconds one trace hour takes (60: 1 trace hour = 1 run minute; 3600: real time), > 0."""
    start_s: float = 0.0
    """Trace second the replay starts from (skip an empty prefix), >= 0 and before the trace's end."""
    nodes: str = "cap"
    """Count rule: "cap" = min(trace count, max_nodes); "proportional" = round(trace count x factor)."""
    max_nodes: int = 4
    """Local spot nodes at most under "cap", >= 1."""
    factor: float = 1.0
    """Local nodes per trace node under "proportional" (0.25: 12 trace nodes -> 3 local), > 0."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.trace_hour_s) and self.trace_hour_s > 0):
            raise ConfigError("spot.trace_hour_s must be a finite number of run seconds > 0, "
                              f"got {self.trace_hour_s}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ConfigError(f"spot.start_s must be a finite trace second >= 0, got {self.start_s}")
        if self.nodes not in NODE_RULES:
            raise ConfigError(f"spot.nodes must be one of {', '.join(NODE_RULES)}, got {self.nodes!r}")
        if self.max_nodes < 1:
            raise ConfigError(f"spot.max_nodes must be >= 1, got {self.max_nodes}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"spot.factor must be a finite number > 0, got {self.factor}")


class Replay:
    """``trace`` as a run sees it under ``config``: run times and local node counts."""

    def __init__(self, trace: Trace, config: ReplayConfig | None = None) -> None:
        self.trace, self.config = trace, config or ReplayConfig()
        if self.config.start_s >= trace.end_s:
            raise ConfigError(f"spot.start_s ({self.config.start_s:g}) must be before the end of "
                              f"{trace.source} ({trace.end_s:g} s)")

    # --- the two rules --------------------------------------------------------------------------
    def run_s(self, trace_s: float) -> float:
        """Run seconds after the replay's start at which trace second ``trace_s`` happens."""
        return self.scale_s(trace_s - self.config.start_s)

    def scale_s(self, trace_duration_s: float) -> float:
        """A trace-time duration (e.g. the cloud's 120 s spot warning) in run seconds."""
        return trace_duration_s * self.config.trace_hour_s / 3600.0

    def local_nodes(self, count: int) -> int:
        """Local spot nodes for a trace capacity of ``count`` nodes."""
        if self.config.nodes == "cap":
            return min(count, self.config.max_nodes)
        return math.floor(count * self.config.factor + 0.5)

    # --- the mapped trace -----------------------------------------------------------------------
    @property
    def duration_s(self) -> float:
        """Run seconds the replay lasts."""
        return self.run_s(self.trace.end_s)

    def steps(self) -> list[tuple[float, int]]:
        """Local capacity step function [(run_s, local nodes from then on)], from (0, n0)."""
        start = self.config.start_s
        out = [(0.0, self.local_nodes(self.trace.capacity_at(start)))]
        for t, count in self.trace.capacity():
            local = self.local_nodes(count)
            if t > start and local != out[-1][1]:
                out.append((self.run_s(t), local))
        return out

    def events(self, prefix: str = "spot") -> list[CapacityEvent]:
        """Local node events in run seconds (``prefix0``, ``prefix1``, ...): what the injector plays."""
        return events_from_counts(self.steps(), prefix=prefix)

    def describe(self) -> str:
        """One line stating the trace, the time rule and the node rule (print it at run start)."""
        s, c, tr = self.trace.summary(), self.config, self.trace
        local_max = max(n for _, n in self.steps())
        if c.nodes == "cap":
            rule = f"cap: min(trace count, {c.max_nodes})"
        else:
            rule = f"proportional: round(trace count x {c.factor:g})"
        return (f"spot trace {tr.source} ({tr.format}; {tr.end_s / 3600:.3g} trace h, {s['events']} events, "
                f"{s['preemptions']} preemptions, {s['min_nodes']}..{s['max_nodes']} nodes); "
                f"time: 1 trace hour = {c.trace_hour_s:g} run s, from trace {c.start_s:g} s, "
                f"{self.duration_s:.4g} run s in all; nodes: {rule} local spot nodes "
                f"(trace max {s['max_nodes']} -> {local_max} local)")
