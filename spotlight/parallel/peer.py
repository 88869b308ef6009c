"""Weights from a peer on the same node: a worker that already holds the current version lends
them through one shared-memory segment, and a joining worker copies them into its own parameters
instead of fetching them from the reserved store (each node fetches a version across the network
once, not once per worker).

CPU: POSIX shared memory (`spotlight.comm.shm.OwnedSegment`), one memcpy out of the lender's
parameters and one into the joiner's. GPU: `spotlight.parallel.device` moves the same layout with
CUDA IPC / cupy peer copy. The layout (name -> dtype, shape, byte offset) travels in the
`WeightsShared` message; a layout from a peer is checked against the joiner's own parameters.

The runtime's workers do not copy into a segment to lend: their parameters already live in one
flat buffer per version (`spotlight.parallel.flat`), lent as is; `layout_of` is shared with them.
`share` / `copy_from_segment` / `copy_from_cuda_peer` serve the SP group members and the standalone
harness (`bench/elastic_sp.py`).

This module knows state dicts and segments; nothing of sockets or schedulers.
"""

from __future__ import annotations

import numpy as np
import torch

from spotlight.comm.shm import HEADER, OwnedSegment, open_readonly
from spotlight.errors import ProtocolError

_ALIGN = 64


def layout_of(state: dict[str, torch.Tensor]) -> tuple[dict[str, list], int]:
    """name -> [dtype, shape, offset] with 64-byte aligned offsets, and the total bytes."""
    layout, offset = {}, 0
    for name, t in state.items():
        layout[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), offset]
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, offset


def share(model: torch.nn.Module) -> tuple[OwnedSegment, dict[str, list], int]:
    """Copy `model`'s state dict into a fresh segment; the caller keeps it alive until the peer
    has copied (and closes it)."""
    return share_arrays({k: v.detach().contiguous().numpy() for k, v in model.state_dict().items()})


def share_arrays(arrays: dict[str, np.ndarray], into: OwnedSegment | None = None
                 ) -> tuple[OwnedSegment, dict[str, list], int]:
    """Copy `arrays` (a worker's weights: its parameters' memory, or a kept copy) into a segment:
    `into` when it is large enough (a segment no reader uses any more: its pages are warm, where a
    fresh segment's are faulted in and zeroed at a fraction of memcpy speed), else a fresh one
    (`into` is then closed). The caller keeps it alive until the peer has copied (and closes it)."""
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    layout, nbytes = layout_of(state)
    if into is not None and len(into.mm) >= HEADER + nbytes:
        seg = into
    else:
        if into is not None:
            into.close()
        seg = OwnedSegment(nbytes)
    try:
        buf = memoryview(seg.mm)[HEADER:]
        for name, (_, _, off) in layout.items():
            t = state[name]
            if t.numel():
                dst = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=off).view(t.shape)
                dst.copy_(t)
                del dst
        del buf
    except BaseException:
        seg.close()
        raise
    return seg, layout, nbytes


def copy_from_segment(model: torch.nn.Module, segment: str, layout: dict[str, list]) -> int:
    """Fill `model`'s (CPU) parameters and buffers from a peer's segment; returns the bytes copied."""
    state = model.state_dict()
    for name, t in state.items():
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ProtocolError(f"peer weight {name}: needs a contiguous CPU tensor here")
    with torch.no_grad():
        return copy_into({k: v.detach().numpy() for k, v in state.items()}, segment, layout)


def copy_into(arrays: dict[str, np.ndarray], segment: str, layout: dict[str, list]) -> int:
    """Fill `arrays` (contiguous, writable) from a peer's segment; returns the bytes copied.

    Read with `preadv` into each array's own memory: one kernel copy from the shared pages, no
    fresh mapping to fault in page by page (docs/BENCHMARKS.md compares the two). A
    layout that does not match `arrays` is a ProtocolError before any byte is written."""
    import os

    if set(layout) != set(arrays):
        missing, extra = sorted(set(arrays) - set(layout))[:3], sorted(set(layout) - set(arrays))[:3]
        raise ProtocolError(f"peer weights do not match this model (missing {missing}, unexpected {extra})")
    for name, (dtype, shape, off) in layout.items():
        a = arrays[name]
        if [str(a.dtype), list(a.shape)] != [dtype, shape]:
            raise ProtocolError(f"peer weight {name}: {dtype}{shape} != {a.dtype}{list(a.shape)}")
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise ProtocolError(f"peer weight {name}: needs a contiguous, writable array here")
    fd = open_readonly(segment)
    total = 0
    try:
        size = os.fstat(fd).st_size - HEADER
        for name, (_, _, off) in layout.items():
            a = arrays[name]
            n = a.nbytes
            if not isinstance(off, int) or off < 0 or off + n > size:
                raise ProtocolError(f"peer weight {name} lies outside the segment")
            if n and os.preadv(fd, [a.reshape(-1).view(np.uint8)], HEADER + off) != n:
                raise ProtocolError(f"peer weight {name}: short read from the segment")
            total += n
    finally:
        os.close(fd)
    return total


def share_cuda(model: torch.nn.Module) -> tuple[dict[str, dict], int]:
    """CUDA IPC handles of `model`'s (contiguous, CUDA) state: name -> handle fields. Nothing is
    copied on the lender's side; its tensors stay alive as long as the model does."""
    from spotlight.parallel.device import cuda_ipc_export

    state = model.state_dict()
    handles = {k: cuda_ipc_export(v.detach()).to_wire() for k, v in state.items()}
    return handles, sum(v.numel() * v.element_size() for v in state.values())


def copy_from_cuda_peer(model: torch.nn.Module, handles: dict[str, dict]) -> int:
    """Fill `model`'s CUDA state from a peer's IPC handles, GPU to GPU (cupy peer copy when it
    works, torch's copy otherwise); returns the bytes copied."""
    from spotlight.parallel.device import cuda_ipc_import, peer_copy

    state = model.state_dict()
    if set(handles) != set(state):
        raise ProtocolError("peer weights (CUDA IPC) do not match this model's parameters")
    total = 0
    with torch.no_grad():
        for name, h in handles.items():
            src, dst = cuda_ipc_import(h), state[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ProtocolError(f"peer weight {name}: {src.dtype}{list(src.shape)} != {dst.dtype}")
            peer_copy(dst, src.contiguous())
            total += dst.numel() * dst.element_size()
    torch.cuda.synchronize()
    return total


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """This machine's warm memcpy bandwidth for a buffer of `nbytes` (the peer copy's yardstick)."""
    import time

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch outside the timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
