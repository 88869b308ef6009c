"""RpcServer/RpcClient over real sockets (ipc and tcp loopback): bad input never kills the server,
errors map back to their classes, timeouts, CURVE accept/refuse; shm across processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from spotlight.comm import messages as m
from spotlight.comm.auth import client_keys, generate_keypair, keys_main, server_keys
from spotlight.comm.codec import Limits, decode, encode
from spotlight.comm.transport import RpcClient, RpcServer
from spotlight.errors import (
    ActorTimeout,
    ConfigError,
    NotFound,
    ProtocolError,
    RemoteError,
    StaleAttempt,
)

pytestmark = pytest.mark.timeout(30)
LIMITS = Limits(max_header_bytes=4096, max_frame_bytes=1 << 16, max_total_bytes=1 << 18)


def handlers() -> dict:
    def get(msg: m.Get) -> m.Message:
        if msg.key == "missing":
            raise NotFound(f"no key {msg.key}")
        if msg.key == "bug":
            raise ZeroDivisionError("division by zero")
        return m.Tensors(key=msg.key, tensors={"x": np.arange(1000, dtype=np.float32)},
                         meta={"n": 1000})

    async def release(msg: m.Release) -> m.Message:
        await asyncio.sleep(0.01)  # an awaiting handler runs in its own task
        raise StaleAttempt(f"{msg.request_id} attempt {msg.attempt} is fenced")

    return {m.Get: get, m.Release: release}


@pytest.fixture(params=["ipc", "tcp"])
def bind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/rpc.ipc"


async def raw_exchange(sock: zmq.asyncio.Socket, frames: list[bytes]) -> m.Message:
    await sock.send_multipart([b"corr0001", *frames])
    async with asyncio.timeout(5):
        reply = await sock.recv_multipart()
    assert reply[0] == b"corr0001"
    return decode(reply[1:])


async def test_server_survives_bad_frames_and_keeps_serving(bind: str) -> None:
    async with RpcServer(handlers(), bind=bind, limits=LIMITS) as server:
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.connect(server.endpoint)
        try:
            bad = [
                ([b"\xc1\xc1 not msgpack"], "not valid msgpack"),
                ([msgpack.packb({"type": "nope", "tensors": [], "fields": {}})], "unknown message"),
                ([msgpack.packb({"type": "s.get", "tensors": [], "fields": {"key": 5}})],
                 "Get.key: expected str"),
                ([msgpack.packb({"type": "s.get", "tensors": [], "fields": {"key": "k" * 5000}})],
                 "over the 4096 limit"),
                (encode(m.Ok()), "does not handle Ok"),
            ]
            for frames, match in bad:
                reply = await raw_exchange(raw, frames)
                assert isinstance(reply, m.ErrorReply) and reply.code == "ProtocolError"
                assert match in reply.message
            await raw.send_multipart([b"c" * 100, *encode(m.Get(key="k"))])  # corr id too long
            reply = await raw_exchange(raw, [])  # (ordered after it) no header at all
            assert "at least a header" in reply.message and server.stats["dropped"] == 1
            await raw.send_multipart([b"c", *encode(m.Get(key="k")), b"\x00" * (1 << 17)])
            # ^ a frame above MAXMSGSIZE: libzmq drops the connection, Python never sees it
        finally:
            raw.close(linger=1000)  # flush the oversized message before closing
        async with RpcClient(server.endpoint, timeout=5) as client:
            reply = await client.call(m.Get(key="k"))
            np.testing.assert_array_equal(reply.tensors["x"], np.arange(1000, dtype=np.float32))
            with pytest.raises(NotFound, match="no key missing"):
                await client.call(m.Get(key="missing"))
            with pytest.raises(RemoteError, match="ZeroDivisionError"):
                await client.call(m.Get(key="bug"))
            with pytest.raises(StaleAttempt, match="fenced"):
                await client.call(m.Release(request_id="r", attempt=1, worker_id="w"))
            with pytest.raises(ProtocolError, match="does not handle Ok"):
                await client.call(m.Ok())
            many = await asyncio.gather(*[client.call(m.Get(key=str(i))) for i in range(50)])
            assert [r.key for r in many] == [str(i) for i in range(50)]  # correlation holds
        assert server.stats["protocol_errors"] == len(bad) + 2  # + empty body + Ok call


async def test_call_to_nobody_times_out(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.ipc"
    async with RpcClient(endpoint, timeout=0.2) as client:
        with pytest.raises(ActorTimeout, match="no reply within 0.2s"):
            await client.call(m.Get(key="k"))


async def test_curve_accepts_listed_key_and_refuses_others(tmp_path: Path) -> None:
    server_pub, server_sec = generate_keypair(tmp_path / "server", "server")
    good_pub, good_sec = keys_main(str(tmp_path / "clients"), "good")
    _, bad_sec = generate_keypair(tmp_path / "other", "intruder")
    with pytest.raises(ConfigError, match="already exists"):
        generate_keypair(tmp_path / "clients", "good")
    assert oct(good_sec.stat().st_mode & 0o777) == "0o600"
    keys = server_keys(server_sec, tmp_path / "clients")
    async with RpcServer(handlers(), bind="tcp://127.0.0.1:0", curve=keys) as server:
        good = client_keys(good_sec, server_pub)
        async with RpcClient(server.endpoint, timeout=5, curve=good) as client:
            assert (await client.call(m.Get(key="a"))).key == "a"
        bad = client_keys(bad_sec, server_pub)
        async with RpcClient(server.endpoint, timeout=0.5, curve=bad) as intruder:
            with pytest.raises(ActorTimeout):
                await intruder.call(m.Get(key="a"))
        async with RpcClient(server.endpoint, timeout=0.5) as plain:  # no CURVE at all
            with pytest.raises(ActorTimeout):
                await plain.call(m.Get(key="a"))
        async with RpcClient(server.endpoint, timeout=5, curve=good) as client:
            assert (await client.call(m.Get(key="b"))).key == "b"  # still serving
