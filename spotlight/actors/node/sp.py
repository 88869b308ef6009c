"""The node agent's pull loop when its unit of work is a sequence-parallel group
(``runtime.sp_degree`` = d > 1): ``GroupServer`` runs inside the agent in place of its
one-slot-per-worker loop, with the same queue, leases, store commits and notices. It is handed the
agent's ``NodeSession`` (``spotlight.actors.node.session``) and imports nothing above it.

Decisions are the ``GroupScheduler``'s (``spotlight.actors.node.groups``, tested with fake
workers); this module carries them out with the node's real worker processes:

- The agent's workers join the scheduler as members. While the idle members could form one more
  group than the requests waiting for one, the server long-polls the queue (as ``NODE/sp``: the
  queue sees the group as one worker) and submits the lease; the scheduler forms a group of d
  idle workers at a fresh membership epoch.
- A formed group gets the lease as d ``WorkerRun(lease, SpGroup(epoch, rank, d, port))``: every
  worker opens the epoch's communicator on the agent's rendezvous store (a torch ``TCPStore``
  hosted here, on ``port``) and runs the single worker's rollout with its DiT parallelized; rank 0
  commits every step to the tensor store exactly as a lone worker does, seals the trajectory and
  scores it, and its result is what the server completes on the queue. Exploration jobs run on
  rank 0 alone (the group's other members are freed at once) and stop when their lease is revoked.
- Every member is handed the lease with the agent's weights hint (``NodeSession.weights_peer``):
  the d members of a group load a new version from the store once per node, not d times.
- One heartbeat per lease, carrying rank 0's committed step (which also feeds the scheduler's
  stall detection: a group that commits nothing for ``runtime.sp_stall_s`` is broken).
- A member whose process exits: the scheduler breaks its group; the survivors are told to leave
  (``WorkerLeave``) and come out of their collective by themselves (a dead peer's closed sockets
  fail it at once; a hung peer after ``runtime.sp_timeout_s``), or are killed after
  ``runtime.sp_release_s``. The request stays here, under the same lease (still heartbeated),
  and the scheduler re-forms it at a new epoch as soon as d members are idle: the survivors are
  the same processes with the same weights (no reload), and the new group resumes from the
  store's newest commit. The dead one is restarted at once when the node needs it to form a
  group; when a spare let the request re-form without it, its restart (interpreter, imports,
  model: CPU-seconds) waits until the new group's first commit is seen, at most
  ``runtime.sp_timeout_s``, so it does not compete with the resumed steps for the node's cores.
  With ``runtime.sp_regroup = false`` (the cold-restart baseline) the survivors are killed and
  restarted instead of told to leave: the request re-forms on restarted, reloaded workers (or on
  idle ones).
  A request whose lease the queue gave to another attempt is dropped
  (``GroupScheduler.cancel``).
- A spot notice: every busy member stops at a step boundary (rank 0's commits flushed), every
  lease held (running or waiting for a group) is released.

Every rank is a runtime worker running the single worker's rollout (``WorkerCore``), so d = 1
and d > 1 share one rollout code path and one commit protocol.

Knows leases, workers and the scheduler's commands; nothing of models or tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from spotlight.actors.node.groups import Finished, Form, GroupScheduler, Kill, Leave
from spotlight.actors.node.session import GONE, RESTART_TRIES, NodeSession
from spotlight.actors.worker.client import WorkerHandle
from spotlight.comm import messages as m
from spotlight.errors import (
    ActorTimeout,
    SpotlightError,
)

log = logging.getLogger(__name__)


class GroupServer:
    """Serves the agent's session with SP groups of ``runtime.sp_degree`` of its workers."""

    def __init__(self, agent: NodeSession) -> None:
        from spotlight.parallel.comms import host_store

        rt = agent.runtime
        self.agent, self.rt = agent, rt
        self.sched = GroupScheduler(rt.sp_degree, stall_s=rt.sp_stall_s, release_s=rt.sp_release_s,
                                    clock=asyncio.get_running_loop().time)
        self.rendezvous = host_store()
        self.pull_id = f"{agent.config.node_id}/sp"
        self.handles: dict[str, WorkerHandle] = {h.worker_id: h for h in agent.workers}
        self.leases: dict[str, m.LeaseGrant] = {}  # request id -> the lease this node holds
        self.results: dict[int, m.WorkResult] = {}  # epoch -> rank 0's result
        self.beats: dict[str, asyncio.Task] = {}
        self.killing: set[str] = set()  # members killed for being stuck: their death is what counts
        self.changed = asyncio.Event()  # the scheduler's state changed: maybe pull again
        self.resuming: set[int] = set()  # epochs of re-formed groups whose first commit is not seen
        self.first_commits = 0  # re-formed groups whose first commit was seen (for the log line)
        self.restart_now = asyncio.Event()  # no such group, or a request waits for members
        self.restart_now.set()
        self.stats = {"groups": 0, "regroups": 0}
        self._tg: asyncio.TaskGroup | None = None

    # --- lifetime ----------------------------------------------------------------------------------
    async def serve(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            background = [tg.create_task(self._watch(h), name=f"watch {h.worker_id}")
                          for h in self.handles.values()]
            background.append(tg.create_task(self._tick(), name="sp tick"))
            for h in self.handles.values():
                self._do(self.sched.join(h.worker_id))
            await self._pull_loop()
            for t in [*background, *self.beats.values()]:
                t.cancel()

    async def leave(self) -> None:
        """Spot notice: busy members stop at a step boundary (commits flushed); leases released."""
        busy = {mid for g in self.sched.groups.values() for mid in g.members}
        for rid in list(self.sched.requests):  # nothing forms again; the leases go back below
            self.sched.cancel(rid)  # (its Leave commands: the WorkerStop below does the same)

        async def stop_one(h: WorkerHandle) -> None:
            try:
                if h.alive and h.rpc is not None:
                    await h.rpc.call(m.WorkerStop(), timeout=self.rt.worker_stop_s)
            except SpotlightError as e:
                log.warning("%s did not stop cleanly: %s", h.worker_id, e)

        async with asyncio.TaskGroup() as tg:
            for mid in busy:
                tg.create_task(stop_one(self.handles[mid]))
        async with asyncio.TaskGroup() as tg:
            for lease in list(self.leases.values()):
                tg.create_task(self.agent.release(self.pull_id, lease))

    # --- the pull loop -----------------------------------------------------------------------------
    async def _pull_loop(self) -> None:
        agent, q = self.agent, self.agent.queue
        assert q is not None
        leaving = asyncio.ensure_future(agent.leaving.wait())
        try:
            while not agent.leaving.is_set():
                self.changed.clear()
                if self.sched.idle() - self.rt.sp_degree * len(self.sched.pending) < self.rt.sp_degree:
                    changed = asyncio.ensure_future(self.changed.wait())
                    await asyncio.wait([changed, leaving], return_when=asyncio.FIRST_COMPLETED)
                    changed.cancel()
                    continue
                try:
                    lease = await q.pull(self.pull_id, agent.kinds, max_wait_s=self.rt.pull_wait_s)
                except ActorTimeout as e:
                    await agent.queue_silent(e)
                    continue
                agent.last_contact = asyncio.get_running_loop().time()
                if lease is None:
                    continue
                if agent.leaving.is_set():
                    await agent.release(self.pull_id, lease)
                    return
                self._take(lease)
        finally:
            leaving.cancel()

    def _take(self, lease: m.LeaseGrant) -> None:
        rid = lease.request_id
        if rid in self.leases:  # an older attempt of ours the queue has since re-leased: drop it
            self._drop(rid)
        self.leases[rid] = lease
        assert self._tg is not None
        self.beats[rid] = self._tg.create_task(self._heartbeats(lease), name=f"beat {rid}")
        self._do(self.sched.submit(rid))

    def _drop(self, rid: str) -> None:
        """Forget a request (done, fenced off, or superseded); a running group is told to leave."""
        self.leases.pop(rid, None)
        if (beat := self.beats.pop(rid, None)) is not None and beat is not asyncio.current_task():
            beat.cancel()
        self._do(self.sched.cancel(rid))

    # --- scheduler commands ------------------------------------------------------------------------
    def _do(self, cmds: list) -> None:
        assert self._tg is not None
        for c in cmds:
            if isinstance(c, Form):
                self._form(c)
            elif isinstance(c, Leave) and not self.rt.sp_regroup:  # the cold-restart baseline
                log.warning("restarting %s cold: its group of epoch %d broke", c.member, c.epoch)
                self.killing.add(c.member)
                self._tg.create_task(self.handles[c.member].kill())  # its watcher restarts it
            elif isinstance(c, Leave):
                self._tg.create_task(self._leave_member(self.handles[c.member], c.epoch))
            elif isinstance(c, Kill):
                log.warning("killing %s: %s", c.member, c.reason)
                self.killing.add(c.member)
                self._tg.create_task(self.handles[c.member].kill())  # its watcher restarts it
            elif isinstance(c, Finished):
                result, lease = self.results.pop(c.epoch, None), self.leases.get(c.request_id)
                self._drop(c.request_id)
                if result is not None and lease is not None:
                    self._tg.create_task(self.agent.complete(self.pull_id, lease, result))
        self.resuming &= self.sched.groups.keys()  # broken or finished: no first commit to wait for
        if (self.resuming or self.sched.pending) and not self.sched.shortfall():
            self.restart_now.clear()  # a regroup is under way without the dead member
        else:
            self.restart_now.set()
        self.changed.set()

    def _form(self, c: Form) -> None:
        assert self._tg is not None
        lease = self.leases[c.request_id]
        req = self.sched.requests[c.request_id]
        self.stats["groups"] += 1
        if req.attempts > 1:  # a regroup: resume from the store's newest commit
            self.stats["regroups"] += 1
            if not isinstance(lease.work, m.ExploreWork):
                self.resuming.add(c.epoch)
            lease = dataclasses.replace(lease, resume_step=max(c.resume_step, lease.resume_step or 0))
            log.warning("%s resumes on a new group (epoch %d: %s) from its newest commit (step >= %d)",
                        c.request_id, c.epoch, ", ".join(c.members), lease.resume_step)
        version = lease.work.version
        if isinstance(lease.work, m.ExploreWork):  # alone on rank 0; the others are free now
            h = self.handles[c.members[0]]
            self._tg.create_task(self._run(h, lease, c.epoch, None, self.agent.weights_peer(h, version)))
            for mid in c.members[1:]:
                self._do(self.sched.done(mid, c.epoch))
            return
        port = self.rendezvous.port
        for rank, mid in enumerate(c.members):
            group = m.SpGroup(epoch=c.epoch, rank=rank, size=len(c.members), port=port,
                              members=list(c.members))
            h = self.handles[mid]  # rank 0 is handed first: the others copy from it if nobody holds it
            self._tg.create_task(self._run(h, lease, c.epoch, group, self.agent.weights_peer(h, version)))

    async def _run(self, h: WorkerHandle, lease: m.LeaseGrant, epoch: int, group: m.SpGroup | None,
                   peer: m.WeightsPeer | None) -> None:
        """One member's part of a group's request; its outcome becomes a scheduler event."""
        proc = h.proc
        if h.rpc is None or proc is None:  # died as the group formed: its watcher reports it
            return
        first = group is None or group.rank == 0
        async with asyncio.TaskGroup() as tg:
            run = tg.create_task(self.agent.call_run(h, m.WorkerRun(lease=lease, group=group, peer=peer)))
            died = tg.create_task(proc.wait())
            revoked = tg.create_task(self.agent.cancel_when_revoked(h, lease))  # explorations only
            await asyncio.wait([run, died], return_when=asyncio.FIRST_COMPLETED)
            revoked.cancel()
            if not run.done():  # the process exited: the watcher turns it into `died`
                run.cancel()
                return
            died.cancel()
        outcome, value = run.result()
        if proc.returncode is not None or h.proc is not proc or h.worker_id in self.killing:
            return  # it died (or is being killed): the watcher's `died` counts, and may be
            # restarting it already (leave the new process be)
        if outcome == "ok":
            held = self.leases.get(lease.request_id)
            ours = held is not None and held.attempt == lease.attempt
            if first and epoch not in self.sched.groups and ours:
                # The group broke (another member died) after rank 0 sealed the trajectory: the
                # result stands; the regroup it triggered is called off.
                self._drop(lease.request_id)
                assert self._tg is not None
                self._tg.create_task(self.agent.complete(self.pull_id, lease, value.result))
            elif first:
                self.results[epoch] = value.result
            self._do(self.sched.done(h.worker_id, epoch))
            return
        held = self.leases.get(lease.request_id)
        if outcome == "cancelled":  # its lease was revoked: the queue dropped it already
            if held is not None and held.attempt == lease.attempt:
                self._drop(lease.request_id)
            self._do(self.sched.released(h.worker_id, epoch))
            return
        log.warning("%s left epoch %d of %s: %s: %s", h.worker_id, epoch, lease.request_id, outcome, value)
        req = self.sched.requests.get(lease.request_id)
        # A broken group (a dead or hung peer) or a stop regroups; the request's own failure, a
        # hung worker, or a group that keeps breaking (more re-forms than runtime.max_attempts,
        # e.g. a step that raises every time) is failed on the queue, which retries it or
        # dead-letters it as it does any failing request.
        fail = outcome in ("error", "timeout") or (req is not None and req.attempts > self.rt.max_attempts)
        fail = fail and held is not None and held.attempt == lease.attempt
        if fail:
            self._drop(lease.request_id)  # the group's other members are told to leave
        self._do(self.sched.released(h.worker_id, epoch))
        if fail:
            await self._fail(lease, f"{outcome}: {value}")
        if outcome == "timeout":
            await h.kill()  # hung: its watcher restarts it

    async def _fail(self, lease: m.LeaseGrant, reason: str) -> None:
        assert self.agent.queue is not None
        self.agent.stats["failed"] += 1
        try:
            await self.agent.queue.fail(lease.request_id, lease.attempt, self.pull_id, reason)
        except GONE:
            self.agent.stats["stale"] += 1
        except ActorTimeout as e:  # unreported: the lease expires and the request retries
            log.warning("fail of %s: %s", lease.request_id, e)

    async def _leave_member(self, h: WorkerHandle, epoch: int) -> None:
        try:
            if h.alive and h.rpc is not None:
                await h.rpc.call(m.WorkerLeave(epoch=epoch))
        except SpotlightError as e:  # dead or stuck: the release bound (Kill) covers it
            log.info("leave to %s: %s", h.worker_id, e)

    # --- members come and go -----------------------------------------------------------------------
    async def _watch(self, h: WorkerHandle) -> None:
        """A member's process exit is a scheduler event; the agent restarts it (it joins again)."""
        agent, failed_starts = self.agent, 0
        while True:
            assert h.proc is not None
            code = await h.proc.wait()
            agent.holders.forget(h.worker_id)
            if not failed_starts:
                agent.stats["worker_deaths"] += 1
                log.warning("%s died (exit %s)", h.worker_id, code)
                self._do(self.sched.died(h.worker_id, f"exit {code}"))
                self.killing.discard(h.worker_id)
                commits_at_death = self.first_commits
            await h.kill()  # reap, close its client
            if agent.leaving.is_set():
                return
            if not failed_starts:
                why = await self._restart_gate(commits_at_death)
                if agent.leaving.is_set():
                    return
                log.warning("%s restarting %s", h.worker_id, why)
            try:
                await agent.start_worker(h)
            except SpotlightError as e:  # killed again while starting: retried, as the slots do
                failed_starts += 1
                if failed_starts >= RESTART_TRIES:
                    raise
                log.warning("%s: %s", h.worker_id, e)
                continue
            failed_starts = 0
            self._do(self.sched.join(h.worker_id))

    async def _restart_gate(self, before: int) -> str:
        """Before a dead member's replacement starts: while a broken group's request re-forms
        without it (the survivor and a spare) and has not committed its first step, and no request
        lacks members, wait, at most sp_timeout_s. Returns why the wait ended (for the log line).
        ``before``: the re-formed groups' first commits counted when the member died — on a loaded
        machine the wait can end while the dead process is still being reaped."""
        if self.restart_now.is_set():  # ended already: by a first commit since the death, or never began
            first = self.first_commits > before
            return "after the first commit of the re-formed group" if first else "at once"
        leaving = asyncio.ensure_future(self.agent.leaving.wait())
        gate = asyncio.ensure_future(self.restart_now.wait())
        try:
            await asyncio.wait([gate, leaving], timeout=self.rt.sp_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            gate.cancel()
            leaving.cancel()
        if not self.restart_now.is_set():
            return f"after runtime.sp_timeout_s ({self.rt.sp_timeout_s} s) with a regroup under way"
        if self.sched.shortfall():
            return "now: a request lacks members"
        if self.first_commits > before:
            return "after the first commit of the re-formed group"
        return "after the broken group's request ended"

    async def _tick(self) -> None:
        """Stalled groups break, members stuck past the release bound are killed."""
        every = min(1.0, self.rt.sp_timeout_s / 2)
        while True:
            await asyncio.sleep(every)
            self._do(self.sched.tick())

    async def _heartbeats(self, lease: m.LeaseGrant) -> None:
        q, rid = self.agent.queue, lease.request_id
        assert q is not None
        while True:
            await asyncio.sleep(self.rt.heartbeat_s)
            step = await self._committed(rid)
            try:
                await q.heartbeat(rid, lease.attempt, self.pull_id, step)
                self.agent.last_contact = asyncio.get_running_loop().time()
            except GONE as e:  # another attempt owns it: stop computing it
                self.agent.stats["stale"] += 1
                log.info("heartbeat fenced: %s", e)
                self._drop(rid)
                return
            except ActorTimeout as e:
                log.warning("heartbeat for %s: %s", rid, e)
                await self.agent.queue_silent(e)

    async def _committed(self, rid: str) -> int | None:
        """Rank 0's committed step (asked now) when a group runs ``rid``; else the last known."""
        req = self.sched.requests.get(rid)
        if req is None:
            return None
        g = next((g for g in self.sched.groups.values() if g.request_id == rid), None)
        h = self.handles[g.members[0]] if g is not None else None
        if h is not None and h.rpc is not None:
            try:
                p = await h.rpc.call(m.WorkerStatus())
            except SpotlightError:  # mid-way through a long step, or dying: the watcher sees it
                p = None
            if p is not None and p.request_id == rid and p.committed_step is not None \
                    and p.committed_step > req.committed_step:  # progress only: a stall must show
                if g.epoch in self.resuming:
                    self.resuming.discard(g.epoch)
                    self.first_commits += 1
                self._do(self.sched.committed(g.members[0], g.epoch, p.committed_step))
        return req.committed_step or None
