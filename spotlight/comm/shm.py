"""Shared-memory segments for the tensor store's same-machine bulk path (Linux ``/dev/shm``).

Why not one fresh segment per tensor: a fresh tmpfs page costs an allocation and a zeroing on
first touch, several times slower than a warm memcpy (docs/BENCHMARKS.md "Tensor transport"). So
the **service owns every segment** and recycles them: a writer asks for a segment (``lend``), copies into it
through a mapping it keeps cached (warm after the first use), and the service then *adopts* the
segment as the stored tensor's memory without copying. When the service drops the last array
viewing a segment (key deleted, commit replaced, version freed), a finalizer returns the segment
to a bounded free pool for the next writer.

Ownership, in one place:

* The service creates, recycles and unlinks segments (``ServiceSegments.close`` unlinks all;
  ``sweep_dead`` removes segments of a service that was SIGKILLed, found by the pid in the name).
* Clients only attach and unmap (``ClientMappings``); they never unlink.
* A reader copies out of a segment and then checks its **generation** word (header bytes 0..8):
  the service bumps it each time it lends the segment to a new writer, so a reader that raced a
  recycle sees a changed generation and gets ``ProtocolError`` instead of torn data (x86 stores
  are ordered; other architectures would need explicit fences).

This module knows files, mappings and generations; it knows nothing of messages or keys.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from spotlight.comm.codec import ALLOWED_DTYPES
from spotlight.errors import ProtocolError

SHM_DIR = "/dev/shm"
HEADER = 64  # generation word + padding; data starts 64-byte aligned
PREFIX = "spotlight-store-"
_ALIGN = 1 << 16  # size classes: round capacities up to 64 KiB so similar tensors share segments


def _path(name: str) -> str:
    if "/" in name or not name.startswith(PREFIX):
        raise ProtocolError(f"bad shared-memory segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def _map(name: str, size: int | None = None, populate: bool = False) -> mmap.mmap:
    """Map segment ``name``; create it with ``size`` bytes if given (exclusively). ``populate``:
    fault every page in now, in one call (faster than faulting them page by page)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = os.open(_path(name), flags, 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size or 0, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor


def _gen_word(mm: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.uint64, count=1)


def view(mm: mmap.mmap, dtype: str, shape: list[int]) -> np.ndarray:
    """A zero-copy array on a segment's data area; dtype and shape come from a peer: checked."""
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype!r:.40} not allowed in shared memory")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"bad tensor shape {shape!r:.100}")
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if HEADER + count * dt.itemsize > len(mm):
        raise ProtocolError(f"tensor {dtype}{shape} does not fit its {len(mm)} B segment")
    return np.frombuffer(mm, dtype=dt, count=count, offset=HEADER).reshape(shape)


