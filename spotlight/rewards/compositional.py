"""A GenEval-style compositional reward computed from the image itself.

For each prompt of the scene grammar (`spotlight.data.scenes`) the reward checks the constraints the
prompt states — colour present, count per colour, shape, relative position — with plain image
analysis, in three stages:

1. **Pixels → colour masks**: each pixel takes its nearest palette colour (or background).
2. **Masks → objects**: 8-connected components of one colour; fragments whose gap is a single
   background pixel are one object (the renderer keeps objects >= 2 px apart, a blurry sample
   splits one object into pieces), then specks (< 1/64 of the canvas) and washes (> 35%) are
   dropped. Counts are counts of these objects.
3. **Objects → shapes**: an object is compared with ideal outlines (circle, square, triangle in
   four orientations) drawn in the square box its bounding box implies; it *is* the outline with
   the highest overlap (IoU) if that overlap is >= `MIN_IOU` and its bounding box is not elongated
   (aspect <= `MAX_ASPECT`), else it has no shape. A bar, a ragged blob, two merged objects or a
   staircase of blocks has no shape; a square does not pass for a circle (IoU pi/4 < 1).

Score = mean of the constraint scores, each in [0, 1], with partial credit: a count off by one of
three earns 2/3, shape is the fraction of the named objects drawn with the named outline (credited
in proportion to how cleanly, see `shape_credit`), the relation is checked between the objects the
prompt names (the best-drawn object of each named colour; half credit when they hold the relation
but are not drawn as the named shapes), and "only the stated colours" is the
fraction of object pixels that are of a stated colour. Partial credit matters for RL: a reward with
few levels leaves many GRPO groups with zero variance, and those teach nothing.
`shortfall` splits what an image did not earn by cause — each constraint's loss, and the shape
loss by what filled each named slot (a partial overlap, an elongated box, another shape, a low
overlap, nothing); evaluations log its mean, docs/REWARD.md reads it for the demo's model.

The validation (renders with true and perturbed captions, adversarial images) is
tests/unit/test_compositional.py; the shape confusion matrix is `bench/reward_validation.py`
(docs/REWARD.md). Knows nothing of models or training: images in, scores out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from spotlight.data.scenes import BACKGROUND, PALETTE, Scene, parse_caption
from spotlight.errors import ConfigError
from spotlight.rewards.base import RewardFn, register_reward

_COLORS = list(PALETTE)
_CENTRES = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32)  # index 0 = background
_EIGHT = np.ones((3, 3), dtype=bool)

MIN_IOU = 0.78
"""An object below this overlap with its best outline is no shape (a ragged blob)."""
FULL_IOU = 0.88
"""At or above this overlap the shape earns full credit; between MIN_IOU and it, a linear ramp."""
MAX_ASPECT = 1.25
"""Bounding boxes longer than this ratio of their sides are bars: no shape (renders are 1:1)."""
_SUPER = 4  # sub-pixel samples per pixel side when rasterising the ideal outlines


def _number(v: object) -> bool:
    """A real number from a recipe (not a bool, not NaN)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """How strictly an object's outline is read (the reward's `min_iou`, `full_iou`, `max_aspect`
    arguments): the shipped values are the ones validated in docs/REWARD.md; a looser rule
    (`bench/shape_leniency.py`) passes more of the near-misses a person would also pass."""

    min_iou: float = MIN_IOU
    full_iou: float = FULL_IOU
    max_aspect: float = MAX_ASPECT

    def __post_init__(self) -> None:
        for name in ("min_iou", "full_iou", "max_aspect"):
            v = getattr(self, name)
            if not _number(v):
                raise ConfigError(f"compositional.{name} must be a number, got {v!r}")
        if not 0 < self.min_iou < self.full_iou <= 1:
            raise ConfigError(f"compositional: need 0 < min_iou < full_iou <= 1, got min_iou={self.min_iou}, "
                              f"full_iou={self.full_iou}")
        if not self.max_aspect >= 1:
            raise ConfigError(f"compositional.max_aspect must be >= 1 (long side / short side), "
                              f"got {self.max_aspect}")


SHIPPED = ShapeRule()


