# python bench/reward_validation.py [--n 400] [--checkpoint builtin:base ...]
# python bench/reward_validation.py --reward ocr [--n 200]
"""Do the compositional and the OCR rewards agree with ground truth the project can make?

Validation of the compositional reward (issue 11), and of the OCR reward (issue 27, `--reward ocr`:
the table of `ocr_cases`).

Prints three tables (results in docs/REWARD.md):
1. the shape classifier's confusion matrix: objects of rendered scenes (true shape known) and
   adversarial objects (bars, rounded bars, long ellipses, two merged circles, unions of 8x8
   blocks, ragged blobs) against what the classifier calls them;
2. the reward of rendered scenes under their true caption and under perturbed captions (wrong
   count, colour, shape, relation): mean score and how often the broken constraint lost its credit;
3. with --checkpoint: each model's ODE samples (eval prompts, fixed seeds) — the reward's parts,
   where the reward it does not earn goes (count, relation, and shape split by cause: a partial
   overlap with the named outline, an elongated box, another shape, a low overlap, a missing
   object), and what the classifier calls each object against the shape the prompt names; with
   --gallery, the docked objects' samples labelled with their cause, to look at.
Seeded: a re-run prints the same numbers.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight.data.scenes import PALETTE, SHAPES, ObjectGroup, Scene, random_scene, render  # noqa: E402
from spotlight.rewards.compositional import analyse, score_scene, shape_cause, shortfall  # noqa: E402

COLUMNS = ("circle", "square", "triangle", "none")
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def adversarial(kind: str, rng: random.Random) -> np.ndarray:
    img = Image.new("RGB", (32, 32))
    d = ImageDraw.Draw(img)
    color = PALETTE[rng.choice(list(PALETTE))]
    if kind in ("bar", "rounded bar", "long ellipse"):
        short = rng.randint(4, 9)
        long_ = min(30, round(short * rng.uniform(1.5, 3.5)))
        x, y = rng.randint(0, 31 - short), rng.randint(0, 31 - long_)
        box = (
            (x, y, x + short - 1, y + long_ - 1)
            if rng.random() < 0.5
            else (y, x, y + long_ - 1, x + short - 1)
        )
        {"bar": d.rectangle, "rounded bar": d.rounded_rectangle, "long ellipse": d.ellipse}[kind](
            box, fill=color
        )
    elif kind == "merged circles":
        r = rng.randint(4, 7)
        x, y = rng.randint(0, 31 - 4 * r), rng.randint(0, 31 - 2 * r)
        d.ellipse((x, y, x + 2 * r, y + 2 * r), fill=color)
        d.ellipse((x + 2 * r - 1, y, x + 4 * r - 1, y + 2 * r), fill=color)
    elif kind == "8x8 blocks":
        cells = rng.sample([(a, b) for a in range(3) for b in range(3)], rng.randint(2, 5))
        for a, b in cells:
            d.rectangle((4 + 8 * b, 4 + 8 * a, 11 + 8 * b, 11 + 8 * a), fill=color)
    else:  # ragged blob: a random walk of 3x3 stamps
        y, x = rng.randint(10, 21), rng.randint(10, 21)
        for _ in range(rng.randint(12, 30)):
            d.rectangle((x - 1, y - 1, x + 1, y + 1), fill=color)
            y, x = min(28, max(3, y + rng.randint(-2, 2))), min(28, max(3, x + rng.randint(-2, 2)))
    return np.asarray(img)


def confusion(n: int) -> dict[str, Counter]:
    rng = random.Random(0)
    rows: dict[str, Counter] = {s: Counter() for s in SHAPES}
    for _ in range(n):
        scene = random_scene(rng)
        a = analyse(render(scene, 32, rng))
        for g in scene.groups:
            for b in a.of(g.color):
                rows[g.shape][b.shape] += 1
    for kind in ("bar", "rounded bar", "long ellipse", "merged circles", "8x8 blocks", "ragged blob"):
        rows[kind] = Counter(b.shape for _ in range(n // 4) for b in analyse(adversarial(kind, rng)).blobs)
    return rows


def perturbations(n: int) -> dict[str, tuple[float, float]]:
    rng = random.Random(1)
    scores: dict[str, list[float]] = {
        k: [] for k in ("true caption", "wrong count", "wrong colour", "wrong shape", "wrong relation")
    }
    lost: dict[str, list[bool]] = {k: [] for k in scores}
    for _ in range(n):
        scene = random_scene(rng)
        img = render(scene, 32, rng)
        a = analyse(img)
        g = scene.groups[0]
        s, _ = score_scene(scene, a)
        scores["true caption"].append(s)
        lost["true caption"].append(s < 0.9)
        other_c = rng.choice([c for c in PALETTE if c not in {x.color for x in scene.groups}])
        other_s = rng.choice([x for x in SHAPES if x != g.shape])
        cases = [
            (
                "wrong colour",
                Scene((ObjectGroup(other_c, g.shape, g.count), *scene.groups[1:]), scene.relation),
                f"{other_c}:present",
            ),
            (
                "wrong shape",
                Scene((ObjectGroup(g.color, other_s, g.count), *scene.groups[1:]), scene.relation),
                f"{g.color}:shape",
            ),
        ]
        if scene.relation is None:
            wrong = rng.choice([k for k in (1, 2, 3) if k != g.count])
            cases.append(("wrong count", Scene((ObjectGroup(g.color, g.shape, wrong),)), f"{g.color}:count"))
        else:
            cases.append(("wrong relation", Scene(scene.groups, OPPOSITE[scene.relation]), "relation"))
        for kind, wrong_scene, part in cases:
            s, p = score_scene(wrong_scene, a)
            scores[kind].append(s)
            lost[kind].append(p[part] < 1.0)
    return {k: (float(np.mean(v)), float(np.mean(lost[k]))) for k, v in scores.items()}


def prompt_names(prompts: str) -> list[str]:
    """A prompt set by name; 'heldout' = the demo's held-out split, 'unseen' = 64 captions the demo
    never trains on."""
    from spotlight.data.prompts import heldout_prompts, prompt_set

    if prompts == "heldout":
        return heldout_prompts("broad")
    return unseen_prompts(64) if prompts == "unseen" else prompt_set(prompts)


def ode_samples(
    checkpoint: str, prompts: list[str], seeds: int, steps: int = 20, shift: float = 1.0
) -> list[np.ndarray]:
    """`seeds` ODE samples (`steps` Euler steps, the evaluation's 20 by default) of each prompt, uint8
    [seeds, 32, 32, 3] per prompt; the seeds are fixed, so two checkpoints draw from the same noise."""
    import torch

    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model
    from spotlight.policy.sampler import sample
    from spotlight.rewards.base import to_uint8_images

    torch.manual_seed(0)
    model = build_model(ModelConfig(checkpoint=checkpoint), VOCABULARY).eval()
    with torch.no_grad():
        out = []
        for i, p in enumerate(prompts):
            fixed = list(range(10_000 + i * seeds, 10_000 + (i + 1) * seeds))
            out.append(to_uint8_images(sample(model, [p] * seeds, fixed, (3, 32, 32), steps, shift)))
        return out


def model_samples(
    checkpoint: str, prompts: str, seeds: int, docked: list | None = None, steps: int = 20, shift: float = 1.0
) -> tuple[dict[str, float], dict[str, Counter], dict[str, float]]:
    """The reward's parts, the shape confusion of the named colours' objects and the reward lost by
    cause over a model's ODE samples; `docked` collects (image, label) for every named-colour
    object that lost shape credit, for looking at (--gallery)."""
    from spotlight.data.scenes import parse_caption

    parts: dict[str, list[float]] = {}
    rows: dict[str, Counter] = {s: Counter() for s in SHAPES}
    lost: Counter = Counter()
    names = prompt_names(prompts)
    for p, imgs in zip(names, ode_samples(checkpoint, names, seeds, steps, shift), strict=True):
        scene = parse_caption(p)
        for img in imgs:
            a = analyse(img)
            total, pt = score_scene(scene, a)
            parts.setdefault("reward", []).append(total)
            for k, v in pt.items():
                parts.setdefault(k.split(":")[-1], []).append(v)
            lost.update(shortfall(scene, a))
            for g in scene.groups:
                for b in a.of(g.color):
                    rows[g.shape][b.shape] += 1
                    why, short = shape_cause(b, g.shape)
                    if docked is not None and short > 0:
                        named = b.ious[("circle", "square", "triangle").index(g.shape)]
                        label = f"{why}\n{g.shape} o={named:.2f} a={b.aspect:.2f}"
                        docked.append((img, label))
    n = len(parts["reward"])
    return {k: float(np.mean(v)) for k, v in parts.items()}, rows, {k: v / n for k, v in lost.items()}


def unseen_prompts(n: int) -> list[str]:
    """`n` captions of the grammar that the demo's training set ("broad") never contains, a fixed
    sample: a wider held-out split than the demo's eight."""
    from spotlight.data.prompts import all_captions, prompt_set

    train = set(prompt_set("broad"))
    return random.Random(0).sample([c for c in all_captions() if c not in train], n)


def save_gallery(docked: list, path: Path, columns: int = 8, limit: int = 96) -> None:
    """The first `limit` docked objects' images (4x), each labelled with its cause, the named shape,
    the object's overlap with that shape's outline (o) and its bounding box's aspect (a)."""
    docked = docked[:limit]
    rows = max(1, -(-len(docked) // columns))
    sheet = Image.new("RGB", (columns * 132, rows * 160), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for k, (img, label) in enumerate(docked):
        x, y = (k % columns) * 132, (k // columns) * 160
        sheet.paste(Image.fromarray(img).resize((128, 128), Image.NEAREST), (x, y))
        draw.multiline_text((x, y + 129), label, fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def print_confusion(rows: dict[str, Counter], title: str) -> None:
    print(f"\n{title}\n{'true / called':<16}" + "".join(f"{c:>10}" for c in COLUMNS) + f"{'objects':>10}")
    for name, row in rows.items():
        total = sum(row.values())
        cells = "".join(f"{row[c] / total:>10.3f}" if total else f"{'-':>10}" for c in COLUMNS)
        print(f"{name:<16}{cells}{total:>10}")


OCR_CASES = ("rendered", "blurred (r=0.7)", "half-drawn", "wrong word", "scrambled", "mirrored",
             "blank", "noise")


def ocr_cases(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The OCR reward's scores of `n` words of both lists (16x64, the shipped font) under each case:
    the word as rendered; blurred; only its left half drawn; another word of the same length;
    its letters scrambled (never the word itself); mirror-imaged; a blank canvas; uniform noise."""
    from PIL import ImageFilter

    from spotlight.data.text import HELDOUT_WORDS, TRAIN_WORDS, prompt_for, render_word
    from spotlight.rewards.ocr import OcrReward

    rng = random.Random(seed)
    words = [rng.choice(TRAIN_WORDS + HELDOUT_WORDS) for _ in range(n)]
    h, w = 16, 64
    imgs: dict[str, list[np.ndarray]] = {k: [] for k in OCR_CASES}
    for word in words:
        img = render_word(word, h, w)
        imgs["rendered"].append(img)
        imgs["blurred (r=0.7)"].append(np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(0.7))))
        half = img.copy()
        dark = np.flatnonzero((img < 128).any(axis=(0, 2)))
        half[:, (dark[0] + dark[-1]) // 2 + 1:] = 255
        imgs["half-drawn"].append(half)
        other = rng.choice([x for x in TRAIN_WORDS + HELDOUT_WORDS if len(x) == len(word) and x != word])
        imgs["wrong word"].append(render_word(other, h, w))
        letters = list(word)
        while "".join(letters) == word and len(set(word)) > 1:
            rng.shuffle(letters)
        imgs["scrambled"].append(render_word("".join(letters), h, w))
        imgs["mirrored"].append(np.ascontiguousarray(img[:, ::-1]))
        imgs["blank"].append(np.full_like(img, 255))
        noise = np.random.default_rng(rng.randrange(2**31))
        imgs["noise"].append(noise.integers(0, 256, img.shape, np.uint8))
    reward = OcrReward(mode="line")
    prompts = [prompt_for(x) for x in words]
    return {k: reward(np.stack(v), prompts) for k, v in imgs.items()}


def print_ocr(n: int) -> None:
    print(f"OCR reward (PP-OCRv4 recognition, 1 - normalised edit distance) of {n} words, 16x64 canvas")
    print(f"{'case':<18}{'mean':>8}{'min':>8}{'max':>8}{'= 1.0':>8}")
    for kind, s in ocr_cases(n).items():
        print(f"{kind:<18}{s.mean():>8.3f}{s.min():>8.3f}{s.max():>8.3f}{(s == 1).mean():>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--n", type=int, default=400, help="rendered scenes per table (adversarial: n/4 per kind)"
    )
    ap.add_argument("--checkpoint", action="append", default=[], help="also score this model's ODE samples")
    ap.add_argument(
        "--prompts",
        default="demo",
        help="prompt set for --checkpoint samples ('heldout': the demo's held-out split; 'unseen': 64 "
        "captions the demo never trains on)",
    )
    ap.add_argument("--seeds", type=int, default=16, help="samples per prompt for --checkpoint")
    ap.add_argument("--steps", type=int, default=20, help="ODE steps for --checkpoint (the evaluation's: 20)")
    ap.add_argument("--shift", type=float, default=1.0, help="time shift of the ODE grid (SD3's: 3)")
    ap.add_argument(
        "--gallery", type=Path, help="also write, per checkpoint, its samples' docked objects to PATH_<k>.png"
    )
    ap.add_argument("--reward", choices=("compositional", "ocr"), default="compositional",
                    help="which reward to validate (ocr: the text task's table only)")
    args = ap.parse_args()
    if args.reward == "ocr":
        print_ocr(args.n)
        return
    print_confusion(
        confusion(args.n),
        f"shape classifier, {args.n} rendered scenes + adversarial objects (fraction of objects of each row)",
    )
    print(f"\nreward of {args.n} rendered scenes under true and perturbed captions")
    print(f"{'caption':<16}{'mean reward':>12}{'broken constraint lost credit':>32}")
    for kind, (mean, lost) in perturbations(args.n).items():
        note = f"{1 - lost:.3f} (>= 0.9)" if kind == "true caption" else f"{lost:.3f}"
        print(f"{kind:<16}{mean:>12.3f}{note:>32}")
    for k, ck in enumerate(args.checkpoint):
        docked: list | None = [] if args.gallery else None
        parts, rows, lost = model_samples(ck, args.prompts, args.seeds, docked, args.steps, args.shift)
        print(
            f"\nmodel {ck}: ODE samples ({args.steps} steps, shift {args.shift}), prompts={args.prompts}, "
            f"{args.seeds} seeds each"
        )
        print("  " + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        print(f"  where the other {1 - parts['reward']:.3f} goes (reward lost per sample, by cause):")
        for why, v in sorted(lost.items(), key=lambda kv: -kv[1]):
            if v > 0:
                print(f"    {why:<26}{v:.4f}")
        print_confusion(rows, "objects of the named colour: named shape / called")
        if docked is not None:
            out = args.gallery.with_name(f"{args.gallery.stem}_{k}.png")
            save_gallery(docked, out)
            print(f"wrote {out}: {min(len(docked), 96)} of {len(docked)} docked objects")


if __name__ == "__main__":
    main()
