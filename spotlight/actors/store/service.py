"""The tensor store's process shell: wire messages -> ``TensorStoreCore`` calls, over ZeroMQ.

``StoreHandlers`` maps each store message to a core call and builds the reply; it is what both
the socket server and the in-process client run, so local and remote behave the same.
``TensorStoreService`` puts those handlers behind a ``comm.transport.RpcServer`` (ROUTER) and,
when enabled, lends shared-memory segments (``spotlight.comm.shm``) to writers on the same machine.
``main`` is the CLI entry (``python -m spotlight.actors.store --bind ADDR``): it owns the
signals and exits cleanly on SIGTERM/SIGINT.

Handlers are plain functions: the transport runs them inline in its receive loop, one at a time
and in arrival order, which is exactly the single-owner discipline the core needs.

This module knows messages and the core; framing and sockets are ``comm.transport``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from typing import Any

import numpy as np

from spotlight.actors.options import add_options, given
from spotlight.actors.procs import announce_ready, die_with_parent
from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore
from spotlight.comm import messages as m
from spotlight.comm import shm as segments
from spotlight.comm.auth import CurveServerKeys, cluster_server_keys
from spotlight.comm.transport import RpcServer
from spotlight.errors import ProtocolError, RemoteError, SpotlightError

log = logging.getLogger(__name__)

SHM_MIN_BYTES = 1 << 20  # below ~1 MB a ZeroMQ frame is as fast as a lend + put round trip pair


def host_id() -> str:
    """Identifies this machine's kernel (boot id) and host: equal ids may share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{boot}/{socket.gethostname()}"


def _refusing(handler: Any) -> Any:
    """Answer a refused argument (ValueError/TypeError from the core) as an error reply naming
    the class, instead of the transport's "unexpected handler crash" path with its traceback."""

    def handle(msg: m.Message) -> m.Message:
        try:
            return handler(msg)
        except (ValueError, TypeError) as e:
            if isinstance(e, SpotlightError):
                raise
            raise RemoteError(f"{type(e).__name__}: {e}") from e

    return handle


class StoreHandlers:
    """Message handlers over one core (and, optionally, the service's shared-memory segments)."""

    def __init__(self, core: TensorStoreCore, segments: segments.ServiceSegments | None = None,
                 shm_min_bytes: int = SHM_MIN_BYTES) -> None:
        self.core = core
        self.segments = segments
        self.shm_min_bytes = shm_min_bytes

    def table(self) -> dict[type[m.Message], Any]:
        table: dict[type[m.Message], Any] = {
            m.Put: self.put, m.Get: self.get, m.Delete: self.delete, m.Commit: self.commit,
            m.GetCommit: self.get_commit, m.DropCommit: self.drop_commit, m.SealCommit: self.seal_commit,
            m.PublishWeights: self.publish, m.GetWeights: self.get_weights,
            m.LatestVersion: self.latest, m.ListKeys: self.list_keys, m.PinWeights: self.pin,
        }
        if self.segments is not None:
            table.update({m.ShmHello: self.shm_hello, m.ShmLend: self.shm_lend,
                          m.ShmPut: self.shm_put, m.ShmCommit: self.shm_commit,
                          m.ShmPublish: self.shm_publish, m.ShmFetch: self.shm_fetch})
        return {cls: _refusing(fn) for cls, fn in table.items()}

    # --- zero-copy frame path ------------------------------------------------------------------
    def put(self, msg: m.Put) -> m.Message:
        self.core.put(msg.key, msg.tensors, msg.meta)
        return m.Ok()

    def get(self, msg: m.Get) -> m.Message:
        tensors, meta = self.core.get(msg.key)
        return m.Tensors(key=msg.key, tensors=tensors, meta=meta)

    def delete(self, msg: m.Delete) -> m.Message:
        self.core.delete(msg.key)
        return m.Ok()

    def commit(self, msg: m.Commit) -> m.Message:
        self.core.commit(msg.request_id, msg.step, msg.tensors, {**msg.meta, "attempt": msg.attempt},
                         base=msg.base)
        return m.Ok()

    def seal_commit(self, msg: m.SealCommit) -> m.Message:
        self.core.seal_commit(msg.request_id, msg.step, msg.key, msg.tensors, msg.meta)
        return m.Ok()

    def get_commit(self, msg: m.GetCommit) -> m.Message:
        held = self.core.get_commit(msg.request_id)
        if held is None:
            return m.CommitState(request_id=msg.request_id, step=None, tensors={}, meta={})
        step, tensors, meta = held
        return m.CommitState(request_id=msg.request_id, step=step, tensors=tensors, meta=meta)

    def drop_commit(self, msg: m.DropCommit) -> m.Message:
        self.core.drop_commit(msg.request_id)
        return m.Ok()

    def publish(self, msg: m.PublishWeights) -> m.Message:
        self.core.publish_weights(msg.version, msg.tensors)
        return m.Ok()

    def get_weights(self, msg: m.GetWeights) -> m.Message:
        return m.Tensors(key=f"weights/{msg.version}", tensors=self.core.get_weights(msg.version),
                         meta={"version": msg.version})

    def pin(self, msg: m.PinWeights) -> m.Message:
        if msg.pinned:
            self.core.pin_version(msg.version)
        else:
            self.core.unpin_version(msg.version)
        return m.Ok()

    def latest(self, msg: m.LatestVersion) -> m.Message:
        return m.VersionReply(version=self.core.latest_version())

    def list_keys(self, msg: m.ListKeys) -> m.Message:
        return m.KeyList(keys=self.core.keys(msg.prefix))

    # --- shared-memory path --------------------------------------------------------------------
    def shm_hello(self, msg: m.ShmHello) -> m.Message:
        assert self.segments is not None
        return m.ShmInfo(host_id=host_id(), probe=self.segments.probe, min_bytes=self.shm_min_bytes)

    def shm_lend(self, msg: m.ShmLend) -> m.Message:
        assert self.segments is not None
        if len(msg.nbytes) > 4096 or any(n < 0 for n in msg.nbytes):
            raise ProtocolError("ShmLend: at most 4096 sizes, each >= 0")
        # Lending is not storing: the cap is checked when the data is adopted by put/commit.
        lent = [self.segments.lend(n) for n in msg.nbytes]
        return m.ShmGrant(segments=[{"name": name, "gen": gen} for name, gen in lent])

    def _adopt(self, tensors: dict[str, np.ndarray], refs: dict[str, dict[str, Any]]) -> dict:
        """Inline tensors plus the lent segments as stored arrays; on failure, unlend them all."""
        assert self.segments is not None
        out = dict(tensors)
        try:
            for tname, ref in refs.items():
                if not isinstance(ref, dict) or set(ref) != {"name", "gen", "dtype", "shape"}:
                    raise ProtocolError(f"shm ref {tname!r} must be {{name, gen, dtype, shape}}")
                if tname in out:
                    raise ProtocolError(f"tensor {tname!r} sent both inline and in shared memory")
                out[tname] = self.segments.adopt(ref["name"], ref["gen"], ref["dtype"], ref["shape"])
        except Exception:
            for ref in refs.values():
                if isinstance(ref, dict) and isinstance(ref.get("name"), str):
                    self.segments.unlend(ref["name"])
            raise
        return out

    def shm_put(self, msg: m.ShmPut) -> m.Message:
        # If the core refuses (cap, bad key), the adopted arrays die here and their segments go
        # back to the pool through their finalizers: nothing is stored, nothing leaks.
        self.core.put(msg.key, self._adopt(msg.tensors, msg.refs), msg.meta)
        return m.Ok()

    def shm_commit(self, msg: m.ShmCommit) -> m.Message:
        tensors = self._adopt(msg.tensors, msg.refs)
        self.core.commit(msg.request_id, msg.step, tensors, {**msg.meta, "attempt": msg.attempt},
                         base=msg.base)
        return m.Ok()

    def shm_publish(self, msg: m.ShmPublish) -> m.Message:
        self.core.publish_weights(msg.version, self._adopt(msg.tensors, msg.refs))
        return m.Ok()

    def shm_fetch(self, msg: m.ShmFetch) -> m.Message:
        assert self.segments is not None
        step = None
        if msg.what == "key":
            tensors, meta = self.core.get(msg.name)
        elif msg.what == "commit":
            held = self.core.get_commit(msg.name)
            if held is None:
                return m.ShmTensors(step=None, tensors={}, refs={}, meta={})
            step, tensors, meta = held
        else:
            tensors, meta = self.core.get_weights(msg.version), {"version": msg.version}
        inline, refs = {}, {}
        for tname, arr in tensors.items():
            ref = self.segments.ref_of(arr) if arr.nbytes >= self.shm_min_bytes else None
            if ref is None:
                inline[tname] = arr  # arrived over ZeroMQ (or small): send it as a frame
            else:
                refs[tname] = {**ref, "dtype": arr.dtype.name, "shape": list(arr.shape)}
        return m.ShmTensors(step=step, tensors=inline, refs=refs, meta=meta)


