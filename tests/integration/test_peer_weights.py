"""Weights from a peer on the same node, through the real runtime (queue, store, controller, one
node agent with three worker processes over ipc): each published version is fetched from the
tensor store once by the node, the node's other workers copy it from a neighbour through shared
memory (the agent's ``WorkerRun.peer`` hint: the lender's live buffer, no per-lend segment), a
worker switching back to a kept version rebinds it, and every trajectory is bit-identical to the
in-process rollout with that version's weights. With ``runtime.peer_weights = false`` every
worker fetches from the store (the baseline)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from spotlight.actors.procs import alive, descendants
from spotlight.actors.runtime import LocalRuntime
from spotlight.actors.worker.peers import read_weights_log
from spotlight.comm import messages as m
from spotlight.comm.shm import PREFIX, SHM_DIR
from spotlight.comm.transport import RpcClient
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.work import policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4
TINY = [
    "model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16", "model.image_size=16",
    "model.patch=4", f"sampler.steps={STEPS}", "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "run.group_size=4", "explore.candidates=4", "runtime.reserved_workers=3", "runtime.spot_workers=0",
]
SEEDS = [11, 12, 13, 14]
PROMPT = "a red circle"
VERSIONS = 3
REQUESTS = 6  # per version: more than the node's workers, so every worker runs at each version


def versions(recipe) -> list[torch.nn.Module]:
    """VERSIONS models with different weights (what a trainer would publish)."""
    torch.manual_seed(0)
    model, out = policy_model(recipe), []
    for _ in range(VERSIONS):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


def run_versions(rt, recipe, states) -> list:
    """Publish each version, run REQUESTS rollouts on it, check each one bit-identical."""
    model, loads = policy_model(recipe), []
    for v, state in enumerate(states):
        rt.call(rt.store.publish_weights(v, {k: t.numpy() for k, t in state.items()}))
        job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=v)
        reqs = [m.WorkRequest(request_id=f"v{v}/{i}", batch=f"b{v}", work=job) for i in range(REQUESTS)]
        rt.call(rt.queue.submit(reqs))
        done = rt.call(rt.queue.wait_batch(f"b{v}", 120), timeout=150)
        assert done.dead == [] and len(done.results) == REQUESTS
        model.load_state_dict(state)
        ref = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, (3, 16, 16))
        for result in done.results:
            traj, _ = rt.call(rt.store.get(result.key))
            assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(ref.latents))
            assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(ref.log_probs))
        loads.append(done)
    return loads


async def progress(rt) -> list[m.WorkerProgress]:
    """Every live worker's status, asked on its own ipc socket (beside the agent's client)."""
    out = []
    for pid in descendants(rt.agents["reserved"].pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        if b"--bind" in args:
            async with RpcClient(args[args.index(b"--bind") + 1].decode(), timeout=5) as client:
                out.append(await client.call(m.WorkerStatus()))
    return out


@pytest.mark.parametrize("peer_weights", [True, False], ids=["peer", "store-only"])
def test_each_version_crosses_to_the_node_once(tmp_path, peer_weights):
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", [*TINY, f"runtime.peer_weights={str(peer_weights).lower()}",
                                  "runtime.step_delay_s=0.05",  # requests overlap: all three workers pull
                                  f'run.out_dir="{tmp_path}"'])
    states = versions(recipe)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            run_versions(rt, recipe, states)
            status = rt.call(progress(rt))
            pids = rt.pids()
            segments = Counter(int(n[len(PREFIX):].split("-", 1)[0]) for n in os.listdir(SHM_DIR)
                               if n.startswith(PREFIX) and "-peer-" in n)
            log = rt.log_dir / "weights.log"
    assert [p for p in pids if alive(p)] == []
    # Lending copied nothing: every worker's segments are its buffers (the current version and
    # worker_versions = 2 more), made at its start, none per lend.
    assert sorted(n for pid, n in segments.items() if pid in pids) == [3, 3, 3], segments

    events = [e for e in read_weights_log(log) if e.how != "lend"]
    for v in range(VERSIONS):
        loads = [e for e in events if e.version == v]
        workers = {e.worker for e in loads}
        store = [e for e in loads if e.how == "store"]
        peer = [e for e in loads if e.how == "peer"]
        assert len(workers) >= 2, loads  # the node's workers shared the version's requests
        assert len(loads) == len(workers), loads  # one load per worker and version (then it is current)
        if peer_weights:
            assert len(store) == 1, loads  # once per node, not once per worker
            assert len(peer) == len(workers) - 1, loads
            assert all(e.peer and e.peer != e.worker and e.nbytes == store[0].nbytes for e in peer)
        else:
            assert len(store) == len(workers) and peer == [], loads
    # The workers' own counters (WorkerProgress, what an operator's status call sees) say the same.
    assert len(status) == 3
    assert sum(p.weights_fetches for p in status) == sum(e.how == "store" for e in events)
    assert sum(p.weights_peer_copies for p in status) == sum(e.how == "peer" for e in events)
    assert sum(p.peer_bytes for p in status) == sum(e.nbytes for e in events if e.how == "peer")
    assert all(p.peer_s > 0 for p in status if p.weights_peer_copies)
