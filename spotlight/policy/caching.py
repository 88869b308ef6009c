"""Step caching for exploration: diffusers' First Block Cache around one sampling call.

Exploration only has to *rank* candidate seeds, so it may run cheaper denoising than a rollout.
`sample(..., effective_steps=E)` skips evenly spaced steps (the naive baseline); this module gives
the adaptive rule the field uses. diffusers' own `FirstBlockCacheConfig` hooks (TeaCache's idea,
generalised by ParaAttention) work on `QwenImageTransformer2DModel` in diffusers 0.42: at every
model call the first transformer block always runs; when the relative mean-absolute change of its
residual since the last fully computed call is at most `threshold`, the remaining blocks are
skipped and their cached residual is added instead. Which steps are skipped is decided per call
from the data, not fixed in advance — steps where the model's input barely moved are the ones
reused. (A hand-written TeaCache rule would only be needed for a DiT class diffusers' hooks do not
cover: of the classes `spotlight.models.dit` supports, QwenImage and Flux have `enable_cache`;
SD3Transformer2DModel has none, and a threshold on it is a ConfigError.)

    with step_cache(model, threshold=0.1) as cached:
        x = sample_policy(cached, prompts, seeds, sampler, shape, init_seed=init)
    cached.stats.computed   # model calls that ran every block

The decision is made for the whole batch (one explore job = one prompt's candidates), so a job's
result depends only on the job — the "same batch, same bits" contract the runtime relies on. The
noise is untouched (it is a function of (seed, step) drawn by the sampler), so the seed -> sample
mapping is the same as without the cache. threshold None or 0 installs nothing: the samples are the
uncached sampler's, bit for bit.

The hooks live on the model's DiT only inside the `with` block (one sampling call at a time on a
model; not for concurrent use from several threads). Every sampling call starts by encoding its
prompts, and that starts a fresh cache, so several calls in one block never share a residual.

Knows the model and diffusers' hooks; nothing of seeds, rewards or the planner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from spotlight.errors import ConfigError

_CONTEXT = "explore"


@dataclass(slots=True)
class CacheStats:
    """What one cached sampling call computed."""

    calls: int = 0
    """`velocity` calls the sampler made."""
    computed: int = 0
    """Calls that ran every transformer block (the rest ran only the first block)."""
    blocks: int = 0
    """Transformer blocks in the DiT (a cached call costs ~1/blocks of a computed one, plus the
    embedding and output layers)."""

    @property
    def cached(self) -> int:
        return self.calls - self.computed

    @property
    def block_evaluations(self) -> int:
        """Transformer-block forwards run: the cost measure independent of the machine."""
        return self.computed * self.blocks + self.cached


class CachedModel:
    """`model` with a counting (and, with hooks installed, cached) `velocity`; everything else is
    the model's own. Made by `step_cache`; valid inside its `with` block."""

    def __init__(self, model, leader, blocks: int) -> None:
        self.model, self._leader = model, leader
        self.stats = CacheStats(blocks=blocks)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        self.stats.calls += 1
        if self._leader is None:
            self.stats.computed += 1
            return self.model.velocity(x, t, text)
        with self.model.dit.cache_context(_CONTEXT):
            v = self.model.velocity(x, t, text)
            self.stats.computed += bool(self._leader.state_manager.get_state().should_compute)
        return v

    def encode(self, prompts: list[str]):
        # a sampling call begins here: a residual cached for another batch must never be reused
        if self._leader is not None:
            self.model.dit._reset_stateful_cache()
        return self.model.encode(prompts)

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        from spotlight.policy.sampler import to_images

        return to_images(self.model, x)


def _transformer_blocks(dit) -> int:
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return sum(len(m) for name, m in dit.named_children()
               if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(m, torch.nn.ModuleList))


@contextmanager
def step_cache(model, threshold: float | None) -> Iterator[CachedModel]:
    """`model` with diffusers' First Block Cache at `threshold` on its DiT for the block's duration.

    threshold None or 0 = no cache (counting only). Needs a DiT class with diffusers' `enable_cache`
    and >= 2 transformer blocks. `stats` count over every sampling call made in the block.
    """
    dit = model.dit
    blocks = _transformer_blocks(dit)
    if not threshold:
        yield CachedModel(model, None, blocks)
        return
    if threshold < 0:
        raise ConfigError(f"explore cache threshold must be >= 0, got {threshold}")
    if blocks < 2:
        raise ConfigError(f"explore cache threshold {threshold}: first-block caching needs a DiT with >= 2 "
                          f"transformer blocks, this one has {blocks} (model.layers)")
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    if not hasattr(dit, "enable_cache"):
        raise ConfigError(f"explore cache threshold {threshold}: diffusers has no cache hooks for "
                          f"{type(dit).__name__} (model.dit_class); use effective steps instead")
    if dit.is_cache_enabled:
        raise RuntimeError(f"{type(dit).__name__} already has a cache enabled; step_cache is not reentrant")
    dit.enable_cache(FirstBlockCacheConfig(threshold=float(threshold)))
    try:
        leader = next(m._diffusers_hook.hooks[_FBC_LEADER_BLOCK_HOOK] for m in dit.modules()
                      if _FBC_LEADER_BLOCK_HOOK in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}))
        yield CachedModel(model, leader, blocks)
    finally:
        dit._reset_stateful_cache()
        dit.disable_cache()
