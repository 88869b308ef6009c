"""The request queue: pull-based leases with heartbeats, fencing, capped retries, dead letters.

- ``RequestQueueCore`` (here): the logic, a plain class with an injectable clock (tests use a
  fake one).
- ``QueueService``, ``QueueClient`` (``spotlight.actors.queue.service`` / ``.client``): the process shell with
  the lease-expiry timer, and a client that hides whether the core is local or remote.
- ``python -m spotlight.actors.queue --bind ADDR``: serve until SIGTERM/SIGINT.

Protocol (DESIGN.md §5): a pull returns a lease (request id, attempt, deadline); rollout requests
outrank exploration ones, then FIFO by submission (a re-queued request keeps its place). Heartbeats
extend the lease and record the last committed step. A release (spot notice) re-queues at once and
is not counted toward the retry cap; an expired lease or a ``fail`` is counted, and after
``max_attempts`` counted failures the request is dead-lettered. A node declared lost by the
controller (``release_node``) has every lease its workers hold re-queued at once, uncounted, instead
of waiting out each lease. A re-queued request carries the
last step its worker reported committed (``resume_step``); where that commit lives is the
worker's and the store's business. Results are accepted only from the current attempt (fencing),
exactly once. Requests are grouped in batches named by the submitter (``wait_batch``); a batch can
be cancelled (``cancel_batch``: what has not finished is dropped, queued or leased, and the
batch's results so far are returned — exploration's deadline).

This module knows leases and batches; requests' work and results are opaque typed messages to it
(it reads only the work's ``KIND`` for priority). It knows nothing of tensors, models or the store.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotlight.comm import messages as m
from spotlight.errors import ActorTimeout, NotFound, ProtocolError, StaleAttempt

KINDS = ("rollout", "explore")  # priority order: rollout first
_RESULT = {"rollout": m.RolloutResult, "explore": m.ExploreResult}  # what each kind of work returns


@dataclass(kw_only=True, slots=True)
class QueueConfig:
    lease_s: float = 30.0
    """lease length; a worker must heartbeat more often than this."""
    max_attempts: int = 3
    """counted failures (expiries + fails) before a request is dead-lettered; releases don't count."""

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise ValueError(f"QueueConfig.lease_s must be > 0, got {self.lease_s}")
        if self.max_attempts < 1:
            raise ValueError(f"QueueConfig.max_attempts must be >= 1, got {self.max_attempts}")


@dataclass(slots=True)
class _Request:
    request_id: str
    batch: str
    work: m.Work
    seq: int  # submission order; kept on re-queue so a retried request keeps its place
    state: str = "queued"  # queued | leased | done | dead | cancelled
    attempt: int = 0  # number of the current (or last) lease; 0 before the first
    worker_id: str | None = None
    deadline: float = 0.0
    failures: int = 0
    committed_step: int | None = None
    result: m.WorkResult | None = None

    @property
    def kind(self) -> str:
        return self.work.KIND


