"""The exploration planner: a UCB1 bandit over (candidate seeds M, step setting) under a time budget.

Exploration for iteration i+1 runs on spot workers while the trainer updates on iteration i, so
what it may cost is bounded by that window: budget = predicted training window (s) x spot workers
present x `budget_fraction` (worker-seconds). An arm is (M candidates per prompt, and full steps or
one of diffusers' step caches, `spotlight.policy.caching.StepCache`). Its predicted cost is
prompts x M x (worker-seconds per candidate sample), the last an EWMA per arm of what the arm's
exploration measured; an arm never measured is priced from the EWMA of seconds per (candidate
sample x model call) over every measurement, times its nominal calls (all steps at full steps and
for a first-block cache, whose reuse depends on the data; TaylorSeer's fixed schedule).
Arms over budget are never chosen; when no arm fits, the cheapest is chosen and the decision says
so.

Payoff: the reward spread (std) of the groups the exploration selected, as the caller measures it.
UCB1's bonus sqrt(2 ln N / n) assumes payoffs in [0, 1]; spreads are divided by the largest spread
seen so far (a common factor of every arm's mean: it changes no ranking of means, only keeps them in
[0, 1] with the best arm near 1, where the bonus is on the same scale).

Call order per iteration: `choose` (pure: the same state gives the same decision), then, once the
exploration ran, `observe_cost` and `observe_payoff` for the chosen arm, and `observe_window` with
the training phase just measured. `state_dict()` is plain JSON (checkpoint metadata) and
`load_state_dict` restores the exact next decisions.

A pure core: no clock, no I/O, no knowledge of workers or queues — every measurement is passed in.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from spotlight.errors import ConfigError
from spotlight.policy.caching import StepCache

DEFAULT_ARMS = ("12", "16", "16@fbc:0.2", "32@fbc:0.2")  # all > the default group of 8
_ARM = re.compile(r"^\s*(\d+)\s*(?:@(.*))?$")


@dataclass(frozen=True, slots=True)
class Arm:
    """One exploration setting: M candidates per prompt, at full steps or with a step cache. Written
    in a recipe as "16" (full steps), "16@fbc:0.2" or "16@taylor:3" (`StepCache`)."""

    candidates: int
    cache: StepCache | None = None

    @classmethod
    def parse(cls, text: str) -> Arm:
        m = _ARM.match(text)
        if not m:
            raise ValueError(f"{text!r} is not 'M' or 'M@CACHE'")
        return cls(int(m[1]), StepCache.parse(m[2]) if m[2] is not None else None)

    @property
    def label(self) -> str:
        return str(self.candidates) if self.cache is None else f"{self.candidates}@{self.cache.label}"

    def nominal_calls(self, steps: int) -> int:
        """Computed model calls per candidate sample before any measurement (`StepCache.nominal_calls`)."""
        return steps if self.cache is None else self.cache.nominal_calls(steps)


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """The exploration planner (recipe section [explore])."""

    arms: tuple[Arm, ...] = field(default_factory=lambda: tuple(map(Arm.parse, DEFAULT_ARMS)))
    """The settings it chooses among: "M" (full steps) or "M@CACHE" (a `StepCache`: "fbc:T",
    "taylor:N"); strings are parsed into `Arm`s."""
    exploration: float = 0.5
    """c in UCB1's mean + c·sqrt(2 ln N / n): 0 = always the best mean so far. Below UCB1's 1
    because normalised spreads of sensible arms lie close together and a run has only a
    few hundred iterations to spend."""
    smoothing: float = 0.5
    """EWMA weight of the newest measurement of costs and the training window, in (0, 1]."""
    budget_fraction: float = 0.9
    """Share of (predicted window x workers) the plan may fill; the rest absorbs prediction error
    (results after the deadline are cancelled, so overshooting wastes the late candidates)."""
    call_seconds: float | None = None
    """Prior worker-seconds per (candidate sample x model call) before anything is measured; None =
    choose the cheapest arm until a measurement arrives."""

    def __post_init__(self) -> None:
        arms = []
        for i, a in enumerate(self.arms):
            try:
                arms.append(Arm.parse(a) if isinstance(a, str) else a)
            except ValueError as e:
                raise ConfigError(f"explore.arms[{i}]: {e}") from None
        self.arms = tuple(arms)
        if not self.arms:
            raise ConfigError("explore.arms must name at least one arm, got none")
        for i, a in enumerate(self.arms):
            if a.candidates < 2:
                raise ConfigError(f"explore.arms[{i}] ({a.label}): candidates must be >= 2")
        if len({a.label for a in self.arms}) != len(self.arms):
            raise ConfigError(f"explore.arms has duplicates: {[a.label for a in self.arms]}")
        if self.exploration < 0:
            raise ConfigError(f"explore.exploration must be >= 0, got {self.exploration}")
        if not 0 < self.smoothing <= 1:
            raise ConfigError(f"explore.smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 < self.budget_fraction <= 1:
            raise ConfigError(f"explore.budget_fraction must be in (0, 1], got {self.budget_fraction}")
        if self.call_seconds is not None and not self.call_seconds > 0:
            raise ConfigError(f"explore.call_seconds must be > 0 or unset, got {self.call_seconds}")


@dataclass(slots=True)
class Decision:
    """One `choose`: what to explore with and why (log it as `as_dict()`)."""

    arm: Arm
    index: int
    budget_s: float | None
    """Worker-seconds available; None before any training window was observed or given."""
    predicted_s: dict[str, float | None]
    """Predicted worker-seconds of every arm (None = no cost known yet)."""
    scores: dict[str, float | None]
    """UCB1 score of every feasible, tried arm (None = untried or over budget)."""
    reason: str
    """'untried', 'ucb', or why the cheapest arm was taken: 'no arm fits the budget: cheapest',
    'no cost estimate yet: cheapest', 'no training window yet: cheapest'."""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["arm"] = self.arm.label
        return d


class Planner:
    """UCB1 over `cfg.arms` within the exploration budget (module docstring)."""

    def __init__(self, cfg: PlannerConfig, *, steps: int, group_size: int) -> None:
        for i, a in enumerate(cfg.arms):
            if a.candidates < group_size:
                raise ConfigError(f"explore.arms[{i}] ({a.label}): {a.candidates} candidates cannot fill a "
                                  f"group of run.group_size={group_size}, so it fits no budget")
        self.cfg, self.steps = cfg, steps
        n = len(cfg.arms)
        self.pulls = [0] * n  # payoffs observed per arm
        self.payoff_sum = [0.0] * n  # raw spreads
        self.payoff_max = 0.0
        self.sample_seconds: list[float | None] = [None] * n  # EWMA worker-s per candidate sample, per arm
        self.call_seconds = cfg.call_seconds  # EWMA worker-s per candidate sample x model call, all arms
        self.window_s: float | None = None  # EWMA of the training window

    # --- measurements --------------------------------------------------------------------------
    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.cfg.smoothing * (new - old)

    def observe_window(self, seconds: float) -> None:
        """The training phase just measured (the window exploration overlaps)."""
        self.window_s = self._ewma(self.window_s, _positive("seconds", seconds))

    def observe_cost(self, arm: Arm, *, worker_seconds: float, samples: int, sample_calls: int) -> None:
        """An exploration of `arm`: compute seconds summed over workers, candidate samples scored, and
        sample_calls = sum over those samples of the model calls computed for each (a batch of 16
        candidates at 10 computed calls = 160; a call the cache reused or predicted
        counts 0, so the per-call rate slightly overstates a computed call — the safe side)."""
        i = self.cfg.arms.index(arm)
        if samples < 1 or sample_calls < 0:
            raise ValueError(f"observe_cost: samples must be >= 1 and sample_calls >= 0, got {samples}, "
                             f"{sample_calls}")
        per_sample = _positive("worker_seconds", worker_seconds) / samples
        self.sample_seconds[i] = self._ewma(self.sample_seconds[i], per_sample)
        if sample_calls:
            self.call_seconds = self._ewma(self.call_seconds, worker_seconds / sample_calls)

    def observe_payoff(self, arm: Arm, spread: float) -> None:
        """The reward spread of the groups `arm`'s exploration selected (>= 0)."""
        i = self.cfg.arms.index(arm)
        if not spread >= 0:
            raise ValueError(f"observe_payoff: spread must be >= 0, got {spread}")
        self.pulls[i] += 1
        self.payoff_sum[i] += float(spread)
        self.payoff_max = max(self.payoff_max, float(spread))

    # --- the choice ------------------------------------------------------------------------------
    def predicted_seconds(self, arm: Arm, prompts: int) -> float | None:
        """Worker-seconds `arm` would take for `prompts` prompts; None when nothing is measured."""
        per = self.sample_seconds[self.cfg.arms.index(arm)]
        if per is None and self.call_seconds is not None:
            per = self.call_seconds * arm.nominal_calls(self.steps)
        return None if per is None else prompts * arm.candidates * per

    def choose(self, *, workers: int, prompts: int, window_s: float | None = None) -> Decision:
        """The arm for the next exploration of `prompts` prompts on `workers` spot workers, within
        `window_s` (default: the predicted window). Pure: changes no state."""
        if workers < 0 or prompts < 1:
            raise ValueError(f"choose: workers must be >= 0 and prompts >= 1, got {workers}, {prompts}")
        arms = self.cfg.arms
        window = self.window_s if window_s is None else window_s
        budget = None if window is None else window * workers * self.cfg.budget_fraction
        cost = [self.predicted_seconds(a, prompts) for a in arms]
        labels = [a.label for a in arms]
        predicted = dict(zip(labels, cost))
        if budget is None or any(c is None for c in cost):
            # Without a price for every arm or a budget, feasibility is unknown: the cheapest nominal arm
            # (fewest candidate-calls) is the one least likely to overrun.
            i = min(range(len(arms)), key=lambda j: (self._nominal(j), j))
            why = "no cost estimate yet" if any(c is None for c in cost) else "no training window yet"
            return Decision(arms[i], i, budget, predicted, dict.fromkeys(labels), f"{why}: cheapest")
        feasible = [j for j in range(len(arms)) if cost[j] <= budget]
        if not feasible:
            i = min(range(len(arms)), key=lambda j: (cost[j], j))
            why = "no arm fits the budget"
            return Decision(arms[i], i, budget, predicted, dict.fromkeys(labels), f"{why}: cheapest")
        scores = dict.fromkeys(labels)
        untried = [j for j in feasible if self.pulls[j] == 0]
        if untried:
            i = untried[0]
            for j in feasible:
                scores[labels[j]] = self._ucb(j)
            return Decision(arms[i], i, budget, predicted, scores, "untried")
        for j in feasible:
            scores[labels[j]] = self._ucb(j)
        i = max(feasible, key=lambda j: (scores[labels[j]], -j))  # ties: the earlier arm
        return Decision(arms[i], i, budget, predicted, scores, "ucb")

    def _nominal(self, j: int) -> int:
        """Candidate-sample model calls of arm j before any measurement."""
        return self.cfg.arms[j].candidates * self.cfg.arms[j].nominal_calls(self.steps)

    def _ucb(self, j: int) -> float | None:
        if self.pulls[j] == 0:
            return None
        total = sum(self.pulls)
        mean = self.payoff_sum[j] / self.pulls[j] / self.payoff_max if self.payoff_max > 0 else 0.0
        return mean + self.cfg.exploration * math.sqrt(2 * math.log(total) / self.pulls[j])

    # --- checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain JSON-able state (floats round-trip exactly through `json`)."""
        return {"arms": [a.label for a in self.cfg.arms], "pulls": list(self.pulls),
                "payoff_sum": list(self.payoff_sum), "payoff_max": self.payoff_max,
                "sample_seconds": list(self.sample_seconds), "call_seconds": self.call_seconds,
                "window_s": self.window_s}

    def load_state_dict(self, state: dict) -> None:
        labels = [a.label for a in self.cfg.arms]
        if state.get("arms") != labels:
            raise ConfigError(f"explore.arms {labels} differ from the checkpoint's planner arms "
                              f"{state.get('arms')}; resume with the same arms")
        self.pulls = [int(x) for x in state["pulls"]]
        self.payoff_sum = [float(x) for x in state["payoff_sum"]]
        self.payoff_max = float(state["payoff_max"])
        self.sample_seconds = [None if x is None else float(x) for x in state["sample_seconds"]]
        self.call_seconds = None if state["call_seconds"] is None else float(state["call_seconds"])
        self.window_s = None if state["window_s"] is None else float(state["window_s"])


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)
