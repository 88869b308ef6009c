"""The simulated cluster: the production control-plane cores on a virtual clock, with nodes whose
workers take their time from the timing model instead of computing.

``SimCluster`` owns, all on one ``VirtualClock``:

- ``RequestQueueCore`` (leases, heartbeats, fencing, expiry through its ``on_deadline`` hook,
  ``release_node``, dead letters), ``TensorStoreCore`` (commits, seals, weights versions: the
  bookkeeping, with empty tensor bundles), ``ControllerCore`` (registry, beats, ``sweep``),
  ``SpotAccount`` (GPU-seconds, dollars, preemptions), and a ``FaultInjector`` acting on the
  cluster (its ``Nodes`` target) with the replayed trace;
- ``SimNode``s, each a node agent's shell around the node cores: a ``GroupScheduler`` (groups of
  ``runtime.sp_degree`` workers at fresh epochs, regrouping when a member goes; degree 1 for
  single workers) and a ``WeightsHolders`` (which worker holds which weights version: a worker
  lacking one copies it from a node peer, else fetches it from the store).

What a worker does is priced, not done: a group formed for a request loads the lease's weights
version (0 if held, a peer copy, or a store fetch queued on the store's network link), then runs
its remaining steps at ``TimingModel.step_s``. Commits are written to the store whenever their step
matters — at each heartbeat, at a notice's step boundary, at a SIGKILL (the steps finished by then)
and at the end — which leaves the store holding exactly what per-step commits would. A SIGTERM
(notice) stops each group at its next step boundary and releases its leases; a SIGKILL leaves
them to the lease expiry or the controller's lost-node sweep. Steps are logged per request as the
workers' step log is (``RequestSteps``), so steps lost and requests resumed are counted the same way.

Knows nodes, leases and time; nothing of tensors or models. The driver (``spotlight.sim.run``)
submits batches and waits on the clock.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.node.groups import Finished, Form, GroupScheduler, Kill, Leave
from spotlight.actors.node.holders import WeightsHolders
from spotlight.actors.queue.core import RequestQueueCore
from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore
from spotlight.comm import messages as m
from spotlight.errors import NotFound, StaleAttempt
from spotlight.recipe import Recipe
from spotlight.sim.clock import Timer, VirtualClock
from spotlight.sim.timing import TimingModel
from spotlight.spot.accounting import RequestSteps, SpotAccount

GONE = (StaleAttempt, NotFound)


@dataclass(slots=True)
class _Run:
    """One formed group's request."""

    lease: m.LeaseGrant
    epoch: int
    members: tuple[str, ...]
    start_s: float  # compute starts (weights loaded)
    first_step: int  # steps done before this attempt (its resume point)
    total: int
    step_s: float
    timer: Timer | None = None

    def done_steps(self, now: float) -> int:
        if now <= self.start_s:
            return self.first_step
        return min(self.total, self.first_step + int((now - self.start_s) / self.step_s + 1e-9))


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


