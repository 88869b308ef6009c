"""The GRPO iteration loop: seeds → rollout → reward → update → (evaluate, checkpoint).

`Loop` is the same for every mode; where the tensor work happens is the `Executor`'s business.
`LocalExecutor` does it in this process (the reference); the runtime's executor sends the same
work as requests through the queue to workers (spotlight.actors.controller). Baselines are
switches of the recipe (explore.enabled, run.mode), never separate loops.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from spotlight import checkpoint
from spotlight.data.prompts import prompt_set
from spotlight.data.scenes import VOCABULARY
from spotlight.evaluation import Evaluator
from spotlight.models.dit import DiffusionModel, build_model
from spotlight.policy.grpo import Group, GRPOTrainer
from spotlight.policy.sampler import sample, sde_rollout
from spotlight.policy.seeds import candidate_seeds, select_contrast
from spotlight.recipe import Recipe
from spotlight.report import MetricsLog, plot_rewards
from spotlight.rewards.base import to_uint8_images as to_uint8
from spotlight.rewards.config import load_reward

INIT_STREAM = 2_000  # seed stream of a group's shared initial noise


@dataclass(slots=True)
class ExploreJob:
    prompt: str
    seeds: list[int]
    effective_steps: int | None
    init_seed: int | None = None  # shared x_1 of the group (sampler.shared_init), else per-seed


@dataclass(slots=True)
class RolloutJob:
    prompt: str
    seeds: list[int]
    init_seed: int | None = None


class Executor(Protocol):
    """Runs the batch work of an iteration; every job is one batch (prompt × seeds)."""

    def explore(self, jobs: list[ExploreJob]) -> list[np.ndarray]: ...
    def rollout(self, jobs: list[RolloutJob]) -> list[Group]: ...
    def publish(self, version: int) -> None: ...


class LocalExecutor:
    """Does the work in this process with the trainer's model (always the fresh weights)."""

    def __init__(self, model: DiffusionModel, recipe: Recipe, reward):
        self.model, self.recipe, self.reward = model, recipe, reward
        c = recipe.model
        self.shape = (c.channels, c.image_size, c.image_size)

    def explore(self, jobs: list[ExploreJob]) -> list[np.ndarray]:
        s = self.recipe.sampler
        out = []
        for job in jobs:
            x = sample(self.model, [job.prompt] * len(job.seeds), job.seeds, self.shape, s.steps, s.shift,
                       noise_level=s.noise_level, effective_steps=job.effective_steps, sde_steps=s.sde_steps, noise_patch=s.noise_patch,
                       init_seed=job.init_seed, sde_type=s.sde_type)
            out.append(self.reward(to_uint8(x), [job.prompt] * len(job.seeds)))
        return out

    def rollout(self, jobs: list[RolloutJob]) -> list[Group]:
        groups = []
        for job in jobs:
            prompts = [job.prompt] * len(job.seeds)
            st = sde_rollout(self.model, prompts, job.seeds, self.recipe.sampler, self.shape, init_seed=job.init_seed)
            rewards = self.reward(to_uint8(st.latents[-1].clamp(-1, 1)), prompts)
            groups.append(make_group(job, st.latents, st.log_probs, rewards))
        return groups

    def publish(self, version: int) -> None:
        pass  # the local executor samples with the trainer's own model


def make_group(job: RolloutJob, latents, log_probs, rewards) -> Group:
    lat = torch.stack(list(latents), 1) if isinstance(latents, (list, tuple)) else latents
    lps = torch.stack(list(log_probs), 1) if isinstance(log_probs, (list, tuple)) else log_probs
    return Group(job.prompt, list(job.seeds), lat, lps, torch.as_tensor(np.asarray(rewards), dtype=torch.float32))


