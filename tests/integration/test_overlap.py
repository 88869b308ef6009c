"""The overlap schedule's runtime parts: a worker alternating between two weights versions without
refetching them, the store keeping a version pinned while exploration samples with it, and the
exploration deadline — work nobody finished by the next rollout is cancelled in the queue, its
prompts fall back to random seeds (counted), and the iteration goes on."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe, work
from spotlight.actors.store.client import TensorStoreClient
from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore
from spotlight.actors.worker.core import WorkerCore
from spotlight.comm import messages as m
from spotlight.errors import ConfigError, NotFound

pytestmark = pytest.mark.timeout(300)

TINY = [
    *TINY_MODEL,
    "sampler.eval_steps=2",
    "run.group_size=4",
    "explore.candidates=8",
    "run.prompts_per_iteration=2",
    "run.eval_every=100",
    "run.eval_seeds=1",
    "run.eval_samples=2",
]


def lease(rid: str, version: int, seeds: list[int]) -> m.LeaseGrant:
    job = m.ExploreWork(prompt="a red circle", seeds=seeds, version=version)
    return m.LeaseGrant(request_id=rid, attempt=1, deadline=0.0, lease_s=30.0, batch="b", work=job)


async def test_worker_switches_between_two_versions_without_refetching():
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", TINY)
    torch.manual_seed(0)
    models = [work.policy_model(recipe) for _ in range(2)]  # two different weights versions
    async with TensorStoreClient.local() as store:
        for v, model in enumerate(models):
            await store.publish_weights(v, {k: x.numpy() for k, x in model.state_dict().items()})
        core = WorkerCore(recipe, store, worker_id="w")
        got = {}
        for i, v in enumerate([1, 0, 1, 0, 1]):  # rollout at v_{i+1}, exploration at v_i, ...
            got.setdefault(v, []).append((await core.run(lease(f"e{i}", v, [5, 6, 7]))).rewards)
        assert core.weights_fetches == 2 and core.weights_switches == 3
        shape, reward = work.image_shape(recipe), work.recipe_reward(recipe)
        for v, model in enumerate(models):  # each version's scores are that version's, exactly
            ref = work.explore(model, lease("x", v, [5, 6, 7]).work, recipe.sampler, reward, shape)
            assert all(r == [float(x) for x in ref.rewards] for r in got[v])


def test_store_keeps_a_pinned_version_past_retention():
    core = TensorStoreCore(TensorStoreConfig(keep_versions=1))
    w = {"a": np.zeros(4, np.float32)}
    core.publish_weights(0, w)
    core.pin_version(0)  # exploration at v0 still in flight
    core.publish_weights(1, w)
    core.publish_weights(2, w)
    assert core.versions() == [0, 2]
    assert core.unpin_version(0) == [0] and core.versions() == [2]
    with pytest.raises(NotFound, match="freed"):
        core.get_weights(0)


@pytest.mark.slow
def test_exploration_past_its_deadline_is_cancelled_and_the_run_goes_on(tmp_path, monkeypatch):
    """Exploration only on spot workers, and no spot worker: nothing explored by the deadline.
    Every exploration request is cancelled in the queue (none left queued or leased), each prompt
    falls back to random seeds and says so, the store's pin is released, the run finishes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = load_recipe("tiny", [
        *TINY,
        "run.iterations=3",
        'run.mode="runtime"',
        "runtime.reserved_workers=1",
        "runtime.spot_workers=0",
        'runtime.explore_on="spot"',
        "explore.schedule=overlap",
        "explore.chunk=4",
        'explore.wait_s=0.0',
        f'run.out_dir="{tmp_path}"',
    ])
    exp = Experiment(recipe)
    seen: dict = {}

    def on_record(rec: dict) -> None:
        if rec["event"] == "iteration" and rec["iteration"] == 2:
            seen["queue"] = exp.runtime.call(exp.queue.stats()).stats
            try:  # v1 (explored for iteration 2, cancelled) must be unpinned: freed by retention
                exp.runtime.call(exp.store.get_weights(1))
            except NotFound as e:
                seen["v1"] = str(e)

    exp.on_metrics(on_record)
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"]
    assert len(its) == 3
    assert "explore_requests" not in its[0]  # the first iteration: nothing explored in a window
    for rec in its[1:]:  # 2 prompts x 8 candidates in chunks of 4: 4 requests, none came back
        assert (rec["explore_requests"], rec["explore_returned"], rec["explore_cancelled"]) == (4, 0, 4)
        assert rec["explore_fallback_prompts"] == 2 and rec["explore_version"] == rec["version"] - 1
    q = seen["queue"]
    assert q["cancelled"] == 8 and q["now_queued"] == 0 and q["now_leased"] == 0  # no work left behind
    assert "freed" in seen["v1"]  # the cancelled batches released their pins


