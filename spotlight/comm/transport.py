"""Request/reply over asyncio ZeroMQ: ``RpcServer`` (ROUTER) and ``RpcClient`` (DEALER).

Frames on the wire: a client sends ``[corr_id, *codec frames]``; the ROUTER prepends the peer
identity; the reply is ``[identity, corr_id, *codec frames]``. ``corr_id`` (8 bytes) lets one
client have many calls in flight on one socket.

Server guarantees: it never dies on bad input. A frame that fails ``codec.decode`` (malformed,
oversized, unknown type, wrong field types), or a message it has no handler for, gets an
``ErrorReply("ProtocolError", ...)`` and the server keeps serving; a frame above
``zmq.MAXMSGSIZE`` makes libzmq drop that peer's connection before Python sees it. A handler that
raises a ``SpotlightError`` is answered with ``ErrorReply(<class name>, message)``; any other
exception is logged with its traceback and answered with ``RemoteError``.

A handler takes the decoded message and returns the reply message, or an awaitable of it. A
plain reply is sent inline from the receive loop (cheap, ordered); an awaitable (an ``async def``
handler, or a ``def`` that only sometimes needs to wait, e.g. a long-poll with nothing queued)
is awaited in a task of the server's TaskGroup so it does not block other peers.

Client guarantees: ``await client.call(msg, timeout=...)`` returns the reply message, raises the
error class an ``ErrorReply`` names (``spotlight.errors``), or ``ActorTimeout`` when no reply
arrives in time (dead server, refused CURVE handshake, lost peer).

CURVE (tcp only): a server given ``CurveServerKeys`` accepts only the client public keys listed;
it gets its own zmq context because the ZAP authenticator is per context.

This module knows framing, sockets and error mapping; it knows nothing of what messages mean.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from spotlight import errors
from spotlight.comm.auth import CurveClientKeys, CurveServerKeys
from spotlight.comm.codec import DEFAULT_LIMITS, Limits, decode, encode
from spotlight.comm.messages import ErrorReply, Message
from spotlight.errors import ActorTimeout, ProtocolError, RemoteError, SpotlightError

log = logging.getLogger(__name__)

Handler = Callable[[Any], Message] | Callable[[Any], Awaitable[Message]]
_CORR = struct.Struct("<Q")
_MAX_CORR_BYTES = 64  # a peer's correlation id is echoed back; bound what we echo
_DRAIN_MAX = 256  # messages handled per event-loop turn before yielding


def error_reply(exc: BaseException) -> ErrorReply:
    """The wire form of an exception raised while handling a request."""
    if isinstance(exc, SpotlightError) and getattr(errors, type(exc).__name__, None) is type(exc):
        return ErrorReply(code=type(exc).__name__, message=str(exc))
    return ErrorReply(code="RemoteError", message=f"{type(exc).__name__}: {exc}")


def raise_error(reply: ErrorReply) -> None:
    """Raise the ``spotlight.errors`` class an ErrorReply names (RemoteError when unknown)."""
    cls = getattr(errors, reply.code, None)
    if isinstance(cls, type) and issubclass(cls, SpotlightError):
        raise cls(reply.message)
    raise RemoteError(f"{reply.code}: {reply.message}")


async def shutdown_group(tg: asyncio.TaskGroup, tasks: set[asyncio.Task], exc_info: tuple) -> None:
    """Leave a TaskGroup entered by hand in ``__aenter__``: cancel and await ``tasks`` (the ones
    the owner runs until told to stop). A task's failure is raised (as the TaskGroup's
    ExceptionGroup); an exception from the ``async with`` body propagates as itself, unwrapped,
    which is what callers of a server context manager expect."""
    for task in list(tasks):
        task.cancel()
    et = exc_info[0]
    if et is not None and not issubclass(et, asyncio.CancelledError):
        exc_info = (None, None, None)  # the body's own error re-raises after we return
    await tg.__aexit__(*exc_info)


def _close_socket(sock: zmq.asyncio.Socket) -> None:
    sock.close(linger=0)  # never block shutdown on undeliverable messages


class RpcServer:
    """A ROUTER socket dispatching decoded messages to handlers by message class.

    Use as ``async with RpcServer(handlers, bind="ipc:///tmp/x") as server:``; ``server.endpoint``
    is the bound address (the real port when binding ``tcp://host:0``). Leaving the block stops
    receiving, cancels and awaits every handler task, and closes the socket.
    """

    def __init__(
        self,
        handlers: Mapping[type[Message], Handler],
        *,
        bind: str,
        limits: Limits = DEFAULT_LIMITS,
        curve: CurveServerKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._handlers = dict(handlers)
        self._bind, self._limits, self._curve = bind, limits, curve
        self._own_ctx = curve is not None and context is None
        self._ctx = zmq.asyncio.Context() if self._own_ctx else (context or zmq.asyncio.Context.instance())
        self._auth: AsyncioAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._raw: zmq.Socket | None = None  # the same socket, plain (non-asyncio) API
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task] = set()  # ours to cancel at exit; the TaskGroup awaits
        self.endpoint = ""
        self.stats = {"requests": 0, "protocol_errors": 0, "handler_errors": 0, "dropped": 0}

    async def __aenter__(self) -> RpcServer:
        sock = self._ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.MAXMSGSIZE, max(self._limits.max_frame_bytes, self._limits.max_header_bytes))
            if self._curve is not None:
                self._auth = AsyncioAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback("*", _AllowedKeys(self._curve.allowed_clients))
                sock.curve_secretkey = self._curve.secret
                sock.curve_publickey = self._curve.public
                sock.curve_server = True
            sock.bind(self._bind)
        except BaseException:
            _close_socket(sock)
            self._stop_auth()
            raise
        self._sock, self._raw = sock, zmq.Socket.shadow(sock.underlying)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._spawn(self._receive_loop(), f"rpc-recv {self.endpoint}")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._tg is not None and self._sock is not None
        try:
            await shutdown_group(self._tg, self._tasks, exc_info)
        finally:
            _close_socket(self._sock)
            self._stop_auth()
            if self.endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
                Path(self.endpoint[len("ipc://") :]).unlink(missing_ok=True)

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()

    async def _receive_loop(self) -> None:
        sock = self._sock
        assert sock is not None and self._raw is not None
        handled = 0
        while True:
            self._handle(await sock.recv_multipart(copy=False))
            handled += 1
            # Drain what is already queued through the plain socket: an awaited recv costs an
            # event-loop cycle and a future each (~half of a small call's server time).
            while handled < _DRAIN_MAX:
                try:
                    frames = self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                handled += 1
            if handled >= _DRAIN_MAX:  # a busy stretch: let handler tasks and timers run
                handled = 0
                await asyncio.sleep(0)

    def _handle(self, frames: list) -> None:
        if len(frames) < 2 or len(frames[1]) > _MAX_CORR_BYTES:
            self.stats["dropped"] += 1  # no usable correlation id: nothing to answer to
            return
        ident, corr = frames[0].bytes, frames[1].bytes
        self.stats["requests"] += 1
        try:
            msg = decode(frames[2:], self._limits)
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"this server does not handle {type(msg).__name__}")
        except ProtocolError as e:
            self.stats["protocol_errors"] += 1
            log.debug("rejected a request from %r: %s", ident, e)
            self._send(ident, corr, error_reply(e))
            return
        reply = self._run_sync(handler, msg)
        if inspect.isawaitable(reply):
            self._spawn(self._finish(reply, msg, ident, corr), type(msg).__name__)
        else:
            self._send(ident, corr, reply)

    def _spawn(self, coro: Any, name: str) -> None:
        assert self._tg is not None
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _run_sync(self, handler: Handler, msg: Message) -> Any:
        try:
            return handler(msg)
        except Exception as e:  # answered to the caller, never swallowed silently
            return self._handler_failed(msg, e)

    async def _finish(self, pending: Awaitable[Message], msg: Message, ident: bytes, corr: bytes) -> None:
        try:
            reply = await pending
        except Exception as e:
            reply = self._handler_failed(msg, e)
        self._send(ident, corr, reply)

    def _handler_failed(self, msg: Message, e: Exception) -> ErrorReply:
        self.stats["handler_errors"] += 1
        if not isinstance(e, SpotlightError):
            log.error("handler for %s raised", type(msg).__name__, exc_info=e)
        return error_reply(e)

    def _send(self, ident: bytes, corr: bytes, reply: Message) -> None:
        try:
            frames = encode(reply)
        except ProtocolError as e:  # a handler returned something unencodable: a bug there
            log.error("reply %s could not be encoded: %s", type(reply).__name__, e)
            frames = encode(error_reply(RemoteError(f"reply could not be encoded: {e}")))
        assert self._raw is not None
        # A ROUTER send never blocks (a reply to a gone or saturated peer is dropped, and that
        # peer's call times out), so the plain socket is safe here and skips a future per reply.
        self._raw.send_multipart([ident, corr, *frames], copy=False)
        # zmq's fd is edge-triggered and a send through the plain socket may consume the edge of
        # a request that arrived meanwhile; reading EVENTS through the asyncio socket re-arms its
        # waiting recv (pyzmq's documented hook), else that request waits for the next arrival.
        assert self._sock is not None
        self._sock.get(zmq.EVENTS)


class _AllowedKeys:
    """ZAP credentials provider: a fixed set of z85 client public keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            log.warning("CURVE: refused client key %s", key.decode(errors="replace"))
        return allowed


class RpcClient:
    """A DEALER socket with many concurrent calls correlated by id.

    Use as ``async with RpcClient("tcp://host:port") as client: reply = await client.call(msg)``.
    A receive task owned by the client routes replies to their callers; leaving the block
    cancels and awaits it; calls still waiting then fail with ``ActorTimeout``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 10.0,
        limits: Limits = DEFAULT_LIMITS,
        curve: CurveClientKeys | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"RpcClient timeout must be > 0, got {timeout}")
        self.endpoint, self.timeout, self._limits, self._curve = endpoint, timeout, limits, curve
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._raw: zmq.Socket | None = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task | None = None
        self.late_replies = 0

    async def __aenter__(self) -> RpcClient:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.MAXMSGSIZE, max(self._limits.max_frame_bytes, self._limits.max_header_bytes))
            if self._curve is not None:
                sock.curve_secretkey = self._curve.secret
                sock.curve_publickey = self._curve.public
                sock.curve_serverkey = self._curve.server_public
            sock.connect(self.endpoint)
        except BaseException:
            _close_socket(sock)
            raise
        self._sock, self._raw = sock, zmq.Socket.shadow(sock.underlying)
        # Owned: cancelled and awaited in __aexit__; its failure is delivered to every caller.
        self._reader = asyncio.create_task(self._read_replies(), name=f"rpc-client {self.endpoint}")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise  # we are being cancelled ourselves: let it through
            self._reader = None
        if self._sock is not None:
            _close_socket(self._sock)
            self._sock = self._raw = None

    async def call(self, msg: Message, *, timeout: float | None = None) -> Message:
        """Send ``msg`` and return its reply; raises ActorTimeout, or the error an ErrorReply
        names. ``timeout`` defaults to the client's."""
        return await (await self.send(msg, timeout=timeout))

    async def send(self, msg: Message, *, timeout: float | None = None) -> Coroutine[Any, Any, Message]:
        """Send ``msg`` now and return the awaitable of its reply (which the caller must await).

        Messages sent by successive ``send`` awaits leave in that order, and a server answers
        one peer's messages in arrival order, so a caller can pipeline: send several, then
        await their replies. ``timeout`` (the client's by default) bounds the send and the
        reply wait, each.
        """
        if self._sock is None or self._raw is None or self._reader is None:
            raise RuntimeError("RpcClient is not open (use 'async with')")
        if self._reader.done():  # the receive task died: surface why, every time
            self._reader.result()
        wait = self.timeout if timeout is None else timeout
        corr = _CORR.pack(next(self._ids))
        fut = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        try:
            frames = [corr, *encode(msg)]
            try:  # the plain socket first: no future when the pipe has room (the usual case)
                self._raw.send_multipart(frames, zmq.NOBLOCK, copy=False)
                # The plain send may consume the fd edge of a reply that arrived meanwhile:
                # re-arm the reader's waiting recv (see RpcServer._send), or it never wakes.
                self._sock.get(zmq.EVENTS)
            except zmq.Again:  # no peer yet, or the pipe is full: wait for room
                async with asyncio.timeout(wait):
                    await self._sock.send_multipart(frames, copy=False)
        except TimeoutError:
            self._pending.pop(corr, None)
            raise ActorTimeout(
                f"{type(msg).__name__} to {self.endpoint}: not sent within {wait:g}s"
            ) from None
        except BaseException:
            self._pending.pop(corr, None)
            raise
        return self._reply(msg, corr, fut, wait)

    async def _reply(self, msg: Message, corr: bytes, fut: asyncio.Future, wait: float) -> Message:
        try:
            async with asyncio.timeout(wait):
                reply = await fut
        except TimeoutError:
            raise ActorTimeout(
                f"{type(msg).__name__} to {self.endpoint}: no reply within {wait:g}s"
            ) from None
        finally:
            self._pending.pop(corr, None)
        if isinstance(reply, ErrorReply):
            raise_error(reply)
        return reply

    def _deliver(self, frames: list) -> None:
        fut = self._pending.get(frames[0].bytes) if frames else None
        if fut is None or fut.done():
            self.late_replies += 1  # its caller timed out already
            return
        try:
            fut.set_result(decode(frames[1:], self._limits))
        except ProtocolError as e:
            fut.set_exception(e)

    async def _read_replies(self) -> None:
        assert self._sock is not None
        try:
            while True:
                self._deliver(await self._sock.recv_multipart(copy=False))
                for _ in range(_DRAIN_MAX):  # as in the server: drain without the event loop
                    try:
                        frames = self._raw.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._deliver(frames)
        except BaseException as e:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(
                        ActorTimeout(f"client to {self.endpoint} closed")
                        if isinstance(e, asyncio.CancelledError)
                        else e
                    )
            raise
