"""The GRPO iteration loop: seeds → rollout → reward → update → (evaluate, checkpoint).

`Loop` is the iteration driver, the same for every mode; where the tensor work happens is the
`Executor`'s business. Work is submitted as batches of typed jobs (`spotlight.comm.messages`
ExploreWork / RolloutWork, each naming its weights version) and answered by handles, so a schedule
can keep exploration, rollouts and the training step in flight at once. `explore.schedule` picks
the schedule `Loop.step` runs:

- ``off``: random seeds, then rollout, train, publish (Flow-GRPO);
- ``critical``: explore the iteration's candidates with the current weights, select, roll out,
  train (DanceGRPO's best-of-N, on the critical path);
- ``overlap`` (Spotlight): as soon as iteration i's rollouts are in the trainer's hands, iteration
  i+1's exploration is submitted at weights v_i and runs (on spot workers) while the trainer
  updates; at i+1's rollout (the deadline) what returned is used and the rest cancelled in the
  queue. The in-process executor runs a job when it is submitted, i.e. at v_i before the update, so
  both paths select the same seeds.

`LocalExecutor` does the work in this process (the reference); the runtime's executor
(`spotlight.actors.controller.client`) sends the same jobs through the queue to workers, which run
them with the same functions (`spotlight.work`). Baselines are switches of the recipe
(explore.schedule, run.mode), never separate loops.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from spotlight import checkpoint, work
from spotlight.comm import messages as m
from spotlight.data.prompts import prompt_set
from spotlight.evaluation import Evaluator
from spotlight.models.dit import DiffusionModel
from spotlight.parallel.device import resolve_device
from spotlight.policy.consistency import spearman
from spotlight.policy.grpo import Group, GRPOTrainer
from spotlight.policy.planner import Arm, Planner
from spotlight.policy.seeds import candidate_seeds, select_contrast
from spotlight.recipe import Recipe
from spotlight.report import MetricsLog, TensorBoardLog, plot_rewards

INIT_STREAM = 2_000  # seed stream of a group's shared initial noise
CHECK_STREAM = 3_000  # which prompts a rank-consistency check re-scores

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Where an iteration's work runs. Work is submitted as a batch (one job per prompt, each job
    one unit: never split or merged) and answered by a handle — a ``concurrent.futures.Future`` the
    driver awaits (``result()``) or polls (``done()``) later, so explore, rollout and the training
    step can be in flight at once. Every job names the weights version it must run with; ``batch``
    is the driver's name for the set. ``publish(version, model)`` makes the model's weights
    available as ``version`` before any job names it.

    An exploration handle holds one ``ExploreResult`` per job, or None for a job that did not
    return (cancelled by ``cancel(batch)``, or lost); ``cancel`` drops what of an exploration batch
    has not finished (a real cancel in the queue) and makes its handle resolve with what did.
    ``explore_workers()`` is the capacity exploration can use while the trainer updates."""

    def explore(self, batch: str, jobs: list[m.ExploreWork]) -> Future[list[m.ExploreResult | None]]: ...
    def rollout(self, batch: str, jobs: list[m.RolloutWork]) -> Future[list[Group]]: ...
    def cancel(self, batch: str) -> None: ...
    def explore_workers(self) -> int: ...
    def publish(self, version: int, model) -> None: ...


ExecutorFactory = Callable[[DiffusionModel, Recipe, int], Executor]
"""(trainer's model, recipe, first weights version) -> an Executor with that version published."""

TrainerFactory = Callable[..., GRPOTrainer]
"""(the run's model, GRPOConfig, SamplerConfig, seed=) -> the trainer that updates it: GRPOTrainer,
or the sharded trainer's rank 0 (`spotlight.parallel.ranks`), which has its interface."""


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

    def _explore_one(self, job: m.ExploreWork) -> m.ExploreResult:
        t0 = time.perf_counter()
        out = work.explore(self.model, self._held(job), self.recipe.sampler, self.reward, self.shape)
        seconds = time.perf_counter() - t0
        return m.ExploreResult(
            rewards=[float(r) for r in out.rewards],
            model_calls=out.model_calls,
            worker_s=seconds,
            compute_s=seconds,
        )

    def explore(self, batch: str, jobs: list[m.ExploreWork]) -> Future[list[m.ExploreResult | None]]:
        return done_future(lambda: [self._explore_one(j) for j in jobs])

    def cancel(self, batch: str) -> None:
        """Nothing to cancel: every job ran when it was submitted."""

    def explore_workers(self) -> int:
        return 1

    def rollout(self, batch: str, jobs: list[m.RolloutWork]) -> Future[list[Group]]:
        s = self.recipe.sampler
        return done_future(
            lambda: [work.rollout(self.model, self._held(j), s, self.reward, self.shape) for j in jobs]
        )

    def publish(self, version: int, model) -> None:
        self.version = version  # the trainer updated this very model in place


