"""Pretrain the base model by flow matching on the synthetic compositional data set (or, with
`task = "text"`, on the text task's training words rendered on the model's canvas).

    spotlight pretrain --minutes 25 --out spotlight/assets/base.safetensors --seed 0
    spotlight pretrain --task text --minutes 60 --max-steps 2500 --batch-size 32 --seed 0 \
        --out clean.safetensors
    spotlight pretrain --task text --minutes 30 --max-steps 800 --batch-size 32 --seed 1 --lr 2e-4 \
        --misspell 0.4 --out spotlight/assets/ocr_base.safetensors 'model.checkpoint="clean.safetensors"'
                                   (the text-rendering base, two stages: docs/BENCHMARKS.md)

Trains the tiny DiT and the text encoder jointly on freshly rendered scenes of the whole caption
grammar, keeps an EMA of the weights, and saves the EMA model as one safetensors file. The base is
meant to be mediocre: it draws roughly the right scene but often misses count or position, so RL
has something to fix. Knows nothing of RL or the runtime.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from spotlight.data import text as text_task
from spotlight.data.scenes import VOCABULARY, random_scene, render
from spotlight.errors import ConfigError
from spotlight.models.dit import ModelConfig, build_model
from spotlight.parallel.device import resolve_device


@dataclass(kw_only=True, slots=True)
class PretrainConfig:
    """Flow-matching pretraining of the base model."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(checkpoint=None))
    task: str = "shapes"
    """shapes: rendered scenes of the caption grammar; text: training words of the text task
    (`spotlight.data.text`), rendered on the model's canvas."""
    minutes: float = 25.0
    """Wall-clock budget; training stops at this or `max_steps`, whichever comes first."""
    max_steps: int = 1_000_000
    batch_size: int = 64
    lr: float = 5e-4
    warmup_steps: int = 200
    min_lr_fraction: float = 0.05
    """The lr decays (cosine, over the wall-clock budget or `max_steps`, whichever is nearer) to this
    fraction of `lr`; 1 keeps it constant. A decayed lr sharpens edges the EMA alone leaves ragged."""
    ema_decay: float = 0.999
    seed: int = 0
    snapshot_minutes: float = 5.0
    """Also save `<out>.<minutes>m.safetensors` snapshots, to pick how mediocre the base is."""
    device: str = "auto"
    """auto | cpu | cuda, as `run.device`."""
    misspell: float = 0.0
    """text: each letter of a rendered word is drawn as its look-alike (R as P, `text_task.LOOKALIKE`)
    with this probability while its caption keeps the word — a base that confuses letters, as real
    text-to-image bases do, with its letters well formed. 0 renders every word as asked."""
    workers: int = 0
    """Processes rendering batches (0: this process, the CPU default). On a GPU the renderer, not
    the model, is the bottleneck (no benchmark table measures it; the H200 pretraining of the v3
    base used `--workers 6`: docs/REWARD.md, "What the base draws under this reward")."""

    def __post_init__(self) -> None:
        for name in ("minutes", "max_steps", "batch_size", "lr", "snapshot_minutes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"pretrain.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.min_lr_fraction <= 1:
            raise ConfigError(f"pretrain.min_lr_fraction must be in (0, 1], got {self.min_lr_fraction}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"pretrain.ema_decay must be in [0, 1), got {self.ema_decay}")
        _check_task(self.task)
        if not 0 <= self.misspell < 1:
            raise ConfigError(f"pretrain.misspell must be in [0, 1), got {self.misspell}")
        if self.misspell and self.task != "text":
            raise ConfigError(f"pretrain.misspell is for task text, got task {self.task!r}")
        if self.workers < 0:
            raise ConfigError(f"pretrain.workers must be >= 0, got {self.workers}")


TASKS = ("shapes", "text")

def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ConfigError(f"pretrain.task must be one of {', '.join(TASKS)}, got {task!r}")


TASK_MODELS: dict[str, dict[str, object]] = {
    "shapes": {},
    "text": {"image_size": 16, "image_width": 64, "text_embedding": "letter_place", "text_layers": 0},
}
"""The [model] fields each task's shipped base was pretrained with, beyond ModelConfig's defaults
(text: the `ocr` recipe's 16x64 strip, letters embedded as letter + place vectors, no text encoder
layer: each spelled letter's vector is its own, whatever the word)."""


def task_model(task: str, overrides: list[str] | None = None) -> ModelConfig:
    """The model `spotlight pretrain --task TASK` trains from scratch: the task's shipped base's
    shape (`TASK_MODELS`) with ``overrides`` (``model.field=value``) on top; ConfigError for an
    unknown task or a bad override."""
    from spotlight.recipe import load_recipe

    _check_task(task)
    return load_recipe({"model": {"checkpoint": None, **TASK_MODELS[task]}}, overrides).model


def misspelled(rng: random.Random, word: str, p: float) -> str:
    """`word` with each letter replaced, with probability `p`, by its look-alike
    (`text_task.LOOKALIKE`, e.g. P for R); `p` = 0 draws nothing from `rng`."""
    if p == 0:
        return word
    return "".join(text_task.LOOKALIKE[ch] if rng.random() < p else ch for ch in word)


def text_batch(rng: random.Random, n: int, height: int, width: int,
               misspell: float = 0.0) -> tuple[torch.Tensor, list[str]]:
    """`n` random training words of the text task rendered on a `height`x`width` canvas, each letter
    drawn wrong with probability `misspell` (`misspelled`); the captions ask for the words."""
    drawn = [text_task.random_prompt(rng) for _ in range(n)]
    imgs = np.stack([text_task.render_word(misspelled(rng, w, misspell), height, width) for _, w in drawn])
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, [p for p, _ in drawn]


def batch(rng: random.Random, n: int, size: int) -> tuple[torch.Tensor, list[str]]:
    scenes = [random_scene(rng) for _ in range(n)]
    imgs = np.stack([render(s, size, rng) for s in scenes])
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x, [s.caption() for s in scenes]


class _Batches(torch.utils.data.IterableDataset):
    """Endless batches ``make(rng)``; worker w of a DataLoader draws from its own seeded stream."""

    def __init__(self, seed: int, make) -> None:
        self.seed, self.make = seed, make

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = random.Random(self.seed * 1_000_003 + (info.id + 1 if info else 0))
        while True:
            yield self.make(rng)


def batches(cfg: PretrainConfig, size: int, pin: bool):
    """Training batches of the task (rendered scenes, or rendered training words): rendered here
    (workers = 0: the seeded stream of `batch` / `text_batch`), or by `cfg.workers` processes ahead
    of the trainer."""
    if cfg.task == "text":
        _, height, width = cfg.model.shape
        make = functools.partial(text_batch, n=cfg.batch_size, height=height, width=width,
                                 misspell=cfg.misspell)
    else:
        make = functools.partial(batch, n=cfg.batch_size, size=size)
    if cfg.workers == 0:
        rng = random.Random(cfg.seed)
        while True:
            yield make(rng)
    loader = torch.utils.data.DataLoader(
        _Batches(cfg.seed, make), batch_size=None, num_workers=cfg.workers,
        pin_memory=pin, prefetch_factor=4, persistent_workers=True,
    )
    yield from loader


def pretrain(cfg: PretrainConfig, out: Path, log=print) -> Path:
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    vocabulary = text_task.VOCABULARY if cfg.task == "text" else VOCABULARY
    model = build_model(cfg.model, vocabulary).to(device)
    ema = copy.deepcopy(model).requires_grad_(False)
    log(f"pretraining on {device}, batch {cfg.batch_size}, {cfg.workers} rendering processes")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    size = cfg.model.image_size
    start = time.monotonic()
    next_snapshot = cfg.snapshot_minutes
    losses: list[float] = []
    step = 0
    data = batches(cfg, size, pin=device.type == "cuda")
    while step < cfg.max_steps and (elapsed := (time.monotonic() - start) / 60) < cfg.minutes:
        x0, captions = next(data)
        x0 = x0.to(device, non_blocking=True)
        eps = torch.randn(x0.shape).to(device)  # drawn on the CPU: the same stream on every device
        t = torch.sigmoid(torch.randn(x0.shape[0])).to(device)  # logit-normal: mid-trajectory
        xt = (1 - t)[:, None, None, None] * x0 + t[:, None, None, None] * eps
        v = model.velocity(xt, t, model.encode(captions))
        loss = (v - (eps - x0)).pow(2).mean()
        done = max(elapsed / cfg.minutes, step / cfg.max_steps)  # fraction of the budget used
        lr_scale = cfg.min_lr_fraction + (1 - cfg.min_lr_fraction) * 0.5 * (
            1 + math.cos(math.pi * min(1.0, done))
        )
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * lr_scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(cfg.ema_decay, (1 + step) / (10 + step))  # warm-up: early EMA must not keep the init
        with torch.no_grad():  # torch 2.13: the multi-tensor lerp has only this underscore name
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)
        losses.append(loss.detach())  # no device sync per step
        step += 1
        if step % 100 == 0:
            losses = [float(x) for x in losses[-100:]]
            log(f"step {step} loss {np.mean(losses[-100:]):.4f} ({elapsed:.1f} min)")
        if elapsed >= next_snapshot:
            ema.save(out.with_suffix(f".{int(next_snapshot)}m.safetensors"), extra={"steps": step})
            next_snapshot += cfg.snapshot_minutes
    extra = {
        "steps": step,
        "minutes": (time.monotonic() - start) / 60,
        "final_loss": float(np.mean([float(x) for x in losses[-100:]])),
        "config": json.dumps(asdict(cfg)),
    }
    ema.save(out, extra=extra)
    log(f"saved {out} after {step} steps, loss {extra['final_loss']:.4f}")
    return out
