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
distance / length counts extra letters too); then each held-out word's letters with their share;
then the held-out letters grouped by how many training words have the same letter at the same
place — the same text token (``WordTokenizer``: a quoted word's letters are spelled ``"c@k``, k its
offset from the centre), which is all a held-out word shares with the training words.
GRPO with groups of 8 learns from a letter only in a group that has it both right and wrong: a
letter right in under 10% of samples is right in no sample of most groups. Seeded: a re-run
prints the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight import work  # noqa: E402
from spotlight.data.prompts import heldout_prompts, prompt_set  # noqa: E402
from spotlight.data.text import quoted_text  # noqa: E402
from spotlight.models.text import WordTokenizer  # noqa: E402
from spotlight.policy.sampler import sample_ode  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.rewards.base import to_uint8_images  # noqa: E402
from spotlight.rewards.ocr import aligned_marks, normalize_text  # noqa: E402

SEED0 = 1000  # the samples' seeds: SEED0 .. SEED0 + samples - 1, for every word and checkpoint
SEEN = ((0, 3), (3, 6), (6, 10), (10, 20), (20, None))  # bins of "training words with the token"


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


def letter_tokens(word: str) -> list[str]:
    """The text token of each letter of ``word`` (its letter and its place in the word)."""
    return WordTokenizer([]).words(f'"{word}"')


def seen_rows(words: dict[str, list[tuple[str, np.ndarray]]], training: list[str]) -> list[tuple]:
    """Held-out letters binned by how many training words share their token: per bin, the count,
    and per checkpoint the mean share right and how many are right in under 10% of samples."""
    seen = Counter(t for w in set(training) for t in set(letter_tokens(w)))
    per_ckpt = {c: [(seen[t], rate) for word, rates in per_word
                    for t, rate in zip(letter_tokens(word), rates)] for c, per_word in words.items()}
    rows = []
    for lo, hi in SEEN:
        cells = []
        for pairs in per_ckpt.values():
            r = np.array([rate for n, rate in pairs if n >= lo and (hi is None or n < hi)])
            cells.append(f"{r.mean():.2f}, {(r < 0.1).sum()} under 10%" if len(r) else "-")
        rows.append((f"{lo}-{hi - 1}" if hi else f"{lo}+", str(len(r)), *cells))
    return rows


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
    print()
    training = [quoted_text(p) for p in prompt_set(load_recipe("ocr").run.prompts)]
    print_rows(seen_rows(words, training),
               header=("training words with the letter at its place", "held-out letters",
                       *(f"{label(c)}: share right, under 10%" for c in args.checkpoints)))


if __name__ == "__main__":
    main()
