"""A GenEval-style compositional reward computed from the image itself.

For each prompt of the scene grammar (`spotlight.data.scenes`) the reward checks the constraints the
prompt states — colour present, count per colour, shape, relative position — with plain image
analysis: nearest-palette colour masks and connected components. Score = mean of the constraint
scores, each in [0, 1], with partial credit (a count off by one of three earns 2/3, shapes are the
fraction of objects with the right outline, and "only the stated colours" is the fraction of
object pixels that are of a stated colour). Partial credit matters for RL: a reward with few
levels leaves many GRPO groups with zero variance, and those teach nothing.

Knows nothing of models or training: images in, scores out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from spotlight.data.scenes import BACKGROUND, PALETTE, Scene, parse_caption
from spotlight.rewards.base import RewardFn, register_reward

_COLORS = list(PALETTE)
_CENTRES = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32)  # index 0 = background


@dataclass(frozen=True, slots=True)
class Blob:
    """One connected component of one colour."""

    color: str
    area: int
    cy: float
    cx: float
    fill: float  # area / bounding-box area: ~1 square, ~0.78 circle, ~0.5 triangle

    @property
    def shape(self) -> str:
        if self.fill >= 0.88:
            return "square"
        return "circle" if self.fill >= 0.64 else "triangle"


@dataclass(frozen=True, slots=True)
class Analysis:
    blobs: tuple[Blob, ...]

    def of(self, color: str) -> list[Blob]:
        return sorted((b for b in self.blobs if b.color == color), key=lambda b: -b.area)


def analyse(image: np.ndarray, max_distance: float = 110.0, min_area: int | None = None) -> Analysis:
    """Colour masks + connected components of one uint8 image [H, W, 3].

    Components smaller than `min_area` (default: 1/64 of the canvas, 16 px at 32x32) are specks,
    not objects: noise must not pass for a count.
    """
    min_area = max(4, image.shape[0] * image.shape[1] // 64) if min_area is None else min_area
    px = image.reshape(-1, 3).astype(np.float32)
    d = ((px[:, None, :] - _CENTRES[None]) ** 2).sum(-1)
    label = d.argmin(1)
    label[d.min(1) > max_distance**2] = 0  # far from every palette colour: not an object pixel
    label = label.reshape(image.shape[:2])
    blobs = []
    for i, color in enumerate(_COLORS, start=1):
        mask = label == i
        comps, n = ndimage.label(mask)
        for j, sl in enumerate(ndimage.find_objects(comps), start=1):
            comp = comps[sl] == j
            area = int(comp.sum())
            if area < min_area or area > image.shape[0] * image.shape[1] * 0.35:
                continue  # a speck, or a wash of colour over the canvas: not an object
            ys, xs = np.nonzero(comp)
            box = comp.shape[0] * comp.shape[1]
            blobs.append(Blob(color, area, ys.mean() + sl[0].start, xs.mean() + sl[1].start, area / box))
    return Analysis(tuple(blobs))


def score_scene(scene: Scene, a: Analysis) -> tuple[float, dict[str, float]]:
    """Mean constraint score and the per-constraint scores (for reports and tests)."""
    parts: dict[str, float] = {}
    for g in scene.groups:
        found = a.of(g.color)
        k = len(found)
        parts[f"{g.color}:present"] = float(k > 0)
        parts[f"{g.color}:count"] = max(0.0, 1.0 - abs(k - g.count) / g.count)
        kept = found[: g.count]
        parts[f"{g.color}:shape"] = sum(b.shape == g.shape for b in kept) / g.count
    if scene.relation is not None:
        first, second = (a.of(g.color) for g in scene.groups)
        parts["relation"] = float(bool(first and second) and _holds(scene.relation, first[0], second[0]))
    stated = sum(b.area for b in a.blobs if b.color in {g.color for g in scene.groups})
    total = sum(b.area for b in a.blobs)
    parts["only-stated-colours"] = stated / total if total else 0.0
    return float(np.mean(list(parts.values()))), parts


def _holds(relation: str, p: Blob, q: Blob, margin: float = 1.0) -> bool:
    return {
        "left of": p.cx + margin < q.cx,
        "right of": p.cx > q.cx + margin,
        "above": p.cy + margin < q.cy,
        "below": p.cy > q.cy + margin,
    }[relation]


@register_reward("compositional")
class CompositionalReward(RewardFn):
    """The compositional reward as a plug-in: uint8 images [B, H, W, 3] + prompts -> [B] scores."""

    name = "compositional"

    def __init__(self, max_distance: float = 110.0, min_area: int | None = None):
        self.max_distance, self.min_area = max_distance, min_area
        self._scenes: dict[str, Scene] = {}

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = np.empty(len(prompts), dtype=np.float32)
        for i, (img, prompt) in enumerate(zip(images, prompts, strict=True)):
            scene = self._scenes.get(prompt) or self._scenes.setdefault(prompt, parse_caption(prompt))
            out[i] = score_scene(scene, analyse(img, self.max_distance, self.min_area))[0]
        return out
