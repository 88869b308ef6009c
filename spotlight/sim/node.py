"""A simulated node: the node agent's shell around the node cores, timed instead of computing.

``SimNode`` does what ``NodeAgent`` (with ``GroupServer`` for SP groups) does, on the virtual
clock: it boots and registers with the controller, beats, long-polls the queue for as many leases
as its idle members can form groups for, hands them to its ``GroupScheduler`` (groups of
``runtime.sp_degree`` at fresh epochs; degree 1 for single workers), loads each lease's weights
version through its ``WeightsHolders`` (held: nothing; a node peer holds it: a peer copy; else a
store fetch queued on the store's link) and, for a rollout, waits the runtime's own seconds per
request (``TimingModel.request_s``), runs the remaining steps at ``TimingModel.step_s`` on its
node class's processors (``SimCluster.cores``: a device per worker, or cores shared by every
process computing on them, its start included — ``spotlight.sim.cores``),
heartbeats every lease with its committed step, and completes on the queue. A notice (SIGTERM)
stops every group at its next step boundary and releases its leases; a SIGKILL leaves them to the
lease expiry or the controller's lost-node sweep. Commits reach the store at each heartbeat, at a
stop and at a kill (the steps finished by then), which leaves it holding what per-step commits
would. Computed steps are logged per request as the workers' step log is (``RequestSteps``).

Knows leases, groups and time; the cluster (``spotlight.sim.cluster``) owns the cores it calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotlight.actors.node.groups import Form, GroupScheduler, Kill, Leave
from spotlight.actors.node.holders import WeightsHolders
from spotlight.comm import messages as m
from spotlight.errors import NotFound, StaleAttempt
from spotlight.policy.caching import StepCache
from spotlight.sim.clock import Timer
from spotlight.sim.cores import Cores, Task
from spotlight.spot.accounting import RequestSteps

if TYPE_CHECKING:
    from spotlight.sim.cluster import SimCluster

GONE = (StaleAttempt, NotFound)

@dataclass(slots=True)
class _Run:
    """One formed group's request: it loads until ``start_s``, then computes its steps as a task
    on the node's cores."""

    lease: m.LeaseGrant
    epoch: int
    members: tuple[str, ...]
    start_s: float  # compute starts (weights loaded)
    first_step: int  # steps done before this attempt (its resume point)
    total: int
    step_s: float  # one step alone on a processor
    cores: Cores
    timer: Timer | None = None  # the start of its compute
    task: Task | None = None  # its compute, once started

    def done_steps(self) -> int:
        if self.task is None:
            return self.first_step
        return min(self.total, self.first_step + int(self.cores.progress(self.task) + 1e-9))

    def boundary_s(self, now: float) -> float:
        """When the step under way ends at the cores' present load (now: loading, or done)."""
        if self.task is None or self.task not in self.cores.tasks:
            return now
        left = self.done_steps() + 1 - self.first_step - self.cores.progress(self.task)
        return now + left * self.cores.unit_time(self.task)

    def halt(self) -> None:
        """Its compute stops now (or never starts)."""
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None:
            self.cores.stop(self.task)


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
        self.cores = cluster.cores[kind]
        self.leases: dict[str, m.LeaseGrant] = {}
        self.runs: dict[int, _Run] = {}
        self.timers: list[Timer] = []
        self.tasks: list[Task] = []  # its processes starting on shared cores
        self.on_books: dict[str, int] = {}  # node ids registered with the controller -> their workers
        self._leaving: set[int] = set()  # epochs a notice stops at their next step boundary
        self.loaded_at: dict[tuple[str, int], float] = {}  # (worker, version) -> when it holds it
        self.warm = self.registered = False
        self.restarting: set[str] = set()  # members restarting cold (runtime.sp_regroup = false)
        self.lost_since: dict[str, float] = {}  # survivors of a group broken by a GPU loss -> since

    # --- lifetime --------------------------------------------------------------------------------
    def start(self, warm: bool) -> None:
        """The node boots (``node_start_s``; at once if warm), its agent registers (the cost meter
        counts it from then on, as the runtime's does), its workers load the model
        (``cold_load_s``; at once if warm), then it serves."""
        self.warm = warm
        self._after(0.0 if warm else self.c.timing.node_start_s, self._register)

    def _after(self, seconds: float, then) -> None:
        """``then`` after a process's ``seconds`` of start-up: a wait on a device of its own, work
        among the others' on shared cores."""
        if seconds <= 0 or self.cores.slowdown is None:
            self.timers.append(self.c.clock.call_later(seconds, then))
        else:
            self.tasks.append(self.cores.start(1, seconds, then))

    def _books(self) -> list[tuple[str, int]]:
        """What registers with the controller when the agent is up: (node id, workers)."""
        return [(self.node_id, self.gpus)]

    def _members(self) -> list[str]:
        """The workers that join the scheduler when the model is loaded."""
        return [f"{self.node_id}/w{i}" for i in range(self.gpus)]

    def _book(self, node_id: str, workers: int) -> None:
        self.c.controller.register(m.Register(node_id=node_id, kind=self.kind, workers=workers))
        self.on_books[node_id] = workers

    def _register(self) -> None:
        if self.state != "starting":
            return
        self.registered = True
        for node_id, workers in self._books():
            self._book(node_id, workers)
        self._after(0.0 if self.warm else self.c.timing.cold_load_s, self._ready)
        self.timers.append(self.c.clock.call_later(self.c.recipe.runtime.node_beat_s, self._beat))

    def _ready(self) -> None:
        if self.state != "starting":
            return
        self.state = "serving"
        for mid in self._members():
            self._do(self.sched.join(mid))
        self.pull()

    def _beat(self) -> None:
        if self.state == "gone":
            return
        for node_id, workers in list(self.on_books.items()):
            try:
                self.c.controller.beat(m.NodeBeat(node_id=node_id))
            except NotFound:  # declared lost (a stall): register again, as the agent does
                self._book(node_id, workers)
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
        for rid in list(self.sched.pending):  # leases waiting for a group go back at once
            self._release(rid)
        self._leaving = set(self.runs)
        for run in list(self.runs.values()):
            if run.task is not None and run.task in self.cores.tasks and run.done_steps() < run.total:
                k = run.done_steps() + 1 - run.first_step  # computing: stops when the step under way ends
                self.cores.end_at(run.task, k, lambda run=run: self._stop_at_boundary(run))
            else:  # loading, or done: stops now
                run.halt()
                self.c.clock.call_later(0.0, lambda run=run: self._stop_at_boundary(run))
        if not self.runs:
            self.c.clock.call_later(0.0, self._exit)

    def _stop_at_boundary(self, run: _Run) -> None:
        self._log_steps(run, run.done_steps())
        run.halt()
        self.runs.pop(run.epoch, None)
        self._release(run.lease.request_id)
        self._leaving.discard(run.epoch)
        if not self._leaving:
            self._exit()

    def _exit(self) -> None:
        if self.state == "gone":
            return
        self._gone()
        for node_id in self.on_books:
            self.c.controller.deregister(m.Deregister(node_id=node_id, reason="leaving"))
        self.on_books.clear()
        self.c.wake()

    def kill(self) -> None:
        """SIGKILL: gone now. Steps finished are committed; leases wait for expiry or the sweep."""
        if self.state == "gone":
            return
        for run in list(self.runs.values()):
            self._log_steps(run, run.done_steps())
        self._gone()
        self.runs.clear()

    def _gone(self) -> None:
        self.state = "gone"
        for t in self.timers:
            t.cancel()
        for task in self.tasks:
            self.cores.stop(task)
        for run in self.runs.values():
            run.halt()
        self.timers.clear()
        self.tasks.clear()
        self.c.hungry.pop(self, None)
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
            self.c.hungry[self] = None  # a long poll: woken when work appears
        else:
            self.c.hungry.pop(self, None)
        for g in grants:
            self.leases[g.request_id] = g
            self._do(self.sched.submit(g.request_id))

    def _do(self, cmds) -> None:
        for cmd in cmds:
            if isinstance(cmd, Form):
                self._form(cmd)
            elif isinstance(cmd, Leave):  # a broken group: its members stop now
                self._drop(cmd.epoch)
                if self.c.recipe.runtime.sp_regroup:  # same process, same weights: idle at once
                    self._do(self.sched.released(cmd.member, cmd.epoch))
                else:
                    self._restart(cmd.member)
            elif isinstance(cmd, Kill):
                self._do(self.sched.died(cmd.member, cmd.reason))
        self._update_busy()

    def _restart(self, member: str) -> None:
        """The cold-restart baseline: ``member`` is restarted (process, model from storage) and
        joins again when it is loaded, as the agent's watcher does with a killed worker."""
        self.holders.forget(member)
        self.restarting.add(member)
        self._do(self.sched.died(member, "restarted cold"))
        self._after(self.c.timing.restart_s, lambda: self._rejoin(member))

    def _rejoin(self, member: str) -> None:
        if member not in self.restarting or self.state != "serving":
            return
        self.restarting.discard(member)
        self._do(self.sched.join(member))
        self.pull()

    def _form(self, cmd: Form) -> None:
        c, lease = self.c, self.leases[cmd.request_id]
        work = lease.work
        held = c.store.get_commit(cmd.request_id) if c.recipe.runtime.step_commits else None
        first = held[0] if held is not None and work.KIND == "rollout" else 0
        members = cmd.members
        if work.KIND == "explore":  # exploration runs on rank 0 alone; the others are free at once
            members = cmd.members[:1]
            steps = c.steps if work.cache is None else StepCache.parse(work.cache).nominal_calls(c.steps)
            step_s = c.timing.step_s(len(work.seeds), 1, self.kind)
        else:
            steps = c.steps
            step_s = c.timing.step_s(len(work.seeds), len(members), self.kind)
        req = self.sched.requests.get(cmd.request_id)
        regroup = c.timing.regroup_s if req is not None and req.attempts > 1 else 0.0
        # the runtime's own work on a rollout (queue, fetches, commits, seal, the trainer's read)
        # holds its members before they compute
        own = c.timing.request_s if work.KIND == "rollout" else 0.0
        ready = c.clock() + regroup + own + self._load(members, work.version)
        c.resumed(cmd.request_id, ready)
        run = _Run(lease, cmd.epoch, members, ready, first, steps, step_s, self.cores)
        self.runs[cmd.epoch] = run
        run.timer = c.clock.call_at(ready, lambda: self._compute(run))
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

    def _compute(self, run: _Run) -> None:
        """``run``'s weights are loaded: its remaining steps compute on the node's cores."""
        delay = self.c.recipe.runtime.step_delay_s  # a modelled slower device sleeps after each step
        steps = run.total - run.first_step
        run.task = self.cores.start(steps, run.step_s, lambda: self._complete(run), delay)

    def _complete(self, run: _Run) -> None:
        c = self.c
        if self.runs.pop(run.epoch, None) is None:
            return
        self._log_steps(run, run.total)
        lease, rid = run.lease, run.lease.request_id
        compute = c.clock() - run.start_s
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
            self._log_steps(run, run.done_steps())
            run.halt()
        if epoch in self._leaving:  # a notice was waiting for it to stop
            self._leaving.discard(epoch)
            if not self._leaving:
                self._exit()

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
        c = self.c
        if self.state not in ("serving", "leaving"):
            return
        steps = {run.lease.request_id: run for run in self.runs.values()}
        freed = False
        for rid, lease in list(self.leases.items()):
            run = steps.get(rid)
            step = None
            if run is not None:
                done = run.done_steps()
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
        self._count_lost()

    def _count_lost(self, gone: tuple[str, ...] = ()) -> None:
        """A survivor of a group broken by a GPU loss stops counting as lost when it computes again
        (its new group's load done), when it is idle with nothing pending here, or when it goes
        (``gone``: preempted in turn; its seconds count as lost, not as a survivor's)."""
        now = self.c.clock()
        for mid, since in list(self.lost_since.items()):
            run = next((r for r in self.runs.values() if mid in r.members), None)
            member = self.sched.members.get(mid)
            if run is not None:
                end = max(run.start_s, since)
            elif mid in gone or (member is not None and member.state == "idle" and not self.sched.pending):
                end = now
            else:
                continue
            self.c.lost_gpu_s += end - since
            if mid not in gone:  # one preempted in turn is a loss, not a survivor's reconfiguration
                self.c.survivor_s.append(end - since)
            del self.lost_since[mid]
