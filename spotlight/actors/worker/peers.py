"""Weights between the workers of one node: a worker lends a version it holds, a worker that lacks
it borrows it instead of fetching it from the tensor store, so a node fetches each version across
the network once, not once per worker.

- Lending (``WorkerCore.lend_weights``) copies nothing: a worker's weights already live in one flat
  buffer per version (``spotlight.parallel.flat``, kept by ``WeightsVersions``): a shared-memory
  segment on the CPU, one CUDA tensor on a GPU. ``WeightsLent`` names that live buffer (segment and
  generation, or one CUDA IPC handle) and the version is pinned until the borrower says
  ``WeightsReturned`` or ``runtime.peer_weights_s`` passed.
- ``borrow`` (the borrower's side): asks the peer the node agent named (``WeightsPeer``), ends the
  wait at once if the peer's process exits (a pidfd), copies the whole version with ONE copy into
  its own flat buffer from a mapping it keeps (``PeerMappings``: one per lender's buffer, reused
  across versions, dropped when that lender dies), checks the generation did not move (a lender
  that reloaded after the pin expired), returns it. Every failure is an exception for the caller,
  which fetches from the store instead.
- The weights log (``<log dir>/weights.log``, the node agent's ``--log-dir``; the local runtime's
  log folder):
  one line per version a worker loads, ``pid worker version how bytes seconds copy_seconds
  cpu_seconds end mapped [peer]`` with ``how`` in store | peer | kept (``seconds``: the whole
  load, a wait for the lender's own load included; ``copy_seconds``: the bytes moving;
  ``cpu_seconds``: a peer copy's thread CPU time; ``end``: wall clock at the
  end; ``mapped``: 1 when the copy first mapped the lender's buffer), and one ``lend`` line when a
  worker is asked to lend (what the tests and ``bench/peer_weights.py`` count);
  ``read_weights_log`` parses it.

Knows buffers, segments, sockets and pids; nothing of models, queues or leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spotlight.comm import messages as m
from spotlight.comm.shm import HEADER, open_readonly
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorDead, ProtocolError
from spotlight.parallel.flat import FlatWeights

WEIGHTS_LOG = "weights.log"
"""The file of the node's log folder every weights load (and lend) is logged to (measurement)."""


def lent_message(version: int, token: str, buf: FlatWeights) -> m.WeightsLent:
    """What a lender answers for ``buf`` (holding ``version``, pinned under ``token``)."""
    if buf.device.type == "cpu":
        return m.WeightsLent(version=version, token=token, segment=buf.segment, nbytes=buf.nbytes,
                             layout=buf.layout, generation=buf.generation)
    from spotlight.parallel.device import cuda_ipc_export

    return m.WeightsLent(version=version, token=token, segment="", nbytes=buf.nbytes, layout=buf.layout,
                         generation=buf.generation, cuda=cuda_ipc_export(buf.flat).to_wire())


