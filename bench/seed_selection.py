# python bench/seed_selection.py --iterations 40 --target 0.10 [--recipe tiny] [overrides ...]
"""Does best-of-N seed selection learn faster than random seeds?

Random seeds (Flow-GRPO) vs best-of-N seed selection (DanceGRPO) from the same base and seeds.

Runs the same recipe twice in one invocation, with `explore.schedule` off and critical, and prints
iterations to the target (held-out reward >= base + target), the final held-out reward, the reward
spread of the rollout groups, and wall time per iteration, with ratios against the random-seed
baseline. Both runs start from the same base weights, use the same training seeds for the random
arm as the candidates' first G of the selection arm, and the same evaluation seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight.loop import Loop  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402


def run_arm(recipe_name: str, overrides: list[str], explore: bool, iterations: int) -> list[dict]:
    name = "bench_selection_" + ("best_of_n" if explore else "random")
    recipe = load_recipe(
        recipe_name,
        [
            *overrides,
            f"explore.schedule={'critical' if explore else 'off'}",
            f"run.iterations={iterations}",
            f'run.name="{name}"',
        ],
    )
    loop = Loop(recipe, progress=False)
    loop.run()
    return loop.metrics.read()


def summarise(records: list[dict], target: float) -> dict:
    evals = [r for r in records if r["event"] == "eval"]
    iters = [r for r in records if r["event"] == "iteration"]
    base = evals[0]["eval_reward"]
    hit = next((e["iteration"] for e in evals[1:] if e["eval_reward"] >= base + target), None)
    return {
        "base": base,
        "final": evals[-1]["eval_reward"],
        "final_std": evals[-1]["eval_reward_std"],
        "iters_to_target": hit,
        "spread": sum(r["group_spread"] for r in iters) / len(iters),
        "zero_var_groups": sum(r["groups_zero_var"] for r in iters) / len(iters),
        "s_per_iter": (iters[-1]["wall_s"] - evals[0]["wall_s"]) / len(iters),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument(
        "--target", type=float, default=0.10, help="absolute rise of held-out reward over the base"
    )
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    arms = {"random seeds (Flow-GRPO)": False, "best-of-N selection (DanceGRPO)": True}
    results = {
        label: summarise(run_arm(a.recipe, a.overrides, on, a.iterations), a.target)
        for label, on in arms.items()
    }
    base = results["random seeds (Flow-GRPO)"]
    print(
        f"\nseed selection bench: recipe={a.recipe} iterations={a.iterations} target=base+{a.target:.2f}"
        f" overrides={' '.join(a.overrides) or '-'}"
    )
    head = (f"{'arm':34} {'base':>6} {'final':>13} {'iters→target':>13} {'group spread':>13} "
            f"{'zero-var grp':>12} {'s/iter':>7}")
    print(head)
    print("-" * len(head))
    for label, r in results.items():
        hit = "never" if r["iters_to_target"] is None else str(r["iters_to_target"])
        print(
            f"{label:34} {r['base']:6.3f} {r['final']:6.3f} ± {r['final_std']:.3f} {hit:>13} "
            f"{r['spread']:13.3f} {r['zero_var_groups']:12.2f} {r['s_per_iter']:7.2f}"
        )
    sel = results["best-of-N selection (DanceGRPO)"]
    ratio = lambda x, y: f"{x / y:.2f}x" if y else "n/a"  # noqa: E731
    print(
        f"ratios vs random seeds: group spread {ratio(sel['spread'], base['spread'])}, "
        f"seconds/iteration {ratio(sel['s_per_iter'], base['s_per_iter'])}, iterations to target "
        f"{ratio(sel['iters_to_target'] or 0, base['iters_to_target'] or 0)}"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
