# python bench/exploration.py learning --iterations 60 [overrides ...]
# python bench/exploration.py time --iterations 8 --repeats 3 [overrides ...]
"""Does seed exploration pay for itself, and does overlapping it with training hide its cost?

Seed exploration schedules side by side: random seeds (off), best-of-N on the critical path
(critical) and stale-weight exploration during training (overlap), from the same base and seeds.

``learning`` (hardware independent: real GRPO on the demo model, in-process; the in-process overlap
schedule is bit-identical to the runtime's when every exploration result arrives by its deadline,
tests/integration/test_runtime_equivalence.py): iterations to base + each target on the run's
headline evaluation (the ODE sampler on held-out prompts), final reward, group spread, the spread of
the selected seeds, rank consistency of stale/cached vs fresh/full scores, seconds per iteration;
ratios against random seeds.

``time`` (the actor runtime on this machine): the trainer, the queue, the store and the reserved
worker pinned to CPU 0, the spot node's worker to CPU 1 (CPU affinity), so "spot idles while the
trainer updates" is real here. Arms interleaved ``--repeats`` times (this machine's speed swings
minute to minute). Per arm: seconds per iteration (median over iterations after the first) and the
share of iteration time the trainer waited on exploration (selection + settling at the deadline);
ratios against the same round's random seeds (paired; the arm order reverses every other round),
median over rounds. critical explores on every worker (``runtime.explore_on=any``),
overlap on spot workers only (``spot``), with the UCB planner choosing what fits the window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight import Experiment  # noqa: E402
from spotlight.actors import procs  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402

ARMS = {
    "off": "random seeds (Flow-GRPO)",
    "critical": "best-of-N, critical path (DanceGRPO)",
    "overlap": "stale-weight overlap (Spotlight)",
}
NAN = float("nan")


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else NAN


# --- learning ------------------------------------------------------------------------------------
def learning_arm(schedule: str, overrides: list[str], iterations: int, out: str) -> list[dict]:
    recipe = load_recipe("tiny", [
        *overrides,
        f"explore.schedule={schedule}",
        f"run.iterations={iterations}",
        "run.minutes=none",  # iteration-based: the same work whatever the machine's load
        f'run.out_dir="{out}"',
        f'run.name="{schedule}"',
        "run.checkpoint_every=100000",
    ])
    exp = Experiment(recipe)
    exp.run(progress=False)
    return exp.records


def learning_summary(records: list[dict], targets: list[float]) -> dict:
    evals = [r for r in records if r["event"] == "eval"]
    its = [r for r in records if r["event"] == "iteration"]
    base = evals[0]["eval_reward"]
    return {
        "base": base,
        "final": evals[-1]["eval_reward"],
        "final_std": evals[-1]["eval_reward_std"],
        "best": max(e["eval_reward"] for e in evals),
        "curve": [(e["iteration"], round(e["eval_reward"], 4)) for e in evals],
        "to_target": {
            f"{t:+.2f}": next((e["iteration"] for e in evals[1:] if e["eval_reward"] >= base + t), None)
            for t in targets
        },
        "group_spread": _mean([r["group_spread"] for r in its]),
        "selected_spread": _mean([r.get("explore_spread", NAN) for r in its]),
        "rank_consistency": _mean([r.get("rank_consistency", NAN) for r in its]),
        "fallbacks": sum(r.get("explore_fallback_prompts", 0) for r in its),
        "s_per_iter": _mean([r["iteration_s"] for r in its]),
        "drift": max(abs(e.get("fm_drift", 0.0)) for e in evals),
    }


def learning(a: argparse.Namespace) -> None:
    targets = [float(t) for t in a.targets.split(",")]
    arms = a.arms.split(",")
    if a.jobs > 1 and len(arms) > 1:  # each arm in its own process (single-threaded, seeded: the
        # same numbers as one after the other), read back from its metrics.jsonl
        cmd = [sys.executable, __file__, "learning", "--iterations", str(a.iterations), "--out", a.out,
               "--jobs", "1", "--no-table", *a.overrides]
        t0 = time.monotonic()
        procs_ = [subprocess.Popen([*cmd, "--arms", s]) for s in arms]
        if any(p.wait() for p in procs_):
            raise SystemExit("an arm failed")
        print(f"arms done in {time.monotonic() - t0:.0f} s", flush=True)
        records = {s: [json.loads(x) for x in open(Path(a.out) / s / "metrics.jsonl")] for s in arms}
    else:
        records = {}
        for schedule in arms:
            t0 = time.monotonic()
            records[schedule] = learning_arm(schedule, a.overrides, a.iterations, a.out)
            print(f"{schedule}: done in {time.monotonic() - t0:.0f} s", flush=True)
    if a.no_table:
        return
    results = {s: learning_summary(r, targets) for s, r in records.items()}
    base = results.get("off")
    print(f"\nexploration bench (learning): iterations={a.iterations} targets={targets} "
          f"overrides={' '.join(a.overrides) or '-'}")
    cols = " | ".join(f"iters to {k}" for k in next(iter(results.values()))["to_target"])
    print(f"| arm | base | final | best | {cols} | group spread | selected spread | rank consistency "
          f"| s/iter | max FM drift |")
    print("|" + " --- |" * (9 + len(targets)))
    for schedule, r in results.items():
        hits = " | ".join("never" if v is None else str(v) for v in r["to_target"].values())
        print(f"| {ARMS[schedule]} | {r['base']:.3f} | {r['final']:.3f} ± {r['final_std']:.3f} "
              f"| {r['best']:.3f} | {hits} | {r['group_spread']:.3f} | {r['selected_spread']:.3f} "
              f"| {r['rank_consistency']:.3f} | {r['s_per_iter']:.2f} | {100 * r['drift']:.1f}% |")
    if base:
        print("ratios against random seeds:")
        for schedule, r in results.items():
            ratios = []
            for k, v in r["to_target"].items():
                b = base["to_target"][k]
                ratios.append(f"iters to {k} {v / b:.2f}x" if v and b else f"iters to {k} n/a")
            print(f"  {schedule}: group spread {r['group_spread'] / base['group_spread']:.2f}x, "
                  f"s/iter {r['s_per_iter'] / base['s_per_iter']:.2f}x, " + ", ".join(ratios))
    for schedule, r in results.items():
        print(f"{schedule} curve: {r['curve']}")
    print(json.dumps(results))


# --- time --------------------------------------------------------------------------------------
def pin(exp: Experiment) -> None:
    """The spot node's agent and workers onto CPU 1 (everything else stays on CPU 0)."""
    spot = exp.runtime.agents.get("spot")
    if spot is not None:
        for pid in [spot.pid, *procs.descendants(spot.pid)]:
            os.sched_setaffinity(pid, {1})


