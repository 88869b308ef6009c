"""Seed exploration and high-contrast seed selection (DanceGRPO's best-of-N, Spotlight's insight 1).

For a prompt, M candidate seeds are sampled and scored; the rollout group keeps the G/2 highest-
and G/2 lowest-reward seeds. Because every noise draw is a function of (seed, step), scoring a seed
predicts that seed's rollout: exactly with the same weights and steps, approximately with stale
weights or cached steps — which is what lets Spotlight explore on spot GPUs during training.

Knows the selection rule and how candidate seeds are named; not who computes the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spotlight.errors import ConfigError
from spotlight.policy.sampler import _mix


@dataclass(kw_only=True, slots=True)
class ExploreConfig:
    """Seed exploration before each rollout."""

    enabled: bool = True
    """False = random seeds (the Flow-GRPO baseline)."""
    candidates: int = 16
    """M: candidate seeds scored per prompt."""
    effective_steps: int | None = None
    """E: model evaluations per exploration sample, evenly spread (naive step skipping); None = all
    rollout steps."""
    cache_threshold: float | None = None
    """Step caching the field uses: diffusers' first-block cache at this threshold (the later
    blocks are reused while the first block's residual changes less than this, relatively);
    None = off. 0.2-0.5 on the tiny model (docs/BENCHMARKS.md, step caching)."""

    def __post_init__(self) -> None:
        if self.candidates < 2:
            raise ConfigError(f"explore.candidates must be >= 2, got {self.candidates}")
        if self.effective_steps is not None and self.effective_steps < 1:
            raise ConfigError(f"explore.effective_steps must be >= 1, got {self.effective_steps}")
        if self.cache_threshold is not None and not 0 <= self.cache_threshold <= 1:
            raise ConfigError(f"explore.cache_threshold must be in [0, 1], got {self.cache_threshold}")


def candidate_seeds(run_seed: int, iteration: int, prompt_index: int, n: int, stream: int = 0) -> list[int]:
    """n distinct seeds for (run, iteration, prompt), reproducible and independent of everything else.

    stream 0 = training seeds; other streams (e.g. evaluation) never collide with them in practice.
    """
    base = _mix(_mix(_mix(run_seed, stream), iteration), prompt_index)
    return [_mix(base, j) % (2**31 - 1) for j in range(n)]


def select_contrast(seeds: list[int], rewards: np.ndarray, group_size: int) -> list[int]:
    """The G/2 highest- and G/2 lowest-reward seeds (ties broken by seed order, stable)."""
    if group_size % 2:
        raise ConfigError(f"run.group_size must be even for seed selection, got {group_size}")
    if len(seeds) < group_size:
        raise ConfigError(f"explore.candidates ({len(seeds)}) must be >= run.group_size ({group_size})")
    order = np.argsort(-np.asarray(rewards, dtype=np.float64), kind="stable")
    half = group_size // 2
    keep = list(order[:half]) + list(order[len(order) - half:])
    return [seeds[i] for i in keep]
