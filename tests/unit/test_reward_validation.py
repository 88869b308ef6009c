"""Ground-truth validation of the compositional reward (issue 11).

The project can make its own ground truth: scenes rendered by `spotlight.data.scenes` with their
true captions (must score >= 0.9), the same scenes with perturbed captions (each perturbation loses
the credit of the constraint it breaks), and adversarial pictures that once fooled the fill-ratio
shape check — bars, blocks, merged objects, specks, a colour wash — which must never earn shape
credit. Seeded; the shape confusion matrix is printed by bench/reward_validation.py.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from PIL import Image, ImageDraw

from spotlight.data.scenes import PALETTE, SHAPES, ObjectGroup, Scene, random_scene, render
from spotlight.rewards.compositional import SHORTFALLS, analyse, score_scene, shape_shortfall, shortfall

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def rendered(n: int, seed: int) -> list[tuple[Scene, np.ndarray]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = random_scene(rng)
        out.append((s, render(s, 32, rng)))
    return out


def parts(scene: Scene, img: np.ndarray) -> tuple[float, dict[str, float]]:
    return score_scene(scene, analyse(img))


def test_true_captions_score_at_least_0_9():
    scores = [parts(s, img)[0] for s, img in rendered(300, seed=11)]
    assert min(scores) >= 0.9 and np.mean(scores) >= 0.99


def test_every_shape_renders_as_itself():
    rng = random.Random(3)
    for shape in SHAPES:
        for _ in range(40):
            scene = Scene((ObjectGroup(rng.choice(list(PALETTE)), shape, 1),))
            (blob,) = analyse(render(scene, 32, rng)).blobs
            assert blob.shape == shape and blob.shape_credit(shape) == 1.0


def _perturbed(scene: Scene, rng: random.Random) -> list[tuple[str, Scene, str]]:
    """(kind, perturbed scene, the part that must lose credit) for one true scene."""
    out = []
    g0 = scene.groups[0]
    other_color = rng.choice([c for c in PALETTE if c not in {g.color for g in scene.groups}])
    other_shape = rng.choice([s for s in SHAPES if s != g0.shape])
    out.append(
        (
            "colour",
            Scene((ObjectGroup(other_color, g0.shape, g0.count), *scene.groups[1:]), scene.relation),
            f"{other_color}:present",
        )
    )
    out.append(
        (
            "shape",
            Scene((ObjectGroup(g0.color, other_shape, g0.count), *scene.groups[1:]), scene.relation),
            f"{g0.color}:shape",
        )
    )
    if scene.relation is None:
        wrong = rng.choice([n for n in (1, 2, 3) if n != g0.count])
        out.append(("count", Scene((ObjectGroup(g0.color, g0.shape, wrong),)), f"{g0.color}:count"))
    else:
        out.append(("relation", Scene(scene.groups, OPPOSITE[scene.relation]), "relation"))
    return out


def test_each_perturbation_loses_the_credit_it_breaks():
    rng = random.Random(5)
    seen = set()
    for scene, img in rendered(200, seed=12):
        true_score, _ = parts(scene, img)
        for kind, wrong, part in _perturbed(scene, rng):
            score, p = parts(wrong, img)
            assert p[part] < 1.0, (kind, scene.caption(), wrong.caption(), p)
            if kind in ("colour", "shape", "relation"):
                assert p[part] == 0.0, (kind, wrong.caption(), p)
            assert score < true_score - 0.09, (kind, scene.caption(), wrong.caption(), score, true_score)
            seen.add(kind)
    assert seen == {"colour", "shape", "count", "relation"}


# --- adversarial pictures -------------------------------------------------------------------------


def _canvas(draws) -> np.ndarray:
    img = Image.new("RGB", (32, 32))
    d = ImageDraw.Draw(img)
    for kind, color, box in draws:
        getattr(d, kind)(box, fill=PALETTE[color])
    return np.asarray(img)


def _no_shape_credit(img: np.ndarray, color: str) -> None:
    for shape in SHAPES:
        for n in (1, 2, 3):
            _, p = score_scene(Scene((ObjectGroup(color, shape, n),)), analyse(img))
            assert p[f"{color}:shape"] == 0.0, (
                shape,
                n,
                [(b.shape, b.aspect, b.ious) for b in analyse(img).blobs],
            )


@pytest.mark.parametrize("kind", ["rectangle", "ellipse", "rounded_rectangle"])
def test_bars_never_earn_shape_credit(kind):
    rng = random.Random(7)
    for _ in range(60):
        short, ratio = rng.randint(4, 9), rng.uniform(1.5, 3.5)
        long_ = min(30, round(short * ratio))
        x, y = rng.randint(0, 31 - short), rng.randint(0, 31 - long_)
        box = (
            (x, y, x + short - 1, y + long_ - 1)
            if rng.random() < 0.5
            else (y, x, y + long_ - 1, x + short - 1)
        )
        color = rng.choice(list(PALETTE))
        _no_shape_credit(_canvas([(kind, color, box)]), color)


def test_three_tall_bars_do_not_pass_for_squares_or_circles():
    bars = _canvas([("rectangle", "blue", (3 + 10 * i, 4, 8 + 10 * i, 27)) for i in range(3)])
    assert score_scene(Scene((ObjectGroup("blue", "square", 3),)), analyse(bars))[1]["blue:shape"] == 0.0
    two = _canvas(
        [("rounded_rectangle", "red", (4, 3, 11, 28)), ("rounded_rectangle", "blue", (20, 3, 27, 28))]
    )
    score, p = score_scene(
        Scene((ObjectGroup("red", "circle", 1), ObjectGroup("blue", "square", 1)), "left of"), analyse(two)
    )
    assert p["red:shape"] == p["blue:shape"] == 0.0 and score <= 0.7  # 0.875 under the fill-ratio check


def test_unions_of_8x8_blocks_are_squares_or_nothing():
    """Block-noise artefacts: every connected union of grid-aligned 8x8 blocks in a 3x3 window is a
    square (one block, 2x2 blocks) or no shape at all — never a circle or a triangle."""
    cells = list(itertools.product(range(3), range(3)))
    for k in range(1, 10):
        for subset in itertools.combinations(cells, k):
            mask = np.zeros((32, 32), bool)
            for r, c in subset:
                mask[4 + 8 * r : 12 + 8 * r, 4 + 8 * c : 12 + 8 * c] = True
            img = np.zeros((32, 32, 3), np.uint8)
            img[mask] = PALETTE["green"]
            for blob in analyse(img).blobs:  # separate blocks are separate objects
                assert blob.shape in ("square", "none"), (subset, blob)
                if blob.shape == "square":  # only a full k x k arrangement of blocks
                    assert blob.fill == 1.0 and blob.aspect == 1.0, (subset, blob)


def test_merged_objects_are_one_shapeless_object():
    img = _canvas([("ellipse", "red", (2, 8, 13, 19)), ("ellipse", "red", (12, 8, 23, 19))])
    _, p = score_scene(Scene((ObjectGroup("red", "circle", 2),)), analyse(img))
    assert p["red:count"] == 0.5 and p["red:shape"] == 0.0


def test_fragments_of_one_object_count_once():
    img = _canvas([("ellipse", "yellow", (8, 8, 21, 21))])
    img = img.copy()
    img[:, 15] = 0  # a one-pixel seam splits the circle in two
    (blob,) = analyse(img).blobs
    assert blob.shape == "circle"


def test_specks_wash_and_noise_earn_nothing():
    rng = np.random.default_rng(0)
    specks = np.zeros((32, 32, 3), np.uint8)
    for y, x in rng.integers(0, 15, (40, 2)) * 2:
        specks[y : y + 1, x : x + 2] = PALETTE["red"]
    assert score_scene(Scene((ObjectGroup("red", "circle", 2),)), analyse(specks))[0] == 0.0
    for color in PALETTE:
        wash = np.zeros((32, 32, 3), np.uint8)
        wash[:] = PALETTE[color]
        _no_shape_credit(wash, color)
        assert score_scene(Scene((ObjectGroup(color, "square", 1),)), analyse(wash))[0] == 0.0
    noise = rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8)
    for img in noise:
        _no_shape_credit(img, "red")
        assert score_scene(Scene((ObjectGroup("red", "circle", 2),)), analyse(img))[0] < 0.2


# --- where a sample's shape credit went (bench/reward_validation.py's breakdown) -------------------


def test_shape_shortfall_names_each_lost_slot_and_sums_to_what_was_lost():
    # "three red squares": one clean square, one 8x14 bar, one circle; the third square missing
    img = _canvas(
        [
            ("rectangle", "red", (2, 2, 9, 9)),
            ("rectangle", "red", (14, 2, 21, 15)),
            ("ellipse", "red", (2, 18, 11, 27)),
        ]
    )
    a = analyse(img)
    why = shape_shortfall(a.of("red"), "square", 3)
    assert set(why) == set(SHORTFALLS)
    assert why["elongated box"] == pytest.approx(1 / 3)
    assert why["another shape"] == pytest.approx(1 / 3)
    assert why["object missing"] == why["low overlap"] == why["partial overlap"] == 0.0  # 3 objects
    _, p = score_scene(Scene((ObjectGroup("red", "square", 3),)), a)
    assert sum(why.values()) == pytest.approx(1 - p["red:shape"])
    # one object for two: the second slot is missing
    two = shape_shortfall(analyse(_canvas([("rectangle", "red", (2, 2, 9, 9))])).of("red"), "square", 2)
    assert two["object missing"] == pytest.approx(0.5) and sum(two.values()) == pytest.approx(0.5)


def test_shape_shortfall_sums_to_the_shape_loss_under_random_captions():
    # rendered scenes under perturbed captions lose shape credit in every way the breakdown names
    rng = random.Random(5)
    for scene, img in rendered(120, seed=13):
        a = analyse(img)
        for g in scene.groups:
            shape = rng.choice(SHAPES)
            count = rng.randint(1, 3)
            _, p = score_scene(Scene((ObjectGroup(g.color, shape, count),)), a)
            why = shape_shortfall(a.of(g.color), shape, count)
            assert min(why.values()) >= 0.0
            assert sum(why.values()) == pytest.approx(1 - p[f"{g.color}:shape"])


def test_shortfall_sums_to_what_each_image_did_not_earn():
    # every cause at once: rendered scenes under perturbed captions lose count, colour, shape and
    # relation credit; the breakdown must account for exactly the reward lost
    from spotlight.rewards.compositional import CompositionalReward

    rng, rw = random.Random(9), CompositionalReward()
    seen: set[str] = set()
    for scene, img in rendered(80, seed=17):
        for _, wrong, _ in [("true", scene, ""), *_perturbed(scene, rng)]:
            a = analyse(img)
            score, _ = score_scene(wrong, a)
            why = shortfall(wrong, a)
            assert min(why.values()) >= 0.0
            assert sum(why.values()) == pytest.approx(1 - score)
            seen |= {k for k, v in why.items() if v > 0}
        assert sum(rw.shortfall(img, scene.caption()).values()) == pytest.approx(0.0)
    assert {"count", "present", "relation", "shape: another shape"} <= seen
