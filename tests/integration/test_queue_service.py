"""The queue in a real subprocess (``python -m spotlight.actors.queue``) driven by QueueClient
over ipc and tcp: the full lease protocol, a real expiry timer, long polls, batching, SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from spotlight.actors.queue.client import QueueClient
from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorTimeout, NotFound, ProtocolError, StaleAttempt

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]
LEASE_S = 1.0


def req(rid: str, kind: str = "rollout", batch: str = "b0") -> m.WorkRequest:
    work = (m.RolloutWork if kind == "rollout" else m.ExploreWork)(prompt="p", seeds=[1], version=0)
    return m.WorkRequest(request_id=rid, batch=batch, work=work)


def res(reward: float, kind: str = "rollout") -> m.WorkResult:
    if kind == "explore":
        return m.ExploreResult(rewards=[reward])
    return m.RolloutResult(key=f"traj/{reward}", nbytes=8, rewards=[reward])


@pytest.fixture(params=["ipc", "tcp"])
async def queue_proc(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple]:
    bind = "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/queue.ipc"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotlight.actors.queue", "--bind", bind, "--lease-s", str(LEASE_S),
        "--max-attempts", "2", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(20):
            line = (await proc.stdout.readline()).decode().split()
        assert line[:1] == ["ready"], (line, await proc.stderr.read())
        yield proc, line[1]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_queue_service_end_to_end_then_sigterm(queue_proc: tuple) -> None:
    proc, endpoint = queue_proc
    async with RpcClient(endpoint, timeout=5) as rpc:
        q = QueueClient.remote(rpc)
        # long poll: the pull waits in the service until work is submitted
        early = asyncio.ensure_future(q.pull("w0", ["rollout"], max_wait_s=5))
        await asyncio.sleep(0.05)
        await q.submit([req("e0", "explore"), req("r0"), req("r1")])
        first = await early
        assert first.request_id == "r0" and first.attempt == 1 and first.lease_s == LEASE_S
        await q.complete("r0", 1, "w0", res(0.1))

        # expiry by the service's own timer, re-queued with the resume reference
        lease = await q.pull("w1")
        assert lease.request_id == "r1"
        await q.heartbeat("r1", 1, "w1", committed_step=3)
        retry = await q.pull("w3", ["rollout"], max_wait_s=5)  # r1 comes back after LEASE_S
        assert (retry.request_id, retry.attempt) == ("r1", 2)
        assert retry.resume_step == 3 and retry.work == req("r1").work
        with pytest.raises(StaleAttempt):
            await q.complete("r1", 1, "w1", res(-1.0))  # the late, fenced-off result
        await q.submit([req("r2")])
        assert (await q.pull("w2", ["rollout"])).request_id == "r2"
        await q.release("r2", 1, "w2")  # spot notice: back at once
        batch = await q.pull_many("w4", max_n=8)
        assert [g.request_id for g in batch] == ["r2", "e0"]
        result = await q.complete_many(
            [m.Complete(request_id="r1", attempt=2, worker_id="w3", result=res(0.2)),
             m.Complete(request_id="r1", attempt=1, worker_id="w1", result=res(9.0))]
            + [m.Complete(request_id=g.request_id, attempt=g.attempt, worker_id="w4",
                          result=res(0.3, g.kind)) for g in batch])
        assert result.accepted == 3 and [r["index"] for r in result.rejected] == [1]
        done = await q.wait_batch("b0", timeout_s=5)
        assert done.results == [res(0.3, "explore"), res(0.1), res(0.2), res(0.3)]  # e0 r0 r1 r2
        with pytest.raises(ActorTimeout, match="batch b7"):
            await q.wait_batch("b7", timeout_s=0.05)
        with pytest.raises(ProtocolError, match="not a new str"):
            await q.submit([req("r0")])
        stats = (await q.stats()).stats
        assert stats["late_results_dropped"] == 2 and stats["expired"] == 1
        assert stats["released"] == 1 and stats["completed"] == 4
        # The trainer took the results: the queue forgets the iteration (bounded memory).
        forgotten = await q.wait_batch("b0", timeout_s=5, forget=True)
        assert forgotten.results == done.results and (await q.stats()).stats["now_done"] == 0
        with pytest.raises(NotFound, match="unknown request"):  # a zombie's late beat
            await q.heartbeat("r1", 2, "w3")

    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(10):  # bounded; exit is quick, but a loaded 2-core box is slow
        code = await proc.wait()
    assert code == 0, (await proc.stderr.read()).decode()


async def test_dead_letter_through_the_service(queue_proc: tuple) -> None:
    proc, endpoint = queue_proc
    async with RpcClient(endpoint, timeout=5) as rpc:
        q = QueueClient.remote(rpc)
        await q.submit([req("bad", batch="b1")])
        for attempt in (1, 2):
            lease = await q.pull("w", max_wait_s=5)
            assert lease.attempt == attempt
            await q.fail("bad", attempt, "w", "nan loss")
        done = await q.wait_batch("b1", timeout_s=5)
        assert done.results == [None] and done.dead == ["bad"]
        dead = (await q.stats()).dead_letters
        assert dead[0]["request_id"] == "bad" and "nan loss" in dead[0]["reason"]
    proc.send_signal(signal.SIGINT)
    async with asyncio.timeout(10):  # bounded; exit is quick, but a loaded 2-core box is slow
        assert await proc.wait() == 0
