"""The request queue's process shell (the logic is ``spotlight.actors.queue.core``).

- ``queue_handlers(core)``: the message API, one handler per message class; used by both the
  service (behind an ``RpcServer``) and the local client, so both paths run the same code.
- ``QueueService``: the lease-expiry timer, which sleeps until the nearest lease deadline (never
  polls), plus an ``RpcServer`` when ``bind`` is given; long-poll pulls wait on an event.
- ``serve`` / ``main``: run a queue until SIGTERM/SIGINT (``python -m spotlight.actors.queue``).

This module knows sockets, timers and signals; the queue's rules live in the core.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
from collections.abc import Callable
from typing import Any

from spotlight.actors.options import add_options, given
from spotlight.actors.procs import announce_ready, die_with_parent
from spotlight.actors.queue.core import QueueConfig, RequestQueueCore
from spotlight.comm import messages as m
from spotlight.comm.auth import cluster_server_keys
from spotlight.comm.transport import RpcServer, shutdown_group
from spotlight.errors import NotFound, ProtocolError, StaleAttempt

log = logging.getLogger(__name__)


# --- the message API, shared by the service (remote) and the client (local) ---------------------
def queue_handlers(core: RequestQueueCore) -> dict[type[m.Message], Callable[[Any], Any]]:
    """Message class -> handler returning the reply (or an awaitable of it, to long-poll)."""
    ok = m.Ok()

    def pull(msg: m.Pull) -> Any:
        grant = core.pull(msg.worker_id, msg.kinds)
        if grant is not None or msg.max_wait_s <= 0:  # answered inline: no task needed
            return grant or m.NoWork()

        async def long_poll() -> m.Message:
            grants = await core.wait_pull(msg.worker_id, msg.kinds, 1, msg.max_wait_s)
            return grants[0] if grants else m.NoWork()
        return long_poll()

    def pull_many(msg: m.PullMany) -> Any:
        if msg.max_n < 1:
            raise ProtocolError(f"PullMany.max_n must be >= 1, got {msg.max_n}")
        grants = core.pull_many(msg.worker_id, msg.kinds, msg.max_n)
        if grants or msg.max_wait_s <= 0:
            return m.LeaseBatch(leases=grants)

        async def long_poll() -> m.Message:
            return m.LeaseBatch(leases=await core.wait_pull(
                msg.worker_id, msg.kinds, msg.max_n, msg.max_wait_s))
        return long_poll()

    def complete_many(msg: m.CompleteMany) -> m.BatchResult:
        accepted, rejected = 0, []
        for i, c in enumerate(msg.completes):
            try:
                accepted += core.complete(c.request_id, c.attempt, c.worker_id, c.result)
            except (StaleAttempt, NotFound) as e:
                rejected.append({"index": i, "code": type(e).__name__, "message": str(e)})
        return m.BatchResult(accepted=accepted, rejected=rejected)

    async def wait_batch(msg: m.WaitBatch) -> m.BatchDone:
        done = await core.wait_batch(msg.batch, msg.timeout_s)
        if msg.forget:
            core.forget_batch(msg.batch)
        return done

    def wait_revoked(msg: m.WaitRevoked) -> Any:
        held = core.holds(msg.request_id, msg.attempt)
        if not held or msg.max_wait_s <= 0:  # answered inline
            return m.LeaseRevoked(revoked=not held)

        async def long_poll() -> m.Message:
            revoked = await core.wait_revoked(msg.request_id, msg.attempt, msg.max_wait_s)
            return m.LeaseRevoked(revoked=revoked)
        return long_poll()

    def cancel_batch(msg: m.CancelBatch) -> m.BatchDone:
        done = core.cancel_batch(msg.batch)
        if msg.forget:
            core.forget_batch(msg.batch)
        return done

    return {
        m.Submit: lambda msg: core.submit(msg.requests) or ok,
        m.CancelBatch: cancel_batch,
        m.Pull: pull,
        m.PullMany: pull_many,
        m.Heartbeat: lambda msg: core.heartbeat(msg.request_id, msg.attempt, msg.worker_id,
                                                msg.committed_step),
        m.Release: lambda msg: core.release(msg.request_id, msg.attempt, msg.worker_id) or ok,
        m.Complete: lambda msg: (core.complete(msg.request_id, msg.attempt, msg.worker_id,
                                               msg.result), ok)[1],
        m.CompleteMany: complete_many,
        m.Fail: lambda msg: core.fail(msg.request_id, msg.attempt, msg.worker_id, msg.error) or ok,
        m.WaitBatch: wait_batch,
        m.WaitRevoked: lambda msg: wait_revoked(msg),
        m.ReleaseNode: lambda msg: m.Requeued(request_ids=core.release_node(msg.node_id)),
        m.QueueStats: lambda msg: m.QueueStatsReply(stats=core.stats(),
                                                    dead_letters=list(core.dead_letters)),
    }


class QueueService:
    """The queue's process shell: lease-expiry timer + (when ``bind`` is given) an RpcServer.

    ``async with QueueService(core, bind="tcp://0.0.0.0:5555") as service:`` serves until the
    block exits; ``bind=None`` runs only the expiry timer (an in-process queue).
    """

    def __init__(self, core: RequestQueueCore, *, bind: str | None = None, **server_kw: Any) -> None:
        self.core = core
        self._server = RpcServer(queue_handlers(core), bind=bind, **server_kw) if bind else None
        self._wake = asyncio.Event()
        self._armed = math.inf  # the deadline the expiry timer sleeps until
        self._tg: asyncio.TaskGroup | None = None
        self._timer: asyncio.Task | None = None
        self.endpoint = ""

    async def __aenter__(self) -> QueueService:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self.core.on_deadline = self._on_deadline
        self._timer = self._tg.create_task(self._expire_loop(), name="queue-lease-expiry")
        if self._server is not None:
            await self._server.__aenter__()
            self.endpoint = self._server.endpoint
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._tg is not None and self._timer is not None
        try:
            if self._server is not None:
                await self._server.__aexit__(*exc_info)
        finally:
            self.core.on_deadline = None
            await shutdown_group(self._tg, {self._timer}, exc_info)

    def _on_deadline(self, deadline: float) -> None:
        if deadline < self._armed:  # only an earlier deadline needs the timer re-armed
            self._armed = deadline
            self._wake.set()

    async def _expire_loop(self) -> None:
        while True:
            for rid in self.core.expire_leases():
                log.info("lease of %s expired; re-queued or dead-lettered", rid)
            nearest = self.core.next_deadline()
            self._armed = math.inf if nearest is None else nearest
            self._wake.clear()
            # +1 ms: never wake a hair before the deadline and spin.
            delay = None if nearest is None else max(0.0, nearest - self.core.clock()) + 1e-3
            try:
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                pass


# --- process entry ------------------------------------------------------------------------------
async def serve(bind: str, config: QueueConfig, keys: str | None = None) -> None:
    """Serve a fresh queue on ``bind`` until SIGTERM or SIGINT; prints ``ready <endpoint>``.
    ``keys``: a reserved node's CURVE folder (``spotlight.comm.auth.cluster_server_keys``)."""
    curve = cluster_server_keys(keys) if keys else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with QueueService(RequestQueueCore(config), bind=bind, curve=curve) as service:
        announce_ready(f"ready {service.endpoint}")  # parents wait for this line
        await stop.wait()
    log.info("queue on %s stopped", bind)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spotlight.actors.queue",
                                     description="Serve a request queue.")
    parser.add_argument("--bind", required=True, help="ipc:///path or tcp://host:port (port 0: any)")
    add_options(parser, QueueConfig)
    parser.add_argument("--keys", default=None, help="CURVE folder: controller.key_secret + nodes/*.key")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    die_with_parent(only_if_asked=True)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = QueueConfig(**given(args, QueueConfig))
    except ValueError as e:
        parser.error(str(e))
    asyncio.run(serve(args.bind, config, args.keys))

if __name__ == "__main__":
    main()
