"""Step caching for exploration: one of diffusers' cache hooks around one sampling call.

Exploration only has to *rank* candidate seeds, so it may denoise more cheaply than a rollout. A
`StepCache` names one of the caches diffusers ships as a public config, and `step_cache` installs
it on the model's DiT (`CacheMixin.enable_cache`) for the duration of a `with` block:

- ``fbc:T`` — `FirstBlockCacheConfig(threshold=T)` (TeaCache's idea, generalised by ParaAttention):
  at every model call the first transformer block runs; when the relative change of its residual
  since the last fully computed call is at most T, the other blocks are skipped and their cached
  residual is added instead. Which calls are reused is decided from the data.
- ``taylor:N`` — `TaylorSeerCacheConfig(cache_interval=N)`: after two warm-up calls, every block's
  attention runs once per N calls and is extrapolated (first-order Taylor) in between. Which calls
  are reused is fixed in advance.

MagCache (`MagCacheConfig`, present in diffusers 0.42.1) is not offered: it needs magnitude ratios
calibrated per checkpoint, and its calibrate mode only prints them (no public return value); the
policy's weights change every iteration, so each version would need a full-step calibration pass.

    with step_cache(model, StepCache.parse("fbc:0.2")) as cached:
        x = sample_policy(cached, prompts, seeds, sampler, shape, init_seed=init)
    cached.stats.computed   # model calls in which every block's attention ran

Invariants: the decision is made for the whole batch (one explore job), so a job's result depends
only on the job — "same batch, same bits". The noise is untouched (a function of (seed, step) drawn
by the sampler), so the seed -> sample mapping is the uncached one. `cache=None` installs nothing:
the samples are the uncached sampler's, bit for bit. Every sampling call starts from an empty cache
(the hooks are reinstalled when it encodes its prompts). The hooks live on the DiT only inside the
`with` block; one sampling call at a time on a model.

Knows the model and diffusers' public cache configs; nothing of seeds, rewards or the planner.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from spotlight.errors import ConfigError

KINDS = ("fbc", "taylor")
_SPEC = re.compile(r"^\s*([a-z]+)\s*:\s*([0-9.eE+-]+)\s*$")
_TAYLOR_WARMUP = 2  # the fewest fully computed calls a first-order expansion needs


@dataclass(frozen=True, slots=True)
class StepCache:
    """One step cache: ``fbc:T`` (first-block cache at threshold T > 0) or ``taylor:N`` (TaylorSeer,
    attention recomputed every N >= 1 calls)."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"step cache {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "fbc" and not self.value > 0:
            raise ValueError(f"fbc threshold must be > 0, got {self.value:g}")
        if self.kind == "taylor" and not (self.value >= 1 and float(self.value).is_integer()):
            raise ValueError(f"taylor interval must be an integer >= 1, got {self.value:g}")

    @classmethod
    def parse(cls, text: str) -> StepCache:
        m = _SPEC.match(text)
        if not m:
            raise ValueError(f"{text!r} is not 'fbc:THRESHOLD' or 'taylor:INTERVAL'")
        try:
            return cls(m[1], float(m[2]))
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.value:g}"

    def nominal_calls(self, steps: int) -> int:
        """Model calls of a `steps`-step sampling call that run every block's attention, before any
        measurement: TaylorSeer's fixed schedule (the warm-up calls, then every N-th, as diffusers
        0.42.1 decides it), and for ``fbc`` all of them (its reuse depends on the data)."""
        if self.kind == "fbc":
            return steps
        n = int(self.value)
        return sum(k < _TAYLOR_WARMUP or (k - _TAYLOR_WARMUP - 1) % n == 0 for k in range(steps))

    def config(self):
        """The diffusers config that `enable_cache` takes."""
        from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

        if self.kind == "fbc":
            return FirstBlockCacheConfig(threshold=float(self.value))
        return TaylorSeerCacheConfig(cache_interval=int(self.value), disable_cache_before_step=_TAYLOR_WARMUP,
                                     taylor_factors_dtype=torch.float32)


@dataclass(slots=True)
class CacheStats:
    """What the sampling calls of one `step_cache` block computed."""

    calls: int = 0
    """`velocity` calls the sampler made."""
    computed: int = 0
    """Calls in which every block's attention ran (the rest reused or predicted some)."""
    blocks: int = 0
    """Attention modules (one per transformer block) in the DiT."""
    attention: int = 0
    """Attention forwards that ran: the cost measure independent of the machine."""

    @property
    def cached(self) -> int:
        return self.calls - self.computed


class CachedModel:
    """`model` with a counting (and, with a cache installed, cached) `velocity`; everything else is
    the model's own. Made by `step_cache`; valid inside its `with` block."""

    def __init__(self, model, cache: StepCache | None, blocks: int) -> None:
        self.model, self.cache = model, cache
        self.stats = CacheStats(blocks=blocks)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        self.stats.calls += 1
        before = self.stats.attention
        if self.cache is None:
            v = self.model.velocity(x, t, text)
        else:
            with self.model.dit.cache_context("explore"):
                v = self.model.velocity(x, t, text)
        self.stats.computed += self.stats.attention - before == self.stats.blocks
        return v

    def encode(self, prompts: list[str]):
        # a sampling call begins here: nothing cached for another batch may be reused
        if self.cache is not None:
            self.model.dit.disable_cache()
            self.model.dit.enable_cache(self.cache.config())
        return self.model.encode(prompts)

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        from spotlight.policy.sampler import to_images

        return to_images(self.model, x)


@contextmanager
def step_cache(model, cache: StepCache | None) -> Iterator[CachedModel]:
    """`model` with `cache` installed on its DiT for the block's duration (None: counting only).

    Raises ConfigError when the DiT class has no diffusers cache hooks, or for ``fbc`` with fewer
    than 2 transformer blocks. `stats` count over every sampling call made in the block; the hooks
    come off when the block exits, also on an exception.
    """
    dit = model.dit
    # diffusers 0.42.1 has no public count of the calls a cache reused. A block's attention runs its
    # query projection only when it is computed, not when a cache reuses or predicts it, so a torch
    # forward hook there counts them (one on the attention module itself would fire either way:
    # diffusers' hooks replace `forward`, torch's hooks wrap the call).
    queries = [m for name, m in dit.named_modules() if name.endswith("attn.to_q")]
    if cache is not None:
        if not hasattr(dit, "enable_cache"):
            raise ConfigError(f"explore cache {cache.label}: diffusers has no cache hooks for "
                              f"{type(dit).__name__} (model.dit_class)")
        if cache.kind == "fbc" and len(queries) < 2:
            raise ConfigError(f"explore cache {cache.label}: first-block caching needs a DiT with >= 2 "
                              f"transformer blocks, this one has {len(queries)} (model.layers)")
        if dit.is_cache_enabled:
            raise RuntimeError(f"{type(dit).__name__} already has a cache enabled; step_cache is not "
                               "reentrant")
    cached = CachedModel(model, cache, len(queries))

    def count(*_) -> None:
        cached.stats.attention += 1

    handles = [q.register_forward_hook(count) for q in queries]
    try:
        if cache is not None:
            dit.enable_cache(cache.config())
        yield cached
    finally:
        for h in handles:
            h.remove()
        if cache is not None and dit.is_cache_enabled:
            dit.disable_cache()
