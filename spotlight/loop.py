"""The GRPO iteration loop: seeds → rollout → reward → update → (evaluate, checkpoint).

`Loop` is the iteration driver, the same for every mode; where the tensor work happens is the
`Executor`'s business. Work is submitted as batches of typed jobs (`spotlight.comm.messages`
ExploreWork / RolloutWork, each naming its weights version) and answered by handles, so a schedule
can keep exploration, rollouts and the training step in flight at once; the serial schedule
(`Loop.step`) is today's default. `LocalExecutor` does the work in this process (the reference);
the runtime's executor (`spotlight.actors.controller.client`) sends the same jobs through the queue
to workers, which run them with the same functions (`spotlight.work`). Baselines are switches of
the recipe (explore.enabled, run.mode), never separate loops.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from spotlight import checkpoint, work
from spotlight.comm import messages as m
from spotlight.data.prompts import prompt_set
from spotlight.data.scenes import VOCABULARY
from spotlight.evaluation import Evaluator
from spotlight.models.dit import DiffusionModel, build_model
from spotlight.policy.grpo import Group, GRPOTrainer
from spotlight.policy.seeds import candidate_seeds, select_contrast
from spotlight.recipe import Recipe
from spotlight.report import MetricsLog, plot_rewards

INIT_STREAM = 2_000  # seed stream of a group's shared initial noise


class Executor(Protocol):
    """Where an iteration's work runs. Work is submitted as a batch (one job per prompt, each job
    one unit: never split or merged) and answered by a handle — a ``concurrent.futures.Future`` the
    driver awaits (``result()``) or polls (``done()``) later, so explore, rollout and the training
    step can be in flight at once. Every job names the weights version it must run with; ``batch``
    is the driver's name for the set. ``publish(version, model)`` makes the model's weights
    available as ``version`` before any job names it."""

    def explore(self, batch: str, jobs: list[m.ExploreWork]) -> Future[list[np.ndarray]]: ...
    def rollout(self, batch: str, jobs: list[m.RolloutWork]) -> Future[list[Group]]: ...
    def publish(self, version: int, model) -> None: ...


ExecutorFactory = Callable[[DiffusionModel, Recipe, int], Executor]
"""(trainer's model, recipe, first weights version) -> an Executor with that version published."""


def done_future(fn: Callable[[], Any]) -> Future:
    """A finished future holding ``fn()``'s value (or its exception)."""
    fut: Future = Future()
    try:
        fut.set_result(fn())
    except Exception as e:  # handed to whoever awaits the handle, as a remote failure would be
        fut.set_exception(e)
    return fut


class LocalExecutor:
    """The reference: does the work in this process, at submit time, with the trainer's own model.

    Running a job when it is submitted means it sees the weights as they are then (the version
    it names), however late its handle is awaited — the in-process analogue of a worker holding
    that version."""

    def __init__(self, model: DiffusionModel, recipe: Recipe, version: int = 0) -> None:
        self.model, self.recipe, self.version = model, recipe, version
        self.reward = work.recipe_reward(recipe)
        self.shape = work.image_shape(recipe)

    def _held(self, job):
        if job.version != self.version:
            raise ValueError(f"job for weights version {job.version}, but this process holds {self.version}")
        return job

    def explore(self, batch: str, jobs: list[m.ExploreWork]) -> Future[list[np.ndarray]]:
        s = self.recipe.sampler
        return done_future(
            lambda: [
                work.explore(self.model, self._held(j), s, self.reward, self.shape).rewards for j in jobs
            ]
        )

    def rollout(self, batch: str, jobs: list[m.RolloutWork]) -> Future[list[Group]]:
        s = self.recipe.sampler
        return done_future(
            lambda: [work.rollout(self.model, self._held(j), s, self.reward, self.shape) for j in jobs]
        )

    def publish(self, version: int, model) -> None:
        self.version = version  # the trainer updated this very model in place


class Loop:
    """One run. `run()` returns the summary; `hooks` get every metrics record as it is written.

    ``executor``: an ``ExecutorFactory`` (default: ``LocalExecutor``); it gets the trainer's
    model, the recipe and the weights version the run starts at, never the Loop itself."""

    def __init__(
        self,
        recipe: Recipe,
        executor: ExecutorFactory | None = None,
        resume: bool = False,
        hooks: list[Callable[[dict], None]] | None = None,
        progress: bool = True,
    ):
        self.recipe, self.hooks, self.progress = recipe, list(hooks or []), progress
        r = recipe.run
        torch.manual_seed(r.seed)
        self.prompts = prompt_set(r.prompts)
        self.reward = work.recipe_reward(recipe)
        self.model = build_model(recipe.model, VOCABULARY)
        self.trainer = GRPOTrainer(self.model, recipe.grpo, recipe.sampler, seed=r.seed)
        self.out = Path(r.out_dir) / r.name
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.start_iteration = 0
        self.wall_offset = 0.0
        if resume:
            self.start_iteration, self.wall_offset = checkpoint.load_latest(
                self.out / "checkpoints", self.model, self.trainer
            )
            self.metrics.truncate_after(self.start_iteration - 1)
        elif self.metrics.path.exists():
            self.metrics.path.unlink()  # a fresh run owns its folder's metrics
        self.shape = work.image_shape(recipe)
        self.version = self.start_iteration  # weights version v_i = the weights iteration i starts from
        self.executor = (executor or LocalExecutor)(self.model, recipe, self.version)
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
        return [
            candidate_seeds(self.recipe.run.seed, it, self.prompts.index(p), 1, stream=INIT_STREAM)[0]
            for p in prompts
        ]

    def submit_explore(
        self, it: int, prompts: list[str], inits: list[int | None], version: int
    ) -> tuple[list[list[int]], Future] | None:
        """Iteration ``it``'s exploration at weights ``version``: the candidates and the handle of
        their scores; None when exploration is off (random seeds)."""
        r, e = self.recipe.run, self.recipe.explore
        if not e.enabled:
            return None
        cands = [candidate_seeds(r.seed, it, self.prompts.index(p), e.candidates) for p in prompts]
        jobs = [
            m.ExploreWork(
                prompt=p,
                seeds=c,
                version=version,
                effective_steps=e.effective_steps,
                cache_threshold=e.cache_threshold,
                init_seed=i,
            )
            for p, c, i in zip(prompts, cands, inits)
        ]
        return cands, self.executor.explore(f"it{it}/explore", jobs)

    def select_seeds(
        self, it: int, prompts: list[str], explored: tuple[list[list[int]], Future] | None
    ) -> tuple[list[list[int]], dict]:
        """Each group's seeds: the contrast selection of the explored candidates, or random seeds."""
        r = self.recipe.run
        if explored is None:
            return [candidate_seeds(r.seed, it, self.prompts.index(p), r.group_size) for p in prompts], {}
        cands, handle = explored
        scores = handle.result()
        chosen = [select_contrast(c, s, r.group_size) for c, s in zip(cands, scores)]
        spread = [
            float(np.std(np.asarray(s)[[c.index(x) for x in ch]])) for c, s, ch in zip(cands, scores, chosen)
        ]
        return chosen, {
            "explore_spread": float(np.mean(spread)),
            "explore_candidates_std": float(np.mean([np.std(s) for s in scores])),
        }

    def step(self, it: int) -> dict:
        """One iteration in the serial schedule (explore, then rollout, then train, then publish),
        written against handles so other schedules can overlap its parts."""
        t0 = time.monotonic()
        prompts = self.iteration_prompts(it)
        inits = self.init_seeds(it, prompts)
        seeds, explore_stats = self.select_seeds(
            it, prompts, self.submit_explore(it, prompts, inits, self.version)
        )
        t1 = time.monotonic()
        jobs = [
            m.RolloutWork(prompt=p, seeds=s, version=self.version, init_seed=i)
            for p, s, i in zip(prompts, seeds, inits)
        ]
        groups = self.executor.rollout(f"it{it}/rollout", jobs).result()
        t2 = time.monotonic()
        train = self.trainer.update(groups)
        self.version += 1
        self.executor.publish(self.version, self.model)
        t3 = time.monotonic()
        rewards = torch.stack([g.rewards for g in groups])
        return {
            "event": "iteration",
            "iteration": it,
            "version": self.version - 1,
            "reward_mean": float(rewards.mean()),
            "group_spread": float(rewards.std(1, unbiased=False).mean()),
            "rewards": [[round(float(x), 6) for x in g.rewards] for g in groups],
            "explore_s": t1 - t0,
            "rollout_s": t2 - t1,
            "train_s": t3 - t2,
            **explore_stats,
            **train,
        }

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
        bar = tqdm(
            range(self.start_iteration, r.iterations), disable=not self.progress, desc=r.name, unit="it"
        )
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
                bar.write(
                    f"iteration {done}: held-out ODE {ev['eval_reward']:.3f} ± {ev['eval_reward_std']:.3f}, "
                    f"train ODE {ev['eval_ode_train']:.3f}, SDE {ev['eval_sde_train']:.3f}, "
                    f"FM drift {ev.get('fm_drift', 0.0):+.1%}"
                )
            if done % r.checkpoint_every == 0 or last:
                checkpoint.save(
                    self.out / "checkpoints",
                    done,
                    self.model,
                    self.trainer,
                    self.wall_offset + time.monotonic() - start,
                )
            if out_of_time:
                break
        bar.close()
        records = self.metrics.read()
        plot_rewards(records, self.out / "reward.png")
        evals = [x for x in records if x["event"] == "eval"]
        return {
            "out": str(self.out),
            "base_reward": evals[0]["eval_reward"],
            "final_reward": evals[-1]["eval_reward"],
            "final_reward_std": evals[-1]["eval_reward_std"],
            "iterations": evals[-1]["iteration"],
            "wall_s": records[-1]["wall_s"],
        }
