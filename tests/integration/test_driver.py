"""The iteration driver's executor contract, through the real runtime (queue, store and worker
processes over ipc): work is submitted as batches and answered by handles, several batches are in
flight at once, and each job runs with exactly the weights version it names — also when a newer
version is published while it waits. The in-process executor is the reference."""

from __future__ import annotations

import pytest
import torch
from tiny_recipe import TINY_MODEL

from spotlight import work
from spotlight.actors.runtime import LocalRuntime
from spotlight.comm import messages as m
from spotlight.loop import LocalExecutor
from spotlight.recipe import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TINY = [
    *TINY_MODEL,
    "runtime.reserved_workers=1",
    "runtime.spot_workers=1",
]


def perturbed(model, seed: int):
    """A copy of ``model`` after a stand-in for a training step: every weight moved a little."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return other


def test_batches_in_flight_at_once_each_at_its_version(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = load_recipe("tiny", [*TINY, f'run.out_dir="{tmp_path}"', 'run.mode="runtime"'])
    torch.manual_seed(0)
    v0 = work.policy_model(recipe)
    v1 = perturbed(v0, seed=1)
    explore_jobs = [
        m.ExploreWork(prompt=p, seeds=[11, 12, 13, 14], version=0, cache="taylor:2")
        for p in ("a red circle", "two blue squares")
    ]
    rollout_jobs = [m.RolloutWork(prompt="a green triangle", seeds=[5, 6, 7, 8], version=1, init_seed=3)]

    with LocalRuntime(recipe) as rt:
        executor = rt.executor(v0, recipe, 0)  # publishes v0
        explored = executor.explore("it0/explore", explore_jobs)  # in flight at v0 ...
        executor.publish(1, v1)  # ... while "training" produced v1
        rolled = executor.rollout("it1/rollout", rollout_jobs)  # a second batch, at v1
        scores, groups = explored.result(120), rolled.result(120)
        assert explored.done() and rolled.done()

    ref0, ref1 = LocalExecutor(v0, recipe, 0), LocalExecutor(v1, recipe, 1)
    for got, want in zip(scores, ref0.explore("ref", explore_jobs).result(), strict=True):
        assert got.rewards == want.rewards and got.model_calls == want.model_calls  # the stale version's bits
    (got,), (want,) = groups, ref1.rollout("ref", rollout_jobs).result()
    assert (got.prompt, got.seeds) == (want.prompt, want.seeds)
    for name in ("latents", "log_probs", "rewards", "credit"):  # credit: through the store as well
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_local_executor_holds_one_version(tiny_cfg):
    recipe = load_recipe("tiny", TINY)
    torch.manual_seed(0)
    model = work.policy_model(recipe)
    executor = LocalExecutor(model, recipe, version=4)
    stale = executor.rollout("b", [m.RolloutWork(prompt="a red circle", seeds=[1, 2], version=3)])
    with pytest.raises(ValueError, match="version 3"):  # the handle carries the error, as a remote one would
        stale.result()
    fresh = executor.explore("b", [m.ExploreWork(prompt="a red circle", seeds=[1, 2], version=4)])
    assert fresh.done() and len(fresh.result()[0].rewards) == 2
