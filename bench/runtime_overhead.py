# OMP_NUM_THREADS=1 python bench/runtime_overhead.py --paired --model tiny --iterations 17
# OMP_NUM_THREADS=1 python bench/runtime_overhead.py --model tiny --iterations 4 --repeats 3
"""What does the actor runtime cost per iteration against the in-process loop?

Runtime overhead: wall time per GRPO iteration through the actor runtime vs the in-process loop.

Same recipe, same seeds, measured side by side in one invocation (modes interleaved, `--repeats`
rounds, so a noisy neighbour hits every mode alike; each run in a fresh Python process, as a user
runs it — runs sharing one process slowed every later run by up to 30%, measured). Per-iteration
time is the loop's own explore + rollout + train/publish time (evaluation excluded); iteration 0 is
a warm-up and left out; the table shows medians. Modes:

- in-process         the reference `LocalExecutor` (one process, 1 torch thread)
- runtime 1 worker   the same work on one reserved worker process: the pure cost of the runtime
                     (queue round trips, per-step commits, trajectory and weight transfers)
- runtime 1+2        1 reserved + 2 spot workers (the default): work spread over processes

Every mode must produce the same per-iteration rewards (checked). Goal: overhead <= 5%.

`--paired` is the cleanest wall-time comparison: the in-process loop and the loop through a
one-worker runtime are built side by side in one process and stepped iteration by iteration in
alternating order (ABBA), so each pair of iterations sees the machine in the same minute.

Two more measures of the one-worker overhead, from the interleaved runs:
- "vs in-process": median s/iter against the in-process runs of the same invocation. Honest but
  exposed to the machine: on the shared 2-vCPU VM one process's speed swings by ±10% and a fresh
  process runs the same work ~12% slower than a warm one (bench/machine_noise.py), so runs a
  minute apart can differ by 20% for no reason of ours.
- "same run": inside each one-worker run, the time the runtime adds to an iteration — per batch,
  wall time minus the time the worker spent computing (model, sampler, reward: `compute_s`),
  plus publishing the weights — over the iteration's time minus that (the work itself). Both
  parts are timed in the same seconds, so a slow machine slows both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from spotlight import Experiment, load_recipe  # noqa: E402

MODES = {
    "in-process": ("in-process", 1, 0),
    "runtime 1 worker": ("runtime", 1, 0),
    "runtime 1+2": ("runtime", 1, 2),
}


# --model: "tiny" is the demo's model as shipped (recipes/tiny.toml: 4 layers, 4x32 heads, 32 px, the
# pretrained base); "micro" a 1-layer random-init cut of it whose requests take ~40 ms, so the
# runtime's fixed per-request costs show as plainly as they can.
MODELS = {
    "tiny": [],
    "micro": [
        "model.checkpoint=none",
        "model.layers=1",
        "model.heads=2",
        "model.head_dim=16",
        "model.patch=4",
    ],
}


# The sampler and prompts every recorded overhead figure used (the demo recipe as of issue 3), pinned
# so the bench measures the same work when the demo recipe changes.
SAMPLER = ['sampler.sde_type="flow"', "sampler.noise_level=1.0", "sampler.sde_steps=2",
           "sampler.noise_patch=8", "sampler.shared_init=true", 'run.prompts="demo"']


def recipe(args, mode: str, reserved: int, spot: int, out: str):
    size = [f"model.image_size={args.image_size}"] if args.image_size else []
    return load_recipe(
        "tiny",
        [
            *MODELS[args.model],
            *size,
            f"sampler.steps={args.steps}",
            *SAMPLER,
            "sampler.eval_steps=2",
            f"run.group_size={args.group}",
            f"explore.candidates={args.candidates}",
            f"run.iterations={args.iterations}",
            f"run.prompts_per_iteration={args.prompts}",
            "run.eval_every=1000",
            "run.eval_seeds=1",
            "run.eval_samples=2",
            "run.checkpoint_every=1000",
            f'run.mode="{mode}"',
            f"runtime.reserved_workers={reserved}",
            f"runtime.spot_workers={spot}",
            f"explore.schedule={'critical' if args.explore else 'off'}",
            f'run.out_dir="{out}"',
            f'run.name="{mode}-{reserved}-{spot}"',
        ],
    )


def one_run(args, name: str, out: str) -> tuple[list[float], list, dict, dict | None]:
    mode, reserved, spot = MODES[name]
    exp = Experiment(recipe(args, mode, reserved, spot, out))
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"]
    parts = {k: statistics.median(r[k] for r in its[1:]) for k in ("explore_s", "rollout_s", "train_s")}
    iter_s = [r["explore_s"] + r["rollout_s"] + r["train_s"] for r in its]
    same_run = None
    if mode == "runtime" and reserved + spot == 1:  # one worker: nothing overlaps, times add up
        per_iter = 3 if args.explore else 2  # [explore,] rollout, publish
        timings = exp.loop.executor.timings[1 + per_iter :]  # the first publish and iteration 0 left out
        batches = [t for t in timings if t["kind"] != "publish"]
        added = sum(t["wall_s"] - t.get("compute_s", 0.0) for t in timings)
        same_run = {
            "added_s": added,
            "work_s": sum(iter_s[1:]) - added,
            "path_ms": 1e3
            * statistics.median((b["wall_s"] - b["worker_s"]) / b["requests"] for b in batches),
            "in_worker_ms": 1e3
            * statistics.median((b["worker_s"] - b["compute_s"]) / b["requests"] for b in batches),
            "publish_ms": 1e3 * statistics.median(t["wall_s"] for t in timings if t["kind"] == "publish"),
        }
    return iter_s[1:], [r["rewards"] for r in its], parts, same_run


def paired(args) -> None:
    """``--paired``: the in-process loop and the loop through a one-worker runtime, built side by
    side in this process and stepped iteration by iteration in alternating order (ABBA...), so
    both see the machine at the same minute. Prints each iteration's pair and the median ratio."""
    from spotlight.actors.runtime import LocalRuntime
    from spotlight.loop import Loop

    with tempfile.TemporaryDirectory() as out:
        ref = Loop(recipe(args, "in-process", 1, 0, out), progress=False)
        rt_recipe = recipe(args, "runtime", 1, 0, out)
        with LocalRuntime(rt_recipe) as rt:
            run = Loop(rt_recipe, executor=rt.executor, progress=False)
            print(f"{'iter':>4s} {'in-process s':>12s} {'runtime s':>10s} {'ratio':>6s}  first")
            ratios, pairs = [], []
            for it in range(args.iterations):
                order = (ref, run) if it % 4 in (0, 3) else (run, ref)
                done = {id(loop): loop.step(it) for loop in order}
                a, b = done[id(ref)], done[id(run)]
                assert a["rewards"] == b["rewards"], f"iteration {it}: rewards differ"
                ta, tb = (r["explore_s"] + r["rollout_s"] + r["train_s"] for r in (a, b))
                first = "in-process" if order[0] is ref else "runtime"
                print(f"{it:4d} {ta:12.3f} {tb:10.3f} {tb / ta:6.3f}  {first}", flush=True)
                if it > 0:  # iteration 0 warms up both
                    ratios.append(tb / ta)
                    pairs.append((ta, tb))
    size = args.image_size or load_recipe("tiny").model.image_size
    print(
        f"\n{args.model} model, {size}px, {args.prompts} prompts x G={args.group}, M={args.candidates}, "
        f"{args.steps} steps; {len(ratios)} paired iterations; torch threads 1; cores {os.cpu_count()}"
    )
    print(
        f"runtime (1 worker) / in-process, same iteration, same minute: "
        f"median {statistics.median(ratios):.3f}x, "
        f"total {sum(b for _, b in pairs) / sum(a for a, _ in pairs):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); same rewards every iteration: yes"
    )


