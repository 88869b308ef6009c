# python bench/shape_leniency.py --trained runs/tiny/checkpoints/iter_0200.safetensors [--base B] [--seeds 32]
"""Does the shape check's strictness hide a rise? Base and trained model scored on the same ODE
samples under the shipped thresholds and under looser ones (docs/REWARD.md, "Where the trained
model's reward goes").

The shipped thresholds (overlap 0.78 for a shape, 0.88 for full credit, bounding-box aspect up to
1.25) dock triangles and circles a person calls the named shape; the loose ones (0.72, 0.80, 1.35)
pass most of those. Prints, per prompt split, base and trained reward under each, the rise, and the
fraction of the base's distance to 1.0 the rise closes. Seeded: the same samples for both readings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward_validation import ode_samples, prompt_names  # noqa: E402  (bench/reward_validation.py)

from spotlight.rewards.compositional import FULL_IOU, MAX_ASPECT, MIN_IOU, CompositionalReward  # noqa: E402

READINGS = {"shipped": (MIN_IOU, FULL_IOU, MAX_ASPECT), "loose": (0.72, 0.80, 1.35)}


def reward(rule: tuple[float, float, float], prompts: list[str], imgs: list[np.ndarray]) -> float:
    """Mean compositional reward of the samples (`imgs[i]`: prompt i's) read with `rule`
    (min_iou, full_iou, max_aspect), the reward's own arguments."""
    rw = CompositionalReward(**dict(zip(("min_iou", "full_iou", "max_aspect"), rule, strict=True)))
    return float(np.mean([rw(batch, [p] * len(batch)) for p, batch in zip(prompts, imgs, strict=True)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="builtin:base")
    ap.add_argument("--trained", required=True, help="a trained checkpoint (.safetensors)")
    ap.add_argument("--seeds", type=int, default=32, help="ODE samples per prompt")
    args = ap.parse_args()
    print("| prompts | thresholds (shape, full credit, aspect) | base | trained | rise | of the way to 1.0 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for split, prompts in (("held-out", prompt_names("heldout")), ("training (demo)", prompt_names("demo"))):
        base = ode_samples(args.base, prompts, args.seeds)
        trained = ode_samples(args.trained, prompts, args.seeds)
        for name, t in READINGS.items():
            b, r = reward(t, prompts, base), reward(t, prompts, trained)
            print(f"| {split} | {name} {t} | {b:.3f} | {r:.3f} | {r - b:+.3f} | {(r - b) / (1 - b):.0%} |")


if __name__ == "__main__":
    main()
