# python bench/redraw.py --checkpoint builtin:base --checkpoint runs/tiny/checkpoints/iter_0200.safetensors
"""Where along the sampling trajectory does a model lose the reward? (docs/LEARNING.md, session 10)

Rendered scenes of a prompt split (true layouts, every constraint met) are noised to a start time
t0 and redrawn by the model's deterministic sampler (the same 20-step Euler grid as evaluation,
from step round((1 − t0)·20) on). t0 = 1 is plain sampling from noise; t0 = 0.5 keeps where the
objects are and asks the model to draw them. A model that keeps ~1.0 from t0 ≤ 0.5 and falls only
above it draws shapes cleanly and loses its reward laying scenes out (how many objects, where,
their boxes) — what RL then has to move is the velocity at high noise.

Prints, per checkpoint and t0, the reward of the redrawn scenes and the four largest causes of the
reward not earned; with --grid, a sheet per checkpoint to look at (top row: the renders; then one
row per t0: what the model redrew from them). Seeded: the same renders and noise for every checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward_validation import prompt_names  # noqa: E402  (bench/reward_validation.py)

STEPS = 20


def redraw(model, x0, eps, captions: list[str], t0: float):
    """x0 noised to t0 (snapped to the 20-step grid) and integrated to t = 0 with the evaluation's ODE."""
    import torch

    from spotlight.policy.sampler import sample, timesteps

    k0 = round((1 - t0) * STEPS)
    t = float(timesteps(STEPS)[k0])
    with torch.no_grad():
        return sample(model, captions, list(range(len(captions))), tuple(x0.shape[1:]), STEPS,
                      start=(k0, (1 - t) * x0 + t * eps))


def save_grid(rows: list[np.ndarray], labels: list[str], path: Path, columns: int) -> None:
    """rows of uint8 images [N, 32, 32, 3]: the first `columns` of each, 3x, one labelled row each."""
    from PIL import Image, ImageDraw

    sheet = Image.new("RGB", (60 + columns * 100, len(rows) * 100), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for r, (imgs, label) in enumerate(zip(rows, labels, strict=True)):
        draw.text((4, r * 100 + 44), label, fill=(0, 0, 0))
        for c, img in enumerate(imgs[:columns]):
            sheet.paste(Image.fromarray(img).resize((96, 96), Image.NEAREST), (60 + c * 100, r * 100 + 2))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", action="append", required=True, help="a model to redraw with, repeatable")
    ap.add_argument("--prompts", default="heldout", help="prompt split (as bench/reward_validation.py)")
    ap.add_argument("--renders", type=int, default=16, help="rendered scenes per prompt")
    ap.add_argument("--t0", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85, 1.0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--grid", type=Path, help="also write each checkpoint's redraws to PATH_<k>.png")
    args = ap.parse_args()
    if not all(0.0 < t <= 1.0 for t in args.t0):
        ap.error("--t0 values must be in (0, 1]")

    import torch

    from spotlight.data.scenes import VOCABULARY, parse_caption
    from spotlight.evaluation import fm_probe
    from spotlight.models.dit import ModelConfig, build_model
    from spotlight.rewards.base import to_uint8_images
    from spotlight.rewards.compositional import analyse, score_scene, shortfall

    x0, eps, _, captions = fm_probe(prompt_names(args.prompts), 32, args.renders, args.seed)
    scenes = [parse_caption(c) for c in captions]
    print(f"redrawn from t0, prompts={args.prompts}, {args.renders} renders each ({len(captions)} scenes)")
    print(f"{'checkpoint':<28}{'t0':>6}{'reward':>9}   largest causes of the reward not earned")
    shown = list(range(0, len(captions), args.renders))  # one scene of each prompt
    for k, ck in enumerate(args.checkpoint):
        torch.manual_seed(0)
        model = build_model(ModelConfig(checkpoint=ck), VOCABULARY).eval()
        rows, labels = [to_uint8_images(x0)[shown]], ["render"]
        for t0 in args.t0:
            imgs = to_uint8_images(redraw(model, x0, eps, captions, t0))
            rows.append(imgs[shown])
            labels.append(f"t0={t0:.2f}")
            scores, lost = [], Counter()
            for scene, img in zip(scenes, imgs, strict=True):
                a = analyse(img)
                scores.append(score_scene(scene, a)[0])
                lost.update(shortfall(scene, a))
            top = ", ".join(f"{why} {v / len(scenes):.3f}" for why, v in lost.most_common(4) if v > 0)
            print(f"{Path(ck).name[-28:]:<28}{t0:>6.2f}{np.mean(scores):>9.3f}   {top}")
        if args.grid:
            out = args.grid.with_name(f"{args.grid.stem}_{k}.png")
            save_grid(rows, labels, out, len(shown))
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
