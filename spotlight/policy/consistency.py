"""Rank consistency of candidate-seed scores: how well cheap scores order seeds like exact ones.

Spotlight's first insight is that a seed ranking computed with stale weights (or cached steps)
agrees with the ranking the fresh weights (at full steps) would give. These helpers measure that
agreement: Spearman's rank correlation per prompt, averaged over prompts.

Knows arrays of scores; nothing of models, samplers or who computed the scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two score vectors of one prompt's candidates (ties get their
    average rank); NaN when either vector is constant (no ranking to agree with)."""
    from scipy.stats import spearmanr

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"spearman needs two 1-D score vectors of the same length >= 2, "
                         f"got {x.shape}, {y.shape}")
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(spearmanr(x, y).statistic)


def rank_consistency(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """Mean Spearman over prompts (prompts with a constant score vector left out) and the per-prompt
    values; the mean is NaN when no prompt has a ranking."""
    if len(a) != len(b):
        raise ValueError(f"rank_consistency needs the same prompts on both sides, got {len(a)} and {len(b)}")
    per = [spearman(x, y) for x, y in zip(a, b)]
    ok = [r for r in per if not math.isnan(r)]
    return (float(np.mean(ok)) if ok else math.nan), per