def time_arm(schedule: str, overrides: list[str], iterations: int, out: str) -> dict:
    recipe = load_recipe("tiny", [
        *overrides,
        'run.mode="runtime"',
        f"explore.schedule={schedule}",
        f'runtime.explore_on="{"spot" if schedule == "overlap" else "any"}"',
        f"run.iterations={iterations}",
        "run.minutes=none",
        f'run.out_dir="{out}"',
        f'run.name="time-{schedule}"',
        "run.checkpoint_every=100000",
        "run.eval_every=100000",
        "run.eval_seeds=1",
        "run.eval_samples=1",
    ])
    exp = Experiment(recipe)
    pinned = []
    exp.on_metrics(lambda rec: pinned or (pin(exp), pinned.append(True)))
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"][1:]  # the first: warm-up
    return {
        "s_per_iter": statistics.median(r["iteration_s"] for r in its),
        "wait_share": sum(r["explore_s"] for r in its) / sum(r["iteration_s"] for r in its),
        "train_s": statistics.median(r["train_s"] for r in its),
        "returned": sum(r.get("explore_returned", 0) for r in its),
        "requests": sum(r.get("explore_requests", 0) for r in its),
        "fallbacks": sum(r.get("explore_fallback_prompts", 0) for r in its),
        "arms": sorted({r["explore_arm"] for r in its if "explore_arm" in r}),
        "rank_consistency": _mean([r.get("rank_consistency", NAN) for r in its]),
    }


def timing(a: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {0})  # the trainer (and the children it starts) on CPU 0
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    arms = a.arms.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in arms}
    for rep in range(a.repeats):  # interleaved: every arm once per round, the order reversed
        for schedule in arms if rep % 2 == 0 else arms[::-1]:  # every other round (drift cancels)
            runs[schedule].append(time_arm(schedule, a.overrides, a.iterations, a.out))
            print(f"round {rep}: {schedule} {runs[schedule][-1]}", flush=True)
    summary = {
        s: {
            "s_per_iter": statistics.median(r["s_per_iter"] for r in rs),
            "wait_share": statistics.median(r["wait_share"] for r in rs),
            "train_s": statistics.median(r["train_s"] for r in rs),
            "returned": sum(r["returned"] for r in rs),
            "requests": sum(r["requests"] for r in rs),
            "fallbacks": sum(r["fallbacks"] for r in rs),
            "arms": sorted({x for r in rs for x in r["arms"]}),
        }
        for s, rs in runs.items()
    }
    base = summary.get("off")
    # Paired: each round's arm against the same round's random seeds (minutes apart at most), so
    # the machine's drift between rounds divides out; the headline is the median paired ratio.
    paired = {
        s: [r["s_per_iter"] / b["s_per_iter"] for r, b in zip(rs, runs["off"], strict=True)]
        for s, rs in runs.items()
    } if base else {}
    print(f"\nexploration bench (time): runtime, trainer + reserved worker on CPU 0, spot worker on "
          f"CPU 1; {a.repeats} interleaved rounds x {a.iterations} iterations; "
          f"overrides={' '.join(a.overrides) or '-'}")
    print("| arm | s/iter (median) | vs random seeds (median of paired rounds) | paired ratio per round "
          "| trainer waiting on exploration | train window (s) | exploration requests returned by the "
          "deadline | prompts on random fallback | arms chosen |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s, r in summary.items():
        vs = f"{statistics.median(paired[s]):.2f}x" if base else "n/a"
        per = " ".join(f"{x:.2f}" for x in paired.get(s, [])) or "-"
        got = f"{r['returned']}/{r['requests']}" if r["requests"] else "-"
        print(f"| {ARMS[s]} | {r['s_per_iter']:.2f} | {vs} | {per} | {100 * r['wait_share']:.1f}% "
              f"| {r['train_s']:.2f} | {got} | {r['fallbacks']} | {' '.join(r['arms']) or '-'} |")
    print(json.dumps({"summary": summary, "paired": paired}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["learning", "time"])
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3, help="time: interleaved rounds")
    p.add_argument("--arms", default="off,critical,overlap")
    p.add_argument("--targets", default="0.02,0.05,0.10,0.15", help="learning: rises over the base")
    p.add_argument("--out", default="/tmp/bench_exploration")
    p.add_argument("--jobs", type=int, default=1, help="learning: arms run as this many processes at once")
    p.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    a = p.parse_intermixed_args()
    learning(a) if a.part == "learning" else timing(a)


if __name__ == "__main__":
    main()
