"""A run's spot accounting: the cost meter fed by real node joins and leaves, and the work that
preemptions cost, read from the workers' step log.

- ``StepLog``: reads the lines workers append for every denoising step they compute
  (``request_id attempt step``; ``<log dir>/steps.log``, ``spotlight.actors.worker.core``) and tells, per
  rollout request, how many attempts computed steps, whether a later attempt resumed from a
  commit (its first step > 1) or ran from scratch, and the steps lost: steps computed minus the
  distinct steps of the request (a step computed twice was computed once in vain).
- ``SpotAccount``: one per run. The controller hands it every join, leave and lost node
  (``ControllerCore.on_event``); the fault injector marks the nodes it takes away (``expect``), so
  their leave counts as a preemption, as does a node declared lost. ``snapshot()`` is what every
  iteration's metrics record carries: spot nodes alive, preemptions so far, requests resumed and
  re-run from scratch, steps lost, GPU-seconds and dollars per node class. A caller that knows
  when the cloud granted a node (the simulator, whose nodes boot for minutes before their agent
  registers) says so with ``granted``: the node is billed from then, and one taken away before it
  registered is billed for its boot.

Thread-safe: events arrive on the controller's loop thread, snapshots are taken on the trainer's.
Knows nothing of processes or traces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotlight.spot.cost import CostConfig, CostMeter


@dataclass(slots=True)
class RequestSteps:
    """One rollout request's computed steps, as logged."""

    computed: int = 0
    steps: set[int] = field(default_factory=set)
    first_step: dict[int, int] = field(default_factory=dict)  # attempt -> the first step it computed

    @property
    def lost(self) -> int:
        """Steps computed in vain (computed again by a later attempt)."""
        return self.computed - len(self.steps)

    @property
    def resumed(self) -> bool:
        """A later attempt started past step 1: it resumed from a commit."""
        attempts = sorted(self.first_step)
        return any(self.first_step[a] > 1 for a in attempts[1:])

    @property
    def rerun(self) -> bool:
        """A later attempt started from step 1 again: the request ran from scratch."""
        attempts = sorted(self.first_step)
        return any(self.first_step[a] == 1 for a in attempts[1:])


class StepLog:
    """Incremental reader of a step log file (``refresh`` reads what was appended since)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.requests: dict[str, RequestSteps] = {}
        self._offset = 0
        self._partial = b""

    def refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data, self._partial = self._partial + data, b""
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next refresh
        for line in lines:
            rid, attempt, step = line.decode().rsplit(" ", 2)
            rec = self.requests.setdefault(rid, RequestSteps())
            rec.computed += 1
            rec.steps.add(int(step))
            rec.first_step.setdefault(int(attempt), int(step))

    def totals(self) -> dict[str, int]:
        """Requests with steps logged, resumed from a commit, re-run from scratch, steps computed
        and steps lost, over the whole log."""
        self.refresh()
        r = self.requests.values()
        return {
            "requests_logged": len(self.requests),
            "requests_resumed": sum(x.resumed for x in r),
            "requests_rerun": sum(x.rerun for x in r),
            "steps_computed": sum(x.computed for x in r),
            "steps_lost": sum(x.lost for x in r),
            "requests_preempted": sum(len(x.first_step) > 1 for x in r),
        }


class SpotAccount:
    """A run's cost meter and preemption counts; see the module docstring."""

    def __init__(self, cost: CostConfig, step_log: str | Path | None = None, *,
                 trace_spot_price: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.meter = CostMeter(cost, trace_spot_price=trace_spot_price, clock=clock)
        self.steps = StepLog(step_log) if step_log is not None else None
        self._lock = threading.Lock()
        self._expected: set[str] = set()  # nodes the injector is taking away
        self._granted: dict[str, tuple[float, int]] = {}  # node -> (grant time, GPUs) until it joins
        self.lost_nodes = 0
        self.events: list[dict[str, Any]] = []
        """(elapsed_s, event, node, kind) of every join and leave: the capacity-over-time plot."""

    def granted(self, node_id: str, gpus: int) -> None:
        """The cloud granted spot node ``node_id`` of ``gpus`` GPUs now; it is billed from now,
        though its agent registers (``on_event("join")``) only once it has booted."""
        with self._lock:
            self._granted[node_id] = (self.meter.clock(), gpus)

    def expect(self, node_id: str) -> None:
        """The injector is taking ``node_id`` away: its leave is a preemption (one still booting,
        never registered, is billed from its grant to now and counted as preempted here)."""
        with self._lock:
            boot = self._granted.pop(node_id, None)
            if boot is None:
                self._expected.add(node_id)
                return
            self.meter.join(node_id, node_class="spot", gpus=boot[1], since=boot[0])
            self.meter.leave(node_id, preempted=True)
            self.events.append({"t": round(self.meter.clock() - self.meter.started_s, 3), "event": "leave",
                                "node": node_id, "kind": "spot", "reason": "preempted while booting",
                                "preempted": True})

    def on_event(self, event: str, node_id: str, node: dict[str, Any]) -> None:
        """``ControllerCore.on_event``: a node joined, left, or was declared lost."""
        with self._lock:
            t = self.meter.clock() - self.meter.started_s
            preempted = False
            if event == "join":
                boot = self._granted.pop(node_id, None)
                self.meter.join(node_id, node_class=node["kind"], gpus=int(node["workers"]),
                                since=None if boot is None else boot[0])
            else:
                preempted = event == "lost" or node_id in self._expected
                self._expected.discard(node_id)
                self.lost_nodes += event == "lost"
                self.meter.leave(node_id, preempted=preempted)
            self.events.append({"t": round(t, 3), "event": event, "node": node_id, "kind": node["kind"],
                                "reason": node.get("reason", ""), "preempted": preempted})

    def snapshot(self) -> dict[str, Any]:
        """The fields every iteration's metrics record carries (prefixed ``spot_`` where ambiguous)."""
        with self._lock:
            snap = self.meter.snapshot()
        out: dict[str, Any] = {
            "spot_elapsed_s": round(snap["elapsed_s"], 3),  # the clock of ``events``
            "spot_nodes": snap["spot_nodes"],
            "preemptions": snap["preemptions"],
            "nodes_lost": self.lost_nodes,
            "gpu_s_reserved": round(snap["gpu_s_reserved"], 3),
            "gpu_s_spot": round(snap["gpu_s_spot"], 3),
            "cost_usd": round(snap["cost_usd"], 6),
            "cost_usd_spot": round(snap["cost_usd_spot"], 6),
        }
        if self.steps is not None:
            t = self.steps.totals()
            out.update(requests_resumed=t["requests_resumed"], requests_rerun=t["requests_rerun"],
                       steps_lost=t["steps_lost"])
        return out

    def close(self) -> None:
        """The run ended: every node still present stops accruing (no preemption)."""
        with self._lock:
            self.meter.leave_all()
