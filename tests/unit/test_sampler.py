"""Sampler contracts: counter-based noise, resume from step k is bit-identical, exact log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from spotlight.errors import ConfigError
from spotlight.policy import sampler as S

SHAPE = (3, 16, 16)


def test_noise_depends_only_on_seed_and_counter():
    a = S.noise([7, 8], 3, SHAPE)
    torch.randn(100)  # global RNG traffic must not matter
    b = S.noise([9, 7], 3, SHAPE)
    assert torch.equal(a[0], b[1])
    assert not torch.equal(a[0], S.noise([7], 4, SHAPE)[0])
    assert not torch.equal(a[0], a[1])


def test_same_seed_same_trajectory(tiny_model):
    cfg = S.SamplerConfig(steps=4)
    one = S.sde_rollout(tiny_model, ["two red circles"] * 2, [1, 2], cfg, SHAPE)
    two = S.sde_rollout(tiny_model, ["two red circles"] * 2, [1, 2], cfg, SHAPE)
    assert all(torch.equal(x, y) for x, y in zip(one.latents, two.latents))
    other = S.sde_rollout(tiny_model, ["two red circles"] * 2, [1, 3], cfg, SHAPE)
    assert torch.equal(one.latents[-1][0], other.latents[-1][0]) and not torch.equal(
        one.latents[-1][1], other.latents[-1][1]
    )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_resume_from_step_k_is_bit_identical(tiny_model, k):
    cfg = S.SamplerConfig(steps=4)
    prompts, seeds = ["a red circle to the left of a blue square"] * 3, [11, 12, 13]
    full = S.sde_rollout(tiny_model, prompts, seeds, cfg, SHAPE)
    # run to step k, "commit" a copy of the state, then resume it in a fresh call
    text = tiny_model.encode(prompts)
    st = S.start(seeds, SHAPE)
    for _ in range(k):
        S.sde_advance(tiny_model, st, text, seeds, cfg)
    committed = S.RolloutState(
        x=st.x.clone(),
        step=st.step,
        latents=[x.clone() for x in st.latents],
        log_probs=[lp.clone() for lp in st.log_probs],
    )
    torch.randn(1000)
    resumed = S.sde_rollout(tiny_model, prompts, seeds, cfg, SHAPE, state=committed)
    assert torch.equal(resumed.latents[-1], full.latents[-1])
    assert all(torch.equal(a, b) for a, b in zip(resumed.log_probs, full.log_probs))


def test_log_prob_matches_direct_gaussian_density(tiny_model):
    cfg = S.SamplerConfig(steps=5, noise_level=0.8)
    prompts, seeds = ["three green triangles"] * 2, [3, 4]
    st = S.sde_rollout(tiny_model, prompts, seeds, cfg, SHAPE)
    ts = S.timesteps(cfg.steps)
    text = tiny_model.encode(prompts)
    for k in range(cfg.steps):
        x, x_next = st.latents[k], st.latents[k + 1]
        t = torch.full((2,), float(ts[k]))
        with torch.no_grad():
            mean = S.sde_mean(tiny_model.velocity(x, t, text), x, ts, k, cfg.noise_level)
        std = S.sde_std(ts, k, cfg.noise_level)
        direct = torch.distributions.Normal(mean.double(), std).log_prob(x_next.double()).flatten(1).mean(1)
        assert torch.allclose(st.log_probs[k].double(), direct, atol=1e-4), k
    # std follows σ_t = a·sqrt(t/(1-t)) · sqrt(|Δt|) away from t=1
    assert math.isclose(S.sde_std(ts, 2, 0.8), 0.8 * math.sqrt(0.6 / 0.4) * math.sqrt(0.2), rel_tol=1e-9)


def test_ode_is_deterministic(tiny_model):
    prompts, seeds = ["a blue square"] * 2, [5, 6]
    a = S.sample(tiny_model, prompts, seeds, SHAPE, steps=6)
    b = S.sample(tiny_model, prompts, seeds, SHAPE, steps=6)
    assert torch.equal(a, b) and a.abs().max() <= 1


def test_start_resumes_the_ode_from_a_given_step_and_latent(tiny_model):
    """sample(start=(k, x)): the same Euler steps k..steps-1 as a full sample whose step-k latent is
    x — started from the full sample's own step-k latent it ends bit-identical; a bad k is refused."""
    prompts, seeds = ["a blue square"] * 2, [5, 6]
    ts, text = S.timesteps(6), tiny_model.encode(prompts)
    x = S.initial_noise(seeds, SHAPE)
    with torch.no_grad():
        for k in range(2):
            x = x + tiny_model.velocity(x, torch.full((2,), float(ts[k])), text) * float(ts[k + 1] - ts[k])
        full = S.sample(tiny_model, prompts, seeds, SHAPE, steps=6)
        resumed = S.sample(tiny_model, prompts, [0, 0], SHAPE, steps=6, start=(2, x))
    assert torch.equal(resumed, full)
    with pytest.raises(ValueError, match="start step"):
        S.sample(tiny_model, prompts, seeds, SHAPE, steps=6, start=(7, x))


