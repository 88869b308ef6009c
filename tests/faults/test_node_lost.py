"""A spot node declared lost gives its leases back at once (real processes over ipc, real signals).

The lease here is long (``LEASE_S``, 120 s), so a request that completes within node_lost_s plus
a margin came back because its node was declared lost, not because its lease expired:

- a SIGKILLed agent (no goodbye): its request is re-queued when the controller declares the node
  lost and completes elsewhere, resumed from its last commit, bit-identical; no lease expired;
- a frozen agent (SIGSTOP: a partition) the same; after SIGCONT its late heartbeats and result are
  refused (the lost attempt is fenced) and it registers again.

    .venv/bin/python -m pytest -q tests/faults/test_node_lost.py
"""

from __future__ import annotations

import os
import signal
import threading
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
from spotlight.work import policy_model as build_policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 8
SEEDS = [31, 32, 33, 34]
PROMPT = "a green circle"
NODE_LOST_S = 1.5
LEASE_S = 120.0
# After the node is declared lost (<= 1.25 x node_lost_s), the re-queued request waits for the
# reserved worker to finish its own request, then runs its remaining steps (~0.1 s each): a few
# seconds, more on a loaded 2-core machine. Far below the lease either way.
MARGIN_S = 20.0
OVERRIDES = [
    *TINY_MODEL,
    f"sampler.steps={STEPS}",
    "run.group_size=4",
    "runtime.reserved_workers=1",
    "runtime.spot_workers=0",  # the spot nodes are added by the tests
    f"runtime.lease_s={LEASE_S}",
    "runtime.heartbeat_s=0.3",
    f"runtime.node_lost_s={NODE_LOST_S}",
]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("node-lost")
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


def lost_event(rt, node_id: str) -> threading.Event:
    """Set when the controller declares ``node_id`` lost (its ``on_event`` hook, chained)."""
    core, event = rt.controller.core, threading.Event()
    before = core.on_event

    def on_event(kind: str, node: str, record: dict) -> None:
        if before is not None:
            before(kind, node, record)
        if kind == "lost" and node == node_id:
            event.set()

    core.on_event = on_event
    return event


def start(rt, node_id: str, batch: str) -> tuple[list[str], str]:
    """Add spot node ``node_id``, submit one request per worker (the node's and the reserved
    one); the request the node runs, once it holds a commit of it."""
    rt.add_node(node_id, wait=True)
    ids = [f"{batch}/0", f"{batch}/1"]
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id=rid, batch=batch, work=job) for rid in ids]))

    def committed_by_node() -> str | None:
        for rid in ids:
            held = rt.call(rt.store.get_commit(rid))
            if held is not None and held[2]["worker"].startswith(node_id + "/"):
                return rid
        return None

    return ids, wait_for(committed_by_node, 60, f"a commit from {node_id}")


def check_results(rt, done: m.BatchDone, ids: list[str], victim: str) -> None:
    assert done.dead == [] and done.results[ids.index(victim)].resumed_from >= 1  # from its commit
    for result in done.results:
        traj, _ = rt.call(rt.store.get(result.key))
        assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
        assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(rt.reference.log_probs))


def requeued_record(rt, node_id: str) -> list[str]:
    (record,) = [x for x in rt.controller.core.left if x["node_id"] == node_id]
    assert record["reason"].startswith("lost: no heartbeat")
    return record.get("requeued")


def stats(rt) -> dict:
    return rt.call(rt.queue.stats()).stats


def test_sigkilled_agent_leases_requeued_when_declared_lost(runtime):
    rt = runtime
    lost = lost_event(rt, "gone.1")
    ids, victim = start(rt, "gone.1", "gone")
    workers = descendants(rt.agents["gone.1"].pid)
    before = stats(rt)
    t0 = time.monotonic()
    rt.signal_node("gone.1", signal.SIGKILL)  # no goodbye, no release: only silence tells
    assert lost.wait(NODE_LOST_S * 1.25 + MARGIN_S), "the killed node was not declared lost"
    done = rt.call(rt.queue.wait_batch("gone", NODE_LOST_S * 1.25 + MARGIN_S), timeout=LEASE_S)
    elapsed = time.monotonic() - t0
    assert elapsed < NODE_LOST_S * 1.25 + MARGIN_S < LEASE_S / 4, elapsed
    check_results(rt, done, ids, victim)
    after = stats(rt)
    assert after["node_lost_requeued"] - before["node_lost_requeued"] == 1
    assert after["expired"] == before["expired"]  # it came back at node loss, not at lease expiry
    assert after["completed"] - before["completed"] == 2 and after["duplicate_completions"] == 0
    assert requeued_record(rt, "gone.1") == [victim]
    assert not any(alive(p) for p in workers)  # the workers died with their agent


def test_frozen_node_requeued_when_lost_and_its_late_result_refused(runtime):
    rt = runtime
    lost = lost_event(rt, "frozen.2")
    ids, victim = start(rt, "frozen.2", "frozen")
    agent = rt.agents["frozen.2"]
    node = [agent.pid, *descendants(agent.pid)]  # a partition stops the whole node
    before = stats(rt)
    t0 = time.monotonic()
    for pid in node:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert lost.wait(NODE_LOST_S * 1.25 + MARGIN_S), "the frozen node was not declared lost"
        done = rt.call(rt.queue.wait_batch("frozen", NODE_LOST_S * 1.25 + MARGIN_S), timeout=LEASE_S)
        assert time.monotonic() - t0 < NODE_LOST_S * 1.25 + MARGIN_S
        check_results(rt, done, ids, victim)
        assert requeued_record(rt, "frozen.2") == [victim]
    finally:
        for pid in node:
            os.kill(pid, signal.SIGCONT)
    # Back from its freeze, the node's attempt is fenced: its heartbeat or result is refused.
    wait_for(lambda: stats(rt)["stale_rejected"] > before["stale_rejected"], 30, "the lost attempt refused")
    wait_for(lambda: "frozen.2" in rt.controller.core.nodes, 30, "the node registered again")
    after = stats(rt)
    assert after["node_lost_requeued"] - before["node_lost_requeued"] == 1
    assert after["expired"] == before["expired"] and after["duplicate_completions"] == 0
    assert after["completed"] - before["completed"] == 2  # each once: the late one is not counted
    assert agent.proc.poll() is None, agent.tail()
    rt.signal_node("frozen.2", signal.SIGTERM)
    assert agent.proc.wait(30) == 0
