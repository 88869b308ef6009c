"""A lender killed mid-lend: a worker asked by a neighbour for a weights version is SIGKILLed before
it answers (a slow lender, ``runtime.lend_delay_s``). The borrower sees
the lender's exit at once (a pidfd, not the ``runtime.peer_weights_s`` wait), fetches the version
from the store instead, and every request — the killed lender's included, resumed from its last
commit — ends bit-identical to the in-process rollout. No lent segment outlives the run. And a
borrower that holds a lent version past ``runtime.peer_weights_s`` (``runtime.borrow_delay_s``):
the lender's version switch waits for that bound and no longer, the late copy is refused."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from polling import wait_for

from spotlight.actors.procs import alive
from spotlight.actors.runtime import LocalRuntime
from spotlight.actors.worker.peers import read_weights_log
from spotlight.comm import messages as m
from spotlight.comm.shm import PREFIX, SHM_DIR
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.work import policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PEER_WAIT_S = 10.0
TINY = [
    "model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16", "model.image_size=16",
    "model.patch=4", "sampler.steps=6", "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "run.group_size=4", "explore.candidates=4", "runtime.reserved_workers=2", "runtime.spot_workers=0",
    f"runtime.peer_weights_s={PEER_WAIT_S}", "runtime.lease_s=3", "runtime.heartbeat_s=0.5",
]
SEEDS = [11, 12, 13, 14]
PROMPT = "a red circle"


def test_borrower_falls_back_to_the_store_when_the_lender_is_killed(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", [*TINY, f'run.out_dir="{tmp_path}"',
                                  "runtime.step_delay_s=0.1",  # the lender is still computing at the kill
                                  "runtime.lend_delay_s=120"])  # a lender that never answers in time
    torch.manual_seed(0)
    model = policy_model(recipe)
    ref = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            log = rt.log_dir / "weights.log"
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
            reqs = [m.WorkRequest(request_id=f"r{i}", batch="b", work=job) for i in range(2)]
            rt.call(rt.queue.submit(reqs))
            (lend,) = wait_for(lambda: [e for e in read_weights_log(log) if e.how == "lend"][:1], 60,
                               "a worker asked to lend version 0")


            def lenders_commit():  # the lender computes its own request meanwhile: kill it mid-request
                held = [rt.call(rt.store.get_commit(f"r{i}")) for i in range(2)]
                return [h for h in held if h is not None and h[2]["worker"] == lend.worker]

            wait_for(lenders_commit, 60, "a step committed by the lender")
            os.kill(lend.pid, signal.SIGKILL)
            done = rt.call(rt.queue.wait_batch("b", 120), timeout=150)
            assert done.dead == [] and len(done.results) == 2
            assert max(r.resumed_from for r in done.results) >= 1  # the lender's request resumed
            for result in done.results:
                traj, _ = rt.call(rt.store.get(result.key))
                assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(ref.latents))
                assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(ref.log_probs))
            pids = rt.pids()
    assert [p for p in pids if alive(p)] == []

    events = read_weights_log(log)
    borrower = [e for e in events if e.pid != lend.pid and e.version == 0 and e.how != "lend"]
    assert borrower and borrower[0].how == "store", events  # fell back, did not copy
    assert borrower[0].seconds < PEER_WAIT_S / 2, events  # the lender's death ended the wait
    assert not [e for e in events if e.how == "peer"], events
    leaked = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and "-peer-" in n
              and int(n[len(PREFIX):].split("-", 1)[0]) in {*pids, lend.pid}]  # the killed lender's too
    assert leaked == []


def test_a_lent_version_is_pinned_until_its_bound_then_a_late_copy_is_refused(tmp_path):
    """One buffer per worker (``runtime.worker_versions = 1``); the borrower of version 0 holds it
    (``runtime.borrow_delay_s``) past ``runtime.peer_weights_s``. The
    lender, handed version 1 meanwhile, does not reload its lent buffer until that bound (the pin),
    then does; the borrower's late copy sees the buffer's generation moved, is refused, and the
    borrower fetches version 0 from the store. Every trajectory is bit-identical."""
    torch.set_num_threads(1)
    pin_s, hold_s = 2.0, 6.0
    tiny = [t for t in TINY if not t.startswith("runtime.peer_weights_s")]
    recipe = load_recipe("tiny", [*tiny, f"runtime.peer_weights_s={pin_s}", "runtime.worker_versions=1",
                                  "runtime.step_delay_s=0.02", f"runtime.borrow_delay_s={hold_s}",
                                  f'run.out_dir="{tmp_path}"'])
    torch.manual_seed(0)
    model = policy_model(recipe)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    states.append({k: v.clone() for k, v in model.state_dict().items()})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            log = rt.log_dir / "weights.log"
            for v, state in enumerate(states):
                rt.call(rt.store.publish_weights(v, {k: t.numpy() for k, t in state.items()}))
            jobs = [m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=v) for v in (0, 1)]
            rt.call(rt.queue.submit([m.WorkRequest(request_id=f"v0/{i}", batch="b0", work=jobs[0])
                                     for i in range(2)]))
            (lend,) = wait_for(lambda: [e for e in read_weights_log(log) if e.how == "lend"][:1], 60,
                               "a worker asked to lend version 0")
            rt.call(rt.queue.submit([m.WorkRequest(request_id="v1/0", batch="b1", work=jobs[1])]))
            results = []
            for batch in ("b0", "b1"):
                done = rt.call(rt.queue.wait_batch(batch, 120), timeout=150)
                assert done.dead == [], done.dead
                results.extend(done.results)
            for result in results:
                model.load_state_dict(states[int(result.key.split("/")[1][1])])
                ref = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
                traj, _ = rt.call(rt.store.get(result.key))
                assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(ref.latents))
                assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(ref.log_probs))

    events = [e for e in read_weights_log(log) if e.how != "lend"]
    lender_v1 = [e for e in events if e.pid == lend.pid and e.version == 1]
    borrower_v0 = [e for e in events if e.pid != lend.pid and e.version == 0]
    assert lender_v1 and borrower_v0, events
    assert borrower_v0[0].how == "store" and borrower_v0[0].seconds >= hold_s, events  # refused, refetched
    assert not [e for e in events if e.how == "peer"], events
    # The lender reloaded its buffer only once the pin's bound passed, and long before the
    # borrower would have returned it.
    assert lender_v1[0].end >= lend.end + pin_s * 0.99, (lend, lender_v1)
    assert lender_v1[0].end < borrower_v0[0].end, events
