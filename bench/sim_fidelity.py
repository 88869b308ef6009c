"""Sim against the real runtime: the same tiny recipe, trace and seed in run.mode = "runtime" (real
processes on this machine) and run.mode = "sim" (the tiny timing profile), side by side.

    OMP_NUM_THREADS=1 python bench/sim_fidelity.py --iterations 8

Printed: the fault injector's actions (the same trace replayed by the same FaultInjector with the
same seed: which node gets a notice and which a SIGKILL, at which run second), preemptions,
requests resumed, steps lost, seconds and dollars per iteration in each mode, and the ratio
sim / runtime (goal: within 10%). Exploration is off; the reserved worker and the trainer share
CPU 0, every spot node CPU 1 (as bench/preemption.py), one worker per spot node.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spotlight import Experiment, load_recipe  # noqa: E402

AWS = next((p / "shared" / "traces" / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv" for p in ROOT.parents
            if (p / "shared" / "traces").is_dir()), None)


def recipe(mode: str, args):
    return load_recipe("tiny", [
        f'run.mode="{mode}"', f"run.iterations={args.iterations}", "run.minutes=none",
        "run.eval_every=100000", "run.checkpoint_every=100000", 'explore.schedule="off"',
        f'run.out_dir="{args.out}"', f'run.name="{mode}"', "runtime.reserved_workers=1",
        "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f'spot.trace="{AWS}"', "spot.start_s=21529", f"spot.trace_hour_s={args.trace_hour_s}",
        'spot.nodes="proportional"', f"spot.factor={args.factor}",
        f"spot.hard_kill_fraction={args.hard_kill}",
        f"spot.seed={args.seed}", "spot.workers_per_node=1"])


def summarise(exp, injector) -> dict:
    its = [r for r in exp.records if r["event"] == "iteration"]
    last, n = its[-1], len(its)
    secs = [r["iteration_s"] for r in its[1:]]  # the first iteration pays the runtime's warm-up
    return {"iterations": n, "s_per_iteration": sum(secs) / len(secs),
            "rollout_s": sum(r["rollout_s"] for r in its[1:]) / len(secs),
            "train_s": sum(r["train_s"] for r in its[1:]) / len(secs), "preemptions": last["preemptions"],
            "resumed": last.get("requests_resumed", 0), "steps_lost": last.get("steps_lost", 0),
            "usd_per_iteration": last["cost_usd"] / n, "end_s": last["spot_elapsed_s"],
            "actions": [(round(x["t"], 1), x["action"], x["node"]) for x in injector.log]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--trace-hour-s", type=float, default=12.0)
    p.add_argument("--factor", type=float, default=0.2)
    p.add_argument("--hard-kill", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_sim_fidelity")
    args = p.parse_args()
    logging.disable(logging.WARNING)
    os.sched_setaffinity(0, {0})
    real = Experiment(recipe("runtime", args))
    real.runtime_options = {"spot_cpus": {1}}
    real.run(progress=False)
    rows = {"runtime": summarise(real, real.runtime.injector)}
    sim = Experiment(recipe("sim", args))
    sim.run(progress=False)
    rows["sim"] = summarise(sim, sim.loop.injector)
    end = min(rows["runtime"]["end_s"], rows["sim"]["end_s"])
    for name, r in rows.items():
        acts = [a for a in r["actions"] if a[0] <= end]
        print(f"{name:>8} actions to {end:.1f} s: {acts}")
    cols = ["iterations", "s_per_iteration", "rollout_s", "train_s", "preemptions", "resumed", "steps_lost",
            "usd_per_iteration"]
    print(f"{'':>8} " + " ".join(f"{c:>17}" for c in cols))
    for name, r in rows.items():
        print(f"{name:>8} " + " ".join(f"{r[c]:>17.4g}" for c in cols))
    ratios = [f"{rows['sim'][c] / rows['runtime'][c]:>17.3f}" if rows["runtime"][c] else f"{'-':>17}"
              for c in cols]
    print(f"{'sim/rt':>8} " + " ".join(ratios))
    print(json.dumps({k: {c: v for c, v in r.items() if c != "actions"} for k, r in rows.items()}))


if __name__ == "__main__":
    main()
