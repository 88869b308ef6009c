"""Message <-> frames: msgpack header plus one raw out-of-band frame per tensor.

Wire layout of one message (a multipart ZeroMQ message, or any list of buffers)::

    frame 0   msgpack {"type": tag, "fields": {...}, "tensors": [{"path", "dtype", "shape",
                                                                 "frame"}, ...]}
    frame 1.. the raw bytes of each tensor, C order, native (little-endian) byte order

A tensor may sit in any field, at any depth of dicts/lists; in the header its slot holds None and
"path" (field name, then dict keys / list indices) says where it goes back. Encoding passes each
array's own buffer (no copy unless the array is not C-contiguous); decoding returns
``np.frombuffer`` views on the received frames (no copy; the view keeps its frame alive).

``decode`` trusts nothing: it checks the tag is known, the exact field set, every field's type
against the message class annotations, the dtype allow-list, shape x itemsize == frame length, and
size limits on the header, on each frame and on the whole message. Any violation raises
``ProtocolError`` naming what was wrong. There is no pickle anywhere.

This module knows the message classes and the frame layout; it knows nothing of sockets.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, fields
from typing import Any, Callable

import msgpack
import numpy as np

from spotlight.comm.messages import MESSAGES, Message
from spotlight.errors import ProtocolError

ALLOWED_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"]
)  # bfloat16 has no numpy dtype: send it viewed as int16 and say so in meta.


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits enforced by ``decode`` (and by the transport's ``zmq.MAXMSGSIZE``)."""

    max_header_bytes: int = 4 << 20
    """msgpack header (frame 0) size cap; headers carry control data, never bulk tensors."""
    max_frame_bytes: int = 1 << 30
    """cap on one tensor frame."""
    max_total_bytes: int = 2 << 30
    """cap on the whole message (header + all tensor frames)."""
    max_tensors: int = 4096
    """cap on tensor frames per message."""

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_frame_bytes", "max_total_bytes", "max_tensors"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()

Frame = Any  # bytes | bytearray | memoryview | zmq.Frame


