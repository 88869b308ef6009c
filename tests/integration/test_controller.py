"""The controller's socket (in-process server, real ipc socket): registration hands a node what it
needs, bad input gets an error reply and the controller keeps serving; a node declared lost or
registering again has its leases re-queued at once; a node that cannot serve the run's device
leaves with one line; the worker's ipc API (WorkerRun /
WorkerStatus / WorkerStop) over a real socket with an in-process store."""

from __future__ import annotations

import asyncio
import os
import sys

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from tiny_recipe import TINY_MODEL

from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.controller.service import Controller, controller_handlers
from spotlight.actors.queue.core import RequestQueueCore
from spotlight.actors.queue.service import QueueService
from spotlight.actors.store.client import TensorStoreClient
from spotlight.actors.store.service import TensorStoreService
from spotlight.actors.worker.core import WorkerCore
from spotlight.actors.worker.service import worker_handlers
from spotlight.comm import messages as m
from spotlight.comm.codec import decode
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import Preempted, ProtocolError
from spotlight.parallel.device import probe_cuda
from spotlight.recipe import load_recipe
from spotlight.work import policy_model as build_policy_model

pytestmark = pytest.mark.timeout(60)

TINY = [
    *TINY_MODEL,
    "run.group_size=4",
    "explore.candidates=4",
]


async def test_register_and_bad_frames(tmp_path):
    recipe = load_recipe("tiny", [*TINY, "runtime.lease_s=7", "runtime.heartbeat_s=2"])
    core = ControllerCore(recipe, "tcp://q:1", "tcp://s:2")
    async with RpcServer(controller_handlers(core), bind=f"ipc://{tmp_path}/c.sock") as server:
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(server.endpoint)
        try:
            for frames in (
                [b"\xc1garbage"],
                [msgpack.packb({"type": "c.register", "tensors": [], "fields": {}})],
                [
                    msgpack.packb(
                        {
                            "type": "q.pull",
                            "tensors": [],
                            "fields": {"worker_id": "w", "kinds": ["rollout"], "max_wait_s": 0.0},
                        }
                    )
                ],
            ):
                await raw.send_multipart([b"corr0001", *frames])
                reply = decode((await raw.recv_multipart())[1:])
                assert isinstance(reply, m.ErrorReply) and reply.code == "ProtocolError", reply
        finally:
            raw.close(linger=0)
        async with RpcClient(server.endpoint, timeout=5) as client:
            with pytest.raises(ProtocolError):
                await client.call(m.Register(node_id="", kind="spot", workers=1))
            reg = await client.call(m.Register(node_id="n1", kind="spot", workers=2))
            assert (reg.queue, reg.store, reg.lease_s) == ("tcp://q:1", "tcp://s:2", 7.0)
            assert load_recipe(reg.recipe) == recipe  # a spot node needs nothing but the address
            assert core.nodes["n1"]["workers"] == 2
            await client.call(m.Deregister(node_id="n1", reason="test"))
            assert "n1" not in core.nodes and core.left[0]["reason"] == "test"


@pytest.mark.skipif(probe_cuda() is None, reason="CUDA is usable here")
async def test_a_node_without_the_runs_device_leaves_with_one_line(tmp_path):
    # The node learns run.device at registration: a CPU host joining a cuda run says so and
    # deregisters, instead of starting workers that each die with a traceback.
    core = ControllerCore(load_recipe("tiny", [*TINY, 'run.device="cuda"']), "tcp://127.0.0.1:1",
                          "tcp://127.0.0.1:2")
    async with RpcServer(controller_handlers(core), bind=f"ipc://{tmp_path}/c.sock") as server:
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "spotlight.actors.node", "--controller", server.endpoint,
            "--workers", "1", "--node-id", "cpu-node", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "SPOTLIGHT_DIE_WITH_PARENT": "1"})
        _, err = await asyncio.wait_for(agent.communicate(), 50)
    assert agent.returncode == 2
    lines = [line for line in err.decode().splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "node agent: error: run.device = 'cuda' but CUDA is not usable here: "), err.decode()
    assert "cpu-node" not in core.nodes and core.left[-1]["node_id"] == "cpu-node"


