"""The GPU worker's core: holds the policy at one weights version and runs leased requests on it.

Owns the worker's model, its weights buffers (one per held version), the running request's
progress and the two measurement logs of its node's log folder. Knows the work (``spotlight.work``,
the functions every path shares), the model and the store; knows nothing of queues or leases
beyond the ``LeaseGrant`` it is handed. The process shell is ``spotlight.actors.worker.service``.

Rollouts. A rollout job (prompt, seeds, weights version) runs a step at a time
(``work.Rollout``), on the loop's thread. After EVERY step the state is handed to the store
client's ``commit_nowait`` (an attempt's first commit carries the whole state — latents so far
[k+1, G, C, H, W], log-probs so far [k, G] — every later one only the new step's latent and
log-prob, appended in the store), then the step yields once to the event loop, so the commit is
transmitted while the next step computes and status and stop messages are answered between steps.
A re-delivered request (attempt > 1, or a reported committed step) resumes from the store's newest
commit made with the same weights and seeds; the sampler's counter-based noise makes the result
bit-identical to an uninterrupted run. At the end it scores the sample and seals the final commit
as the trajectory under ``traj/<request_id>`` (latents [K+1, G, C, H, W], log_probs [K, G], rewards
[G], the rewards' per-column credit [G, W]); the ``RolloutResult`` names that key. With
``runtime.step_commits = false`` (the naive_spot baseline) only the last step is committed, so a
preempted request starts over elsewhere.

In a sequence-parallel group (``WorkerRun.group``, ``runtime.sp_degree`` > 1) the same rollout runs
on every rank with the DiT parallelized over the group's communicator
(``spotlight.actors.worker.sp``): every rank resumes from the store's newest commit, computes its
share of each step, and only rank 0 commits, logs the step, scores and seals, so a request a group
started may resume on a single worker or another group. The ranks agree at every step boundary
whether to stop; a failed collective is ``GroupBroken``.

Explorations. An exploration job (``work.explore``) runs alone, on a compute thread, with a check
between denoising steps: a revoked lease (``cancel``, from the node agent) ends it with
``Cancelled`` and a spot notice with ``Preempted``, each after at most the step in flight; its
rewards travel in the ``ExploreResult``.

Weights. A job names its version; the worker loads it before the first step and never changes
weights inside a request. Parameters are views of one flat buffer per held version
(``WeightsVersions``, ``spotlight.parallel.flat``); besides the current one it keeps the
``runtime.worker_versions`` newest it held before, so alternating between a rollout at v_{i+1}
and an exploration at v_i rebinds the parameters instead of fetching. A version it does not hold
is copied from the worker of its node the agent names (``WorkerRun.peer``,
``spotlight.actors.worker.peers``), else fetched from the store; it lends what it holds in turn
(``lend_weights``, pinned until returned or ``runtime.peer_weights_s``). ``WorkerProgress``
carries the counters.

Measurement logs (when the agent gives a log folder): ``steps.log``, one line ``request_id attempt
step`` per rollout step computed by a committing rank (one O_APPEND write: concurrent workers never
interleave within a line, a SIGKILL loses at most the step in flight; read by
``spotlight.spot.accounting``); ``weights.log``, one line per weights load or lend
(``spotlight.actors.worker.peers.read_weights_log``). ``runtime.step_delay_s`` (and the lend and
borrow delays) model a slower device in benches and fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from spotlight import work
from spotlight.actors.store.client import TensorStoreClient
from spotlight.actors.worker.peers import (
    WEIGHTS_LOG,
    Borrowed,
    PeerMappings,
    borrow,
    lent_message,
    log_line,
)
from spotlight.actors.worker.sp import SpRank
from spotlight.actors.worker.versions import WeightsVersions
from spotlight.comm import messages as m
from spotlight.errors import Cancelled, GroupBroken, NotFound, Preempted, ProtocolError, SpotlightError
from spotlight.parallel.device import resolve_device
from spotlight.parallel.flat import host_staging
from spotlight.pipelines.text import fetch_prompts
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


STEP_LOG = "steps.log"
"""The file of the node's log folder every computed denoising step is logged to (measurement)."""


