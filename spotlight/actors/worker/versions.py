"""The weights versions a worker holds: one ``FlatWeights`` buffer each, the model's parameters
bound to the current one, and the pins of the versions lent to neighbours.

- Capacity mirrors ``WeightsHolders`` (the node agent's view): the current version plus the
  ``runtime.worker_versions`` newest it held before when that is > 1, else the current one alone.
  The buffers are allocated (pages faulted in) when the worker starts. Switching to a held version
  rebinds the parameters (no copy); a new version is loaded into an empty buffer, else into the
  one holding the oldest version.
- Lending hands out the live buffer (its segment or CUDA IPC handle) and **pins** it: a pinned
  buffer is not reloaded until every borrower returned it or ``ttl_s`` after the latest lend (a
  borrower that died or hangs). ``slot_for`` waits for that, so a lender's switch to a new version
  may wait for its borrowers' copies when every buffer is lent. A copy racing a
  reload after the ttl is caught by the buffer's generation (``FlatWeights.reload``).

The clock is the event loop's (a test's fake loop clock works). Knows buffers, versions and
borrowers' tokens; nothing of sockets, stores or the wire.
"""

from __future__ import annotations

import asyncio
import secrets

import torch

from spotlight.errors import ConfigError
from spotlight.parallel.flat import FlatWeights, bind
from spotlight.parallel.peer import layout_of


def check_fits(nbytes: int, capacity: int, free_bytes: int, device: str) -> None:
    """``capacity`` whole copies of ``nbytes`` of weights must fit in ``free_bytes`` of ``device``
    with room for activations (a tenth kept free): else one ConfigError line naming the field."""
    if capacity > 1 and capacity * nbytes > 0.9 * free_bytes:
        gib = 2**30
        raise ConfigError(
            f"runtime.worker_versions keeps {capacity} copies of the weights ({capacity * nbytes / gib:.1f} "
            f"GiB) on {device}, which has {free_bytes / gib:.1f} GiB free: set runtime.worker_versions = 1 "
            f"(one copy; switching versions then loads from a neighbour or the store)")


class WeightsVersions:
    def __init__(self, model: torch.nn.Module, keep: int, ttl_s: float) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.model, self.ttl_s = model, ttl_s
        self.capacity = keep + 1 if keep > 1 else 1
        device = next(model.parameters()).device
        if device.type == "cuda":  # a big model's kept versions may not fit beside it: say so first
            free, _ = torch.cuda.mem_get_info(device)
            _, nbytes = layout_of(model.state_dict())  # one buffer's bytes (aligned tensors)
            check_fits(nbytes, self.capacity, free + nbytes, str(device))  # the model's own copy is reused
        # Every buffer up front, pages faulted in: a load never lands in cold memory.
        first = FlatWeights.like(model)
        first.load_state(model.state_dict())
        bind(model, first)
        self.buffers = [first] + [FlatWeights(first.layout, first.nbytes, first.device)
                                  for _ in range(self.capacity - 1)]
        self.current: FlatWeights | None = None  # bound and whole (the model's version)
        self._pins: dict[str, tuple[FlatWeights, float]] = {}  # token -> (buffer, deadline)
        self._unpinned = asyncio.Event()

    def held(self, version: int) -> FlatWeights | None:
        return next((b for b in self.buffers if b.version == version), None)

    def versions(self) -> set[int]:
        return {b.version for b in self.buffers if b.version is not None}

    def use(self, buf: FlatWeights) -> None:
        """Bind the model to ``buf`` (whole: its ``version`` is set)."""
        if buf is not self.current:
            bind(self.model, buf)
        self.current = buf

    # --- pins ----------------------------------------------------------------------------------
    def pin(self, buf: FlatWeights) -> str:
        """A borrower's token for ``buf``; every pin of a buffer ends ``ttl_s`` after its latest."""
        deadline = asyncio.get_running_loop().time() + self.ttl_s
        token = secrets.token_hex(8)
        for t, (b, _) in list(self._pins.items()):
            if b is buf:
                self._pins[t] = (b, deadline)
        self._pins[token] = (buf, deadline)
        return token

    def unpin(self, token: str) -> None:
        """A borrower is done (unknown tokens: a late return after the ttl, ignored)."""
        if self._pins.pop(token, None) is not None:
            self._unpinned.set()

    def pinned(self, buf: FlatWeights) -> bool:
        now = asyncio.get_running_loop().time()
        for token, (b, deadline) in list(self._pins.items()):
            if deadline <= now:
                del self._pins[token]
            elif b is buf:
                return True
        return False

    @property
    def lent(self) -> int:
        """Buffers pinned now."""
        return sum(self.pinned(b) for b in self.buffers)

    # --- loading -------------------------------------------------------------------------------
    async def slot_for(self, version: int) -> FlatWeights:
        """A buffer to load ``version`` into (not held): an empty one, else the
        unpinned one holding the oldest version, waiting for a pin to end when all are pinned.
        It is marked reloading (no version, next generation) before it is returned."""
        if self.held(version) is not None:
            raise ValueError(f"version {version} is held already")
        while True:
            free = [b for b in self.buffers if not self.pinned(b)]
            if free:
                break
            deadlines = [d for _, d in self._pins.values()]
            self._unpinned.clear()
            wait = max(0.0, min(deadlines) - asyncio.get_running_loop().time())
            try:
                async with asyncio.timeout(wait + 1e-3):
                    await self._unpinned.wait()
            except TimeoutError:
                pass  # the earliest pin expired: look again
        empty = [b for b in free if b.version is None]
        buf = empty[0] if empty else min(free, key=lambda b: b.version)
        if buf is self.current:
            self.current = None
        buf.reload()
        return buf

    def close(self) -> None:
        self._pins.clear()
        for b in self.buffers:
            b.close()
        self.buffers, self.current = [], None