def test_planner_state_survives_resume(tmp_path):
    """The planner's arm statistics are in the checkpoint: a resumed run continues with them."""
    torch.set_num_threads(1)
    over = [
        *TINY,
        "explore.schedule=overlap",
        "explore.planner=true",
        'explore.arms=["4", "8", "8@taylor:2"]',
        "run.checkpoint_every=2",
        f'run.out_dir="{tmp_path}"',
        'run.name="planned"',
    ]
    from spotlight.loop import Loop

    first = Loop(load_recipe("tiny", [*over, "run.iterations=2"]), progress=False)
    first.run()
    saved = first.planner.state_dict()
    assert sum(saved["pulls"]) == 1  # iteration 1 used iteration 0's overlapped exploration
    resumed = Loop(load_recipe("tiny", [*over, "run.iterations=4"]), resume=True, progress=False)
    assert resumed.start_iteration == 2 and resumed.planner.state_dict() == saved
    resumed.run()
    assert sum(resumed.planner.state_dict()["pulls"]) == 2  # iteration 2: cold start; 3: overlapped


def test_an_arm_plan_sets_each_iterations_exploration(tmp_path):
    """explore.arm_plan, cycled from the first iteration that explores, decides every exploration's
    arm in the loop and in the simulated run alike; a resumed run keeps to the plan's iterations."""
    torch.set_num_threads(1)
    over = [*TINY, "explore.schedule=overlap", 'explore.arm_plan=["8@taylor:2", "4", "8"]',
            "run.checkpoint_every=2", f'run.out_dir="{tmp_path}"', 'run.name="plan"']
    from spotlight.loop import Loop
    from spotlight.sim.run import SimRun

    Loop(load_recipe("tiny", [*over, "run.iterations=2"]), progress=False).run()
    Loop(load_recipe("tiny", [*over, "run.iterations=5"]), resume=True, progress=False).run()
    lines = (tmp_path / "plan" / "metrics.jsonl").read_text().splitlines()
    its = [r for r in map(json.loads, lines) if r["event"] == "iteration"]
    want = [None, "8@taylor:2", "4", "8", "8@taylor:2"]
    # iteration 2 resumed: the exploration in flight at the checkpoint is gone (random seeds)
    assert [r.get("explore_arm") for r in its] == [*want[:2], None, *want[3:]]
    assert all(r["explore_fallback_prompts"] == 0 for r in its if "explore_arm" in r)
    sim = SimRun(load_recipe("tiny", [*over, "run.iterations=5", 'run.mode="sim"', 'run.name="plan-sim"',
                                      "runtime.spot_workers=2"]))
    sim.run()
    assert [r.get("explore_arm") for r in sim.records] == want


def test_an_arm_plan_is_checked_like_the_arms():
    for bad, says in [('explore.arm_plan=["8", "x"]', "explore.arm_plan[1]"),
                      ('explore.arm_plan=["2"]', "explore.arm_plan: every candidate count"),
                      ("explore.arm_plan=[]", "at least one arm"),
                      ("explore.planner=true", "set explore.planner = false")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_recipe("tiny", [*TINY, "explore.schedule=overlap", 'explore.arm_plan=["8"]', bad])
