"""Spotlight: GRPO post-training of Diffusion Transformers on reserved + preemptible spot GPUs.

The public names are imported on first use, so a process that needs none of them (a node agent,
the queue, the store: no torch) does not pay for importing torch when it imports ``spotlight.*``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotlight.api import Experiment
    from spotlight.recipe import Recipe, load_recipe

__all__ = ["Experiment", "Recipe", "load_recipe"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Experiment":
        from spotlight.api import Experiment

        return Experiment
    if name in ("Recipe", "load_recipe"):
        from spotlight import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'spotlight' has no attribute {name!r}")
