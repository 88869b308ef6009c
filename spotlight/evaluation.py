"""A run's evaluation: the sampler users deploy, on prompts never trained on — and what it costs.

Every evaluation reports:
- **ode_heldout** — the headline (`eval_reward`): the deterministic ODE sampler (`sampler.eval_steps`)
  on the held-out split of the run's prompt set (`spotlight.data.prompts.heldout_prompts`);
- **ode_train** — the same sampler on (the first 8 of) the training prompts, unseen seeds;
- **sde_train** — the rollout policy itself (the SDE sampler as trained) on the training prompts;
- **fm_loss** — the model's flow-matching loss on freshly rendered scenes of all evaluation prompts
  (a fixed batch: same scenes, noise and times at every evaluation, so values are paired), and
  `fm_drift` = fm_loss / the base's − 1: how far RL has moved the model away from drawing images.
Each reward is the mean over `run.eval_seeds` disjoint seed sets of `run.eval_samples` samples per
prompt; `*_std` is the spread over those sets; `*_parts` the constraints' mean scores and, for a
reward with a `shortfall` (the compositional one), `*_shortfall` the mean reward lost by cause
(they sum to 1 − the suite's reward). The first seed set's samples are saved as grids.

Knows the model, the sampler and the reward; not the loop, the trainer or the runtime.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from spotlight.data.prompts import eval_train_prompts, heldout_prompts
from spotlight.data.scenes import parse_caption, render
from spotlight.data.text import quoted_text, render_word
from spotlight.policy.sampler import sample_ode, sample_policy
from spotlight.policy.seeds import candidate_seeds
from spotlight.recipe import Recipe
from spotlight.report import MetricsLog, save_grid
from spotlight.rewards.base import to_uint8_images

EVAL_STREAM = 1_000  # seed stream of evaluation sets (training uses stream 0)
HELDOUT_OFFSET = 10_000  # held-out prompts' seed index offset: never the training prompts' seeds
FM_RENDERS = 8  # rendered scenes per evaluation prompt in the flow-matching drift probe
FM_SEED = 12_345


class Evaluator:
    """Evaluates the model it was given (whatever weights it holds when called)."""

    def __init__(self, model, recipe: Recipe, reward, out: Path):
        self.model, self.recipe, self.reward, self.out = model, recipe, reward, out
        from spotlight.work import image_shape

        c = recipe.model
        self.shape = image_shape(recipe)
        self.train = eval_train_prompts(recipe.run.prompts)
        self.heldout = heldout_prompts(recipe.run.prompts)
        # the drift probe renders pixel scenes: a latent-space pipeline model has none to compare
        self.fm_probe = None if c.pipeline is not None else fm_probe(self.train + self.heldout, c.shape[1:])
        self.base_fm = _base_fm(out / "metrics.jsonl")  # a resumed run keeps its base's value

    @torch.no_grad()
    def __call__(self, it: int, save_samples: bool = True) -> dict:
        t0 = time.monotonic()
        rec: dict = {"event": "eval", "iteration": it}
        suites = [
            ("ode_heldout", self.heldout, False, ""),
            ("ode_train", self.train, False, "_train"),
            ("sde_train", self.train, True, "_sde"),
        ]
        for name, prompts, sde, suffix in suites:
            if not prompts:
                continue  # prompt set 'all' has no held-out split
            per_set, parts, short, grid = self._suite(
                prompts, sde, offset=HELDOUT_OFFSET if name == "ode_heldout" else 0
            )
            rec[f"eval_{name}"] = float(np.mean(per_set))
            rec[f"eval_{name}_std"] = float(np.std(per_set))
            rec[f"eval_{name}_per_set"] = per_set
            if parts:
                rec[f"eval_{name}_parts"] = parts
            if short:
                rec[f"eval_{name}_shortfall"] = short
            if save_samples:
                save_grid(
                    grid,
                    self.out / "samples" / f"eval_{it:04d}{suffix}.png",
                    columns=self.recipe.run.eval_samples,
                )
        head = "ode_heldout" if self.heldout else "ode_train"
        rec.update(
            eval_reward=rec[f"eval_{head}"],
            eval_reward_std=rec[f"eval_{head}_std"],
            eval_per_seed_set=rec[f"eval_{head}_per_set"],
            eval_headline=head,
        )
        if self.fm_probe is not None:
            rec["fm_loss"] = self.fm_loss()
            if self.base_fm is None and it == 0:
                self.base_fm = rec["fm_loss"]
            if self.base_fm is not None:
                rec["fm_drift"] = rec["fm_loss"] / self.base_fm - 1
        rec["eval_s"] = time.monotonic() - t0
        return rec

    def _suite(
        self, prompts: list[str], sde: bool, offset: int
    ) -> tuple[list[float], dict[str, float], dict[str, float], np.ndarray]:
        """One suite over all seed sets: per-set mean reward, constraint means, the mean reward
        lost by cause (rewards with a `shortfall`), set 0's images."""
        r, s = self.recipe.run, self.recipe.sampler
        per_set, parts, short, grid = [], {}, {}, None
        for k in range(r.eval_seeds):
            batch = [p for p in prompts for _ in range(r.eval_samples)]
            seeds = [
                x
                for i in range(len(prompts))
                for x in candidate_seeds(r.seed, 0, offset + i, r.eval_samples, stream=EVAL_STREAM + k)
            ]
            if sde:  # the rollout policy: the sampler as trained, every option of SamplerConfig
                x = sample_policy(self.model, batch, seeds, s, self.shape)
            else:
                x = sample_ode(self.model, batch, seeds, s, self.shape)
            imgs = to_uint8_images(x)
            per_set.append(float(np.mean(self.reward(imgs, batch))))
            if k == 0:
                grid = imgs
            part_fn = getattr(self.reward, "parts", None)
            if part_fn is not None:
                for img, p in zip(imgs, batch):
                    for key, v in part_fn(img, p).items():
                        parts.setdefault(key.split(":")[-1], []).append(v)
            short_fn = getattr(self.reward, "shortfall", None)
            if short_fn is not None:
                for img, p in zip(imgs, batch):
                    for key, v in short_fn(img, p).items():
                        short[key] = short.get(key, 0.0) + v
        n = r.eval_seeds * len(prompts) * r.eval_samples
        return (
            per_set,
            {k: round(float(np.mean(v)), 4) for k, v in parts.items()},
            {k: round(v / n, 4) for k, v in short.items()},
            grid,
        )

    def fm_loss(self) -> float:
        """Flow-matching loss on the fixed probe batch (renders of the evaluation prompts)."""
        device = next(self.model.parameters()).device
        fm_x0, fm_eps, fm_t, prompts = self.fm_probe
        x0, eps, t = (v.to(device) for v in (fm_x0, fm_eps, fm_t))
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        v = self.model.velocity(xt, t, self.model.encode(prompts))
        return float((v - (eps - x0)).pow(2).mean())


def fm_probe(prompts: list[str], size: int | tuple[int, int], renders: int = FM_RENDERS, seed: int = FM_SEED):
    """A fixed flow-matching batch: `renders` rendered scenes (or words, for prompts with quoted text)
    per prompt ([N, 3, H, W] in [-1, 1]) on a `size` (square side, or (height, width)) canvas, with
    noise and times drawn as in pretraining (logit-normal t) from a fixed seed."""
    rng = random.Random(seed)
    height, width = (size, size) if isinstance(size, int) else size
    captions = [p for p in prompts for _ in range(renders)]
    imgs = np.stack([
        render_word(quoted_text(p), height, width) if '"' in p else render(parse_caption(p), height, rng)
        for p in captions
    ])
    x0 = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(x0.shape, generator=g)
    t = torch.sigmoid(torch.randn(len(captions), generator=g))
    return x0, eps, t, captions


def _base_fm(metrics: Path) -> float | None:
    for rec in MetricsLog(metrics).read():
        if rec.get("event") == "eval" and rec.get("iteration") == 0 and "fm_loss" in rec:
            return float(rec["fm_loss"])
    return None