class SimNode:
    """One node (spot or reserved): the agent's pull loop, groups, heartbeats and notices."""

    def __init__(self, cluster: SimCluster, node_id: str, kind: str, gpus: int) -> None:
        self.c, self.node_id, self.kind, self.gpus = cluster, node_id, kind, gpus
        rt = cluster.recipe.runtime
        self.pull_id = f"{node_id}/sp"
        self.sched = GroupScheduler(rt.sp_degree, stall_s=rt.sp_stall_s, release_s=rt.sp_release_s,
                                    clock=cluster.clock)
        self.holders = WeightsHolders(rt.worker_versions)
        self.state = "starting"  # starting | serving | leaving | gone
        self.leases: dict[str, m.LeaseGrant] = {}
        self.runs: dict[int, _Run] = {}
        self.timers: list[Timer] = []
        self.loaded_at: dict[tuple[str, int], float] = {}  # (worker, version) -> when it holds it
        self.warm = self.registered = False

    # --- lifetime --------------------------------------------------------------------------------
    def start(self, warm: bool) -> None:
        """The node boots (``node_start_s``; at once if warm), its agent registers (the cost meter
        counts it from then on, as the runtime's does), its workers load the model
        (``cold_load_s``; at once if warm), then it serves."""
        self.warm = warm
        boot = 0.0 if warm else self.c.timing.node_start_s
        self.timers.append(self.c.clock.call_later(boot, self._register))

    def _register(self) -> None:
        if self.state != "starting":
            return
        c, self.registered = self.c, True
        c.controller.register(m.Register(node_id=self.node_id, kind=self.kind, workers=self.gpus))
        self.timers.append(c.clock.call_later(0.0 if self.warm else c.timing.cold_load_s, self._ready))
        self.timers.append(c.clock.call_later(c.recipe.runtime.node_beat_s, self._beat))

    def _ready(self) -> None:
        if self.state != "starting":
            return
        self.state = "serving"
        for i in range(self.gpus):
            self._do(self.sched.join(f"{self.node_id}/w{i}"))
        self.pull()

    def _beat(self) -> None:
        if self.state == "gone":
            return
        try:
            self.c.controller.beat(m.NodeBeat(node_id=self.node_id))
        except NotFound:  # declared lost (a stall): register again, as the agent does
            self.c.controller.register(m.Register(node_id=self.node_id, kind=self.kind, workers=self.gpus))
        self.timers.append(self.c.clock.call_later(self.c.recipe.runtime.node_beat_s, self._beat))
        self._heartbeats()

    def notice(self) -> None:
        """SIGTERM: every group stops at its next step boundary (commit flushed), leases released."""
        if self.state in ("leaving", "gone"):
            return
        if not self.registered:  # still booting: it goes without ever having joined
            self._gone()
            return
        self.state = "leaving"
        now, last = self.c.clock(), self.c.clock()
        for rid in list(self.sched.pending):  # leases waiting for a group go back at once
            self._release(rid)
        for run in list(self.runs.values()):
            if run.timer is not None:
                run.timer.cancel()
            k = run.done_steps(now)
            boundary = now  # loading, or done: stops now; else at the end of the step under way
            if k < run.total and now > run.start_s:
                boundary = run.start_s + (k + 1 - run.first_step) * run.step_s
            last = max(last, boundary)
            self.c.clock.call_at(boundary, lambda run=run: self._stop_at_boundary(run))
        self.c.clock.call_at(last, self._exit)

    def _stop_at_boundary(self, run: _Run) -> None:
        now = self.c.clock()
        self._log_steps(run, run.done_steps(now))
        self.runs.pop(run.epoch, None)
        self._release(run.lease.request_id)

    def _exit(self) -> None:
        if self.state == "gone":
            return
        self._gone()
        if self.registered:
            self.c.controller.deregister(m.Deregister(node_id=self.node_id, reason="leaving"))
        self.c.wake()

    def kill(self) -> None:
        """SIGKILL: gone now. Steps finished are committed; leases wait for expiry or the sweep."""
        if self.state == "gone":
            return
        now = self.c.clock()
        for run in list(self.runs.values()):
            self._log_steps(run, run.done_steps(now))
        self.runs.clear()
        self._gone()

    def _gone(self) -> None:
        self.state = "gone"
        for t in self.timers:
            t.cancel()
        for run in self.runs.values():
            if run.timer is not None:
                run.timer.cancel()
        self.timers.clear()
        self.c.hungry.discard(self)
        self.c.set_busy(self, 0)

    # --- the pull loop -----------------------------------------------------------------------------
    def pull(self) -> None:
        """Lease as many requests as the idle members can form groups for (one long poll)."""
        if self.state != "serving":
            return
        want = self.sched.idle() // self.sched.degree - len(self.sched.pending)
        if want <= 0:
            return
        grants = self.c.ops.timed("pull", self.c.queue.pull_many, self.pull_id, self.c.kinds(self.kind), want)
        if len(grants) < want:
            self.c.hungry.add(self)  # a long poll: woken when work appears
        else:
            self.c.hungry.discard(self)
        for g in grants:
            self.leases[g.request_id] = g
            self._do(self.sched.submit(g.request_id))

    def _do(self, cmds) -> None:
        for cmd in cmds:
            if isinstance(cmd, Form):
                self._form(cmd)
            elif isinstance(cmd, Finished):
                self._finished(cmd)
            elif isinstance(cmd, Leave):  # a broken group (a stall): its members stop now
                self._drop(cmd.epoch)
                self._do(self.sched.released(cmd.member, cmd.epoch))
            elif isinstance(cmd, Kill):
                self._do(self.sched.died(cmd.member, cmd.reason))
        self._update_busy()

    def _form(self, cmd: Form) -> None:
        c, lease = self.c, self.leases[cmd.request_id]
        work = lease.work
        held = c.store.get_commit(cmd.request_id) if c.recipe.runtime.step_commits else None
        first = held[0] if held is not None and work.KIND == "rollout" else 0
        members = cmd.members
        if work.KIND == "explore":  # exploration runs on rank 0 alone; the others are free at once
            members = cmd.members[:1]
            steps = work.effective_steps or c.steps
            step_s = c.timing.step_s(len(work.seeds), 1)
        else:
            steps = c.steps
            step_s = c.timing.step_s(len(work.seeds), len(members))
        ready = c.clock() + self._load(members, work.version)
        run = _Run(lease, cmd.epoch, members, ready, first, steps, step_s)
        self.runs[cmd.epoch] = run
        run.timer = c.clock.call_at(ready + (steps - first) * step_s, lambda: self._complete(run))
        if work.KIND == "explore":
            for mid in cmd.members[1:]:
                self._do(self.sched.done(mid, cmd.epoch))

    def _load(self, members: tuple[str, ...], version: int) -> float:
        """Seconds until every member holds ``version``: a peer copy from a node neighbour that
        holds it, else one store fetch (queued on the store's link) and peer copies from it."""
        c = self.c
        ready = 0.0
        for mid in members:
            if version in self.holders.holds(mid):
                continue
            peers = self.holders.peers(version, exclude=mid) if c.recipe.runtime.peer_weights else []
            if peers:
                t = max(self.loaded_at.get((peers[0], version), 0.0) - c.clock(), 0.0)
                t += c.timing.peer_copy_s(c.timing.profile.update_bytes)
            else:
                t = c.store_fetch(c.timing.profile.update_bytes)
            self.holders.handed(mid, version)
            self.loaded_at[(mid, version)] = c.clock() + t
            ready = max(ready, t)
        return ready

    def _complete(self, run: _Run) -> None:
        c = self.c
        if self.runs.pop(run.epoch, None) is None:
            return
        self._log_steps(run, run.total)
        lease, rid = run.lease, run.lease.request_id
        compute = (run.total - run.first_step) * run.step_s
        if lease.work.KIND == "rollout":
            if c.recipe.runtime.step_commits:
                c.store.seal_commit(rid, run.total, f"traj/{rid}")
            else:
                c.store.put(f"traj/{rid}", {})
            result: m.WorkResult = m.RolloutResult(key=f"traj/{rid}", nbytes=0, rewards=[],
                                                   resumed_from=run.first_step, worker_s=compute,
                                                   compute_s=compute)
        else:
            result = m.ExploreResult(rewards=[], model_calls=run.total, worker_s=compute, compute_s=compute)
        self.leases.pop(rid, None)
        try:
            accepted = c.ops.timed("complete", c.queue.complete, rid, lease.attempt, self.pull_id, result)
        except GONE:  # fenced: cancelled at a deadline, or another attempt owns it
            accepted = False
        if accepted:
            c.completed(lease, result)
        cmds = []
        for mid in run.members[1:]:
            cmds += self.sched.done(mid, run.epoch)
        cmds += self.sched.done(run.members[0], run.epoch)
        self._do(cmds)
        self.pull()

    def _drop(self, epoch: int) -> None:
        run = self.runs.pop(epoch, None)
        if run is not None:
            self._log_steps(run, run.done_steps(self.c.clock()))
            if run.timer is not None:
                run.timer.cancel()

    def _finished(self, cmd: Finished) -> None:
        pass  # the queue was told in _complete; the scheduler's record is enough

    def _release(self, rid: str) -> None:
        lease = self.leases.pop(rid, None)
        self._do(self.sched.cancel(rid))
        if lease is None:
            return
        try:
            self.c.ops.timed("release", self.c.queue.release, rid, lease.attempt, self.pull_id)
        except GONE:
            pass
        self.c.wake()

    def _heartbeats(self) -> None:
        """Every held lease's heartbeat with its committed step (one timer per node, at the beat)."""
        c, now = self.c, self.c.clock()
        if self.state not in ("serving", "leaving"):
            return
        steps = {run.lease.request_id: run for run in self.runs.values()}
        freed = False
        for rid, lease in list(self.leases.items()):
            run = steps.get(rid)
            step = None
            if run is not None:
                done = run.done_steps(now)
                if lease.work.KIND == "rollout":
                    step = done
                    if step > 0 and c.recipe.runtime.step_commits:
                        c.store.commit(rid, step, {})
                self._do(self.sched.committed(run.members[0], run.epoch, done))
            try:
                c.ops.timed("heartbeat", c.queue.heartbeat, rid, lease.attempt, self.pull_id, step)
            except GONE:  # cancelled at a deadline or re-leased: drop the work
                self.leases.pop(rid, None)
                if run is not None:
                    self._drop(run.epoch)
                self._do(self.sched.cancel(rid))
                freed = True
        cmds = self.sched.tick()
        self._do(cmds)
        if freed or cmds:  # members came free (dropped work, a stalled group broken): pull for them
            self.pull()

    # --- bookkeeping ------------------------------------------------------------------------------
    def _log_steps(self, run: _Run, upto: int) -> None:
        """Steps first_step+1..upto were computed by this attempt (the workers' step log)."""
        lease = run.lease
        if upto > run.first_step and lease.work.KIND == "rollout":
            if self.c.recipe.runtime.step_commits:
                self.c.store.commit(lease.request_id, upto, {})
            rec = self.c.steps_log.setdefault(lease.request_id, RequestSteps())
            rec.computed += upto - run.first_step
            rec.steps.update(range(run.first_step + 1, upto + 1))
            rec.first_step.setdefault(lease.attempt, run.first_step + 1)

    def _update_busy(self) -> None:
        if self.state == "gone":
            return
        self.c.set_busy(self, sum(len(r.members) for r in self.runs.values()))


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
        self.nodes: dict[str, SimNode] = {}
        self.hungry: set[SimNode] = set()
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
        clock.call_later(rt.node_sweep_s, self._sweep)

    # --- the Nodes protocol of the fault injector ---------------------------------------------------
    def add_node(self, node_id: str, *, metadata_url: str | None = None, warm: bool = False,
                 kind: str = "spot", gpus: int | None = None) -> None:
        node = SimNode(self, node_id, kind, self.gpus_per_node if gpus is None else gpus)
        self.nodes[node_id] = node
        node.start(warm=warm or self.clock() <= 0)

    def signal_node(self, node_id: str, sig: int) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.state == "gone":
            return False
        if sig == signal.SIGKILL:
            node.kill()
        else:
            node.notice()
        return True

    def node_alive(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.state != "gone"

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
