"""The reserved side disappears under a spot node: its agent notices the silent queue, leaves
cleanly (workers stopped, one clear line, exit 2) instead of pulling forever or crashing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.controller.service import controller_handlers
from spotlight.actors.procs import alive, descendants
from spotlight.comm.transport import RpcServer
from spotlight.recipe import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

TINY = [
    "model.checkpoint=none",
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=16",
    "model.image_size=16",
    "model.patch=4",
    "sampler.steps=3",
    "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "run.group_size=4",
]


async def test_agent_leaves_when_the_queue_is_gone(tmp_path: Path, spawn) -> None:
    queue, q_ep = await spawn("spotlight.actors.queue", "--bind", f"ipc://{tmp_path}/q.sock", ready="ready ")
    _, s_ep = await spawn(
        "spotlight.actors.store", "--bind", f"ipc://{tmp_path}/s.sock", ready="tensor store ready on "
    )
    recipe = load_recipe("tiny", [*TINY, "runtime.lease_s=5", "runtime.heartbeat_s=1"])
    core = ControllerCore(recipe, q_ep, s_ep)
    async with RpcServer(controller_handlers(core), bind=f"ipc://{tmp_path}/c.sock") as controller:
        agent, _ = await spawn(
            "spotlight.actors.node",
            "--controller",
            controller.endpoint,
            "--queue-lost-s",
            "1",
            "--rpc-timeout-s",
            "0.5",
            ready="agent ready ",
        )
        workers = descendants(agent.pid)
        assert len(workers) == 1
        queue.kill()  # the reserved node's queue dies (a crash, a network partition)
        await queue.wait()
        async with asyncio.timeout(20):  # silent for 1 s + one pull timeout + leaving
            code = await agent.wait()
        err = (await agent.stderr.read()).decode()
        assert code == 2, err[-2000:]
        assert "has not answered" in err and "node left" in err and "Traceback" not in err, err[-2000:]
        assert not [p for p in workers if alive(p)]  # its worker left with it