async def test_lost_or_restarted_nodes_leases_requeued_at_once(tmp_path):
    """A node registering again under its name (a restarted agent) has the old incarnation's
    leases re-queued before it is answered; a silent node's are re-queued when it is declared
    lost; both long before their 60 s leases would expire."""
    recipe = load_recipe("tiny", [*TINY, "runtime.lease_s=60", "runtime.heartbeat_s=0.1",
                                  "runtime.node_lost_s=2"])
    queue = RequestQueueCore(recipe.runtime.queue())
    released: asyncio.Queue = asyncio.Queue()
    release_node = queue.release_node

    def spy(node_id: str) -> list[str]:
        ids = release_node(node_id)
        released.put_nowait((node_id, ids))
        return ids

    queue.release_node = spy
    job = m.RolloutWork(prompt="p", seeds=[1], version=0)
    async with (
        QueueService(queue, bind=f"ipc://{tmp_path}/q.sock") as q,
        TensorStoreService(f"ipc://{tmp_path}/s.sock", shm=False) as s,
    ):
        core = ControllerCore(recipe, q.endpoint, s.endpoint)
        async with (
            Controller(core, bind=f"ipc://{tmp_path}/c.sock", queue=q.endpoint, store=s.endpoint,
                       timeout=5) as ctl,
            RpcClient(ctl.endpoint, timeout=5) as node,
        ):
            for name in ("a", "b"):
                await node.call(m.Register(node_id=name, kind="spot", workers=1))
            queue.submit([m.WorkRequest(request_id=r, batch="x", work=job) for r in ("ra", "rb")])
            assert queue.pull("a/w0").request_id == "ra" and queue.pull("b/w0").request_id == "rb"
            await node.call(m.Register(node_id="b", kind="spot", workers=1))  # b restarted
            assert released.get_nowait() == ("b", ["rb"])  # before the reply
            async with asyncio.timeout(10):  # no beats: both are declared lost (2 s + a sweep)
                lost = dict([await released.get(), await released.get()])
            assert lost == {"a": ["ra"], "b": []}  # b's new incarnation held nothing
            assert queue.stats()["node_lost_requeued"] == 2 and queue.stats()["expired"] == 0
            assert [x.get("requeued") for x in core.left if x["node_id"] == "a"] == [["ra"]]


async def test_worker_api_over_ipc(tmp_path):
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", TINY)
    torch.manual_seed(0)
    model = build_policy_model(recipe)
    async with TensorStoreClient.local() as store:
        await store.publish_weights(3, {k: v.numpy() for k, v in model.state_dict().items()})
        core = WorkerCore(recipe, store, worker_id="n/w0")
        try:
            async with (
                RpcServer(worker_handlers(core), bind=f"ipc://{tmp_path}/w.sock") as server,
                RpcClient(server.endpoint, timeout=30) as client,
            ):

                def lease(rid: str, kind: str) -> m.LeaseGrant:
                    job = (m.RolloutWork if kind == "rollout" else m.ExploreWork)(
                        prompt="a red circle", seeds=[1, 2, 3, 4], version=3
                    )
                    return m.LeaseGrant(
                        request_id=rid, attempt=1, deadline=0.0, lease_s=30.0, batch="b", work=job
                    )

                idle = await client.call(m.WorkerStatus())
                assert idle.request_id is None and idle.version is None
                done = await client.call(m.WorkerRun(lease=lease("r", "rollout")))
                assert done.result.key == "traj/r" and len(done.result.rewards) == 4
                traj, meta = await store.get("traj/r")
                assert traj["latents"].shape == (4, 4, 3, 16, 16) and traj["log_probs"].shape == (3, 4)
                assert meta["version"] == 3 and await store.get_commit("r") is None  # commit dropped
                explored = await client.call(m.WorkerRun(lease=lease("e", "explore")))
                assert np.allclose(explored.result.rewards, done.result.rewards)  # same seeds, same SDE
                stopped = await client.call(m.WorkerStop())
                assert stopped.request_id is None and stopped.version == 3
                with pytest.raises(Preempted):  # a stopping worker takes no new work
                    await client.call(m.WorkerRun(lease=lease("late", "rollout")))
        finally:
            core.close()