class RequestQueueCore:
    """The queue's logic; every method is synchronous except the two ``wait_*`` ones."""

    def __init__(self, config: QueueConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config or QueueConfig(), clock
        self._requests: dict[str, _Request] = {}
        self._ready: dict[str, list[tuple[int, str]]] = {k: [] for k in KINDS}  # heaps by seq
        self._leases: list[tuple[float, str, int]] = []  # heap; stale entries skipped lazily
        self._seq = itertools.count()
        self._batches: dict[str, list[str]] = {}
        self._open: dict[str, int] = {}
        self._batch_done: dict[str, asyncio.Event] = {}
        self._work = asyncio.Event()  # set (and replaced) when work is queued and pulls wait
        self._revoked: dict[tuple[str, int], asyncio.Event] = {}  # (request, attempt) watched -> its event
        self._pullers_waiting = 0
        self.on_deadline: Callable[[float], None] | None = None  # the expiry timer's hook
        self.dead_letters: list[dict[str, Any]] = []
        self.counters = dict.fromkeys(
            ["submitted", "leased", "completed", "released", "expired", "failed", "dead",
             "heartbeats", "late_results_dropped", "stale_rejected", "duplicate_completions",
             "cancelled", "node_lost_requeued"], 0)

    # --- producers --------------------------------------------------------------------------
    def submit(self, requests: list[m.WorkRequest]) -> None:
        """Enqueue requests (all or none: every one is validated first)."""
        seen: set[str] = set()
        for r in requests:
            if not isinstance(r, m.WorkRequest) or not isinstance(r.work, (m.ExploreWork, m.RolloutWork)):
                raise ProtocolError(
                    f"a request must be a WorkRequest with Explore/RolloutWork, got {r!r:.200}"
                )
            rid = r.request_id
            if not isinstance(rid, str) or rid in self._requests or rid in seen:
                raise ProtocolError(f"request_id {rid!r} is not a new str")
            if not isinstance(r.batch, str) or not r.batch:
                raise ProtocolError(f"request {rid}: batch must be a non-empty str, got {r.batch!r}")
            seen.add(rid)
        for r in requests:
            rec = _Request(r.request_id, r.batch, r.work, next(self._seq))
            self._requests[rec.request_id] = rec
            self._batches.setdefault(rec.batch, []).append(rec.request_id)
            self._open[rec.batch] = self._open.get(rec.batch, 0) + 1
            event = self._batch_done.get(rec.batch)
            if event is not None and event.is_set():
                self._batch_done[rec.batch] = asyncio.Event()  # re-opened
            self._enqueue(rec)
        self.counters["submitted"] += len(requests)

    # --- workers ----------------------------------------------------------------------------
    def pull(self, worker_id: str, kinds: tuple[str, ...] | list[str] = KINDS) -> m.LeaseGrant | None:
        grants = self.pull_many(worker_id, kinds, 1)
        return grants[0] if grants else None

    def pull_many(self, worker_id: str, kinds: tuple[str, ...] | list[str], max_n: int) -> list[m.LeaseGrant]:
        """Up to ``max_n`` leases, best first (rollout before explore, then FIFO)."""
        grants: list[m.LeaseGrant] = []
        now, lease_s = self.clock(), self.config.lease_s
        for kind in KINDS:
            heap = self._ready[kind]
            while kind in kinds and heap and len(grants) < max_n:
                rec = self._requests.get(heapq.heappop(heap)[1])
                if rec is None or rec.state != "queued":
                    continue  # cancelled (or forgotten) while queued: its heap entry is dropped here
                rec.state, rec.worker_id, rec.deadline = "leased", worker_id, now + lease_s
                rec.attempt += 1
                self._track_deadline(rec)
                grants.append(
                    m.LeaseGrant(
                        request_id=rec.request_id,
                        attempt=rec.attempt,
                        deadline=rec.deadline,
                        lease_s=lease_s,
                        batch=rec.batch,
                        work=rec.work,
                        resume_step=rec.committed_step,
                    )
                )
        self.counters["leased"] += len(grants)
        return grants

    async def wait_pull(
        self, worker_id: str, kinds: list[str], max_n: int, max_wait_s: float
    ) -> list[m.LeaseGrant]:
        """``pull_many``, waiting up to ``max_wait_s`` (event loop time) for work to appear."""
        grants = self.pull_many(worker_id, kinds, max_n)
        if grants or max_wait_s <= 0:
            return grants
        self._pullers_waiting += 1
        try:
            async with asyncio.timeout(max_wait_s):
                while not grants:
                    await self._work.wait()
                    grants = self.pull_many(worker_id, kinds, max_n)
        except TimeoutError:
            pass
        finally:
            self._pullers_waiting -= 1
        return grants

    def holds(self, request_id: str, attempt: int) -> bool:
        """Whether ``attempt`` is still the current lease of ``request_id``."""
        rec = self._requests.get(request_id)
        return rec is not None and rec.state == "leased" and rec.attempt == attempt

    async def wait_revoked(self, request_id: str, attempt: int, max_wait_s: float) -> bool:
        """True as soon as lease ``attempt`` of ``request_id`` is no longer current (cancelled with
        its batch, expired, released, re-queued with a lost node, or forgotten); False if it still
        is after ``max_wait_s`` (event loop time)."""
        if not self.holds(request_id, attempt):
            return True
        revoked = self._revoked.setdefault((request_id, attempt), asyncio.Event())
        try:
            async with asyncio.timeout(max_wait_s):
                await revoked.wait()
        except TimeoutError:
            return False
        return True

    def heartbeat(
        self, request_id: str, attempt: int, worker_id: str, committed_step: int | None = None
    ) -> m.LeaseExtended:
        rec = self._current(request_id, attempt, worker_id, "heartbeat")
        if committed_step is not None:
            rec.committed_step = committed_step
        rec.deadline = self.clock() + self.config.lease_s
        self._track_deadline(rec)
        self.counters["heartbeats"] += 1
        return m.LeaseExtended(
            request_id=request_id, attempt=attempt, deadline=rec.deadline, lease_s=self.config.lease_s
        )

    def release(self, request_id: str, attempt: int, worker_id: str) -> None:
        """Spot notice: back to the queue at once, not counted toward the retry cap."""
        rec = self._current(request_id, attempt, worker_id, "release")
        self.counters["released"] += 1
        self._enqueue(rec)

    def complete(self, request_id: str, attempt: int, worker_id: str, result: m.WorkResult) -> bool:
        """Record the result; True if accepted now, False for a repeat of the accepted one."""
        rec = self._requests.get(request_id)
        if rec is not None and rec.state == "done" and (rec.attempt, rec.worker_id) == (attempt, worker_id):
            self.counters["duplicate_completions"] += 1  # a resent Complete: exactly-once
            return False
        try:
            rec = self._current(request_id, attempt, worker_id, "complete")
        except StaleAttempt:
            self.counters["late_results_dropped"] += 1
            raise
        if not isinstance(result, _RESULT[rec.kind]):
            raise ProtocolError(
                f"complete {request_id}: a {rec.kind} request returns "
                f"{_RESULT[rec.kind].__name__}, got {type(result).__name__}"
            )
        rec.state, rec.result = "done", result
        self.counters["completed"] += 1
        self._finished(rec)
        return True

    def fail(self, request_id: str, attempt: int, worker_id: str, error: str) -> None:
        rec = self._current(request_id, attempt, worker_id, "fail")
        self.counters["failed"] += 1
        self._count_failure(rec, f"failed: {error}")

    def release_node(self, node_id: str) -> list[str]:
        """Node ``node_id`` was declared lost (silent past ``runtime.node_lost_s``: SIGKILLed, cut
        off): every lease its workers hold (worker ids ``<node_id>/...``, as its agent names them)
        goes back to the queue now, with its last commit, instead of at its expiry. Not counted
        toward the retry cap (losing a spot node is no fault of the request, as with a notice);
        those attempts are fenced off like any stale one, so if the node was only frozen, its late
        heartbeats and results are refused. Returns the re-queued request ids."""
        if not isinstance(node_id, str) or not node_id or "/" in node_id:
            raise ProtocolError(f"release_node: node_id must be a non-empty str without '/', got {node_id!r}")
        prefix = node_id + "/"
        held = [rec for rec in self._requests.values()
                if rec.state == "leased" and rec.worker_id is not None and rec.worker_id.startswith(prefix)]
        for rec in held:
            self._enqueue(rec)
        self.counters["node_lost_requeued"] += len(held)
        return [rec.request_id for rec in held]

    # --- time -------------------------------------------------------------------------------
    def expire_leases(self) -> list[str]:
        """Re-queue (or dead-letter) every lease past its deadline; returns their ids."""
        now, expired = self.clock(), []
        while self._leases and self._leases[0][0] <= now:
            deadline, rid, attempt = heapq.heappop(self._leases)
            if self._live_lease(rid, attempt, deadline):
                rec = self._requests[rid]
                self.counters["expired"] += 1
                expired.append(rid)
                self._count_failure(rec, f"lease expired (worker {rec.worker_id})")
        return expired

    def next_deadline(self) -> float | None:
        """The nearest live lease deadline, or None when nothing is leased."""
        while self._leases:
            deadline, rid, attempt = self._leases[0]
            if self._live_lease(rid, attempt, deadline):
                return deadline
            heapq.heappop(self._leases)  # superseded by a heartbeat, finished, or forgotten
        return None

    def _live_lease(self, rid: str, attempt: int, deadline: float) -> bool:
        """Whether a lease-heap entry is still the request's current lease (entries of renewed,
        finished and forgotten requests stay in the heap and are skipped lazily)."""
        return self.holds(rid, attempt) and self._requests[rid].deadline == deadline

    # --- batches ---------------------------------------------------------------------------
    async def wait_batch(self, batch: str, timeout_s: float | None = None) -> m.BatchDone:
        """Wait until every request of ``batch`` is done or dead; results in submit order."""
        if not self._batch_finished(batch):
            event = self._batch_done.setdefault(batch, asyncio.Event())
            try:
                async with asyncio.timeout(timeout_s):
                    await event.wait()
            except TimeoutError:
                raise ActorTimeout(
                    f"batch {batch}: {self._open.get(batch, 0)} requests still open after {timeout_s}s"
                ) from None
        return self._batch_reply(batch)

    def cancel_batch(self, batch: str) -> m.BatchDone:
        """Drop every request of ``batch`` that is not done: queued ones are never leased, leased
        ones are fenced off (heartbeat, complete and release from their worker are refused as
        stale, so the worker drops the work). Returns the batch's results so far; the batch is
        finished (a waiting ``wait_batch`` returns the same)."""
        if batch not in self._batches:
            raise NotFound(f"cancel: unknown batch {batch!r}")
        for rid in self._batches[batch]:
            rec = self._requests[rid]
            if rec.state in ("queued", "leased"):
                rec.state, rec.worker_id = "cancelled", None
                self.counters["cancelled"] += 1
                self._finished(rec)
        return self._batch_reply(batch)

    def _batch_reply(self, batch: str) -> m.BatchDone:
        ids = self._batches[batch]
        return m.BatchDone(
            batch=batch,
            results=[self._requests[r].result for r in ids],
            dead=[r for r in ids if self._requests[r].state == "dead"],
            cancelled=[r for r in ids if self._requests[r].state == "cancelled"],
        )

    def forget_batch(self, batch: str) -> None:
        """Drop a finished batch's records (and results) to bound memory in long runs."""
        if not self._batch_finished(batch):
            raise ProtocolError(f"batch {batch} is not finished")
        for rid in self._batches.pop(batch):
            del self._requests[rid]
        self._open.pop(batch, None)
        self._batch_done.pop(batch, None)

    def stats(self) -> dict[str, Any]:
        states = {"queued": 0, "leased": 0, "done": 0, "dead": 0, "cancelled": 0}
        for rec in self._requests.values():
            states[rec.state] += 1
        return {**self.counters, **{f"now_{k}": v for k, v in states.items()}}

    # --- internals --------------------------------------------------------------------------
    def _current(self, request_id: str, attempt: int, worker_id: str, op: str) -> _Request:
        rec = self._requests.get(request_id)
        if rec is None:
            raise NotFound(f"{op}: unknown request {request_id!r}")
        if rec.state != "leased" or rec.attempt != attempt or rec.worker_id != worker_id:
            self.counters["stale_rejected"] += 1
            raise StaleAttempt(
                f"{op} {request_id} attempt {attempt} from {worker_id}: fenced off "
                f"(current attempt {rec.attempt}, {rec.state}, {rec.worker_id})"
            )
        return rec

    def _track_deadline(self, rec: _Request) -> None:
        heapq.heappush(self._leases, (rec.deadline, rec.request_id, rec.attempt))
        if self.on_deadline is not None:
            self.on_deadline(rec.deadline)

    def _revoke(self, rec: _Request) -> None:
        """``rec``'s current lease stops being current: wake the ``wait_revoked`` calls on it."""
        revoked = self._revoked.pop((rec.request_id, rec.attempt), None)
        if revoked is not None:
            revoked.set()

    def _enqueue(self, rec: _Request) -> None:
        if rec.state == "leased":
            self._revoke(rec)
        rec.state, rec.worker_id = "queued", None
        heapq.heappush(self._ready[rec.kind], (rec.seq, rec.request_id))
        if self._pullers_waiting:  # wake every waiting pull; each retries and re-waits if beaten
            self._work.set()
            self._work = asyncio.Event()

    def _count_failure(self, rec: _Request, reason: str) -> None:
        rec.failures += 1
        if rec.failures < self.config.max_attempts:
            self._enqueue(rec)
            return
        rec.state, rec.worker_id = "dead", None
        self.counters["dead"] += 1
        self.dead_letters.append(
            {
                "request_id": rec.request_id,
                "kind": rec.kind,
                "batch": rec.batch,
                "attempts": rec.attempt,
                "reason": reason,
            }
        )
        self._finished(rec)

    def _batch_finished(self, batch: str) -> bool:
        return batch in self._batches and self._open.get(batch, 0) == 0

    def _finished(self, rec: _Request) -> None:
        self._revoke(rec)
        self._open[rec.batch] -= 1
        if self._open[rec.batch] == 0 and rec.batch in self._batch_done:
            self._batch_done[rec.batch].set()
