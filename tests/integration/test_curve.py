"""CURVE on every reserved socket: the queue and tensor-store processes and the controller serve
with the reserved key pair; a node with a listed key is served, a node with an unlisted key (or
none) is refused by each of them and they keep serving. End to end: a spot agent holding only
its own key folder joins a TCP runtime and runs a rollout through all three sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_recipe import TINY_MODEL

from spotlight.actors.config import ServeConfig
from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.controller.service import controller_handlers
from spotlight.actors.procs import alive
from spotlight.actors.runtime import LocalRuntime
from spotlight.comm import messages as m
from spotlight.comm.auth import (
    cluster_client_keys,
    cluster_server_keys,
)
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import ActorTimeout, NotFound
from spotlight.recipe import load_recipe
from spotlight.work import policy_model as build_policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TINY = [
    *TINY_MODEL,
    "run.group_size=4",
    "explore.candidates=4",
]



@pytest.fixture
async def services(keys: dict[str, Path], spawn) -> AsyncIterator[dict[str, str]]:
    reserved = str(keys["reserved"])
    queue, q_ep = await spawn(
        "spotlight.actors.queue", "--bind", "tcp://127.0.0.1:0", "--keys", reserved, ready="ready "
    )
    store, s_ep = await spawn(
        "spotlight.actors.store",
        "--bind",
        "tcp://127.0.0.1:0",
        "--keys",
        reserved,
        ready="tensor store ready on ",
    )
    recipe = load_recipe("tiny", [*TINY, "runtime.lease_s=5", "runtime.heartbeat_s=1"])
    core = ControllerCore(recipe, q_ep, s_ep)
    async with RpcServer(
        controller_handlers(core), bind="tcp://127.0.0.1:0", curve=cluster_server_keys(reserved)
    ) as controller:
        yield {"queue": q_ep, "store": s_ep, "controller": controller.endpoint}
    for proc in (queue, store):  # CURVE or not, they still stop cleanly
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0


# One harmless request per socket: each answers it with a typed reply.
PROBES = {
    "queue": (m.QueueStats(), m.QueueStatsReply),
    "store": (m.ListKeys(prefix=""), m.KeyList),
    "controller": (m.Register(node_id="probe", kind="spot", workers=1), m.Registered),
}


@pytest.mark.parametrize("socket", sorted(PROBES))
async def test_each_reserved_socket_serves_listed_keys_and_refuses_others(services, keys, socket) -> None:
    endpoint, (probe, reply_type) = services[socket], PROBES[socket]
    async with RpcClient(endpoint, timeout=5, curve=cluster_client_keys(keys["good"])) as node:
        assert isinstance(await node.call(probe), reply_type)
    for curve in (cluster_client_keys(keys["bad"]), None):  # unlisted key; no key at all
        async with RpcClient(endpoint, timeout=0.5, curve=curve) as intruder:
            with pytest.raises(ActorTimeout):  # the handshake fails: no request reaches a handler
                await intruder.call(probe)
    async with RpcClient(endpoint, timeout=5, curve=cluster_client_keys(keys["reserved"])) as own:
        assert isinstance(await own.call(probe), reply_type)  # the reserved side's own clients


def test_key_folder_errors_name_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        cluster_client_keys(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotFound, match="node.key_secret"):
        cluster_client_keys(tmp_path / "empty")
    with pytest.raises(NotFound, match="controller.key_secret"):
        cluster_server_keys(tmp_path / "empty")


def test_spot_agent_with_its_own_keys_runs_a_rollout_over_tcp(keys, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", [*TINY, f'run.out_dir="{tmp_path}"'])
    torch.manual_seed(0)
    weights = {k: v.numpy() for k, v in build_policy_model(recipe).state_dict().items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    recipe = load_recipe(
        recipe.to_dict(), ['runtime.transport="tcp"', "runtime.reserved_workers=0", "runtime.spot_workers=0"]
    )
    with LocalRuntime(recipe, serve=ServeConfig(host="127.0.0.1", port=0, keys=str(keys["reserved"]))) as rt:
        rt.call(rt.store.publish_weights(0, weights))
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "spotlight.actors.node",
                "--controller",
                rt.endpoint,
                "--keys",
                str(keys["good"]),
                "--node-id",
                "spot-1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            assert agent.stdout is not None
            line = agent.stdout.readline().decode()  # bounded by the module timeout
            assert line.startswith("agent ready spot-1"), (line, agent.stderr.read().decode()[-2000:])
            job = m.RolloutWork(prompt="a red circle", seeds=[1, 2, 3, 4], version=0)
            rt.call(rt.queue.submit([m.WorkRequest(request_id="r0", batch="b0", work=job)]))
            done = rt.call(rt.queue.wait_batch("b0", 60), timeout=90)
            (result,) = done.results
            traj, meta = rt.call(rt.store.get(result.key))
            assert meta["worker"] == "spot-1/w0" and traj["latents"].shape == (4, 4, 3, 16, 16)
            assert np.isfinite(traj["rewards"]).all()
            assert "spot-1" in rt.controller.core.nodes
        finally:
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(10) == 0
            agent.stdout.close()
            agent.stderr.close()
        assert "spot-1" not in rt.controller.core.nodes  # it deregistered (answered) before it exited
        pids = rt.pids()
    assert [p for p in pids if alive(p)] == []
