"""The work of an iteration, defined once: "run this explore job / this rollout job on this model".

The in-process executor (``spotlight.loop.LocalExecutor``) and the runtime's GPU worker
(``spotlight.actors.worker``) call the same functions here with the same job messages and the same
config objects, so the bit-identity of the two paths holds by construction, not by keeping copies
in agreement:

- ``policy_model(recipe)``, ``recipe_reward(recipe)``: the trainer's architecture (the LoRA adapter
  included) for a worker, and the recipe's reward, built the same way everywhere;
- ``explore(model, job, sampler, reward, shape)``: one prompt's candidate seeds scored;
- ``Rollout``: one prompt's group, step by step (the worker commits between steps; the in-process
  executor just runs them), then scored;
- ``trajectory(state)`` / ``group(job, latents, log_probs, rewards)``: the step-major trajectory
  tensors a worker commits, and the trainer's ``Group`` built from them — from memory in-process,
  from the tensor store in the runtime.

Jobs are the wire's work messages (``spotlight.comm.messages.ExploreWork`` / ``RolloutWork``): each
names its prompt, seeds, shared initial noise and the weights version it must run with.

This module knows the model, the sampler and the reward; nothing of queues, stores or processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spotlight.comm.messages import ExploreWork, RolloutWork
from spotlight.policy.caching import StepCache, step_cache
from spotlight.policy.grpo import Group, add_lora
from spotlight.policy.sampler import RolloutState, SamplerConfig, sample_policy, sde_advance, start, to_images
from spotlight.rewards.base import column_scores, column_scores_async, to_uint8_images


def batch_name(iteration: int, phase: str) -> str:
    """The queue batch of an iteration's phase ("explore", "check", "rollout");
    ``batch_iteration`` reads the iteration back."""
    return f"it{iteration}/{phase}"


def batch_iteration(batch: str) -> int | None:
    """The iteration of a ``batch_name`` batch; None for a batch named otherwise (a bench's)."""
    head = batch.split("/", 1)[0]
    return int(head[2:]) if head.startswith("it") and head[2:].isdigit() else None


def recipe_model(cfg) -> Any:
    """The model a recipe's ``[model]`` names, as a run starts from it: a diffusers pipeline folder
    (``model.pipeline``: ``spotlight.pipelines``) or the embedded DiT (``spotlight.models.dit``)."""
    if cfg.pipeline is not None:
        from spotlight.pipelines.model import load_pipeline_model

        return load_pipeline_model(cfg)
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import build_model

    return build_model(cfg, VOCABULARY)


def policy_model(recipe) -> Any:
    """The trainer's model architecture (with the LoRA adapter under LoRA fine-tuning, frozen), so
    the trainer's ``state_dict`` loads into it key for key."""
    model = recipe_model(recipe.model)
    if recipe.grpo.finetune == "lora":
        add_lora(model, recipe.grpo)
    return model.requires_grad_(False)


def recipe_reward(recipe):
    """The recipe's reward, built the one way the trainer, the in-process executor and every
    worker process build it."""
    from spotlight.rewards.config import load_reward

    return load_reward(recipe.reward)


def image_shape(recipe) -> tuple[int, int, int]:
    """The sampler's state shape: pixels, or a pipeline's normalised latent."""
    c = recipe.model
    if c.pipeline is not None:
        from spotlight.pipelines.folder import read_folder

        return read_folder(c.pipeline).latent_shape(c.image_size)
    return c.shape


@dataclass(slots=True)
class Explored:
    """An explore job's outcome: rewards [M] in seed order, and the DiT calls that ran every block's
    attention (all steps without a cache)."""

    rewards: np.ndarray
    model_calls: int


@torch.no_grad()
def explore(model, job: ExploreWork, sampler: SamplerConfig, reward, shape, between_steps=None) -> Explored:
    """The job's candidate seeds scored: sampled with the rollout policy from the group's shared x_1
    (when it has one), through the job's step cache (``job.cache``; None = full steps).
    ``between_steps(k)`` runs after each denoising step k; what it raises ends the job
    (``spotlight.policy.sampler.sample``)."""
    prompts = [job.prompt] * len(job.seeds)
    cache = None if job.cache is None else StepCache.parse(job.cache)
    with step_cache(model, cache) as cached:
        x = sample_policy(cached, prompts, list(job.seeds), sampler, shape, init_seed=job.init_seed,
                          between_steps=between_steps)
    return Explored(np.asarray(reward(to_uint8_images(x), prompts), dtype=np.float32), cached.stats.computed)


class Rollout:
    """One rollout job, a denoising step at a time: ``while not r.done: r.step()``, then
    ``r.rewards(reward)``. ``state`` resumes from a committed step (counter-based noise: the end is
    bit-identical to an uninterrupted run)."""

    def __init__(
        self, model, job: RolloutWork, sampler: SamplerConfig, shape, state: RolloutState | None = None
    ) -> None:
        self.model, self.job, self.sampler = model, job, sampler
        self.seeds = list(job.seeds)
        self.prompts = [job.prompt] * len(self.seeds)
        device = next(model.parameters()).device
        self.state = state or start(self.seeds, shape, device, init_seed=job.init_seed)
        self.resumed_from = self.state.step
        with torch.no_grad():
            self.text = model.encode(self.prompts)

    @property
    def done(self) -> bool:
        return self.state.step >= self.sampler.steps

    def step(self) -> RolloutState:
        """Run the next denoising step (the sampler never writes into a past step's tensors)."""
        return sde_advance(self.model, self.state, self.text, self.seeds, self.sampler)

    @torch.no_grad()
    def images(self) -> np.ndarray:
        """The group's final samples as the reward sees them: uint8 [B, H, W, 3], decoded by the
        model (a pipeline's VAE) when it works in a latent space."""
        return to_uint8_images(to_images(self.model, self.state.latents[-1]))

    def scores(self, reward) -> tuple[np.ndarray, np.ndarray]:
        """(rewards float32 [G], per-column credit float32 [G, W]): ``column_scores`` of the group's
        final images."""
        return column_scores(reward, self.images(), self.prompts)

    async def scores_async(self, reward) -> tuple[np.ndarray, np.ndarray]:
        """``scores``, awaited (``column_scores_async``): a reward with its own thread pool (ocr)
        scores while the caller's event loop keeps running."""
        return await column_scores_async(reward, self.images(), self.prompts)


def rollout(model, job: RolloutWork, sampler: SamplerConfig, reward, shape) -> Group:
    """The whole job in one go (the in-process executor): every step, then the rewards."""
    r = Rollout(model, job, sampler, shape)
    while not r.done:
        r.step()
    latents, log_probs = trajectory(r.state)
    return group(job, latents, log_probs, *r.scores(reward))


def trajectory(state: RolloutState) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-major latents [K+1, G, C, H, W] and log-probs [K, G] of a rollout so far, in host
    memory (what the store and the trainer's groups hold; no copy on the CPU)."""
    return torch.stack(state.latents).cpu(), torch.stack(state.log_probs).cpu()


def group(job: RolloutWork, latents, log_probs, rewards, credit=None) -> Group:
    """The trainer's ``Group`` ([G, steps, ...] writable tensors) from a step-major trajectory,
    whether it comes from memory or from the tensor store (numpy views); ``credit`` the rewards'
    per-column credit [G, W] (None: a trajectory stored without one)."""
    lat, lps = (
        torch.as_tensor(np.ascontiguousarray(np.asarray(x).swapaxes(0, 1))) for x in (latents, log_probs)
    )
    return Group(job.prompt, list(job.seeds), lat, lps, torch.as_tensor(np.array(rewards, dtype=np.float32)),
                 None if credit is None else torch.as_tensor(np.array(credit, dtype=np.float32)))
