"""Cost accounting: GPU-seconds per node class from join/leave events, priced per GPU-hour.

`CostMeter` is told when a node joins (its class, reserved or spot, and its GPU count) and when it
leaves (preempted or not); between the two the node accrues GPUs x seconds on the injected clock.
It also counts what the caller reports: requests resumed after a preemption and denoising steps
lost. `snapshot()` is the per-iteration record: spot nodes present, preemptions so far, requests
resumed, steps lost, GPU-seconds per class and cost so far (nodes still present included up to now).

Prices (`CostConfig`, the recipe's [spot] section): reserved $/GPU-hour; spot $/GPU-hour from, in
order, the config, the trace, or ``spot_fraction`` x reserved (0.3: the middle of the 69-77%
discount the paper cites). A node class never changes price during a run.

Knows nothing of traces, processes or heartbeats: the runtime decides that a node joined or left
and calls in; a broken join/leave sequence (leaving twice, never seen, joining twice) is a caller
bug and raises `ProtocolError`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from spotlight.errors import ConfigError, ProtocolError

NODE_CLASSES = ("reserved", "spot")


@dataclass(kw_only=True, slots=True)
class CostConfig:
    """GPU prices (recipe section [spot])."""

    reserved_usd_per_gpu_hour: float = 4.10
    """On-demand $/GPU-hour of reserved nodes, >= 0 (4.10: an A100 of an AWS p4d.24xlarge,
    $32.77/h for 8, us-east-1 on-demand list price)."""
    spot_usd_per_gpu_hour: float | None = None
    """Spot $/GPU-hour, >= 0; None = the trace's price if it carries one, else
    ``spot_fraction`` x reserved."""
    spot_fraction: float = 0.3
    """Spot price as a share of reserved when neither this section nor the trace names one, in
    (0, 1] (0.3: the middle of the 69-77% spot discount the paper cites)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.reserved_usd_per_gpu_hour) and self.reserved_usd_per_gpu_hour >= 0):
            raise ConfigError("spot.reserved_usd_per_gpu_hour must be a finite $/GPU-hour >= 0, "
                              f"got {self.reserved_usd_per_gpu_hour}")
        spot = self.spot_usd_per_gpu_hour
        if spot is not None and not (math.isfinite(spot) and spot >= 0):
            raise ConfigError("spot.spot_usd_per_gpu_hour must be a finite $/GPU-hour >= 0 or unset, "
                              f"got {spot}")
        if not (math.isfinite(self.spot_fraction) and 0 < self.spot_fraction <= 1):
            raise ConfigError(f"spot.spot_fraction must be in (0, 1], got {self.spot_fraction}")

    def spot_price(self, trace_price: float | None = None) -> float:
        """Spot $/GPU-hour: this config's, else the trace's, else ``spot_fraction`` x reserved."""
        if self.spot_usd_per_gpu_hour is not None:
            return self.spot_usd_per_gpu_hour
        if trace_price is not None:
            return trace_price
        return self.spot_fraction * self.reserved_usd_per_gpu_hour


@dataclass(slots=True)
class _Present:
    node_class: str
    gpus: int
    joined_s: float


