"""Seed exploration and high-contrast seed selection (DanceGRPO's best-of-N, Spotlight's insight 1).

For a prompt, M candidate seeds are sampled and scored; the rollout group keeps the G/2 highest-
and G/2 lowest-reward seeds. Because every noise draw is a function of (seed, step), scoring a seed
predicts that seed's rollout: exactly with the same weights and steps, approximately with stale
weights or cached steps — which is what lets Spotlight explore on spot GPUs during training.

Knows the selection rule and how candidate seeds are named; not who computes the scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spotlight.errors import ConfigError
from spotlight.policy.caching import StepCache
from spotlight.policy.planner import DEFAULT_ARMS, Arm, PlannerConfig
from spotlight.policy.sampler import _mix

SCHEDULES = ("off", "critical", "overlap")


@dataclass(kw_only=True, slots=True)
class ExploreConfig:
    """Seed exploration: when it runs, with what, and how it is checked (recipe section [explore])."""

    schedule: str = "critical"
    """'off' = random seeds (the Flow-GRPO baseline); 'critical' = best-of-N scored with the current
    weights before each rollout (DanceGRPO; on the critical path); 'overlap' = iteration i+1's
    candidates scored with iteration i's weights while the trainer updates (Spotlight; spot workers
    idle through training), cut off at i+1's rollout."""
    candidates: int = 16
    """M: candidate seeds scored per prompt (when the planner is off)."""
    cache: str | None = None
    """The step cache exploration samples through (when the planner is off): "fbc:T" (diffusers'
    first-block cache at threshold T) or "taylor:N" (TaylorSeer, attention every N calls);
    None = full steps (`spotlight.policy.caching.StepCache`)."""
    chunk: int | None = None
    """Candidate seeds per exploration request; None = a prompt's M candidates in one request.
    Smaller chunks spread a prompt over more workers and let a deadline keep part of a prompt."""
    wait_s: float = 0.0
    """overlap: seconds the driver may wait past the deadline (the start of the next rollout) for
    late exploration results before cancelling them. 0 = the paper's rule; a large value makes a
    runtime run reproduce the in-process one exactly (the equivalence test)."""
    planner: bool = False
    """Let the UCB planner (spotlight.policy.planner) choose (M, steps) per iteration from `arms`
    under the training-window budget, instead of the fixed candidates/cache."""
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    """The planner's arms: "M" (full steps) or "M@CACHE" (M candidates through a step cache)."""
    arm_plan: list[str] | None = None
    """The arm of each exploration, given instead of chosen ("M" or "M@CACHE", as `arms`): the
    exploration for iteration i uses ``arm_plan[(i - first) % len(arm_plan)]``, where first is the
    first iteration that explores (0 under 'critical', 1 under 'overlap'). None = the planner's
    choice (`planner`) or the fixed `candidates`/`cache`. Set it with `planner` off.
    `spotlight compare` sets it to the arms the planner chose on the simulated cluster a system is
    billed on, so its learning run explores as that cluster does."""
    exploration: float = 0.5
    """The planner's UCB1 coefficient c (0 = greedy)."""
    budget_fraction: float = 0.9
    """Share of (predicted training window x exploring workers) the planner may fill."""
    call_seconds: float | None = None
    """The planner's prior worker-seconds per (sample x model call); None = cheapest arm first."""
    check_every: int | None = None
    """Every this many iterations, re-score some explored candidates with the fresh weights at full
    steps and log the Spearman rank consistency of stale/cached vs fresh/full scores; None = never."""
    check_prompts: int = 2
    """Prompts re-scored per consistency check (all their returned candidates)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"explore.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}"
            )
        if self.candidates < 2:
            raise ConfigError(f"explore.candidates must be >= 2, got {self.candidates}")
        if self.cache is not None:
            try:
                StepCache.parse(self.cache)
            except ValueError as e:
                raise ConfigError(f"explore.cache: {e}") from None
        if self.chunk is not None and self.chunk < 1:
            raise ConfigError(f"explore.chunk must be >= 1 or unset, got {self.chunk}")
        if not self.wait_s >= 0:
            raise ConfigError(f"explore.wait_s must be >= 0, got {self.wait_s}")
        if self.check_every is not None and self.check_every < 1:
            raise ConfigError(f"explore.check_every must be >= 1 or unset, got {self.check_every}")
        if self.check_prompts < 1:
            raise ConfigError(f"explore.check_prompts must be >= 1, got {self.check_prompts}")
        self.planner_config()  # arms and coefficients validated now, with the field named
        if self.arm_plan is not None:
            if self.planner:
                raise ConfigError("explore.arm_plan gives every arm: set explore.planner = false with it")
            if not self.arm_plan:
                raise ConfigError("explore.arm_plan must name at least one arm, or be unset")
            for i, a in enumerate(self.arm_plan):
                try:
                    Arm.parse(a)
                except ValueError as e:
                    raise ConfigError(f"explore.arm_plan[{i}]: {e}") from None

    @property
    def enabled(self) -> bool:
        """Whether seeds are selected from explored candidates (any schedule but 'off')."""
        return self.schedule != "off"

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(
            arms=tuple(self.arms),
            exploration=self.exploration,
            budget_fraction=self.budget_fraction,
            call_seconds=self.call_seconds,
        )

    def fixed_arm(self, iteration: int) -> Arm:
        """The arm of iteration ``iteration``'s exploration when the planner is off: `arm_plan`'s
        (cycled, as there), else the fixed `candidates`/`cache`."""
        if self.arm_plan is not None:
            first = 1 if self.schedule == "overlap" else 0
            return Arm.parse(self.arm_plan[(iteration - first) % len(self.arm_plan)])
        return Arm(self.candidates, None if self.cache is None else StepCache.parse(self.cache))

    def candidate_counts(self) -> list[int]:
        """Every M this config can choose (the planner's arms, the plan's, or the fixed one)."""
        if self.planner:
            return [a.candidates for a in self.planner_config().arms]
        if self.arm_plan is not None:
            return sorted({Arm.parse(a).candidates for a in self.arm_plan})
        return [self.candidates]


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
    keep = list(order[:half]) + list(order[len(order) - half :])
    return [seeds[i] for i in keep]
