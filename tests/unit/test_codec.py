"""Codec: round trips (tensors zero-copy), every malformed input -> ProtocolError; shm views."""

from __future__ import annotations

import struct
import typing

import msgpack
import numpy as np
import pytest

from spotlight.comm import messages as m
from spotlight.comm.codec import Limits, _checker, decode, encode
from spotlight.errors import ProtocolError

pytestmark = pytest.mark.timeout(20)


def header(tag: str, fields: dict, tensors: list | None = None) -> bytes:
    """A header laid out as the encoder does: type, tensors, fields (in that order)."""
    return msgpack.packb({"type": tag, "tensors": tensors or [], "fields": fields})


def slot(frame: int, code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, struct.pack("<I", frame))


def put(a: object, dtype: str = "float32", shape: list | None = None, frame: int = 1) -> bytes:
    spec = {"dtype": dtype, "shape": [2] if shape is None else shape, "frame": frame}
    return header("s.put", {"key": "k", "tensors": {"a": a}, "meta": {}}, [spec])


def test_every_registered_message_has_a_supported_schema() -> None:
    for tag, cls in m.MESSAGES.items():
        assert cls.TAG == tag
        for name, tp in typing.get_type_hints(cls).items():
            if name not in ("TAG", "KIND"):  # class constants, not fields
                _checker(tp)  # raises TypeError on an annotation the decoder cannot check


def test_round_trip_scalars_and_nested_messages() -> None:
    explore = m.ExploreWork(prompt="a cat", seeds=[9, 10], version=4, cache="fbc:0.2")
    grant = m.LeaseGrant(request_id="r", attempt=2, deadline=1.5, lease_s=30.0, batch="it4/explore",
                         work=explore, resume_step=3)
    assert decode(encode(m.LeaseBatch(leases=[grant, grant]))) == m.LeaseBatch(leases=[grant] * 2)
    # Typed work: the union decodes to the class whose fields arrived, and a malformed job is refused.
    rollout = m.RolloutWork(prompt="a cat", seeds=[1], version=0)
    back = decode(encode(m.Submit(requests=[m.WorkRequest(request_id="x", batch="b", work=rollout)])))
    assert type(back.requests[0].work) is m.RolloutWork and back.requests[0].work == rollout
    frames = encode(m.Complete(request_id="x", attempt=1, worker_id="w",
                               result=m.RolloutResult(key="k", nbytes=1, rewards=[0.5])))
    assert decode(frames).result == m.RolloutResult(key="k", nbytes=1, rewards=[0.5])
    header = encode(m.WorkRequest(request_id="x", batch="b", work=rollout))[0]
    with pytest.raises(ProtocolError, match="work"):  # a job with a misspelt field is no job
        decode([bytes(header).replace(b"seeds", b"seedz")])
    assert decode(encode(m.Ok())) == m.Ok()
    assert decode(encode(m.Heartbeat(request_id="r", attempt=1, worker_id="w"))).committed_step is None


def test_tensors_are_zero_copy_both_ways() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    nested = np.ones(5, dtype=np.int64)
    frames = encode(m.Put(key="k", tensors={"a": a}, meta={"deep": [{"x": nested}]}))
    assert len(frames) == 3
    assert np.shares_memory(np.frombuffer(frames[1], np.float32), a)  # encode passes the buffer
    out = decode(frames)
    assert np.shares_memory(out.tensors["a"], a)  # decode views the frame
    np.testing.assert_array_equal(out.tensors["a"], a)
    np.testing.assert_array_equal(out.meta["deep"][0]["x"], nested)
    # Non-contiguous input is made contiguous (the only copy); 0-d and empty shapes survive.
    for x in (a[:, ::2], np.array(3.5), np.zeros((0, 7), np.float16), np.array([True, False])):
        y = decode(encode(m.Put(key="k", tensors={"x": x}, meta={}))).tensors["x"]
        assert y.shape == x.shape and y.dtype == x.dtype and np.array_equal(x, y)


