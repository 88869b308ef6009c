"""Message <-> frames: msgpack header plus one raw out-of-band frame per tensor.

Wire layout of one message (a multipart ZeroMQ message, or any list of buffers)::

    frame 0   msgpack map, keys in this order:
                "type":    the message tag
                "tensors": [{"dtype", "shape", "frame"}, ...]   one entry per tensor frame
                "fields":  {field: value}; each tensor's place holds a msgpack ext (code 1)
                           whose data is its frame index (little-endian u32)
    frame 1.. the raw bytes of each tensor, C order, native (little-endian) byte order

A tensor may sit in any field, at any depth of dicts/lists/nested messages. The ext placeholder
marks its place instead of a key path, so both directions stay single C passes of msgpack (no
Python walk over every field). Encoding
passes each array's own buffer (no copy unless the array is not C-contiguous); decoding returns
``np.frombuffer`` views on the received frames (no copy; the view keeps its frame alive; views of
``bytes`` frames are read-only).

``decode`` trusts nothing: it checks the tag is known, the exact field set, every field's type
against the message class annotations, the dtype allow-list, shape x itemsize == frame length, and
size limits on the header, on each frame and on the whole message. Any violation raises
``ProtocolError`` naming what was wrong. There is no pickle anywhere.

This module knows the message classes and the frame layout; it knows nothing of sockets.
"""

from __future__ import annotations

import math
import struct
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
_TENSOR_EXT = 1  # msgpack ext type code of a tensor placeholder; its data: the frame index (u32)
_INDEX = struct.Struct("<I")
_K_TYPE, _K_TENSORS, _K_FIELDS = (msgpack.packb(k) for k in ("type", "tensors", "fields"))
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


