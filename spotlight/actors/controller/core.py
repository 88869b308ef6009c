"""The controller's logic: ``ControllerCore``, the reserved side's registry of nodes.

Owns which nodes are registered and when each was last heard from. It answers a node's Register
with the queue and tensor-store addresses, the lease length and the recipe, whose ``runtime``
section holds every runtime knob (so a spot node needs only the controller's address). Liveness
comes from the agents' heartbeats (``NodeBeat``): ``sweep`` declares a node silent for
``runtime.node_lost_s`` lost (a SIGKILLed agent says no goodbye); every join and leave is handed to
``on_event`` (the cost meter counts GPU-seconds from them).

Invariants: ``nodes`` holds the nodes present, ``left`` a record of every leave (with its reason);
a stall of the reserved side itself is never counted as a node's silence; registrations carry the
run ``epoch``, so nothing from before a restart is counted.

A plain class under an injectable clock: no sockets, no asyncio. The message API and the process
shell are in ``service.py``; the trainer's executor over the runtime in ``client.py``. It knows
nodes and addresses, not requests, leases or weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from spotlight.comm import messages as m
from spotlight.errors import NotFound, ProtocolError
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


class ControllerCore:
    """The node registry; ``queue``/``store`` are the addresses nodes are told to use. A node
    learns the run's runtime knobs (``[runtime]``: lease, heartbeat, timeouts) from the recipe."""

    def __init__(self, recipe: Recipe, queue: str, store: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.recipe_dict = recipe.to_dict()
        self.queue, self.store, self.lease_s = queue, store, recipe.runtime.lease_s
        self.node_lost_s, self.clock = recipe.runtime.node_lost_s, clock
        self.sweep_s = recipe.runtime.node_sweep_s
        self._swept = clock()  # when the last sweep ran (the first is due sweep_s after start)
        self.epoch = time.time_ns() // 1_000_000
        """This reserved side's run epoch (ms since 1970 at start): request ids and registrations
        carry it, so nothing from before a restart (``--resume``) is ever counted."""
        self.nodes: dict[str, dict[str, Any]] = {}
        self.left: list[dict[str, Any]] = []
        self.on_event: Callable[[str, str, dict[str, Any]], None] | None = None
        """Called as (event "join" | "leave" | "lost", node_id, the node's record with "reason")."""
        self.run_name, self.sp_degree = recipe.run.name, recipe.runtime.sp_degree
        self.progress: dict[str, Any] = {"phase": "starting", "iteration": None, "version": None,
                                         "since": time.time()}
        """What the trainer is doing (``note``): shown by ``spotlight status``."""
        self.cost: Callable[[], dict[str, Any]] = dict
        """GPU-seconds, dollars and preemptions so far (the runtime's ``SpotAccount.snapshot``)."""

    def _event(self, event: str, node_id: str, node: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(event, node_id, node)

    def register(self, msg: m.Register) -> m.Registered:
        if not msg.node_id or msg.workers < 1:
            raise ProtocolError(
                f"Register needs a node_id and workers >= 1, got {msg.node_id!r}, {msg.workers}"
            )
        if msg.node_id in self.nodes:
            log.warning("node %s registered again (restarted?)", msg.node_id)
            self._leave(msg.node_id, "registered again")
        self.nodes[msg.node_id] = {"kind": msg.kind, "workers": msg.workers, "since": time.time(),
                                   "seen": self.clock()}
        self._event("join", msg.node_id, self.nodes[msg.node_id])
        log.info("node %s (%s, %d workers) registered", msg.node_id, msg.kind, msg.workers)
        return m.Registered(
            node_id=msg.node_id,
            queue=self.queue,
            store=self.store,
            lease_s=self.lease_s,
            recipe=self.recipe_dict,
            epoch=self.epoch,
        )

    def deregister(self, msg: m.Deregister) -> m.Ok:
        self._leave(msg.node_id, msg.reason)
        return m.Ok()

    def beat(self, msg: m.NodeBeat) -> m.Ok:
        """A node's heartbeat; NotFound when it was declared lost (it registers again)."""
        node = self.nodes.get(msg.node_id)
        if node is None:
            raise NotFound(f"node {msg.node_id} is not registered (declared lost or never joined)")
        node["seen"] = self.clock()
        return m.Ok()

    def sweep(self) -> list[str]:
        """Declare every node silent for ``runtime.node_lost_s`` lost; returns their ids.

        Silence is counted only while the controller listened. A sweep is due every
        ``sweep_s``; one that runs later than that means the controller itself was stalled (its
        loop blocked, its process starved of CPU or of the GIL by the trainer, swapped out):
        heartbeats sent meanwhile wait unread in its socket, and would be read just after this
        sweep. The stall is not the nodes' silence, so it is credited to every node first (a
        live node must not be declared lost because the reserved side was slow)."""
        now = self.clock()
        stall_from = self._swept + self.sweep_s  # when this sweep was due
        self._swept = now
        if now > stall_from:
            for node in self.nodes.values():  # silence inside the stall does not count
                node["seen"] += now - max(node["seen"], stall_from)
            if now - stall_from > self.sweep_s:
                log.warning("the controller was stalled %.1f s: node silence during it not counted",
                            now - stall_from)
        lost = [n for n, node in self.nodes.items() if now - node["seen"] >= self.node_lost_s]
        for node_id in lost:
            silent = now - self.nodes[node_id]["seen"]
            log.warning("node %s lost: no heartbeat for %.1f s", node_id, silent)
            self._leave(node_id, f"lost: no heartbeat for {silent:.1f} s", event="lost")
        return lost

    def requeued(self, node_id: str, request_ids: list[str]) -> None:
        """The queue re-queued ``request_ids``, the leases node ``node_id`` held when it was lost
        (or registered again): noted on its record in ``left``."""
        for record in reversed(self.left):
            if record["node_id"] == node_id:
                record["requeued"] = request_ids
                break
        if request_ids:
            log.warning("node %s gone: %d leases re-queued (%s)", node_id, len(request_ids),
                        ", ".join(request_ids[:8]))

    def note(self, phase: str, **fields: Any) -> None:
        """The trainer entered ``phase`` (e.g. "rollout" of iteration 3); ``fields`` update
        iteration / version."""
        self.progress.update(fields, phase=phase, since=time.time())

    def status(self, queue: dict[str, Any]) -> m.FleetStatusReply:
        """The fleet now, with the queue's counters ``queue`` (fetched by the shell)."""
        now, wall = self.clock(), time.time()
        nodes = [{"node_id": n, "kind": r["kind"], "workers": r["workers"],
                  "sp_groups": r["workers"] // self.sp_degree, "up_s": round(wall - r["since"], 1),
                  "beat_s": round(now - r["seen"], 1)} for n, r in sorted(self.nodes.items())]
        return m.FleetStatusReply(run=self.run_name, epoch=self.epoch, sp_degree=self.sp_degree,
                                  nodes=nodes, left=len(self.left), queue=queue,
                                  progress=dict(self.progress), cost=self.cost())

    def _leave(self, node_id: str, reason: str, event: str = "leave") -> None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            record = {"node_id": node_id, **node, "reason": reason}
            self.left.append(record)
            self._event(event, node_id, record)

