"""The GPU worker: holds the policy at one weights version and runs leased requests on it.

- ``WorkerCore``: the logic. A rollout request (prompt, seeds, weights version) runs step by step
  with ``sampler.sde_advance``; after EVERY step the state (latents so far [k+1, G, C, H, W],
  log-probs so far [k, G], step, seeds, version) is handed to the store client's
  ``commit_nowait``; the step then yields once to the event loop so the flusher hands the state
  to ZeroMQ, whose I/O thread transmits it while the next step computes. (The math runs on the
  loop's thread: a separate compute thread fought the loop for the GIL and cost 6-10 ms per
  rollout request on the tiny model.) An attempt's first commit carries the whole state, every
  later one only the new step's latent and log-prob, appended in the store (O(K) bytes per
  request, not O(K²)). Status and stop messages are answered between steps. A re-delivered
  request (attempt > 1 or a resume reference) resumes from the store's newest commit; the
  sampler's counter-based noise makes the result bit-identical to an uninterrupted run. At the
  end it scores the sample and seals the final commit as the trajectory under
  ``traj/<request_id>``: latents [K+1, G, C, H, W] and log_probs [K, G] (step-major, as
  committed) plus rewards [G]. An exploration request is one ``sampler.sample`` + reward; its
  rewards travel in the result.
- ``serve`` / ``main``: the process shell (``python -m spotlight.actors.worker``): an ipc
  ``RpcServer`` its node agent drives with WorkerRun / WorkerStatus / WorkerStop.

Weights: a request names its version; the worker loads that version before the first step
(straight into its parameters' memory) and never changes weights inside a request.

This module knows the sampler, the model and the store; it knows nothing of queues or leases
beyond the LeaseGrant it is handed (the agent talks to the queue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import torch

from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm import messages as m
from spotlight.errors import Preempted, ProtocolError
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


def build_policy_model(recipe: Recipe):
    """The trainer's model architecture (incl. a LoRA adapter under LoRA fine-tuning), so that
    the trainer's ``state_dict`` loads into it key for key."""
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import build_model
    from spotlight.policy.grpo import LORA_TARGETS

    model = build_model(recipe.model, VOCABULARY)
    g = recipe.grpo
    if g.finetune == "lora":
        from peft import LoraConfig

        model.dit.add_adapter(LoraConfig(r=g.lora_rank, lora_alpha=g.lora_alpha, init_lora_weights="gaussian",
                                         target_modules=LORA_TARGETS))
    return model.requires_grad_(False)


def trajectory_key(request_id: str) -> str:
    return f"traj/{request_id}"