def test_torch_cpu_tensors_are_accepted_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    frames = encode(m.Put(key="k", tensors={"t": t}, meta={}))
    assert np.shares_memory(np.frombuffer(frames[1], np.float32), t.numpy())
    np.testing.assert_array_equal(decode(frames).tensors["t"], t.numpy())


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "at least a header"),
        ([b"\xc1garbage"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "not valid msgpack"),
        ([msgpack.packb({"type": "ok", "fields": {}})], "map of type, tensors, fields"),
        ([msgpack.packb({"fields": {}, "type": "ok", "tensors": []})], "found key 'fields'"),
        ([header("ok", {}) + b"\x00"], "trailing bytes"),
        ([header("nope", {})], "unknown message type 'nope'"),
        ([header("q.release", {"request_id": "r", "attempt": 1})], r"missing fields \['worker_id'\]"),
        ([header("ok", {"extra": 1})], r"unknown fields \['extra'\]"),
        (
            [header("q.release", {"request_id": "r", "attempt": "1", "worker_id": "w"})],
            "Release.attempt: expected int, got str",
        ),
        (
            [header("q.release", {"request_id": "r", "attempt": True, "worker_id": "w"})],
            "expected int, got bool",
        ),
        ([header("q.pull", {"worker_id": "w", "kinds": ["train"], "max_wait_s": 0.0})], r"Pull.kinds\[0\]"),
        ([header("q.submit", {"requests": {"a": 1}})], "expected a list"),
        (
            [header("ok", {}, [{"dtype": "uint8", "shape": [1], "frame": 1}])],
            "lists 1 tensors but 0 tensor frames",
        ),
        ([header("ok", {}), b"x"], "lists 0 tensors but 1 tensor frames"),
        ([put(slot(1), dtype="object"), b"\x00" * 8], "dtype 'object' not allowed"),
        ([put(slot(1), shape=[3]), b"\x00" * 8], r"shape \[3\] x 4 B != frame of 8 B"),
        ([put(slot(1), frame=2), b"\x00" * 8], "names frame 2"),
        ([put(slot(2)), b"\x00" * 8], "names frame 2: missing or reused"),
        ([put([slot(1), slot(1)]), b"\x00" * 8], "missing or reused"),
        ([put(None), b"\x00" * 8], "1 tensor frames unplaced"),
        ([put(slot(1, code=5)), b"\x00" * 8], "unknown msgpack extension 5"),
        (
            [header("s.put", {"key": "k", "tensors": {"a": None}, "meta": {}})],
            "Put.tensors.a: expected a tensor, got NoneType",
        ),
    ],
)
def test_malformed_frames_raise_protocol_error(frames: list, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_size_limits() -> None:
    limits = Limits(max_header_bytes=256, max_frame_bytes=1024, max_total_bytes=4096)
    with pytest.raises(ProtocolError, match="header is .* over the 256 limit"):
        decode(encode(m.ErrorReply(code="x", message="y" * 300)), limits)
    with pytest.raises(ProtocolError, match="frame is 2048 bytes"):
        decode(encode(m.Put(key="k", tensors={"a": np.zeros(256)}, meta={})), limits)
    big = {f"t{i}": np.zeros(128) for i in range(5)}
    with pytest.raises(ProtocolError, match="over the 4096 limit"):
        decode(encode(m.Put(key="k", tensors=big, meta={})), limits)
    with pytest.raises(ValueError, match="max_frame_bytes"):
        Limits(max_frame_bytes=0)


def test_encode_refuses_bad_values() -> None:
    with pytest.raises(ProtocolError, match="Put: tensor dtype object not allowed"):
        encode(m.Put(key="k", tensors={"a": np.array([object()])}, meta={}))
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(m.Put(key="k", tensors={}, meta={"f": {1, 2}}))  # a set is not msgpack
