# python bench/ocr_letters.py [--samples 32] [CHECKPOINT ...]     (default: builtin:ocr_base)
"""Which letters does a text-rendering checkpoint draw right, and which does it never draw right?

For each checkpoint (the OCR base by default; a run's `checkpoints/iter_NNNN.safetensors`), the
`ocr` recipe's deterministic sampler (`sampler.eval_steps` ODE steps) draws every held-out word
and the first 16 training words `--samples` times (the same seeds for every checkpoint), PP-OCRv4
reads them (the `ocr` reward's reader, line mode), and each letter of the word counts as right when
the minimum edit alignment of the read text matches it to the same letter (``aligned_marks`` of
the word against the read: what the reward's per-letter credit marks).

Prints, per checkpoint and word set, how the letters split by the share of samples that draw them
right (never, under 10%, 10-50%, 50% and more) and their mean (about the word reward: 1 − edit
distance / length counts extra letters too); then each held-out word's letters with their share.
GRPO with groups of 8 learns from a letter only in a group that has it both right and wrong: a
letter right in under 10% of samples is right in no sample of most groups. Seeded: a re-run
prints the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight import work  # noqa: E402
from spotlight.data.prompts import heldout_prompts, prompt_set  # noqa: E402
from spotlight.data.text import quoted_text  # noqa: E402
from spotlight.policy.sampler import sample_ode  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.rewards.base import to_uint8_images  # noqa: E402
from spotlight.rewards.ocr import aligned_marks, normalize_text  # noqa: E402

SEED0 = 1000  # the samples' seeds: SEED0 .. SEED0 + samples - 1, for every word and checkpoint


def label(checkpoint: str) -> str:
    """A checkpoint's name in the tables: ``builtin:...`` as given, a run's file as ``run/iter_NNNN``."""
    if checkpoint.startswith("builtin:"):
        return checkpoint
    path = Path(checkpoint)
    return f"{path.parent.parent.name}/{path.name.removesuffix('.safetensors')}"


def letter_rates(model, recipe, reward, prompts: list[str], samples: int) -> list[tuple[str, np.ndarray]]:
    """(word, share of the samples with each of its letters right) per prompt."""
    shape, out = work.image_shape(recipe), []
    seeds = list(range(SEED0, SEED0 + samples))
    for p in prompts:
        reads = reward.read(to_uint8_images(sample_ode(model, [p] * samples, seeds, recipe.sampler, shape)))
        word = quoted_text(p)
        marks = [aligned_marks(normalize_text(word), normalize_text(r)) for r in reads]
        out.append((word, np.mean(marks, axis=0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="*", default=["builtin:ocr_base"])
    ap.add_argument("--samples", type=int, default=32)
    args = ap.parse_args()
    rows, words = [], {}
    for ckpt in args.checkpoints:
        recipe = load_recipe("ocr", [f'model.checkpoint="{ckpt}"'])
        torch.manual_seed(0)
        model, reward = work.policy_model(recipe), work.recipe_reward(recipe)
        sets = {"held-out": heldout_prompts(recipe.run.prompts),
                "training (first 16)": prompt_set(recipe.run.prompts)[:16]}
        for name, prompts in sets.items():
            per_word = letter_rates(model, recipe, reward, prompts, args.samples)
            r = np.concatenate([rate for _, rate in per_word])
            split = (f"{(r == 0).sum()} / {((r > 0) & (r < 0.1)).sum()} / {((r >= 0.1) & (r < 0.5)).sum()} / "
                     f"{(r >= 0.5).sum()} of {len(r)}")
            rows.append((f"{label(ckpt)} {name}", split, f"{r.mean():.3f}"))
            if name == "held-out":
                words[ckpt] = per_word
        reward.close()
    print(f"# {args.samples} ODE samples per word, seeds {SEED0}..{SEED0 + args.samples - 1}")
    print_rows(rows, header=("checkpoint, words", "letters never / under 10% / 10-50% / 50%+ right",
                             "mean share right"))
    print()
    print("| held-out word | " + " | ".join(label(c) for c in args.checkpoints) + " |")
    print("| --- | " + " | ".join("---" for _ in args.checkpoints) + " |")
    for i, (word, _) in enumerate(next(iter(words.values()))):
        cells = [" ".join(f"{ch}:{rate:.2f}" for ch, rate in zip(word, words[c][i][1]))
                 for c in args.checkpoints]
        print(f"| {word} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
