"""The GRPO update for flow-matching policies (Flow-GRPO formulation, DESIGN §6).

advantage = (r − mean of its prompt's group) / std of the group;
loss per step = −min(ρ·A, clip(ρ, 1±ε)·A) + β·KL(π_θ ‖ π_ref),  ρ = exp(log π_θ − log π_old).
Both policies' transitions are Gaussians with the same std, so the KL is ‖μ_θ − μ_ref‖²/(2σ²).
The reference is the base weights: a frozen copy under full fine-tuning, the adapter switched off
under LoRA.

Gradients of the whole rollout batch are accumulated into each optimizer step (the rollout is
tiny next to Flow-GRPO's ~1k samples, so one noisy micro-batch per Adam step would turn noise into
full-size steps). Micro-batches are exactly the rollout's groups, so the first inner step
recomputes the sampler's log-probs bit for bit and ρ is exactly 1.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass

import numpy as np
import torch

from spotlight.errors import ConfigError
from spotlight.policy.sampler import SamplerConfig, step_log_prob

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """The policy-gradient update."""

    lr: float = 1e-4
    adam_eps: float = 1e-8
    """Adam's epsilon; a larger value damps steps when gradients are tiny and noisy."""
    weight_decay: float = 0.0
    clip_range: float = 0.2
    """ε of the clipped importance ratio."""
    beta: float = 0.0
    """Weight of the KL to the reference (base) policy."""
    adv_clip: float = 5.0
    timestep_fraction: float = 0.5
    """Fraction of denoising steps trained per iteration (a random subset, seeded)."""
    updates_per_iteration: int = 1
    """Optimizer steps per iteration; the rollout batch is split evenly between them."""
    inner_epochs: int = 1
    max_grad_norm: float = 1.0
    finetune: str = "full"
    """'full' or 'lora'."""
    lora_rank: int = 8
    lora_alpha: float = 8.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"grpo.lr must be > 0, got {self.lr}")
        if self.clip_range <= 0:
            raise ConfigError(f"grpo.clip_range must be > 0, got {self.clip_range}")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta must be >= 0, got {self.beta}")
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"grpo.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        for name in ("updates_per_iteration", "inner_epochs", "lora_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"grpo.{name} must be >= 1, got {getattr(self, name)}")
        if self.finetune not in ("full", "lora"):
            raise ConfigError(f"grpo.finetune must be 'full' or 'lora', got {self.finetune!r}")


@dataclass(slots=True)
class Group:
    """One prompt's rollout group, exactly as sampled (one batch)."""

    prompt: str
    seeds: list[int]
    latents: torch.Tensor  # [G, K+1, C, H, W]
    log_probs: torch.Tensor  # [G, K]
    rewards: torch.Tensor  # [G]


def add_lora(model, cfg: GRPOConfig):
    """Attach the LoRA adapter `cfg` describes to the model's DiT (peft, through diffusers'
    ``add_adapter``); its weights are the trainable part under ``finetune = "lora"``. The one
    place the adapter is wired: the trainer, the workers and checkpoint loading all call it, so
    their ``state_dict`` keys match."""
    from peft import LoraConfig

    model.dit.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                                     target_modules=LORA_TARGETS))
    return model


def advantages(rewards: torch.Tensor, clip: float = 5.0, eps: float = 1e-4) -> torch.Tensor:
    """Group-normalised advantages of one group's rewards [G]; all-equal rewards give zeros."""
    r = rewards.double()
    std = r.std(unbiased=False)
    adv = (r - r.mean()) / (std + eps) if std > 0 else torch.zeros_like(r)
    return adv.clamp(-clip, clip).float()


