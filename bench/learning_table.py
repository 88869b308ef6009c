# python bench/learning_table.py runs/tiny      (after `spotlight run tiny`)
"""How far did a run learn, evaluation by evaluation?

The learning table of a run, from its metrics.jsonl: every evaluation's ODE reward on held-out
prompts (the headline, mean ± spread over the evaluation seed sets) and its rise over the base, ODE
on training prompts, the SDE policy, the held-out shape credit (for a reward that reports one) and
the flow-matching drift; then the
issue-11 goals checked against it, and where the held-out reward not earned goes, by cause, at the
base and at the last evaluation (runs from session 9 on log it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in records if r["event"] == "eval"]
    iters = [r for r in records if r["event"] == "iteration"]
    base = evals[0]
    print(f"run {run}: {len(iters)} iterations, {records[-1]['wall_s']:.0f} s; "
          f"{sum(r['eval_s'] for r in evals):.0f} s of it in {len(evals)} evaluations")
    shape = "shape" in base.get("eval_ode_heldout_parts", {})  # the compositional reward's credit
    print(
        "| iteration | wall (s) | ODE held-out (headline) | rise | ODE train | rise | SDE policy "
        + ("| held-out shape " if shape else "") + "| FM drift |"
    )
    print("| --- " * (9 if shape else 8) + "|")
    for r in evals:
        rise = r["eval_ode_heldout"] - base["eval_ode_heldout"]
        rise_t = r["eval_ode_train"] - base["eval_ode_train"]
        print(
            f"| {r['iteration']} | {r['wall_s']:.0f} "
            f"| {r['eval_ode_heldout']:.3f} ± {r['eval_ode_heldout_std']:.3f} "
            f"| {rise:+.3f} | {r['eval_ode_train']:.3f} ± {r['eval_ode_train_std']:.3f} | {rise_t:+.3f} "
            f"| {r['eval_sde_train']:.3f} ± {r['eval_sde_train_std']:.3f} "
            + (f"| {r.get('eval_ode_heldout_parts', {}).get('shape', float('nan')):.3f} " if shape else "")
            + f"| {100 * r.get('fm_drift', 0):+.1f}% |"
        )
    last = evals[-1]
    rise = last["eval_ode_heldout"] - base["eval_ode_heldout"]
    spread = max(base["eval_ode_heldout_std"], last["eval_ode_heldout_std"])
    worst = min(evals[1:], key=lambda r: r["eval_ode_heldout"], default=base)
    print(
        f"\nheld-out ODE rise {rise:+.3f} (goal >= +0.10, larger than the spread {spread:.3f}): "
        f"{'met' if rise >= 0.10 and rise > spread else 'missed'}"
    )
    print(
        f"training-prompt ODE rise {last['eval_ode_train'] - base['eval_ode_train']:+.3f} "
        f"(goal: at least the held-out rise)"
    )
    dip = worst["eval_ode_heldout"] - base["eval_ode_heldout"]
    print(
        f"lowest held-out ODE after the base: {worst['eval_ode_heldout']:.3f} "
        f"at iteration {worst['iteration']} ({dip:+.3f}; "
        f"goal: never below the base by more than its spread {base['eval_ode_heldout_std']:.3f}): "
        f"{'met' if dip >= -base['eval_ode_heldout_std'] else 'missed'}"
    )
    drift = max(r.get("fm_drift", 0.0) for r in evals)
    print(
        f"largest flow-matching drift {100 * drift:+.1f}% (goal < 10%): {'met' if drift < 0.10 else 'missed'}"
    )
    if "eval_ode_heldout_shortfall" in last and "eval_ode_heldout_shortfall" in base:
        before, after = base["eval_ode_heldout_shortfall"], last["eval_ode_heldout_shortfall"]
        print(f"\nheld-out reward not earned, by cause (per sample), iteration 0 -> {last['iteration']}:")
        for why in sorted(before, key=lambda k: -before[k]):
            if before[why] or after.get(why):
                print(f"  {why:<26}{before[why]:.4f} -> {after.get(why, 0.0):.4f}")


if __name__ == "__main__":
    main()
