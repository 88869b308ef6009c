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
import contextlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward_validation import ode_samples, prompt_names  # noqa: E402  (bench/reward_validation.py)

import spotlight.rewards.compositional as compositional  # noqa: E402

READINGS = {"shipped": (0.78, 0.88, 1.25), "loose": (0.72, 0.80, 1.35)}


@contextlib.contextmanager
def thresholds(min_iou: float, full_iou: float, max_aspect: float):
    """The shape check's module-level thresholds, set for the block and restored after it."""
    saved = compositional.MIN_IOU, compositional.FULL_IOU, compositional.MAX_ASPECT
    compositional.MIN_IOU, compositional.FULL_IOU, compositional.MAX_ASPECT = min_iou, full_iou, max_aspect
    try:
        yield
    finally:
        compositional.MIN_IOU, compositional.FULL_IOU, compositional.MAX_ASPECT = saved


def reward(prompts: list[str], imgs: list[np.ndarray]) -> float:
    from spotlight.data.scenes import parse_caption

    return float(
        np.mean(
            [
                compositional.score_scene(parse_caption(p), compositional.analyse(im))[0]
                for p, batch in zip(prompts, imgs, strict=True)
                for im in batch
            ]
        )
    )


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
            with thresholds(*t):
                b, r = reward(prompts, base), reward(prompts, trained)
            print(f"| {split} | {name} {t} | {b:.3f} | {r:.3f} | {r - b:+.3f} | {(r - b) / (1 - b):.0%} |")


if __name__ == "__main__":
    main()
