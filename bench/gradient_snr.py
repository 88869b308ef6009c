# python bench/gradient_snr.py [recipe overrides ...]   e.g.  sampler.noise_patch=8 sampler.sde_steps=2
"""How much signal is in one iteration's policy gradient? Cosine between independent estimates.

Computes the GRPO gradient (ratio 1, no step taken) of the shipped base on three independent
rollout batches of the recipe's prompts (random seeds, same weights) and prints the pairwise
cosines. ~0 means the estimate is noise at this batch size and no optimizer can learn from it;
this is the measurement behind docs/LEARNING.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spotlight.comm.messages import RolloutWork  # noqa: E402
from spotlight.loop import Loop  # noqa: E402
from spotlight.policy.grpo import advantages  # noqa: E402
from spotlight.policy.seeds import candidate_seeds  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402


def gradient(loop: Loop, iteration: int) -> tuple[torch.Tensor, float]:
    prompts, r = loop.prompts, loop.recipe.run
    inits = loop.init_seeds(iteration, prompts)
    jobs = [
        RolloutWork(
            prompt=p,
            seeds=candidate_seeds(r.seed, iteration, i, r.group_size),
            version=loop.version,
            init_seed=init,
        )
        for i, (p, init) in enumerate(zip(prompts, inits))
    ]
    groups = loop.executor.rollout(f"snr{iteration}", jobs).result()
    tr = loop.trainer
    tr.opt.zero_grad(set_to_none=True)
    steps = list(range(loop.recipe.sampler.stochastic_steps))
    stats: dict[str, list] = {k: [] for k in ("loss", "ratio_dev", "clip_frac", "kl")}
    for g in groups:
        tr._accumulate(g, advantages(g.rewards), steps, 1.0 / (len(groups) * len(steps)), stats)
    flat = torch.cat([p.grad.flatten() for p in tr.params if p.grad is not None]).clone()
    return flat, float(torch.stack([g.rewards for g in groups]).std(1).mean())


def main() -> None:
    overrides = sys.argv[1:]
    loop = Loop(load_recipe("tiny", ["explore.schedule=off", *overrides]), progress=False)
    grads = []
    for it in range(3):
        g, spread = gradient(loop, 100 + it)
        grads.append(g)
        print(
            f"batch {it}: {len(loop.prompts) * loop.recipe.run.group_size} samples, "
            f"group spread {spread:.3f}, "
            f"|grad| {float(g.norm()):.4f}"
        )
    cos = [
        float(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0))
        for i in range(3)
        for j in range(i + 1, 3)
    ]
    print(f"overrides: {' '.join(overrides) or '-'}")
    print(
        f"pairwise cosine of independent gradient estimates: {np.round(cos, 3).tolist()} "
        f"(mean {np.mean(cos):.3f})"
    )


if __name__ == "__main__":
    main()
