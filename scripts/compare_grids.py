# python scripts/compare_grids.py runs/tiny --out docs/ode_heldout_base_vs_trained.png [--suffix ""]
"""Base vs trained evaluation grids of one run, side by side, one row per prompt (labelled).

Takes the run's first and last evaluation grids (samples/eval_0000{suffix}.png and the newest
samples/eval_NNNN{suffix}.png: the same prompts and seeds, before and after RL) and writes one PNG
for the README. suffix "" = ODE on held-out prompts (the headline), "_train" = ODE on training
prompts, "_sde" = the rollout policy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight.data.prompts import eval_train_prompts, heldout_prompts  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="run folder (runs/<name>)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--suffix", default="", help="'' (ODE held-out), '_train' (ODE train), '_sde'")
    ap.add_argument("--recipe", default="tiny", help="recipe of the run (for the prompt labels)")
    ap.add_argument("--scale", type=float, default=0.5, help="resize factor of the grids")
    args = ap.parse_args()
    grids = sorted(p for p in (args.run / "samples").glob(f"eval_[0-9][0-9][0-9][0-9]{args.suffix}.png"))
    first, last = grids[0], grids[-1]
    name = load_recipe(args.recipe).run.prompts
    prompts = heldout_prompts(name) if args.suffix == "" else eval_train_prompts(name)
    imgs = [Image.open(p).convert("RGB") for p in (first, last)]
    imgs = [
        im.resize((round(im.width * args.scale), round(im.height * args.scale)), Image.NEAREST) for im in imgs
    ]
    label_w, head, gap = 260, 18, 12
    w = label_w + imgs[0].width + gap + imgs[1].width
    h = head + imgs[0].height
    out = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(out)
    x1 = label_w + imgs[0].width + gap
    out.paste(imgs[0], (label_w, head))
    out.paste(imgs[1], (x1, head))
    d.text((label_w, 2), f"base ({first.stem})", fill=(0, 0, 0))
    d.text((x1, 2), f"after RL ({last.stem})", fill=(0, 0, 0))
    row = imgs[0].height / len(prompts)
    for i, p in enumerate(prompts):
        d.text((4, head + row * i + row / 2 - 5), p, fill=(0, 0, 0))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out.save(args.out, optimize=True)
    print(f"wrote {args.out} ({first.name} vs {last.name})")


if __name__ == "__main__":
    main()