class PeerMappings:
    """A borrower's mappings of its lenders' buffers, ``(pid, segment)`` -> a read-only mapping
    (or ``(pid, IPC handle)`` -> the imported CUDA tensor): mapped once, pages populated, reused for
    every later version the lender lends from the same buffer (a copy from an existing mapping does
    not fault its pages in again; docs/BENCHMARKS.md "Peer weights on a node" has the figures).
    Mappings of a lender that exited are dropped as it exits (``watch``, which ``borrow`` calls
    after each copy: a pidfd on the loop, immune to pid reuse; the segment's memory is freed then,
    not at the next borrow); at most ``max_maps`` are kept (oldest dropped first). The copy maps
    from a thread, the watch drops on the loop: a lock."""

    def __init__(self, max_maps: int = 16) -> None:
        self.max_maps = max_maps
        self._maps: OrderedDict[tuple[int, Any], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[asyncio.AbstractEventLoop, int]] = {}  # pid -> (loop, pidfd)
        self.mapped = 0  # mappings made (a copy that made one paid for faulting its page table in)

    def segment(self, pid: int, name: str, size: int) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get((pid, name))
        if mm is not None and len(mm) < size:  # the lender's segment grew: map it again
            self.drop(pid, name)
        return self._cached((pid, name), lambda: _map_readonly(name, size))

    def cuda(self, pid: int, handle: dict[str, Any]) -> torch.Tensor:
        from spotlight.parallel.device import cuda_ipc_import

        return self._cached((pid, bytes(handle["handle"])), lambda: cuda_ipc_import(handle))

    def _cached(self, key: tuple[int, Any], make) -> Any:
        """The mapping under ``key`` (most recently used now), made by ``make()`` if missing."""
        with self._lock:
            value = self._maps.get(key)
        if value is None:
            value = make()
            self._add(key, value)
            self.mapped += 1
        with self._lock:
            if key in self._maps:
                self._maps.move_to_end(key)
        return value

    def drop(self, pid: int, name: Any) -> None:
        with self._lock:
            gone = [self._maps.pop(k) for k in list(self._maps)
                    if k[0] == pid and (name is None or k[1] == name)]
        for mapping in gone:
            _close(mapping)

    def watch(self, pid: int) -> None:
        """Drop ``pid``'s mappings the moment it exits (a pidfd reader on the running loop; call
        from the loop's thread), so a dead lender's segment does not stay mapped here."""
        if pid in self._watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.drop(pid, None)
            return
        loop = asyncio.get_running_loop()

        def exited() -> None:
            self._unwatch(pid)
            self.drop(pid, None)

        loop.add_reader(fd, exited)
        self._watched[pid] = (loop, fd)

    def _unwatch(self, pid: int) -> None:
        if (w := self._watched.pop(pid, None)) is not None:
            loop, fd = w
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to remove
                loop.remove_reader(fd)
            os.close(fd)

    def _add(self, key, value) -> None:
        with self._lock:
            self._maps[key] = value
            evicted = []
            while len(self._maps) > self.max_maps:
                evicted.append(self._maps.popitem(last=False)[1])
        for mapping in evicted:
            _close(mapping)

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        for pid in list(self._watched):
            self._unwatch(pid)
        with self._lock:
            maps, self._maps = list(self._maps.values()), OrderedDict()
        for mapping in maps:
            _close(mapping)


def _map_readonly(name: str, size: int) -> mmap.mmap:
    """A read-only shared mapping of segment ``name`` (at least ``size`` bytes), pages populated."""
    fd = open_readonly(name)
    try:
        if os.fstat(fd).st_size < size:
            raise ProtocolError(f"segment {name!r} is smaller than the lent weights")
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _close(mapping: Any) -> None:
    if isinstance(mapping, mmap.mmap):
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when it is collected
            mapping.close()


@dataclass(frozen=True, slots=True)
class Borrowed:
    """A peer copy done: ``copy_s`` wall seconds of the copy itself (after the lender answered),
    ``cpu_s`` of them on a CPU (the copying thread's; less than ``copy_s`` when other processes
    shared its core), ``mapped``: it first mapped the lender's buffer."""

    nbytes: int
    copy_s: float
    cpu_s: float
    mapped: bool


def copy_lent(lent: m.WeightsLent, pid: int, into: FlatWeights, maps: PeerMappings) -> int:
    """Copy the version ``lent`` describes (a buffer of process ``pid``) into ``into``: one copy of
    the whole flat buffer; returns the bytes. Blocking (run it off the loop's thread)."""
    if lent.nbytes != into.nbytes or lent.layout != into.layout:
        raise ProtocolError(f"peer weights' layout differs from this model's ({lent.nbytes} B vs "
                            f"{into.nbytes} B)")
    if into.device.type == "cpu":
        if not lent.segment:
            raise ProtocolError("peer lent a CUDA buffer to a CPU worker")
        mm = maps.segment(pid, lent.segment, HEADER + lent.nbytes)
        src = np.frombuffer(mm, dtype=np.uint8, count=lent.nbytes, offset=HEADER)
        np.copyto(into.flat.numpy(), src)
        gen = int(np.frombuffer(mm, dtype=np.uint64, count=1)[0])
        del src
        if gen != lent.generation:
            raise ProtocolError(f"the lender reloaded its buffer during the copy (generation {gen} != "
                                f"{lent.generation})")
        return lent.nbytes
    if lent.cuda is None:
        raise ProtocolError("peer lent a host segment to a GPU worker")
    from spotlight.parallel.device import peer_copy

    src = maps.cuda(pid, lent.cuda)
    if src.dtype != torch.uint8 or src.numel() != lent.nbytes:
        raise ProtocolError(f"peer's CUDA buffer is {src.dtype}[{src.numel()}], not uint8[{lent.nbytes}]")
    peer_copy(into.flat, src)
    return lent.nbytes


