"""The tensor store as a real subprocess, over ipc and tcp loopback, with and without shm."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np
import pytest
import zmq
import zmq.asyncio

from spotlight.actors.store.client import TensorStoreClient
from spotlight.comm import codec
from spotlight.comm import messages as m
from spotlight.comm import shm as segments
from spotlight.errors import CapacityError, NotFound, ProtocolError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MAX_BYTES = 256 << 20


async def start_store(bind: str, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "spotlight.actors.store",
        "--bind",
        bind,
        "--max-bytes",
        str(MAX_BYTES),
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)  # the service's readiness line
    except TimeoutError:
        proc.kill()
        raise
    assert line.startswith(b"tensor store ready on "), line + await proc.stderr.read()
    return proc, line.decode().split()[-1]


async def stop_store(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), 5)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise


@pytest.fixture(params=["ipc", "tcp"])
async def store(request, tmp_path):
    bind = f"ipc://{tmp_path}/store.sock" if request.param == "ipc" else "tcp://127.0.0.1:0"
    proc, endpoint = await start_store(bind)
    yield endpoint
    assert await stop_store(proc) == 0


def bit_pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bits viewed as float32: NaN payloads and denormals included, so equality is bitwise."""
    return np.random.default_rng(seed).integers(0, 2**32, nbytes // 4, dtype=np.uint32).view(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
async def test_large_tensor_roundtrip_bit_exact(store, shm):
    x = bit_pattern(32 << 20).reshape(1024, -1)
    small = np.arange(10, dtype=np.int64)
    async with TensorStoreClient.remote(store, shm=shm, timeout=20) as client:
        assert client.uses_shm is shm
        await client.put("traj/1", {"x": x, "small": small}, {"reward": 0.25})
        got, meta = await client.get("traj/1")
        assert same_bits(got["x"], x) and np.array_equal(got["small"], small)
        assert meta == {"reward": 0.25}
        buf = np.empty_like(x)
        got, _ = await client.get("traj/1", out={"x": buf})
        assert got["x"] is buf and same_bits(buf, x)
        await client.publish_weights(3, {"w": x})
        assert same_bits((await client.get_weights(3))["w"], x)
        await client.delete("traj/1")
        with pytest.raises(NotFound, match="traj/1"):
            await client.get("traj/1")
    async with TensorStoreClient.remote(store, shm=not shm, timeout=20) as other:
        # Written through one path, read through the other: the store is the same either way.
        assert same_bits((await other.get_weights(3))["w"], x)
        assert await other.latest_version() == 3


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
async def test_background_commits_flush_then_newest(store, shm):
    def latent(step: int) -> np.ndarray:
        return bit_pattern(2 << 20, seed=step)  # 2 MB: over the shm threshold

    async with TensorStoreClient.remote(store, shm=shm, timeout=20) as worker:
        for step in range(8):
            for rid in ("a", "b", "c"):
                worker.commit_nowait(
                    rid, step, {"x_t": latent(step), "lp": np.full(step + 1, step)}, {"k": step}, attempt=2
                )
        worker.commit_nowait("a", 3, {"x_t": latent(3)})  # a late, older step: must not win
        await worker.flush(timeout=20)
    async with TensorStoreClient.remote(store, timeout=20) as reader:
        for rid in ("a", "b", "c"):
            step, tensors, meta = await reader.get_commit(rid)
            assert step == 7 and meta == {"k": 7, "attempt": 2}
            assert same_bits(tensors["x_t"], latent(7))
            assert tensors["lp"].tolist() == [7] * 8
        assert await reader.keys("commit/") == ["commit/a", "commit/b", "commit/c"]
        await reader.drop_commit("a")
        assert await reader.get_commit("a") is None


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
async def test_append_commits_coalesce_then_seal_as_the_trajectory(store, shm):
    def row(step: int) -> np.ndarray:
        return bit_pattern(1 << 20, seed=100 + step).reshape(1, -1)  # 1 MB a step: the shm path

    async with TensorStoreClient.remote(store, shm=shm, timeout=20) as worker:
        worker.commit_nowait(
            "r", 1, {"lat": np.concatenate([row(0), row(1)]), "lp": np.zeros((1, 2))}, attempt=1
        )
        await worker.flush(timeout=20)
        for step in range(2, 9):  # no await between them: they coalesce into one pending append
            worker.commit_nowait(
                "r",
                step,
                {"lat": row(step), "lp": np.full((1, 2), step - 1.0)},
                {"step": step},
                attempt=1,
                base=step - 1,
            )
            if step == 5:
                await worker.flush(timeout=20)  # ...and some reach the store on their own
        worker.commit_nowait("r", 8, {"lat": row(0), "lp": np.zeros((1, 2))}, base=7)  # a repeat: ignored
        with pytest.raises(ValueError, match="pending"):
            worker.commit_nowait("r", 10, {"lat": row(10), "lp": np.zeros((1, 2))}, base=9)  # a gap
        await worker.flush(timeout=20)
        step, tensors, meta = await worker.get_commit("r")
        assert step == 8 and meta == {"step": 8, "attempt": 1}
        assert same_bits(tensors["lat"], np.concatenate([row(k) for k in range(9)]))
        assert tensors["lp"][:, 0].tolist() == list(range(8))
        worker.commit_nowait(
            "r", 9, {"lat": row(9), "lp": np.full((1, 2), 8.0)}, {"step": 9}, attempt=1, base=8
        )
        await worker.seal_commit("r", 9, "traj/r", {"rewards": np.ones(2, np.float32)}, {"done": True})
        assert await worker.get_commit("r") is None
        traj, meta = await worker.get("traj/r")
        assert same_bits(
            traj["lat"], np.concatenate([tensors["lat"], row(9)])
        )  # the last commit went with it
        assert traj["rewards"].tolist() == [1.0, 1.0] and meta == {"done": True}
        with pytest.raises(NotFound):
            await worker.seal_commit("r", 9, "traj/r")


async def test_background_commit_error_surfaces_on_flush(store):
    async with TensorStoreClient.remote(store, shm=False, timeout=20) as worker:
        worker.commit_nowait("big", 0, {"x": np.zeros(MAX_BYTES // 4 + 1, np.float32)})
        with pytest.raises(CapacityError, match="cap"):
            await worker.flush(timeout=20)
        worker.commit_nowait("ok", 0, {"x": np.zeros(4, np.float32)})  # the error was reported once
        await worker.flush(timeout=20)
        assert await worker.get_commit("big") is None
        assert (await worker.get_commit("ok"))[0] == 0


async def test_capacity_error_over_shm_leaves_store_unchanged(store):
    async with TensorStoreClient.remote(store, shm=True, timeout=20) as client:
        await client.put("keep", {"x": np.ones(1 << 20, np.float32)})
        with pytest.raises(CapacityError, match="cap"):
            await client.put("huge", {"x": np.ones(MAX_BYTES // 4, np.float32)})
        assert await client.keys() == ["keep"]
        await client.put("keep", {"x": np.full(1 << 20, 2.0, np.float32)})  # segments recycled
        assert (await client.get("keep"))[0]["x"][0] == 2.0


async def raw_call(endpoint: str, frames: list) -> m.Message:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"corr0001", *frames])
        reply = await asyncio.wait_for(sock.recv_multipart(), 10)
    finally:
        sock.close(linger=0)
    assert reply[0] == b"corr0001"
    return codec.decode(reply[1:])


async def test_malformed_frames_get_error_replies_and_service_keeps_serving(store):
    bad = [
        [b"\xc1not msgpack"],
        [codec.encode(m.Get(key="k"))[0], b"an unexpected tensor frame"],
        codec.encode(
            m.ShmPut(
                key="k",
                tensors={},
                refs={"x": {"name": "../etc/passwd", "gen": 1, "dtype": "float32", "shape": [1]}},
                meta={},
            )
        ),
        codec.encode(m.ShmFetch(what="key", name="")),
    ]
    for frames in bad:
        reply = await raw_call(store, frames)
        assert isinstance(reply, m.ErrorReply), reply
        assert reply.code in ("ProtocolError", "RemoteError"), reply
    async with TensorStoreClient.remote(store, timeout=10) as client:
        await client.put("k", {"x": np.arange(4, dtype=np.float32)})
        assert (await client.get("k"))[0]["x"].tolist() == [0, 1, 2, 3]
        with pytest.raises(ProtocolError):  # a forged ref is refused through the client too
            await client._call(
                m.ShmPut(
                    key="z",
                    tensors={},
                    meta={},
                    refs={"x": {"name": "spotlight-store-1-x", "gen": 5, "dtype": "float32", "shape": [1]}},
                )
            )
        assert await client.keys() == ["k"]


async def test_sigterm_exits_quickly_and_unlinks_segments(tmp_path):
    proc, endpoint = await start_store(f"ipc://{tmp_path}/s.sock")
    async with TensorStoreClient.remote(endpoint, shm=True, timeout=10) as client:
        await client.put("k", {"x": np.ones(1 << 20, np.float32)})
    mine = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"{segments.PREFIX}{proc.pid}-")]
    assert mine, "the shm put should have used a segment of this service"
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 2) == 0
    assert loop.time() - t0 < 2
    left = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"{segments.PREFIX}{proc.pid}-")]
    assert left == []


