"""The node agent: the per-node persistent scheduler that outlives its GPU workers.

- ``NodeAgent``: registers with the controller (whose reply names the queue, the tensor store,
  the lease length and the recipe, so a spot node needs only ``--controller``), starts one worker
  process per device (``python -m spotlight.actors.worker``, over ipc), and runs the node's pull
  loop: one long-poll pull per idle worker, the lease handed to that worker, heartbeats (with the
  worker's committed step) forwarded while it runs, the result completed on the queue. With
  ``runtime.sp_degree`` = d > 1 the unit is a group of d workers instead of one worker
  (``spotlight.actors.node.sp``: the same queue, leases, commits and notices).
  A worker whose process exits mid-request has its lease released at once, so the request
  resumes elsewhere from its last commit, and the worker is restarted.
- Weights on the node: every lease goes to its worker with a hint (``WorkerRun.peer``), a worker
  of this node that holds or is loading the lease's weights version (``WeightsHolders``, the
  agent's record of what it handed to whom), so the worker copies it from that neighbour through
  shared memory and the node fetches each version from the store once (``runtime.peer_weights``).
- A spot notice (SIGTERM, or a polled metadata URL in the AWS ``spot/instance-action`` or GCP
  ``instance/preempted`` form) makes the agent leave: every busy worker finishes its current step
  and flushes its commit, every lease is released, workers are stopped, the agent exits — within
  ``runtime.leave_s`` (``spotlight.actors.config``). SIGINT is the same clean exit.
- Liveness: the agent beats to the controller every ``runtime.node_beat_s`` (``NodeBeat``); a
  controller that declared it lost (silent past ``runtime.node_lost_s``: frozen, cut off) gets a
  fresh registration. A pull that times out only means the queue is gone once the queue has been
  silent ``runtime.queue_lost_s`` AND one more probe goes unanswered: an agent frozen by SIGSTOP
  (or a long GC or swap stall) sees every timer fire at once on SIGCONT, and must not count its
  own freeze as the queue's silence. A node whose queue is gone stops serving (its workers are
  stopped) and keeps asking the controller for up to ``queue_lost_s``: a reserved side restarted
  with ``--resume`` behind the same address (a new run epoch in ``Registered``) is served from
  scratch; otherwise the node leaves (exit 2, one line).
- ``main``: the process shell (``python -m spotlight.actors.node`` / ``spotlight agent``).

Every task is owned by a TaskGroup, every remote await has a timeout, and workers die with the
agent (PR_SET_PDEATHSIG) even if it is SIGKILLed.

This module knows leases, processes and notices; it knows nothing of models or tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from spotlight.actors.config import NODE_FIELDS, RuntimeConfig
from spotlight.actors.node.holders import WeightsHolders
from spotlight.actors.procs import announce_ready
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.worker.client import WorkerHandle
from spotlight.comm import messages as m
from spotlight.comm.auth import cluster_client_keys
from spotlight.comm.transport import RpcClient
from spotlight.errors import (
    ActorTimeout,
    Cancelled,
    ConfigError,
    NotFound,
    Preempted,
    SpotlightError,
    StaleAttempt,
)

# A message about a lease the queue no longer honours: another attempt owns the request
# (StaleAttempt) or its iteration is finished and forgotten (NotFound). Counted, never fatal.
GONE = (StaleAttempt, NotFound)
RESTART_TRIES = 3
"""A dead worker's restarts that may fail in a row (killed again while it loads) before the
agent gives up on it and exits (a worker that can never start is a broken node)."""

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """One node agent: where it joins, what it runs. Its timing knobs are the run's ``[runtime]``
    (``RuntimeConfig``), which the controller sends at registration; ``runtime`` overrides the
    ones a node may set for itself (``NODE_FIELDS``: timeouts, the leave budget, polls)."""

    controller: str
    """Controller endpoint (tcp://HOST:PORT or ipc://PATH)."""
    workers: int = 1
    """Worker processes to run (one per GPU; on CPU, as configured)."""
    kind: str = "spot"
    """'reserved' or 'spot' (reported to the controller)."""
    node_id: str = ""
    """This node's name in the run (default: hostname-pid)."""
    metadata_url: str | None = None
    """Spot-notice URL to poll (AWS .../spot/instance-action or GCP .../instance/preempted)."""
    keys: str | None = None
    """CURVE folder: this node's node.key_secret and the reserved side's controller.key (used for
    the controller, the queue and the store)."""
    log_dir: str | None = None
    """Folder of this node's measurement logs: its workers append every denoising step they compute
    to ``steps.log`` and every weights version they load to ``weights.log`` (None: not written)."""
    runtime: dict[str, Any] = field(default_factory=dict)
    """This node's own values of ``RuntimeConfig`` fields named in ``NODE_FIELDS``."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"AgentConfig.workers must be >= 1, got {self.workers}")
        if self.kind not in ("reserved", "spot"):
            raise ConfigError(f"AgentConfig.kind must be 'reserved' or 'spot', got {self.kind!r}")
        if unknown := set(self.runtime) - set(NODE_FIELDS):
            raise ConfigError(f"AgentConfig.runtime: a node cannot set {sorted(unknown)}; "
                              f"it may set {', '.join(NODE_FIELDS)}")
        RuntimeConfig(**self.runtime)  # validated now, not at registration
        self.node_id = self.node_id or f"{socket.gethostname()}-{os.getpid()}"


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


class NodeAgent:
    """Use as ``await NodeAgent(config).run(notice)``: serves until ``notice`` is set (or a
    metadata notice arrives), then leaves cleanly."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.runtime = RuntimeConfig(**config.runtime)
        """The runtime knobs in force: the run's (from registration) with this node's overrides."""
        self.leaving = asyncio.Event()
        self.workers: list[WorkerHandle] = []
        self.busy: dict[str, m.LeaseGrant] = {}  # worker_id -> the lease it runs
        self.holders = WeightsHolders(self.runtime.worker_versions)  # who holds which version
        self._released: set[tuple[str, int]] = set()
        self.queue: QueueClient | None = None
        self.lost: str | None = None
        """Why the agent left on its own (the queue unreachable), or None."""
        self._notice: asyncio.Event | None = None  # run()'s: set to leave
        self._last_contact = 0.0  # loop time of the queue's last answer
        self._notice_at: float | None = None  # loop time of the notice that made it leave
        self._ctl: RpcClient | None = None
        self._epoch = 0  # the reserved side's run epoch this node serves
        self._session_end = asyncio.Event()  # set when the queue is found gone
        self._announced = False
        self._next: m.Registered | None = None  # a restarted run found by a heartbeat
        self.stats = {"completed": 0, "failed": 0, "released": 0, "worker_deaths": 0, "stale": 0,
                      "cancelled": 0}

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
        self._last_contact = asyncio.get_running_loop().time()
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

    @property
    def kinds(self) -> list[str]:
        """The request kinds this node's workers pull (``runtime.explore_on``)."""
        if self.config.kind == "reserved" and self.runtime.explore_on == "spot":
            return ["rollout"]
        return ["rollout", "explore"]

    async def _serve(self, notice: asyncio.Event) -> None:
        c = self.config
        groups = None
        async with asyncio.TaskGroup() as tg:
            if self.runtime.sp_degree > 1:  # the unit of work is a group of workers
                from spotlight.actors.node.sp import GroupServer

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
                await self._release(h.worker_id, lease)

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
                tg.create_task(self._start(h))

    async def _start(self, h: WorkerHandle) -> None:
        rt = self.runtime
        await h.start(self.store, self.recipe, rt.worker_start_s, rt.rpc_timeout_s, self.config.keys,
                      self.config.log_dir)

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
                        await self._start(h)
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
                    await self._queue_silent(e)
                    continue
                self._last_contact = asyncio.get_running_loop().time()
                if lease is None:
                    continue
                if self.leaving.is_set():
                    await self._release(h.worker_id, lease)
                    return
                await self._run_lease(h, lease, completes)

    async def _queue_silent(self, e: ActorTimeout) -> None:
        """A pull timed out. Once the queue has been silent for ``queue_lost_s`` the reserved
        side is gone (or cut off): leave cleanly instead of pulling forever. Before concluding,
        ask the queue once more: after a freeze (SIGSTOP, a GC or swap stall) every timeout fires
        at once and the silence measured is this process's own."""
        loop = asyncio.get_running_loop()
        log.warning("queue did not answer: %s", e)
        if loop.time() - self._last_contact < self.runtime.queue_lost_s or self.lost is not None:
            return
        assert self.queue is not None
        try:
            await self.queue.stats()
        except ActorTimeout:
            pass
        else:
            log.warning("the queue answered after %.1f s without a reply (this agent was frozen or "
                        "slow); staying", loop.time() - self._last_contact)
            self._last_contact = loop.time()
            return
        now = loop.time()
        if self.lost is None and not self.leaving.is_set():
            self.lost = f"the request queue has not answered for {now - self._last_contact:.0f}s; node left"
            self._session_end.set()

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

    async def _complete(self, worker_id: str, lease: m.LeaseGrant, result: m.WorkResult) -> None:
        assert self.queue is not None
        try:
            await self.queue.complete(lease.request_id, lease.attempt, worker_id, result)
            self.stats["completed"] += 1
        except GONE as e:  # fenced: another attempt owns it now, or it is long done
            self.stats["stale"] += 1
            log.info("%s", e)
        except ActorTimeout as e:  # the lease expires and the request runs again: at-least-once
            log.warning("complete of %s: %s", lease.request_id, e)

    async def _run_lease(self, h: WorkerHandle, lease: m.LeaseGrant, completes: asyncio.TaskGroup) -> None:
        q = self.queue
        assert q is not None and h.rpc is not None and h.proc is not None
        self.busy[h.worker_id] = lease
        try:
            peer = self.weights_peer(h, lease.work.version)
            async with asyncio.TaskGroup() as tg:
                run = tg.create_task(self._call_run(h, lease, peer))
                died = tg.create_task(h.proc.wait())
                beat = tg.create_task(self._heartbeats(h, lease))
                revoked = tg.create_task(self.cancel_when_revoked(h, lease))
                await asyncio.wait([run, died], return_when=asyncio.FIRST_COMPLETED)
                beat.cancel()
                revoked.cancel()
                if not run.done():  # the worker process exited mid-request
                    run.cancel()
                    log.warning("%s died running %s; releasing its lease", h.worker_id, lease.request_id)
                    await self._release(h.worker_id, lease)
                    return
                died.cancel()
            outcome, value = run.result()
            if outcome == "ok":
                completes.create_task(self._complete(h.worker_id, lease, value.result))
            elif outcome == "preempted":
                await self._release(h.worker_id, lease)
            elif outcome == "cancelled":  # its lease is gone already: nothing to tell the queue
                self.stats["cancelled"] += 1
                log.info("%s", value)
            else:
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

    def weights_peer(self, h: WorkerHandle, version: int) -> m.WeightsPeer | None:
        """The live worker of this node that ``h`` should copy weights ``version`` from (None: the
        store), and ``h`` recorded as holding it from now on (``WeightsHolders``)."""
        peer = None
        if self.runtime.peer_weights:
            handles = {w.worker_id: w for w in self.workers}
            for wid in self.holders.peers(version, exclude=h.worker_id):
                p = handles.get(wid)
                if p is not None and p.alive and p.proc is not None:
                    peer = m.WeightsPeer(worker=wid, endpoint=p.endpoint, pid=p.proc.pid)
                    break
        self.holders.handed(h.worker_id, version)
        return peer

    async def _call_run(self, h: WorkerHandle, lease: m.LeaseGrant, peer: m.WeightsPeer | None = None):
        """The worker's answer as (outcome, value), so a failure is data for the slot to act on."""
        try:
            return "ok", await h.rpc.call(m.WorkerRun(lease=lease, peer=peer),
                                          timeout=self.runtime.request_timeout_s)
        except Preempted as e:
            return "preempted", e
        except Cancelled as e:
            return "cancelled", e
        except ActorTimeout as e:
            return "timeout", e
        except SpotlightError as e:
            return "error", e

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
                self._last_contact = asyncio.get_running_loop().time()
            except GONE as e:
                self.stats["stale"] += 1
                log.info("heartbeat fenced: %s", e)
                return
            except ActorTimeout as e:  # a slow step or a slow queue: try again next beat
                log.warning("heartbeat for %s: %s", lease.request_id, e)
                await self._queue_silent(e)  # a busy node learns of a gone queue here, not by pulls

    async def cancel_when_revoked(self, h: WorkerHandle, lease: m.LeaseGrant) -> None:
        """While ``h`` runs an exploration ``lease``: long-poll the queue for the lease's revocation
        (its batch cancelled at the exploration's deadline) and tell the worker to stop it
        (``WorkerCancel``), so the worker is free for the next request after the step in flight
        instead of computing a result the queue would refuse. Rollouts are not watched: a revoked
        rollout lease is seen by its heartbeat and its work resumes from its commits. The caller
        cancels this task when the run ends."""
        q = self.queue
        if not isinstance(lease.work, m.ExploreWork) or q is None:
            return
        while True:
            try:
                if await q.wait_revoked(lease.request_id, lease.attempt, self.runtime.pull_wait_s):
                    break
            except ActorTimeout as e:  # a slow queue: the heartbeats judge whether it is gone
                log.info("revocation watch of %s: %s", lease.request_id, e)
        try:
            if h.rpc is not None:
                await h.rpc.call(m.WorkerCancel(request_id=lease.request_id, attempt=lease.attempt))
        except SpotlightError as e:  # dead or stuck: its watcher and the request timeout cover it
            log.info("cancel to %s: %s", h.worker_id, e)

    async def _release(self, worker_id: str, lease: m.LeaseGrant) -> None:
        key = (lease.request_id, lease.attempt)
        if key in self._released:
            return
        self._released.add(key)
        assert self.queue is not None
        try:
            await self.queue.release(lease.request_id, lease.attempt, worker_id)
            self.stats["released"] += 1
        except (*GONE, ActorTimeout) as e:  # expired meanwhile: the queue re-queued it
            log.info("release of %s: %s", lease.request_id, e)

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
