# python bench/core_interference.py [--rounds 6] [overrides ...]
"""How much one CPU's work slows the other CPU's on this machine: the control for the exploration
time bench, which models "reserved" and "spot" hardware as CPU 0 and CPU 1 of one 2-core VM.

The trainer (the demo recipe's model and GRPO update on one iteration's groups) runs on CPU 0. On
CPU 1 a process does what the spot worker does during an overlapped training window: scores
candidate seeds with the rollout policy at the demo planner's cheap arm (8 candidates, TaylorSeer
cache every 3rd call), in a loop. It is stopped (SIGSTOP, CPU 1 idle) and continued (SIGCONT, CPU 1
busy) between measurements, alternately, `--rounds` times each: the same update timed with the neighbour idle
and busy. On separate machines — what reserved and spot nodes are — the ratio is 1.00 by
construction; here it is whatever the two cores share (memory bandwidth, cache, the host's
scheduling of two vCPUs).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight.comm import messages as m  # noqa: E402
from spotlight.loop import Loop  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402

_NEIGHBOUR = """
import sys, torch
torch.set_num_threads(1)
from spotlight import work
from spotlight.comm import messages as m
from spotlight.recipe import load_recipe
recipe = load_recipe("tiny", sys.argv[1:])
model = work.policy_model(recipe)
reward, shape = work.recipe_reward(recipe), work.image_shape(recipe)
print("ready", flush=True)
k = 0
while True:  # the spot worker's exploration, forever: the demo's cheap arm, 8@taylor:3
    job = m.ExploreWork(prompt="two red circles", seeds=list(range(k, k + 8)), version=0,
                        cache="taylor:3", init_seed=None)
    work.explore(model, job, recipe.sampler, reward, shape)
    k += 8
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    out = 'run.out_dir="/tmp/core_interference"'
    recipe = load_recipe("tiny", [*args.overrides, "run.minutes=none", out])
    loop = Loop(recipe, progress=False)
    prompts = loop.iteration_prompts(0)
    jobs = [m.RolloutWork(prompt=p, seeds=list(range(8 * i, 8 * i + 8)), version=0, init_seed=None)
            for i, p in enumerate(prompts)]
    groups = loop.executor.rollout("it0", jobs).result()
    root = str(Path(__file__).resolve().parent.parent)
    neighbour = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, *args.overrides], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        os.sched_setaffinity(neighbour.pid, {1})
        assert neighbour.stdout.readline().strip() == "ready"
        times: dict[str, list[float]] = {"idle": [], "busy": []}
        loop.trainer.update(groups)  # warm-up
        for _ in range(args.rounds):
            for state in ("idle", "busy"):
                neighbour.send_signal(signal.SIGSTOP if state == "idle" else signal.SIGCONT)
                t0 = time.perf_counter()
                loop.trainer.update(groups)
                times[state].append(time.perf_counter() - t0)
    finally:
        neighbour.send_signal(signal.SIGCONT)
        neighbour.kill()
        neighbour.wait()
    idle, busy = statistics.median(times["idle"]), statistics.median(times["busy"])
    print(f"\ncommand: python bench/core_interference.py --rounds {args.rounds} {' '.join(args.overrides)}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    print("| CPU 1 during the update | GRPO update on CPU 0 (median s) | vs idle | per round (s) |")
    print("| --- | --- | --- | --- |")
    for state, med in (("idle (neighbour stopped)", idle), ("busy (exploring)", busy)):
        per = times[state.split()[0]]
        print(f"| {state} | {med:.3f} | {med / idle:.2f}x | {' '.join(f'{x:.2f}' for x in per)} |")


if __name__ == "__main__":
    main()
