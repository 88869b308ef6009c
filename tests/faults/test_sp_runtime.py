"""Elastic SP in the real runtime (queue, store, runtime.sp_degree = 2; a reserved node agent with
three workers — a group and a spare — and a spot node agent with two): a member SIGKILLed
mid-request — the committing rank 0 or the other rank — has its group broken, the survivor
regroups at a new epoch without restarting (same process, same weights), the request resumes
from its last store commit under the same lease, and the trajectory is bit-identical to the
single-process rollout (degree 1: the SP forward is exact here, so degree 2 and degree 1 agree
bit for bit). The group's second rank copies its weights from the first (peer copy, not the
store). The dead worker is restarted and joins again. A member frozen mid-request (SIGSTOP):
its peer keeps answering status while its collective waits, gives up after runtime.sp_timeout_s,
the frozen member is killed after the release bound, and the request completes bit-identical
without its lease expiring. A spot notice (SIGTERM) to a node
whose group is mid-request: both ranks stop at the same step boundary, the lease is released,
the agent leaves within its budget, and the other node's group resumes the request from its
commit, bit-identical. Nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from polling import wait_for

from spotlight.actors.procs import alive, descendants
from spotlight.actors.runtime import LocalRuntime
from spotlight.actors.worker.peers import read_weights_log
from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.work import policy_model as build_policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # 3 cold workers on a loaded 2-core box

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
    "runtime.sp_degree=2",
    "runtime.reserved_workers=3",  # one group of 2 and a spare
    "runtime.spot_workers=2",  # one group
    "runtime.lease_s=3",
    "runtime.heartbeat_s=0.3",
    "runtime.sp_timeout_s=2",
    "runtime.step_delay_s=0.05",  # a slow device: kills land mid-request
]
SEEDS = [11, 12, 13, 14]
PROMPT = "a red circle"


def _runtime(tmp_path_factory, *extra: str):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("sp")
    recipe = load_recipe("tiny", [*TINY, f'run.out_dir="{out}"', *extra])
    torch.manual_seed(0)
    model = build_policy_model(recipe)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            rt.reference = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
            yield rt
            pids = rt.pids()
    assert [p for p in pids if alive(p)] == []


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    yield from _runtime(tmp_path_factory)


@pytest.fixture(scope="module")
def cold_runtime(tmp_path_factory):  # the baseline: one group, no spare, survivors restarted cold
    yield from _runtime(tmp_path_factory, "runtime.sp_regroup=false", "runtime.reserved_workers=2",
                        "runtime.spot_workers=0")


def cmdline_arg(pid: int, flag: bytes) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    return args[args.index(flag) + 1].decode()


async def worker_status(endpoint: str) -> m.WorkerProgress:
    async with RpcClient(endpoint, timeout=1.0) as client:  # beside the agent's own client
        return await client.call(m.WorkerStatus())


def workers(rt) -> dict[str, int]:
    """worker id -> pid of the live workers of the runtime's live agents."""
    out = {}
    for pid in [p for a in rt.agents.values() if a.proc.poll() is None for p in descendants(a.pid)]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in args:
            out[args[args.index(b"--worker-id") + 1].decode()] = pid
    return out


def five(rt) -> dict[str, int] | None:
    w = workers(rt)
    return w if len(w) == 5 else None


def restart_lines(rt, node: str, worker: str) -> list[str]:
    log = (rt.log_dir / f"agent-{node}.log").read_text()
    return [line for line in log.splitlines() if f"{worker} restarting" in line]


