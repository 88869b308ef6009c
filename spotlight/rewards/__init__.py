"""Rewards: one plug-in interface (``base``) and the scorers built on it.

``make_reward("jpeg", quality=90)`` builds a reward by name; built-in scorers (jpeg, http,
compositional) are imported only when first used, so ``import spotlight.rewards`` stays cheap.
The classes are reachable here too, also lazily (PEP 562 ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import Any

from spotlight.rewards.base import __all__ as _base_all
from spotlight.rewards.base import (
    RewardFn,
    WeightedSum,
    check_batch,
    check_scores,
    known_rewards,
    make_reward,
    register_reward,
    to_uint8_images,
)

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "JpegCompressibility": "spotlight.rewards.jpeg",
    "JpegConfig": "spotlight.rewards.jpeg",
    "HttpReward": "spotlight.rewards.http",
    "RewardServer": "spotlight.rewards.http",
    "serve_reward": "spotlight.rewards.http",
}

__all__ = [*_base_all, *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