def test_sampler_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="sampler.steps"):
        S.SamplerConfig(steps=0)
    with pytest.raises(ConfigError, match="noise_level"):
        S.SamplerConfig(noise_level=-1)


@pytest.mark.parametrize("patch", [1, 4])
def test_cps_step_lands_on_its_noise_level_with_exact_log_probs(tiny_model, patch):
    """Coefficients-preserving SDE: x' = (1−t')x̂0 + t'(cos θ ε̂ + sin θ z) on the block subspace,
    log-prob = the exact density of the block draws, resume bit-identical, ODE when θ → 0."""
    cfg = S.SamplerConfig(steps=4, sde_steps=3, noise_level=0.5, noise_patch=patch, sde_type="cps")
    prompts, seeds = ["two red circles"] * 2, [21, 22]
    st = S.sde_rollout(tiny_model, prompts, seeds, cfg, SHAPE)
    ts, text = S.timesteps(cfg.steps), tiny_model.encode(prompts)
    for k in range(cfg.sde_steps):
        x, x_next = st.latents[k], st.latents[k + 1]
        t, t_next = float(ts[k]), float(ts[k + 1])
        with torch.no_grad():
            v = tiny_model.velocity(x, torch.full((2,), t), text)
        x0_hat, eps_hat = x - t * v, x + (1 - t) * v
        z = S.sde_noise(seeds, k, SHAPE, patch) / patch  # white noise's scale on the block subspace
        coarse = S.block_project(eps_hat, patch) if patch > 1 else eps_hat
        theta = 0.5 * math.pi / 2
        expect = (1 - t_next) * x0_hat + t_next * (
            eps_hat - coarse + math.cos(theta) * coarse + math.sin(theta) * z
        )
        assert torch.allclose(x_next, expect, atol=1e-5), k
        std = t_next * math.sin(theta) / patch
        r = torch.nn.functional.avg_pool2d((x_next - (expect - t_next * math.sin(theta) * z)).double(), patch)
        direct = torch.distributions.Normal(0.0, std).log_prob(r).flatten(1).mean(1)
        assert torch.allclose(st.log_probs[k].double(), direct, atol=1e-4), k
    # resume from a committed step: bit-identical
    part = S.start(seeds, SHAPE)
    for _ in range(2):
        S.sde_advance(tiny_model, part, text, seeds, cfg)
    resumed = S.sde_rollout(tiny_model, prompts, seeds, cfg, SHAPE, state=part)
    assert torch.equal(resumed.latents[-1], st.latents[-1])
    # the explore sampler draws the same trajectory as the rollout
    x = S.sample(
        tiny_model, prompts, seeds, SHAPE, 4, noise_level=0.5, sde_steps=3, noise_patch=patch, sde_type="cps"
    )
    assert torch.allclose(x, st.latents[-1].clamp(-1, 1), atol=1e-6)
    # a vanishing angle is the ODE
    tiny_cfg = S.SamplerConfig(steps=4, sde_steps=3, noise_level=1e-9, noise_patch=patch, sde_type="cps")
    near_ode = S.sde_rollout(tiny_model, prompts, seeds, tiny_cfg, SHAPE).latents[-1]
    assert torch.allclose(near_ode.clamp(-1, 1), S.sample(tiny_model, prompts, seeds, SHAPE, 4), atol=1e-5)


def test_cps_config_is_validated():
    with pytest.raises(ConfigError, match="sde_type"):
        S.SamplerConfig(sde_type="ddim")
    with pytest.raises(ConfigError, match="noise_level"):
        S.SamplerConfig(sde_type="cps", noise_level=1.5, sde_steps=2)
    with pytest.raises(ConfigError, match="sde_steps"):
        S.SamplerConfig(sde_type="cps", steps=4)  # every step stochastic: the last one lands on t=0
