"""An exploration stops when its batch is cancelled: the spot node's only worker runs a 10-step
exploration on a slow device (``runtime.step_delay_s``); the exploration's batch is cancelled (the
trainer's deadline) and a rollout submitted. The node agent sees the lease revoked (its long poll
on the queue), tells the worker, and the worker stops after at most the step in flight — the
worker's own log line says at which step the cancel arrived and at which it stopped — and is free
for the rollout at once: the rollout is leased before the exploration would have finished, its
trajectory is complete, and no late exploration result ever reaches the queue."""

from __future__ import annotations

import re
import time

import pytest
import torch
from polling import wait_for

from spotlight.actors.runtime import LocalRuntime
from spotlight.comm import messages as m
from spotlight.recipe import load_recipe
from spotlight.spot.accounting import StepLog
from spotlight.work import policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS, DELAY_S = 10, 0.5
TINY = [
    "model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16", "model.image_size=16",
    "model.patch=4", f"sampler.steps={STEPS}", "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "run.group_size=4", "explore.candidates=4",
    "runtime.reserved_workers=0", "runtime.spot_workers=1",  # one worker: what it runs, it runs in turn
    f"runtime.step_delay_s={DELAY_S}", "runtime.pull_wait_s=0.2",
]
CANCELLED = re.compile(r"(\S+): exploration cancelled after step (\d+) of (\d+) \(the cancel arrived after "
                       r"step (\d+)\)")


def test_a_cancelled_exploration_stops_within_a_step_and_the_worker_takes_the_next_rollout(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", [*TINY, f'run.out_dir="{tmp_path}"'])
    torch.manual_seed(0)
    model = policy_model(recipe)
    explore = m.ExploreWork(prompt="a red circle", seeds=[1, 2, 3, 4], version=0)
    rollout = m.RolloutWork(prompt="a red circle", seeds=[11, 12, 13, 14], version=0)
    with LocalRuntime(recipe) as rt:
        stats = lambda: rt.call(rt.queue.stats()).stats  # noqa: E731
        rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
        rt.call(rt.queue.submit([m.WorkRequest(request_id="x/0", batch="x", work=explore)]))
        wait_for(lambda: stats()["now_leased"] == 1, 120, "the spot worker to lease the exploration")
        # Let it get a few steps in (nothing announces a step of an exploration outside the worker;
        # the assertions hold wherever the cancel lands, this only makes it land mid-job).
        time.sleep(3 * DELAY_S)
        t_cancel = time.monotonic()
        done = rt.call(rt.queue.cancel_batch("x"))
        rt.call(rt.queue.submit([m.WorkRequest(request_id="r/0", batch="r", work=rollout)]))
        wait_for(lambda: stats()["leased"] == 2, 60, "the rollout leased")
        leased_s = time.monotonic() - t_cancel
        (result,) = rt.call(rt.queue.wait_batch("r", 60), timeout=90).results
        end = stats()
        log = (rt.log_dir / "agent-spot.log").read_text()
        step_log = StepLog(rt.log_dir / "steps.log")
        step_log.refresh()
        steps = step_log.requests
    assert done.cancelled == ["x/0"] and done.results == [None]
    (line,) = [x.groups() for x in CANCELLED.finditer(log)]
    rid, stopped, total, arrived = line[0], int(line[1]), int(line[2]), int(line[3])
    assert rid == "x/0" and total == STEPS
    assert stopped <= arrived + 1  # the step in flight at the cancel, and no more
    assert stopped < STEPS  # it did not run to the end: the rollout was leased before then
    print(f"cancel arrived after step {arrived}, stopped after step {stopped} of {STEPS}; "
          f"rollout leased {leased_s:.2f} s after the cancel (the exploration had "
          f"{(STEPS - stopped) * DELAY_S:.1f} s of injected delay left)")
    # The rollout ran whole on that worker, and no exploration result came back late.
    assert len(result.rewards) == 4 and result.resumed_from == 0
    assert steps["r/0"].computed == STEPS and "x/0" not in steps  # the step log is the rollouts'
    assert end["completed"] == 1 and end["late_results_dropped"] == 0 and end["stale_rejected"] == 0
    assert end["cancelled"] == 1 and end["now_leased"] == 0