# --- encode ---------------------------------------------------------------------------------------
def _as_array(value: Any) -> np.ndarray | None:
    """numpy arrays as they are; torch CPU tensors as zero-copy numpy views; else None."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        # torch is not imported here on purpose (it costs a second); .numpy() shares memory and
        # raises for CUDA tensors or bfloat16, which is the clear error we want.
        return value.detach().numpy()
    return None


def _extract(value: Any, path: list, out: list) -> Any:
    """Return ``value`` with tensors replaced by None, appending (path, array) to ``out``."""
    cls = type(value)
    if cls in (int, float, str, bytes, bool) or value is None:
        return value
    if cls is dict:
        return {k: _extract(v, path + [k], out) for k, v in value.items()}
    if cls is list or cls is tuple:
        return [_extract(v, path + [i], out) for i, v in enumerate(value)]
    if isinstance(value, Message):
        return {f.name: _extract(getattr(value, f.name), path + [f.name], out)
                for f in fields(value)}
    arr = _as_array(value)
    if arr is not None:
        out.append((path, arr))
        return None
    return value  # msgpack decides (and raises on anything it cannot pack)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``: header first, then one zero-copy buffer per tensor."""
    if type(msg).TAG not in MESSAGES or MESSAGES[type(msg).TAG] is not type(msg):
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a registered message")
    found: list[tuple[list, np.ndarray]] = []
    body = {f.name: _extract(getattr(msg, f.name), [f.name], found) for f in fields(msg)}
    specs, frames = [], []
    for i, (path, arr) in enumerate(found):
        name = arr.dtype.name
        if name not in ALLOWED_DTYPES or arr.dtype.byteorder == ">":
            raise ProtocolError(f"{type(msg).__name__}.{_where(path)}: dtype {arr.dtype} not allowed")
        shape = list(arr.shape)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # the only copy encode ever makes
        specs.append({"path": path, "dtype": name, "shape": shape, "frame": i + 1})
        frames.append(memoryview(arr.reshape(-1)).cast("B"))  # reshape of C-contiguous: a view
    try:
        header = msgpack.packb({"type": msg.TAG, "fields": body, "tensors": specs},
                               use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {e}") from None
    return [header, *frames]


# --- decode ---------------------------------------------------------------------------------------
def _where(path: list) -> str:
    return ".".join(str(p) for p in path)


def _buffer(frame: Frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


def _unpack_header(frame: Frame, limits: Limits) -> dict:
    raw = _buffer(frame)
    if raw.nbytes > limits.max_header_bytes:
        raise ProtocolError(f"header is {raw.nbytes} bytes, over the {limits.max_header_bytes} limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many unrelated types for garbage input
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict) or set(header) != {"type", "fields", "tensors"}:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise ProtocolError(f"header must be a map with keys type, fields, tensors; got {got}")
    return header


def _place_tensors(cls_name: str, body: dict, specs: Any, frames: list, limits: Limits) -> None:
    if not isinstance(specs, list) or len(specs) > limits.max_tensors:
        raise ProtocolError(f"{cls_name}: 'tensors' must be a list of <= {limits.max_tensors}")
    if len(frames) != len(specs) + 1:
        raise ProtocolError(f"{cls_name}: header lists {len(specs)} tensors but "
                            f"{len(frames) - 1} tensor frames arrived")
    used: set[int] = set()
    for spec in specs:
        if not isinstance(spec, dict) or set(spec) != {"path", "dtype", "shape", "frame"}:
            raise ProtocolError(f"{cls_name}: bad tensor spec {spec!r:.200}")
        path, dtype, shape, index = spec["path"], spec["dtype"], spec["shape"], spec["frame"]
        where = f"{cls_name}.{_where(path) if isinstance(path, list) else path!r}"
        if dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"{where}: dtype {dtype!r:.40} not allowed")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ProtocolError(f"{where}: shape must be a list of ints >= 0, got {shape!r:.200}")
        if type(index) is not int or not 1 <= index < len(frames) or index in used:
            raise ProtocolError(f"{where}: bad or reused frame index {index!r:.40}")
        used.add(index)
        buf = _buffer(frames[index])
        if buf.nbytes > limits.max_frame_bytes:
            raise ProtocolError(f"{where}: frame is {buf.nbytes} bytes, over the "
                                f"{limits.max_frame_bytes} limit")
        dt = np.dtype(dtype)
        if math.prod(shape) * dt.itemsize != buf.nbytes:
            raise ProtocolError(f"{where}: shape {shape} x {dt.itemsize} B != frame of "
                                f"{buf.nbytes} B")
        arr = np.frombuffer(buf, dtype=dt).reshape(shape)  # a view: no copy
        _set_at(body, path, arr, where)


def _set_at(body: dict, path: Any, arr: np.ndarray, where: str) -> None:
    if not isinstance(path, list) or not path:
        raise ProtocolError(f"{where}: tensor path must be a non-empty list")
    node: Any = body
    for key in path[:-1]:
        node = _child(node, key, where)
    last = path[-1]
    _child(node, last, where)  # checks the slot exists
    if node[last] is not None:
        raise ProtocolError(f"{where}: tensor slot is already filled")
    node[last] = arr


def _child(node: Any, key: Any, where: str) -> Any:
    if isinstance(node, dict) and isinstance(key, str) and key in node:
        return node[key]
    if isinstance(node, list) and type(key) is int and 0 <= key < len(node):
        return node[key]
    raise ProtocolError(f"{where}: tensor path does not exist in the fields")


def decode(frames: list[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate ``frames`` and build the message; tensors are views on the frames."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("a message needs at least a header frame")
    if len(frames) > limits.max_tensors + 1:
        raise ProtocolError(f"{len(frames)} frames, over the {limits.max_tensors + 1} limit")
    total = sum(_buffer(f).nbytes for f in frames)
    if total > limits.max_total_bytes:
        raise ProtocolError(f"message is {total} bytes, over the {limits.max_total_bytes} limit")
    header = _unpack_header(frames[0], limits)
    tag = header["type"]
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r:.60}")
    body = header["fields"]
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: 'fields' must be a map")
    if header["tensors"] or len(frames) > 1:
        _place_tensors(cls.__name__, body, header["tensors"], frames, limits)
    return _checker(cls)(body, cls.__name__)


# --- field type checks, compiled once per annotation ---------------------------------------------
Check = Callable[[Any, str], Any]
_CHECKERS: dict[Any, Check] = {}


def _checker(tp: Any) -> Check:
    try:
        return _CHECKERS[tp]
    except (KeyError, TypeError):
        pass
    check = _compile(tp)
    try:
        _CHECKERS[tp] = check
    except TypeError:  # unhashable annotation: just do not cache it
        pass
    return check


def _scalar(tp: type, name: str) -> Check:
    def check(v: Any, where: str) -> Any:
        if type(v) is not tp:
            raise ProtocolError(f"{where}: expected {name}, got {type(v).__name__}")
        return v
    return check


def _float(v: Any, where: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:  # msgpack packs 1.0 as float, but a sender may have written 1
        return float(v)
    raise ProtocolError(f"{where}: expected float, got {type(v).__name__}")


def _tensor(v: Any, where: str) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise ProtocolError(f"{where}: expected a tensor, got {type(v).__name__}")
    return v


def _compile(tp: Any) -> Check:  # noqa: C901 - a flat dispatch on annotation kinds
    if tp is Any:
        return lambda v, where: v
    if tp is float:
        return _float
    if tp in (int, str, bytes, bool):
        return _scalar(tp, tp.__name__)
    if tp is None or tp is type(None):
        return _scalar(type(None), "None")
    if tp is np.ndarray:
        return _tensor
    if isinstance(tp, type) and issubclass(tp, Message):
        return _message_checker(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        allowed = frozenset(args)

        def literal(v: Any, where: str) -> Any:
            if not isinstance(v, str | int) or v not in allowed:
                raise ProtocolError(f"{where}: {v!r:.60} is not one of {sorted(allowed)}")
            return v
        return literal
    if origin is list:
        item = _checker(args[0]) if args else _checker(Any)

        def list_of(v: Any, where: str) -> list:
            if type(v) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return list_of
    if origin is dict:
        value = _checker(args[1]) if args else _checker(Any)

        def dict_of(v: Any, where: str) -> dict:
            if type(v) is not dict:
                raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
            for k in v:
                if type(k) is not str:
                    raise ProtocolError(f"{where}: map keys must be str, got {type(k).__name__}")
            return {k: value(x, f"{where}.{k}") for k, x in v.items()}
        return dict_of
    if origin in (typing.Union, types.UnionType):
        options = [_checker(a) for a in args]

        def union(v: Any, where: str) -> Any:
            for opt in options:
                try:
                    return opt(v, where)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{where}: {type(v).__name__} matches none of {tp}")
        return union
    raise TypeError(f"unsupported field annotation {tp!r} in a message class")


def _message_checker(cls: type[Message]) -> Check:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    expected = frozenset(names)
    # Compile field checkers lazily: a message may name a class declared after it.
    compiled: list[tuple[str, Check]] = []

    def check(v: Any, where: str) -> Message:
        if type(v) is not dict:
            raise ProtocolError(f"{where}: expected the fields of {cls.__name__} as a map")
        if v.keys() != expected:
            missing, unknown = expected - v.keys(), v.keys() - expected
            raise ProtocolError(f"{where}: missing fields {sorted(missing)}, "
                                f"unknown fields {sorted(map(str, unknown))}")
        if not compiled:
            compiled.extend((n, _checker(hints[n])) for n in names)
        return cls(**{n: c(v[n], f"{where}.{n}") for n, c in compiled})
    return check
