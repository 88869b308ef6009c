"""A simulated spot host whose GPUs the market grants and takes one instance at a time.

With ``sim.gpus_per_instance`` set, a trace node is a spot instance of that many GPUs, and
``SimCluster`` places each on a ``SimHost`` of ``sim.gpus_per_node`` GPUs beside others. The host
is a ``SimNode`` (the agent's shell around the node's ``GroupScheduler`` and ``WeightsHolders``)
whose members come and go by instance: each instance registers with the controller as a node of
its GPUs (so the cost meter bills it and counts its removal as a preemption), the host beats for
the instances it holds, and the host's pull loop, groups and leases outlive any one of them.

- An instance granted to a booting host joins when the host is up; one granted to a serving host
  starts a worker per GPU whose model comes from a node peer over NVLink (``runtime.peer_weights``)
  or cold from storage.
- A removal takes the instance's GPUs out of their groups (SIGKILL: now; a notice: at the next step
  boundary of each group they are in). A group that loses a member is broken by the scheduler; its
  survivors re-form at a new epoch with the host's idle members, resuming from the last commit
  (``runtime.sp_regroup``), or are restarted cold first (the baseline). The interrupted request's
  reconfiguration (loss -> resumed compute) and the survivors' idle or reloading GPU-seconds are
  what the cluster records (``SimCluster.reconfig_s``, ``lost_gpu_s``).
- A host left with fewer GPUs than one group releases the leases waiting for a group (another host
  resumes them from their commit); one left without GPUs releases every lease and is gone.

Knows instances, members and the clock; the node cores decide who groups with whom.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from spotlight.comm import messages as m
from spotlight.sim.node import SimNode

if TYPE_CHECKING:
    from spotlight.sim.cluster import SimCluster


class SimHost(SimNode):
    """One spot host of ``capacity`` GPUs holding instances (module docstring)."""

    def __init__(self, cluster: SimCluster, host_id: str, capacity: int) -> None:
        super().__init__(cluster, host_id, "spot", 0)
        self.capacity = capacity
        self.slices: dict[str, list[str]] = {}  # instance id -> its members (one per GPU)

    # --- instances ---------------------------------------------------------------------------------
    def add_slice(self, instance: str, gpus: int) -> None:
        members = [f"{self.node_id}/{instance}/w{i}" for i in range(gpus)]
        self.slices[instance] = members
        self.gpus += gpus
        if self.state != "serving":  # booting: registered and joined when the host is up
            return
        c, t = self.c, self.c.timing
        self._book(instance, gpus)
        peer = c.recipe.runtime.peer_weights and any(
            x.state != "releasing" for x in self.sched.members.values())
        model = t.peer_copy_s(t.profile.weights_bytes) if peer else t.cold_load_s
        load = t.restart_s - t.cold_load_s + model  # the worker's process start, then its model
        self.restarting.update(members)  # a fresh worker per GPU: joins once its model is loaded
        for mid in members:
            self._after(load, lambda mid=mid: self._rejoin(mid))

    def lose(self, instance: str, sig: int) -> bool:
        """The market takes ``instance`` away: SIGKILL now, a notice at its groups' step boundaries."""
        members = self.slices.get(instance)
        if members is None or self.state == "gone":
            return False
        now = self.c.clock()
        if sig == signal.SIGKILL or self.state != "serving":
            self._take(instance, graceful=sig != signal.SIGKILL)
            return True
        boundary = now
        for run in self.runs.values():
            if set(members) & set(run.members) and run.done_steps() < run.total:
                boundary = max(boundary, run.boundary_s(now))
        self.c.clock.call_at(boundary, lambda: self._take(instance, graceful=True))
        return True

    def _take(self, instance: str, graceful: bool) -> None:
        c, now = self.c, self.c.clock()
        members = self.slices.pop(instance, None)
        if members is None:
            return
        self.gpus -= len(members)
        for mid in members:
            run = next((r for r in self.runs.values() if mid in r.members), None)
            if run is not None:
                if run.lease.work.KIND == "rollout":
                    c.interrupted(run.lease.request_id)
                for other in run.members:
                    if other not in members:
                        self.lost_since.setdefault(other, now)
                self._drop(run.epoch)
            if self.lost_since.get(mid) == now:  # lost together with its group's first victim:
                del self.lost_since[mid]  # not a survivor
            self.restarting.discard(mid)
            self.holders.forget(mid)
            self._count_lost(gone=(mid,))
            self._do(self.sched.died(mid, "preempted"))
        if instance in self.on_books:
            del self.on_books[instance]
            if graceful:  # a killed instance falls silent: the controller's sweep declares it lost
                c.controller.deregister(m.Deregister(node_id=instance, reason="leaving"))
        if self.gpus < self.sched.degree:  # no group can form here now: the leases go to other hosts
            for rid in list(self.sched.pending):
                self._release(rid)
        if not self.slices:
            for rid in list(self.leases):
                self._release(rid)
            self._count_lost(gone=tuple(self.lost_since))
            self._gone()
        else:
            self.pull()
        c.wake()

    # --- the SimNode lifetime, by instance ---------------------------------------------------------
    def _books(self) -> list[tuple[str, int]]:
        return [(instance, len(members)) for instance, members in self.slices.items()]

    def _members(self) -> list[str]:
        return [mid for members in self.slices.values() for mid in members]
