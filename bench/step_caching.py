# taskset -c 1 python bench/step_caching.py [--recipe tiny] [--prompts 8] [--candidates 16] [--rounds 1]
"""Which step cache should exploration use: model calls saved vs rank fidelity, against full steps.

The baseline is exploration at full steps (every one of `sampler.steps` model calls computed), as
the rollout policy samples. Side by side in one run, on the same candidate seeds (the demo's
training prompts, `--candidates` seeds each, the loop's shared initial noise), each of diffusers'
step caches the planner's arms can name (`spotlight.policy.caching.StepCache`):

- `fbc:T` — First Block Cache at several thresholds (reuse decided per call from the data);
- `taylor:N` — TaylorSeer, attention recomputed every N calls and extrapolated in between;
- MagCache at several thresholds, which is not an arm (its ratios are per checkpoint; see
  `spotlight.policy.caching`): here with ratios calibrated on the first prompt batch at full steps,
  i.e. the best it could do with one calibration pass per weights version.

Columns: model calls in which every block's attention ran (ratio to full), attention forwards run
(the machine-independent cost), CPU seconds of this process (one torch thread: unlike wall time,
not inflated by other jobs on a shared core), rank fidelity = mean over prompts of
Spearman(cached rewards, full-step rewards) of the same candidates, and what the selection keeps:
the share of the G/2 best + G/2 worst seeds that match the full-step selection, and the full-step
reward spread of the selected group relative to the full-step selection's spread (what GRPO gets).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight import work  # noqa: E402
from spotlight.data.prompts import prompt_set  # noqa: E402
from spotlight.loop import INIT_STREAM  # noqa: E402
from spotlight.policy.caching import StepCache, step_cache  # noqa: E402
from spotlight.policy.consistency import rank_consistency  # noqa: E402
from spotlight.policy.sampler import sample_policy  # noqa: E402
from spotlight.policy.seeds import candidate_seeds, select_contrast  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.rewards.base import to_uint8_images  # noqa: E402

CACHES = ("fbc:0.15", "fbc:0.2", "fbc:0.3", "fbc:0.5", "fbc:1",
          "taylor:2", "taylor:3", "taylor:4", "taylor:8")
MAG_THRESHOLDS = (0.06, 0.12, 0.25, 0.5)


@torch.no_grad()
def mag_ratios(model, recipe, batch) -> list[float]:
    """MagCache's per-step magnitude ratios for this model, computed as diffusers' calibrate mode
    does (mean over tokens of |residual_k| / |residual_k-1|, residual = the last block's image output
    minus the first block's input), on `batch`'s first prompt at full steps. diffusers 0.42.1's
    calibrate mode only prints them, so torch's public hooks take them here (QwenImage blocks)."""
    blocks, seen, ratios = model.dit.transformer_blocks, {}, []

    def head(module, args, kwargs):
        seen["in"] = kwargs["hidden_states"]

    def tail(module, args, kwargs, out):
        res = out[-1] - seen["in"]
        if "res" in seen:
            ratios.append(float((res.norm(dim=-1) / (seen["res"].norm(dim=-1) + 1e-8)).mean()))
        seen["res"] = res

    hooks = [blocks[0].register_forward_pre_hook(head, with_kwargs=True),
             blocks[-1].register_forward_hook(tail, with_kwargs=True)]
    prompt, seeds, init = batch[0]
    try:
        sample_policy(model, [prompt] * len(seeds), seeds, recipe.sampler, work.image_shape(recipe),
                      init_seed=init)
    finally:
        for h in hooks:
            h.remove()
    return [1.0, *ratios]


def jobs(recipe, n_prompts: int, candidates: int, rounds: int) -> list[tuple[str, list[int], int | None]]:
    r, prompts = recipe.run, prompt_set(recipe.run.prompts)[:n_prompts]
    out = []
    for it in range(rounds):
        for i, p in enumerate(prompts):
            shared = recipe.sampler.shared_init
            init = candidate_seeds(r.seed, it, i, 1, stream=INIT_STREAM)[0] if shared else None
            out.append((p, candidate_seeds(r.seed, it, i, candidates), init))
    return out


def explore(model, recipe, reward, batch, cache: StepCache | None = None) -> tuple[list, int, int, float]:
    """Rewards per prompt, computed calls, attention forwards and CPU seconds (sampling + reward)."""
    shape, scores, calls, attention = work.image_shape(recipe), [], 0, 0
    t0 = time.process_time()
    for prompt, seeds, init in batch:
        with step_cache(model, cache) as cached:
            x = sample_policy(cached, [prompt] * len(seeds), seeds, recipe.sampler, shape, init_seed=init)
        calls += cached.stats.computed
        attention += cached.stats.attention
        scores.append(np.asarray(reward(to_uint8_images(x), [prompt] * len(seeds)), dtype=np.float64))
    return scores, calls, attention, time.process_time() - t0


def selection(batch, full, scores, group: int) -> tuple[float, float]:
    """Share of the full-step selection kept, and the selected groups' full-step spread / the full
    selection's spread (both averaged over prompts)."""
    kept, spread = [], []
    for (_, seeds, _), f, s in zip(batch, full, scores):
        ref, sel = select_contrast(seeds, f, group), select_contrast(seeds, s, group)
        kept.append(len(set(ref) & set(sel)) / group)
        std = lambda chosen: float(np.std(f[[seeds.index(c) for c in chosen]]))  # noqa: E731
        spread.append(std(sel) / std(ref) if std(ref) > 0 else 1.0)
    return float(np.mean(kept)), float(np.mean(spread))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="seed sets per prompt (iterations' candidates)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    model, reward = work.policy_model(recipe), work.recipe_reward(recipe)
    batch = jobs(recipe, args.prompts, args.candidates, args.rounds)
    steps, group = recipe.sampler.steps, recipe.run.group_size

    explore(model, recipe, reward, batch[:1])  # warm-up: first-call allocations out of the timings
    full, calls0, attn0, sec0 = explore(model, recipe, reward, batch)

    print(f"{args.recipe}: {len(batch)} prompt batches x {args.candidates} candidates, {steps} steps, "
          f"G={group}; baseline = full steps (every model call computed)")
    head = (f"{'mode':<26}{'calls':>7}{'vs full':>9}{'attn':>8}{'vs full':>9}{'cpu s':>8}{'vs full':>9}"
            f"{'spearman':>10}{'kept':>7}{'spread':>8}")
    print(head)
    print("-" * len(head))
    print(f"{'full steps (baseline)':<26}{calls0:>7}{1:>8.3f}x{attn0:>8}{1:>8.3f}x{sec0:>8.2f}{1:>8.3f}x"
          f"{1:>10.3f}{1:>7.2f}{1:>8.3f}")
    from diffusers.hooks import MagCacheConfig

    ratios = mag_ratios(model, recipe, batch)
    mags = [(f"mag:{t:g} (calibrated)", MagCacheConfig(threshold=t, num_inference_steps=steps,
                                                        mag_ratios=ratios)) for t in MAG_THRESHOLDS]
    for name, config in [(c, StepCache.parse(c)) for c in CACHES] + mags:
        if isinstance(config, StepCache):
            scores, calls, attn, sec = explore(model, recipe, reward, batch, config)
        else:  # installed here, counted by step_cache; it resets itself after num_inference_steps calls
            model.dit.enable_cache(config)
            try:
                scores, calls, attn, sec = explore(model, recipe, reward, batch)
            finally:
                model.dit.disable_cache()
        rho, per = rank_consistency(scores, full)
        kept, spread = selection(batch, full, scores, group)
        print(f"{name:<26}{calls:>7}{calls / calls0:>8.3f}x{attn:>8}{attn / attn0:>8.3f}x{sec:>8.2f}"
              f"{sec / sec0:>8.3f}x{rho:>10.3f}{kept:>7.2f}{spread:>8.3f}")
    print("calls: model calls in which every block's attention ran; attn: attention forwards; spearman:\n"
          "mean over "
          "prompts vs full-step rewards; kept: share of the full-step G/2+G/2 selection chosen; spread:\n"
          "full-step reward std of the chosen group / that of the full-step selection")


if __name__ == "__main__":
    main()
