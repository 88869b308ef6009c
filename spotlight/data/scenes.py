"""Synthetic compositional scenes: a caption grammar, a renderer, and the caption parser.

A scene is a list of coloured shapes; its caption states colours, counts and (for two objects) a
relative position, like GenEval's prompts ("a red circle to the left of a blue square",
"three green triangles"). `render` draws the scene with PIL; `parse_caption` turns a caption back
into the `Scene` it states, so the compositional reward can score any image against any prompt of
this grammar. This module knows nothing of models, training or rewards.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from spotlight.errors import ConfigError

# Saturated, far-apart colours so a colour mask is unambiguous even on blurry samples.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (225, 45, 45),
    "green": (45, 200, 70),
    "blue": (55, 85, 235),
    "yellow": (235, 215, 45),
}
BACKGROUND = (0, 0, 0)
SHAPES = ("circle", "square", "triangle")
NUMBERS = {1: "a", 2: "two", 3: "three"}
WORD_TO_NUMBER = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
RELATIONS = ("left of", "right of", "above", "below")


@dataclass(frozen=True, slots=True)
class ObjectGroup:
    """`count` objects of one colour and shape."""

    color: str
    shape: str
    count: int


@dataclass(frozen=True, slots=True)
class Scene:
    """What a caption states: one or two object groups and, for two, a relation."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None  # "left of" | "right of" | "above" | "below": groups[0] REL groups[1]

    def caption(self) -> str:
        if self.relation is not None:
            a, b = self.groups
            return f"a {a.color} {a.shape} {_rel_phrase(self.relation)} a {b.color} {b.shape}"
        (g,) = self.groups
        noun = g.shape if g.count == 1 else g.shape + "s"
        return f"{NUMBERS[g.count]} {g.color} {noun}"


def _rel_phrase(relation: str) -> str:
    return f"to the {relation}" if relation in ("left of", "right of") else relation


VOCABULARY: tuple[str, ...] = tuple(
    sorted(
        set(WORD_TO_NUMBER)
        | set(PALETTE)
        | set(SHAPES)
        | {s + "s" for s in SHAPES}
        | {"to", "the", "left", "right", "of", "above", "below"}
    )
)

_SINGLE = re.compile(r"^(a|an|one|two|three) (\w+) (\w+?)s?$")
_PAIR = re.compile(r"^an? (\w+) (\w+) (to the left of|to the right of|above|below) an? (\w+) (\w+)$")


def parse_caption(caption: str) -> Scene:
    """The `Scene` a caption of this grammar states; ConfigError if it is not of the grammar."""
    text = " ".join(caption.lower().split())
    if m := _PAIR.match(text):
        c1, s1, rel, c2, s2 = m.groups()
        rel = rel.removeprefix("to the ")
        groups = (ObjectGroup(c1, s1, 1), ObjectGroup(c2, s2, 1))
        scene = Scene(groups, rel)
    elif m := _SINGLE.match(text):
        n, c, s = m.groups()
        scene = Scene((ObjectGroup(c, s, WORD_TO_NUMBER[n]),))
    else:
        raise ConfigError(f"prompt {caption!r} is not of the compositional grammar")
    for g in scene.groups:
        if g.color not in PALETTE or g.shape not in SHAPES:
            raise ConfigError(f"prompt {caption!r}: unknown colour or shape ({g.color} {g.shape})")
    return scene


def random_scene(rng: random.Random) -> Scene:
    """A scene from the whole grammar (used for pretraining)."""
    if rng.random() < 0.5:
        c1, c2 = rng.sample(list(PALETTE), 2)
        return Scene(
            (ObjectGroup(c1, rng.choice(SHAPES), 1), ObjectGroup(c2, rng.choice(SHAPES), 1)),
            rng.choice(RELATIONS),
        )
    return Scene((ObjectGroup(rng.choice(list(PALETTE)), rng.choice(SHAPES), rng.randint(1, 3)),))


def render(scene: Scene, size: int, rng: random.Random) -> np.ndarray:
    """Draw `scene` on a `size`x`size` canvas: uint8 array [H, W, 3]. Objects never overlap."""
    lo, hi = max(4, size // 4), max(5, size * 3 // 8)
    for _ in range(100):  # a crowded first placement can leave no room: lay the scene out again
        img = Image.new("RGB", (size, size), BACKGROUND)
        draw = ImageDraw.Draw(img)
        boxes: list[tuple[int, int, int, int]] = []
        if scene.relation is not None:
            todo = [
                (g, r, rng.randint(lo, hi))
                for g, r in zip(scene.groups, _relation_regions(scene.relation, size))
            ]
        else:
            (g,) = scene.groups
            todo = [(g, (0, 0, size, size), rng.randint(lo, hi - g.count + 1)) for _ in range(g.count)]
        for group, region, side in todo:
            box = _place(rng, region, side, boxes)
            if box is None:
                break
            boxes.append(box)
            _draw_shape(draw, group.shape, box, PALETTE[group.color])
        else:
            return np.asarray(img, dtype=np.uint8)
    raise RuntimeError(f"could not lay out {scene.caption()!r} on a {size}x{size} canvas")


def _relation_regions(relation: str, size: int) -> tuple[tuple[int, int, int, int], ...]:
    half = size // 2
    left, right = (0, 0, half, size), (half, 0, size, size)
    top, bottom = (0, 0, size, half), (0, half, size, size)
    return {
        "left of": (left, right),
        "right of": (right, left),
        "above": (top, bottom),
        "below": (bottom, top),
    }[relation]


def _place(rng, region, side, taken, tries: int = 200):
    x0, y0, x1, y1 = region
    side = min(side, x1 - x0 - 1, y1 - y0 - 1)
    for _ in range(tries):
        x, y = rng.randint(x0, x1 - side - 1), rng.randint(y0, y1 - side - 1)
        box = (x, y, x + side, y + side)
        if all(_apart(box, t) for t in taken):
            return box
    return None


def _apart(a, b, gap: int = 2) -> bool:
    return a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box, color) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)
