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
``max_attempts`` counted failures the request is dead-lettered. A re-queued request carries a
resume reference {request_id, step, key} to its last commit, which lives in the tensor store at
``commit/<request_id>``. Results are accepted only from the current attempt (fencing), exactly once.

This module knows leases and iterations; it knows nothing of tensors, models or the store.
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
_REQUEST_KEYS = frozenset({"request_id", "kind", "iteration", "payload"})


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
    kind: str
    iteration: int
    payload: dict
    seq: int  # submission order; kept on re-queue so a retried request keeps its place
    state: str = "queued"  # queued | leased | done | dead
    attempt: int = 0  # number of the current (or last) lease; 0 before the first
    worker_id: str | None = None
    deadline: float = 0.0
    failures: int = 0
    committed_step: int | None = None
    result: dict | None = None


class RequestQueueCore:
    """The queue's logic; every method is synchronous except the two ``wait_*`` ones."""

    def __init__(self, config: QueueConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.clock = config or QueueConfig(), clock
        self._requests: dict[str, _Request] = {}
        self._ready: dict[str, list[tuple[int, str]]] = {k: [] for k in KINDS}  # heaps by seq
        self._leases: list[tuple[float, str, int]] = []  # heap; stale entries skipped lazily
        self._seq = itertools.count()
        self._iterations: dict[int, list[str]] = {}
        self._open: dict[int, int] = {}
        self._iter_done: dict[int, asyncio.Event] = {}
        self._work = asyncio.Event()  # set (and replaced) when work is queued and pulls wait
        self._pullers_waiting = 0
        self.on_deadline: Callable[[float], None] | None = None  # the expiry timer's hook
        self.dead_letters: list[dict[str, Any]] = []
        self.counters = dict.fromkeys(
            ["submitted", "leased", "completed", "released", "expired", "failed", "dead",
             "heartbeats", "late_results_dropped", "stale_rejected", "duplicate_completions"], 0)

    # --- producers --------------------------------------------------------------------------
    def submit(self, requests: list[dict[str, Any]]) -> None:
        """Enqueue requests (all or none: every one is validated first)."""
        seen: set[str] = set()
        for r in requests:
            if not isinstance(r, dict) or r.keys() != _REQUEST_KEYS:
                raise ProtocolError(f"a request needs exactly {sorted(_REQUEST_KEYS)}, got {r!r:.200}")
            rid = r["request_id"]
            if not isinstance(rid, str) or rid in self._requests or rid in seen:
                raise ProtocolError(f"request_id {rid!r} is not a new str")
            if r["kind"] not in KINDS or type(r["iteration"]) is not int or type(r["payload"]) is not dict:
                raise ProtocolError(f"request {rid}: bad kind, iteration or payload")
            seen.add(rid)
        for r in requests:
            rec = _Request(r["request_id"], r["kind"], r["iteration"], r["payload"], next(self._seq))
            self._requests[rec.request_id] = rec
            self._iterations.setdefault(rec.iteration, []).append(rec.request_id)
            self._open[rec.iteration] = self._open.get(rec.iteration, 0) + 1
            event = self._iter_done.get(rec.iteration)
            if event is not None and event.is_set():
                self._iter_done[rec.iteration] = asyncio.Event()  # re-opened
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
                rec = self._requests[heapq.heappop(heap)[1]]
                rec.state, rec.worker_id, rec.deadline = "leased", worker_id, now + lease_s
                rec.attempt += 1
                self._track_deadline(rec)
                grants.append(m.LeaseGrant(
                    request_id=rec.request_id, attempt=rec.attempt, deadline=rec.deadline,
                    lease_s=lease_s, kind=rec.kind, iteration=rec.iteration, payload=rec.payload,
                    resume=self._resume_ref(rec)))
        self.counters["leased"] += len(grants)
        return grants

    async def wait_pull(self, worker_id: str, kinds: list[str], max_n: int,
                        max_wait_s: float) -> list[m.LeaseGrant]:
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

    def heartbeat(self, request_id: str, attempt: int, worker_id: str,
                  committed_step: int | None = None) -> m.LeaseExtended:
        rec = self._current(request_id, attempt, worker_id, "heartbeat")
        if committed_step is not None:
            rec.committed_step = committed_step
        rec.deadline = self.clock() + self.config.lease_s
        self._track_deadline(rec)
        self.counters["heartbeats"] += 1
        return m.LeaseExtended(request_id=request_id, attempt=attempt, deadline=rec.deadline,
                               lease_s=self.config.lease_s)

    def release(self, request_id: str, attempt: int, worker_id: str) -> None:
        """Spot notice: back to the queue at once, not counted toward the retry cap."""
        rec = self._current(request_id, attempt, worker_id, "release")
        self.counters["released"] += 1
        self._enqueue(rec)

    def complete(self, request_id: str, attempt: int, worker_id: str, result: dict) -> bool:
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
        rec.state, rec.result = "done", result
        self.counters["completed"] += 1
        self._finished(rec)
        return True

    def fail(self, request_id: str, attempt: int, worker_id: str, error: str) -> None:
        rec = self._current(request_id, attempt, worker_id, "fail")
        self.counters["failed"] += 1
        self._count_failure(rec, f"failed: {error}")

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
        rec = self._requests.get(rid)
        return rec is not None and rec.state == "leased" and rec.attempt == attempt and rec.deadline == deadline

    # --- iterations -------------------------------------------------------------------------
    async def wait_iteration(self, iteration: int, timeout_s: float | None = None) -> m.IterationDone:
        """Wait until every request of ``iteration`` is done or dead; results in submit order."""
        if not self._iteration_finished(iteration):
            event = self._iter_done.setdefault(iteration, asyncio.Event())
            try:
                async with asyncio.timeout(timeout_s):
                    await event.wait()
            except TimeoutError:
                raise ActorTimeout(f"iteration {iteration}: {self._open.get(iteration, 0)} requests "
                                   f"still open after {timeout_s}s") from None
        ids = self._iterations[iteration]
        return m.IterationDone(
            iteration=iteration, results=[self._requests[r].result for r in ids],
            dead=[r for r in ids if self._requests[r].state == "dead"])

    def forget_iteration(self, iteration: int) -> None:
        """Drop a finished iteration's records (and results) to bound memory in long runs."""
        if not self._iteration_finished(iteration):
            raise ProtocolError(f"iteration {iteration} is not finished")
        for rid in self._iterations.pop(iteration):
            del self._requests[rid]
        self._open.pop(iteration, None)
        self._iter_done.pop(iteration, None)

    def stats(self) -> dict[str, Any]:
        states = {"queued": 0, "leased": 0, "done": 0, "dead": 0}
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
            raise StaleAttempt(f"{op} {request_id} attempt {attempt} from {worker_id}: fenced off "
                               f"(current attempt {rec.attempt}, {rec.state}, {rec.worker_id})")
        return rec

    def _resume_ref(self, rec: _Request) -> dict[str, Any] | None:
        if rec.committed_step is None:
            return None
        return {"request_id": rec.request_id, "step": rec.committed_step,
                "key": f"commit/{rec.request_id}"}

    def _track_deadline(self, rec: _Request) -> None:
        heapq.heappush(self._leases, (rec.deadline, rec.request_id, rec.attempt))
        if self.on_deadline is not None:
            self.on_deadline(rec.deadline)

    def _enqueue(self, rec: _Request) -> None:
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
        self.dead_letters.append({"request_id": rec.request_id, "kind": rec.kind,
                                  "iteration": rec.iteration, "attempts": rec.attempt,
                                  "reason": reason})
        self._finished(rec)

    def _iteration_finished(self, iteration: int) -> bool:
        return iteration in self._iterations and self._open.get(iteration, 0) == 0

    def _finished(self, rec: _Request) -> None:
        self._open[rec.iteration] -= 1
        if self._open[rec.iteration] == 0 and rec.iteration in self._iter_done:
            self._iter_done[rec.iteration].set()