class TensorStoreService:
    """A tensor store served on ``bind`` until ``stop`` is set.

    ``async with TensorStoreService(...) as svc:`` binds and serves; ``svc.endpoint`` is the bound
    address. Leaving the block stops the server and unlinks every shared-memory segment.
    """

    def __init__(self, bind: str, config: TensorStoreConfig | None = None, *, shm: bool = True,
                 shm_pool_bytes: int = 1 << 30, shm_min_bytes: int = SHM_MIN_BYTES,
                 curve: CurveServerKeys | None = None) -> None:
        self.core = TensorStoreCore(config)
        segments.sweep_dead()  # segments of an earlier store on this machine that was SIGKILLed
        self.segments = segments.ServiceSegments(shm_pool_bytes) if shm else None
        self.handlers = StoreHandlers(self.core, self.segments, shm_min_bytes)
        self._server = RpcServer(self.handlers.table(), bind=bind, curve=curve)
        self.endpoint = ""

    async def __aenter__(self) -> TensorStoreService:
        try:
            await self._server.__aenter__()
        except BaseException:
            self._close_segments()
            raise
        self.endpoint = self._server.endpoint
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self._server.__aexit__(*exc_info)
        finally:
            self._close_segments()

    def _close_segments(self) -> None:
        if self.segments is not None:
            self.segments.close()

    async def serve_until(self, stop: asyncio.Event) -> None:
        async with self:
            # The readiness line a launcher (or test) waits for instead of sleeping.
            announce_ready(f"tensor store ready on {self.endpoint}")
            await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotlight.actors.store",
                                     description="Serve a Spotlight tensor store.")
    parser.add_argument("--bind", required=True, help="ZeroMQ address, e.g. tcp://0.0.0.0:5560")
    add_options(parser, TensorStoreConfig)
    parser.add_argument("--no-shm", action="store_true", help="disable the shared-memory path")
    parser.add_argument("--keys", default=None, help="CURVE folder: controller.key_secret + nodes/*.key")
    args = parser.parse_args(argv)
    die_with_parent(only_if_asked=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = TensorStoreConfig(**given(args, TensorStoreConfig))
    except ValueError as e:
        parser.error(str(e))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            curve = cluster_server_keys(args.keys) if args.keys else None
            await TensorStoreService(args.bind, config, shm=not args.no_shm, curve=curve).serve_until(stop)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    asyncio.run(run())
    log.info("tensor store stopped")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
