"""Flow-matching samplers: ODE for evaluation, SDE with exact per-step log-probs for rollouts.

Flow-GRPO formulation (DESIGN §6). x_t = (1−t)·x_0 + t·ε, v ≈ ε − x_0, sampling from t=1 to 0.
One SDE step from t to t+Δt (Δt < 0):

    x' = x + [v + σ²/(2t)·(x + (1−t)·v)]·Δt + σ·√|Δt|·z,   σ = a·√(t/(1−t))

is a Gaussian transition with mean μ(x, t) and std σ·√|Δt|, so log p(x' | x) is exact.

`sde_type = "cps"` is the coefficients-preserving step (Wang & Yu 2025, used by recent Flow-GRPO
and MixGRPO versions): with x̂_0 = x − t·v and ε̂ = x + (1−t)·v,

    x' = (1−t')·x̂_0 + t'·(cos θ·ε̂ + sin θ·z),   θ = a·π/2,

so x' has exactly the noise level of time t' (the Flow-GRPO step over- or under-shoots it at
large |Δt|): explored states are states the ODE also visits, and what RL learns there carries over
to the deterministic sampler. With block noise only the block-constant part of ε̂ is rotated, and z
has the scale white noise has on that subspace (1/patch per pixel), so blocks stay invisible.

Noise is counter-based: the draw for step k of a sample depends only on (seed, k). A trajectory
resumed from its step-k state therefore ends bit-identical to the uninterrupted run — the
contract the preemption-aware scheduler relies on (DESIGN §5). A batch is one unit of work: the
same (prompts, seeds) batch gives the same bits; the runtime never splits or merges batches.

This module knows the math only; the model is anything with `velocity(x, t, text)` and `encode`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from spotlight.errors import ConfigError

_MASK64 = (1 << 64) - 1


@dataclass(kw_only=True, slots=True)
class SamplerConfig:
    """How rollouts and evaluation samples are drawn."""

    steps: int = 10
    """Denoising steps from t=1 to t=0."""
    noise_level: float = 0.7
    """a in σ_t = a·√(t/(1−t)): SDE exploration noise (0 would be the ODE)."""
    shift: float = 1.0
    """Time shift t' = s·t/(1+(s−1)·t); >1 spends more steps at high noise (SD3 uses 3)."""
    shift_terminal: float | None = None
    """Stretch the shifted schedule so its last non-zero time is this (diffusers'
    FlowMatchEulerDiscreteScheduler `shift_terminal`; Qwen-Image's scheduler uses 0.02)."""
    eval_steps: int = 20
    """ODE steps for evaluation samples."""
    sde_steps: int | None = None
    """Only the first `sde_steps` steps are stochastic (and trained); the rest are ODE steps.
    None = every step. Early steps decide a scene's layout; confining the noise there ties each
    sample's reward to few trainable decisions (the idea of Flow-GRPO-Fast / MixGRPO)."""
    noise_patch: int = 1
    """SDE noise is drawn once per noise_patch x noise_patch pixel block and channel (1 = per
    pixel). Block noise explores layouts instead of pixel grain and has fewer dimensions, so a
    policy-gradient estimate from few samples is far less noisy; log-probs stay exact densities of
    the block draws."""
    shared_init: bool = False
    """All samples of a group start from the same x_1 (DanceGRPO), so the reward differences in a
    group come from the policy's own stochastic steps, not from the untrainable initial noise."""
    sde_type: str = "flow"
    """'flow' (the Flow-GRPO SDE above) or 'cps' (coefficients-preserving: each stochastic step
    lands exactly on its time's noise level, with noise_level a in (0, 1] as the angle θ = a·π/2
    between predicted and fresh noise). 'cps' cannot make the last step stochastic (t'=0)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"sampler.steps must be >= 1, got {self.steps}")
        if self.eval_steps < 1:
            raise ConfigError(f"sampler.eval_steps must be >= 1, got {self.eval_steps}")
        if not 0 < self.noise_level <= 2:
            raise ConfigError(f"sampler.noise_level must be in (0, 2], got {self.noise_level}")
        if self.shift <= 0:
            raise ConfigError(f"sampler.shift must be > 0, got {self.shift}")
        if self.shift_terminal is not None and not 0 < self.shift_terminal < 1:
            raise ConfigError(f"sampler.shift_terminal must be in (0, 1), got {self.shift_terminal}")
        if self.noise_patch < 1:
            raise ConfigError(f"sampler.noise_patch must be >= 1, got {self.noise_patch}")
        if self.sde_steps is not None and not 1 <= self.sde_steps <= self.steps:
            raise ConfigError(
                f"sampler.sde_steps must be in [1, sampler.steps={self.steps}], got {self.sde_steps}"
            )
        if self.sde_type not in ("flow", "cps"):
            raise ConfigError(f"sampler.sde_type must be 'flow' or 'cps', got {self.sde_type!r}")
        if self.sde_type == "cps" and self.noise_level > 1:
            raise ConfigError(
                f"sampler.noise_level must be in (0, 1] with sde_type='cps', got {self.noise_level}"
            )
        if self.sde_type == "cps" and self.stochastic_steps >= self.steps:
            raise ConfigError(
                f"sampler.sde_steps must be < sampler.steps={self.steps} with sde_type='cps' "
                f"(the last step lands on t=0 and has no noise), got {self.sde_steps}"
            )

    @property
    def stochastic_steps(self) -> int:
        return self.steps if self.sde_steps is None else self.sde_steps


def timesteps(steps: int, shift: float = 1.0, terminal: float | None = None) -> torch.Tensor:
    """steps+1 times from 1 down to 0 (float64 for exact, device-independent arithmetic).

    The points are those of the diffusers flow-match pipelines (linspace(1, 1/steps) shifted, then
    0); `terminal` stretches the non-zero times so the last is `terminal` (`shift_terminal`)."""
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    t = shift * t / (1 + (shift - 1) * t)
    if terminal is not None and steps > 1:
        rest = 1 - t[:-1]
        t[:-1] = 1 - rest / (rest[-1] / (1 - terminal))
    return t


def to_images(model, x: torch.Tensor) -> torch.Tensor:
    """Images in [-1, 1] of final states x: the model's `decode` (a latent-space pipeline model),
    else x itself clamped (the pixel-space model)."""
    decode = getattr(model, "decode", None)
    return decode(x) if decode is not None else x.clamp(-1, 1)


def _mix(seed: int, counter: int) -> int:
    """splitmix64 of (seed, counter): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (counter + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def noise(seeds: list[int], counter: int, shape: tuple[int, ...], device=None) -> torch.Tensor:
    """Standard normal [B, *shape]; row i depends only on (seeds[i], counter).

    Drawn on the CPU so every backend sees the same bits. counter = -1 is the initial noise x_1,
    counter = k the SDE draw of step k.
    """
    g = torch.Generator()
    rows = []
    for s in seeds:
        g.manual_seed(_mix(int(s), counter))
        rows.append(torch.randn(shape, generator=g))
    return torch.stack(rows).to(device)


def sde_std(ts: torch.Tensor, k: int, noise_level: float) -> float:
    """σ_t·√|Δt| of step k. At t=1, σ uses t_1 in 1/(1−t), as Flow-GRPO does, to stay finite."""
    t, t_next = float(ts[k]), float(ts[k + 1])
    t_den = float(ts[1]) if t >= 1.0 else t
    sigma = noise_level * math.sqrt(t / (1 - t_den)) if t > 0 else 0.0
    return sigma * math.sqrt(abs(t_next - t))


def sde_mean(
    v: torch.Tensor, x: torch.Tensor, ts: torch.Tensor, k: int, noise_level: float, patch: int = 1
) -> torch.Tensor:
    """Mean of the Gaussian transition of step k given the velocity v at (x, t_k).

    x + (1−t)·v is the predicted noise ε̂ (= −t·score), so σ²/(2t)·ε̂ is the score correction
    that keeps the SDE's marginals equal to the ODE's. With block noise (patch > 1) the noise
    covariance is σ²·P, P the projection onto block-constant images, and the correction is
    projected the same way — otherwise the drift would damp detail that no noise puts back.
    """
    t, dt = float(ts[k]), float(ts[k + 1] - ts[k])
    t_den = float(ts[1]) if t >= 1.0 else t
    sigma2 = noise_level**2 * t / (1 - t_den) if t > 0 else 0.0
    eps_hat = x + (1 - t) * v
    if patch > 1:
        eps_hat = block_project(eps_hat, patch)
    return x + (v + sigma2 / (2 * t) * eps_hat) * dt


def cps_transition(
    v: torch.Tensor, x: torch.Tensor, ts: torch.Tensor, k: int, noise_level: float, patch: int = 1
) -> tuple[torch.Tensor, float]:
    """Mean and std (per block draw) of the coefficients-preserving step k (module docstring)."""
    t, t_next = float(ts[k]), float(ts[k + 1])
    theta = noise_level * math.pi / 2
    x0_hat, eps_hat = x - t * v, x + (1 - t) * v
    coarse = block_project(eps_hat, patch) if patch > 1 else eps_hat
    mean = (1 - t_next) * x0_hat + t_next * (eps_hat - (1 - math.cos(theta)) * coarse)
    return mean, t_next * math.sin(theta) / patch


def transition(
    v: torch.Tensor,
    x: torch.Tensor,
    ts: torch.Tensor,
    k: int,
    noise_level: float,
    patch: int = 1,
    sde_type: str = "flow",
) -> tuple[torch.Tensor, float]:
    """Mean and std of stochastic step k's Gaussian transition, for either SDE."""
    if sde_type == "cps":
        return cps_transition(v, x, ts, k, noise_level, patch)
    return sde_mean(v, x, ts, k, noise_level, patch), sde_std(ts, k, noise_level)


def block_project(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Orthogonal projection of [B, C, H, W] onto images constant over patch x patch blocks."""
    avg = torch.nn.functional.avg_pool2d(x, patch)
    return avg.repeat_interleave(patch, 2).repeat_interleave(patch, 3)


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: float, patch: int = 1) -> torch.Tensor:
    """log N(x_next; mean, std²) averaged over all non-batch dims (Flow-GRPO's per-step log-prob).

    With block noise (patch > 1) the density is that of the block draws: the block means of
    x_next − mean are std·z exactly.
    """
    r = x_next.detach() - mean
    if patch > 1:
        r = torch.nn.functional.avg_pool2d(r, patch)
    lp = -(r**2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def sde_noise(seeds: list[int], k: int, shape: tuple[int, ...], patch: int = 1, device=None) -> torch.Tensor:
    """The SDE draw of step k: per pixel, or one value per patch x patch block, repeated over it."""
    if patch == 1:
        return noise(seeds, k, shape, device)
    c, h, w = shape
    z = noise(seeds, k, (c, h // patch, w // patch), device)
    return z.repeat_interleave(patch, 2).repeat_interleave(patch, 3)  # block-constant


@dataclass(slots=True)
class RolloutState:
    """A batch's state between steps: what a worker commits and another resumes from."""

    x: torch.Tensor  # current latent x_{t_k}, [B, C, H, W]
    step: int  # next step to run (0..steps)
    latents: list[torch.Tensor]  # x_{t_0} .. x_{t_k}
    log_probs: list[torch.Tensor]  # log p of steps 0 .. k-1, each [B]


def initial_noise(seeds: list[int], shape, device=None, init_seed: int | None = None) -> torch.Tensor:
    """x_1 of a batch: per-sample from `seeds`, or one shared draw from `init_seed`."""
    return noise(seeds if init_seed is None else [init_seed] * len(seeds), -1, shape, device)


def start(
    seeds: list[int], shape: tuple[int, ...], device=None, init_seed: int | None = None
) -> RolloutState:
    x = initial_noise(seeds, shape, device, init_seed)
    return RolloutState(x=x, step=0, latents=[x], log_probs=[])


@torch.no_grad()
def sde_advance(model, state: RolloutState, text, seeds: list[int], cfg: SamplerConfig) -> RolloutState:
    """Run one SDE step on `state` (in place) and return it."""
    ts = timesteps(cfg.steps, cfg.shift, cfg.shift_terminal)
    k, x = state.step, state.x
    t = torch.full((x.shape[0],), float(ts[k]), dtype=x.dtype, device=x.device)
    v = model.velocity(x, t, text)
    if k < cfg.stochastic_steps:
        mean, std = transition(v, x, ts, k, cfg.noise_level, cfg.noise_patch, cfg.sde_type)
        x_next = mean + std * sde_noise(seeds, k, tuple(x.shape[1:]), cfg.noise_patch, x.device).to(x.dtype)
        state.log_probs.append(gaussian_log_prob(x_next, mean, std, cfg.noise_patch))
    else:  # a deterministic ODE step: no action to train, log-prob recorded as 0
        x_next = x + v * float(ts[k + 1] - ts[k])
        state.log_probs.append(torch.zeros(x.shape[0], dtype=x.dtype, device=x.device))
    state.latents.append(x_next)
    state.x, state.step = x_next, k + 1
    return state


def sde_rollout(
    model,
    prompts: list[str],
    seeds: list[int],
    cfg: SamplerConfig,
    shape,
    state=None,
    on_step=None,
    init_seed: int | None = None,
):
    """Full SDE rollout of one batch, optionally resumed from `state`; `on_step(state)` after each step.

    Returns the final state: latents [steps+1] and log-probs [steps] of the whole trajectory.
    """
    text = model.encode(prompts)
    state = state or start(seeds, shape, _device(model), init_seed)
    while state.step < cfg.steps:
        sde_advance(model, state, text, seeds, cfg)
        if on_step is not None:
            on_step(state)
    return state


def step_log_prob(model, x: torch.Tensor, x_next: torch.Tensor, k: int, text, cfg: SamplerConfig):
    """log p_θ(x_next | x) of step k, and the transition mean (for the KL term). Differentiable."""
    ts = timesteps(cfg.steps, cfg.shift, cfg.shift_terminal)
    t = torch.full((x.shape[0],), float(ts[k]), dtype=x.dtype, device=x.device)
    mean, std = transition(
        model.velocity(x, t, text), x, ts, k, cfg.noise_level, cfg.noise_patch, cfg.sde_type
    )
    return gaussian_log_prob(x_next, mean, std, cfg.noise_patch), mean, std


@torch.no_grad()
def sample(
    model,
    prompts: list[str],
    seeds: list[int],
    shape,
    steps: int = 20,
    shift: float = 1.0,
    noise_level: float | None = None,
    sde_steps: int | None = None,
    init_seed: int | None = None,
    noise_patch: int = 1,
    sde_type: str = "flow",
    start: tuple[int, torch.Tensor] | None = None,
    between_steps: Callable[[int], None] | None = None,
    shift_terminal: float | None = None,
) -> torch.Tensor:
    """Final images [B, C, H, W] in [-1, 1] (`to_images`) without recording the trajectory.

    `between_steps(k)` is called after step k (1-based) of every step run; an exception it raises
    ends the sampling there (a cancelled exploration).

    `start` = (k, x): begin at step k from the latent x (at time timesteps(steps, shift)[k])
    instead of from the seeds' x_1 — SDEdit, and bench/redraw.py's redraws of noised renders.

    noise_level None = deterministic Euler ODE (evaluation); a float = the rollout SDE with the same
    (seed, k) draws as `sde_rollout`, so a seed explored here predicts that seed's rollout.
    """
    ts = timesteps(steps, shift, shift_terminal)
    text = model.encode(prompts)
    k0, x = start if start is not None else (0, initial_noise(seeds, shape, _device(model), init_seed))
    if not 0 <= k0 <= steps:
        raise ValueError(f"start step must be in [0, {steps}], got {k0}")
    stochastic = steps if sde_steps is None else sde_steps
    for k in range(k0, steps):
        t = torch.full((x.shape[0],), float(ts[k]), dtype=x.dtype, device=x.device)
        v = model.velocity(x, t, text)
        if noise_level is None or k >= stochastic:
            x = x + v * float(ts[k + 1] - ts[k])
        else:
            z = sde_noise(seeds, k, tuple(x.shape[1:]), noise_patch, x.device).to(x.dtype)
            mean, std = transition(v, x, ts, k, noise_level, noise_patch, sde_type)
            x = mean + std * z
        if between_steps is not None:
            between_steps(k + 1)
    return to_images(model, x)


def sample_policy(
    model,
    prompts: list[str],
    seeds: list[int],
    cfg: SamplerConfig,
    shape,
    *,
    init_seed: int | None = None,
    between_steps: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The rollout policy's final samples (the SDE `cfg` describes) without recording the trajectory:
    what exploration scores and the SDE evaluation draws. Every sampler setting comes from `cfg`;
    `between_steps` as in `sample`."""
    return sample(
        model,
        prompts,
        seeds,
        shape,
        cfg.steps,
        cfg.shift,
        noise_level=cfg.noise_level,
        sde_steps=cfg.sde_steps,
        init_seed=init_seed,
        noise_patch=cfg.noise_patch,
        sde_type=cfg.sde_type,
        between_steps=between_steps,
        shift_terminal=cfg.shift_terminal,
    )


def sample_ode(model, prompts: list[str], seeds: list[int], cfg: SamplerConfig, shape) -> torch.Tensor:
    """The deterministic sampler users deploy: `cfg.eval_steps` Euler steps of the flow ODE."""
    return sample(model, prompts, seeds, shape, cfg.eval_steps, cfg.shift, shift_terminal=cfg.shift_terminal)


def _device(model) -> torch.device:
    return next(model.parameters()).device
