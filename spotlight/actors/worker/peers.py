"""Weights between the workers of one node: a worker lends a version it holds, a worker that lacks
it borrows it (one shared-memory segment, ``spotlight.parallel.peer``) instead of fetching it from
the tensor store, so a node fetches each version across the network once, not once per worker.

- ``WeightsLender`` (the lender's side, inside the worker's process shell): copies the version's
  arrays into a fresh segment (one per version, shared by the borrowers that ask while it is out)
  and answers ``WeightsLent``; the segment is freed when its borrowers say ``WeightsReturned``,
  after ``runtime.peer_weights_s`` if one never does (a borrower that died), and at exit. A
  SIGKILLed lender's segments are swept by ``shm.sweep_dead`` (its pid is in their names).
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
from typing import Any

import numpy as np

from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorDead, ProtocolError
from spotlight.parallel.peer import copy_into, share_arrays

WEIGHTS_LOG_ENV = "SPOTLIGHT_WEIGHTS_LOG"
"""Environment variable naming the file every weights load (and lend) is logged to (measurement)."""


@dataclass(slots=True)
class _Lent:
    segment: Any  # an OwnedSegment
    layout: dict[str, list]
    nbytes: int
    borrowers: set[str]
    expiry: asyncio.TimerHandle | None = None


class WeightsLender:
    """The segments a worker has lent and not yet had back: one per version, shared by every
    borrower of that version that asks while it is out (versions are immutable). When the last of
    them returns it, it is kept as the spare the next version is copied into (warm pages: a fresh
    segment's page faults ran at ~0.3 GB/s here against ~2 GB/s warm); ``ttl_s`` after the latest
    lend it is freed if a borrower never returned it (it may still be reading: never reused)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lent: dict[int, _Lent] = {}  # version -> its segment
        self._tokens: dict[str, int] = {}  # borrower token -> version
        self._spare = None  # a segment every borrower has returned

    def lend(self, version: int, arrays: dict[str, np.ndarray]) -> m.WeightsLent:
        """Weights ``version`` (``arrays``) in a segment, lent until returned: copied into a fresh
        one unless that version is out already."""
        loop = asyncio.get_running_loop()
        lent = self._lent.get(version)
        if lent is None:
            seg, layout, nbytes = share_arrays(arrays, into=self._spare)
            self._spare = None
            lent = self._lent[version] = _Lent(seg, layout, nbytes, set())
        if lent.expiry is not None:
            lent.expiry.cancel()
        lent.expiry = loop.call_later(self.ttl_s, self._free, version)
        token = secrets.token_hex(8)
        lent.borrowers.add(token)
        self._tokens[token] = version
        return m.WeightsLent(version=version, token=token, segment=lent.segment.name, nbytes=lent.nbytes,
                             layout=lent.layout)

    def returned(self, token: str) -> None:
        """A borrower is done. Unknown tokens are ignored (a late return after the expiry)."""
        version = self._tokens.pop(token, None)
        lent = self._lent.get(version) if version is not None else None
        if lent is not None:
            lent.borrowers.discard(token)
            if not lent.borrowers:
                self._free(version, spare=True)

    def _free(self, version: int, spare: bool = False) -> None:
        lent = self._lent.pop(version, None)
        if lent is not None:
            if lent.expiry is not None:
                lent.expiry.cancel()
            for token in lent.borrowers:
                self._tokens.pop(token, None)
            if spare and self._spare is None:
                self._spare = lent.segment
            else:
                lent.segment.close()

    @property
    def lent(self) -> int:
        """Segments out now."""
        return len(self._lent)

    def close(self) -> None:
        for version in list(self._lent):
            self._free(version)
        if self._spare is not None:
            self._spare.close()
            self._spare = None


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