@dataclass(frozen=True, slots=True)
class Blob:
    """One object: a connected component (fragments joined) of one colour."""

    color: str
    area: int
    cy: float
    cx: float
    fill: float  # area / bounding-box area (kept for reports)
    aspect: float  # long side / short side of the bounding box
    ious: tuple[float, float, float]  # overlap with the ideal circle, square, triangle
    rule: ShapeRule = SHIPPED  # how strictly `shape` and `shape_credit` read the overlaps

    @property
    def shape(self) -> str:
        """'circle' | 'square' | 'triangle', or 'none' for a bar or a shapeless blob."""
        if self.aspect > self.rule.max_aspect:
            return "none"
        best = int(np.argmax(self.ious))
        return ("circle", "square", "triangle")[best] if self.ious[best] >= self.rule.min_iou else "none"

    def shape_credit(self, shape: str) -> float:
        """Credit for being drawn as `shape`: 0 unless it is that shape; 1 from `full_iou` up."""
        if self.shape != shape:
            return 0.0
        iou = self.ious[("circle", "square", "triangle").index(shape)]
        lo, hi = self.rule.min_iou, self.rule.full_iou
        return float(min(1.0, (iou - lo) / (hi - lo) * 0.5 + 0.5))


@dataclass(frozen=True, slots=True)
class Analysis:
    blobs: tuple[Blob, ...]

    def of(self, color: str) -> list[Blob]:
        return sorted((b for b in self.blobs if b.color == color), key=lambda b: -b.area)


