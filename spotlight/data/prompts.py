"""Prompt sets: the whole caption grammar (pretraining) and named small sets for RL runs.

RL on a 2-core CPU has minutes, so the demo trains on a small fixed prompt set and evaluates on
the same prompts with *unseen seeds* (the held-out split is over seeds, not prompts) — enough to
show the policy improving what the base gets wrong. Larger sets exist for longer runs.
"""

from __future__ import annotations

import itertools

from spotlight.data.scenes import PALETTE, RELATIONS, SHAPES, ObjectGroup, Scene
from spotlight.errors import ConfigError


def all_captions() -> list[str]:
    """Every caption of the grammar, in a fixed order."""
    colors = list(PALETTE)
    single = [Scene((ObjectGroup(c, s, n),)) for n in (1, 2, 3) for c in colors for s in SHAPES]
    pairs = [
        Scene((ObjectGroup(c1, s1, 1), ObjectGroup(c2, s2, 1)), rel)
        for c1, c2 in itertools.permutations(colors, 2)
        for s1, s2 in itertools.product(SHAPES, SHAPES)
        for rel in RELATIONS
    ]
    return [s.caption() for s in single + pairs]


PROMPT_SETS: dict[str, list[str]] = {
    # Counting and relations are what the base model gets wrong most; colours it mostly gets right.
    "demo": [
        "two red circles",
        "three blue squares",
        "three yellow circles",
        "two green triangles",
        "a red circle to the left of a blue square",
        "a green square above a yellow circle",
        "a blue triangle to the right of a yellow square",
        "a yellow circle below a red square",
    ],
    "counting": [f"{n} {c} {s}s" for n in ("two", "three") for c in PALETTE for s in SHAPES],
}


def prompt_set(name: str) -> list[str]:
    if name == "all":
        return all_captions()
    if name not in PROMPT_SETS:
        raise ConfigError(f"data.prompts: unknown prompt set {name!r}; known: all, {', '.join(PROMPT_SETS)}")
    return list(PROMPT_SETS[name])
