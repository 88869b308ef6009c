"""``RuntimeExecutor``: the trainer's executor over the runtime — jobs go as requests through the
queue, trajectories and weights through the tensor store.

A batch of jobs (``spotlight.comm.messages.ExploreWork`` / ``RolloutWork``, each naming its weights
version) becomes one request per job under the driver's batch id — a job is never split, so samples
are bit-identical to the in-process reference — and the call returns at once with a handle (a
``concurrent.futures.Future``). Behind the handle, on the controller's loop: wait for the batch,
read the trajectories from the store, build the ``Group``s in job order with ``spotlight.work.group``
(the same assembly the in-process executor uses), and free the trajectories in the background.
Several batches may be in flight at once (exploration beside rollout and training). An exploration
batch pins its weights version in the store while it runs, may be cancelled (``cancel``: the queue
drops what has not finished, the handle resolves with what has), and tolerates lost requests
(None in their place); a rollout batch must complete. ``publish`` puts the trainer's
``state_dict`` into the store as an immutable weights version.

This module knows requests, versions and groups; the queue's rules, the store's and the workers'
math live in their own modules. It never imports the loop: the driver hands it what it needs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from spotlight import work
from spotlight.actors.controller.service import BackgroundLoop
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm import messages as m
from spotlight.errors import NotFound, RemoteError
from spotlight.pipelines.text import publish_prompts
from spotlight.policy.grpo import Group

log = logging.getLogger(__name__)


class RuntimeExecutor:
    """The driver's Executor over the actor runtime (see the module docstring). ``wait_s`` bounds
    how long one batch may take; ``rpc_s`` one store or queue call."""

    def __init__(self, loop: BackgroundLoop, queue: QueueClient, store: TensorStoreClient, *,
                 wait_s: float, rpc_s: float, explore_workers: Callable[[], int] = lambda: 1,
                 epoch: int | None = None,
                 progress: Callable[..., None] = lambda phase, **fields: None) -> None:
        self.bg, self.queue, self.store = loop, queue, store
        self._progress = progress
        """Told the trainer's phase: "rollout" and "train" of an iteration, "publish" of a version,
        then "between iterations" (``ControllerCore.note``, for ``spotlight status``)."""
        self.epoch = "" if epoch is None else f"@{epoch}"
        """Suffix of every request id: the run epoch, so a result of an attempt from before a
        restart (``--resume``) names a request the new queue never had, and is refused."""
        self.wait_s, self.rpc_s = wait_s, rpc_s
        self._explore_workers = explore_workers
        self.timings: list[dict[str, Any]] = []
        """Per batch: kind, wall_s (submit to results read), worker_s (summed time inside workers),
        compute_s (summed time the workers spent computing); per publish: kind "publish", wall_s."""
        self._deletes: set[asyncio.Future] = set()  # deletes of trajectories read (loop-side)
        self._model = None  # the driver's model (its prompt embeddings go to the store for the workers)
        self._prompts_put: set[str] = set()

    def _submit(self, batch: str, jobs: list[m.Work], read: Callable[[list[m.WorkResult]], Coroutine],
                *, partial: bool = False) -> concurrent.futures.Future:
        """``partial``: the batch may come back incomplete (cancelled or dead-lettered requests are
        None in the results) instead of failing; its weights version is pinned meanwhile."""
        requests = [
            m.WorkRequest(request_id=f"{batch}/{i}{self.epoch}", batch=batch, work=job)
            for i, job in enumerate(jobs)
        ]
        kind = jobs[0].KIND if jobs else "empty"
        versions = sorted({j.version for j in jobs}) if partial else []

        async def go() -> Any:
            t0 = time.perf_counter()
            await publish_prompts(self.store, self._model, [j.prompt for j in jobs], self._prompts_put)
            for v in versions:
                await self.store.pin_version(v)
            try:
                await self.queue.submit(requests)
                done = await self.queue.wait_batch(batch, self.wait_s, forget=True)  # bounded queue memory
            finally:
                for v in versions:
                    await self.store.pin_version(v, pinned=False)
            if done.dead and not partial:
                raise RemoteError(
                    f"{kind} batch {batch}: requests {done.dead} were dead-lettered (see queue stats)"
                )
            if done.dead:
                log.warning("%s batch %s: %d requests dead-lettered", kind, batch, len(done.dead))
            value = await read(done.results)
            got = [r for r in done.results if r is not None]
            self.timings.append(
                {
                    "kind": kind,
                    "batch": batch,
                    "requests": len(requests),
                    "returned": len(got),
                    "wall_s": time.perf_counter() - t0,
                    "worker_s": sum(r.worker_s for r in got),
                    "compute_s": sum(r.compute_s for r in got),
                }
            )
            return value

        return self.bg.submit(go())

    def explore(self, batch: str, jobs: list[m.ExploreWork]) -> concurrent.futures.Future:
        """Handle of each job's ``ExploreResult`` in job order (None: cancelled or lost)."""

        async def read(results: list[m.ExploreResult | None]) -> list[m.ExploreResult | None]:
            return results

        return self._submit(batch, jobs, read, partial=True)

    def cancel(self, batch: str) -> None:
        """Drop what of ``batch`` has not finished, in the queue; its handle resolves with the rest."""

        async def go() -> None:
            try:
                await self.queue.cancel_batch(batch)
            except NotFound:  # it finished (and was collected) meanwhile: nothing left to cancel
                pass

        self.bg.call(go(), timeout=self.rpc_s)

    def explore_workers(self) -> int:
        """Workers that run exploration now (the planner's capacity)."""
        return self._explore_workers()

    def rollout(self, batch: str, jobs: list[m.RolloutWork]) -> concurrent.futures.Future:
        """Handle of each job's ``Group``, in job order."""
        it = work.batch_iteration(batch)
        self._progress("rollout", iteration=it)

        async def read(results: list[m.RolloutResult]) -> list[Group]:
            keys = [r.key for r in results]
            trajs = [t for t, _ in await asyncio.gather(*(self.store.get(k) for k in keys))]
            groups = [
                work.group(job, t["latents"], t["log_probs"], t["rewards"], t.get("credit"))
                for job, t in zip(jobs, trajs, strict=True)
            ]
            self._free(keys)
            self._progress("train", iteration=it)
            return groups

        return self._submit(batch, jobs, read)

    def _free(self, keys: list[str]) -> None:
        """Delete read trajectories off the driver's path (runs on the loop; awaited, and its
        errors raised, at the next ``publish``)."""
        self._deletes.add(asyncio.ensure_future(asyncio.gather(*(self.store.delete(k) for k in keys))))

    async def _publish(self, version: int, tensors: dict[str, np.ndarray]) -> None:
        deletes, self._deletes = self._deletes, set()
        await asyncio.gather(*deletes)
        await self.store.publish_weights(version, tensors)

    def publish(self, version: int, model) -> None:
        """Put ``model``'s weights into the store as ``version`` (and settle earlier deletes)."""
        t0 = time.perf_counter()
        self._model = model
        self._progress("publish", version=version)
        tensors = {k: v.detach().cpu().contiguous().numpy() for k, v in model.state_dict().items()}
        self.bg.call(self._publish(version, tensors), timeout=self.rpc_s)
        self._progress("between iterations (seeds, evaluation, checkpoint)")
        self.timings.append({"kind": "publish", "version": version, "wall_s": time.perf_counter() - t0})