def _timed(fn, *args) -> tuple[Any, float]:
    """``fn(*args)`` and the CPU seconds this thread spent in it."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


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


async def borrow(peer: m.WeightsPeer, version: int, into: FlatWeights, maps: PeerMappings,
                 timeout_s: float, delay_s: float = 0.0) -> Borrowed:
    """Fill ``into`` with weights ``version`` from ``peer``. ``delay_s``: fault injection, a wait
    between the lender's answer and the copy (a borrower that holds the lent version). Raises
    (``ActorTimeout``, ``ActorDead``, ``NotFound``, ``ProtocolError``, ``OSError``) when it could
    not; ``into`` may then hold part of a copy (the caller loads it again from the store)."""
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
            maps.drop(peer.pid, None)
            raise ActorDead(f"peer {peer.worker} (pid {peer.pid}) exited before lending version {version}")
        lent = ask.result()
        if not isinstance(lent, m.WeightsLent) or lent.version != version:
            raise ProtocolError(f"peer {peer.worker} answered {type(lent).__name__} for version {version}")
        try:  # the copy runs off the loop's thread: status and stop are answered meanwhile
            if delay_s:
                await asyncio.sleep(delay_s)
            t0, mapped = time.perf_counter(), maps.mapped
            nbytes, cpu_s = await asyncio.to_thread(_timed, copy_lent, lent, peer.pid, into, maps)
            maps.watch(peer.pid)  # its mapping is kept for the next version, until it exits
            return Borrowed(nbytes, time.perf_counter() - t0, cpu_s, maps.mapped > mapped)
        except BaseException:
            maps.drop(peer.pid, lent.segment or None)
            raise
        finally:  # the lender unpins the version (it would after peer_weights_s anyway)
            with contextlib.suppress(Exception):
                await rpc.call(m.WeightsReturned(token=lent.token), timeout=min(timeout_s, 2.0))


# --- the weights log ------------------------------------------------------------------------------
def log_line(fd: int | None, worker: str, version: int, how: str, nbytes: int = 0, seconds: float = 0.0,
             copy_s: float = 0.0, cpu_s: float = 0.0, mapped: bool = False, peer: str = "") -> None:
    """One O_APPEND write (concurrent workers never interleave within a line); ``end``: the
    wall-clock time now (the load's end), so copies that overlapped can be told apart."""
    if fd is not None:
        line = (f"{os.getpid()} {worker} {version} {how} {nbytes} {seconds:.6f} {copy_s:.6f} "
                f"{cpu_s:.6f} {time.time():.6f} {int(mapped)} {peer}\n")
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
    cpu_s: float  # a peer copy's CPU seconds (its thread's)
    end: float  # wall clock (time.time) at the load's end
    mapped: bool  # a peer copy that first mapped the lender's buffer (its first borrow from it)
    peer: str

    @property
    def node(self) -> str:
        return self.worker.rsplit("/", 1)[0]


def read_weights_log(path: str | os.PathLike) -> list[WeightsEvent]:
    events = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) in (10, 11):
                pid, worker, version, how, nbytes, seconds, copy_s, cpu_s, end, mapped, *peer = parts
                events.append(WeightsEvent(int(pid), worker, int(version), how, int(nbytes), float(seconds),
                                           float(copy_s), float(cpu_s), float(end), mapped == "1",
                                           peer[0] if peer else ""))
    return events