def run_and_kill(rt, batch: str, victim_rank: int):
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rid = f"{batch}/0"
    before = wait_for(lambda: five(rt), 120, "five workers")
    rt.call(rt.queue.submit([m.WorkRequest(request_id=rid, batch=batch, work=job)]))
    held = wait_for(lambda: rt.call(rt.store.get_commit(rid)), 60, f"a commit of {rid}")
    rank0, group = held[2]["worker"], held[2]["group"]
    assert held[0] < STEPS and group[0] == rank0 and len(group) == 2  # mid-request, in a group
    victim = group[victim_rank]
    node = "reserved" if victim.startswith("local-reserved") else "spot"
    restarts = restart_lines(rt, node, victim)
    os.kill(before[victim], signal.SIGKILL)
    done = rt.call(rt.queue.wait_batch(batch, 90), timeout=120)
    (result,) = done.results
    assert done.dead == []
    traj, meta = rt.call(rt.store.get(result.key))
    ref = rt.reference
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(ref.latents))
    assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(ref.log_probs))
    assert meta["worker"] != victim and result.resumed_from >= 1  # from a commit, not from step 0
    # The survivors are the same processes (no restart, no reload); the victim is restarted.
    after = wait_for(lambda: five(rt), 120, "the victim restarted")
    assert {w: p for w, p in after.items() if w != victim} == {w: p for w, p in before.items() if w != victim}
    assert after[victim] != before[victim]
    # Where a spare let the group re-form without it (the reserved node), no request lacked the
    # victim: its replacement waited for the re-formed group (its first commit, its end, or the
    # timeout, whichever a loaded machine shows first); the spot node's group needed it at once.
    new = wait_for(lambda: restart_lines(rt, node, victim)[len(restarts):], 30, "the restart line")
    assert len(new) == 1
    if node == "reserved":
        assert "restarting now: a request lacks members" not in new[0], new
    else:
        assert "restarting at once" in new[0] or "restarting now: a request lacks members" in new[0], new
    stats = rt.call(rt.queue.stats()).stats
    return result, stats


def test_sp_group_runs_a_request_bit_identical_to_one_process(runtime):
    rt = runtime
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="plain/0", batch="plain", work=job)]))
    (result,) = rt.call(rt.queue.wait_batch("plain", 90), timeout=120).results
    traj, meta = rt.call(rt.store.get(result.key))
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
    assert result.resumed_from == 0 and len(result.rewards) == 4
    # The group's weights crossed to its node once: rank 0 fetched version 0 from the store, the
    # other rank copied it from rank 0 (the weights log of the run's log folder).
    rank0, other = meta["group"]
    loads = {e.worker: e for e in read_weights_log(rt.log_dir / "weights.log") if e.how in ("store", "peer")}
    assert (loads[rank0].how, loads[other].how, loads[other].peer) == ("store", "peer", rank0)
    assert loads[other].nbytes == loads[rank0].nbytes > 0


@pytest.mark.parametrize("victim_rank", [1, 0], ids=["other-rank", "committing-rank"])
def test_killed_member_regroups_and_the_request_completes_bit_identical(runtime, victim_rank):
    result, stats = run_and_kill(runtime, f"kill{victim_rank}", victim_rank)
    assert stats["expired"] == 0  # kept under its lease and resumed on the node: nothing expired


def test_frozen_member_times_out_is_killed_and_the_request_completes_bit_identical(runtime):
    rt = runtime
    before = wait_for(lambda: five(rt), 120, "five workers")
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="stop/0", batch="stop", work=job)]))
    held = wait_for(lambda: rt.call(rt.store.get_commit("stop/0")), 60, "a commit of stop/0")
    rank0, victim = held[2]["group"]
    os.kill(before[victim], signal.SIGSTOP)  # alive but hung: rank 0's next collective cannot finish
    t0 = time.monotonic()
    progress = rt.call(worker_status(cmdline_arg(before[rank0], b"--bind")), timeout=5)
    assert time.monotonic() - t0 < 1.0 and progress.request_id == "stop/0"  # answered while it waits
    done = rt.call(rt.queue.wait_batch("stop", 90), timeout=120)
    (result,) = done.results
    traj, _ = rt.call(rt.store.get(result.key))
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
    assert result.resumed_from >= 1
    wait_for(lambda: not alive(before[victim]), 30, "the frozen member killed")
    after = wait_for(lambda: five(rt), 120, "the frozen member restarted")
    assert after[rank0] == before[rank0] and after[victim] != before[victim]
    assert rt.call(rt.queue.stats()).stats["expired"] == 0


