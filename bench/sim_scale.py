"""Scaling of the simulated cluster (run.mode = "sim"), Qwen-Image 20B profile on H200s.

    OMP_NUM_THREADS=1 taskset -c 1 python bench/sim_scale.py            # every table
    python bench/sim_scale.py scale | queue | wall | traces             # one of them

Every figure is from the simulator (labelled sim): the production queue, store, controller, node
group scheduler and planner cores on a virtual clock, workers timed by spotlight/sim/timing.py.

- scale: a fixed spot pool of N GPUs (8 per node, no preemption), weak scaling (2 rollout samples
  per spot GPU per iteration: N/8 prompts x 16), a fixed reserved trainer pool of 8 GPUs. Rollout
  throughput and its efficiency against 8 GPUs, iteration time, the exploration's share of the
  critical path (overlap = Spotlight; critical = DanceGRPO's best-of-N before the rollout), and the
  spot GPUs' idle share during the training phase without exploration (off) and with it (overlap).
- queue: 1,024 single-GPU nodes pulling through the real RequestQueueCore; the real CPU time of
  each queue operation (pull, heartbeat, complete, release, submit), p50 / p99.
- wall: wall seconds to simulate one trace hour at 512 GPUs (the AWS trace, proportional x 5.33
  nodes of 8 GPUs), one core.
- traces: 64 GPUs under a fixed pool, the real AWS trace, a synthetic Poisson trace and the same
  with correlated bursts; SP degree 1 and 4; preemptions, requests resumed, steps lost, seconds
  and dollars per iteration.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.sim.run import SimRun  # noqa: E402
from spotlight.spot.traces import shared_trace  # noqa: E402

AWS = shared_trace()  # None where the shared traces are not beside the repository
GPUS = [8, 16, 32, 64, 128, 256, 512]
BASE = ['run.mode="sim"', 'sim.profile="qwen-image-20b"', 'sim.gpu="h200"', "sim.gpus_per_node=8",
        "sim.samples_per_request=1", "run.group_size=16", "sampler.steps=20", "runtime.reserved_workers=0",
        "explore.chunk=4", "explore.planner=true", 'explore.arms=["16@taylor:3", "32", "64", "128", "256"]',
        "run.out_dir=\"/tmp/sim_scale\""]


def recipe(*extra: str):
    return load_recipe("tiny", [*BASE, *extra])


def run(*extra: str, ops: bool = False):
    sim = SimRun(recipe(*extra), write=False)
    sim.cluster.ops.enabled = ops
    t = time.perf_counter()
    summary = sim.run()
    return sim, summary, time.perf_counter() - t


def mean(records, key, skip=1, stop=None):
    xs = [r[key] for r in records[skip:stop] if r.get(key) is not None]
    return statistics.fmean(xs) if xs else float("nan")


def scale() -> None:
    print("# scale: fixed spot pool, 2 samples per spot GPU per iteration, trainer = 8 reserved H200s;")
    print("# means over iterations 1-7; 'idle overlap' over 5-6, once the planner tried its 5 arms (the")
    print("# last iteration explores nothing: no next iteration)")
    print(f"{'res':>5} {'spot':>5} {'samples/s':>9} {'eff':>6} {'rollout s':>9} {'train s':>8} {'iter s':>8} "
          f"{'expl crit% overlap':>18} {'expl crit% critical':>19} {'idle off':>8} {'idle overlap':>12} arm")
    for res in (1280, 512):
        base = None
        for n in GPUS:
            common = [f"sim.resolution={res}", f"sim.spot_gpus={n}", "sim.trainer_gpus=8",
                      f"run.prompts_per_iteration={max(1, n // 8)}", "run.iterations=8"]
            off = run(*common, 'explore.schedule="off"')[0].records
            ovl = run(*common, 'explore.schedule="overlap"')[0].records
            crit = run(*common, 'explore.schedule="critical"')[0].records
            thr = mean(ovl, "rollout_samples_per_s")
            base = base or thr / n
            share = 100 * mean(ovl, "explore_s") / mean(ovl, "iteration_s")
            share_c = 100 * mean(crit, "explore_s") / mean(crit, "iteration_s")
            print(f"{res:>5} {n:>5} {thr:>9.3f} {thr / n / base:>6.1%} {mean(ovl, 'rollout_s'):>9.1f} "
                  f"{mean(ovl, 'train_s'):>8.1f} {mean(ovl, 'iteration_s'):>8.1f} {share:>17.2f}% "
                  f"{share_c:>18.1f}% "
                  f"{mean(off, 'spot_idle_training'):>8.1%} {mean(ovl, 'spot_idle_training', 5, 7):>12.1%} "
                  f"{ovl[-1].get('explore_arm')}")


def queue() -> None:
    print("# queue: 1,024 single-GPU spot nodes (1,024 pullers) through RequestQueueCore, 512^2, overlap")
    sim, summary, wall = run("sim.resolution=512", "sim.spot_gpus=1024", "sim.gpus_per_node=1",
                             "sim.trainer_gpus=8", "run.prompts_per_iteration=128", "run.iterations=3",
                             'explore.schedule="overlap"', ops=True)
    allops = []
    print(f"{'op':>10} {'count':>8} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for name, xs in sorted(sim.cluster.ops.ops.items()):
        allops += xs
        xs = sorted(xs)
        print(f"{name:>10} {len(xs):>8} {1e6 * xs[len(xs) // 2]:>8.1f} {1e6 * xs[int(len(xs) * 0.99)]:>8.1f} "
              f"{1e6 * xs[-1]:>8.1f}")
    allops.sort()
    print(f"{'all':>10} {len(allops):>8} {1e6 * allops[len(allops) // 2]:>8.1f} "
          f"{1e6 * allops[int(len(allops) * 0.99)]:>8.1f} {1e6 * allops[-1]:>8.1f}   (sim wall {wall:.1f} s)")


def wall() -> None:
    print("# wall: one trace hour at 512 GPUs (AWS trace from its first capacity, proportional x 5.3334)")
    print(f"{'res':>5} {'wall s':>7} {'iterations':>10} {'events':>8} {'requests':>8} {'preemptions':>11}")
    for res in (1280, 512):
        _, s, w = run(f"sim.resolution={res}", f'spot.trace="{AWS}"', "spot.start_s=21529.0",
                      "spot.trace_hour_s=3600.0", 'spot.nodes="proportional"', "spot.factor=5.3334",
                      "spot.workers_per_node=8", "spot.hard_kill_fraction=0.3", "sim.trainer_gpus=64",
                      "run.prompts_per_iteration=64", "run.iterations=100000", "sim.hours=1.0",
                      'explore.schedule="overlap"')
        print(f"{res:>5} {w:>7.1f} {s['iterations']:>10} {s['events_run']:>8} {s['queue']['submitted']:>8} "
              f"{s['preemptions']:>11}")


def traces() -> None:
    print("# traces: 64 spot GPUs (8 nodes x 8), 1280^2, 32 trainer GPUs, 32 prompts x 16, overlap, 6 h")
    common = ["sim.resolution=1280", "sim.trainer_gpus=32", "run.prompts_per_iteration=32",
              "run.iterations=100000", "sim.hours=6.0", 'explore.schedule="overlap"',
              "spot.trace_hour_s=3600.0", "spot.workers_per_node=8", "spot.hard_kill_fraction=0.3",
              "spot.max_nodes=8"]
    synth = ['spot.trace="synthetic"', "spot.synthetic.max_nodes=8", "spot.synthetic.min_nodes=1",
             "spot.synthetic.preemption_rate=0.5", "spot.synthetic.arrival_rate=4.0", "spot.synthetic.seed=3",
             "spot.synthetic.duration_s=21600.0"]
    arms = {"fixed 64": ["sim.spot_gpus=64"],
            "AWS trace": [f'spot.trace="{AWS}"', "spot.start_s=21529.0"],
            "synthetic": synth,
            "synthetic+bursts": [*synth, "spot.synthetic.burst_fraction=0.5"]}
    print(f"{'trace':>17} {'sp':>3} {'its':>4} {'preempt':>7} {'resumed':>7} {'lost':>5} {'expired':>7} "
          f"{'released':>8} {'iter s':>7} {'x fixed':>7} {'$/iter':>7} {'x fixed':>7}")
    for sp in (1, 4):
        ref = None
        for name, extra in arms.items():
            sim, s, _ = run(*common, *extra, f"runtime.sp_degree={sp}", "runtime.spot_workers=8")
            its = sim.records
            it_s = statistics.fmean(r["iteration_s"] for r in its)
            usd = its[-1]["cost_usd"] / len(its)
            ref = ref or (it_s, usd)
            q = s["queue"]
            print(f"{name:>17} {sp:>3} {len(its):>4} {s['preemptions']:>7} {s['requests_resumed']:>7} "
                  f"{s['steps_lost']:>5} {q['expired']:>7} {q['released']:>8} {it_s:>7.0f} "
                  f"{it_s / ref[0]:>7.2f} "
                  f"{usd:>7.2f} {usd / ref[1]:>7.2f}")
            assert q["dead"] == 0 and q["duplicate_completions"] == 0


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the controller's "node lost" lines, one per SIGKILL
    which = sys.argv[1:] or ["scale", "queue", "wall", "traces"]
    for name in which:
        t = time.perf_counter()
        globals()[name]()
        print(f"({name}: {time.perf_counter() - t:.1f} s)\n", flush=True)