def sweep_dead() -> list[str]:
    """Unlink segments left by tensor-store services that no longer run (SIGKILL, OOM)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
        except (ValueError, PermissionError):
            continue  # not ours to judge
    return removed


class ServiceSegments:
    """The service side: lends segments to writers, adopts them as storage, recycles them."""

    def __init__(self, pool_bytes: int = 1 << 30, lend_ttl_s: float = 60.0) -> None:
        self.pool_bytes = pool_bytes
        self.lend_ttl_s = lend_ttl_s
        self._prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._count = 0
        self._gen: dict[str, int] = {}  # every live segment -> its current generation
        self._size: dict[str, int] = {}
        self._free: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._free_bytes = 0
        self._lent: dict[str, float] = {}  # name -> deadline (monotonic)
        self._held: weakref.WeakKeyDictionary[mmap.mmap, str] = weakref.WeakKeyDictionary()
        self._closed = False
        # A tiny segment a client attaches to prove it shares this machine's /dev/shm.
        self.probe = self._create(0)

    def _create(self, nbytes: int) -> str:
        name = f"{self._prefix}{self._count}"
        self._count += 1
        size = HEADER + -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        _map(name, size).close()
        self._gen[name], self._size[name] = 0, size
        return name

    def lend(self, nbytes: int) -> tuple[str, int]:
        """A segment with room for ``nbytes`` of data, at a fresh generation: ``(name, gen)``."""
        self._expire_lent()
        need = HEADER + -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        name = next((n for n in self._free if need <= self._size[n] <= 2 * need), None)
        if name is None:
            name = self._create(nbytes)
        else:
            del self._free[name]
            self._free_bytes -= self._size[name]
        self._gen[name] += 1
        mm = _map(name)
        _gen_word(mm)[0] = self._gen[name]  # before the writer writes: readers of the old data see it
        mm.close()
        self._lent[name] = time.monotonic() + self.lend_ttl_s
        return name, self._gen[name]

    def adopt(self, name: str, gen: int, dtype: str, shape: list[int]) -> np.ndarray:
        """Turn a lent, filled segment into a stored array (no copy)."""
        if self._lent.get(name) is None or self._gen.get(name) != gen:
            raise ProtocolError(f"segment {name!r} gen {gen} is not lent to a writer")
        del self._lent[name]
        mm = _map(name)
        self._held[mm] = name
        # The array's base is this mapping; when the last view dies so does the mapping, and the
        # segment goes back to the pool. Late readers in other processes are caught by the gen.
        weakref.finalize(mm, self._release, name)
        return view(mm, dtype, shape)

    def ref_of(self, arr: np.ndarray) -> dict[str, Any] | None:
        """``{name, gen}`` of the segment an adopted array lives in, else None."""
        base = arr.base
        while isinstance(base, np.ndarray):  # numpy stops collapsing view chains at frombuffer
            base = base.base
        if isinstance(base, memoryview):  # frombuffer's base: a memoryview exported by the mmap
            base = base.obj
        if isinstance(base, mmap.mmap) and base in self._held:
            name = self._held[base]
            return {"name": name, "gen": self._gen[name]}
        return None

    def unlend(self, name: str) -> None:
        """A lent segment will not be adopted after all (the write failed)."""
        if self._lent.pop(name, None) is not None:
            self._release(name)

    def _release(self, name: str) -> None:
        if self._closed or name not in self._size:
            return
        self._free[name] = None
        self._free_bytes += self._size[name]
        while self._free_bytes > self.pool_bytes and self._free:
            old, _ = self._free.popitem(last=False)
            self._free_bytes -= self._size[old]
            self._unlink(old)

    def _expire_lent(self) -> None:
        now = time.monotonic()
        for name in [n for n, deadline in self._lent.items() if deadline < now]:
            self.unlend(name)  # the writer died or gave up between lend and put

    def _unlink(self, name: str) -> None:
        self._gen.pop(name, None)
        self._size.pop(name, None)
        try:
            os.unlink(_path(name))
        except FileNotFoundError:
            pass

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        """Unlink every segment; mappings still held stay valid until unmapped."""
        self._closed = True
        for name in list(self._size):
            self._unlink(name)
        self._free.clear()
        self._lent.clear()


class ClientMappings:
    """The client side: a bounded cache of attached segments, so reused segments stay warm."""

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = max_bytes
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._bytes = 0

    def attach(self, name: str) -> mmap.mmap:
        mm = self._maps.get(name)
        if mm is not None:
            self._maps.move_to_end(name)
            return mm
        try:
            mm = _map(name)
        except FileNotFoundError:
            raise ProtocolError(f"shared-memory segment {name!r} is gone") from None
        self._maps[name] = mm
        self._bytes += len(mm)
        while self._bytes > self.max_bytes and len(self._maps) > 1:
            _, old = self._maps.popitem(last=False)
            self._bytes -= len(old)
            self._unmap(old)
        return mm

    def write(self, name: str, gen: int, arr: np.ndarray) -> None:
        mm = self.attach(name)
        if int(_gen_word(mm)[0]) != gen:
            raise ProtocolError(f"segment {name!r} is at another generation than lent")
        np.copyto(view(mm, arr.dtype.name, list(arr.shape)), arr, casting="no")

    def read(self, name: str, gen: int, dtype: str, shape: list[int],
             out: np.ndarray | None = None) -> np.ndarray:
        """Copy a tensor out (the segment may be recycled later); check no writer raced us.
        ``out``: copy into this array (same dtype and shape) instead of a fresh one."""
        mm = self.attach(name)
        src = view(mm, dtype, shape)
        if out is None:
            out = src.copy()
        else:
            np.copyto(out, src, casting="no")
        if int(_gen_word(mm)[0]) != gen:
            raise ProtocolError(f"segment {name!r} was recycled while being read; retry")
        return out

    @staticmethod
    def _unmap(mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:
            pass  # an array still views it (caller kept one); the GC unmaps it later

    def close(self) -> None:
        for mm in self._maps.values():
            self._unmap(mm)
        self._maps.clear()
        self._bytes = 0


class OwnedSegment:
    """A segment one process creates and fills for others on its machine to read (a worker lending
    its weights to a joining peer). The name carries the owner's pid, so ``sweep_dead`` removes it
    if the owner is SIGKILLed; ``close`` unmaps and unlinks it. ``populate``: its pages are faulted
    in at creation (a buffer written and read for the process's lifetime)."""

    def __init__(self, nbytes: int, populate: bool = False) -> None:
        self.name = f"{PREFIX}{os.getpid()}-peer-{secrets.token_hex(4)}"
        self.mm = _map(self.name, HEADER + max(nbytes, 1), populate)
        # Unlinked by close, else when collected or at interpreter exit (an owner never closed).
        self._unlink = weakref.finalize(self, _unlink_quietly, _path(self.name))

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        self._unlink()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_readonly(name: str) -> int:
    """A read-only descriptor of a segment another process created: ``os.preadv`` from it copies
    straight into the caller's buffers, without faulting in a fresh mapping page by page."""
    try:
        return os.open(_path(name), os.O_RDONLY)
    except FileNotFoundError:
        raise ProtocolError(f"shared-memory segment {name!r} is gone") from None


def attach(name: str) -> mmap.mmap:
    """Map a segment another process created (read it, then close the mapping)."""
    try:
        return _map(name)
    except FileNotFoundError:
        raise ProtocolError(f"shared-memory segment {name!r} is gone") from None
