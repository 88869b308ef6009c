"""``run.mode = "sim"``: a run's iterations on the simulated cluster, written like a real run's.

``SimRun(recipe).run()`` drives the iterations the way ``spotlight.loop.Loop.step`` does for each
``explore.schedule`` — ``off`` (random seeds, rollout, train, publish), ``critical`` (explore with
the current weights, select, roll out, train) and ``overlap`` (iteration i+1's exploration at v_i
submitted when i's rollouts are in, running while the trainer updates, cut off by
``cancel_batch`` at i+1's rollout) — with the same request shapes (one request per prompt's group,
or ``sim.samples_per_request``; exploration in ``explore.chunk``s), the UCB planner
(``spotlight.policy.planner``) when ``explore.planner`` is on, and the trainer's update priced by
the timing model on ``sim.trainer_gpus`` reserved GPUs. Spot capacity is the recipe's ``[spot]``
trace replayed by the ``FaultInjector`` on the virtual clock, or a fixed pool of ``sim.spot_gpus``.

It writes what a runtime run writes, in ``<out_dir>/<name>/``: ``metrics.jsonl`` (one record per
iteration with the spot fields — spot nodes, preemptions, requests resumed, steps lost, GPU-seconds
and dollars per node class — and the phase times in simulated seconds, with what of the
exploration and rollout phases went to waiting for capacity (``wait_capacity_s``: no rollout node
registered) and to preemptions (``preempt_lost_gpu_s``: GPU-seconds of denoising steps computed in
vain and of broken SP groups' idle or reloading survivors; ``preempt_lost_s``: those over the mean
rollout GPUs registered in the phase)) and ``spot.png``. The bill covers every role: the trainer
pool and the reserved rollout GPUs from time 0, each spot node from the trace's grant (its boot
billed; one taken away while booting too) to its leave. Every
record carries ``"mode": "sim"`` and the plot is titled ``sim``. Learning is not simulated: there
are no tensors, so no rewards; a record has no ``reward_mean``, and the planner's payoff is the
expected spread of the seeds an arm would select from i.i.d. normal rewards
(``timing.expected_spread``), which ranks arms by M alone.

Knows the iteration's shape and the clock; the protocols are the cores' (``spotlight.sim.cluster``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotlight.comm import messages as m
from spotlight.errors import ActorTimeout, ConfigError
from spotlight.policy.planner import Arm, Planner
from spotlight.recipe import Recipe
from spotlight.report import MetricsLog
from spotlight.sim.clock import VirtualClock
from spotlight.sim.cluster import SimCluster
from spotlight.sim.timing import expected_spread
from spotlight.spot.accounting import SpotAccount
from spotlight.spot.config import spot_replay
from spotlight.spot.injector import FaultInjector


class SimRun:
    """One simulated run of ``recipe`` (module docstring); ``hooks`` get every record."""

    def __init__(self, recipe: Recipe, hooks: list[Callable[[dict], None]] | None = None,
                 write: bool = True) -> None:
        self.recipe, self.hooks, self.write = recipe, list(hooks or []), write
        sim, rt, sp = recipe.sim, recipe.runtime, recipe.spot
        self.timing = sim.timing()
        self.gpus_per_node = sim.gpus_per_node or sp.workers_per_node
        self.replay = spot_replay(sp)
        per = sim.gpus_per_instance
        if per is not None and self.gpus_per_node % per:
            raise ConfigError(f"sim.gpus_per_instance ({per}) must divide the GPUs of a node "
                              f"({self.gpus_per_node})")
        if self.replay is not None:
            most = max(n for _, n in self.replay.steps()) * (per or self.gpus_per_node)
            if most < rt.sp_degree:
                raise ConfigError(f"spot trace {self.replay.trace.source}: at most {most} spot GPUs "
                                  f"({self.gpus_per_node} per node), fewer than one SP group of "
                                  f"runtime.sp_degree={rt.sp_degree}")
        rt.check_node_workers(self.gpus_per_node, "sim.gpus_per_node")
        self.clock = VirtualClock()
        self.account = SpotAccount(sp.cost_config(), clock=self.clock,
                                   trace_spot_price=self.replay.trace.spot_price if self.replay else None)
        self.cluster = SimCluster(recipe, self.timing, self.clock, self.account, self.gpus_per_node)
        self.cluster.on_complete = self._completed
        self.cluster.on_dead = self._dead
        self.injector: FaultInjector | None = None
        self.out = Path(recipe.run.out_dir) / recipe.run.name
        self.records: list[dict[str, Any]] = []
        self.version = 0
        self._open: dict[str, int] = {}
        self._explore_done: dict[str, list[tuple[m.ExploreWork, m.ExploreResult]]] = {}
        self.planner = None
        e = recipe.explore
        if e.enabled and e.planner:
            self.planner = Planner(e.planner_config(), steps=recipe.sampler.steps,
                                   group_size=recipe.run.group_size)
        tf = recipe.grpo.timestep_fraction
        self.train_timesteps = sim.train_timesteps or max(1, round(recipe.sampler.steps * tf))
        self._spread: dict[int, float] = {}
        self._lost_before = 0.0

    # --- the cluster at time 0 --------------------------------------------------------------------
    def _start(self) -> None:
        rt, sp, c = self.recipe.runtime, self.recipe.spot, self.cluster
        # the trainer's pool is reserved for the whole run, as the runtime bills its trainer's device
        trainer = {"kind": "reserved", "workers": self.recipe.sim.trainer_gpus}
        self.account.on_event("join", "trainer", trainer)
        if rt.reserved_workers > 0:
            c.add_node("reserved", kind="reserved", gpus=rt.reserved_workers, warm=True)
        if self.replay is None:
            gpus = rt.spot_workers if self.recipe.sim.spot_gpus is None else self.recipe.sim.spot_gpus
            for i in range(math.ceil(gpus / self.gpus_per_node)):
                c.add_node(f"spot{i}", gpus=min(self.gpus_per_node, gpus - i * self.gpus_per_node), warm=True)
            return
        self.injector = FaultInjector(
            _Granting(c, self.account), self.replay.events(), warning_s=self.replay.scale_s(sp.warning_s),
            hard_kill_fraction=sp.hard_kill_fraction, cloud=sp.cloud, seed=sp.seed,
            expect=self.account.expect, clock=self.clock, call_later=self.clock.call_later)
        self.injector.play_initial()
        for event in self.injector.events:
            self.clock.call_at(event.time_s, lambda e=event: self.injector.apply(e))

    # --- batches -------------------------------------------------------------------------------------
    def _submit(self, batch: str, works: list[m.Work]) -> None:
        self._open[batch] = len(works)
        self.cluster.submit([m.WorkRequest(request_id=f"{batch}/{i}", batch=batch, work=w)
                             for i, w in enumerate(works)])

    def _completed(self, lease: m.LeaseGrant, result: m.WorkResult) -> None:
        if lease.batch in self._open:
            self._open[lease.batch] -= 1
        if isinstance(result, m.ExploreResult):
            self._explore_done.setdefault(lease.batch, []).append((lease.work, result))

    def _dead(self, letter: dict) -> None:
        if letter["batch"] in self._open:
            self._open[letter["batch"]] -= 1

    def _wait(self, batch: str) -> None:
        limit = self.clock() + self.recipe.runtime.batch_timeout_s
        self.clock.run(until=lambda: self._open[batch] <= 0, end=limit)
        if self._open[batch] > 0:
            raise ActorTimeout(f"sim: batch {batch}: {self._open[batch]} requests still open after "
                               f"{self.recipe.runtime.batch_timeout_s:g} simulated s "
                               "(no worker to serve them?)")

    def _finish(self, batch: str) -> None:
        """The batch's records are dropped from the queue (its results were counted)."""
        self.cluster.queue.forget_batch(batch)
        self._open.pop(batch, None)

    # --- one iteration ------------------------------------------------------------------------------
    def _arm(self, it: int, prompts: int) -> tuple[Arm, dict | None]:
        e = self.recipe.explore
        if self.planner is None:
            return e.fixed_arm(it), None
        d = self.planner.choose(workers=max(self.cluster.explorers(), 1), prompts=prompts)
        return d.arm, d.as_dict()

    def _explore(self, it: int, version: int) -> tuple[str, Arm, dict | None, int]:
        e, r = self.recipe.explore, self.recipe.run
        arm, decision = self._arm(it, r.prompts_per_iteration)
        chunk = e.chunk or arm.candidates
        works: list[m.Work] = []
        for p in range(r.prompts_per_iteration):
            seeds = list(range(arm.candidates))
            for i in range(0, arm.candidates, chunk):
                works.append(m.ExploreWork(prompt=f"p{it}.{p}", seeds=seeds[i:i + chunk], version=version,
                                           cache=None if arm.cache is None else arm.cache.label))
        batch = f"it{it}/explore"
        self._submit(batch, works)
        return batch, arm, decision, len(works)

    def _settle(self, batch: str, arm: Arm) -> dict[str, Any]:
        """The exploration's deadline: what returned is used, the rest cancelled in the queue."""
        G = self.recipe.run.group_size
        self.cluster.queue.cancel_batch(batch)
        done = self._explore_done.pop(batch, [])
        per_prompt: dict[str, int] = {}
        worker_s = samples = calls = 0.0
        for work, res in done:
            per_prompt[work.prompt] = per_prompt.get(work.prompt, 0) + len(work.seeds)
            worker_s += res.compute_s
            samples += len(work.seeds)
            calls += res.model_calls * len(work.seeds)
        selected = sum(n >= G for n in per_prompt.values())
        if self.planner is not None and samples:
            self.planner.observe_cost(arm, worker_seconds=max(worker_s, 1e-9), samples=int(samples),
                                      sample_calls=int(calls))
            if arm.candidates not in self._spread:
                self._spread[arm.candidates] = expected_spread(arm.candidates, G)
            self.planner.observe_payoff(arm, self._spread[arm.candidates])
        self._finish(batch)
        return {"explore_arm": arm.label, "explore_samples": int(samples),
                "explore_worker_s": round(worker_s, 3), "explore_prompts_selected": selected}

    def _rollout_works(self, it: int) -> list[m.Work]:
        r, sim = self.recipe.run, self.recipe.sim
        per = sim.samples_per_request or r.group_size
        works: list[m.Work] = []
        for p in range(r.prompts_per_iteration):
            seeds = list(range(r.group_size))
            for i in range(0, r.group_size, per):
                works.append(m.RolloutWork(prompt=f"p{it}.{p}", seeds=seeds[i:i + per], version=self.version))
        return works

    def step(self, it: int, last: int, pending: tuple | None) -> tuple[dict[str, Any], tuple | None]:
        e, c, clock = self.recipe.explore, self.cluster, self.clock
        t0 = clock()
        explore: dict[str, Any] = {}
        if e.schedule == "critical":
            batch, arm, decision, n = self._explore(it, self.version)
            self._wait(batch)
            explore = {**self._settle(batch, arm), "explore_requests": n}
        elif e.schedule == "overlap" and pending is not None:
            if e.wait_s > 0:
                clock.run(until=lambda: self._open[pending[0]] <= 0, end=clock() + e.wait_s)
            explore = {**self._settle(pending[0], pending[1]), "explore_requests": pending[3]}
            if pending[2] is not None:
                explore["planner"] = pending[2]
        t1 = clock()
        batch = f"it{it}/rollout"
        works = self._rollout_works(it)
        self._submit(batch, works)
        self._wait(batch)
        samples = sum(len(w.seeds) for w in works)
        for i in range(len(works)):  # the trainer reads the trajectories; the store drops them after
            c.store.delete(f"traj/{batch}/{i}")
        self._finish(batch)
        t2 = clock()
        nxt = None
        if e.schedule == "overlap" and it < last:
            nxt = self._explore(it + 1, self.version)
        t3 = clock()
        busy0, present0 = c.busy_gpu_s(), self.account.meter.gpu_seconds("spot")
        train_s = self.timing.train_s(samples, self.train_timesteps, self.recipe.sim.trainer_gpus,
                                      reference=self.recipe.grpo.beta > 0)
        c.train(train_s)
        busy1, present1 = c.busy_gpu_s(), self.account.meter.gpu_seconds("spot")
        self.version += 1
        c.store.publish_weights(self.version, {})
        t4 = clock()
        if self.planner is not None:
            self.planner.observe_window(max(t4 - t3, 1e-6))
        present = present1 - present0
        q = c.queue.counters
        lost = self._lost_gpu_s()
        no_capacity_s, capacity_gpu_s = self._capacity(t0, t2)
        lost_gpu_s, self._lost_before = lost - self._lost_before, lost
        record = {
            "event": "iteration", "mode": "sim", "iteration": it, "version": self.version - 1,
            "schedule": e.schedule, "explore_s": (t1 - t0) + (t3 - t2), "rollout_s": t2 - t1,
            "train_s": t4 - t3, "iteration_s": t4 - t0, "sim_s": round(t4, 3),
            "rollout_samples": samples, "rollout_samples_per_s": samples / max(t2 - t1, 1e-9),
            "spot_gpus": sum(n.gpus for n in c.nodes.values() if n.kind == "spot" and n.state != "gone"),
            "spot_idle_training": None if present <= 0 else round(1 - (busy1 - busy0) / present, 4),
            "wait_capacity_s": round(no_capacity_s, 3),
            "preempt_lost_gpu_s": round(lost_gpu_s, 3),
            "preempt_lost_s": round(min(lost_gpu_s / max(capacity_gpu_s / max(t2 - t0, 1e-9), 1.0),
                                        max(t2 - t0 - no_capacity_s, 0.0)), 3),
            **explore,
            **{f"queue_{k}": q[k] for k in ("expired", "released", "dead", "late_results_dropped",
                                            "node_lost_requeued", "cancelled")},
            **self._step_totals(),
        }
        return record, nxt

    def _lost_gpu_s(self) -> float:
        """GPU-seconds lost to preemptions so far: denoising steps computed in vain (each at the
        price of a step of one request) and the idle or reloading survivors of broken SP groups."""
        rt, r = self.recipe.runtime, self.recipe.run
        per = self.recipe.sim.samples_per_request or r.group_size
        steps = sum(x.lost for x in self.cluster.steps_log.values())
        return steps * self.timing.step_s(per, rt.sp_degree) * rt.sp_degree + self.cluster.lost_gpu_s

    def _capacity(self, a: float, b: float) -> tuple[float, float]:
        """Over simulated [a, b]: seconds with no rollout node registered (waiting for capacity)
        and the rollout GPU-seconds registered, from the cost account's join/leave events."""
        present: dict[str, int] = {}
        gpus = {n.node_id: n.gpus for n in self.cluster.nodes.values()}
        t, none_s, gpu_s = a, 0.0, 0.0
        for ev in [*self.account.events, {"t": b, "event": "end", "node": ""}]:
            if ev["t"] > a:
                span = min(ev["t"], b) - t
                if span > 0:
                    none_s += span * (not present)
                    gpu_s += span * sum(present.values())
                    t = min(ev["t"], b)
            if ev["t"] >= b:
                break
            if ev["node"] == "trainer":
                continue
            if ev["event"] == "join":
                present[ev["node"]] = gpus.get(ev["node"], self.gpus_per_node)
            else:
                present.pop(ev["node"], None)
        return none_s, gpu_s

    def _step_totals(self) -> dict[str, int]:
        r = self.cluster.steps_log.values()
        return {"requests_resumed": sum(x.resumed for x in r), "requests_rerun": sum(x.rerun for x in r),
                "steps_lost": sum(x.lost for x in r)}

    # --- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        r, sim = self.recipe.run, self.recipe.sim
        metrics = None
        if self.write:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
            metrics = MetricsLog(self.out / "metrics.jsonl")
        self._start()
        if sim.setup_s > 0:  # the trainer's set-up after the replay started
            self.clock.run(end=sim.setup_s)
        pending = None
        last = r.iterations - 1
        for it in range(r.iterations):
            record, pending = self.step(it, last, pending)
            record.update(self.account.snapshot())
            record["wall_s"] = round(time.perf_counter() - wall0, 3)
            for hook in self.hooks:
                hook(record)
            self.records.append(record)
            if metrics is not None:
                metrics.write(record)
            if sim.hours is not None and self.clock() >= sim.hours * 3600:
                break
        self.account.close()
        summary = self.summary(time.perf_counter() - wall0)
        if self.write:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
            from spotlight.spot.plots import plot_spot

            plot_spot(self.account.events, self.records, self.out / "spot.png", label="sim")
        return summary

    def summary(self, wall_s: float) -> dict[str, Any]:
        its = self.records
        snap = its[-1] if its else {}
        q = self.cluster.queue
        return {
            "mode": "sim", "profile": self.timing.profile.name, "gpu": self.timing.gpu.name,
            "resolution": self.timing.resolution, "iterations": len(its),
            "sim_s": round(self.clock(), 3), "wall_s": round(wall_s, 3),
            "iteration_s_mean": sum(x["iteration_s"] for x in its) / max(len(its), 1),
            "cost_usd": snap.get("cost_usd"), "preemptions": snap.get("preemptions"),
            "requests_resumed": snap.get("requests_resumed"), "steps_lost": snap.get("steps_lost"),
            "queue": q.stats(), "dead_letters": q.dead_letters, "events_run": self.clock.events_run,
            "rewards": "not simulated (no tensors)",
            "reconfigurations": len(self.cluster.reconfig_s), "reconfig_s": self.cluster.reconfig_s,
            "survivor_s": self.cluster.survivor_s, "gpu_s_lost_reconfig": round(self.cluster.lost_gpu_s, 3),
        }


class _Granting:
    """The fault injector's ``Nodes`` target: the cluster, telling the cost account when each spot
    node (or instance, with ``sim.gpus_per_instance``) is granted, so its boot is billed — a host's
    boot included for the instances granted while it boots — not only from its registration."""

    def __init__(self, cluster: SimCluster, account: SpotAccount) -> None:
        self.cluster, self.account = cluster, account

    def add_node(self, node_id: str, **kw: Any) -> None:
        self.account.granted(node_id, self.cluster.gpus_per_instance or self.cluster.gpus_per_node)
        self.cluster.add_node(node_id, **kw)

    def signal_node(self, node_id: str, sig: int) -> bool:
        return self.cluster.signal_node(node_id, sig)

    def node_alive(self, node_id: str) -> bool:
        return self.cluster.node_alive(node_id)

    def spot_pids(self) -> dict[str, list[int]]:
        return self.cluster.spot_pids()


def simulate(recipe: Recipe, hooks: list[Callable[[dict], None]] | None = None) -> dict[str, Any]:
    """Run ``recipe`` in ``run.mode = "sim"``; the summary."""
    return SimRun(recipe, hooks).run()