class GRPOTrainer:
    """Owns the optimizer and the reference policy; `update(groups)` runs one GRPO iteration."""

    def __init__(self, model, cfg: GRPOConfig, sampler: SamplerConfig, seed: int = 0):
        self.model, self.cfg, self.sampler, self.seed = model, cfg, sampler, seed
        model.text.requires_grad_(False)  # the text encoder is frozen during RL
        if cfg.finetune == "lora":
            model.dit.requires_grad_(False)
            add_lora(model, cfg)
            self.reference = None
        else:
            self.reference = copy.deepcopy(model).requires_grad_(False) if cfg.beta > 0 else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.iteration = 0

    @contextlib.contextmanager
    def _reference(self):
        """The model to compute π_ref with: the frozen base copy, or the model with LoRA off."""
        if self.reference is not None:
            yield self.reference
        else:
            self.model.dit.disable_adapters()
            try:
                yield self.model
            finally:
                self.model.dit.enable_adapters()

    def train_steps(self) -> list[int]:
        """The seeded random subset of denoising steps trained this iteration."""
        k = self.sampler.stochastic_steps  # ODE steps carry no action to train
        n = max(1, round(k * self.cfg.timestep_fraction))
        return sorted(random.Random(self.seed * 1_000_003 + self.iteration).sample(range(k), n))

    def update(self, groups: list[Group]) -> dict[str, float]:
        cfg, steps = self.cfg, self.train_steps()
        advs = [advantages(g.rewards, cfg.adv_clip) for g in groups]
        live = [i for i, a in enumerate(advs) if a.abs().sum() > 0]  # zero-variance groups teach nothing
        stats: dict[str, list[float]] = {
            "loss": [],
            "ratio_dev": [],
            "clip_frac": [],
            "kl": [],
            "grad_norm": [],
            "update_norm": [],
        }
        chunks = [c for c in np.array_split(np.array(live, dtype=int), cfg.updates_per_iteration) if len(c)]
        for _epoch in range(cfg.inner_epochs):
            for chunk in chunks:
                self.opt.zero_grad(set_to_none=True)
                scale = 1.0 / (len(chunk) * len(steps))
                for gi in chunk:
                    self._accumulate(groups[gi], advs[gi], steps, scale, stats)
                norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
                stats["grad_norm"].append(float(norm))
                before = [p.detach().clone() for p in self.params]
                self.opt.step()
                # how far the weights moved: Adam turns tiny noisy gradients into full-size steps
                # unless lr / adam_eps keep it in check, so this is the number to watch
                stats["update_norm"].append(
                    float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(self.params, before))))
                )
        self.iteration += 1
        out = {k: float(np.mean(v)) if v else 0.0 for k, v in stats.items()}
        out["groups_trained"] = float(len(live))
        out["groups_zero_var"] = float(len(groups) - len(live))
        return out

    def _accumulate(self, g: Group, adv: torch.Tensor, steps: list[int], scale: float, stats) -> None:
        cfg = self.cfg
        text = self.model.encode([g.prompt] * len(g.seeds))
        for k in steps:
            x, x_next, old = g.latents[:, k], g.latents[:, k + 1], g.log_probs[:, k]
            lp, mean, std = step_log_prob(self.model, x, x_next, k, text, self.sampler)
            ratio = torch.exp(lp - old)
            unclipped = -adv * ratio
            clipped = -adv * ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)
            loss = torch.maximum(unclipped, clipped).mean()
            kl = torch.zeros(())
            if cfg.beta > 0:
                with torch.no_grad(), self._reference() as ref:
                    _, ref_mean, _ = step_log_prob(
                        ref, x, x_next, k, ref.encode([g.prompt] * len(g.seeds)), self.sampler
                    )
                kl = ((mean - ref_mean) ** 2).flatten(1).mean(1).mean() / (2 * std**2)
                loss = loss + cfg.beta * kl
            (loss * scale).backward()
            stats["loss"].append(loss.item())
            stats["ratio_dev"].append((ratio.detach() - 1).abs().max().item())
            stats["clip_frac"].append(((ratio.detach() - 1).abs() > cfg.clip_range).float().mean().item())
            stats["kl"].append(float(kl.detach()))