def _as_array(value: Any) -> np.ndarray | None:
    """numpy arrays as they are; torch CPU tensors as zero-copy numpy views; else None."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        # torch is not imported here on purpose (it costs a second); .numpy() shares memory and
        # raises for CUDA tensors or bfloat16, which is the clear error we want.
        return value.detach().numpy()
    return None


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``: header first, then one zero-copy buffer per tensor."""
    cls = type(msg)
    if MESSAGES.get(cls.TAG) is not cls:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a registered message")
    specs: list[dict] = []
    frames: list[bytes | memoryview] = []

    def default(obj: Any) -> Any:  # msgpack calls this for what it cannot pack itself
        if isinstance(obj, Message):
            return {n: getattr(obj, n) for n in _field_names(type(obj))}
        arr = _as_array(obj)
        if arr is not None:
            if arr.dtype.name not in ALLOWED_DTYPES or arr.dtype.byteorder == ">":
                raise ProtocolError(f"{cls.__name__}: tensor dtype {arr.dtype} not allowed")
            shape = list(arr.shape)
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)  # the only copy encode ever makes
            frames.append(memoryview(arr.reshape(-1)).cast("B"))  # C-contiguous: a view
            specs.append({"dtype": arr.dtype.name, "shape": shape, "frame": len(frames)})
            return msgpack.ExtType(_TENSOR_EXT, _INDEX.pack(len(frames)))
        if isinstance(obj, np.generic):
            return obj.item()  # numpy scalars travel as plain numbers
        raise TypeError(f"cannot serialize {type(obj).__name__}")

    body = {n: getattr(msg, n) for n in _field_names(cls)}
    try:
        packed_fields = msgpack.packb(body, default=default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode {cls.__name__}: {e}") from None
    # Keys in this order (type, tensors, fields): the decoder builds the tensor views from
    # "tensors" before it unpacks "fields", so placeholders resolve during that one C pass.
    header = b"".join([b"\x83", _K_TYPE, msgpack.packb(cls.TAG), _K_TENSORS,
                       msgpack.packb(specs), _K_FIELDS, packed_fields])
    return [header, *frames]


# --- decode ---------------------------------------------------------------------------------------
def _buffer(frame: Frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else memoryview(frame)


def _tensor_views(specs: Any, frames: list, limits: Limits) -> list[np.ndarray]:
    """Zero-copy views of the tensor frames, after checking every spec against its frame."""
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists {len(specs) if isinstance(specs, list) else specs!r:.40}"
                            f" tensors but {len(frames) - 1} tensor frames arrived")
    views = []
    for i, spec in enumerate(specs, start=1):
        if not isinstance(spec, dict) or spec.keys() != {"dtype", "shape", "frame"}:
            raise ProtocolError(f"bad tensor spec {spec!r:.200}")
        dtype, shape = spec["dtype"], spec["shape"]
        if spec["frame"] != i:
            raise ProtocolError(f"tensor spec {i} names frame {spec['frame']!r:.20}")
        if dtype not in ALLOWED_DTYPES:
            raise ProtocolError(f"tensor {i}: dtype {dtype!r:.40} not allowed")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ProtocolError(f"tensor {i}: shape must be a list of ints >= 0, got {shape!r:.200}")
        buf = _buffer(frames[i])
        if buf.nbytes > limits.max_frame_bytes:
            raise ProtocolError(f"tensor {i}: frame is {buf.nbytes} bytes, over the "
                                f"{limits.max_frame_bytes} limit")
        dt = np.dtype(dtype)
        if math.prod(shape) * dt.itemsize != buf.nbytes:
            raise ProtocolError(f"tensor {i}: shape {shape} x {dt.itemsize} B != frame of "
                                f"{buf.nbytes} B")
        views.append(np.frombuffer(buf, dtype=dt).reshape(shape))  # a view: no copy
    return views


def _read_key(unpacker: msgpack.Unpacker, key: str) -> Any:
    got = unpacker.unpack()
    if got != key:
        raise ProtocolError(f"header must be a map of type, tensors, fields; found key {got!r:.40}")
    return unpacker.unpack()


def decode(frames: list[Frame], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate ``frames`` and build the message; tensors are views on the frames."""
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ProtocolError("a message needs at least a header frame")
    if len(frames) > limits.max_tensors + 1:
        raise ProtocolError(f"{len(frames)} frames, over the {limits.max_tensors + 1} limit")
    total = sum(_buffer(f).nbytes for f in frames)
    if total > limits.max_total_bytes:
        raise ProtocolError(f"message is {total} bytes, over the {limits.max_total_bytes} limit")
    raw = _buffer(frames[0])
    if raw.nbytes > limits.max_header_bytes:
        raise ProtocolError(f"header is {raw.nbytes} bytes, over the {limits.max_header_bytes} limit")
    views: list[np.ndarray] = []
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> np.ndarray:
        if code != _TENSOR_EXT or len(data) != _INDEX.size:
            raise ProtocolError(f"unknown msgpack extension {code}")
        index = _INDEX.unpack(data)[0]
        if not 1 <= index <= len(views) or index in used:
            raise ProtocolError(f"tensor placeholder names frame {index}: missing or reused")
        used.add(index)
        return views[index - 1]

    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=ext_hook,
                                max_buffer_size=max(raw.nbytes, 1))
    try:
        unpacker.feed(raw)
        if unpacker.read_map_header() != 3:
            raise ProtocolError("header must be a map of type, tensors, fields")
        tag = _read_key(unpacker, "type")
        cls = MESSAGES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message type {tag!r:.60}")
        views.extend(_tensor_views(_read_key(unpacker, "tensors"), frames, limits))
        body = _read_key(unpacker, "fields")
        if unpacker.tell() != raw.nbytes:
            raise ProtocolError("trailing bytes after the header")
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises many unrelated types for garbage input
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if len(used) != len(views):
        raise ProtocolError(f"{cls.__name__}: {len(views) - len(used)} tensor frames unplaced")
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: 'fields' must be a map")
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
    if origin is list and (not args or args[0] is Any):
        return _scalar(list, "a list")
    if origin is list:
        item = _checker(args[0])

        def list_of(v: Any, where: str) -> list:
            if type(v) is not list:
                raise ProtocolError(f"{where}: expected a list, got {type(v).__name__}")
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return list_of
    if origin is dict and (not args or args[1] is Any):
        def any_dict(v: Any, where: str) -> dict:  # values unchecked: keep the object as is
            if type(v) is not dict:
                raise ProtocolError(f"{where}: expected a map, got {type(v).__name__}")
            for k in v:
                if type(k) is not str:
                    raise ProtocolError(f"{where}: map keys must be str, got {type(k).__name__}")
            return v
        return any_dict
    if origin is dict:
        value = _checker(args[1])

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
