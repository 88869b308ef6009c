"""The node agent's core: the per-node persistent scheduler that outlives its GPU workers.

The node folder has the actors' shape: this module is the logic (``NodeAgent``), ``service`` the
process shell (``python -m spotlight.actors.node`` / ``spotlight agent``: signals, options,
logging), and the agent's clients of others are ``spotlight.actors.queue.client`` and
``spotlight.actors.worker.client`` (nothing calls an agent: it pulls). The state and lease
operations it shares with its SP groups live below it in ``session``; the SP groups in ``sp``
(scheduled by ``groups``); the weights bookkeeping in ``holders``. Imports go only downwards:
core -> sp -> session -> holders.

``NodeAgent`` promises:
- Registration: it registers with the controller (whose reply names the queue, the tensor store
  and the run's recipe, so a spot node needs only ``--controller``), starts one worker process per
  device (over ipc) and serves the run epoch: one long-poll pull per idle worker (with
  ``runtime.sp_degree`` = d > 1, per idle group of d workers, ``sp``), the lease handed to the
  worker with a weights hint (``WorkerRun.peer``: a worker of this node holding the version, so the
  node fetches each version from the store once), heartbeats carrying the committed step while it
  runs, the result completed on the queue. An exploration whose lease is revoked (its batch
  cancelled) is stopped on its worker after the step in flight.
- A worker whose process exits mid-request has its lease released at once (the request resumes
  elsewhere from its last commit) and is restarted; ``RESTART_TRIES`` failed restarts in a row end
  the agent.
- A spot notice (SIGTERM, or a polled metadata URL in the AWS ``spot/instance-action`` or GCP
  ``instance/preempted`` form) makes it leave within ``runtime.leave_s``: every busy worker
  finishes its step and flushes its commit, every lease is released, workers stop, it deregisters.
  SIGINT is the same clean exit.
- Liveness: it beats to the controller every ``runtime.node_beat_s`` and registers again when the
  controller declared it lost. The queue counts as gone only after ``runtime.queue_lost_s`` of
  silence AND one more unanswered probe (a frozen agent's own freeze is not the queue's silence);
  then it stops serving and waits up to ``queue_lost_s`` for a restarted reserved side (a new run
  epoch) to serve from scratch, else leaves (exit 2, one line).

Every task is owned by a TaskGroup, every remote await has a timeout, and workers die with the
agent (PR_SET_PDEATHSIG) even if it is SIGKILLed. Knows leases, processes and notices; nothing of
models or tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import urllib.error
import urllib.request

from spotlight.actors.config import RuntimeConfig
from spotlight.actors.node.holders import WeightsHolders
from spotlight.actors.node.session import GONE, RESTART_TRIES, AgentConfig, NodeSession
from spotlight.actors.node.sp import GroupServer
from spotlight.actors.procs import announce_ready
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.worker.client import WorkerHandle
from spotlight.comm import messages as m
from spotlight.comm.auth import cluster_client_keys
from spotlight.comm.transport import RpcClient
from spotlight.errors import (
    ActorTimeout,
    ConfigError,
    NotFound,
    SpotlightError,
)

log = logging.getLogger(__name__)


def spot_notice(url: str, timeout: float) -> str | None:
    """Poll a metadata endpoint once; the notice text, or None. AWS: 200 + JSON body is a
    notice, 404 is none. GCP: body "TRUE" is a notice ("FALSE" none). Unreachable = none."""
    req = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})  # GCP requires it
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read(4096).decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        if e.code != 404:
            log.warning("metadata %s: HTTP %d", url, e.code)
        return None
    except (urllib.error.URLError, OSError) as e:
        log.debug("metadata %s unreachable: %s", url, e)
        return None
    if body.upper() == "TRUE":
        return "gcp preempted"
    if body.startswith("{"):
        try:
            return f"aws {json.loads(body).get('action', 'notice')}"
        except ValueError:
            return None
    return None


class NodeAgent(NodeSession):
    """Use as ``await NodeAgent(config).run(notice)``: serves until ``notice`` is set (or a
    metadata notice arrives), then leaves cleanly."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__(config)
        self.busy: dict[str, m.LeaseGrant] = {}  # worker_id -> the lease it runs
        self._notice: asyncio.Event | None = None  # run()'s: set to leave
        self._notice_at: float | None = None  # loop time of the notice that made it leave
        self._ctl: RpcClient | None = None
        self._epoch = 0  # the reserved side's run epoch this node serves
        self._announced = False
        self._next: m.Registered | None = None  # a restarted run found by a heartbeat

    # --- lifetime ------------------------------------------------------------------------------
    async def run(self, notice: asyncio.Event) -> None:
        c = self.config
        self._notice = notice
        sock_dir = tempfile.mkdtemp(prefix="spl-agent-")
        try:
            curve = cluster_client_keys(c.keys) if c.keys else None
            async with RpcClient(c.controller, timeout=self.runtime.rpc_timeout_s, curve=curve) as ctl:
                self._ctl = ctl
                reg = await self._join(ctl)
                while reg is not None:  # one session per run epoch of the reserved side
                    await self._session(reg, sock_dir, curve, notice)
                    reg, self._next = self._next, None
                    if reg is None and self.lost is not None and not notice.is_set():
                        reg = await self._wait_for_reserved(ctl, self._epoch)
                if self.lost is not None:
                    log.error("%s", self.lost)
                try:
                    await ctl.call(m.Deregister(node_id=c.node_id, reason="leaving"),
                                   timeout=self.runtime.deregister_s)
                except SpotlightError as e:
                    log.info("deregister: %s", e)
                if self._notice_at is not None:  # the leave budget is runtime.leave_s
                    log.warning("node %s left %.2f s after the notice", c.node_id,
                                asyncio.get_running_loop().time() - self._notice_at)
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)

    async def _join(self, ctl: RpcClient) -> m.Registered:
        """The first registration. A reserved side still starting (its controller not listening
        yet, slow on a loaded machine) is asked again for up to ``queue_lost_s``."""
        c, loop = self.config, asyncio.get_running_loop()
        deadline = loop.time() + self.runtime.queue_lost_s
        while True:
            try:
                return await ctl.call(m.Register(node_id=c.node_id, kind=c.kind, workers=c.workers))
            except ActorTimeout as e:
                if loop.time() >= deadline:  # one line that says what to check
                    raise ActorTimeout(
                        f"{e} (no answer for {self.runtime.queue_lost_s:g}s: is the reserved side up at "
                        f"this address, and does it accept this node's key?)"
                    ) from None
                log.warning("%s; asking again (the reserved side may still be starting)", e)

    async def _session(self, reg: m.Registered, sock_dir: str, curve, notice: asyncio.Event) -> None:
        """Serve one run epoch of the reserved side: its queue, its store, fresh workers."""
        c = self.config
        self.runtime = RuntimeConfig(**{**reg.recipe.get("runtime", {}), **c.runtime})
        try:  # the run's sp_degree and device are learnt here: a node that cannot serve leaves at once
            self.runtime.check_node_workers(c.workers, f"node {c.node_id}'s workers")
            if (device := reg.recipe.get("run", {}).get("device", "auto")) != "auto":
                from spotlight.parallel.device import resolve_device

                resolve_device(device)  # 'cuda' on a node without one: one line, not a worker's traceback
        except ConfigError:
            assert self._ctl is not None
            with contextlib.suppress(SpotlightError):
                await self._ctl.call(m.Deregister(node_id=c.node_id, reason="leaving"),
                                     timeout=self.runtime.deregister_s)
            raise
        # Workers run by the same knobs (their leave share, their store timeout).
        self.store, self._epoch = reg.store, reg.epoch
        self.recipe = {**reg.recipe, "runtime": dataclasses.asdict(self.runtime)}
        self.lost, self._session_end = None, asyncio.Event()
        self.leaving.clear()
        self.last_contact = asyncio.get_running_loop().time()
        async with RpcClient(reg.queue, timeout=self.runtime.rpc_timeout_s, curve=curve) as qrpc:
            self.queue = QueueClient.remote(qrpc)
            self.workers = [WorkerHandle(i, c.node_id, sock_dir) for i in range(c.workers)]
            self.holders = WeightsHolders(self.runtime.worker_versions)
            try:
                async with asyncio.TaskGroup() as life:  # beats from registration on
                    beat = life.create_task(self._beat_controller(), name="node beat")
                    starting = life.create_task(self._start_all())
                    noticed = life.create_task(notice.wait())
                    await asyncio.wait([starting, noticed], return_when=asyncio.FIRST_COMPLETED)
                    noticed.cancel()
                    if not starting.done():  # a notice while the workers load: leave now
                        log.warning("node %s leaving during start-up (spot notice or shutdown)", c.node_id)
                        starting.cancel()
                        beat.cancel()
                        return
                    if not self._announced:
                        announce_ready(f"agent ready {c.node_id} workers={c.workers}")
                        self._announced = True
                    await self._serve(notice)
                    beat.cancel()
            finally:
                await self._stop_workers()

    async def _wait_for_reserved(self, ctl: RpcClient, epoch: int) -> m.Registered | None:
        """The queue is gone. Wait up to ``queue_lost_s`` for the reserved side to come back (a
        restart with ``--resume`` behind the same controller address) and register with it; None
        (leave) when it does not, or when the same run answers (its queue alone is gone)."""
        c, rt, loop = self.config, self.runtime, asyncio.get_running_loop()
        assert self._notice is not None
        deadline = loop.time() + rt.queue_lost_s
        log.warning("%s; waiting up to %.0f s for the reserved side to come back", self.lost, rt.queue_lost_s)
        while (left := deadline - loop.time()) > 0 and not self._notice.is_set():
            try:
                reg = await ctl.call(m.Register(node_id=c.node_id, kind=c.kind, workers=c.workers),
                                     timeout=min(rt.rpc_timeout_s, left))
            except SpotlightError as e:
                log.info("register with a restarted reserved side: %s", e)
                with contextlib.suppress(TimeoutError):  # a refusal comes back at once: pace the retries
                    await asyncio.wait_for(self._notice.wait(), min(rt.pull_wait_s, max(left, 0.0)))
                continue
            if reg.epoch == epoch:
                self.lost += "; the same run answered without its queue"
                return None
            log.warning("node %s joins the restarted run (epoch %d, was %d)", c.node_id, reg.epoch, epoch)
            return reg
        self.lost += f"; the reserved side did not come back within {rt.queue_lost_s:.0f}s"
        return None

    async def _serve(self, notice: asyncio.Event) -> None:
        c = self.config
        groups = None
        async with asyncio.TaskGroup() as tg:
            if self.runtime.sp_degree > 1:  # the unit of work is a group of workers
                groups = GroupServer(self)
                slots = [tg.create_task(groups.serve(), name="sp groups")]
            else:
                slots = [tg.create_task(self._slot(h), name=f"slot {h.worker_id}") for h in self.workers]
            watch = tg.create_task(self._watch_metadata(notice)) if c.metadata_url else None
            ends = [tg.create_task(notice.wait()), tg.create_task(self._session_end.wait())]
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
            for t in ends:
                t.cancel()
            self.leaving.set()
            if watch is not None:
                watch.cancel()
            if self.lost is not None and not notice.is_set():  # the queue is gone: nothing to release
                log.warning("node %s stops serving: %s", c.node_id, self.lost)
            else:
                log.warning("node %s leaving (spot notice or shutdown signal)", c.node_id)
                self._notice_at = asyncio.get_running_loop().time()
                await (self._leave() if groups is None else groups.leave())
            # Slots finish their pull (<= pull_wait_s) and release what it brought.
            _, pending = await asyncio.wait(slots, timeout=self.runtime.pull_return_s)
            for t in pending:
                t.cancel()

    async def _leave(self) -> None:
        """Stop busy workers at a step boundary (their commits flushed), release every lease."""
        budget = self.runtime.worker_stop_s

        async def stop_one(h: WorkerHandle) -> None:
            try:
                if h.alive and h.rpc is not None:
                    await h.rpc.call(m.WorkerStop(), timeout=budget)
            except SpotlightError as e:
                log.warning("%s did not stop cleanly: %s", h.worker_id, e)
            lease = self.busy.get(h.worker_id)
            if lease is not None:
                await self.release(h.worker_id, lease)

        async with asyncio.TaskGroup() as tg:
            for h in self.workers:
                if h.worker_id in self.busy:
                    tg.create_task(stop_one(h))

    async def _stop_workers(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for h in self.workers:
                tg.create_task(h.stop(grace_s=self.runtime.worker_kill_s))

    async def _start_all(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for h in self.workers:
                tg.create_task(self.start_worker(h))

    # --- the pull loop -------------------------------------------------------------------------
    async def _slot(self, h: WorkerHandle) -> None:
        q = self.queue
        assert q is not None
        # Owns this slot's completes: each overlaps the next pull (one round trip per request saved).
        failed_starts = 0
        async with asyncio.TaskGroup() as completes:
            while not self.leaving.is_set():
                if not h.alive:
                    await h.kill()
                    self.holders.forget(h.worker_id)
                    self.stats["worker_deaths"] += 1
                    log.warning("%s died (exit %s); restarting", h.worker_id,
                                h.proc.returncode if h.proc else None)
                    try:
                        await self.start_worker(h)
                        failed_starts = 0
                    except SpotlightError as e:  # killed again while starting: the next turn retries
                        failed_starts += 1
                        if failed_starts >= RESTART_TRIES:
                            raise
                        log.warning("%s: %s", h.worker_id, e)
                    continue
                try:
                    lease = await q.pull(h.worker_id, self.kinds, max_wait_s=self.runtime.pull_wait_s)
                except ActorTimeout as e:
                    await self.queue_silent(e)
                    continue
                self.last_contact = asyncio.get_running_loop().time()
                if lease is None:
                    continue
                if self.leaving.is_set():
                    await self.release(h.worker_id, lease)
                    return
                await self._run_lease(h, lease, completes)

    async def _beat_controller(self) -> None:
        """Tell the controller this node is alive; register again if it declared the node lost."""
        c, ctl = self.config, self._ctl
        assert ctl is not None
        while True:
            await asyncio.sleep(self.runtime.node_beat_s)
            try:  # a slow reply is waited for one beat period at most: the cadence holds
                await ctl.call(m.NodeBeat(node_id=c.node_id), timeout=self.runtime.node_beat_s)
            except NotFound:
                log.warning("the controller declared node %s lost; registering again", c.node_id)
                try:
                    reg = await ctl.call(m.Register(node_id=c.node_id, kind=c.kind, workers=c.workers))
                except ActorTimeout as e:
                    log.warning("register again: %s", e)
                    continue
                if reg.epoch != self._epoch:  # a restarted reserved side: serve it from scratch
                    log.warning("node %s joins the restarted run (epoch %d, was %d)", c.node_id, reg.epoch,
                                self._epoch)
                    self._next = reg
                    self.lost = "the reserved side restarted"
                    self._session_end.set()
                    return
            except ActorTimeout as e:  # a late reply (a busy controller); the beat itself arrived
                log.info("node heartbeat: %s", e)

    async def _run_lease(self, h: WorkerHandle, lease: m.LeaseGrant, completes: asyncio.TaskGroup) -> None:
        q = self.queue
        assert q is not None and h.rpc is not None and h.proc is not None
        self.busy[h.worker_id] = lease
        try:
            peer = self.weights_peer(h, lease.work.version)
            async with asyncio.TaskGroup() as tg:
                run = tg.create_task(self.call_run(h, m.WorkerRun(lease=lease, peer=peer)))
                died = tg.create_task(h.proc.wait())
                beat = tg.create_task(self._heartbeats(h, lease))
                revoked = tg.create_task(self.cancel_when_revoked(h, lease))
                await asyncio.wait([run, died], return_when=asyncio.FIRST_COMPLETED)
                beat.cancel()
                revoked.cancel()
                if not run.done():  # the worker process exited mid-request
                    run.cancel()
                    log.warning("%s died running %s; releasing its lease", h.worker_id, lease.request_id)
                    await self.release(h.worker_id, lease)
                    return
                died.cancel()
            outcome, value = run.result()
            if outcome == "ok":
                completes.create_task(self.complete(h.worker_id, lease, value.result))
            elif outcome == "preempted":
                await self.release(h.worker_id, lease)
            elif outcome != "cancelled":  # (cancelled: its lease is gone already, nothing to tell)
                self.stats["failed"] += 1
                log.warning("%s failed %s: %s", h.worker_id, lease.request_id, value)
                try:
                    await q.fail(lease.request_id, lease.attempt, h.worker_id, f"{outcome}: {value}")
                except GONE:
                    self.stats["stale"] += 1
                except ActorTimeout as e:  # unreported: the lease expires and the request retries
                    log.warning("fail of %s: %s", lease.request_id, e)
                if outcome == "timeout":
                    await h.kill()  # hung: the slot restarts it
        finally:
            self.busy.pop(h.worker_id, None)

    async def _heartbeats(self, h: WorkerHandle, lease: m.LeaseGrant) -> None:
        q, every = self.queue, self.runtime.heartbeat_s
        assert q is not None and h.rpc is not None
        while True:
            await asyncio.sleep(every)
            try:
                step = (await h.rpc.call(m.WorkerStatus())).committed_step
            except ActorTimeout:  # mid-way through a long step: alive (death is watched apart)
                step = None
            try:
                await q.heartbeat(lease.request_id, lease.attempt, h.worker_id, step)
                self.last_contact = asyncio.get_running_loop().time()
            except GONE as e:
                self.stats["stale"] += 1
                log.info("heartbeat fenced: %s", e)
                return
            except ActorTimeout as e:  # a slow step or a slow queue: try again next beat
                log.warning("heartbeat for %s: %s", lease.request_id, e)
                await self.queue_silent(e)  # a busy node learns of a gone queue here, not by pulls

    async def _watch_metadata(self, notice: asyncio.Event) -> None:
        c, rt = self.config, self.runtime
        assert c.metadata_url is not None
        while True:
            text = await asyncio.to_thread(spot_notice, c.metadata_url, rt.metadata_timeout_s)
            if text is not None:
                log.warning("spot notice from %s: %s", c.metadata_url, text)
                notice.set()
                return
            await asyncio.sleep(rt.metadata_poll_s)
