"""The recipe's [reward] section: a name with arguments, a weighted sum, a user's reward by import
path; the same table in and out (workers get it as JSON); one-line errors for every mistake."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from spotlight.errors import ConfigError
from spotlight.recipe import load_recipe
from spotlight.rewards import RewardConfig, WeightedSum, load_reward
from spotlight.rewards.http import HttpReward
from spotlight.rewards.jpeg import JpegCompressibility

IMAGES = np.random.default_rng(0).integers(0, 256, size=(2, 16, 16, 3), dtype=np.uint8)
PROMPTS = ["a red circle", "two blue squares"]

USER_MODULE = '''
import numpy as np

class Brightness:
    """Mean pixel value times `scale`: a reward that lives outside spotlight."""

    def __init__(self, scale):
        self.name, self.scale = "brightness", scale

    def __call__(self, images, prompts):
        return (images.reshape(len(images), -1).mean(1) * self.scale).astype(np.float32)

def make_brightness(scale: float = 1.0):
    return Brightness(scale)

def not_a_reward():
    return 42
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A reward module on sys.path for this test only; forgotten (sys.modules too) afterwards."""
    name = "user_rewards_cfg"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def recipe(*overrides: str):
    return load_recipe("tiny", ["model.checkpoint=none", *overrides])


def test_default_is_the_compositional_reward():
    r = recipe()
    assert r.reward == RewardConfig(name="compositional")
    assert load_reward(r.reward).name == "compositional"


def test_name_with_arguments_from_overrides():
    r = recipe("reward.name=http", "reward.url=http://scorer:8000", "reward.timeout_s=5")
    assert r.reward == RewardConfig(name="http", args={"url": "http://scorer:8000", "timeout_s": 5})
    reward = load_reward(r.reward)
    assert isinstance(reward, HttpReward) and reward.url == "http://scorer:8000" and reward.timeout_s == 5.0


