"""``RuntimeExecutor``: the trainer's executor over the runtime (requests through the queue,
trajectories and weights through the tensor store)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
import torch

from spotlight.actors.controller.service import BackgroundLoop
from spotlight.actors.queue.client import QueueClient
from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm import messages as m
from spotlight.errors import RemoteError
from spotlight.loop import ExploreJob, RolloutJob
from spotlight.policy.grpo import Group
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


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
