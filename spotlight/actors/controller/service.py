"""The controller's async shell: its ``RpcServer`` plus open queue and store clients
(``Controller``), and ``BackgroundLoop``, the asyncio loop in a thread that hosts them beside the
synchronous trainer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from spotlight.actors.controller.core import ControllerCore, controller_handlers
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm.auth import CurveClientKeys, CurveServerKeys
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import ActorTimeout

log = logging.getLogger(__name__)


class Controller:
    """``async with Controller(core, bind=..., queue=..., store=...) as ctl``: the controller's
    server plus open clients of the queue (``ctl.queue``) and the store (``ctl.store``)."""

    def __init__(self, core: ControllerCore, *, bind: str, queue: str, store: str,
                 curve: CurveServerKeys | None = None, client_curve: CurveClientKeys | None = None,
                 timeout: float = 30.0) -> None:
        self.core, self._bind, self._curve, self._client_curve = core, bind, curve, client_curve
        self._queue_ep, self._store_ep, self._timeout = queue, store, timeout
        self._stack = contextlib.AsyncExitStack()
        self.endpoint = ""
        self.queue: QueueClient | None = None
        self.store: TensorStoreClient | None = None

    async def __aenter__(self) -> Controller:
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(
                RpcServer(controller_handlers(self.core), bind=self._bind, curve=self._curve))
            self.endpoint = server.endpoint
            rpc = await stack.enter_async_context(
                RpcClient(self._queue_ep, timeout=self._timeout, curve=self._client_curve))
            self.queue = QueueClient.remote(rpc)
            self.store = await stack.enter_async_context(
                TensorStoreClient.remote(self._store_ep, timeout=self._timeout, curve=self._client_curve))
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._stack.__aexit__(*exc_info)


class BackgroundLoop:
    """An asyncio loop in a daemon thread running ``main(ready)`` until ``close``.

    ``main`` is an async context factory: whatever it yields is ``value``; leaving it is
    the shutdown. ``call(coro, timeout)`` runs a coroutine on that loop from another thread.
    """

    def __init__(self, main: Callable[[], contextlib.AbstractAsyncContextManager], start_timeout: float = 60.0):
        self._main, self._stop = main, None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="controller-loop", daemon=True)
        self._thread.start()
        self.value = self._ready.result(start_timeout)  # raises what startup raised

    async def _run(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            async with self._main() as value:
                self._ready.set_result(value)
                await self._stop.wait()
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            else:
                log.error("controller loop failed", exc_info=e)
            raise

    def call(self, coro: Coroutine, timeout: float) -> Any:
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise ActorTimeout(f"controller call did not finish within {timeout}s") from None

    def close(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
