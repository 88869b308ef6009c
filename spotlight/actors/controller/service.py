"""The controller's service: its message API and process shell around ``ControllerCore``.

- ``controller_handlers(core)``: the message API, one handler per message class (Register,
  Deregister, NodeBeat);
- ``Controller``: the async shell — the controller's ``RpcServer`` plus open queue and store
  clients (CURVE on both sides when keys are given);
- ``BackgroundLoop``: the trainer (``Loop``) is synchronous torch code on the main thread, so the
  controller's sockets live on an asyncio loop in one background thread; ``submit`` hands it a
  coroutine (``call`` also waits for the result), and ``fail`` makes every call raise at once
  when a supervisor sees an actor die.

Knows sockets, the event loop and threads; the registry's rules are the core's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm import messages as m
from spotlight.comm.auth import CurveClientKeys, CurveServerKeys
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import ActorDead, ActorTimeout, SpotlightError

log = logging.getLogger(__name__)

STATUS_QUEUE_S = 2.0
"""How long a status request waits for the queue's counters (a status must answer while the
queue is busy; it then shows none)."""


def controller_handlers(core: ControllerCore) -> dict[type[m.Message], Callable[[Any], Any]]:
    """The controller's message API over ``core`` (the shell adds its own Register wrapper)."""
    return {m.Register: core.register, m.Deregister: core.deregister, m.NodeBeat: core.beat}


class Controller:
    """``async with Controller(core, bind=..., queue=..., store=..., timeout=...) as ctl``: the
    controller's server plus open clients of the queue (``ctl.queue``) and the store
    (``ctl.store``), whose replies wait up to ``timeout``."""

    def __init__(self, core: ControllerCore, *, bind: str, queue: str, store: str,
                 timeout: float, curve: CurveServerKeys | None = None,
                 client_curve: CurveClientKeys | None = None) -> None:
        self.core, self._bind, self._curve, self._client_curve = core, bind, curve, client_curve
        self._queue_ep, self._store_ep, self._timeout = queue, store, timeout
        self._stack = contextlib.AsyncExitStack()
        self.endpoint = ""
        self.queue: QueueClient | None = None
        self.store: TensorStoreClient | None = None

    async def __aenter__(self) -> Controller:
        async with contextlib.AsyncExitStack() as stack:
            handlers = {**controller_handlers(self.core), m.Register: self._register,
                        m.FleetStatus: self._status}
            server = await stack.enter_async_context(
                RpcServer(handlers, bind=self._bind, curve=self._curve))
            self.endpoint = server.endpoint
            rpc = await stack.enter_async_context(
                RpcClient(self._queue_ep, timeout=self._timeout, curve=self._client_curve))
            self.queue = QueueClient.remote(rpc)
            self.store = await stack.enter_async_context(
                TensorStoreClient.remote(self._store_ep, timeout=self._timeout, curve=self._client_curve))
            sweeper = asyncio.create_task(self._sweep(), name="node sweep")  # owned by the stack
            stack.push_async_callback(self._cancel, sweeper)
            self._stack = stack.pop_all()
        return self

    async def _sweep(self) -> None:
        """Node liveness: every ``node_sweep_s``, nodes without a heartbeat for ``node_lost_s``
        are declared lost (``ControllerCore.sweep``) and the leases their workers hold go back to
        the queue at once (``ReleaseNode``), not one by one as each lease expires."""
        while True:
            await asyncio.sleep(self.core.sweep_s)
            for node_id in self.core.sweep():
                await self._requeue(node_id)

    async def _register(self, msg: m.Register) -> m.Registered:
        """A node registering under a name still registered is a restarted agent (the old one
        left without a goodbye, or gave up on the queue): the old incarnation's leases go back
        to the queue before the new one is answered, so none of the new one's leases can be."""
        again = msg.node_id in self.core.nodes
        reply = self.core.register(msg)
        if again:
            await self._requeue(msg.node_id)
        return reply

    async def _status(self, msg: m.FleetStatus) -> m.FleetStatusReply:
        """The fleet's state; the queue's counters are left empty when it does not answer in time."""
        assert self.queue is not None
        try:
            async with asyncio.timeout(STATUS_QUEUE_S):
                queue = (await self.queue.stats()).stats
        except (SpotlightError, TimeoutError) as e:
            log.warning("status: the queue did not answer: %s", e)
            queue = {}
        return self.core.status(queue)

    async def _requeue(self, node_id: str) -> None:
        assert self.queue is not None
        try:
            requeued = await self.queue.release_node(node_id)
        except SpotlightError as e:  # the leases still come back, at their expiry
            log.warning("re-queueing the leases of lost node %s: %s", node_id, e)
            return
        self.core.requeued(node_id, requeued)

    @staticmethod
    async def _cancel(task: asyncio.Task) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._stack.__aexit__(*exc_info)


