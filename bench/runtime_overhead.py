# OMP_NUM_THREADS=1 python bench/runtime_overhead.py --iterations 6 --repeats 2
"""Runtime overhead: wall time per GRPO iteration through the actor runtime vs the in-process loop.

Same recipe, same seeds, measured side by side in one invocation (modes interleaved, `--repeats`
rounds, so a noisy neighbour hits every mode alike). Per-iteration time is the loop's own
explore + rollout + train/publish time (evaluation excluded); iteration 0 is a warm-up and left
out; the table shows medians. Modes:

- in-process         the reference `LocalExecutor` (one process, 1 torch thread)
- runtime 1 worker   the same work on one reserved worker process: the pure cost of the runtime
                     (queue round trips, per-step commits, trajectory and weight transfers)
- runtime 1+2        1 reserved + 2 spot workers (the default): work spread over processes

Every mode must produce the same per-iteration rewards (checked). Goal: overhead <= 5%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from spotlight import Experiment, load_recipe  # noqa: E402

MODES = {"in-process": ("in-process", 1, 0), "runtime 1 worker": ("runtime", 1, 0),
         "runtime 1+2": ("runtime", 1, 2)}


def recipe(args, mode: str, reserved: int, spot: int, out: str):
    return load_recipe("tiny", [
        "model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16",
        f"model.image_size={args.image_size}", "model.patch=4", f"sampler.steps={args.steps}", "sampler.eval_steps=2",
        f"run.group_size={args.group}", f"explore.candidates={args.candidates}", f"run.iterations={args.iterations}",
        f"run.prompts_per_iteration={args.prompts}", "run.eval_every=1000", "run.eval_seeds=1",
        "run.eval_samples=2", "run.checkpoint_every=1000", f'run.mode="{mode}"', f"run.reserved_workers={reserved}",
        f"run.spot_workers={spot}", f"explore.enabled={str(args.explore).lower()}", f'run.out_dir="{out}"',
        f'run.name="{mode}-{reserved}-{spot}"'])


def one_run(args, name: str, out: str) -> tuple[list[float], list, dict, float | None]:
    mode, reserved, spot = MODES[name]
    exp = Experiment(recipe(args, mode, reserved, spot, out))
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"]
    parts = {k: statistics.median(r[k] for r in its[1:]) for k in ("explore_s", "rollout_s", "train_s")}
    path_ms = None
    if mode == "runtime" and reserved + spot == 1:  # one worker: batch wall - time inside it = the runtime's path
        batches = exp.loop.executor.timings[2 if args.explore else 1:]  # iteration 0 left out
        path_ms = 1e3 * statistics.median((b["wall_s"] - b["worker_s"]) / b["requests"] for b in batches)
    return [r["explore_s"] + r["rollout_s"] + r["train_s"] for r in its[1:]], [r["rewards"] for r in its], parts, path_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--no-explore", dest="explore", action="store_false", help="random seeds (no explore phase)")
    args = p.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {k: [] for k in MODES}
    parts: dict[str, list[dict]] = {k: [] for k in MODES}
    path: list[float] = []
    rewards: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for name in MODES:
                t0 = time.monotonic()
                its, rw, pt, path_ms = one_run(args, name, out)
                path += [path_ms] if path_ms is not None else []
                print(f"  {name:18s} run {time.monotonic() - t0:6.1f}s (incl. startup)", flush=True)
                times[name] += its
                parts[name].append(pt)
                assert rewards.setdefault(name, rw) == rw, f"{name}: rewards differ between repeats"
    same = all(rw == rewards["in-process"] for rw in rewards.values())
    base = statistics.median(times["in-process"])
    print(f"\ntiny DiT (1 layer, 2x16 heads, {args.image_size}px), {args.prompts} prompts x G={args.group}, "
          f"M={args.candidates} candidates, {args.steps} steps; {args.iterations - 1} timed iterations x "
          f"{args.repeats} repeats; torch threads 1; cores {os.cpu_count()}")
    print(f"{'mode':18s} {'s/iter (median)':>16s} {'explore':>8s} {'rollout':>8s} {'train+pub':>9s} {'vs in-process':>14s}")
    for name in MODES:
        med = statistics.median(times[name])
        pm = {k: statistics.median(x[k] for x in parts[name]) for k in ("explore_s", "rollout_s", "train_s")}
        print(f"{name:18s} {med:16.3f} {pm['explore_s']:8.3f} {pm['rollout_s']:8.3f} {pm['train_s']:9.3f} "
              f"{med / base:13.3f}x")
    print(f"runtime path per request (1 worker: batch wall - time inside the worker, median): "
          f"{statistics.median(path):.2f} ms")
    print(f"same per-iteration rewards in every mode: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
