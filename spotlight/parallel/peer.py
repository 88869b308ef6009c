"""The byte layout a worker's weights have in one flat buffer (``layout_of``: name -> dtype, shape,
64-byte aligned offset), shared by ``spotlight.parallel.flat`` (which lays a model's parameters out
in it) and the peer copy between the workers of a node (``spotlight.actors.worker.peers``, which
checks a lender's layout against its own); and ``memcpy_gbps``, the yardstick a peer copy's
bandwidth is measured against (``bench/peer_weights.py``).

Knows tensors and byte offsets; nothing of segments, sockets or schedulers.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


def layout_of(state: dict[str, torch.Tensor]) -> tuple[dict[str, list], int]:
    """name -> [dtype, shape, offset] with 64-byte aligned offsets, and the total bytes."""
    layout, offset = {}, 0
    for name, t in state.items():
        layout[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), offset]
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return layout, offset


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
