"""The request queue's client: the same async methods whether the core is in this process
(``QueueClient.local(core)``, through the very handlers the service uses) or behind an
``RpcClient`` (``QueueClient.remote(rpc)``).

This module knows messages and timeouts; the queue's rules live in ``core``, its sockets in
``service``."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from spotlight.actors.queue.core import KINDS, RequestQueueCore
from spotlight.actors.queue.service import queue_handlers
from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient


class QueueClient:
    """The queue's async API, in-process (``QueueClient.local(core)``) or over an ``RpcClient``."""

    def __init__(self, call: Callable[[m.Message, float], Any], timeout: float) -> None:
        self._call, self.timeout = call, timeout

    @classmethod
    def local(cls, core: RequestQueueCore) -> QueueClient:
        handlers = queue_handlers(core)

        async def call(msg: m.Message, timeout: float) -> m.Message:
            reply = handlers[type(msg)](msg)
            return await reply if inspect.isawaitable(reply) else reply
        return cls(call, timeout=math.inf)

    @classmethod
    def remote(cls, rpc: RpcClient) -> QueueClient:
        return cls(lambda msg, timeout: rpc.call(msg, timeout=timeout), timeout=rpc.timeout)

    async def _rpc(self, msg: m.Message, wait_s: float = 0.0) -> Any:
        return await self._call(msg, self.timeout + wait_s)  # waiting calls get their wait on top

    async def submit(self, requests: list[m.WorkRequest]) -> None:
        await self._rpc(m.Submit(requests=requests))

    async def pull(self, worker_id: str, kinds: tuple[str, ...] | list[str] = KINDS,
                   max_wait_s: float = 0.0) -> m.LeaseGrant | None:
        reply = await self._rpc(m.Pull(worker_id=worker_id, kinds=list(kinds), max_wait_s=max_wait_s),
                                max_wait_s)
        return reply if isinstance(reply, m.LeaseGrant) else None

    async def pull_many(self, worker_id: str, max_n: int, kinds: tuple[str, ...] | list[str] = KINDS,
                        max_wait_s: float = 0.0) -> list[m.LeaseGrant]:
        reply = await self._rpc(m.PullMany(worker_id=worker_id, kinds=list(kinds), max_n=max_n,
                                           max_wait_s=max_wait_s), max_wait_s)
        return reply.leases

    async def heartbeat(self, request_id: str, attempt: int, worker_id: str,
                        committed_step: int | None = None) -> m.LeaseExtended:
        return await self._rpc(m.Heartbeat(request_id=request_id, attempt=attempt,
                                           worker_id=worker_id, committed_step=committed_step))

    async def release(self, request_id: str, attempt: int, worker_id: str) -> None:
        await self._rpc(m.Release(request_id=request_id, attempt=attempt, worker_id=worker_id))

    async def complete(self, request_id: str, attempt: int, worker_id: str, result: m.WorkResult) -> None:
        await self._rpc(m.Complete(request_id=request_id, attempt=attempt, worker_id=worker_id,
                                   result=result))

    async def complete_many(self, completes: list[m.Complete]) -> m.BatchResult:
        return await self._rpc(m.CompleteMany(completes=completes))

    async def fail(self, request_id: str, attempt: int, worker_id: str, error: str) -> None:
        await self._rpc(m.Fail(request_id=request_id, attempt=attempt, worker_id=worker_id,
                               error=error))

    async def wait_batch(self, batch: str, timeout_s: float, *, forget: bool = False) -> m.BatchDone:
        """Results of ``batch`` once all are done; ``forget`` frees its records in the queue."""
        return await self._rpc(m.WaitBatch(batch=batch, timeout_s=timeout_s, forget=forget), timeout_s)

    async def cancel_batch(self, batch: str, *, forget: bool = False) -> m.BatchDone:
        """Cancel what of ``batch`` has not finished; the results that did arrive."""
        return await self._rpc(m.CancelBatch(batch=batch, forget=forget))

    async def wait_revoked(self, request_id: str, attempt: int, max_wait_s: float) -> bool:
        """True once lease ``attempt`` of ``request_id`` is no longer current (e.g. its batch was
        cancelled); False if it still is after ``max_wait_s``."""
        reply = await self._rpc(m.WaitRevoked(request_id=request_id, attempt=attempt, max_wait_s=max_wait_s),
                                max_wait_s)
        return reply.revoked

    async def release_node(self, node_id: str) -> list[str]:
        """Node ``node_id`` was declared lost: its workers' leases back to the queue now; their ids."""
        return (await self._rpc(m.ReleaseNode(node_id=node_id))).request_ids

    async def stats(self) -> m.QueueStatsReply:
        return await self._rpc(m.QueueStats())
