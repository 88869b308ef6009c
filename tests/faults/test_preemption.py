"""Preemption through the real runtime (processes over ipc): a SIGKILLed worker's request resumes
elsewhere from its last commit, bit-identical; a SIGTERMed node agent commits, releases and exits
within its leave budget (``runtime.leave_s``, 2 s); a spot notice from a (fake, local) metadata
endpoint (the fault injector's ``MetadataServer``) does the same; nothing is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from polling import wait_for

from spotlight.actors.node.core import spot_notice
from spotlight.actors.procs import alive, descendants
from spotlight.actors.runtime import LocalRuntime
from spotlight.comm import messages as m
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.spot.injector import MetadataServer
from spotlight.work import policy_model as build_policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 8
TINY = [
    "model.checkpoint=none",
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=16",
    "model.image_size=16",
    "model.patch=4",
    f"sampler.steps={STEPS}",
    "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "run.group_size=4",
    "explore.candidates=4",
    "runtime.reserved_workers=1",
    "runtime.spot_workers=1",
    # A short lease (beats every 0.3 s): an uninterrupted request (>= 8 x 50 ms) outlives a
    # beat interval, so the agents' heartbeats must keep it leased (no expiry is asserted).
    "runtime.lease_s=0.9",
    "runtime.heartbeat_s=0.3",
]
SEEDS = [11, 12, 13, 14]
# Measured leave time = the agent's leave budget + its process's exit (interpreter teardown) and
# its workers' deaths, which on a loaded 2-core machine (load ~7) took 4 s on top of the budget:
# generous headroom, while a leave that waited out an RPC timeout (>= 10 s) still fails.
EXIT_HEADROOM_S = 6.0
PROMPT = "a red circle"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("faults")
    # a slow device (50 ms after each step), so kills land mid-request
    recipe = load_recipe("tiny", [*TINY, "runtime.step_delay_s=0.05", f'run.out_dir="{out}"'])
    torch.manual_seed(0)
    model = build_policy_model(recipe)
    # The variables reach the workers; the context puts the environment back for later modules.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            rt.reference = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
            yield rt
            pids = rt.pids()
    assert [p for p in pids if alive(p)] == []  # shutdown left nothing behind


def submit(rt, iteration: int, ids: list[str]) -> None:
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id=rid, batch=str(iteration), work=job) for rid in ids]))


def first_commit(rt, rid: str) -> dict:
    """The commit's meta once the store holds one (the event we wait for)."""
    held = wait_for(lambda: rt.call(rt.store.get_commit(rid)), 60, f"a commit of {rid}")
    return held[2]


def worker_pid(rt, worker_id: str) -> int:
    kind = worker_id.split("/")[0].removeprefix("local-")
    (pid,) = descendants(rt.agents[kind].pid)  # one worker per agent here
    return pid


def check_bit_identical(rt, result: dict) -> None:
    traj, meta = rt.call(rt.store.get(result.key))
    ref = rt.reference
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(ref.latents))  # step-major
    assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(ref.log_probs))


def test_sigkilled_worker_resumes_elsewhere_bit_identical(runtime):
    rt = runtime
    submit(rt, 100, ["kill/0"])
    meta = first_commit(rt, "kill/0")
    victim = worker_pid(rt, meta["worker"])
    os.kill(victim, signal.SIGKILL)
    done = rt.call(rt.queue.wait_batch("100", 60), timeout=90)
    (result,) = done.results
    assert done.dead == [] and result.resumed_from >= 1  # picked up from a commit, not step 0
    check_bit_identical(rt, result)
    stats = rt.call(rt.queue.stats()).stats
    assert stats["released"] >= 1 and stats["expired"] == 0  # released at once, not left to expire
    # The agent restarts its worker: the node is whole again.
    kind = meta["worker"].split("/")[0].removeprefix("local-")
    wait_for(
        lambda: [p for p in descendants(rt.agents[kind].pid) if p != victim], 60, "a restarted worker", 0.1
    )


@pytest.fixture
def metadata():
    """The injector's own metadata endpoint (the cloud's forms, one path per node)."""
    server = MetadataServer()
    yield server
    server.close()


def test_spot_notice_forms(metadata):
    aws, gcp = metadata.url("n1", "aws"), metadata.url("n1", "gcp")
    assert spot_notice(aws, timeout=5) is None and spot_notice(gcp, timeout=5) is None
    metadata.noticed.add("n1")
    assert spot_notice(aws, timeout=5) == "aws terminate" and spot_notice(gcp, timeout=5) == "gcp preempted"
    assert spot_notice("http://127.0.0.1:9/unreachable", timeout=0.2) is None


def test_metadata_notice_makes_agent_leave(runtime, metadata):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTLIGHT_DIE_WITH_PARENT": "1"}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotlight.actors.node",
            "--controller",
            runtime.controller.endpoint,
            "--workers",
            "1",
            "--node-id",
            "meta-node",
            "--metadata-poll-s",
            "0.1",
            "--metadata-url",
            metadata.url("meta-node", "aws"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        assert agent.stdout.readline().startswith(b"agent ready meta-node")
        workers = descendants(agent.pid)
        assert len(workers) == 1 and "meta-node" in runtime.controller.core.nodes
        t0 = time.monotonic()
        metadata.noticed.add("meta-node")
        leave_s = runtime.config.leave_s
        assert agent.wait(leave_s + 10) == 0
        assert time.monotonic() - t0 < leave_s + 0.1 + EXIT_HEADROOM_S  # budget + one poll period
        assert not any(alive(p) for p in workers)
        assert "meta-node" not in runtime.controller.core.nodes  # it deregistered
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        agent.stdout.close()


def test_sigterm_agent_commits_releases_and_exits_within_its_leave_budget(runtime):
    rt = runtime
    ids = ["term/0", "term/1"]
    submit(rt, 101, ids)
    # Both workers busy; the spot agent's request has a commit.
    metas = wait_for(lambda: [m for m in (rt.call(rt.store.get_commit(r)) for r in ids) if m], 60, "commits")
    spot = wait_for(
        lambda: [
            r
            for r in ids
            if (c := rt.call(rt.store.get_commit(r))) and c[2]["worker"].startswith("local-spot")
        ],
        60,
        "a commit from the spot node",
    )
    assert metas
    agent = rt.agents["spot"].proc  # its supervisor counts a clean exit (0) as a node leaving
    workers = descendants(agent.pid)
    released = rt.call(rt.queue.stats()).stats["released"]
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(rt.config.leave_s + 10) == 0
    assert time.monotonic() - t0 < rt.config.leave_s + EXIT_HEADROOM_S
    assert not any(alive(p) for p in workers)
    assert rt.call(rt.queue.stats()).stats["released"] == released + 1
    done = rt.call(rt.queue.wait_batch("101", 60), timeout=90)
    assert done.dead == []
    stats = rt.call(rt.queue.stats()).stats
    assert stats["heartbeats"] >= 1 and stats["expired"] == 0  # kept alive by beats, never expired
    moved = done.results[ids.index(spot[0])]
    assert moved.resumed_from >= 1
    for result in done.results:
        check_bit_identical(rt, result)
