# OMP_NUM_THREADS=1 python bench/sim_fidelity.py --iterations 8 --pairs 2
"""Sim against the real runtime: the same tiny recipe, trace and seed in run.mode = "runtime" (real
processes on this machine) and run.mode = "sim" (the tiny profile priced by a calibration of this
machine measured in the same invocation), side by side.

    OMP_NUM_THREADS=1 python bench/sim_fidelity.py --iterations 8 --pairs 2

Layout (as bench/preemption.py): this process — the trainer, the queue, the store and the reserved
node of one worker — on CPU 0; every spot node (one worker each) on CPU 1. The machine is shared,
so its speed drifts: the bench measures the primitives (``spotlight.sim.calibrate``: step seconds
with 1 and 2 processes computing at once on CPU 1, one on CPU 0, the trainer's seconds per sample,
a worker's and an agent's start, the runtime's own seconds per rollout request) before and after
each runtime run, and the sim of that run is
priced by the mean of the two (its range: each alone). Nothing is fitted to iteration seconds.
One figure is taken from the runtime run: the run seconds its trainer spent setting up (and
evaluating the base) after the replay started, so that the sim's first iteration meets the same
trace second (``sim.setup_s``); a one-machine run spends tens of seconds there under load.

Printed per pair: the fault injector's actions in both (the same trace replayed by the same
FaultInjector with the same seed: which node gets a notice and which a SIGKILL, at which run
second), removals up to the shorter run's end, requests resumed, steps lost, seconds and dollars
per iteration after the first (the runtime's warm-up), and sim / runtime. Goal: within 10%. The
row "sim, no request_s" prices the runtime's own per-request work at zero: what that term explains.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spotlight import Experiment, load_recipe  # noqa: E402
from spotlight.sim.calibrate import measure  # noqa: E402
from spotlight.sim.timing import Calibration  # noqa: E402
from spotlight.spot.traces import shared_trace  # noqa: E402

SPOT_CPUS, RESERVED_CPUS = {1}, {0}


def overrides(args) -> list[str]:
    return [
        f"run.iterations={args.iterations}", "run.minutes=none", "run.eval_every=100000",
        # the base's evaluation runs after run second 0 (the sim has none): as small as it goes
        "run.eval_seeds=1", "run.eval_samples=1", "sampler.eval_steps=2",
        "run.checkpoint_every=100000", 'explore.schedule="off"', f'run.out_dir="{args.out}"',
        "runtime.reserved_workers=1", "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f'spot.trace="{args.trace}"', "spot.start_s=21529", f"spot.trace_hour_s={args.trace_hour_s}",
        'spot.nodes="proportional"', f"spot.factor={args.factor}",
        f"spot.hard_kill_fraction={args.hard_kill}", f"spot.seed={args.seed}", "spot.workers_per_node=1"]


def mean_calibration(cals: list[Calibration]) -> Calibration:
    avg = {}
    for f in fields(Calibration):
        vals = [getattr(c, f.name) for c in cals]
        if isinstance(vals[0], tuple):
            avg[f.name] = tuple(statistics.fmean(x) for x in zip(*vals))
        elif isinstance(vals[0], int):
            avg[f.name] = vals[0]
        else:
            avg[f.name] = statistics.fmean(vals)
    return Calibration(**avg)


def summarise(exp, injector) -> dict:
    its = [r for r in exp.records if r["event"] == "iteration"]
    first, last, n = its[0], its[-1], len(its) - 1  # after the first iteration (the runtime's warm-up)
    secs = [r["iteration_s"] for r in its[1:]]
    return {"iterations": len(its), "s_per_iteration": sum(secs) / n,
            "rollout_s": sum(r["rollout_s"] for r in its[1:]) / n,
            "train_s": sum(r["train_s"] for r in its[1:]) / n,
            "resumed": last.get("requests_resumed", 0), "steps_lost": last.get("steps_lost", 0),
            "usd_per_iteration": (last["cost_usd"] - first["cost_usd"]) / n, "end_s": last["spot_elapsed_s"],
            "actions": [(round(x["t"], 1), x["action"], x["node"]) for x in injector.log]}


def setup_s(exp) -> float:
    """Run seconds from the replay's start to the first iteration's: the runtime's trainer set-up
    and base evaluation (the replay starts at its first executor)."""
    first = next(r for r in exp.records if r["event"] == "iteration")
    return max(first["spot_elapsed_s"] - first["iteration_s"], 0.0)


def sim_run(args, name: str, cal: Calibration, setup: float) -> dict:
    path = Path(args.out) / f"{name}.calibration.json"
    cal.save(path)
    exp = Experiment(load_recipe("tiny", [*overrides(args), 'run.mode="sim"', f'run.name="{name}"',
                                          f'sim.calibration="{path}"', f"sim.setup_s={setup}"]))
    exp.run(progress=False)
    return summarise(exp, exp.loop.injector)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--pairs", type=int, default=2, help="runtime runs, each between two calibrations")
    p.add_argument("--trace", default=None, help="counts trace (default: the shared AWS g4dn trace)")
    p.add_argument("--trace-hour-s", type=float, default=12.0)
    p.add_argument("--factor", type=float, default=0.2)
    p.add_argument("--hard-kill", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_sim_fidelity")
    args = p.parse_args()
    args.trace = args.trace or shared_trace()
    if args.trace is None:
        p.error("no --trace, and the shared AWS trace is not beside the repository")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logging.disable(logging.WARNING)
    os.sched_setaffinity(0, RESERVED_CPUS)
    t0 = time.monotonic()
    cals = [measure(SPOT_CPUS, RESERVED_CPUS, overrides(args))]
    pairs = []
    for i in range(args.pairs):
        name = [f'run.name="runtime{i}"']
        real = Experiment(load_recipe("tiny", [*overrides(args), 'run.mode="runtime"', *name]))
        real.runtime_options = {"spot_cpus": SPOT_CPUS}
        real.run(progress=False)
        cals.append(measure(SPOT_CPUS, RESERVED_CPUS, overrides(args)))
        setup = setup_s(real)
        rows = {"runtime": summarise(real, real.runtime.injector),
                "sim": sim_run(args, f"sim{i}", mean_calibration(cals[i:i + 2]), setup),
                "sim, cal. before": sim_run(args, f"sim{i}_before", cals[i], setup),
                "sim, cal. after": sim_run(args, f"sim{i}_after", cals[i + 1], setup),
                "sim, no request_s": sim_run(args, f"sim{i}_bare",
                                             replace(mean_calibration(cals[i:i + 2]), request_s=0.0), setup)}
        pairs.append(rows)
        report(i, rows, cals[i:i + 2], setup, time.monotonic() - t0)
    cols = ("s_per_iteration", "usd_per_iteration")
    print("\n# sim / runtime, every pair (sim priced by the mean of the calibrations around its runtime run)")
    for c in cols:
        r = [x["sim"][c] / x["runtime"][c] for x in pairs]
        print(f"{c:>18}: " + " ".join(f"{x:.3f}" for x in r) + f"   mean {statistics.fmean(r):.3f}")
    print(json.dumps({"calibrations": [asdict(c) for c in cals],
                      "pairs": [{k: {c: v for c, v in r.items() if c != "actions"} for k, r in x.items()}
                                for x in pairs]}))


def report(i: int, rows: dict, cals: list[Calibration], setup: float, elapsed: float) -> None:
    print(f"\n## pair {i} ({elapsed / 60:.1f} min in; load average {os.getloadavg()[0]:.1f}); "
          f"the runtime's set-up after the replay's start: {setup:.1f} s")
    for when, c in zip(("before", "after"), cals):
        spot = ", ".join(f"{x:.4f}" for x in c.spot_step_s)
        print(f"calibration {when}: spot step s (1, 2 at once) {spot}; "
              f"reserved {c.reserved_step_s[0]:.4f}; train s/sample {c.train_s_per_sample:.4f}; "
              f"worker start {c.worker_start_s:.1f} s; agent start {c.node_start_s:.2f} s; "
              f"runtime's own s/request {c.request_s:.4f}")
    # up to a second before the shorter run's end: an action in that second races the run's stop
    end = min(r["end_s"] for r in rows.values()) - 1.0
    acts = {k: [a for a in r["actions"] if a[0] <= end] for k, r in rows.items()}
    for name in ("runtime", "sim"):
        print(f"{name:>8} actions to {end:.1f} s: {acts[name]}")
    same = [a[1:] for a in acts["runtime"] if a[1] != "kill_after_warning"] == \
           [a[1:] for a in acts["sim"] if a[1] != "kill_after_warning"]
    print(f"same adds, notices and SIGKILLs of the same nodes in order: {same}")
    cols = ["iterations", "s_per_iteration", "rollout_s", "train_s", "removals", "resumed", "steps_lost",
            "usd_per_iteration"]
    for name, r in rows.items():
        r["removals"] = sum(a[1] in ("notice", "hard_kill") for a in acts[name]) if name in acts else \
            sum(a[1] in ("notice", "hard_kill") for a in r["actions"] if a[0] <= end)
    print(f"{'':>17} " + " ".join(f"{c:>17}" for c in cols))
    for name, r in rows.items():
        print(f"{name:>17} " + " ".join(f"{r[c]:>17.4g}" for c in cols))
    for name in ("sim", "sim, cal. before", "sim, cal. after", "sim, no request_s"):
        ratios = [f"{rows[name][c] / rows['runtime'][c]:>17.3f}" if rows["runtime"][c] else f"{'-':>17}"
                  for c in cols]
        print(f"{name + ' / rt':>17} " + " ".join(ratios))


if __name__ == "__main__":
    main()
