"""Rewards: one plug-in interface (``base``), the recipe's ``[reward]`` section (``config``) and
the scorers built on it.

``load_reward(recipe.reward)`` builds the reward a recipe names (a name with arguments, a weighted
sum, or a user's ``"module:factory"``); ``make_reward("jpeg", quality=90)`` is the same from code.
Built-in scorers (jpeg, http, compositional) are imported only when first used, so
``import spotlight.rewards`` stays cheap. The classes are reachable here too, also lazily (PEP 562
``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import Any

from spotlight.rewards.base import (
    RewardFn,
    WeightedSum,
    check_arguments,
    check_batch,
    check_scores,
    known_rewards,
    make_reward,
    register_reward,
    resolve_reward,
    to_uint8_images,
    unregister_reward,
)
from spotlight.rewards.config import RewardConfig, load_reward

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "JpegCompressibility": "spotlight.rewards.jpeg",
    "JpegConfig": "spotlight.rewards.jpeg",
    "HttpReward": "spotlight.rewards.http",
    "RewardServer": "spotlight.rewards.http",
    "serve_reward": "spotlight.rewards.http",
    "OcrReward": "spotlight.rewards.ocr",
    "OcrConfig": "spotlight.rewards.ocr",
}

__all__ = [
    "RewardConfig",
    "RewardFn",
    "WeightedSum",
    "check_arguments",
    "check_batch",
    "check_scores",
    "known_rewards",
    "load_reward",
    "make_reward",
    "register_reward",
    "resolve_reward",
    "to_uint8_images",
    "unregister_reward",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
