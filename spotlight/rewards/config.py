"""The `[reward]` recipe section and the one function that builds a reward from it.

A reward is a name plus the arguments of its factory, written as one TOML table:

    [reward]                          # a built-in or registered reward with its arguments
    name = "http"
    url = "http://scorer:8000"
    timeout_s = 30

    [reward]                          # a user's own reward, named by import path
    name = "mypkg.rewards:make_score" # a factory: called with the table's other keys
    threshold = 0.5

    [reward]                          # a weighted sum: each term is a reward table + its weight
    name = "weighted"
    [[reward.terms]]
    name = "compositional"
    weight = 1.0
    [[reward.terms]]
    name = "jpeg"
    weight = 0.1
    quality = 90

Every process that scores — the trainer, each worker, a spot node's workers — calls
:func:`load_reward` on the same section (workers receive the recipe as JSON), so an import path
loads wherever the module is importable (installed, or on PYTHONPATH). The section is validated
when it is built: unknown names, import paths that do not import, unknown or missing arguments
raise one ConfigError line. Values are checked by the reward's own constructor in `load_reward`.

Knows the registry (``base``); nothing of models, actors or recipes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spotlight.errors import ConfigError
from spotlight.rewards.base import RewardFn, WeightedSum, check_arguments, make_reward, resolve_reward

__all__ = ["RewardConfig", "load_reward", "weighted_sum"]


@dataclass(kw_only=True, slots=True, frozen=True)
class RewardConfig:
    """Which reward scores the images (the recipe's `[reward]` table)."""

    name: str = "compositional"
    """A built-in or registered name (compositional, jpeg, http, weighted, ...) or an import path
    'package.module:factory' whose factory takes `args` as keywords and returns a reward."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory; in TOML the table's keys other than `name`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"reward.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.args, Mapping) or not all(isinstance(k, str) for k in self.args):
            raise ConfigError(f"reward {self.name!r}: arguments must be a table with string keys")
        object.__setattr__(self, "args", dict(self.args))
        check_arguments(self.name, resolve_reward(self.name), self.args)
        if self.name == "weighted":
            _terms(self.args["terms"])  # each term is itself a validated reward table

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> RewardConfig:
        """From a TOML table: `name` plus the factory's arguments as the other keys."""
        if not isinstance(table, Mapping):
            raise ConfigError(f"a reward must be a table with a name, got {table!r}")
        args = dict(table)
        return cls(name=args.pop("name", "compositional"), args=args)

    def to_table(self) -> dict[str, Any]:
        """The TOML/JSON table `from_table` reads back (what workers receive)."""
        return {"name": self.name, **self.args}


def load_reward(config: RewardConfig) -> RewardFn:
    """Build the reward a `[reward]` section names; the trainer and every worker call this."""
    return make_reward(config.name, **config.args)


def _terms(terms: Any) -> list[tuple[RewardConfig, float]]:
    if isinstance(terms, (str, bytes, Mapping)) or not isinstance(terms, (list, tuple)) or not terms:
        raise ConfigError(f"reward 'weighted': terms must be a non-empty list of tables, got {terms!r}")
    out = []
    for i, term in enumerate(terms):
        if not isinstance(term, Mapping):
            raise ConfigError(f"reward 'weighted': terms[{i}] must be a table, got {term!r}")
        table = dict(term)
        if "name" not in table or "weight" not in table:
            raise ConfigError(f"reward 'weighted': terms[{i}] needs a name and a weight, got {term!r}")
        weight = table.pop("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"reward 'weighted': terms[{i}].weight must be a finite number, got {weight!r}")
        out.append((RewardConfig.from_table(table), float(weight)))
    return out


def weighted_sum(terms: list[Mapping[str, Any]]) -> WeightedSum:
    """The 'weighted' reward: ``sum_i weight_i * reward_i``; each term is a reward table (name and
    arguments, as in `[reward]`) plus its `weight`. Term rewards need distinct names."""
    return WeightedSum([(load_reward(cfg), w) for cfg, w in _terms(terms)])
