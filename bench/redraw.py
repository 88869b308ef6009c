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
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward_validation import prompt_names  # noqa: E402  (bench/reward_validation.py)

STEPS = 20


def renders(captions: list[str], seed: int):
    """Each caption's scene rendered once, [N, 3, 32, 32] in [-1, 1], and a noise of that shape."""
    import torch

    from spotlight.data.scenes import parse_caption, render

    rng = random.Random(seed)
    imgs = np.stack([render(parse_caption(c), 32, rng) for c in captions])
    x0 = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    return x0, eps


def redraw(model, x0, eps, captions: list[str], t0: float):
    """x0 noised to t0 (snapped to the 20-step grid) and integrated to t = 0 with the ODE."""
    import torch

    from spotlight.policy.sampler import timesteps

    ts = timesteps(STEPS)
    k0 = round((1 - t0) * STEPS)
    t_start = float(ts[k0])
    x = (1 - t_start) * x0 + t_start * eps
    with torch.no_grad():
        text = model.encode(captions)
        for k in range(k0, STEPS):
            t = torch.full((x.shape[0],), float(ts[k]))
            x = x + model.velocity(x, t, text) * float(ts[k + 1] - ts[k])
    return x.clamp(-1, 1)


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
    from spotlight.models.dit import ModelConfig, build_model
    from spotlight.rewards.base import to_uint8_images
    from spotlight.rewards.compositional import analyse, score_scene, shortfall

    captions = [p for p in prompt_names(args.prompts) for _ in range(args.renders)]
    scenes = [parse_caption(c) for c in captions]
    x0, eps = renders(captions, args.seed)
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