class CostMeter:
    """GPU-seconds and dollars of a run, per node class; see the module docstring."""

    def __init__(self, config: CostConfig | None = None, *, trace_spot_price: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config or CostConfig(), clock
        if trace_spot_price is not None and not (math.isfinite(trace_spot_price) and trace_spot_price >= 0):
            raise ConfigError("the trace's spot price must be a finite $/GPU-hour >= 0, "
                              f"got {trace_spot_price}")
        self.prices = {"reserved": self.config.reserved_usd_per_gpu_hour,
                       "spot": self.config.spot_price(trace_spot_price)}
        self.started_s = clock()
        self._present: dict[str, _Present] = {}
        self._left: dict[str, float] = {}  # node -> when it last left (for a clear error on a second leave)
        self._gpu_s = dict.fromkeys(NODE_CLASSES, 0.0)  # accrued by nodes that left
        self.preemptions = 0
        self.requests_resumed = 0
        self.steps_lost = 0

    # --- events from the runtime ----------------------------------------------------------------
    def join(self, node: str, *, node_class: str, gpus: int, since: float | None = None) -> None:
        """``node`` (of ``gpus`` GPUs) starts accruing now, or from ``since`` (a clock reading not
        before the meter's start: when the cloud granted it, its boot billed); a node that left
        may join again."""
        if node_class not in NODE_CLASSES:
            raise ValueError(f"node class must be one of {', '.join(NODE_CLASSES)}, got {node_class!r}")
        if not (isinstance(gpus, int) and gpus >= 1):
            raise ValueError(f"node {node!r}: gpus must be a whole number >= 1, got {gpus!r}")
        if node in self._present:
            p = self._present[node]
            raise ProtocolError(f"node {node!r} joins again while present (joined at "
                                f"{p.joined_s - self.started_s:.3f} s as {p.node_class}); "
                                "expected a leave first")
        now = self.clock()
        start = now if since is None else min(max(since, self.started_s), now)
        self._present[node] = _Present(node_class, gpus, start)
        self._left.pop(node, None)

    def leave(self, node: str, *, preempted: bool) -> None:
        """``node`` stops accruing now; ``preempted`` counts it as a preemption (a spot notice or a
        node found dead), not a planned removal or the end of the run."""
        p = self._present.pop(node, None)
        if p is None:
            if node in self._left:
                raise ProtocolError(f"node {node!r} leaves twice: it already left at "
                                    f"{self._left[node] - self.started_s:.3f} s and has not joined since")
            raise ProtocolError(f"node {node!r} leaves but never joined; known nodes: "
                                f"{sorted(self._present) or 'none present'}")
        now = self.clock()
        self._gpu_s[p.node_class] += p.gpus * (now - p.joined_s)
        self._left[node] = now
        self.preemptions += bool(preempted)

    def leave_all(self) -> None:
        """The run ended: every present node stops accruing (no preemption counted)."""
        for node in list(self._present):
            self.leave(node, preempted=False)

    def record_resumed(self, requests: int = 1) -> None:
        """``requests`` that a preemption interrupted were resumed elsewhere from their last commit."""
        self.requests_resumed += self._count(requests, "requests resumed")

    def record_steps_lost(self, steps: int) -> None:
        """``steps`` denoising steps of work were lost to a preemption (0 with per-step commits)."""
        self.steps_lost += self._count(steps, "steps lost")

    # --- what a run records ---------------------------------------------------------------------
    def present(self, node_class: str) -> int:
        """Nodes of ``node_class`` present now."""
        return sum(p.node_class == node_class for p in self._present.values())

    def gpu_seconds(self, node_class: str) -> float:
        """GPU-seconds of ``node_class`` so far, nodes present now accrued up to now."""
        now = self.clock()
        return self._gpu_s[node_class] + sum(p.gpus * (now - p.joined_s) for p in self._present.values()
                                             if p.node_class == node_class)

    def cost_usd(self, node_class: str | None = None) -> float:
        """Dollars so far for ``node_class``, or for both."""
        classes = NODE_CLASSES if node_class is None else (node_class,)
        return sum(self.gpu_seconds(c) / 3600.0 * self.prices[c] for c in classes)

    def snapshot(self) -> dict[str, float | int]:
        """The per-iteration record (flat, JSON-ready; one clock reading for every number)."""
        now = self.clock()
        gpu_s = dict(self._gpu_s)
        for p in self._present.values():
            gpu_s[p.node_class] += p.gpus * (now - p.joined_s)
        cost = {c: gpu_s[c] / 3600.0 * self.prices[c] for c in NODE_CLASSES}
        return {
            "elapsed_s": now - self.started_s,
            "spot_nodes": self.present("spot"),
            "reserved_nodes": self.present("reserved"),
            "preemptions": self.preemptions,
            "requests_resumed": self.requests_resumed,
            "steps_lost": self.steps_lost,
            "gpu_s_reserved": gpu_s["reserved"],
            "gpu_s_spot": gpu_s["spot"],
            "cost_usd_reserved": cost["reserved"],
            "cost_usd_spot": cost["spot"],
            "cost_usd": cost["reserved"] + cost["spot"],
        }

    @staticmethod
    def _count(n: int, what: str) -> int:
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"{what} must be a whole number >= 0, got {n!r}")
        return n
