"""The GRPO update for flow-matching policies (Flow-GRPO formulation, DESIGN §6).

advantage = (r − mean of its prompt's group) / std of the group;
loss per step = −min(ρ·A, clip(ρ, 1±ε)·A) + β·KL(π_θ ‖ π_ref),  ρ = exp(log π_θ − log π_old).
Both policies' transitions are Gaussians with the same std, so the KL is ‖μ_θ − μ_ref‖²/(2σ²).
The reference is the base weights: a frozen copy under full fine-tuning, the adapter switched off
under LoRA.

`objective = "awm"` (advantage-weighted matching) replaces the policy gradient by the
flow-matching loss on each rollout's final image, weighted by its advantage (docs/LEARNING.md).

Gradients of the whole rollout batch are accumulated into each optimizer step (the rollout is
tiny next to Flow-GRPO's ~1k samples, so one noisy micro-batch per Adam step would turn noise into
full-size steps). Micro-batches are exactly the rollout's groups, so the first inner step
recomputes the sampler's log-probs bit for bit and ρ is exactly 1.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from spotlight.errors import ConfigError
from spotlight.parallel.fsdp import whole
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
    """Weight of the KL to the reference (base) policy; with `kl_target`, its starting value and floor."""
    kl_target: float = 0.0
    """Adaptive β (0 = β fixed): after each iteration β ← β·(1 + clip(kl / kl_target − 1, ±0.2)·n /
    kl_horizon), n the iteration's samples (the adaptive KL controller of Ziegler et al. 2019, verl's
    `kl_ctrl.type = "adaptive"`), never below `beta`: β rises while the policy's distance to the
    base is past the target and falls back once it is under (what it did on the demo's model:
    docs/LEARNING.md)."""
    kl_horizon: float = 10_000.0
    """Samples over which the adaptive β can change by a factor of ~e^0.2 (smaller = faster)."""
    adv_clip: float = 5.0
    adv_norm: str = "group"
    """What a group's centred rewards are divided by: 'group' — its own std (Flow-GRPO, DeepSeek's
    GRPO); 'batch' — the std of the whole iteration's centred rewards (Dr. GRPO's criticism of the
    per-group std; REINFORCE++'s global normalisation): a group whose samples differ by a sliver of
    shape credit then gets sliver-sized advantages instead of ±1, and a group where one sample
    misses an object keeps a large one (the two compared: docs/LEARNING.md)."""
    timestep_fraction: float = 0.5
    """Fraction of denoising steps trained per iteration (a random subset, seeded)."""
    updates_per_iteration: int = 1
    """Optimizer steps per iteration; the rollout batch is split evenly between them."""
    inner_epochs: int = 1
    max_grad_norm: float = 1.0
    warmup_iterations: int = 0
    """Linear lr warm-up over this many iterations (0 = none): Adam's first steps are ~lr·sign(g)
    for every weight, a full-size step in a mostly random direction."""
    decay_iterations: int = 0
    """Cosine lr decay from `lr` at iteration 0 to `lr·decay_to` at this iteration, held there after
    (0 = constant lr). Iterations, not minutes, so a resumed run and another machine follow it too."""
    decay_to: float = 0.1
    """The lr at the end of the decay, a fraction of `lr`."""
    finetune: str = "full"
    """'full' or 'lora'."""
    lora_rank: int = 8
    lora_alpha: float = 8.0
    objective: str = "grpo"
    """'grpo': the clipped policy gradient on the rollout's stochastic steps (Flow-GRPO). 'awm':
    advantage-weighted matching (AWM / DiffusionNFT): the flow-matching loss on each rollout's
    final image, re-noised to `awm_times` fresh times, weighted by its advantage — a positive
    sample's image is pulled in, a negative one's pushed away, at every noise level (the late ones
    where shapes form included) and independent of the sampler that drew it, so what it learns is
    what the deterministic sampler uses. β then weighs ‖v_θ − v_ref‖² on the same inputs."""
    awm_times: int = 2
    """Fresh noise levels per sample per iteration under objective 'awm'."""
    awm_time_dist: str = "logit_normal"
    """Times of the 'awm' loss: 'logit_normal' (pretraining's) or 'uniform' (the demo's; why:
    docs/LEARNING.md)."""
    awm_time_min: float = 0.0
    """Under 'awm', draw the times from [awm_time_min, 1] (the chosen distribution rescaled): 0 = all
    noise levels. The steps at high t lay the scene out: where objects go, how many, their boxes
    (what training only them did: docs/LEARNING.md)."""
    awm_rollout_noise: float = 0.0
    """Under 'awm', the fraction of the `awm_times` draws whose ε is the rollout's own x_1 — the
    noise that drew the image — instead of a fresh draw: x_t on the line from that noise to its
    image (rectified flow's 'reflow' coupling), so the loss at high t says which noise led to a
    good layout, where a fresh ε says only which layouts are good (measured: docs/LEARNING.md)."""
    awm_negative: float = 1.0
    """Weight of negative advantages under 'awm' (0 = learn from the better half only)."""
    awm_push_limit: float = 0.0
    """Under 'awm', stop pushing a below-average sample away once its flow-matching error exceeds
    the reference's on the same input by this fraction (0 = never stop): the push-away term has no
    floor of its own (its loss goes to −∞), and β resists it only in proportion."""
    ema_decay: float = 0.0
    """Exponential moving average of the weights, updated after every optimizer step (0 = off):
    the model evaluated, checkpointed and deployed is the average; rollouts use the online one."""
    awm_credit: str = "sample"
    """Under 'awm', whose advantage weights each pixel's flow-matching error: 'sample' (the image's
    group advantage, everywhere in it) or 'columns' (the rewards' per-column credit, centred per
    column over the group: `column_advantages`; the OCR reward's map says which letters are right,
    so a sample is pulled towards its right letters and away from its wrong ones, not towards or
    away from its whole word). A reward without a map gives its score at every column, which
    makes 'columns' the 'sample' weighting."""
    awm_shared_noise: bool = True
    """Under 'awm', every sample of a group is re-noised with the same (ε, t) draws: the
    advantages sum to zero, so the part of the loss's gradient that comes from (ε, t) rather
    than from the images cancels within the group (common random numbers)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"grpo.lr must be > 0, got {self.lr}")
        if self.clip_range <= 0:
            raise ConfigError(f"grpo.clip_range must be > 0, got {self.clip_range}")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta must be >= 0, got {self.beta}")
        if self.kl_target < 0:
            raise ConfigError(f"grpo.kl_target must be >= 0, got {self.kl_target}")
        if self.kl_target > 0 and self.beta <= 0:
            raise ConfigError("grpo.kl_target needs grpo.beta > 0 (the adaptive β starts there)")
        if self.kl_horizon <= 0:
            raise ConfigError(f"grpo.kl_horizon must be > 0, got {self.kl_horizon}")
        if not 0 < self.timestep_fraction <= 1:
            raise ConfigError(f"grpo.timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.warmup_iterations < 0:
            raise ConfigError(f"grpo.warmup_iterations must be >= 0, got {self.warmup_iterations}")
        if self.decay_iterations < 0:
            raise ConfigError(f"grpo.decay_iterations must be >= 0, got {self.decay_iterations}")
        if not 0 <= self.decay_to <= 1:
            raise ConfigError(f"grpo.decay_to must be in [0, 1], got {self.decay_to}")
        for name in ("updates_per_iteration", "inner_epochs", "lora_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"grpo.{name} must be >= 1, got {getattr(self, name)}")
        if self.finetune not in ("full", "lora"):
            raise ConfigError(f"grpo.finetune must be 'full' or 'lora', got {self.finetune!r}")
        if self.objective not in ("grpo", "awm"):
            raise ConfigError(f"grpo.objective must be 'grpo' or 'awm', got {self.objective!r}")
        if self.awm_credit not in ("sample", "columns"):
            raise ConfigError(f"grpo.awm_credit must be 'sample' or 'columns', got {self.awm_credit!r}")
        if self.awm_credit == "columns" and (self.objective != "awm" or self.awm_push_limit > 0):
            raise ConfigError("grpo.awm_credit = 'columns' needs objective 'awm' and awm_push_limit 0")
        if self.awm_push_limit < 0:
            raise ConfigError(f"grpo.awm_push_limit must be >= 0, got {self.awm_push_limit}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"grpo.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.awm_negative < 0:
            raise ConfigError(f"grpo.awm_negative must be >= 0, got {self.awm_negative}")
        if self.adv_norm not in ("group", "batch"):
            raise ConfigError(f"grpo.adv_norm must be 'group' or 'batch', got {self.adv_norm!r}")
        if self.awm_times < 1:
            raise ConfigError(f"grpo.awm_times must be >= 1, got {self.awm_times}")
        if self.awm_time_dist not in ("logit_normal", "uniform"):
            raise ConfigError(
                f"grpo.awm_time_dist must be 'logit_normal' or 'uniform', got {self.awm_time_dist!r}"
            )
        if not 0.0 <= self.awm_rollout_noise <= 1.0:
            raise ConfigError(f"grpo.awm_rollout_noise must be in [0, 1], got {self.awm_rollout_noise}")
        if not 0.0 <= self.awm_time_min < 1.0:
            raise ConfigError(f"grpo.awm_time_min must be in [0, 1), got {self.awm_time_min}")


@dataclass(slots=True)
class Group:
    """One prompt's rollout group, exactly as sampled (one batch)."""

    prompt: str
    seeds: list[int]
    latents: torch.Tensor  # [G, K+1, C, H, W]
    log_probs: torch.Tensor  # [G, K]
    rewards: torch.Tensor  # [G]
    credit: torch.Tensor | None = None  # [G, W]: where in each image its reward was earned (columns)


def _mean_over_ranks(stats: dict[str, list[float]], device) -> dict[str, float]:
    """Each statistic's mean over the values of every rank (an all-reduce of sums and counts)."""
    import torch.distributed as dist

    sums = torch.tensor([[sum(v), len(v)] for v in stats.values()], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return {k: float(s / n) if n else 0.0 for k, (s, n) in zip(stats, sums.tolist())}


def add_lora(model, cfg: GRPOConfig):
    """Attach the LoRA adapter `cfg` describes to the model's DiT (peft, through diffusers'
    ``add_adapter``); its weights are the trainable part under ``finetune = "lora"``. The one
    place the adapter is wired: the trainer, the workers and checkpoint loading all call it, so
    their ``state_dict`` keys match."""
    from peft import LoraConfig

    model.dit.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian",
                                     target_modules=getattr(model, "lora_targets", LORA_TARGETS)))
    for name, p in model.dit.named_parameters():  # the adapter trains in float32 over a bf16 base
        if ".lora_" in name:
            p.data = p.data.float()
    return model


def advantages(
    rewards: torch.Tensor, clip: float = 5.0, eps: float = 1e-4, std: float | None = None
) -> torch.Tensor:
    """Normalised advantages of one group's rewards [G]: centred on the group's mean, divided by
    `std` (default: the group's own); all-equal rewards give zeros."""
    r = rewards.double()
    centred = r - r.mean()
    scale = float(r.std(unbiased=False)) if std is None else std
    if scale <= 0:  # all-equal rewards (a group's own std is 0 exactly when it is)
        return torch.zeros_like(r).float()
    return (centred / (scale + eps)).clamp(-clip, clip).float()


def column_advantages(credit: torch.Tensor, width: int, clip: float = 5.0, eps: float = 1e-4) -> torch.Tensor:
    """Per-column advantages [G, width] of one group's per-column credit [G, W]: the map averaged
    down to ``width`` columns (a latent's, when the model works in a latent space), centred per
    column over the group, divided by the RMS of all the centred values (so a map that is each
    sample's reward at every column gives exactly ``advantages``); all-equal maps give zeros."""
    c = torch.nn.functional.adaptive_avg_pool1d(credit.double()[:, None, :], width)[:, 0]
    centred = c - c.mean(0, keepdim=True)
    scale = float(centred.pow(2).mean().sqrt())
    if scale <= 0:
        return torch.zeros_like(c).float()
    return (centred / (scale + eps)).clamp(-clip, clip).float()


def batch_std(groups: list[torch.Tensor]) -> float:
    """The std of every group's centred rewards together (`adv_norm = "batch"`)."""
    centred = torch.cat([g.double() - g.double().mean() for g in groups])
    return float(centred.pow(2).mean().sqrt())


def share(chunk: list[int], rank: int, world: int) -> list[tuple[int, float]]:
    """The (group index, weight) pairs rank `rank` of `world` trains for one optimizer step on
    `chunk`: every world-th group from its rank's position, weight 1, then as many weight-0
    repeats of the chunk's first group as it takes for every rank to run the same number of
    forward and backward passes (FSDP's all-gathers and reduce-scatters are collectives)."""
    mine = [(int(gi), 1.0) for gi in chunk[rank::world]]
    return mine + [(int(chunk[0]), 0.0)] * (-(-len(chunk) // world) - len(mine))


class GRPOTrainer:
    """Owns the optimizer and the reference policy; `update(groups)` runs one GRPO iteration.

    With a `device_mesh` (the ranks of a sharded trainer, `spotlight.parallel.trainer`), the
    model's DiT — and a full fine-tune's reference copy — are sharded over it with FSDP2
    (`spotlight.parallel.fsdp.shard`) before the optimizer is built: every rank then calls
    `update` with the same groups' rewards, trains its `share` of each optimizer step's groups
    (only those groups need their latents), and FSDP averages the gradients, which the per-group
    scale turns into the single-process sum. Without one it is the one-process trainer."""

    def __init__(self, model, cfg: GRPOConfig, sampler: SamplerConfig, seed: int = 0, device_mesh=None):
        self.model, self.cfg, self.sampler, self.seed = model, cfg, sampler, seed
        model.text.requires_grad_(False)  # the text encoder is frozen during RL
        if cfg.finetune == "lora":
            model.dit.requires_grad_(False)
            add_lora(model, cfg)
            self.reference = None
        else:
            referenced = cfg.beta > 0 or cfg.awm_push_limit > 0
            self.reference = copy.deepcopy(model).requires_grad_(False) if referenced else None
        self.rank, self.world = 0, 1
        self.mixed_precision = False
        """Sharded with bfloat16 compute over float32 shards (`spotlight.parallel.fsdp.shard`)."""
        if device_mesh is not None:
            from spotlight.parallel.fsdp import shard

            if cfg.ema_decay > 0:
                raise ConfigError("grpo.ema_decay > 0 is not supported by a sharded trainer")
            self.rank, self.world = device_mesh.get_local_rank(), device_mesh.size()
            self.mixed_precision = shard(model, device_mesh)
            if self.reference is not None:
                shard(self.reference, device_mesh)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.ema = copy.deepcopy(model).requires_grad_(False) if cfg.ema_decay > 0 else None
        self.iteration = 0
        self.beta = cfg.beta
        """The KL weight of the next update: `cfg.beta`, or the adaptive controller's value."""

    @property
    def deployed(self):
        """The model a user gets from this run: the moving average when there is one."""
        return self.ema if self.ema is not None else self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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

    def lr(self) -> float:
        """This iteration's lr: the warm-up's ramp times the cosine decay's factor."""
        cfg, it = self.cfg, self.iteration
        warm = min(1.0, (it + 1) / cfg.warmup_iterations) if cfg.warmup_iterations else 1.0
        decay = 1.0
        if cfg.decay_iterations:
            cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, it / cfg.decay_iterations)))
            decay = cfg.decay_to + (1 - cfg.decay_to) * cosine
        return cfg.lr * warm * decay

    def train_steps(self) -> list[int]:
        """The seeded random subset of denoising steps trained this iteration."""
        k = self.sampler.stochastic_steps  # ODE steps carry no action to train
        n = max(1, round(k * self.cfg.timestep_fraction))
        return sorted(random.Random(self.seed * 1_000_003 + self.iteration).sample(range(k), n))

    def plan(
        self, rewards: list[torch.Tensor], credits: list[torch.Tensor | None] | None = None
    ) -> tuple[list[torch.Tensor], list[int], list[np.ndarray]]:
        """Each group's advantages, the groups with a signal, and those split into the optimizer
        steps' chunks. A group has a signal when its rewards differ or — under ``awm_credit =
        'columns'`` — when its credit maps (``credits``; None for a group without one) differ at some
        column: samples that score the same with different letters wrong still say which letters
        are right. A group without either teaches nothing and is left out."""
        cfg = self.cfg
        std = batch_std(rewards) if cfg.adv_norm == "batch" else None
        advs = [advantages(r, cfg.adv_clip, std=std) for r in rewards]
        maps = credits if cfg.awm_credit == "columns" and credits is not None else [None] * len(rewards)
        live = [i for i, (a, c) in enumerate(zip(advs, maps))
                if a.abs().sum() > 0 or (c is not None and bool((c != c[:1]).any()))]
        chunks = [c for c in np.array_split(np.array(live, dtype=int), cfg.updates_per_iteration) if len(c)]
        return advs, live, chunks

    def needs(
        self, rewards: list[torch.Tensor], rank: int, credits: list[torch.Tensor | None] | None = None
    ) -> list[int]:
        """The groups (sorted indices) whose latents rank `rank` trains on in `update`."""
        return sorted({gi for c in self.plan(rewards, credits)[2] for gi, _ in share(c, rank, self.world)})

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One iteration's optimizer steps on `groups`. Sharded, every rank passes every group's
        rewards and the latents and log-probs of the groups it `needs` (the rest may be empty)."""
        cfg, steps = self.cfg, self.train_steps()
        advs, live, chunks = self.plan([g.rewards for g in groups], [g.credit for g in groups])
        stats: dict[str, list[float]] = {
            "loss": [],
            "ratio_dev": [],
            "clip_frac": [],
            "kl": [],
            "grad_norm": [],
            "update_norm": [],
            "push_stopped": [],
        }
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        for _epoch in range(cfg.inner_epochs):
            for chunk in chunks:
                self.opt.zero_grad(set_to_none=True)
                for gi, w in share(chunk, self.rank, self.world):
                    into = stats if w else {k: [] for k in stats}  # a weight-0 repeat reports nothing
                    if cfg.objective == "awm":
                        self._accumulate_awm(groups[gi], advs[gi], gi, w * self.world / len(chunk), into)
                    else:
                        scale = w * self.world / (len(chunk) * len(steps))
                        self._accumulate(groups[gi], advs[gi], steps, scale, into)
                norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
                stats["grad_norm"].append(float(whole(norm)))
                before = [p.detach().clone() for p in self.params]
                self.opt.step()
                # how far the weights moved: Adam turns tiny noisy gradients into full-size steps
                # unless lr / adam_eps keep it in check, so this is the number to watch
                moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(self.params, before)))
                stats["update_norm"].append(float(whole(moved)))
                if self.ema is not None:
                    with torch.no_grad():
                        for e, p in zip(self.ema.parameters(), self.model.parameters()):
                            e.lerp_(p, 1 - cfg.ema_decay)
        self.iteration += 1
        out = {k: float(np.mean(v)) if v else 0.0 for k, v in stats.items()}
        if self.world > 1:  # the per-step statistics of every rank's groups
            per_step = {k: v for k, v in stats.items() if k not in ("grad_norm", "update_norm")}
            out.update(_mean_over_ranks(per_step, self.device))
        out["groups_trained"] = float(len(live))
        out["groups_zero_var"] = float(len(groups) - len(live))
        out["beta"], out["lr"] = self.beta, self.opt.param_groups[0]["lr"]
        if cfg.kl_target > 0 and stats["kl"]:
            error = min(max(out["kl"] / cfg.kl_target - 1.0, -0.2), 0.2)
            samples = sum(len(g.seeds) for g in groups)
            self.beta = max(cfg.beta, self.beta * (1.0 + error * samples / cfg.kl_horizon))
        return out

    def _accumulate(self, g: Group, adv: torch.Tensor, steps: list[int], scale: float, stats) -> None:
        cfg, device = self.cfg, self.device
        text = self.model.encode([g.prompt] * len(g.seeds))
        adv = adv.to(device)
        for k in steps:  # groups live in host memory; one step's tensors go to the model's device
            x, x_next = g.latents[:, k].to(device), g.latents[:, k + 1].to(device)
            old = g.log_probs[:, k].to(device)
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
                loss = loss + self.beta * kl
            (loss * scale).backward()
            stats["loss"].append(loss.item())
            stats["ratio_dev"].append((ratio.detach() - 1).abs().max().item())
            stats["clip_frac"].append(((ratio.detach() - 1).abs() > cfg.clip_range).float().mean().item())
            stats["kl"].append(float(kl.detach()))

    def _accumulate_awm(self, g: Group, adv: torch.Tensor, index: int, scale: float, stats) -> None:
        """Advantage-weighted matching on one group: Σ_i A_i·‖v_θ(x_t) − (ε − x_0,i)‖² over its final
        images x_0,i re-noised to `awm_times` seeded (ε, t), + β·‖v_θ − v_ref‖² on the same x_t."""
        cfg = self.cfg
        x0 = g.latents[:, -1].to(self.device).clamp(-1, 1).repeat(cfg.awm_times, 1, 1, 1)
        adv = adv.to(self.device)
        a = torch.where(adv > 0, adv, cfg.awm_negative * adv).repeat(cfg.awm_times)
        gen = torch.Generator().manual_seed(
            int((self.seed * 1_000_003 + self.iteration) * 1_009 + int(index))
        )
        n = cfg.awm_times if cfg.awm_shared_noise else x0.shape[0]  # independent (ε, t) draws
        eps = torch.randn((n, *x0.shape[1:]), generator=gen).to(x0)
        if cfg.awm_time_dist == "logit_normal":
            t = torch.sigmoid(torch.randn(n, generator=gen)).to(x0)
        else:
            t = torch.rand(n, generator=gen).to(x0)
        t = cfg.awm_time_min + (1.0 - cfg.awm_time_min) * t
        if cfg.awm_shared_noise:  # x0 is [x0_1..x0_G] repeated awm_times: draw j for the j-th copy
            eps, t = eps.repeat_interleave(len(g.seeds), 0), t.repeat_interleave(len(g.seeds))
        own = round(cfg.awm_rollout_noise * cfg.awm_times)
        if own:  # the first copies re-noise each image with the noise its rollout started from
            x1 = g.latents[:, 0].to(x0).repeat(own, 1, 1, 1)
            eps = torch.cat([x1, eps[len(x1):]])
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        text = self.model.encode([g.prompt] * x0.shape[0])
        v = self.model.velocity(xt, t, text)
        err = (v - (eps - x0)).pow(2).flatten(1).mean(1)
        v_ref = None
        if cfg.beta > 0 or cfg.awm_push_limit > 0:
            with torch.no_grad(), self._reference() as ref:
                v_ref = ref.velocity(xt, t, ref.encode([g.prompt] * x0.shape[0]))
        if cfg.awm_push_limit > 0:  # pushed far enough: no further gradient from this sample
            err_ref = (v_ref - (eps - x0)).pow(2).flatten(1).mean(1)
            stop = (a < 0) & (err.detach() > (1 + cfg.awm_push_limit) * err_ref)
            a = torch.where(stop, torch.zeros_like(a), a)
            stats["push_stopped"].append(float(stop.float().mean()))
        if cfg.awm_credit == "columns":  # each pixel weighted by its column's advantage
            credit = g.credit if g.credit is not None else g.rewards[:, None].expand(-1, x0.shape[-1])
            amap = column_advantages(credit, x0.shape[-1]).to(x0).repeat(cfg.awm_times, 1)[:, None, None, :]
            amap = torch.where(amap > 0, amap, cfg.awm_negative * amap)
            loss = (amap * (v - (eps - x0)).pow(2)).mean()
        else:
            loss = (a * err).mean()
        kl = torch.zeros(())
        if cfg.beta > 0:
            kl = (v - v_ref).pow(2).flatten(1).mean(1).mean()
            loss = loss + self.beta * kl
        (loss * scale).backward()
        stats["loss"].append(loss.item())
        stats["ratio_dev"].append(0.0)
        stats["clip_frac"].append(0.0)
        stats["kl"].append(float(kl.detach()))
