"""The device backends, probed before use: which device a run computes on, how bulk tensors move
between the processes of a node (CUDA IPC), how weights move between GPUs (cupy peer copy), which
collective backend a group uses (NCCL / gloo).

Every path is **probed by using it once**, not by importing it: cupy imports without a driver and
fails on first use (`cudaErrorInsufficientDriver`); a CUDA build of torch may see no device. A path
that was asked for and is missing fails with one line naming the field (`run.device`); `auto`
takes the best path present and says which.

CUDA IPC here is torch's own mechanism (the one `torch.multiprocessing` uses), with the handle
sent as plain bytes and ints in a typed message instead of pickled: the exporter keeps the tensor
alive until the importer has copied or dropped it.

This module knows devices and the libraries that drive them; nothing of schedulers or models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spotlight.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def probe_cuda() -> str | None:
    """None when a CUDA device computes; else the reason it does not."""
    try:
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no device, no driver, or a CPU build of torch)"
        x = torch.ones(4, device="cuda")
        if float((x * 2).sum()) != 8.0:
            return "a CUDA kernel returned a wrong result"
        torch.cuda.synchronize()
        return None
    except Exception as e:  # any failure of the first use is the answer
        return f"{type(e).__name__}: {e}"[:200]


def probe_nccl() -> str | None:
    reason = probe_cuda()
    if reason:
        return reason
    import torch.distributed as dist

    return None if dist.is_nccl_available() else "torch was built without NCCL"


def probe_cupy() -> str | None:
    """None when cupy works on this machine (import alone proves nothing)."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install -e .[gpu])"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA device"
        if int(cupy.arange(4).sum()) != 6:
            return "a cupy kernel returned a wrong result"
        return None
    except Exception as e:  # cudaErrorInsufficientDriver and friends surface here
        return f"{type(e).__name__}: {e}"[:200]


def probe_xfuser() -> str | None:
    """None when xfuser imports on a CUDA machine (it does not import without a GPU)."""
    reason = probe_cuda()
    if reason:
        return reason
    try:
        import xfuser  # noqa: F401
    except Exception as e:
        return f"xfuser unavailable: {type(e).__name__}: {e}"[:200]
    return None


def resolve_device(requested: str) -> torch.device:
    """`run.device` = auto | cpu | cuda -> the device to compute on; a requested device that is
    not present is one clear ConfigError line."""
    if requested not in DEVICES:
        raise ConfigError(f"run.device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return torch.device("cpu")
    reason = probe_cuda()
    if requested == "cuda" and reason:
        raise ConfigError(f"run.device = 'cuda' but CUDA is not usable here: {reason}")
    return torch.device("cpu" if reason else "cuda")


def group_backend(device: torch.device) -> str:
    """The collective backend of a group on `device`: NCCL on GPUs (probed), gloo on the CPU."""
    if device.type != "cuda":
        return "gloo"
    reason = probe_nccl()
    if reason:
        raise ConfigError(f"run.device = 'cuda' needs NCCL for SP groups: {reason}")
    return "nccl"


# --- CUDA IPC: a tensor of one process seen by another process of the node, no copy ----------------
@dataclass(slots=True)
class IpcHandle:
    """Everything a peer needs to map a CUDA tensor: plain values, msgpack-able (no pickle)."""

    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def to_wire(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def cuda_ipc_export(t: torch.Tensor) -> IpcHandle:
    """Share `t` (on a CUDA device) with another process; keep `t` alive while it is used."""
    if t.device.type != "cuda":
        raise ValueError(f"CUDA IPC needs a CUDA tensor, got one on {t.device}")
    (device, handle, size, off, rc_handle, rc_off, ev_handle, ev_sync) = t.untyped_storage()._share_cuda_()
    return IpcHandle(str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()),
                     t.storage_offset(), int(device), bytes(handle), int(size), int(off),
                     bytes(rc_handle), int(rc_off), None if ev_handle is None else bytes(ev_handle),
                     bool(ev_sync))


def cuda_ipc_import(h: IpcHandle | dict) -> torch.Tensor:
    """The peer's tensor, mapped into this process (same memory: copy it before the peer frees it)."""
    if isinstance(h, dict):
        h = IpcHandle(**{k: bytes.fromhex(v) if k.endswith("handle") and isinstance(v, str) else v
                         for k, v in h.items()})  # JSON carries the handles as hex
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device, h.handle, h.storage_bytes, h.storage_offset, h.ref_counter_handle,
        h.ref_counter_offset, h.event_handle, h.event_sync_required,
    )
    dtype = getattr(torch, h.dtype)
    return torch.empty(0, dtype=dtype, device=f"cuda:{h.device}").set_(
        storage, h.offset, h.shape, h.stride
    )


# --- peer copy between GPUs ------------------------------------------------------------------------------
def peer_copy(dst: torch.Tensor, src: torch.Tensor) -> str:
    """Copy device tensor `src` into `dst` (another GPU, or the same): cupy's peer memcpy over
    NVLink/PCIe when cupy works, torch's copy otherwise. Returns which path ran."""
    if dst.nbytes != src.nbytes or dst.dtype != src.dtype:
        raise ValueError(f"peer copy of {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("peer copy needs contiguous tensors")
    if probe_cupy() is None:
        import cupy

        torch.cuda.synchronize(src.device)  # src written by torch kernels: finished before cupy reads
        cupy.cuda.runtime.memcpyPeer(dst.data_ptr(), dst.device.index, src.data_ptr(), src.device.index,
                                     src.nbytes)
        cupy.cuda.runtime.deviceSynchronize()
        return "cupy"
    dst.copy_(src)
    return "torch"


def cuda_memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth on the current GPU (the peer copy's yardstick)."""
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9
