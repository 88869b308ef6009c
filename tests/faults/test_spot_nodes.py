"""Spot nodes that come and go under a running runtime (real processes over ipc, real signals):

- a node agent frozen with SIGSTOP (a network partition, a long stall) loses its lease, its
  request completes elsewhere bit-identical, the controller declares the node lost; after SIGCONT
  its late result is refused, it does not mistake its own freeze for the queue's silence (it
  stays, and registers again);
- a SIGKILLed agent (no goodbye) is declared lost within the bound and its request re-queued;
- chaos: ~10 random SIGKILLs and SIGTERMs of spot agents and workers (``FaultInjector``, seeded)
  while requests run: none lost, none counted twice, every trajectory bit-identical to the
  no-fault reference, at most one step lost per preempted request (step commits).

    .venv/bin/python -m pytest -q tests/faults/test_spot_nodes.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from polling import wait_for
from tiny_recipe import TINY_MODEL

from spotlight.actors.procs import alive, descendants
from spotlight.actors.runtime import LocalRuntime
from spotlight.comm import messages as m
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.spot.injector import FaultInjector
from spotlight.work import policy_model as build_policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8
SEEDS = [21, 22, 23, 24]
PROMPT = "a blue square"
NODE_LOST_S = 1.5
MAX_FAULTS = 30  # the chaos test's bound
OVERRIDES = [
    *TINY_MODEL,
    f"sampler.steps={STEPS}",
    "run.group_size=4",
    "runtime.reserved_workers=1",
    "runtime.spot_workers=0",  # spot nodes are added by the tests
    "runtime.lease_s=0.9",
    "runtime.heartbeat_s=0.3",
    f"runtime.node_lost_s={NODE_LOST_S}",
    "runtime.queue_lost_s=1.0",  # shorter than the freeze below: the freeze must not count
]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("spot-nodes")
    # a slow device: faults land mid-request
    recipe = load_recipe("tiny", [*OVERRIDES, "runtime.step_delay_s=0.1", f'run.out_dir="{out}"'])
    torch.manual_seed(0)
    model = build_policy_model(recipe)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            rt.reference = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
            yield rt
            pids = rt.pids()
    assert [p for p in pids if alive(p)] == []  # nothing left behind


def submit(rt, batch: str, ids: list[str]) -> None:
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id=rid, batch=batch, work=job) for rid in ids]))


def committed_by(rt, ids: list[str], node: str) -> list[str]:
    """The requests of ``ids`` whose newest commit is from ``node``'s workers (one request per
    worker is submitted, so the node under test is busy whichever worker pulls first)."""
    held = {rid: rt.call(rt.store.get_commit(rid)) for rid in ids}
    return [rid for rid, h in held.items() if h is not None and h[2]["worker"].startswith(node + "/")]


def check_bit_identical(rt, result) -> None:
    traj, _ = rt.call(rt.store.get(result.key))
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
    assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(rt.reference.log_probs))


def stats(rt) -> dict:
    return rt.call(rt.queue.stats()).stats


def test_frozen_agent_loses_its_lease_and_its_late_result_is_refused(runtime):
    rt = runtime
    rt.add_node("frozen.1", wait=True)
    agent = rt.agents["frozen.1"]
    ids = ["freeze/0", "freeze/1"]
    submit(rt, "freeze", ids)
    (victim,) = wait_for(lambda: committed_by(rt, ids, "frozen.1"), 60, "a commit from the node to freeze")
    late = stats(rt)["late_results_dropped"] + stats(rt)["stale_rejected"]
    node = [agent.pid, *descendants(agent.pid)]  # a partition stops the whole node
    t0 = time.monotonic()
    for pid in node:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "frozen.1" not in rt.controller.core.nodes, 30, "the frozen node declared lost")
        lost_s = time.monotonic() - t0
        assert lost_s < NODE_LOST_S * 1.25 + 3.0, lost_s  # node_lost_s + a sweep, loaded-machine slack
        left = [x for x in rt.controller.core.left if x["node_id"] == "frozen.1"]
        assert left and left[-1]["reason"].startswith("lost: no heartbeat")
        done = rt.call(rt.queue.wait_batch("freeze", 60), timeout=90)
        assert done.dead == [] and done.results[ids.index(victim)].resumed_from >= 1  # from its commit
        for result in done.results:
            check_bit_identical(rt, result)
        assert time.monotonic() - t0 > 1.0  # frozen longer than queue_lost_s: the case to survive
    finally:
        for pid in node:
            os.kill(pid, signal.SIGCONT)
    # Its late result (and heartbeats) are refused; it registers again instead of leaving.
    wait_for(lambda: stats(rt)["late_results_dropped"] + stats(rt)["stale_rejected"] > late, 30,
             "the late result refused")
    wait_for(lambda: "frozen.1" in rt.controller.core.nodes, 30, "the node registered again")
    assert agent.proc.poll() is None, agent.tail()  # it stayed: its freeze was not the queue's silence
    assert stats(rt)["duplicate_completions"] == 0
    rt.signal_node("frozen.1", signal.SIGTERM)
    assert agent.proc.wait(30) == 0


def test_sigkilled_agent_is_declared_lost_and_its_request_requeued(runtime):
    rt = runtime
    rt.add_node("killed.1", wait=True)
    ids = ["kill/0", "kill/1"]
    submit(rt, "kill", ids)
    (victim,) = wait_for(lambda: committed_by(rt, ids, "killed.1"), 60, "a commit from the node to kill")
    workers = descendants(rt.agents["killed.1"].pid)
    before = rt.account.snapshot()["nodes_lost"]
    t0 = time.monotonic()
    rt.signal_node("killed.1", signal.SIGKILL)  # no goodbye: only silence tells
    wait_for(lambda: "killed.1" not in rt.controller.core.nodes, 30, "the killed node declared lost")
    noticed_s = time.monotonic() - t0
    assert noticed_s < NODE_LOST_S * 1.25 + 3.0, noticed_s  # node_lost_s + a sweep, loaded-machine slack
    assert rt.account.snapshot()["nodes_lost"] == before + 1
    done = rt.call(rt.queue.wait_batch("kill", 60), timeout=90)
    assert done.dead == [] and done.results[ids.index(victim)].resumed_from >= 1
    for result in done.results:
        check_bit_identical(rt, result)
    wait_for(lambda: not any(alive(p) for p in workers), 10, "its workers gone with it")


def test_chaos_ten_random_kills_lose_nothing(runtime):
    rt = runtime
    injector = FaultInjector(rt, [], warning_s=1.0, seed=7, expect=rt.account.expect)
    for name in ("chaos0", "chaos1", "chaos2"):
        injector.add(name)
    wait_for(lambda: sum(n.startswith("chaos") for n in rt.controller.core.nodes) == 3, 120,
             "three spot nodes")
    before = stats(rt)
    assert rt.account.steps is not None  # the step log that tells a preempted request
    faults, ids, batches = [], [], []
    rounds = 0
    seen: dict[str, tuple[str, int]] = {}  # request -> (worker, step) of its newest commit when last looked

    def running(round_ids: list[str]) -> list[str]:
        """Spot nodes whose commit of a request advanced since the last look: computing now,
        not between requests or restarting a worker (a fault there would hit nothing)."""
        nodes = set()
        for rid in round_ids:
            held = rt.call(rt.store.get_commit(rid))
            if held is None:
                continue
            now = (held[2]["worker"], held[0])
            if rid in seen and seen[rid][0] == now[0] and seen[rid][1] < now[1]:
                nodes.add(now[0].split("/")[0])
            seen[rid] = now
        return [n for n in sorted(nodes) if n.startswith("chaos") and rt.node_alive(n)]

    def preempted() -> dict:
        """The submitted requests run by more than one attempt so far, by the step log."""
        rt.account.steps.refresh()
        logged = rt.account.steps.requests
        return {rid: logged[rid] for rid in ids if rid in logged and len(logged[rid].first_step) > 1}

    # ~10 faults, and on until three running requests were hit (a spot notice lets a short request
    # finish within its warning, so not every fault preempts one); bounded, so a blind injector fails.
    def more() -> bool:
        return len(faults) < 10 or (len(faults) < MAX_FAULTS and len(preempted()) < 3)

    while more():
        rounds += 1
        batch = f"chaos{rounds}"
        round_ids = [f"{batch}/{i}" for i in range(12)]
        submit(rt, batch, round_ids)
        ids += round_ids
        batches.append(batch)
        handle = rt.bg.submit(rt.queue.wait_batch(batch, 120))
        while not handle.done() and more():
            busy = running(round_ids)
            if busy:
                faults.append(injector.random_fault(busy))
            try:
                handle.result(timeout=0.3)
            except TimeoutError:
                pass
        results = handle.result(timeout=150)
        assert results.dead == [], (faults, results.dead)
        for result in results.results:
            check_bit_identical(rt, result)
    injector.stop()
    after = stats(rt)
    assert after["completed"] - before["completed"] == len(ids)  # each exactly once: none counted twice
    assert after["duplicate_completions"] == before["duplicate_completions"]
    assert after["dead"] == before["dead"]  # none lost
    hit = preempted()
    assert set(ids) <= rt.account.steps.requests.keys()  # every request's steps logged
    assert all(r.lost <= len(r.first_step) - 1 for r in hit.values()), (  # <= 1 step per preemption
        {rid: (r.lost, r.first_step) for rid, r in hit.items()})
    assert len(hit) >= 3  # the faults did hit running requests
    print(f"chaos: {len(faults)} faults ({faults}); {len(ids)} requests, {len(hit)} preempted, "
          f"{sum(r.resumed for r in hit.values())} resumed, "
          f"steps lost {sum(r.lost for r in hit.values())}")
