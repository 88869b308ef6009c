"""The controller's socket (in-process server, real ipc socket): registration hands a node what it
needs, bad input gets an error reply and the controller keeps serving; the worker's ipc API
(WorkerRun / WorkerStatus / WorkerStop) over a real socket with an in-process store."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from tiny_recipe import TINY_MODEL

from spotlight.actors.controller.core import ControllerCore, controller_handlers
from spotlight.actors.store.client import TensorStoreClient
from spotlight.actors.worker.core import WorkerCore
from spotlight.actors.worker.service import worker_handlers
from spotlight.comm import messages as m
from spotlight.comm.codec import decode
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import Preempted, ProtocolError
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
