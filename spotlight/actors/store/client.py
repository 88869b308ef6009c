"""``TensorStoreClient``: one async API over a tensor store in this process or behind a socket.

``TensorStoreClient.local(core)`` runs the very handlers the service runs, without encoding;
``TensorStoreClient.remote(endpoint)`` speaks to a ``TensorStoreService`` through
``comm.transport.RpcClient``. Callers cannot tell them apart, except by speed.

Bulk path. Over ZeroMQ every tensor is a zero-copy frame. When the store shares this machine's
``/dev/shm`` (checked at open: same boot id + host, and a probe segment attaches), tensors of at
least ``ShmInfo.min_bytes`` go through shared memory instead: the client borrows a segment from the
service (``ShmLend``), copies into it once, and the service adopts it without copying; reads copy
out once and check the segment's generation. The service owns every segment (see ``spotlight.comm.shm``).

Commits. ``commit_nowait`` returns at once; an owned flusher task sends pending commits in order.
Each commit is sent at the worker's next yield without waiting for earlier replies (up to
``MAX_IN_FLIGHT`` unanswered); beyond that, pending commits of one request coalesce (a full
commit replaces what is pending; an append (``base=``) extends it, rows concatenated), so a
worker committing every step never waits on the network and never sends a step twice. At most
``max_pending`` requests may have a commit pending; beyond that ``commit_nowait`` raises
``CapacityError`` (await ``flush``).
A failed background commit is raised by the next ``commit_nowait`` or ``flush``.
``commit_nowait`` takes ownership of the arrays: do not write into them afterwards.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

from spotlight.actors.config import DEFAULTS
from spotlight.actors.store.core import Tensors, TensorStoreCore
from spotlight.actors.store.service import StoreHandlers, host_id
from spotlight.comm import messages as m
from spotlight.comm.auth import CurveClientKeys
from spotlight.comm.shm import ClientMappings
from spotlight.comm.transport import RpcClient
from spotlight.errors import CapacityError, ProtocolError, RemoteError

log = logging.getLogger(__name__)


def _numpy(tensors: dict[str, Any]) -> dict[str, np.ndarray]:
    """numpy arrays as they are, torch CPU tensors as zero-copy numpy views (a GPU tensor is copied
    to the host: the wire and the store hold host memory)."""
    return {k: v if isinstance(v, np.ndarray) else v.detach().cpu().numpy() for k, v in tensors.items()}


@dataclass(slots=True)
class _PendingCommit:
    """A commit waiting for the flusher; later appends of the same request extend ``rows``."""

    request_id: str
    attempt: int
    step: int
    base: int | None
    meta: dict
    rows: dict[str, list[np.ndarray]]


@dataclass(slots=True)
class _Seal:
    """A queued SealCommit and the future its caller awaits."""

    msg: m.SealCommit
    done: asyncio.Future


async def _settled(reply: Any, error: Exception | None) -> Any:
    if error is not None:
        raise error
    return reply


async def _translated(reply: Awaitable[Any]) -> Any:
    """Await a store reply; the store refuses bad arguments with ValueError/TypeError, which
    arrive as RemoteError naming them: raise the same class here."""
    try:
        return await reply
    except RemoteError as e:
        text = str(e)
        for cls in (ValueError, TypeError):
            if text.startswith(cls.__name__ + ": "):
                raise cls(text[len(cls.__name__) + 2 :]) from None
        raise


MAX_IN_FLIGHT = 8
"""Commits/seals sent and not yet answered, per client; more pending ones wait and coalesce."""


def _is_local(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return True
    host = urlparse(endpoint).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class TensorStoreClient:
    """Async client of a tensor store. Use as ``async with TensorStoreClient.remote(ep) as c:``."""

    def __init__(
        self,
        *,
        rpc: RpcClient | None = None,
        handlers: StoreHandlers | None = None,
        shm: bool | None = None,
        max_pending: int = 64,
        timeout: float = DEFAULTS.store_timeout_s,
    ) -> None:
        if (rpc is None) == (handlers is None):
            raise ValueError("TensorStoreClient needs exactly one of rpc, handlers")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._rpc, self._handlers = rpc, handlers
        self._table = handlers.table() if handlers is not None else {}
        self._want_shm, self._timeout, self.max_pending = shm, timeout, max_pending
        self._maps: ClientMappings | None = None
        self._shm_min = 0
        self._pending: OrderedDict[str | tuple[str, str], _PendingCommit | _Seal] = OrderedDict()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0  # ops sent whose replies are not settled yet
        self._settled = asyncio.Event()
        self._settling: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._flusher: asyncio.Task | None = None

    @classmethod
    def local(cls, core: TensorStoreCore | None = None, **kw: Any) -> TensorStoreClient:
        return cls(handlers=StoreHandlers(core or TensorStoreCore()), **kw)

    @classmethod
    def remote(
        cls,
        endpoint: str,
        *,
        timeout: float = DEFAULTS.store_timeout_s,
        shm: bool | None = None,
        curve: CurveClientKeys | None = None,
        **kw: Any,
    ) -> TensorStoreClient:
        """``shm``: None = use shared memory when the store turns out to be on this machine.
        ``curve``: client keys when the store serves with CURVE."""
        return cls(rpc=RpcClient(endpoint, timeout=timeout, curve=curve), shm=shm, timeout=timeout, **kw)

    @property
    def uses_shm(self) -> bool:
        return self._maps is not None

    # --- lifetime ------------------------------------------------------------------------------
    async def __aenter__(self) -> TensorStoreClient:
        if self._rpc is not None:
            await self._rpc.__aenter__()
        try:
            if self._rpc is not None and self._want_shm is not False:
                await self._setup_shm()
            self._tg = asyncio.TaskGroup()
            await self._tg.__aenter__()
            self._flusher = self._tg.create_task(self._flush_loop(), name="store-commit-flusher")
        except BaseException:
            await self._close_transport()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            if exc_info[0] is None:
                await self.flush()  # leave cleanly: pending commits reach the store
        finally:
            assert self._tg is not None and self._flusher is not None
            self._flusher.cancel()
            for task in self._settling:  # unanswered after a failure: nobody waits for them
                task.cancel()
            try:
                await self._tg.__aexit__(None, None, None)
            finally:
                await self._close_transport()

    async def _close_transport(self) -> None:
        if self._maps is not None:
            self._maps.close()
            self._maps = None
        if self._rpc is not None:
            await self._rpc.close()

    async def _setup_shm(self) -> None:
        endpoint = self._rpc.endpoint if self._rpc is not None else ""
        if self._want_shm is None and not _is_local(endpoint):
            return
        try:
            info = await self._call(m.ShmHello())
            if info.host_id != host_id():
                raise ProtocolError(f"store at {endpoint} is on another machine")
            maps = ClientMappings()
            maps.attach(info.probe)
        except ProtocolError as e:  # no shm handlers there, other host, or probe not visible
            if self._want_shm:
                raise
            log.info("tensor store %s: shared memory off (%s)", endpoint, e)
            return
        self._maps, self._shm_min = maps, info.min_bytes

    # --- calls ---------------------------------------------------------------------------------
    async def _call(self, msg: m.Message) -> Any:
        return await (await self._send(msg))

    async def _send(self, msg: m.Message) -> Coroutine[Any, Any, Any]:
        """Send ``msg`` now, in order; the awaitable of its reply (pipelining, see RpcClient.send)."""
        if self._handlers is not None:
            try:
                reply, error = self._table[type(msg)](msg), None
            except Exception as e:
                reply, error = None, e
            return _translated(_settled(reply, error))
        assert self._rpc is not None
        return _translated(await self._rpc.send(msg, timeout=self._timeout))

    def _owned(self, tensors: dict[str, Any]) -> dict[str, np.ndarray]:
        arrays = _numpy(tensors)
        # In-process, the core would keep the caller's arrays: copy so callers keep value semantics.
        return {k: np.array(a, copy=True) for k, a in arrays.items()} if self._handlers else arrays

    async def _write(self, tensors: dict[str, Any], plain: Any, via_shm: Any) -> Coroutine[Any, Any, Any]:
        """Send a write: ``plain(tensors)`` over frames, or ``via_shm(inline, refs)``; returns
        the awaitable of its reply."""
        arrays = self._owned(tensors)
        big = {k: a for k, a in arrays.items() if self._maps is not None and a.nbytes >= self._shm_min}
        if not big:
            return await self._send(plain(arrays))
        assert self._maps is not None
        grant = await self._call(m.ShmLend(nbytes=[a.nbytes for a in big.values()]))
        refs = {}
        for (name, arr), seg in zip(big.items(), grant.segments, strict=True):
            self._maps.write(seg["name"], seg["gen"], arr)
            refs[name] = {
                "name": seg["name"],
                "gen": seg["gen"],
                "dtype": arr.dtype.name,
                "shape": list(arr.shape),
            }
        inline = {k: a for k, a in arrays.items() if k not in big}
        return await self._send(via_shm(inline, refs))

    def _read(self, reply: Any, out: dict[str, np.ndarray] | None) -> Tensors:
        """The reply's tensors; with ``out``, those named there are copied into the caller's
        arrays (no fresh pages to fault in: the fast way to refill a worker's buffers)."""
        out = out or {}
        got = dict(reply.tensors)
        for name, arr in got.items():
            if name in out:
                np.copyto(out[name], arr, casting="no")
                got[name] = out[name]
        for name, ref in getattr(reply, "refs", {}).items():
            assert self._maps is not None
            got[name] = self._maps.read(ref["name"], ref["gen"], ref["dtype"], ref["shape"], out.get(name))
        return got

    # --- keys ----------------------------------------------------------------------------------
    async def put(self, key: str, tensors: dict[str, Any], meta: dict | None = None) -> None:
        meta = dict(meta or {})
        await (
            await self._write(
                tensors,
                lambda t: m.Put(key=key, tensors=t, meta=meta),
                lambda t, r: m.ShmPut(key=key, tensors=t, refs=r, meta=meta),
            )
        )

    async def get(self, key: str, *, out: dict[str, np.ndarray] | None = None) -> tuple[Tensors, dict]:
        """``(tensors, meta)``; ``out`` optionally names preallocated arrays to fill."""
        if self._maps is not None:
            reply = await self._call(m.ShmFetch(what="key", name=key))
        else:
            reply = await self._call(m.Get(key=key))
        return self._read(reply, out), reply.meta

    async def delete(self, key: str) -> None:
        await self._call(m.Delete(key=key))

    async def keys(self, prefix: str = "") -> list[str]:
        return (await self._call(m.ListKeys(prefix=prefix))).keys

    # --- commits -------------------------------------------------------------------------------
    async def commit(
        self,
        request_id: str,
        step: int,
        tensors: dict[str, Any],
        meta: dict | None = None,
        *,
        attempt: int = 0,
        base: int | None = None,
    ) -> None:
        """Commit and wait for the store to hold it (in order after pending background commits)."""
        self.commit_nowait(request_id, step, tensors, meta, attempt=attempt, base=base)
        await self.flush()

    def commit_nowait(
        self,
        request_id: str,
        step: int,
        tensors: dict[str, Any],
        meta: dict | None = None,
        *,
        attempt: int = 0,
        base: int | None = None,
    ) -> None:
        """Queue a commit for the flusher and return at once (never blocks). ``base``: this
        commit holds only the rows added since the commit at step ``base`` (see the store)."""
        self._raise_background_error()
        if self._flusher is None:
            raise RuntimeError("TensorStoreClient is not open (use 'async with')")
        held = self._pending.get(request_id)
        if held is None and len(self._pending) >= self.max_pending:
            raise CapacityError(
                f"{len(self._pending)} commits pending (max_pending "
                f"{self.max_pending}); await flush() before committing more"
            )
        arrays, meta = _numpy(tensors), dict(meta or {})
        if held is not None and (held.step > step or (held.step == step and base is not None)):
            return  # not newer than one already queued: the store would ignore it anyway
        if held is not None and base is not None:
            if base != held.step or arrays.keys() != held.rows.keys():
                raise ValueError(f"append to {request_id!r} at step {base}, but step {held.step} is pending")
            # Extend the pending commit: it now reaches `step`, built on what it was built on.
            for name, arr in arrays.items():
                held.rows[name].append(arr)
            held.step, held.meta, held.attempt = step, meta, attempt
        else:
            self._pending[request_id] = _PendingCommit(
                request_id, attempt, step, base, meta, {name: [arr] for name, arr in arrays.items()}
            )
        self._idle.clear()
        self._wake.set()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued commit reached the store; raise a background failure."""
        async with asyncio.timeout(self._timeout if timeout is None else timeout):
            await self._idle.wait()
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    async def _flush_loop(self) -> None:
        # Sends every pending op as soon as the loop runs it (a worker yields once per step, so
        # each step's commit leaves during that yield), never waiting for replies: they are
        # settled by owned tasks, at most MAX_IN_FLIGHT at a time; beyond that, pending commits
        # coalesce until replies come back. A seal queued behind its request's last commit
        # leaves right after it: one round trip for both.
        assert self._tg is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                while self._in_flight >= MAX_IN_FLIGHT:
                    self._settled.clear()
                    await self._settled.wait()
                _, op = self._pending.popitem(last=False)
                self._in_flight += 1  # from now on: being sent counts as in flight (not idle)
                try:
                    reply = await self._send_op(op)
                except Exception as e:
                    self._in_flight -= 1
                    self._op_failed(op, e)
                    continue
                task = self._tg.create_task(self._settle(op, reply), name="store-commit-reply")
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)
            self._check_idle()

    async def _settle(self, op: _PendingCommit | _Seal, reply: Coroutine) -> None:
        try:
            await reply
        except Exception as e:
            self._op_failed(op, e)
        else:
            if isinstance(op, _Seal) and not op.done.done():
                op.done.set_result(None)
        finally:
            self._in_flight -= 1
            self._settled.set()
            self._check_idle()

    def _check_idle(self) -> None:
        if not self._pending and self._in_flight == 0:
            self._idle.set()

    async def _send_op(self, op: _PendingCommit | _Seal) -> Coroutine:
        if isinstance(op, _Seal):
            return await self._send(op.msg)
        tensors = {
            name: rows[0] if len(rows) == 1 else np.concatenate(rows) for name, rows in op.rows.items()
        }
        return await self._write(
            tensors,
            lambda t: m.Commit(
                request_id=op.request_id,
                attempt=op.attempt,
                step=op.step,
                tensors=t,
                meta=op.meta,
                base=op.base,
            ),
            lambda t, r: m.ShmCommit(
                request_id=op.request_id,
                attempt=op.attempt,
                step=op.step,
                tensors=t,
                refs=r,
                meta=op.meta,
                base=op.base,
            ),
        )

    def _op_failed(self, op: _PendingCommit | _Seal, e: Exception) -> None:
        if isinstance(op, _Seal):  # its caller is waiting: it gets the error
            if not op.done.done():
                op.done.set_exception(e)
            return
        log.warning("background commit of %s step %d failed: %s", op.request_id, op.step, e)
        if self._error is None:  # kept for the caller's next call; the first one wins
            self._error = e

    async def get_commit(self, request_id: str) -> tuple[int, Tensors, dict] | None:
        if self._maps is not None:
            reply = await self._call(m.ShmFetch(what="commit", name=request_id))
            return None if reply.step is None else (reply.step, self._read(reply, None), reply.meta)
        reply = await self._call(m.GetCommit(request_id=request_id))
        return None if reply.step is None else (reply.step, reply.tensors, reply.meta)

    async def drop_commit(self, request_id: str) -> None:
        await self._call(m.DropCommit(request_id=request_id))

    async def seal_commit(
        self,
        request_id: str,
        step: int,
        key: str,
        tensors: dict[str, Any] | None = None,
        meta: dict | None = None,
    ) -> None:
        """Make the request's commit at ``step`` the entry ``key`` (plus ``tensors``). Queued
        behind the request's pending commits and sent with them, so the final commit and the
        seal cost one round trip; the store refuses it unless it holds exactly ``step``."""
        self._raise_background_error()
        if self._flusher is None:
            raise RuntimeError("TensorStoreClient is not open (use 'async with')")
        seal = _Seal(
            m.SealCommit(
                request_id=request_id,
                step=step,
                key=key,
                tensors=self._owned(tensors or {}),
                meta=dict(meta or {}),
            ),
            asyncio.get_running_loop().create_future(),
        )
        self._pending[("seal", request_id)] = seal
        self._idle.clear()
        self._wake.set()
        try:
            async with asyncio.timeout(self._timeout):
                await seal.done
        except Exception:
            self._raise_background_error()  # the root cause (a refused commit) first
            raise

    # --- weights -------------------------------------------------------------------------------
    async def publish_weights(self, version: int, tensors: dict[str, Any]) -> None:
        await (
            await self._write(
                tensors,
                lambda t: m.PublishWeights(version=version, tensors=t, meta={}),
                lambda t, r: m.ShmPublish(version=version, tensors=t, refs=r, meta={}),
            )
        )

    async def get_weights(self, version: int, *, out: dict[str, np.ndarray] | None = None) -> Tensors:
        """Weights ``version``; ``out`` optionally names preallocated arrays to fill."""
        if self._maps is not None:
            return self._read(await self._call(m.ShmFetch(what="weights", version=version)), out)
        return self._read(await self._call(m.GetWeights(version=version)), out)

    async def pin_version(self, version: int, pinned: bool = True) -> None:
        """Keep ``version`` held while requests that name it are in flight (False: release)."""
        await self._call(m.PinWeights(version=version, pinned=pinned))

    async def latest_version(self) -> int | None:
        return (await self._call(m.LatestVersion())).version
