"""Weights between the workers of one node: a worker lends a version it holds, a worker that lacks
it borrows it (one shared-memory segment, ``spotlight.parallel.peer``) instead of fetching it from
the tensor store, so a node fetches each version across the network once, not once per worker.

- ``WeightsLender`` (the lender's side, inside the worker's process shell): copies the version's
  arrays into a fresh segment and answers ``WeightsLent``; the segment is freed when the borrower
  says ``WeightsReturned``, after ``runtime.peer_weights_s`` if it never does (a borrower that
  died), and at exit. A SIGKILLed lender's segments are swept by ``shm.sweep_dead`` (its pid is in
  their names).
- ``borrow`` (the borrower's side): asks the peer the node agent named (``WeightsPeer``), ends the
  wait at once if the peer's process exits (a pidfd), copies with ``preadv`` into the borrower's
  own arrays, returns the segment. Every failure is an exception for the caller, which fetches
  from the store instead.
- On a GPU worker the arrays lent and filled are the worker's host copy of its weights (which
  ``WorkerCore`` keeps for the store's loads and copies to the device after each), so the path is
  the same as on CPU. A device-to-device copy (CUDA IPC + cupy peer copy,
  ``spotlight.parallel.peer.copy_from_cuda_peer``, used by the standalone SP harness) is not wired
  in here: it would need the lender to hold its device weights unchanged until the borrower is done.
- The weights log (``SPOTLIGHT_WEIGHTS_LOG``, set by the local runtime to ``<logs>/weights.log``):
  one line per version a worker loads, ``pid worker version how bytes seconds copy_seconds
  [peer]`` with ``how`` in store | peer | kept (``seconds``: the whole load, a wait for the
  lender's own load included; ``copy_seconds``: the bytes moving), and one ``lend`` line when a
  worker is asked to lend (what the tests and ``bench/peer_weights.py`` count);
  ``read_weights_log`` parses it.

Knows segments, sockets and pids; nothing of models, queues or leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorDead, ProtocolError
from spotlight.parallel.peer import copy_into, share_arrays

WEIGHTS_LOG_ENV = "SPOTLIGHT_WEIGHTS_LOG"
"""Environment variable naming the file every weights load (and lend) is logged to (measurement)."""


class WeightsLender:
    """The segments a worker has lent and not yet had back."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._out: dict[str, tuple[object, asyncio.TimerHandle]] = {}  # token -> (segment, expiry)

    def lend(self, version: int, arrays: dict[str, np.ndarray]) -> m.WeightsLent:
        """Copy ``arrays`` (weights ``version``) into a fresh segment, lent until returned."""
        seg, layout, nbytes = share_arrays(arrays)
        token = secrets.token_hex(8)
        expiry = asyncio.get_running_loop().call_later(self.ttl_s, self.returned, token)
        self._out[token] = (seg, expiry)
        return m.WeightsLent(version=version, token=token, segment=seg.name, nbytes=nbytes, layout=layout)

    def returned(self, token: str) -> None:
        """The borrower is done (or its time is up): free the segment. Unknown tokens are ignored
        (a late WeightsReturned after the expiry)."""
        held = self._out.pop(token, None)
        if held is not None:
            seg, expiry = held
            expiry.cancel()
            seg.close()

    @property
    def lent(self) -> int:
        return len(self._out)

    def close(self) -> None:
        for token in list(self._out):
            self.returned(token)


async def _exited(pid: int) -> None:
    """Returns when process ``pid`` exits (a pidfd: no polling); at once if it is gone already."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop, done = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(fd, done.set)
    try:
        await done.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def borrow(peer: m.WeightsPeer, version: int, arrays: dict[str, np.ndarray],
                 timeout_s: float) -> tuple[int, float]:
    """Fill ``arrays`` with weights ``version`` from ``peer``; returns the bytes copied and the
    seconds the copy itself took (after the lender answered). Raises
    (``ActorTimeout``, ``ActorDead``, ``NotFound``, ``ProtocolError``, ``OSError``) when it could
    not; ``arrays`` may then hold part of a copy (the caller loads them again from the store)."""
    async with RpcClient(peer.endpoint, timeout=timeout_s) as rpc:
        ask = asyncio.ensure_future(rpc.call(m.LendWeights(version=version)))
        died = asyncio.ensure_future(_exited(peer.pid))
        try:
            await asyncio.wait([ask, died], return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not ask.done():
                ask.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await died
        if not ask.done() or ask.cancelled():
            with contextlib.suppress(asyncio.CancelledError):
                await ask
            raise ActorDead(f"peer {peer.worker} (pid {peer.pid}) exited before lending version {version}")
        lent = ask.result()
        if not isinstance(lent, m.WeightsLent) or lent.version != version:
            raise ProtocolError(f"peer {peer.worker} answered {type(lent).__name__} for version {version}")
        try:  # the copy runs off the loop's thread: status and stop are answered meanwhile
            t0 = time.perf_counter()
            nbytes = await asyncio.to_thread(copy_into, arrays, lent.segment, lent.layout)
            return nbytes, time.perf_counter() - t0
        finally:  # the lender frees the segment (it would after peer_weights_s anyway)
            with contextlib.suppress(Exception):
                await rpc.call(m.WeightsReturned(token=lent.token), timeout=min(timeout_s, 2.0))


# --- the weights log ------------------------------------------------------------------------------
def log_line(fd: int | None, worker: str, version: int, how: str, nbytes: int = 0, seconds: float = 0.0,
             copy_s: float = 0.0, peer: str = "") -> None:
    """One O_APPEND write (concurrent workers never interleave within a line)."""
    if fd is not None:
        line = f"{os.getpid()} {worker} {version} {how} {nbytes} {seconds:.6f} {copy_s:.6f} {peer}\n"
        os.write(fd, line.encode())


@dataclass(frozen=True, slots=True)
class WeightsEvent:
    pid: int
    worker: str
    version: int
    how: str  # store | peer | kept | lend
    nbytes: int
    seconds: float
    copy_s: float
    peer: str

    @property
    def node(self) -> str:
        return self.worker.rsplit("/", 1)[0]


def read_weights_log(path: str | os.PathLike) -> list[WeightsEvent]:
    events = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) in (7, 8):
                pid, worker, version, how, nbytes, seconds, copy_s, *peer = parts
                events.append(WeightsEvent(int(pid), worker, int(version), how, int(nbytes), float(seconds),
                                           float(copy_s), peer[0] if peer else ""))
    return events