def test_a_request_that_fails_in_a_group_is_failed_on_the_queue_not_regrouped(runtime):
    rt = runtime  # the reward refuses this prompt after the last step: the request's own failure
    job = m.RolloutWork(prompt="a teapot on the moon", seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="bad/0", batch="bad", work=job)]))
    done = rt.call(rt.queue.wait_batch("bad", 90), timeout=120)
    assert done.dead == ["bad/0"] and done.results == [None]  # failed max_attempts times, dead-lettered
    assert "bad/0 resumes on a new group" not in (rt.log_dir / "agent-reserved.log").read_text() + \
        (rt.log_dir / "agent-spot.log").read_text()


def test_a_node_with_fewer_workers_than_sp_degree_leaves_with_one_line(runtime):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTLIGHT_DIE_WITH_PARENT": "1"}
    agent = subprocess.run(
        [sys.executable, "-m", "spotlight.actors.node", "--controller", runtime.controller.endpoint,
         "--workers", "1", "--node-id", "small-node"],
        capture_output=True, text=True, env=env, timeout=60)
    assert agent.returncode == 2
    lines = [line for line in agent.stderr.splitlines() if "error" in line]
    assert lines == ["node agent: error: runtime.sp_degree (2) is more than the workers a node has "
                     "(node small-node's workers = 1)"], agent.stderr
    assert "small-node" not in runtime.controller.core.nodes  # it said goodbye, not left as lost


def test_notice_stops_the_group_at_one_step_releases_and_another_group_resumes(runtime):
    rt = runtime
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    ids = ["term/0", "term/1"]
    wait_for(lambda: five(rt), 120, "five workers")
    rt.call(rt.queue.submit([m.WorkRequest(request_id=r, batch="term", work=job) for r in ids]))
    spot = wait_for(
        lambda: [r for r in ids
                 if (c := rt.call(rt.store.get_commit(r))) and c[2]["worker"].startswith("local-spot")],
        60, "a commit from the spot node's group")
    agent = rt.agents["spot"].proc
    members = descendants(agent.pid)
    released = rt.call(rt.queue.stats()).stats["released"]
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(rt.config.leave_s + 10) == 0
    assert time.monotonic() - t0 < rt.config.leave_s + 6.0  # budget + process teardown under load
    assert not any(alive(p) for p in members)
    done = rt.call(rt.queue.wait_batch("term", 90), timeout=120)
    assert done.dead == []
    stats = rt.call(rt.queue.stats()).stats
    assert stats["released"] == released + 1 and stats["expired"] == 0
    moved = done.results[ids.index(spot[0])]
    assert moved.resumed_from >= 1  # from the spot group's commit, on the reserved node's group
    for result in done.results:
        traj, meta = rt.call(rt.store.get(result.key))
        assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
        assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(rt.reference.log_probs))
        assert meta["worker"].startswith("local-reserved") or result is not moved
    log = (rt.log_dir / "agent-spot.log").read_text()
    assert "did not stop cleanly" not in log  # both ranks stopped at the same step boundary


def test_cold_restart_baseline_restarts_the_survivor_and_completes_bit_identical(cold_runtime):
    rt = cold_runtime  # runtime.sp_regroup = false: the survivor is restarted, not regrouped
    before = wait_for(lambda: (w := workers(rt)) and len(w) == 2 and w, 120, "two workers")
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="cold/0", batch="cold", work=job)]))
    held = wait_for(lambda: rt.call(rt.store.get_commit("cold/0")), 60, "a commit of cold/0")
    survivor, victim = held[2]["group"]
    os.kill(before[victim], signal.SIGKILL)
    done = rt.call(rt.queue.wait_batch("cold", 120), timeout=150)
    (result,) = done.results
    traj, _ = rt.call(rt.store.get(result.key))
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
    assert result.resumed_from >= 1  # from its commit, on restarted workers
    after = wait_for(lambda: (w := workers(rt)) and len(w) == 2 and w, 120, "both restarted")
    assert after[survivor] != before[survivor] and after[victim] != before[victim]  # both new processes
    log = (rt.log_dir / "agent-reserved.log").read_text()
    assert f"restarting {survivor} cold" in log