def analyse(
    image: np.ndarray, max_distance: float = 110.0, min_area: int | None = None, rule: ShapeRule = SHIPPED
) -> Analysis:
    """Colour masks -> objects -> shapes of one uint8 image [H, W, 3].

    Objects smaller than `min_area` (default: 1/64 of the canvas, 16 px at 32x32) are specks, not
    objects: noise must not pass for a count. Each object's shape is read by `rule`.
    """
    h, w = image.shape[:2]
    min_area = max(4, h * w // 64) if min_area is None else min_area
    px = image.reshape(-1, 3).astype(np.float32)
    d = ((px[:, None, :] - _CENTRES[None]) ** 2).sum(-1)
    label = d.argmin(1)
    label[d.min(1) > max_distance**2] = 0  # far from every palette colour: not an object pixel
    label = label.reshape(h, w)
    blobs = []
    for i, color in enumerate(_COLORS, start=1):
        for comp in _objects(label == i, min_area):
            area = int(comp.sum())
            if area > h * w * 0.35:
                continue  # a wash of colour over the canvas: not an object
            blobs.append(_describe(color, comp, area, rule))
    return Analysis(tuple(blobs))


def _objects(mask: np.ndarray, min_area: int) -> list[np.ndarray]:
    """Boolean masks of the objects in `mask`.

    An object is an 8-connected component of at least `min_area` pixels with a solid core (at
    least min_area/4 interior pixels — random noise makes long threads, not cores); components that only one
    background pixel separates (their 1-px dilations overlap) are one object, and smaller fragments
    that close join the object they belong to (they change its outline, not the count). Fragments
    near no object are specks: noise must not pass for an object.
    """
    comps, n = ndimage.label(mask, structure=_EIGHT)
    if n == 0:
        return []
    index = np.arange(1, n + 1)
    areas = ndimage.sum_labels(mask, comps, index=index)
    # a solid core, not a thread of noise pixels: interior pixels (all 8 neighbours set) too
    inner = ndimage.sum_labels(ndimage.binary_erosion(mask, structure=_EIGHT), comps, index=index)
    big = [j for j in index if areas[j - 1] >= min_area and inner[j - 1] >= max(1, min_area // 4)]
    if not big:
        return []
    grown = {j: ndimage.binary_dilation(comps == j, structure=_EIGHT) for j in range(1, n + 1)}
    parent = {j: j for j in big}

    def root(a: int) -> int:
        while parent[a] != a:
            a = parent[a]
        return a

    for i, a in enumerate(big):
        for b in big[i + 1:]:
            if (grown[a] & grown[b]).any():
                parent[root(b)] = root(a)
    objects = {r: np.zeros_like(mask) for r in {root(j) for j in big}}
    for j in range(1, n + 1):
        home = root(j) if j in parent else next((root(b) for b in big if (grown[j] & grown[b]).any()), None)
        if home is not None:
            objects[home] |= comps == j
    return list(objects.values())


def _describe(color: str, comp: np.ndarray, area: int, rule: ShapeRule) -> Blob:
    ys, xs = np.nonzero(comp)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box = comp[y0:y1, x0:x1]
    bh, bw = box.shape
    ious = tuple(max(_iou(box, t) for t in _outlines(kind, bh, bw))
                 for kind in ("circle", "square", "triangle"))
    return Blob(
        color, area, float(ys.mean()), float(xs.mean()), area / (bh * bw), max(bh, bw) / min(bh, bw), ious,
        rule,
    )


def _iou(mask: np.ndarray, ideal: np.ndarray) -> float:
    union = (mask | ideal).sum()
    return float((mask & ideal).sum() / union) if union else 0.0


@functools.lru_cache(maxsize=4096)
def _outlines(kind: str, h: int, w: int) -> tuple[np.ndarray, ...]:
    """Ideal masks of `kind` filling an h x w bounding box: a pixel is in when at least half of its
    sub-pixel samples are. Triangles in four orientations (apex up — the renderer's — down, left,
    right): a person calls all four triangles."""
    offs = (np.arange(_SUPER) + 0.5) / _SUPER
    y = ((np.arange(h)[:, None] + offs[None]).reshape(-1)[:, None] - h / 2) / (h / 2)  # in [-1, 1]
    x = ((np.arange(w)[:, None] + offs[None]).reshape(-1)[None, :] - w / 2) / (w / 2)
    if kind == "circle":
        masks = [y**2 + x**2 <= 1]
    elif kind == "square":
        masks = [(np.abs(y) <= 1) & (np.abs(x) <= 1)]
    else:
        masks = [
            (np.abs(a) <= 1) & (np.abs(b) <= (s * a + 1) / 2) for a, b in ((y, x), (x, y)) for s in (1, -1)
        ]
    return tuple(
        np.broadcast_to(m, (h * _SUPER, w * _SUPER)).reshape(h, _SUPER, w, _SUPER).mean((1, 3)) >= 0.5
        for m in masks
    )


def score_scene(scene: Scene, a: Analysis) -> tuple[float, dict[str, float]]:
    """Mean constraint score and the per-constraint scores (for reports and tests)."""
    parts: dict[str, float] = {}
    named: list[Blob | None] = []
    for g in scene.groups:
        found = a.of(g.color)
        k = len(found)
        parts[f"{g.color}:present"] = float(k > 0)
        parts[f"{g.color}:count"] = max(0.0, 1.0 - abs(k - g.count) / g.count)
        credits = sorted((b.shape_credit(g.shape) for b in found), reverse=True)[: g.count]
        parts[f"{g.color}:shape"] = sum(credits) / g.count
        # the object the prompt names: the best-drawn one of its colour, else the largest
        named.append(max(found, key=lambda b: (b.shape_credit(g.shape), b.area)) if found else None)
    if scene.relation is not None:
        p, q = named
        # between the objects the prompt names: a bar left of a blob is only half of "a red circle
        # to the left of a blue square"; full credit needs the named shapes too
        named_ok = (
            0.0
            if p is None or q is None
            else (p.shape_credit(scene.groups[0].shape) + q.shape_credit(scene.groups[1].shape)) / 2
        )
        parts["relation"] = float(p is not None and q is not None and _holds(scene.relation, p, q)) * (
            0.5 + 0.5 * named_ok
        )
    stated = sum(b.area for b in a.blobs if b.color in {g.color for g in scene.groups})
    total = sum(b.area for b in a.blobs)
    parts["only-stated-colours"] = stated / total if total else 0.0
    return float(np.mean(list(parts.values()))), parts


SHORTFALLS = ("partial overlap", "elongated box", "another shape", "low overlap", "object missing")
"""The causes `shape_shortfall` splits a shape constraint's lost credit into."""


def shape_shortfall(found: list[Blob], shape: str, count: int) -> dict[str, float]:
    """Why a colour group's shape constraint fell short, by cause (the values sum to 1 − its score).

    The prompt's `count` slots take the best-credited objects, as `score_scene` does; a slot loses
    to a *partial overlap* (called `shape`, overlap below the rule's `full_iou`), an *elongated
    box*, *another shape*, a *low overlap* (below `min_iou`: a ragged, merged or bitten object), or
    no object at all (*object missing*). `shortfall` puts these beside the other constraints' losses.
    """
    out = dict.fromkeys(SHORTFALLS, 0.0)
    best = sorted(found, key=lambda b: -b.shape_credit(shape))[:count]
    for b in best:
        why, lost = shape_cause(b, shape)
        out[why] += lost / count
    out["object missing"] = (count - len(best)) / count
    return out


def shape_cause(b: Blob, shape: str) -> tuple[str, float]:
    """Why one object falls short of full credit as `shape`, and the credit it loses (0 with a
    full-credit object, whose cause is then "partial overlap")."""
    credit = b.shape_credit(shape)
    if credit > 0:
        return "partial overlap", 1 - credit
    if b.aspect > b.rule.max_aspect:
        return "elongated box", 1.0
    return ("another shape" if b.shape != "none" else "low overlap"), 1.0


def shortfall(scene: Scene, a: Analysis) -> dict[str, float]:
    """The reward one image does not earn, by cause; the values sum to 1 − its score.

    Each constraint's lost credit over the number of constraints (the score is their mean), keyed
    by constraint ("count", "relation", "present", "only-stated-colours"), with the shape
    constraints' loss split by `shape_shortfall` ("shape: elongated box", ...). Evaluations log
    its mean, so a run shows what its reward is still missing, not only how much.
    """
    _, parts = score_scene(scene, a)
    n = len(parts)
    out: dict[str, float] = {}
    for key, v in parts.items():
        name = key.split(":")[-1]
        if name != "shape":
            out[name] = out.get(name, 0.0) + (1 - v) / n
    for g in scene.groups:
        for why, v in shape_shortfall(a.of(g.color), g.shape, g.count).items():
            out[f"shape: {why}"] = out.get(f"shape: {why}", 0.0) + v / n
    return out


def _holds(relation: str, p: Blob, q: Blob, margin: float = 2.0) -> bool:
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

    def __init__(
        self,
        max_distance: float = 110.0,
        min_area: int | None = None,
        min_iou: float = MIN_IOU,
        full_iou: float = FULL_IOU,
        max_aspect: float = MAX_ASPECT,
    ):
        """`max_distance`: how far (RGB) from a palette colour a pixel may be and still belong to an
        object; `min_area`: specks below it are not objects (default 1/64 of the canvas);
        `min_iou`, `full_iou`, `max_aspect`: the shape rule (`ShapeRule`). In a recipe, the
        `[reward]` table's keys: `name = "compositional"`, `min_iou = 0.72`, ..."""
        if not _number(max_distance) or not max_distance > 0:
            raise ConfigError(f"compositional.max_distance must be a number > 0, got {max_distance!r}")
        whole = isinstance(min_area, int) and not isinstance(min_area, bool)
        if min_area is not None and not (whole and min_area >= 1):
            raise ConfigError(f"compositional.min_area must be an int >= 1 (pixels), got {min_area!r}")
        self.max_distance, self.min_area = max_distance, min_area
        self.rule = ShapeRule(min_iou, full_iou, max_aspect)
        self._scenes: dict[str, Scene] = {}

    def scene(self, prompt: str) -> Scene:
        return self._scenes.get(prompt) or self._scenes.setdefault(prompt, parse_caption(prompt))

    def analyse(self, image: np.ndarray) -> Analysis:
        """One image's objects and shapes, read with this reward's thresholds."""
        return analyse(image, self.max_distance, self.min_area, self.rule)

    def parts(self, image: np.ndarray, prompt: str) -> dict[str, float]:
        """Per-constraint scores of one image (evaluation breaks the reward down with these)."""
        return score_scene(self.scene(prompt), self.analyse(image))[1]

    def shortfall(self, image: np.ndarray, prompt: str) -> dict[str, float]:
        """The reward one image does not earn, by cause (`shortfall`; sums to 1 − its score)."""
        return shortfall(self.scene(prompt), self.analyse(image))

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        out = np.empty(len(prompts), dtype=np.float32)
        for i, (img, prompt) in enumerate(zip(images, prompts, strict=True)):
            out[i] = score_scene(self.scene(prompt), self.analyse(img))[0]
        return out
