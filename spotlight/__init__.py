"""Spotlight: GRPO post-training of Diffusion Transformers on reserved + preemptible spot GPUs."""

from spotlight.api import Experiment
from spotlight.recipe import Recipe, load_recipe

__all__ = ["Experiment", "Recipe", "load_recipe"]
__version__ = "0.1.0"