class Loop:
    """One run. `run()` returns the summary; `hooks` get every metrics record as it is written."""

    def __init__(self, recipe: Recipe, executor_factory: Callable | None = None, resume: bool = False,
                 hooks: list[Callable[[dict], None]] | None = None, progress: bool = True):
        self.recipe, self.hooks, self.progress = recipe, list(hooks or []), progress
        r = recipe.run
        torch.manual_seed(r.seed)
        self.prompts = prompt_set(r.prompts)
        self.reward = load_reward(recipe.reward)
        self.model = build_model(recipe.model, VOCABULARY)
        self.trainer = GRPOTrainer(self.model, recipe.grpo, recipe.sampler, seed=r.seed)
        self.out = Path(r.out_dir) / r.name
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.start_iteration = 0
        self.wall_offset = 0.0
        if resume:
            self.start_iteration, self.wall_offset = checkpoint.load_latest(self.out / "checkpoints", self.model,
                                                                           self.trainer)
            self.metrics.truncate_after(self.start_iteration - 1)
        elif self.metrics.path.exists():
            self.metrics.path.unlink()  # a fresh run owns its folder's metrics
        c = recipe.model
        self.shape = (c.channels, c.image_size, c.image_size)
        self.executor = (executor_factory or (lambda loop: LocalExecutor(loop.model, recipe, loop.reward)))(self)
        self.evaluator = Evaluator(self.model, recipe, self.reward, self.out)

    # --- one iteration -----------------------------------------------------------------------
    def iteration_prompts(self, it: int) -> list[str]:
        n = self.recipe.run.prompts_per_iteration
        if n >= len(self.prompts):
            return list(self.prompts)
        return random.Random(self.recipe.run.seed * 7919 + it).sample(self.prompts, n)

    def init_seeds(self, it: int, prompts: list[str]) -> list[int | None]:
        """Each group's shared initial-noise seed when sampler.shared_init, else None."""
        if not self.recipe.sampler.shared_init:
            return [None] * len(prompts)
        return [candidate_seeds(self.recipe.run.seed, it, self.prompts.index(p), 1, stream=INIT_STREAM)[0]
                for p in prompts]

    def plan_seeds(self, it: int, prompts: list[str], inits: list[int | None]) -> tuple[list[list[int]], dict]:
        r, e = self.recipe.run, self.recipe.explore
        idx = [self.prompts.index(p) for p in prompts]
        if not e.enabled:
            return [candidate_seeds(r.seed, it, i, r.group_size) for i in idx], {}
        cands = [candidate_seeds(r.seed, it, i, e.candidates) for i in idx]
        scores = self.executor.explore([ExploreJob(p, c, e.effective_steps, init)
                                        for p, c, init in zip(prompts, cands, inits)])
        chosen = [select_contrast(c, s, r.group_size) for c, s in zip(cands, scores)]
        spread = [float(np.std(np.asarray(s)[[c.index(x) for x in ch]])) for c, s, ch in zip(cands, scores, chosen)]
        return chosen, {"explore_spread": float(np.mean(spread)),
                        "explore_candidates_std": float(np.mean([np.std(s) for s in scores]))}

    def step(self, it: int) -> dict:
        t0 = time.monotonic()
        prompts = self.iteration_prompts(it)
        inits = self.init_seeds(it, prompts)
        seeds, explore_stats = self.plan_seeds(it, prompts, inits)
        t1 = time.monotonic()
        groups = self.executor.rollout([RolloutJob(p, s, init) for p, s, init in zip(prompts, seeds, inits)])
        t2 = time.monotonic()
        train = self.trainer.update(groups)
        self.executor.publish(it + 1)
        t3 = time.monotonic()
        rewards = torch.stack([g.rewards for g in groups])
        return {"event": "iteration", "iteration": it, "reward_mean": float(rewards.mean()),
                "group_spread": float(rewards.std(1, unbiased=False).mean()),
                "rewards": [[round(float(x), 6) for x in g.rewards] for g in groups],
                "explore_s": t1 - t0, "rollout_s": t2 - t1, "train_s": t3 - t2, **explore_stats, **train}

    def evaluate(self, it: int, save_samples: bool = True) -> dict:
        """ODE on held-out prompts (the headline, `eval_reward`), ODE on training prompts, the SDE
        policy, flow-matching drift: spotlight.evaluation."""
        return self.evaluator(it, save_samples)

    # --- the run ----------------------------------------------------------------------------
    def emit(self, record: dict, start: float) -> None:
        record["wall_s"] = round(self.wall_offset + time.monotonic() - start, 3)
        self.metrics.write(record)
        for hook in self.hooks:
            hook(record)

    def run(self) -> dict:
        from tqdm import tqdm

        r = self.recipe.run
        start = time.monotonic()
        if self.start_iteration == 0:
            self.emit(self.evaluate(0), start)
        it = self.start_iteration
        bar = tqdm(range(self.start_iteration, r.iterations), disable=not self.progress, desc=r.name, unit="it")
        for it in bar:
            rec = self.step(it)
            self.emit(rec, start)
            bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", spread=f"{rec['group_spread']:.3f}")
            done = it + 1
            out_of_time = r.minutes is not None and (time.monotonic() - start) / 60 >= r.minutes
            last = done == r.iterations or out_of_time
            if done % r.eval_every == 0 or last:
                ev = self.evaluate(done)
                self.emit(ev, start)
                bar.write(f"iteration {done}: held-out ODE {ev['eval_reward']:.3f} ± {ev['eval_reward_std']:.3f}, "
                          f"train ODE {ev['eval_ode_train']:.3f}, SDE {ev['eval_sde_train']:.3f}, "
                          f"FM drift {ev.get('fm_drift', 0.0):+.1%}")
            if done % r.checkpoint_every == 0 or last:
                checkpoint.save(self.out / "checkpoints", done, self.model, self.trainer,
                                self.wall_offset + time.monotonic() - start)
            if out_of_time:
                break
        bar.close()
        records = self.metrics.read()
        plot_rewards(records, self.out / "reward.png")
        evals = [x for x in records if x["event"] == "eval"]
        return {"out": str(self.out), "base_reward": evals[0]["eval_reward"], "final_reward": evals[-1]["eval_reward"],
                "final_reward_std": evals[-1]["eval_reward_std"], "iterations": evals[-1]["iteration"],
                "wall_s": records[-1]["wall_s"]}
