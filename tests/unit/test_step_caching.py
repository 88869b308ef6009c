"""Step caching (diffusers' first-block and TaylorSeer caches around one sampling call) and rank
consistency."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spotlight.errors import ConfigError
from spotlight.policy.caching import StepCache, step_cache
from spotlight.policy.consistency import rank_consistency, spearman
from spotlight.policy.sampler import SamplerConfig, sample_policy

SHAPE = (3, 16, 16)
PROMPTS = ["a red circle"] * 4
SEEDS = [11, 12, 13, 14]
# the demo's rollout policy: few stochastic steps, block noise, cps or flow
SAMPLER = SamplerConfig(steps=8, noise_level=1.0, sde_steps=2, noise_patch=4)


def model_of(dit_class: str = "QwenImageTransformer2DModel", layers: int = 3):
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model

    cfg = ModelConfig(checkpoint=None, dit_class=dit_class, layers=layers, heads=2, head_dim=16,
                      image_size=16, patch=4, text_dim=32, text_layers=1)
    torch.manual_seed(0)
    return build_model(cfg, VOCABULARY).eval()


@pytest.fixture(scope="module")
def model():
    return model_of()


def sample(m, init_seed=7, **kw):
    return sample_policy(m, PROMPTS, SEEDS, SAMPLER, SHAPE, init_seed=init_seed, **kw)


def test_no_cache_is_the_uncached_sampler_bit_for_bit(model):
    ref = sample(model)
    with step_cache(model, None) as cached:
        x = sample(cached)
    assert torch.equal(x, ref)
    s = cached.stats
    assert (s.calls, s.computed, s.cached) == (SAMPLER.steps, SAMPLER.steps, 0)
    assert s.attention == SAMPLER.steps * 3 and s.blocks == 3


@pytest.mark.parametrize("dit_class", ["QwenImageTransformer2DModel", "FluxTransformer2DModel"])
@pytest.mark.parametrize("spec", ["fbc:1e-12", "taylor:1"])
def test_caches_that_never_reuse_are_bit_identical(dit_class, spec):
    # fbc: every relative change is above 1e-12; taylor: an interval of 1 recomputes every call
    m = model_of(dit_class, layers=4)
    ref = sample(m)
    with step_cache(m, StepCache.parse(spec)) as cached:
        x = sample(cached)
    assert cached.stats.computed == cached.stats.calls == SAMPLER.steps
    assert torch.equal(x, ref)
    assert not m.dit.is_cache_enabled


@pytest.mark.parametrize("spec, computed, attention", [
    ("fbc:10", [0], 3 + (SAMPLER.steps - 1)),  # only the first call computes every block
    # two warm-up calls, then every third: calls 0, 1, 3, 6 of 8; the others predict every attention
    ("taylor:3", [0, 1, 3, 6], 4 * 3),
])
def test_a_cache_reuses_calls_deterministically_and_leaves_no_hooks(model, spec, computed, attention):
    ref = sample(model)
    cache = StepCache.parse(spec)
    with step_cache(model, cache) as cached:
        x = sample(cached)
    s = cached.stats
    assert (s.calls, s.computed, s.cached) == (SAMPLER.steps, len(computed), SAMPLER.steps - len(computed))
    assert s.attention == attention
    if cache.kind == "taylor":  # a fixed schedule: the planner's price before any measurement is exact
        assert cache.nominal_calls(SAMPLER.steps) == s.computed
    assert not torch.equal(x, ref)
    assert (x - ref).abs().mean() < 0.05  # an approximation of the same sample, not another one
    with step_cache(model, cache) as again:  # same batch, same bits; no state carried between calls
        assert torch.equal(sample(again), x)
    assert again.stats == s
    assert not model.dit.is_cache_enabled
    assert torch.equal(sample(model), ref)  # the model is untouched afterwards


def test_cached_samples_keep_the_seed_to_noise_mapping(model):
    # the cache changes velocities only: a cached sample still depends on its seeds (per-sample noise)
    # and on the shared initial noise exactly as the uncached one does
    with step_cache(model, StepCache("fbc", 10.0)) as cached:
        a = sample(cached, init_seed=7)
        b = sample_policy(cached, PROMPTS[:2], SEEDS[:2], SAMPLER, SHAPE, init_seed=7)  # another batch size
        c = sample(cached, init_seed=8)
        d = sample(cached, init_seed=7)  # each call starts a fresh cache: nothing of b or c leaks in
    assert all(not torch.equal(a[i], a[j]) for i in range(4) for j in range(i))
    assert not torch.equal(a, c)
    assert torch.equal(a, d)
    assert b.shape == (2, *SHAPE) and cached.stats.calls == 4 * SAMPLER.steps


def test_hooks_come_off_when_sampling_raises(model):
    with pytest.raises(RuntimeError, match="boom"):
        with step_cache(model, StepCache("fbc", 0.2)) as cached:
            cached.velocity  # noqa: B018
            raise RuntimeError("boom")
    assert not model.dit.is_cache_enabled


@pytest.mark.parametrize("text, message", [
    ("fbc:0", "fbc threshold must be > 0"),
    ("fbc:-0.1", "fbc threshold must be > 0"),
    ("taylor:0", "taylor interval must be an integer >= 1"),
    ("taylor:2.5", "taylor interval must be an integer >= 1"),
    ("mag:0.06", "step cache 'mag' is not one of fbc, taylor"),
    ("0.2", "is not 'fbc:THRESHOLD' or 'taylor:INTERVAL'"),
])
def test_bad_cache_specs(text, message):
    with pytest.raises(ValueError, match=message):
        StepCache.parse(text)


def test_models_a_cache_cannot_hook(model):
    one = model_of(layers=1)
    with pytest.raises(ConfigError, match=r"needs a DiT with >= 2 transformer blocks.*model\.layers"):
        with step_cache(one, StepCache("fbc", 0.2)):
            pass
    with pytest.raises(ConfigError, match=r"no cache hooks for SD3Transformer2DModel \(model\.dit_class\)"):
        with step_cache(model_of("SD3Transformer2DModel", layers=2), StepCache("taylor", 2)):
            pass
    with step_cache(one, None) as cached:  # counting only works on any model
        sample(cached)
    assert cached.stats.computed == SAMPLER.steps


def test_spearman_matches_scipy_and_handles_ties_and_constants():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a, b = rng.random(16), rng.random(16)
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    ties = [1, 1, 2, 3], [1, 2, 3, 4]
    assert spearman(*ties) == pytest.approx(spearmanr(*ties).statistic)
    assert math.isnan(spearman([0.5] * 4, [1, 2, 3, 4]))  # no warning, no ranking
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2, 3], [1, 2])
    mean, per = rank_consistency([[1, 2, 3], [1, 1, 1], [3, 2, 1]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    assert mean == 0.0 and per[0] == 1.0 and math.isnan(per[1]) and per[2] == -1.0