def run_in_child(name: str, out: str) -> tuple:
    """``one_run`` in a fresh interpreter (this script with ``--one``); its JSON result."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{name} run failed:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return r["its"], r["rewards"], r["parts"], r["same_run"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--model", choices=sorted(MODELS), default="micro")
    p.add_argument(
        "--image-size", type=int, default=None, help="default: 16 for micro, the recipe's for tiny"
    )
    p.add_argument(
        "--no-explore", dest="explore", action="store_false", help="random seeds (no explore phase)"
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="step the in-process and the 1-worker runtime loops alternately in one process",
    )
    p.add_argument("--one", choices=list(MODES), help=argparse.SUPPRESS)  # internal: one run, JSON out
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.image_size is None and args.model == "micro":
        args.image_size = 16
    torch.set_num_threads(1)
    if args.paired:
        paired(args)
        return
    if args.one:
        print(
            json.dumps(dict(zip(("its", "rewards", "parts", "same_run"), one_run(args, args.one, args.out))))
        )
        return
    times: dict[str, list[float]] = {k: [] for k in MODES}
    parts: dict[str, list[dict]] = {k: [] for k in MODES}
    same_runs: list[dict] = []
    rewards: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for name in MODES:
                t0 = time.monotonic()
                its, rw, pt, same_run = run_in_child(name, out)
                same_runs += [same_run] if same_run is not None else []
                print(f"  {name:18s} run {time.monotonic() - t0:6.1f}s (incl. startup)", flush=True)
                times[name] += its
                parts[name].append(pt)
                assert rewards.setdefault(name, rw) == rw, f"{name}: rewards differ between repeats"
    same = all(rw == rewards["in-process"] for rw in rewards.values())
    base = statistics.median(times["in-process"])
    model = (
        "micro DiT (1 layer, 2x16 heads, random init"
        if args.model == "micro"
        else "tiny DiT (the demo's: 4 layers, 4x32 heads, base checkpoint"
    )
    size = args.image_size or load_recipe("tiny").model.image_size
    print(
        f"\n{model}, {size}px), {args.prompts} prompts x G={args.group}, "
        f"M={args.candidates} candidates, {args.steps} steps; {args.iterations - 1} timed iterations x "
        f"{args.repeats} repeats; torch threads 1; cores {os.cpu_count()}"
    )
    print(
        f"{'mode':18s} {'s/iter (median)':>16s} {'explore':>8s} {'rollout':>8s} {'train+pub':>9s} "
        f"{'vs in-process':>14s}"
    )
    for name in MODES:
        med = statistics.median(times[name])
        pm = {k: statistics.median(x[k] for x in parts[name]) for k in ("explore_s", "rollout_s", "train_s")}
        print(
            f"{name:18s} {med:16.3f} {pm['explore_s']:8.3f} {pm['rollout_s']:8.3f} {pm['train_s']:9.3f} "
            f"{med / base:13.3f}x"
        )
    added = sum(r["added_s"] for r in same_runs) / sum(r["work_s"] for r in same_runs)
    per_run = ", ".join(f"{100 * r['added_s'] / r['work_s']:.1f}%" for r in same_runs)
    print(
        f"runtime 1 worker, same run: the runtime adds {100 * added:.1f}% to the work of an iteration "
        f"(runs: {per_run})"
    )
    print(
        f"  per request (median): {statistics.median(r['path_ms'] for r in same_runs):.2f} ms outside the "
        f"worker (queue, agent, result), "
        f"{statistics.median(r['in_worker_ms'] for r in same_runs):.2f} ms inside it "
        f"but not computing (commits, seal, weights); per iteration: publish "
        f"{statistics.median(r['publish_ms'] for r in same_runs):.1f} ms"
    )
    print(f"same per-iteration rewards in every mode: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
