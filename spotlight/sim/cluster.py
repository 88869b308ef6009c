"""The simulated cluster: the production control-plane cores on a virtual clock, with nodes whose
workers take their time from the timing model instead of computing.

``SimCluster`` owns, all on one ``VirtualClock``:

- ``RequestQueueCore`` (leases, heartbeats, fencing, expiry through its ``on_deadline`` hook,
  ``release_node``, dead letters), ``TensorStoreCore`` (commits, seals, weights versions: the
  bookkeeping, with empty tensor bundles), ``ControllerCore`` (registry, beats, ``sweep``),
  ``SpotAccount`` (GPU-seconds, dollars, preemptions), and a ``FaultInjector`` acting on the
  cluster (its ``Nodes`` target) with the replayed trace;
- ``SimNode``s (``spotlight.sim.node``), each a node agent's shell around the node cores: a
  ``GroupScheduler`` (groups of ``runtime.sp_degree`` workers at fresh epochs, regrouping when a
  member goes; degree 1 for single workers) and a ``WeightsHolders`` (which worker holds which
  weights version: a worker lacking one copies it from a node peer, else fetches it from the store).

What a worker does is priced, not done: a group formed for a request loads the lease's weights
version (0 if held, a peer copy, or a store fetch queued on the store's network link), then runs
its remaining steps at ``TimingModel.step_s`` on its node class's processors (``cores``: a
device per worker; with a calibration, the cores every spot process shares, and the reserved ones
its workers share with the trainer). Commits are written to the store whenever their step
matters — at each heartbeat, at a notice's step boundary, at a SIGKILL (the steps finished by then)
and at the end — which leaves the store holding exactly what per-step commits would. A SIGTERM
(notice) stops each group at its next step boundary and releases its leases; a SIGKILL leaves
them to the lease expiry or the controller's lost-node sweep. Steps are logged per request as the
workers' step log is (``RequestSteps``), so steps lost and requests resumed are counted the same way.

With ``sim.gpus_per_instance`` set, trace nodes are instances of that many GPUs placed on
``SimHost``s (``spotlight.sim.host``), so a removal takes GPUs out of a host's SP groups; the
cluster records each interrupted request's reconfiguration (``reconfig_s``) and the survivors'
idle or reloading GPU-seconds (``lost_gpu_s``, ``survivor_s``).

Knows nodes, leases and time; nothing of tensors or models. The driver (``spotlight.sim.run``)
submits batches and waits on the clock.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.queue.core import RequestQueueCore
from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore
from spotlight.comm import messages as m
from spotlight.recipe import Recipe
from spotlight.sim.clock import Timer, VirtualClock
from spotlight.sim.cores import Cores
from spotlight.sim.host import SimHost
from spotlight.sim.node import SimNode
from spotlight.sim.timing import TimingModel
from spotlight.spot.accounting import RequestSteps, SpotAccount


@dataclass(slots=True)
class OpTimes:
    """Real CPU seconds of each queue operation (the bench's latency figures), when recorded."""

    enabled: bool = False
    ops: dict[str, list[float]] = field(default_factory=dict)

    def timed(self, name: str, fn: Callable, *args):
        if not self.enabled:
            return fn(*args)
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.ops.setdefault(name, []).append(time.perf_counter() - t)



class SimCluster:
    """The control plane and the nodes of one simulated run (module docstring); also the fault
    injector's ``Nodes`` target (``add_node``, ``signal_node``, ``node_alive``)."""

    def __init__(self, recipe: Recipe, timing: TimingModel, clock: VirtualClock, account: SpotAccount,
                 gpus_per_node: int) -> None:
        self.recipe, self.timing, self.clock, self.account = recipe, timing, clock, account
        rt = recipe.runtime
        self.steps = recipe.sampler.steps
        self.gpus_per_node = gpus_per_node
        self.queue = RequestQueueCore(rt.queue(), clock=clock)
        self.queue.on_deadline = self._on_deadline
        self.store = TensorStoreCore(TensorStoreConfig(keep_versions=rt.store_keep_versions))
        self.controller = ControllerCore(recipe, "sim://queue", "sim://store", clock=clock)
        self.controller.on_event = account.on_event
        self.cores = {kind: Cores(clock, timing.slowdown(kind)) for kind in ("spot", "reserved")}
        """The processors of each node class (the reserved one's are the trainer's too)."""
        self.nodes: dict[str, SimNode] = {}
        self.hungry: dict[SimNode, None] = {}  # nodes in a long poll, in the order they began it
        self.ops = OpTimes()
        self.steps_log: dict[str, RequestSteps] = {}
        """Per rollout request, the steps each attempt computed (the workers' step log)."""
        self.on_complete: Callable[[m.LeaseGrant, m.WorkResult], None] | None = None
        self.on_dead: Callable[[dict], None] | None = None
        self._expiry: Timer | None = None
        self._store_free_s = 0.0  # when the store's link is next free (fetches queue on it)
        self._busy: dict[str, int] = {}
        self.busy_spot = 0
        self.busy_area = 0.0  # integral of busy spot GPUs over time
        self._area_t = clock()
        self.gpus_per_instance = recipe.sim.gpus_per_instance
        self.hosts: dict[str, SimHost] = {}  # GPU-level preemption: trace instance id -> its host
        self.reconfig_s: list[float] = []
        """Per rollout interrupted by a GPU loss: seconds from the loss to its resumed compute."""
        self.lost_gpu_s = 0.0
        """GPU-seconds the survivors of groups broken by GPU losses spent not computing (SimNode)."""
        self.survivor_s: list[float] = []
        """Per survivor of a group broken by a GPU loss: seconds until it computes again, or is free
        with nothing waiting for it on its host (SimNode)."""
        self._interrupted: dict[str, float] = {}
        clock.call_later(rt.node_sweep_s, self._sweep)

    # --- the Nodes protocol of the fault injector ---------------------------------------------------
    def add_node(self, node_id: str, *, metadata_url: str | None = None, warm: bool = False,
                 kind: str = "spot", gpus: int | None = None) -> None:
        if kind == "spot" and self.gpus_per_instance is not None:
            self._place(node_id)
            return
        node = SimNode(self, node_id, kind, self.gpus_per_node if gpus is None else gpus)
        self.nodes[node_id] = node
        node.start(warm=warm or self.clock() <= 0)

    def signal_node(self, node_id: str, sig: int) -> bool:
        if node_id in self.hosts:
            return self.hosts.pop(node_id).lose(node_id, sig)
        node = self.nodes.get(node_id)
        if node is None or node.state == "gone":
            return False
        if sig == signal.SIGKILL:
            node.kill()
        else:
            node.notice()
        return True

    def node_alive(self, node_id: str) -> bool:
        if self.gpus_per_instance is not None and node_id not in self.nodes:
            host = self.hosts.get(node_id)
            return host is not None and host.state != "gone" and node_id in host.slices
        node = self.nodes.get(node_id)
        return node is not None and node.state != "gone"

    def _place(self, instance: str) -> None:
        """A trace instance's GPUs go to the fullest live host with room for them, else a new host."""
        g = self.gpus_per_instance
        fits = [h for h in self.nodes.values() if isinstance(h, SimHost)
                and h.state in ("starting", "serving") and h.gpus + g <= h.capacity]
        host = max(fits, key=lambda h: h.gpus, default=None)
        if host is None:
            host = SimHost(self, f"host{len(self.nodes)}", self.gpus_per_node)
            self.nodes[host.node_id] = host
            host.start(warm=self.clock() <= 0)
        self.hosts[instance] = host
        host.add_slice(instance, g)

    def interrupted(self, request_id: str) -> None:
        """A GPU loss broke the group computing ``request_id`` (its reconfiguration starts now)."""
        self._interrupted.setdefault(request_id, self.clock())

    def resumed(self, request_id: str, ready: float) -> None:
        """``request_id`` computes again from ``ready`` (a group formed for it has loaded)."""
        since = self._interrupted.pop(request_id, None)
        if since is not None:
            self.reconfig_s.append(ready - since)

    def spot_pids(self) -> dict[str, list[int]]:
        return {}  # no processes: the chaos suite's random_fault has nothing to signal

    # --- the queue's service side --------------------------------------------------------------------
    def submit(self, requests: list[m.WorkRequest]) -> None:
        self.ops.timed("submit", self.queue.submit, requests)
        self.wake()

    def wake(self) -> None:
        """Work may be queued: every node in a long poll pulls again."""
        for node in list(self.hungry):
            node.pull()

    def kinds(self, kind: str) -> list[str]:
        if kind == "reserved" and self.recipe.runtime.explore_on == "spot":
            return ["rollout"]
        return ["rollout", "explore"]

    def completed(self, lease: m.LeaseGrant, result: m.WorkResult) -> None:
        if self.on_complete is not None:
            self.on_complete(lease, result)

    def _on_deadline(self, deadline: float) -> None:
        if self._expiry is None or self._expiry.cancelled or deadline < self._expiry.when:
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry = self.clock.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        dead = len(self.queue.dead_letters)
        if self.queue.expire_leases():
            self.wake()
        for d in self.queue.dead_letters[dead:]:
            self.dead(d)
        nxt = self.queue.next_deadline()
        if nxt is not None:
            self._on_deadline(nxt)

    def dead(self, letter: dict) -> None:
        """A request was dead-lettered (the driver's batch counts it as finished)."""
        if self.on_dead is not None:
            self.on_dead(letter)

    def _sweep(self) -> None:
        """The controller's lost-node sweep; a lost node's leases go back to the queue at once."""
        for node_id in self.controller.sweep():
            self.controller.requeued(node_id, self.queue.release_node(node_id))
            self.wake()
        self.clock.call_later(self.recipe.runtime.node_sweep_s, self._sweep)

    def train(self, seconds: float) -> None:
        """The trainer's update of ``seconds`` (alone on its processors) runs; the clock moves on
        until it is done, the rest of the cluster going on meanwhile."""
        cores = self.cores["reserved"]
        if cores.slowdown is None:  # its own GPUs: nothing shares them
            self.clock.run(end=self.clock() + seconds)
            return
        done: list[bool] = []
        cores.start(1, seconds, lambda: done.append(True))
        self.clock.run(until=lambda: bool(done))

    # --- the store's link and busy accounting ----------------------------------------------------------
    def store_fetch(self, nbytes: float) -> float:
        """Seconds from now until a fetch of ``nbytes`` from the store is done (fetches queue)."""
        start = max(self.clock(), self._store_free_s)
        self._store_free_s = start + self.timing.store_fetch_s(nbytes)
        return self._store_free_s - self.clock()

    def set_busy(self, node: SimNode, gpus: int) -> None:
        if node.kind != "spot":
            return
        now = self.clock()
        self.busy_area += self.busy_spot * (now - self._area_t)
        self._area_t = now
        self.busy_spot += gpus - self._busy.get(node.node_id, 0)
        self._busy[node.node_id] = gpus

    def busy_gpu_s(self) -> float:
        """Spot GPU-seconds spent loading or computing, up to now."""
        return self.busy_area + self.busy_spot * (self.clock() - self._area_t)

    def explorers(self) -> int:
        """Workers (SP groups) that pull exploration now: the planner's capacity."""
        d = self.recipe.runtime.sp_degree
        return sum(n.gpus // d for n in self.nodes.values() if n.state == "serving"
                   and "explore" in self.kinds(n.kind))