async def test_seal_behind_a_refused_commit_raises_the_refusal():
    from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore

    core = TensorStoreCore(TensorStoreConfig(max_bytes=64))
    async with TensorStoreClient.local(core) as worker:
        await worker.commit("r", 1, {"lat": np.zeros((2, 4), np.float32)})  # 32 B
        worker.commit_nowait("r", 2, {"lat": np.zeros((9, 4), np.float32)}, base=1)  # refused: over the cap
        with pytest.raises(CapacityError):  # not a trajectory missing its last step
            await worker.seal_commit("r", 2, "traj/r")
        assert core.get_commit("r")[0] == 1 and core.keys("traj/") == []


async def test_each_step_commit_leaves_during_the_yield_after_it(store):
    """A worker yields once per step and then computes (blocking its loop). The step's commit
    must be on its way during that one yield: another client sees it while the worker still
    computes, step after step (not coalesced into a later step's send)."""
    import concurrent.futures
    import time

    def newest_step_seen(want: int) -> int | None:  # another client, in another thread
        async def poll() -> int | None:
            async with TensorStoreClient.remote(store, shm=False, timeout=5) as reader:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    held = await reader.get_commit("w")
                    if held is not None and held[0] >= want:
                        return held[0]
                    await asyncio.sleep(0.005)
                return None if held is None else held[0]

        return asyncio.run(poll())

    with concurrent.futures.ThreadPoolExecutor(1) as other:
        async with TensorStoreClient.remote(store, shm=False, timeout=20) as worker:
            for step in range(1, 7):
                rows = np.full((step + 1 if step == 1 else 1, 4), float(step), np.float32)
                worker.commit_nowait("w", step, {"lat": rows}, base=None if step == 1 else step - 1)
                await asyncio.sleep(0)  # the worker's one yield per step
                # ...then "compute": this loop is blocked while the other client looks.
                assert other.submit(newest_step_seen, step).result(10) == step
            await worker.flush(timeout=20)
            assert (await worker.get_commit("w"))[1]["lat"][:, 0].tolist() == [1, 1, 2, 3, 4, 5, 6]
