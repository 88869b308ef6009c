# OMP_NUM_THREADS=1 python bench/machine_noise.py
"""How steady is this machine? The yardstick behind the runtime-overhead notes
(docs/history/BENCHMARKS-lab-notes.md, "Runtime overhead").

Times one fixed piece of work — a best-of-16 exploration sample of the tiny (demo) model, the
runtime's typical request — three ways, interleaved in rounds:
- parent: in this process, again and again (how much one process's speed swings by itself);
- child: the same work in a fresh `python` child process, with no runtime code at all, while the
  parent waits (what a worker process pays for being a different process, nothing else);
- idle processes: this process's CPU time over a few seconds of doing nothing, with a one-worker
  LocalRuntime up (whether the runtime burns CPU while idle).
Prints medians and ranges; the ratio child/parent is what a 5% comparison across processes is
up against.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from spotlight.recipe import load_recipe  # noqa: E402


def sample_times(n: int) -> list[float]:
    from spotlight.policy.sampler import sample
    from spotlight.work import policy_model as build_policy_model

    recipe = load_recipe("tiny")
    model = build_policy_model(recipe)
    s, seeds, prompt = recipe.sampler, list(range(16)), "two red circles"
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with torch.no_grad():
            sample(
                model,
                [prompt] * 16,
                seeds,
                (3, 32, 32),
                s.steps,
                s.shift,
                noise_level=s.noise_level,
                sde_steps=s.sde_steps,
                noise_patch=s.noise_patch,
            )
        out.append(time.perf_counter() - t0)
    return out


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_runtime_cpu(seconds: float) -> float:
    import tempfile

    from spotlight.actors.runtime import LocalRuntime

    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe("tiny", [f'run.out_dir="{out}"', "runtime.spot_workers=0"])
        with LocalRuntime(recipe) as rt:
            pids = [*rt.pids(), os.getpid()]
            before = {p: cpu_s(p) for p in pids}
            time.sleep(seconds)  # measuring idleness: nothing to await
            return sum(cpu_s(p) - before[p] for p in pids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: print times
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(" ".join(f"{t:.6f}" for t in sample_times(args.per_round)))
        return
    parent, child = [], []
    for _ in range(args.rounds):
        parent += sample_times(args.per_round)
        done = subprocess.run(
            [sys.executable, __file__, "--child", "--per-round", str(args.per_round)],
            capture_output=True,
            text=True,
            check=True,
        )
        child += [float(x) for x in done.stdout.split()]
    idle = idle_runtime_cpu(5.0)

    def ms(xs):
        lo, mid, hi = 1e3 * min(xs), 1e3 * statistics.median(xs), 1e3 * max(xs)
        return f"median {mid:6.0f} ms  range {lo:4.0f}-{hi:4.0f} ms"

    print(
        f"best-of-16 exploration sample, tiny model, 1 torch thread, cores {os.cpu_count()}; "
        f"{args.rounds} rounds x {args.per_round}"
    )
    print(f"parent process   {ms(parent)}")
    print(
        f"child process    {ms(child)}   "
        f"child/parent {statistics.median(child) / statistics.median(parent):.3f}x"
    )
    print(f"idle one-worker runtime: {idle:.2f} s CPU in 5 s over all its processes")


if __name__ == "__main__":
    main()