class WorkerCore:
    """Runs one request at a time on its model; ``store`` is an open ``TensorStoreClient``."""

    def __init__(self, recipe: Recipe, store: TensorStoreClient, model=None, *, worker_id: str = "worker",
                 step_delay_s: float = 0.0) -> None:
        from spotlight.rewards.config import load_reward

        self.recipe, self.store, self.worker_id = recipe, store, worker_id
        # Fault injection only (a slow device): lets tests land a kill between two steps.
        self.step_delay_s = step_delay_s
        self.model = model if model is not None else build_policy_model(recipe)
        self.reward = load_reward(recipe.reward)
        c = recipe.model
        self.shape = (c.channels, c.image_size, c.image_size)
        # numpy views on the parameters: get_weights(out=...) fills the model without a copy.
        self._params = {k: v.detach().numpy() for k, v in self.model.state_dict().items()}
        self.version: int | None = None
        self.request_id: str | None = None
        self.attempt = 0
        self.committed_step: int | None = None
        self._stop = False
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        """Nothing to release today; kept so a device backend can free its resources here."""

    # --- weights -------------------------------------------------------------------------------
    async def load_weights(self, version: int) -> None:
        if self.version == version:
            return
        self.version = None  # half-loaded weights are no version at all
        await self.store.get_weights(version, out=self._params)
        self.version = version

    # --- requests ------------------------------------------------------------------------------
    def progress(self) -> m.WorkerProgress:
        return m.WorkerProgress(request_id=self.request_id, attempt=self.attempt,
                                committed_step=self.committed_step, version=self.version)

    async def stop(self, timeout: float = 1.5) -> m.WorkerProgress:
        """Spot notice: let the running step finish, flush its commit, stop; no new requests."""
        self._stop = True
        async with asyncio.timeout(timeout):
            await self._idle.wait()
            await self.store.flush()
        return self.progress()

    async def run(self, lease: m.LeaseGrant) -> dict[str, Any]:
        if self._stop:
            raise Preempted("worker is stopping")
        if not self._idle.is_set():
            raise ProtocolError(f"worker busy with {self.request_id}; one request at a time")
        self._idle.clear()
        self.request_id, self.attempt, self.committed_step = lease.request_id, lease.attempt, None
        t0 = time.perf_counter()
        try:
            await self.load_weights(int(lease.payload["version"]))
            if lease.kind == "explore":
                result = await self._explore(lease.payload)
            else:
                result = await self._rollout(lease)
            # Time inside the worker, and the part of it spent computing (model, sampler, reward):
            # the rest, and everything outside the worker, is the runtime's overhead.
            return {**result, "worker_s": time.perf_counter() - t0}
        finally:
            self.request_id = None
            self._idle.set()

    async def _explore(self, p: dict[str, Any]) -> dict[str, Any]:
        from spotlight.policy.sampler import sample
        from spotlight.rewards.base import to_uint8_images

        s, seeds = self.recipe.sampler, list(p["seeds"])
        prompts = [p["prompt"]] * len(seeds)

        t0 = time.perf_counter()
        x = sample(self.model, prompts, seeds, self.shape, s.steps, s.shift, noise_level=s.noise_level,
                   effective_steps=p.get("effective_steps"), sde_steps=s.sde_steps, noise_patch=s.noise_patch,
                   init_seed=p.get("init_seed"))
        rewards = self.reward(to_uint8_images(x), prompts)
        return {"rewards": [float(r) for r in rewards], "compute_s": time.perf_counter() - t0}

    async def _rollout(self, lease: m.LeaseGrant) -> dict[str, Any]:
        from spotlight.policy.sampler import sde_advance, start
        from spotlight.rewards.base import to_uint8_images

        p, cfg, rid = lease.payload, self.recipe.sampler, lease.request_id
        seeds, prompts = list(p["seeds"]), [p["prompt"]] * len(p["seeds"])
        meta = {"version": self.version, "seeds": seeds, "prompt": p["prompt"], "worker": self.worker_id}
        state = await self._resume(lease, meta)
        resumed_from = 0 if state is None else state.step
        t0 = time.perf_counter()
        state = state or start(seeds, self.shape, init_seed=p.get("init_seed"))
        with torch.no_grad():
            text = self.model.encode(prompts)
        compute_s = time.perf_counter() - t0
        base = None  # this attempt's first commit is the whole state; later ones append a step
        while state.step < cfg.steps:
            if self._stop:
                await self.store.flush()
                raise Preempted(f"{rid}: stopped after step {state.step} (committed)")
            t0 = time.perf_counter()
            sde_advance(self.model, state, text, seeds, cfg)
            compute_s += time.perf_counter() - t0
            # The sampler never writes into a past step's tensors, so the store client may own
            # these (views, no copy) while the next step runs.
            if base is None:
                rows = {"latents": torch.stack(state.latents), "log_probs": torch.stack(state.log_probs)}
            else:
                rows = {"latents": state.latents[-1][None], "log_probs": state.log_probs[-1][None]}
            self.store.commit_nowait(rid, state.step, rows, meta, attempt=lease.attempt, base=base)
            self.committed_step = base = state.step
            await asyncio.sleep(self.step_delay_s)  # yield: the flusher sends, stop/status run

        t0 = time.perf_counter()
        rewards = np.asarray(self.reward(to_uint8_images(state.latents[-1].clamp(-1, 1)), prompts), np.float32)
        compute_s += time.perf_counter() - t0
        key = trajectory_key(rid)
        # The final commit becomes the trajectory in the store: nothing is sent twice.
        await self.store.seal_commit(rid, state.step, key, {"rewards": rewards}, {**meta, "attempt": lease.attempt})
        return {"key": key, "rewards": [float(r) for r in rewards], "resumed_from": resumed_from, "compute_s": compute_s}

    async def _resume(self, lease: m.LeaseGrant, meta: dict[str, Any]):
        """The state of the newest commit of this request, if it was made with these weights."""
        from spotlight.policy.sampler import RolloutState

        if lease.resume is None and lease.attempt <= 1:
            return None  # first delivery: nothing can have been committed
        held = await self.store.get_commit(lease.request_id)
        if held is None:
            return None
        step, tensors, got = held
        if got.get("version") != meta["version"] or list(got.get("seeds", [])) != meta["seeds"]:
            log.warning("%s: commit at step %d is for version %s, not %s; starting over",
                        lease.request_id, step, got.get("version"), meta["version"])
            return None
        lat = torch.from_numpy(np.array(tensors["latents"]))  # own, writable copies
        lps = torch.from_numpy(np.array(tensors["log_probs"]))
        self.committed_step = step
        log.info("%s attempt %d resumes from step %d", lease.request_id, lease.attempt, step)
        return RolloutState(x=lat[-1], step=step, latents=list(lat.unbind(0)), log_probs=list(lps.unbind(0)))