class BackgroundLoop:
    """An asyncio loop in a daemon thread running ``main()`` until ``close``.

    ``main`` is an async context factory: whatever it yields is ``value``; leaving it is the
    shutdown. From other threads, ``submit(coro)`` starts a coroutine on the loop and returns a
    ``concurrent.futures.Future`` at once; ``call(coro, timeout)`` waits for it. ``fail(exc)``
    (a supervisor saw an actor die) makes every pending and every later future raise ``exc`` at
    once, as does the loop's own death (``ActorDead``) and ``close``.
    """

    def __init__(self, main: Callable[[], contextlib.AbstractAsyncContextManager],
                 start_timeout: float) -> None:
        self._main, self._stop = main, None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.RLock()  # guards _failure and _pending; settles futures under it
        self._failure: BaseException | None = None
        # Futures handed out -> the loop's futures behind them.
        self._pending: dict[concurrent.futures.Future, concurrent.futures.Future] = {}
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="controller-loop",
                                        daemon=True)
        self._thread.start()
        self.value = self._ready.result(start_timeout)  # raises what startup raised

    async def _run(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with self._main() as value:
                self._ready.set_result(value)
                await self._stop.wait()
        except BaseException as e:  # handed on (to start-up's caller, or to every call), not re-raised
            if not self._ready.done():
                self._ready.set_exception(e)
            else:
                log.error("controller loop failed", exc_info=e)
                self.fail(ActorDead(f"the controller loop failed: {e!r}"))  # before its tasks are cancelled
        finally:
            self.fail(ActorDead("the controller loop is closed"))  # no-op when it failed first

    @property
    def failure(self) -> BaseException | None:
        """What ``fail`` was given (or why the loop ended); None while it serves."""
        return self._failure

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Start ``coro`` on the loop; its future at once (a handle to wait on later)."""
        assert self.loop is not None
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._failure is not None:
                coro.close()
                out.set_exception(self._failure)
                return out
            inner = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending[out] = inner

        def settle(_: concurrent.futures.Future) -> None:
            with self._lock:
                if self._pending.pop(out, None) is None or out.done():  # failed (or cancelled) first
                    return
                if inner.cancelled():
                    out.cancel()
                elif inner.exception() is not None:
                    out.set_exception(inner.exception())
                else:
                    out.set_result(inner.result())

        def cancel_inner(_: concurrent.futures.Future) -> None:
            if out.cancelled():
                inner.cancel()

        out.add_done_callback(cancel_inner)
        inner.add_done_callback(settle)
        return out

    def call(self, coro: Coroutine, timeout: float) -> Any:
        """``submit(coro)`` and wait for its result (``ActorTimeout`` after ``timeout``)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ActorTimeout(f"controller call did not finish within {timeout}s") from None

    def fail(self, exc: BaseException) -> None:
        """Every pending future, and every later ``submit``/``call``, raises ``exc`` now; the
        coroutines behind the pending ones are cancelled. The first failure sticks."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = exc
            pending, self._pending = self._pending, {}
            for out, inner in pending.items():
                if not out.done():
                    out.set_exception(exc)
                inner.cancel()

    def close(self, timeout: float) -> None:
        """Leave ``main`` (its cleanup runs on the loop) and join the thread for up to ``timeout``."""
        if self.loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # "Event loop is closed": it has ended already
                self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
