"""Elastic SP at scale in the simulated cluster (run.mode = "sim"): regroup in place against a cold restart.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/sim_elastic_sp.py          # 64 and 512 spot GPUs
    python bench/sim_elastic_sp.py --gpus 64 --hours 2                     # a shorter table

Every figure is from the simulator (labelled sim). Qwen-Image 20B at 1280^2 on H200 hosts of 8 GPUs;
GPU-level preemption: the AWS trace's instances (g4dn.xlarge: one GPU each) are single GPUs
(sim.gpus_per_instance = 1) placed on the hosts, proportionally scaled to 64 or 512 GPUs, 30% of
removals SIGKILLs, the rest AWS notices. SP groups of degree 2, 4 and 8 (runtime.sp_degree), the
same trace and seed in both arms:

- regroup: runtime.sp_regroup = true, runtime.peer_weights = true — a group that loses a GPU
  re-forms at a new epoch on its surviving workers and the host's idle ones (timing.regroup_s), a
  GPU granted to a serving host copies the model from a node peer over NVLink;
- cold: runtime.sp_regroup = false, runtime.peer_weights = false — the survivors are restarted
  (timing.restart_s: process start + the 41 GB model from storage), a granted GPU loads cold.

Reconfiguration: per rollout request interrupted by a GPU loss, seconds from the loss to its
resumed compute (a group formed for it, loaded). Survivor: a surviving GPU of an interrupted group,
seconds from the loss until it computes again (idle waiting for a group, or restarting and
reloading), or until nothing waits for it on its host (one preempted in turn is not counted).
GPU-s lost/h: those seconds summed (a survivor preempted in turn included), per trace hour. Every
request must complete exactly once (asserted).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.sim.run import SimRun  # noqa: E402
from spotlight.spot.traces import shared_trace  # noqa: E402

AWS = shared_trace()  # None where the shared traces are not beside the repository
ARMS = {"regroup": ["runtime.sp_regroup=true", "runtime.peer_weights=true"],
        "cold": ["runtime.sp_regroup=false", "runtime.peer_weights=false"]}


def recipe(gpus: int, sp: int, hours: float, arm: str, trace: Path | str = AWS, start_s: float = 21529.0):
    return load_recipe("tiny", [
        'run.mode="sim"', 'sim.profile="qwen-image-20b"', 'sim.gpu="h200"', "sim.resolution=1280",
        "sim.gpus_per_node=8", "sim.gpus_per_instance=1", "sim.samples_per_request=1", "run.group_size=16",
        "sampler.steps=20", "runtime.reserved_workers=0", "runtime.spot_workers=8", "spot.workers_per_node=8",
        f"runtime.sp_degree={sp}", 'explore.schedule="off"', f'spot.trace="{trace}"',
        f"spot.start_s={start_s}",
        "spot.trace_hour_s=3600.0", 'spot.nodes="proportional"', f"spot.factor={gpus / 12:.4f}",
        "spot.hard_kill_fraction=0.3", "spot.seed=0", f"sim.trainer_gpus={gpus}", "model.heads=24",
        f"run.prompts_per_iteration={gpus // 2}", "run.iterations=100000", f"sim.hours={hours}",
        'run.out_dir="/tmp/sim_elastic_sp"', *ARMS[arm]])


def run(gpus: int, sp: int, hours: float, arm: str, **kw):
    sim = SimRun(recipe(gpus, sp, hours, arm, **kw), write=False)
    done: Counter[str] = Counter()
    inner = sim.cluster.on_complete

    def count(lease, result):
        done[lease.request_id] += 1
        inner(lease, result)

    sim.cluster.on_complete = count
    summary = sim.run()
    rollouts = sum(1 for rid in done if "/rollout/" in rid)
    assert rollouts == sum(r["rollout_samples"] for r in sim.records), "a rollout request was not completed"
    assert max(done.values()) == 1 and summary["queue"]["dead"] == 0, "a request completed twice or died"
    return sim, summary


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.1f} {pct(xs, 0.5):.1f} {pct(xs, 0.99):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hours", type=float, default=6.0, help="trace hours replayed per cell")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the controller's "node lost" lines, one per SIGKILL
    print(f"# sim: Qwen-Image 20B 1280^2, H200 hosts of 8, AWS trace as single GPUs, {args.hours:g} trace h")
    print("# request: an interrupted rollout's seconds from the GPU loss to its resumed compute "
          "(mean p50 p99);")
    print("# survivor: a surviving GPU's seconds from the loss until it computes again or is free with")
    print("#   nothing waiting for it on its host (mean p50 p99); one preempted in turn is not a survivor;")
    print("# interr / surv: how many (a group whose every GPU went at once has no survivor)")
    print(f"{'gpus':>5} {'sp':>3} {'arm':>8} {'preempt':>7} {'interr':>6} {'request s':>20} "
          f"{'surv':>4} {'survivor s':>20} "
          f"{'GPU-s lost/h':>12} {'its':>4} {'iter s':>7} {'lost steps':>10} {'wall s':>6}")
    for gpus in args.gpus:
        for sp in args.sp:
            for arm in ARMS:
                t = time.perf_counter()
                sim, s = run(gpus, sp, args.hours, arm)
                x, y = s["reconfig_s"], s["survivor_s"]
                hours = s["sim_s"] / 3600
                it_s = statistics.fmean(r["iteration_s"] for r in sim.records)
                print(f"{gpus:>5} {sp:>3} {arm:>8} {s['preemptions']:>7} {len(x):>6} {stats(x):>20} "
                      f"{len(y):>4} {stats(y):>20} "
                      f"{s['gpu_s_lost_reconfig'] / hours:>12.1f} {len(sim.records):>4} {it_s:>7.0f} "
                      f"{s['steps_lost']:>10} {time.perf_counter() - t:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
