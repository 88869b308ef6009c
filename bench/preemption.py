# .venv/bin/python bench/preemption.py --iterations 16 --prompts 8 --steps 20 --trace-hour-s 6
"""What does preemption cost a run, with per-step commits and without them?

Preemption cost: one spot trace, one model, per-step commits against naive_spot, beside a run
with the same spot capacity and no preemption, side by side in one invocation.

Three real runs (``run.mode = "runtime"``, the tiny model on this machine's CPUs, exploration off
in all three so only preemption handling differs):

- ``no_preemption``: a reserved node (1 worker) and a static spot node with ``--spot-workers``
  workers that is never taken away;
- ``step_commits``: the reserved node, and spot nodes (1 worker each) as the trace says
  (``spot.nodes = "proportional"``), taken away with the cloud's notice (AWS 120 s, scaled) or, for
  ``--hard-kill`` of them, SIGKILL; a preempted request resumes from its last committed step;
- ``naive_spot``: the same, with ``runtime.step_commits = false``: a preempted request restarts
  from scratch.

CPU affinity: the trainer, the queue, the store and the reserved worker on CPU 0, every spot node
(its agent and workers) on CPU 1 (``LocalRuntime.spot_cpus``), so spot work and the trainer do not
take each other's CPU and the three runs see the same split. The replay's second 0 is the run's
first iteration (``LocalRuntime``), so a slow start-up does not use up the trace; pick
``--trace-hour-s`` so the trace spans the runs (the AWS trace from 21529 s is 24.5 trace hours),
and enough work per iteration (``--prompts``, ``--steps``) that spot workers are busy most of the
time: a preemption of an idle node loses nothing in either mode and measures nothing.

Printed per run: iterations, seconds per iteration (and the ratio to no_preemption), preemptions,
requests resumed / re-run from scratch, denoising steps lost (in all and per preemption), cost
per iteration in dollars (reserved + spot GPU-seconds at the recipe's prices) and its ratio.
Each run's ``spot.png`` (capacity with preemption marks; reward against cost) is left in ``--out``.
The trace defaults to the shared AWS trace beside the repository, else a seeded synthetic one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spotlight import Experiment, load_recipe  # noqa: E402
from spotlight.spot.traces import shared_trace  # noqa: E402

AWS = shared_trace()  # None where the shared traces are not beside the repository
MODEL = ["model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16",
         "model.image_size=16", "model.patch=4", "sampler.sde_steps=none", 'sampler.sde_type="flow"']


def run(mode: str, args, out: Path) -> dict:
    common = [
        *MODEL, f"sampler.steps={args.steps}", "sampler.eval_steps=2", "run.group_size=4",
        "explore.schedule=off", f"run.iterations={args.iterations}",
        f"run.prompts_per_iteration={args.prompts}",
        "run.eval_every=100000", "run.eval_seeds=1", "run.eval_samples=1", "run.checkpoint_every=100000",
        'run.mode="runtime"', f'run.out_dir="{out}"', f'run.name="{mode}"', f"run.seed={args.seed}",
        "runtime.reserved_workers=1", "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f"runtime.step_delay_s={args.step_delay}",  # a slow device
    ]
    if mode == "no_preemption":
        spot = [f"runtime.spot_workers={args.spot_workers}"]
    else:
        trace = args.trace or (str(AWS) if AWS is not None else "synthetic")
        spot = [f'spot.trace="{trace}"', f"spot.trace_hour_s={args.trace_hour_s}",
                'spot.nodes="proportional"', f"spot.factor={args.factor}",
                f"spot.hard_kill_fraction={args.hard_kill}", f"spot.seed={args.seed}"]
        if trace == str(AWS):
            spot.append("spot.start_s=21529")  # the trace is empty before
        if mode == "naive_spot":
            spot.append("runtime.step_commits=false")
    exp = Experiment(load_recipe("tiny", [*common, *spot]))
    exp.runtime_options = {"spot_cpus": {1}}  # this process (and what it starts) is on CPU 0
    exp.run(progress=False)
    iters = [r for r in exp.records if r["event"] == "iteration"]
    last = iters[-1]
    n = len(iters)
    s_per_it = (last["wall_s"] - iters[0]["wall_s"]) / max(1, n - 1)
    preempt = last["preemptions"]
    return {
        "mode": mode, "iterations": n, "s_per_iteration": s_per_it, "preemptions": preempt,
        "resumed": last.get("requests_resumed", 0), "rerun": last.get("requests_rerun", 0),
        "steps_lost": last.get("steps_lost", 0),
        "lost_per_preemption": last.get("steps_lost", 0) / preempt if preempt else 0.0,
        "usd_per_iteration": last["cost_usd"] / n, "gpu_s_spot": last["gpu_s_spot"],
        "gpu_s_reserved": last["gpu_s_reserved"], "reward_last": last["reward_mean"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8, help="prompts (requests) per iteration")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per request")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds a worker waits after each step")
    p.add_argument("--trace", default=None, help="trace file (default: the shared AWS trace, else synthetic)")
    p.add_argument("--trace-hour-s", type=float, default=6.0, help="run seconds per trace hour")
    p.add_argument("--factor", type=float, default=0.2, help="local spot nodes per trace node")
    p.add_argument("--spot-workers", type=int, default=2, help="no_preemption's static spot workers")
    p.add_argument("--hard-kill", type=float, default=0.2, help="share of removals that are SIGKILLs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_preemption")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {0})  # the trainer and the reserved side; spot nodes go to CPU 1
    torch.set_num_threads(1)
    out = Path(args.out)
    rows = [run(mode, args, out) for mode in ("no_preemption", "step_commits", "naive_spot")]
    base = rows[0]
    cols = ["mode", "iterations", "s_per_iteration", "x_time", "preemptions", "resumed", "rerun",
            "steps_lost", "lost_per_preemption", "usd_per_iteration", "x_cost"]
    default = "AWS g4dn (shared)" if AWS is not None else "synthetic"
    print(f"preemption bench: trace {args.trace or default}, "
          f"1 trace hour = {args.trace_hour_s} run s, factor {args.factor}, hard kills {args.hard_kill}, "
          f"{args.iterations} iterations x {args.prompts} requests x {args.steps} steps")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        r["x_time"] = r["s_per_iteration"] / base["s_per_iteration"]
        r["x_cost"] = r["usd_per_iteration"] / base["usd_per_iteration"]
        print("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