def test_toml_table_and_weighted_terms(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(textwrap.dedent('''
        [reward]
        name = "weighted"
        [[reward.terms]]
        name = "jpeg"
        weight = 2.0
        [[reward.terms]]
        name = "compositional"
        weight = 0.5
        min_area = 3
        '''))
    cfg = load_recipe(path).reward
    assert cfg.name == "weighted" and [t["name"] for t in cfg.args["terms"]] == ["jpeg", "compositional"]
    reward = load_reward(cfg)
    assert isinstance(reward, WeightedSum) and [w for _, w in reward.terms] == [2.0, 0.5]
    assert reward.terms[1][0].min_area == 3
    by_hand = 2.0 * JpegCompressibility()(IMAGES, PROMPTS) + 0.5 * reward.terms[1][0](IMAGES, PROMPTS)
    np.testing.assert_allclose(reward(IMAGES, PROMPTS), by_hand, rtol=1e-6)


def test_table_round_trips_through_json_as_workers_receive_it():
    r = recipe("reward.name=weighted", 'reward.terms=[{name="jpeg", weight=1.0, quality=50}]')
    terms = [{"name": "jpeg", "weight": 1.0, "quality": 50}]
    assert r.to_dict()["reward"] == {"name": "weighted", "terms": terms}
    assert load_recipe(json.loads(json.dumps(r.to_dict()))) == r


def test_user_reward_by_import_path(user_module):
    r = recipe(f"reward.name={user_module}:make_brightness", "reward.scale=2.0")
    reward = load_reward(r.reward)
    assert reward.name == "brightness"
    np.testing.assert_allclose(reward(IMAGES, PROMPTS), IMAGES.reshape(2, -1).mean(1) * 2.0, rtol=1e-6)
    # a class is a factory too
    assert load_reward(RewardConfig(name=f"{user_module}:Brightness", args={"scale": 1.0})).scale == 1.0


@pytest.mark.parametrize("overrides,message", [
    (["reward.name=pickscore"],
     "unknown reward 'pickscore'; known rewards: compositional, http, jpeg, ocr, weighted"),
    (["reward.name=mypkg.rewards.score"], "an import path is written 'module:attribute'"),
    (["reward.name=http"], "reward 'http': missing a required argument: 'url'"),
    (["reward.name=jpeg", "reward.qualty=90"], "reward 'jpeg': got an unexpected keyword argument 'qualty'; "
                                               "accepted arguments: config, quality, normalize"),
    (["reward.name=no_such_module_xyz:score"],
     "reward 'no_such_module_xyz:score': cannot import no_such_module_xyz (ModuleNotFoundError"),
    (["reward.name=spotlight.rewards.jpeg:Nope"], "spotlight.rewards.jpeg has no attribute 'Nope'"),
    (["reward.name=weighted"], "reward 'weighted': missing a required argument: 'terms'"),
    (["reward.name=weighted", 'reward.terms=[{name="jpeg", weight="high"}]'],
     "terms[0].weight must be a finite"),
    (["reward.name=weighted", 'reward.terms=[{name="jpg", weight=1}]'], "unknown reward 'jpg'"),
])
def test_mistakes_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        recipe(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_user_factory_errors(user_module, tmp_path):
    with pytest.raises(ConfigError, match="unexpected keyword argument 'gain'"):
        recipe(f"reward.name={user_module}:make_brightness", "reward.gain=2")
    with pytest.raises(ConfigError, match="the factory returned int, not a reward"):
        load_reward(RewardConfig(name=f"{user_module}:not_a_reward"))
    (tmp_path / "broken_rewards_cfg.py").write_text("import numpy as np\nraise RuntimeError('no GPU here')\n")
    try:
        with pytest.raises(ConfigError, match=r"import broken_rewards_cfg \(RuntimeError: no GPU here"):
            recipe("reward.name=broken_rewards_cfg:score")
    finally:
        sys.modules.pop("broken_rewards_cfg", None)


def test_values_are_checked_by_the_reward_when_built():
    cfg = recipe("reward.name=jpeg", "reward.quality=0").reward
    with pytest.raises(ConfigError, match="quality must be in 1..95"):
        load_reward(cfg)


def test_the_shape_rule_is_an_argument_of_the_compositional_reward():
    """`min_iou`, `full_iou`, `max_aspect` set how strictly outlines are read (bench/shape_leniency.py's
    loose reading is a recipe line now): a 13x10 box is a bar to the shipped rule (aspect 1.3 > 1.25)
    and a square to one that allows 1.35; the default is the shipped rule, bit for bit."""
    from PIL import Image, ImageDraw

    from spotlight.data.scenes import PALETTE
    from spotlight.rewards.compositional import SHIPPED, ShapeRule, analyse, score_scene

    img = Image.new("RGB", (32, 32))
    ImageDraw.Draw(img).rectangle((8, 8, 17, 20), fill=PALETTE["red"])  # 10 wide, 13 tall
    img = np.asarray(img)
    shipped = load_reward(recipe().reward)
    loose = load_reward(recipe("reward.min_iou=0.72", "reward.full_iou=0.8", "reward.max_aspect=1.35").reward)
    assert shipped.rule == SHIPPED and loose.rule == ShapeRule(0.72, 0.8, 1.35)
    assert [b.shape for b in shipped.analyse(img).blobs] == ["none"]
    assert [b.shape for b in loose.analyse(img).blobs] == ["square"]
    assert shipped([img], ["a red square"])[0] < loose([img], ["a red square"])[0] == 1.0
    assert shipped.shortfall(img, "a red square")["shape: elongated box"] > 0
    assert sum(loose.shortfall(img, "a red square").values()) == 0
    pair = np.stack([np.asarray(Image.new("RGB", (32, 32))), img])  # an empty canvas and the box
    assert list(shipped(pair, PROMPTS)) == [  # the module-level reading is the shipped rule
        score_scene(shipped.scene(p), analyse(i))[0] for i, p in zip(pair, PROMPTS)]


@pytest.mark.parametrize("overrides,message", [
    (["reward.min_iou=0.9"], "need 0 < min_iou < full_iou <= 1, got min_iou=0.9, full_iou=0.88"),
    (["reward.full_iou=1.5"], "need 0 < min_iou < full_iou <= 1"),
    (["reward.max_aspect=0.8"], "compositional.max_aspect must be >= 1"),
    (['reward.min_iou="high"'], "compositional.min_iou must be a number, got 'high'"),
    (["reward.max_distance=0"], "compositional.max_distance must be a number > 0"),
    (["reward.min_area=2.5"], "compositional.min_area must be an int >= 1"),
    (["reward.min_area=inf"], "compositional.min_area must be an int >= 1"),
])
def test_the_compositional_readings_are_checked_when_built(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_reward(recipe(*overrides).reward)
    assert message in str(e.value) and "\n" not in str(e.value)