@dataclass(slots=True)
class Exploration:
    """One iteration's exploration in flight: its jobs (``owners[j]`` = the prompt index whose
    candidates job j scores a chunk of), and the handle of their results."""

    iteration: int
    version: int
    arm: Arm
    plan: dict
    prompts: list[str]
    owners: list[int]
    jobs: list[m.ExploreWork]
    batch: str
    handle: Future
    returned: list[tuple[list[int], list[float]]] | None = field(default=None)
    """Per prompt, the seeds that came back and their scores (set once settled)."""


class Loop:
    """One run. `run()` returns the summary; `hooks` get every metrics record before it is
    written, and may add fields to it (the runtime adds spot capacity, preemptions and cost).

    ``executor``: an ``ExecutorFactory`` (default: ``LocalExecutor``); it gets the trainer's
    model, the recipe and the weights version the run starts at, never the Loop itself.
    ``trainer``: a ``TrainerFactory`` (default: ``GRPOTrainer``, in this process)."""

    def __init__(
        self,
        recipe: Recipe,
        executor: ExecutorFactory | None = None,
        resume: bool = False,
        hooks: list[Callable[[dict], None]] | None = None,
        progress: bool = True,
        trainer: TrainerFactory | None = None,
    ):
        self.recipe, self.hooks, self.progress = recipe, list(hooks or []), progress
        r = recipe.run
        torch.manual_seed(r.seed)
        self.prompts = prompt_set(r.prompts)
        self.reward = work.recipe_reward(recipe)
        self.device = resolve_device(r.device)
        self.model = work.recipe_model(recipe.model).to(self.device)
        self.trainer = (trainer or GRPOTrainer)(self.model, recipe.grpo, recipe.sampler, seed=r.seed)
        self.out = Path(r.out_dir) / r.name
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.start_iteration = 0
        self.wall_offset = 0.0
        loop_state: dict = {}
        if resume:
            self.start_iteration, self.wall_offset, loop_state = checkpoint.load_latest(
                self.out / "checkpoints", self.model, self.trainer
            )
            self.metrics.truncate_to_checkpoint(self.start_iteration)
        elif self.metrics.path.exists():
            self.metrics.path.unlink()  # a fresh run owns its folder's metrics
        self.out.mkdir(parents=True, exist_ok=True)  # the recipe beside the metrics (spotlight report)
        (self.out / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")
        arms = tuple(Arm.parse(a).label for a in recipe.explore.arms) if recipe.explore.planner else ()
        self.tensorboard = TensorBoardLog.open(self.out, r.tensorboard, arms=arms,
                                               purge_step=self.start_iteration if resume else None)
        self.shape = work.image_shape(recipe)
        self.version = self.start_iteration  # weights version v_i = the weights iteration i starts from
        self.executor = (executor or LocalExecutor)(self.model, recipe, self.version)
        self.evaluator = Evaluator(self.trainer.deployed, recipe, self.reward, self.out)
        e = recipe.explore
        self.planner = (
            Planner(e.planner_config(), steps=recipe.sampler.steps, group_size=r.group_size)
            if e.enabled and e.planner else None
        )
        if self.planner is not None and loop_state.get("planner"):
            self.planner.load_state_dict(loop_state["planner"])
        self.pending: Exploration | None = None  # overlap: the next iteration's exploration in flight

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

    # --- exploration ---------------------------------------------------------------------------
    def plan(self, it: int, prompts: int) -> tuple[Arm, dict]:
        """The (M, steps) setting of iteration ``it``'s exploration: the planner's choice, or the
        given arm (`ExploreConfig.fixed_arm`)."""
        if self.planner is None:
            return self.recipe.explore.fixed_arm(it), {}
        decision = self.planner.choose(workers=max(1, self.executor.explore_workers()), prompts=prompts)
        return decision.arm, {
            "plan_arm": decision.arm.label,
            "plan_budget_s": decision.budget_s,
            "plan_predicted_s": decision.predicted_s.get(decision.arm.label),
            "plan_reason": decision.reason,
        }

    def submit_explore(
        self, it: int, prompts: list[str], inits: list[int | None], version: int
    ) -> Exploration | None:
        """Iteration ``it``'s exploration at weights ``version``, in flight; None when exploration
        is off. Each prompt's candidates go as requests of ``explore.chunk`` seeds."""
        r, e = self.recipe.run, self.recipe.explore
        if not e.enabled:
            return None
        arm, plan = self.plan(it, len(prompts))
        cands = [candidate_seeds(r.seed, it, self.prompts.index(p), arm.candidates) for p in prompts]
        size = e.chunk or arm.candidates
        owners, jobs = [], []
        for k, (p, c, i) in enumerate(zip(prompts, cands, inits)):
            for lo in range(0, len(c), size):
                owners.append(k)
                jobs.append(
                    m.ExploreWork(
                        prompt=p,
                        seeds=c[lo : lo + size],
                        version=version,
                        cache=None if arm.cache is None else arm.cache.label,
                        init_seed=i,
                    )
                )
        batch = work.batch_name(it, "explore")
        return Exploration(it, version, arm, plan, prompts, owners, jobs, batch,
                           self.executor.explore(batch, jobs))

    def settle(self, exp: Exploration, deadline: bool) -> list[m.ExploreResult | None]:
        """The exploration's results. ``deadline``: the next rollout starts now — wait at most
        ``explore.wait_s`` more, then cancel what has not finished (None in its place)."""
        if deadline and not exp.handle.done():
            try:
                return exp.handle.result(timeout=self.recipe.explore.wait_s)
            except FutureTimeout:
                self.executor.cancel(exp.batch)
        return exp.handle.result()

    def select_seeds(
        self, it: int, prompts: list[str], exp: Exploration | None, deadline: bool = False
    ) -> tuple[list[list[int]], dict]:
        """Each group's seeds: the contrast selection of the explored candidates that returned, or
        random seeds (exploration off; or, for a prompt, fewer than G candidates returned)."""
        r = self.recipe.run
        G = r.group_size

        def fresh(p: str) -> list[int]:
            return candidate_seeds(r.seed, it, self.prompts.index(p), G)

        if exp is None:
            return [fresh(p) for p in prompts], {}
        results = self.settle(exp, deadline)
        seeds: list[list[int]] = [[] for _ in prompts]
        scores: list[list[float]] = [[] for _ in prompts]
        for k, job, res in zip(exp.owners, exp.jobs, results):
            if res is not None:
                seeds[k] += job.seeds
                scores[k] += res.rewards
        exp.returned = list(zip(seeds, scores))
        chosen, spreads, fallbacks = [], [], 0
        for p, sd, sc in zip(prompts, seeds, scores):
            if len(sd) < G:
                fallbacks += 1
                chosen.append(fresh(p))
                continue
            pick = select_contrast(sd, np.asarray(sc), G)
            chosen.append(pick)
            spreads.append(float(np.std(np.asarray(sc)[[sd.index(x) for x in pick]])))
        got = [x for x in results if x is not None]
        if fallbacks:
            log.warning("iteration %d: %d of %d prompts had < %d explored candidates back by the "
                        "deadline; random seeds for them", it, fallbacks, len(prompts), G)
        stats = {
            "explore_version": exp.version,
            "explore_arm": exp.arm.label,
            "explore_requests": len(results),
            "explore_returned": len(got),
            "explore_cancelled": len(results) - len(got),
            "explore_fallback_prompts": fallbacks,
            "explore_spread": float(np.mean(spreads)) if spreads else 0.0,
            "explore_candidates_std": float(np.mean([np.std(x) for x in scores if x])) if got else 0.0,
            "explore_worker_s": float(sum(x.worker_s for x in got)),
            **exp.plan,
        }
        if self.planner is not None and got:
            self.planner.observe_cost(
                exp.arm,
                worker_seconds=max(stats["explore_worker_s"], 1e-9),
                samples=sum(len(sd) for sd in seeds),
                sample_calls=sum(x.model_calls * len(j.seeds) for j, x in zip(exp.jobs, results) if x),
            )
            if spreads:
                self.planner.observe_payoff(exp.arm, stats["explore_spread"])
        return chosen, stats

    def submit_check(self, it: int, exp: Exploration | None) -> tuple[list, Future] | None:
        """Every ``explore.check_every`` iterations: re-score some explored prompts' returned
        candidates with the current weights at full steps (stale/cached vs fresh/full)."""
        e = self.recipe.explore
        if exp is None or e.check_every is None or it % e.check_every or exp.returned is None:
            return None
        ranked = [k for k, (sd, _) in enumerate(exp.returned) if len(sd) >= 2]
        if not ranked:
            return None
        picks = sorted(random.Random(self.recipe.run.seed * CHECK_STREAM + it).sample(
            ranked, min(e.check_prompts, len(ranked))))
        jobs = [
            m.ExploreWork(prompt=exp.prompts[k], seeds=exp.returned[k][0], version=self.version,
                          init_seed=exp.jobs[exp.owners.index(k)].init_seed)
            for k in picks
        ]
        return [exp.returned[k][1] for k in picks], self.executor.explore(work.batch_name(it, "check"), jobs)

    @staticmethod
    def settle_check(check: tuple[list, Future] | None) -> dict:
        if check is None:
            return {}
        stale, handle = check
        fresh = handle.result()
        per = [spearman(a, b.rewards) if b is not None else math.nan for a, b in zip(stale, fresh)]
        ok = [x for x in per if not math.isnan(x)]
        return {
            "rank_consistency": float(np.mean(ok)) if ok else math.nan,
            "rank_consistency_prompts": [None if math.isnan(x) else round(x, 4) for x in per],
        }

    # --- one iteration -----------------------------------------------------------------------
    def step(self, it: int) -> dict:
        """One iteration in the recipe's schedule (module docstring), written against handles."""
        e, last = self.recipe.explore, self.recipe.run.iterations - 1
        t0 = time.monotonic()
        prompts = self.iteration_prompts(it)
        inits = self.init_seeds(it, prompts)
        exp, overlapped = None, False
        if self.pending is not None and self.pending.iteration == it:
            exp, overlapped, self.pending = self.pending, True, None
        elif e.schedule == "critical":  # (overlap's first iteration: random seeds, as nothing
            exp = self.submit_explore(it, prompts, inits, self.version)  # ran in a training window)
        seeds, explore_stats = self.select_seeds(it, prompts, exp, deadline=overlapped)
        check = self.submit_check(it, exp)
        t1 = time.monotonic()
        jobs = [
            m.RolloutWork(prompt=p, seeds=s, version=self.version, init_seed=i)
            for p, s, i in zip(prompts, seeds, inits)
        ]
        groups = self.executor.rollout(work.batch_name(it, "rollout"), jobs).result()
        t2 = time.monotonic()
        if e.schedule == "overlap" and it < last:  # the next iteration's exploration, at v_i
            nxt = self.iteration_prompts(it + 1)
            self.pending = self.submit_explore(it + 1, nxt, self.init_seeds(it + 1, nxt), self.version)
        t3 = time.monotonic()
        train = self.trainer.update(groups)
        self.version += 1
        self.executor.publish(self.version, self.model)
        t4 = time.monotonic()
        check_stats = self.settle_check(check)
        t5 = time.monotonic()
        if self.planner is not None:
            self.planner.observe_window(max(t4 - t3, 1e-6))
        rewards = torch.stack([g.rewards for g in groups])
        return {
            "event": "iteration",
            "iteration": it,
            "version": self.version - 1,
            "reward_mean": float(rewards.mean()),
            "group_spread": float(rewards.std(1, unbiased=False).mean()),
            "rewards": [[round(float(x), 6) for x in g.rewards] for g in groups],
            "schedule": e.schedule,
            # the trainer's wait on exploration: selecting (critical: the whole exploration;
            # overlap: settling at the deadline) plus submitting the next one (in-process: runs it)
            "explore_s": (t1 - t0) + (t3 - t2),
            "rollout_s": t2 - t1,
            "train_s": t4 - t3,
            "check_s": t5 - t4,
            "iteration_s": t5 - t0,
            **explore_stats,
            **check_stats,
            **train,
        }

    def evaluate(self, it: int, save_samples: bool = True) -> dict:
        """ODE on held-out prompts (the headline, `eval_reward`), ODE on training prompts, the SDE
        policy, flow-matching drift: spotlight.evaluation."""
        return self.evaluator(it, save_samples)

    # --- the run ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of the driver besides model and optimizer (JSON)."""
        return {"planner": self.planner.state_dict()} if self.planner is not None else {}

    def emit(self, record: dict, start: float) -> None:
        record["wall_s"] = round(self.wall_offset + time.monotonic() - start, 3)
        for hook in self.hooks:  # before the write: a hook may add fields (the runtime's spot fields)
            hook(record)
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def run(self) -> dict:
        from tqdm import tqdm

        r = self.recipe.run
        start = time.monotonic()
        if self.progress:
            where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
            print(f"{r.name}: computing on {self.device} ({where}; run.device = {r.device!r})")
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
                    state=self.state_dict(),
                )
            if out_of_time:
                break
        bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.pending is not None:  # a run cut short by run.minutes: nothing left in flight
            self.executor.cancel(self.pending.batch)
            self.pending = None
        records = self.metrics.read()
        its = [x for x in records if x["event"] == "iteration"]
        wait_share = sum(x["explore_s"] for x in its) / max(sum(x["iteration_s"] for x in its), 1e-9)
        if self.progress:
            print(f"exploration ({self.recipe.explore.schedule}): the trainer waited on it "
                  f"{wait_share:.1%} of iteration time")
        plot_rewards(records, self.out / "reward.png")
        evals = [x for x in records if x["event"] == "eval"]
        return {
            "out": str(self.out),
            "base_reward": evals[0]["eval_reward"],
            "final_reward": evals[-1]["eval_reward"],
            "final_reward_std": evals[-1]["eval_reward_std"],
            "iterations": evals[-1]["iteration"],
            "wall_s": records[-1]["wall_s"],
            "explore_wait_share": wait_share,
            "device": str(self.device),
        }