def _append(log_dir: str | os.PathLike | None, name: str) -> int | None:
    """An O_APPEND descriptor of ``log_dir/name`` (None without a log folder)."""
    if log_dir is None:
        return None
    return os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def trajectory_key(request_id: str) -> str:
    return f"traj/{request_id}"


class WorkerCore:
    """Runs one request at a time on its model; ``store`` is an open ``TensorStoreClient``."""

    def __init__(
        self,
        recipe: Recipe,
        store: TensorStoreClient,
        model=None,
        *,
        worker_id: str = "worker",
        log_dir: str | os.PathLike | None = None,
    ) -> None:
        self.recipe, self.store, self.worker_id = recipe, store, worker_id
        rt = recipe.runtime
        self.step_delay_s = rt.step_delay_s  # a modelled slower device (benches, fault tests)
        self.step_commits = rt.step_commits
        self._step_log = _append(log_dir, STEP_LOG)
        if model is None:
            model = work.policy_model(recipe).to(resolve_device(recipe.run.device))
        self.model = model
        self.device = next(model.parameters()).device
        self.reward = work.recipe_reward(recipe)
        self.shape = work.image_shape(recipe)
        # The model's parameters are views of one flat buffer per held version (a shared-memory
        # segment on the CPU: the store fills it in place, a neighbour copies it whole; one CUDA
        # tensor on a GPU, the store's bytes staged in host memory first).
        self.versions = WeightsVersions(self.model, rt.worker_versions, rt.peer_weights_s)
        self._staging = None if self.device.type == "cpu" else host_staging(self.versions.buffers[0])
        self._maps = PeerMappings()  # this worker's mappings of its neighbours' buffers
        self.version: int | None = None
        self.weights_fetches = 0  # from the store
        self.weights_switches = 0  # to a held version
        self.weights_peer_copies, self.peer_bytes, self.peer_s = 0, 0, 0.0  # from a neighbour
        self._loading: int | None = None  # the version being loaded now
        self._loaded = asyncio.Event()  # set when that load ends (done or failed)
        self.lend_delay_s, self.borrow_delay_s = rt.lend_delay_s, rt.borrow_delay_s  # a slow peer
        self._weights_log = _append(log_dir, WEIGHTS_LOG)
        self.request_id: str | None = None
        self.attempt = 0
        self.committed_step: int | None = None
        self._stop = False
        self._cancel = threading.Event()  # the running request's lease was revoked
        self._explore_step = 0  # denoising steps the running exploration has finished
        self._cancelled_after: int | None = None  # ... when its cancel arrived
        self._revoked: tuple[str, int] | None = None  # the last lease revoked while not running
        self.sp = SpRank(self.model, recipe.runtime.sp_timeout_s, warm=recipe.runtime.sp_degree > 1)
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        """Close the step log; a device backend frees its resources here too."""
        for fd in (self._step_log, self._weights_log):
            if fd is not None:
                os.close(fd)
        self._step_log = self._weights_log = None
        self._maps.close()
        self.versions.close()
        self.sp.close()

    # --- weights -------------------------------------------------------------------------------
    async def load_weights(self, version: int, peer: m.WeightsPeer | None = None) -> None:
        """Make ``version`` this worker's weights: already current, a held buffer (rebound, no
        copy), a copy from ``peer`` (a worker of this node holding it, named by the agent), or the
        store — in that order; a failed peer copy falls back to the store (one log line). A new
        version goes into a buffer no neighbour is copying from (waiting for its pin to end)."""
        if self.version == version:
            return
        self.version = None  # half-loaded weights are no version at all
        self._loading, self._loaded = version, asyncio.Event()
        try:
            t0 = time.perf_counter()
            buf = self.versions.held(version)
            if buf is not None:
                self.weights_switches += 1
                how, nbytes, copy_s, cpu_s, by, mapped = "kept", 0, 0.0, 0.0, "", False
            else:
                buf = await self.versions.slot_for(version)
                if peer is not None and (borrowed := await self._borrow(peer, version, buf)):
                    nbytes, copy_s, cpu_s, mapped = (borrowed.nbytes, borrowed.copy_s, borrowed.cpu_s,
                                                     borrowed.mapped)
                    self.weights_peer_copies += 1
                    self.peer_bytes += nbytes
                    self.peer_s += time.perf_counter() - t0
                    how, by = "peer", peer.worker
                else:
                    t1 = time.perf_counter()  # after a failed peer copy: the store's part alone
                    if self._staging is None:
                        await self.store.get_weights(version, out=buf.arrays)
                    else:
                        host, arrays = self._staging
                        await self.store.get_weights(version, out=arrays)
                        buf.flat.copy_(host)
                        torch.cuda.synchronize(self.device)
                    self.weights_fetches += 1
                    how, by, mapped, cpu_s = "store", "", False, 0.0
                    nbytes, copy_s = buf.nbytes, time.perf_counter() - t1
                buf.version = version
            self.versions.use(buf)
            self.version = version
            log_line(self._weights_log, self.worker_id, version, how, nbytes, time.perf_counter() - t0,
                     copy_s, cpu_s, mapped, by)
        finally:
            self._loading = None
            self._loaded.set()

    async def _borrow(self, peer: m.WeightsPeer, version: int, buf) -> Borrowed | None:
        """Copy ``version`` from ``peer`` into ``buf``; None when it could not."""
        try:
            return await borrow(peer, version, buf, self._maps, self.recipe.runtime.peer_weights_s,
                                delay_s=self.borrow_delay_s)
        except (SpotlightError, OSError) as e:
            log.warning("%s: version %d from peer %s failed (%s: %s); fetching it from the store",
                        self.worker_id, version, peer.worker, type(e).__name__, e)
            return None

    async def lend_weights(self, version: int) -> m.WeightsLent:
        """A neighbour asks for ``version``: lend the buffer holding it (current or kept), after
        this worker's own load of it when one is in progress, pinned until the neighbour returns it.
        ``NotFound`` when it holds neither."""
        log_line(self._weights_log, self.worker_id, version, "lend")
        if self.lend_delay_s:  # a modelled slow lender (runtime.lend_delay_s)
            await asyncio.sleep(self.lend_delay_s)
        while self._loading == version:
            await self._loaded.wait()
        buf = self.versions.held(version)
        if buf is None:
            held = sorted(self.versions.versions())
            raise NotFound(f"{self.worker_id} holds versions {held}, not {version}")
        return lent_message(version, self.versions.pin(buf), buf)

    def weights_returned(self, token: str) -> None:
        """A neighbour copied the version it was lent under ``token``."""
        self.versions.unpin(token)

    # --- requests ------------------------------------------------------------------------------
    def progress(self) -> m.WorkerProgress:
        return m.WorkerProgress(
            request_id=self.request_id,
            attempt=self.attempt,
            committed_step=self.committed_step,
            version=self.version,
            weights_fetches=self.weights_fetches,
            weights_peer_copies=self.weights_peer_copies,
            peer_bytes=self.peer_bytes,
            peer_s=self.peer_s,
        )

    async def stop(self) -> m.WorkerProgress:
        """Spot notice: let the running step finish, flush its commit, stop; no new requests.
        Raises TimeoutError after ``runtime.worker_stop_s`` (the leave budget's share for it)."""
        self._stop = True
        async with asyncio.timeout(self.recipe.runtime.worker_stop_s):
            await self._idle.wait()
            await self.store.flush()
        return self.progress()

    def cancel(self, request_id: str, attempt: int) -> None:
        """The lease of ``request_id`` (``attempt``) was revoked: if it is the running request, it
        stops after the step in flight (an exploration; its ``run`` raises ``Cancelled``)."""
        if self.request_id != request_id or self.attempt != attempt:
            self._revoked = (request_id, attempt)  # arrived before its run began (or after it ended)
        elif not self._cancel.is_set():
            self._cancel.set()
            self._cancelled_after = self._explore_step

    async def run(self, lease: m.LeaseGrant, group: m.SpGroup | None = None,
                  peer: m.WeightsPeer | None = None) -> m.WorkResult:
        """Run ``lease`` alone, or as one rank of the SP ``group`` (rollouts only); ``peer``: a
        worker of this node to copy the lease's weights version from (else the store)."""
        if self._stop:
            raise Preempted("worker is stopping")
        if not self._idle.is_set():
            raise ProtocolError(f"worker busy with {self.request_id}; one request at a time")
        self._idle.clear()
        self.request_id, self.attempt, self.committed_step = lease.request_id, lease.attempt, None
        self._cancel = threading.Event()
        if self._revoked == (lease.request_id, lease.attempt):
            self._cancel.set()
            self._cancelled_after = 0
        t0 = time.perf_counter()
        try:
            await self.load_weights(lease.work.version, peer)
            await asyncio.sleep(0)  # neighbours waiting to borrow this version: lend before computing
            if isinstance(lease.work, m.ExploreWork):
                result = await self._explore(lease)
            elif group is None or group.size == 1:
                result = await self._rollout(lease, lease.work)
            else:
                async with self.sp.joined(group):
                    result = await self._rollout(lease, lease.work, group)
            # Time inside the worker, and the part of it spent computing (model, sampler, reward):
            # the rest, and everything outside the worker, is the runtime's overhead.
            result.worker_s = time.perf_counter() - t0
            return result
        finally:
            self.request_id = None
            self._idle.set()

    async def _explore(self, lease: m.LeaseGrant) -> m.ExploreResult:
        """The exploration job, on a compute thread so the loop answers status, stop and cancel
        meanwhile; between two denoising steps it stops for a revoked lease (``Cancelled``) or a
        spot notice (``Preempted``), so the worker is free after at most the step in flight."""
        job, cancel, delay, total = lease.work, self._cancel, self.step_delay_s, self.recipe.sampler.steps
        self._explore_step = 0

        def between_steps(k: int) -> None:
            if delay:
                time.sleep(delay)  # a modelled slower device: the step takes this much longer
            self._explore_step = k
            if cancel.is_set():
                raise Cancelled(f"{lease.request_id}: exploration cancelled after step {k} of {total} "
                                f"(the cancel arrived after step {self._cancelled_after})")
            if self._stop:
                raise Preempted(f"{lease.request_id}: exploration stopped after step {k} of {total}")

        t0 = time.perf_counter()
        await fetch_prompts(self.store, self.model, [job.prompt])
        try:
            explored = await asyncio.to_thread(work.explore, self.model, job, self.recipe.sampler,
                                               self.reward, self.shape, between_steps)
        except Cancelled as e:
            log.warning("%s", e)  # the node's log: where the cancel arrived and where the job stopped
            raise
        return m.ExploreResult(
            rewards=[float(r) for r in explored.rewards],
            model_calls=explored.model_calls,
            compute_s=time.perf_counter() - t0,
        )

    async def _rollout(self, lease: m.LeaseGrant, job: m.RolloutWork,
                       group: m.SpGroup | None = None) -> m.RolloutResult:
        rid = lease.request_id
        first = group is None or group.rank == 0  # commits, logs, scores and seals
        meta = {
            "version": self.version,
            "seeds": list(job.seeds),
            "prompt": job.prompt,
            "worker": self.worker_id,
        }
        if group is not None:
            meta["group"] = list(group.members)
        state = await self._resume(lease, meta)
        if state is None and (lease.attempt > 1 or lease.resume_step is not None):
            sealed = await self._sealed(lease, meta)
            if sealed is not None:  # an earlier attempt finished and sealed it, then lost its lease
                return sealed
        t0 = time.perf_counter()
        await fetch_prompts(self.store, self.model, [job.prompt])
        rollout = work.Rollout(self.model, job, self.recipe.sampler, self.shape, state)
        compute_s = time.perf_counter() - t0
        base = None  # this attempt's first commit is the whole state; later ones append a step
        while not rollout.done:
            stop = self._stop or self.sp.left(group)
            if group is not None:  # the ranks stop at the same step boundary
                stop = await self._sp(self.sp.agree(stop))
            if stop:
                await self.store.flush()
                kept = "committed" if self.step_commits else "not committed: it starts over"
                raise Preempted(f"{rid}: stopped after step {rollout.state.step} ({kept})")
            t0 = time.perf_counter()
            state = rollout.step() if group is None else await self._sp(self.sp.compute(rollout.step))
            compute_s += time.perf_counter() - t0
            if not first:
                continue
            if self._step_log is not None:
                os.write(self._step_log, f"{rid} {lease.attempt} {state.step}\n".encode())
            if not self.step_commits and not rollout.done:
                await asyncio.sleep(self.step_delay_s)  # yield: stop/status run between steps
                continue
            # The sampler never writes into a past step's tensors, so the store client may own
            # these (views, no copy) while the next step runs.
            if base is None:
                latents, log_probs = work.trajectory(state)
                rows = {"latents": latents, "log_probs": log_probs}
            else:  # host memory (no copy on the CPU)
                rows = {"latents": state.latents[-1][None].cpu(),
                        "log_probs": state.log_probs[-1][None].cpu()}
            # The step's wall time rides in the commit's meta (when a resumed request's first step
            # was done, read without polling the store; bench/elastic_sp.py).
            self.store.commit_nowait(rid, state.step, rows, {**meta, "stepped_at": time.time()},
                                     attempt=lease.attempt, base=base)
            self.committed_step = base = state.step
            await asyncio.sleep(self.step_delay_s)  # yield: the flusher sends, stop/status run

        if not first:  # the first rank scores and seals; its result is the group's
            return m.RolloutResult(key=trajectory_key(rid), nbytes=0, rewards=[],
                                   resumed_from=rollout.resumed_from, compute_s=compute_s)
        t0 = time.perf_counter()
        rewards, credit = await rollout.scores_async(self.reward)
        compute_s += time.perf_counter() - t0
        key = trajectory_key(rid)
        # The final commit becomes the trajectory in the store: nothing is sent twice.
        await self.store.seal_commit(
            rid, rollout.state.step, key, {"rewards": rewards, "credit": credit},
            {**meta, "attempt": lease.attempt},
        )
        nbytes = sum(x.nbytes for x in (*rollout.state.latents, *rollout.state.log_probs, rewards, credit))
        return m.RolloutResult(
            key=key,
            nbytes=nbytes,
            rewards=[float(r) for r in rewards],
            resumed_from=rollout.resumed_from,
            compute_s=compute_s,
        )

    async def _sp(self, call):
        """An SP group's step or agreement, awaited: it runs off the loop's thread and may wait
        on a peer. A failed collective raises ``GroupBroken`` (the agent regroups; anything else
        is the request's failure); the first rank's commits so far are flushed before, so the
        group that resumes the request finds them."""
        try:
            return await call
        except Exception as e:
            with contextlib.suppress(Exception):
                await self.store.flush()
            raise GroupBroken(f"{type(e).__name__}: {e}") from e

    async def _sealed(self, lease: m.LeaseGrant, meta: dict[str, Any]) -> m.RolloutResult | None:
        """The trajectory an earlier attempt sealed (its worker died between the seal and the
        queue's complete), when it is for these weights and seeds: nothing is computed again."""
        try:
            traj, got = await self.store.get(trajectory_key(lease.request_id))
        except NotFound:
            return None
        if got.get("version") != meta["version"] or list(got.get("seeds", [])) != meta["seeds"]:
            return None
        log.info("%s attempt %d: sealed by attempt %s; returning it", lease.request_id, lease.attempt,
                 got.get("attempt"))
        steps = int(traj["log_probs"].shape[0])
        return m.RolloutResult(key=trajectory_key(lease.request_id),
                               nbytes=sum(x.nbytes for x in traj.values()),
                               rewards=[float(r) for r in traj["rewards"]], resumed_from=steps)

    async def _resume(self, lease: m.LeaseGrant, meta: dict[str, Any]):
        """The state of the newest commit of this request, if it was made with these weights."""
        from spotlight.policy.sampler import RolloutState

        if lease.resume_step is None and lease.attempt <= 1:
            return None  # first delivery: nothing can have been committed
        held = await self.store.get_commit(lease.request_id)
        if held is None:
            return None
        step, tensors, got = held
        if got.get("version") != meta["version"] or list(got.get("seeds", [])) != meta["seeds"]:
            log.warning(
                "%s: commit at step %d is for version %s, not %s; starting over",
                lease.request_id,
                step,
                got.get("version"),
                meta["version"],
            )
            return None
        lat = torch.from_numpy(np.array(tensors["latents"])).to(self.device)  # own, writable copies
        lps = torch.from_numpy(np.array(tensors["log_probs"])).to(self.device)
        self.committed_step = step
        log.info("%s attempt %d resumes from step %d", lease.request_id, lease.attempt, step)
        return RolloutState(x=lat[-1], step=step, latents=list(lat.unbind(0)), log_probs=list(lps.unbind(0)))
