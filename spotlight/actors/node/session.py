"""What a node agent serves with during one session of the reserved side, and the lease operations
both of its ways of serving share: the one-slot-per-worker pull loop (``spotlight.actors.node.core``)
and the SP groups (``spotlight.actors.node.sp``).

- ``AgentConfig``: where the node joins and what it runs (its CLI options are generated from it).
- ``NodeSession``: the session's state (runtime knobs in force, workers, the queue client, the
  weights holders, counters) and the operations on a lease: complete, release (once per attempt),
  judge a silent queue, name a weights peer, start a worker, and stop an exploration whose lease
  was revoked. ``NodeAgent`` is a ``NodeSession`` that also owns the lifetime (registration,
  sessions, beats, notices).

Invariants: a lease is released at most once per attempt; a message the queue refuses as stale or
unknown (``GONE``) is counted, never fatal; every remote await has a timeout.

Knows leases, worker processes and the queue's client; nothing of models or tensors. Imports only
downwards (the actors' clients, config, messages): ``core`` and ``sp`` import this module, never
the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from spotlight.actors.config import NODE_FIELDS, RuntimeConfig
from spotlight.actors.node.holders import WeightsHolders
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.worker.client import WorkerHandle
from spotlight.comm import messages as m
from spotlight.errors import (
    ActorTimeout,
    Cancelled,
    ConfigError,
    GroupBroken,
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


class NodeSession:
    """A node's state while it serves one run epoch, and the lease operations on it."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.runtime = RuntimeConfig(**config.runtime)
        """The runtime knobs in force: the run's (from registration) with this node's overrides."""
        self.store, self.recipe = "", {}  # the store's endpoint and the run's recipe (registration)
        self.leaving = asyncio.Event()
        self.workers: list[WorkerHandle] = []
        self.holders = WeightsHolders(self.runtime.worker_versions)  # who holds which version
        self.queue: QueueClient | None = None
        self.lost: str | None = None
        """Why the agent left on its own (the queue unreachable), or None."""
        self.last_contact = 0.0  # loop time of the queue's last answer
        self._session_end = asyncio.Event()  # set when the queue is found gone
        self._released: set[tuple[str, int]] = set()
        self.stats = {"completed": 0, "failed": 0, "released": 0, "worker_deaths": 0, "stale": 0,
                      "cancelled": 0}

    @property
    def kinds(self) -> list[str]:
        """The request kinds this node's workers pull (``runtime.explore_on``)."""
        if self.config.kind == "reserved" and self.runtime.explore_on == "spot":
            return ["rollout"]
        return ["rollout", "explore"]

    async def start_worker(self, h: WorkerHandle) -> None:
        rt = self.runtime
        await h.start(self.store, self.recipe, rt.worker_start_s, rt.rpc_timeout_s, self.config.keys,
                      self.config.log_dir)

    async def queue_silent(self, e: ActorTimeout) -> None:
        """A pull timed out. Once the queue has been silent for ``queue_lost_s`` the reserved
        side is gone (or cut off): leave cleanly instead of pulling forever. Before concluding,
        ask the queue once more: after a freeze (SIGSTOP, a GC or swap stall) every timeout fires
        at once and the silence measured is this process's own."""
        loop = asyncio.get_running_loop()
        log.warning("queue did not answer: %s", e)
        if loop.time() - self.last_contact < self.runtime.queue_lost_s or self.lost is not None:
            return
        assert self.queue is not None
        try:
            await self.queue.stats()
        except ActorTimeout:
            pass
        else:
            log.warning("the queue answered after %.1f s without a reply (this agent was frozen or "
                        "slow); staying", loop.time() - self.last_contact)
            self.last_contact = loop.time()
            return
        now = loop.time()
        if self.lost is None and not self.leaving.is_set():
            self.lost = f"the request queue has not answered for {now - self.last_contact:.0f}s; node left"
            self._session_end.set()

    async def complete(self, worker_id: str, lease: m.LeaseGrant, result: m.WorkResult) -> None:
        assert self.queue is not None
        try:
            await self.queue.complete(lease.request_id, lease.attempt, worker_id, result)
            self.stats["completed"] += 1
        except GONE as e:  # fenced: another attempt owns it now, or it is long done
            self.stats["stale"] += 1
            log.info("%s", e)
        except ActorTimeout as e:  # the lease expires and the request runs again: at-least-once
            log.warning("complete of %s: %s", lease.request_id, e)

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

    async def call_run(self, h: WorkerHandle, msg: m.WorkerRun) -> tuple[str, Any]:
        """``msg`` run on ``h``; its answer as ``(outcome, value)`` so that a failure is data for
        the caller to act on: ``"ok"`` (the ``WorkerDone``), ``"preempted"`` (a spot notice, or its
        SP group broke), ``"cancelled"`` (a revoked exploration, stopped after the step in flight;
        counted here, and the worker has logged where it stopped), ``"timeout"`` (no answer within
        ``request_timeout_s``: hung) or ``"error"`` (the request's own failure)."""
        assert h.rpc is not None
        try:
            return "ok", await h.rpc.call(msg, timeout=self.runtime.request_timeout_s)
        except (Preempted, GroupBroken) as e:
            return "preempted", e
        except Cancelled as e:
            self.stats["cancelled"] += 1
            return "cancelled", e
        except ActorTimeout as e:
            return "timeout", e
        except SpotlightError as e:
            return "error", e

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

    async def release(self, worker_id: str, lease: m.LeaseGrant) -> None:
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
