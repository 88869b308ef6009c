"""Unit tests of the reward interface: registry, WeightedSum, JPEG reward, tensor conversion."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from spotlight.errors import ConfigError
from spotlight.rewards import base
from spotlight.rewards.base import (
    WeightedSum,
    check_batch,
    known_rewards,
    make_reward,
    register_reward,
    to_uint8_images,
)
from spotlight.rewards.jpeg import JpegCompressibility, JpegConfig, jpeg_size_bytes

RNG = np.random.default_rng(0)
NOISE = RNG.integers(0, 256, size=(3, 48, 40, 3), dtype=np.uint8)
FLAT = np.full((3, 48, 40, 3), 128, dtype=np.uint8)
PROMPTS = ["a", "b", "c"]


class Const:
    """A reward that scores every image ``value``, counting its calls."""

    def __init__(self, value: float, name: str = "const") -> None:
        self.value, self.name, self.calls = value, name, 0

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        self.calls += 1
        return np.full(len(prompts), self.value, dtype=np.float32)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests that register names get a private copy, so nothing leaks between tests.
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_BUILTIN", dict(base._BUILTIN))


# --- registry -----------------------------------------------------------------------------------
def test_unknown_reward_names_it_and_lists_known() -> None:
    with pytest.raises(ConfigError) as e:
        make_reward("pickscoar")
    msg = str(e.value)
    assert "'pickscoar'" in msg
    for name in ("jpeg", "http", "compositional", "weighted"):
        assert name in msg
    assert isinstance(e.value, ValueError)  # ConfigError is also a ValueError


def test_bad_arguments_are_config_errors_listing_accepted_ones() -> None:
    with pytest.raises(ConfigError, match=r"qualty.*accepted arguments: .*quality"):
        make_reward("jpeg", qualty=90)
    with pytest.raises(ConfigError, match="quality must be in 1..95"):
        make_reward("jpeg", quality=0)


def test_make_reward_builds_builtin_with_kwargs() -> None:
    r = make_reward("jpeg", quality=50, normalize=True)
    assert isinstance(r, JpegCompressibility)
    assert r.config == JpegConfig(quality=50, normalize=True)
    assert r.name == "jpeg"


@pytest.mark.usefixtures("registry")
def test_register_reward_and_duplicate_names() -> None:
    @register_reward("const7")
    def const7(value: float = 7.0) -> Const:
        return Const(value)

    assert "const7" in known_rewards()
    r = make_reward("const7", value=3.0)
    np.testing.assert_array_equal(r(FLAT, PROMPTS), np.full(3, 3.0, np.float32))
    register_reward("const7")(const7)  # re-registering the same factory is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_reward("const7")(lambda: Const(1.0))


@pytest.mark.usefixtures("registry")
def test_missing_builtin_module_is_a_config_error() -> None:
    base._BUILTIN["ghost"] = "spotlight.rewards.ghost_module_that_does_not_exist:Ghost"
    with pytest.raises(ConfigError, match="'ghost'.*not available"):
        make_reward("ghost")


def test_importing_base_is_lazy() -> None:
    # A fresh interpreter: importing the reward interface must not pull in the scorers, PIL
    # or torch. The parent package may import what it likes, so count only what base adds.
    code = (
        "import sys, spotlight\n"
        "before = set(sys.modules)\n"
        "import spotlight.rewards, spotlight.rewards.base\n"
        "heavy = ('torch', 'PIL', 'spotlight.rewards.jpeg', 'spotlight.rewards.http',"
        " 'spotlight.rewards.compositional')\n"
        "added = [m for m in heavy if m in set(sys.modules) - before]\n"
        "assert not added, added\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- WeightedSum --------------------------------------------------------------------------------
def test_weighted_sum_combines_and_reports_parts() -> None:
    a, b = Const(2.0, "a"), Const(-1.0, "b")
    w = WeightedSum([(a, 0.5), (b, 3.0)])
    total, parts = w.evaluate(FLAT, PROMPTS)
    np.testing.assert_allclose(total, np.full(3, 0.5 * 2.0 + 3.0 * -1.0))
    assert total.dtype == np.float32 and total.shape == (3,)
    assert set(parts) == {"a", "b"}
    np.testing.assert_array_equal(parts["b"], np.full(3, -1.0, np.float32))
    np.testing.assert_array_equal(w(FLAT, PROMPTS), total)
    assert w.name == "0.5*a+3*b"


def test_weighted_sum_of_real_rewards_matches_by_hand() -> None:
    jpeg, low = JpegCompressibility(), JpegCompressibility(quality=20)
    w = make_reward("weighted", terms=[{"name": "jpeg", "weight": 2.0}])
    np.testing.assert_allclose(w(NOISE, PROMPTS), 2.0 * jpeg(NOISE, PROMPTS), rtol=1e-6)
    # per-term arguments sit beside the term's name and weight, as in a [[reward.terms]] table
    w = make_reward("weighted", terms=[{"name": "jpeg", "weight": -1.0, "quality": 20}])
    np.testing.assert_allclose(w(NOISE, PROMPTS), -low(NOISE, PROMPTS), rtol=1e-6)
    with pytest.raises(ConfigError, match=r"terms\[0\] needs a name and a weight"):
        make_reward("weighted", terms=[{"name": "jpeg"}])


def test_weighted_sum_rejects_bad_terms() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        WeightedSum([])
    with pytest.raises(ConfigError, match="unique"):
        WeightedSum([(Const(1.0), 1.0), (Const(2.0), 1.0)])
    with pytest.raises(ConfigError, match="must be finite"):
        WeightedSum([(Const(1.0), float("nan"))])


def test_weighted_sum_rejects_bad_scores() -> None:
    class Short(Const):
        def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
            return np.zeros(len(prompts) - 1, np.float32)

    with pytest.raises(ValueError, match=r"'short' returned shape \[2\], expected \[3\]"):
        WeightedSum([(Short(0.0, "short"), 1.0)])(FLAT, PROMPTS)
    with pytest.raises(ValueError, match="non-finite"):
        WeightedSum([(Const(float("inf")), 1.0)])(FLAT, PROMPTS)


def test_column_scores_awaited_are_checked_as_called() -> None:
    """The async path (a worker's event loop) gives what the sync path gives, and refuses what it
    refuses: a map of the wrong shape, a non-finite score — each naming the reward."""
    import asyncio

    class Async(Const):
        def __init__(self, value, name, width):
            super().__init__(value, name)
            self.width = width

        async def columns_async(self, images, prompts):
            maps = np.zeros((len(prompts), self.width), np.float32)
            return np.full(len(prompts), self.value, np.float32), maps

    class Scored(Const):
        async def score_async(self, images, prompts):
            return np.full(len(prompts), self.value, np.float32)

    run = asyncio.run
    scores, maps = run(base.column_scores_async(Async(0.5, "ok", FLAT.shape[2]), FLAT, PROMPTS))
    assert scores.tolist() == [0.5] * 3 and maps.shape == (3, FLAT.shape[2]) and not maps.any()
    for reward in (Scored(0.25), Const(0.25)):  # a score alone: its score at every column
        scores, maps = run(base.column_scores_async(reward, FLAT, PROMPTS))
        want = base.column_scores(Const(0.25), FLAT, PROMPTS)
        assert np.array_equal(scores, want[0]) and np.array_equal(maps, want[1])
    with pytest.raises(ValueError, match=r"'narrow' returned columns of shape \[3, 5\]"):
        run(base.column_scores_async(Async(0.5, "narrow", 5), FLAT, PROMPTS))
    with pytest.raises(ValueError, match="'nan' returned non-finite"):
        run(base.column_scores_async(Scored(float("nan"), "nan"), FLAT, PROMPTS))


def test_check_batch() -> None:
    check_batch(FLAT, PROMPTS)
    with pytest.raises(ValueError, match="uint8"):
        check_batch(FLAT.astype(np.float32), PROMPTS)
    with pytest.raises(ValueError, match=r"\[B, H, W, 3\]"):
        check_batch(FLAT[..., :1], PROMPTS)
    with pytest.raises(ValueError, match="one prompt per image"):
        check_batch(FLAT, PROMPTS[:2])
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        check_batch(FLAT, ["a", 2, "c"])  # type: ignore[list-item]


# --- JPEG ---------------------------------------------------------------------------------------
def test_jpeg_flat_beats_noise_and_is_deterministic() -> None:
    r = JpegCompressibility()
    images = np.concatenate([FLAT[:1], NOISE[:1]])
    s1 = r(images, ["x", "y"])
    s2 = r(images.copy(), ["other", "prompts"])  # the prompt does not matter
    assert s1.dtype == np.float32 and s1.shape == (2,)
    assert s1[0] > s1[1]
    assert (s1 < 0).all()
    np.testing.assert_array_equal(s1, s2)
    # DDPO convention: minus the size in kB.
    assert s1[1] == np.float32(-jpeg_size_bytes(NOISE[0], 95) / 1000.0)


def test_jpeg_quality_and_normalize() -> None:
    hi, lo = JpegCompressibility(quality=95), JpegCompressibility(quality=20)
    assert (lo(NOISE, PROMPTS) > hi(NOISE, PROMPTS)).all()  # lower quality, smaller files
    norm = JpegCompressibility(JpegConfig(normalize=True))(NOISE, PROMPTS)
    raw = 48 * 40 * 3
    expected = [-jpeg_size_bytes(img, 95) / raw for img in NOISE]
    np.testing.assert_allclose(norm, expected, rtol=1e-6)
    with pytest.raises(ConfigError, match="not both"):
        JpegCompressibility(JpegConfig(), quality=10)
    with pytest.raises(ConfigError, match="quality"):
        JpegConfig(quality=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uint8"):
        hi(NOISE.astype(np.int32), PROMPTS)


def test_jpeg_empty_batch() -> None:
    out = JpegCompressibility()(np.zeros((0, 8, 8, 3), np.uint8), [])
    assert out.shape == (0,) and out.dtype == np.float32


# --- tensor -> uint8 ----------------------------------------------------------------------------
def test_to_uint8_images_values_layout_and_clipping() -> None:
    x = torch.zeros(2, 3, 4, 5)
    x[0, 0] = -1.0  # red channel black
    x[0, 1] = 1.0  # green channel white
    x[0, 2] = 0.0  # blue channel mid grey
    x[1] = torch.linspace(-3.0, 3.0, 60).reshape(3, 4, 5)  # overshoot both ends
    out = to_uint8_images(x)
    assert out.dtype == np.uint8 and out.shape == (2, 4, 5, 3)
    assert (out[0, ..., 0] == 0).all() and (out[0, ..., 1] == 255).all()
    assert (out[0, ..., 2] == 128).all()  # 127.5 rounds to 128
    assert out[1].min() == 0 and out[1].max() == 255
    expected = ((x[1].clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(out[1], expected.astype(np.uint8))


def test_to_uint8_images_round_trips_and_accepts_bf16() -> None:
    u = torch.randint(0, 256, (2, 3, 6, 7), dtype=torch.uint8)
    x = u.float() / 127.5 - 1.0
    np.testing.assert_array_equal(to_uint8_images(x), u.permute(0, 2, 3, 1).numpy())
    out = to_uint8_images(x.to(torch.bfloat16).requires_grad_())
    assert out.shape == (2, 6, 7, 3)
    # bf16 keeps 8 significant bits, so values may move by a step or two, never more.
    assert np.abs(out.astype(int) - u.permute(0, 2, 3, 1).numpy().astype(int)).max() <= 2


def test_to_uint8_images_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        to_uint8_images(torch.zeros(2, 4, 4, 3))
    with pytest.raises(ValueError, match="floating"):
        to_uint8_images(torch.zeros(1, 3, 2, 2, dtype=torch.uint8))
    bad = torch.zeros(1, 3, 2, 2)
    bad[0, 1, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        to_uint8_images(bad)
