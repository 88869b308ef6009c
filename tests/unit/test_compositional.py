"""The compositional reward on hand-made images with known answers, adversarial ones included."""

from __future__ import annotations

import random

import numpy as np
import pytest
from PIL import Image, ImageDraw

from spotlight.data.scenes import PALETTE, parse_caption, random_scene, render
from spotlight.errors import ConfigError
from spotlight.rewards.base import make_reward
from spotlight.rewards.compositional import analyse, score_scene

R = make_reward("compositional")


def canvas(*shapes, size=32):
    img = Image.new("RGB", (size, size))
    d = ImageDraw.Draw(img)
    for kind, color, box in shapes:
        {"circle": d.ellipse, "square": d.rectangle}.get(kind, None)(
            box, fill=PALETTE[color]
        ) if kind != "triangle" else d.polygon(
            [((box[0] + box[2]) / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=PALETTE[color]
        )
    return np.asarray(img)


def score(img, prompt):
    return float(R(img[None], [prompt])[0])


def test_exact_scene_scores_one():
    img = canvas(("circle", "red", (2, 10, 12, 20)), ("square", "blue", (18, 10, 28, 20)))
    assert score(img, "a red circle to the left of a blue square") == 1.0


def test_wrong_relation_loses_only_the_relation():
    img = canvas(("circle", "red", (18, 10, 28, 20)), ("square", "blue", (2, 10, 12, 20)))
    _, parts = score_scene(parse_caption("a red circle to the left of a blue square"), analyse(img))
    assert parts["relation"] == 0.0 and parts["red:count"] == 1.0 and parts["blue:shape"] == 1.0
    assert score(img, "a red circle to the right of a blue square") == 1.0


def test_counts_get_partial_credit():
    two = canvas(("circle", "green", (2, 2, 11, 11)), ("circle", "green", (18, 18, 27, 27)))
    assert score(two, "two green circles") == 1.0
    _, parts = score_scene(parse_caption("three green circles"), analyse(two))
    assert parts["green:count"] == pytest.approx(2 / 3) and parts["green:shape"] == pytest.approx(2 / 3)


def test_wrong_colour_and_wrong_shape():
    img = canvas(("square", "yellow", (8, 8, 20, 20)))
    assert score(img, "a yellow square") == 1.0
    assert score(img, "a red square") == 0.0  # nothing red; all colour is unstated
    _, parts = score_scene(parse_caption("a yellow circle"), analyse(img))
    assert parts["yellow:shape"] == 0.0 and parts["yellow:count"] == 1.0
    tri = canvas(("triangle", "yellow", (6, 6, 22, 22)))
    assert analyse(tri).of("yellow")[0].shape == "triangle"


def test_adversarial_images_score_low():
    assert score(np.zeros((32, 32, 3), np.uint8), "two red circles") == 0.0
    assert score(np.full((32, 32, 3), 255, np.uint8), "two red circles") == 0.0
    noise = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    assert R(noise, ["two red circles"] * 16).max() < 0.2
    red_wash = np.zeros((32, 32, 3), np.uint8)
    red_wash[:] = PALETTE["red"]
    assert score(red_wash, "two red circles") < 0.6  # one huge square blob: wrong count and shape


def test_rendered_scenes_score_one():
    rng = random.Random(0)
    scenes = [random_scene(rng) for _ in range(64)]
    imgs = np.stack([render(s, 32, rng) for s in scenes])
    assert np.all(R(imgs, [s.caption() for s in scenes]) == 1.0)


def test_captions_round_trip_and_reject_unknown_grammar():
    rng = random.Random(1)
    for _ in range(50):
        s = random_scene(rng)
        assert parse_caption(s.caption()) == s
    with pytest.raises(ConfigError, match="not of the compositional grammar"):
        score(np.zeros((32, 32, 3), np.uint8), "a photo of a cat")
    with pytest.raises(ConfigError, match="unknown colour or shape"):
        parse_caption("a purple circle")
