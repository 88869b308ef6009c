"""The controller: the reserved side's node registry and the Loop's executor over the runtime.

- ``ControllerCore``: which nodes are registered; answers a node's Register with the queue and
  tensor-store addresses, the lease length and the recipe (so a spot node needs only the
  controller's address). ``controller_handlers`` is its message API.
- ``Controller``: the async shell: the controller's ``RpcServer`` plus open queue and store
  clients (CURVE on both sides when keys are given).
- ``BackgroundLoop``: the trainer (``Loop``) is synchronous torch code on the main thread, so the
  controller's sockets live on an asyncio loop in one background thread; ``call`` hands it a
  coroutine and waits for the result under a timeout.
- ``RuntimeExecutor``: the ``loop.Executor`` over the queue: one request per job (a job is one
  batch, never split, so samples are bit-identical to the in-process reference), wait for the
  batch, read trajectories from the store and build ``Group``s in job order; ``publish`` puts
  the trainer's ``state_dict`` into the store as an immutable weights version.

This module knows requests, weights versions and groups; the queue's rules, the store's and the
workers' math live in their own modules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch

from spotlight.actors.queue_service import QueueClient
from spotlight.actors.store_client import TensorStoreClient
from spotlight.comm import messages as m
from spotlight.comm.auth import CurveClientKeys, CurveServerKeys
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import ActorTimeout, ProtocolError, RemoteError
from spotlight.loop import ExploreJob, RolloutJob
from spotlight.policy.grpo import Group
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


class ControllerCore:
    """The node registry; ``queue``/``store`` are the addresses nodes are told to use."""

    def __init__(self, recipe: Recipe, queue: str, store: str, lease_s: float) -> None:
        self.recipe_dict = recipe.to_dict()
        self.queue, self.store, self.lease_s = queue, store, lease_s
        self.nodes: dict[str, dict[str, Any]] = {}
        self.left: list[dict[str, Any]] = []

    def register(self, msg: m.Register) -> m.Registered:
        if not msg.node_id or msg.workers < 1:
            raise ProtocolError(f"Register needs a node_id and workers >= 1, got {msg.node_id!r}, {msg.workers}")
        if msg.node_id in self.nodes:
            log.warning("node %s registered again (restarted?)", msg.node_id)
        self.nodes[msg.node_id] = {"kind": msg.kind, "workers": msg.workers, "since": time.time()}
        log.info("node %s (%s, %d workers) registered", msg.node_id, msg.kind, msg.workers)
        return m.Registered(node_id=msg.node_id, queue=self.queue, store=self.store, lease_s=self.lease_s,
                            recipe=self.recipe_dict)

    def deregister(self, msg: m.Deregister) -> m.Ok:
        node = self.nodes.pop(msg.node_id, None)
        if node is not None:
            self.left.append({"node_id": msg.node_id, "reason": msg.reason, **node})
        return m.Ok()


def controller_handlers(core: ControllerCore) -> dict[type[m.Message], Callable[[Any], Any]]:
    return {m.Register: core.register, m.Deregister: core.deregister}


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


class RuntimeExecutor:
    """The Loop's Executor over the actor runtime; ``version`` is the weights version requests
    name (published here at construction: the trainer's current weights)."""

    def __init__(self, model, recipe: Recipe, loop: BackgroundLoop, queue: QueueClient, store: TensorStoreClient,
                 version: int = 0, wait_s: float = 3600.0) -> None:
        self.model, self.recipe, self.bg, self.queue, self.store = model, recipe, loop, queue, store
        self.wait_s = wait_s
        self._batch = 0
        self.version = -1
        self.timings: list[dict[str, Any]] = []
        """Per batch: kind, wall_s (submit to results read), worker_s (summed time inside workers),
        compute_s (summed time the workers spent computing); per publish: kind "publish", wall_s."""
        self._cleanup: concurrent.futures.Future | None = None  # deletes of the last trajectories
        self.publish(version)

    def _finish_cleanup(self) -> None:
        if self._cleanup is not None:
            cleanup, self._cleanup = self._cleanup, None
            cleanup.result(60.0)

    def _run(self, coro: Coroutine, extra_s: float = 0.0) -> Any:
        return self.bg.call(coro, timeout=60.0 + extra_s)

    def _submit_and_wait(self, kind: str, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self._finish_cleanup()
        batch, self._batch = self._batch, self._batch + 1
        requests = [{"request_id": f"{kind}/{batch}/{i}", "kind": kind, "iteration": batch, "payload": p}
                    for i, p in enumerate(payloads)]

        async def go() -> m.IterationDone:
            await self.queue.submit(requests)
            return await self.queue.wait_iteration(batch, self.wait_s, forget=True)  # bounded queue memory

        t0 = time.perf_counter()
        done = self._run(go(), self.wait_s)
        if done.dead:
            raise RemoteError(f"{kind} batch {batch}: requests {done.dead} were dead-lettered (see queue stats)")
        self.timings.append({"kind": kind, "requests": len(requests), "t0": t0, "wall_s": time.perf_counter() - t0,
                             "worker_s": sum(r.get("worker_s", 0.0) for r in done.results),
                             "compute_s": sum(r.get("compute_s", 0.0) for r in done.results)})
        return done.results

    def explore(self, jobs: list[ExploreJob]) -> list[np.ndarray]:
        results = self._submit_and_wait("explore", [
            {"prompt": j.prompt, "seeds": list(j.seeds), "version": self.version,
             "effective_steps": j.effective_steps, "init_seed": j.init_seed} for j in jobs])
        return [np.asarray(r["rewards"], dtype=np.float32) for r in results]

    def rollout(self, jobs: list[RolloutJob]) -> list[Group]:
        results = self._submit_and_wait("rollout", [
            {"prompt": j.prompt, "seeds": list(j.seeds), "version": self.version, "init_seed": j.init_seed}
            for j in jobs])

        keys = [r["key"] for r in results]

        async def fetch() -> list[dict[str, np.ndarray]]:
            return [t for t, _ in await asyncio.gather(*(self.store.get(k) for k in keys))]

        async def free() -> None:
            await asyncio.gather(*(self.store.delete(k) for k in keys))

        trajs = self._run(fetch())
        # Freeing them is nobody's wait: it runs while the trainer trains, and is awaited
        # (errors raised) before the next batch.
        self._cleanup = asyncio.run_coroutine_threadsafe(free(), self.bg.loop)
        self.timings[-1]["wall_s"] = time.perf_counter() - self.timings[-1]["t0"]  # reading them is overhead too
        groups = []
        for job, traj in zip(jobs, trajs, strict=True):
            # Stored step-major (as committed); the trainer wants [G, steps, ...]: writable copies.
            lat, lps = (torch.from_numpy(np.ascontiguousarray(traj[k].swapaxes(0, 1))) for k in ("latents", "log_probs"))
            groups.append(Group(job.prompt, list(job.seeds), lat, lps, torch.from_numpy(np.array(traj["rewards"]))))
        return groups

    def publish(self, version: int) -> None:
        t0 = time.perf_counter()
        tensors = {k: v.detach().cpu().contiguous().numpy() for k, v in self.model.state_dict().items()}
        self._run(self.store.publish_weights(version, tensors))
        self.version = version
        self.timings.append({"kind": "publish", "t0": t0, "wall_s": time.perf_counter() - t0})

