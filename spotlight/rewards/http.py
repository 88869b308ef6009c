"""Rewards served over HTTP: a client (:class:`HttpReward`) and a reference server.

Big scorers (PickScore, OCR, a VLM judge) live in their own process or machine, as in
Flow-GRPO, so a training run does not hold their weights. The wire is deliberately plain JSON
that any language can serve::

    POST /score   {"prompts": [str, ...], "images": [base64 PNG (RGB), ...]}
    200           {"scores": [float, ...]}          one finite float per image, in order
    4xx / 5xx     {"error": str}
    GET /health   {"status": "ok", "reward": name}

How the client fails, after ``retries`` extra attempts where retrying can help:

- no reply within ``timeout_s`` (per attempt) ......... retried, then ActorTimeout
- connection refused / reset / closed early ........... retried, then ActorDead
- HTTP 502 / 503 / 504 (overloaded, behind a proxy) ... retried, then ActorTimeout
- other non-200 (bad request, the reward raised) ...... ProtocolError at once
- 200 with a malformed reply (length, non-finite) ..... ProtocolError at once

The wire uses only the standard library (http.client, http.server): no pickle, no extra
dependency for a server often deployed apart from the package.

Run a server: ``python -m spotlight.rewards.http --reward jpeg --port 8000 [--option quality=90]``
"""

from __future__ import annotations

import argparse
import base64
import binascii
import http.client
import io
import json
import logging
import math
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from PIL import Image

from spotlight.errors import ActorDead, ActorTimeout, ConfigError, ProtocolError
from spotlight.rewards.base import RewardFn, check_batch, check_scores, make_reward
from spotlight.signals import sigterm_as_interrupt

__all__ = ["HttpReward", "RewardServer", "decode_request", "encode_request", "serve_reward"]

log = logging.getLogger(__name__)

SCORE_PATH = "/score"
_RETRY_STATUSES = {502, 503, 504}
_MAX_IMAGE_PIXELS = 4096 * 4096  # per image; refuses decompression bombs before decoding


# --- wire format --------------------------------------------------------------------------------
def encode_request(images: np.ndarray, prompts: Sequence[str]) -> bytes:
    """JSON body for POST /score. PNG keeps pixels exact, so a served reward equals a local one."""
    encoded = []
    for img in images:
        buf = io.BytesIO()
        # compress_level=1: fastest; size barely matters on a LAN and PNG is lossless anyway.
        Image.fromarray(img).save(buf, format="PNG", compress_level=1)
        encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return json.dumps({"prompts": list(prompts), "images": encoded}).encode("utf-8")


class BadRequest(ValueError):
    """A request body the server refuses (answered with HTTP 400 and this message)."""


def decode_request(body: bytes) -> tuple[np.ndarray, list[str]]:
    """Parse a POST /score body into (uint8 [B, H, W, 3], prompts); BadRequest if malformed."""
    try:
        msg = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("images"), list) \
            or not isinstance(msg.get("prompts"), list):
        raise BadRequest('body must be an object with lists "images" and "prompts"')
    images, prompts = msg["images"], msg["prompts"]
    if len(images) != len(prompts) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(f"need one string prompt per image: {len(images)} images, "
                         f"prompts {[type(p).__name__ for p in prompts][:8]}")
    arrays = [_decode_png(s, i) for i, s in enumerate(images)]
    if len({a.shape for a in arrays}) > 1:
        raise BadRequest(f"images differ in size: {sorted({a.shape for a in arrays})}")
    batch = np.stack(arrays) if arrays else np.zeros((0, 1, 1, 3), dtype=np.uint8)
    return batch, prompts


def _decode_png(data: Any, index: int) -> np.ndarray:
    if not isinstance(data, str):
        raise BadRequest(f"images[{index}] must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"images[{index}] is not valid base64: {e}") from None
    try:
        with Image.open(io.BytesIO(raw)) as img:
            # Check format, mode and size from the header before decoding any pixels.
            if img.format != "PNG" or img.mode != "RGB":
                raise BadRequest(f"images[{index}] must be an RGB PNG, got {img.format} {img.mode}")
            if img.width * img.height > _MAX_IMAGE_PIXELS:
                raise BadRequest(f"images[{index}] is too large: {img.width}x{img.height}")
            return np.asarray(img, dtype=np.uint8)
    except BadRequest:
        raise
    except Exception as e:  # PIL raises many types for corrupt data; all mean "bad image"
        raise BadRequest(f"images[{index}] is not a readable PNG: {e!r}") from None


def decode_scores(data: bytes, batch: int, url: str) -> np.ndarray:
    """Parse a 200 reply into float32 [batch]; raise ProtocolError if it is anything else."""
    try:
        msg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"reward server {url}: reply is not JSON: {e}") from None
    scores = msg.get("scores") if isinstance(msg, dict) else None
    if not isinstance(scores, list):
        raise ProtocolError(f'reward server {url}: reply has no "scores" list: {data[:200]!r}')
    if len(scores) != batch:
        raise ProtocolError(f"reward server {url}: {len(scores)} scores for {batch} images")
    for i, s in enumerate(scores):
        # bool is an int in Python but never a score; json.loads also accepts NaN/Infinity.
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ProtocolError(f"reward server {url}: scores[{i}] is not a finite number: {s!r}")
    return np.asarray(scores, dtype=np.float32)


# --- client -------------------------------------------------------------------------------------
class HttpReward:
    """A RewardFn whose scores come from a reward server (see the module docstring).

    ``url`` is the server's base (``http://host:port``) or the full endpoint; an empty path
    means ``/score``. ``timeout_s`` bounds each attempt from connect to the last reply byte,
    so a call takes at most about ``(retries + 1) * timeout_s`` plus the short backoffs.
    """

    def __init__(self, url: str, timeout_s: float = 60.0, retries: int = 2, *,
                 backoff_s: float = 0.2, name: str = "http",
                 max_reply_bytes: int = 1 << 20) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"http.url must be http(s)://host[:port][/path], got {url!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"http.timeout_s must be a positive number, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"http.retries must be an int >= 0, got {retries!r}")
        if not (isinstance(backoff_s, (int, float)) and 0 <= backoff_s <= timeout_s):
            raise ConfigError(f"http.backoff_s must be in [0, timeout_s], got {backoff_s!r}")
        self.url, self.name, self.retries = url, name, retries
        self.timeout_s, self.backoff_s = float(timeout_s), float(backoff_s)
        self.max_reply_bytes = max_reply_bytes
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._path = (parts.path or SCORE_PATH) + (f"?{parts.query}" if parts.query else "")

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        check_batch(images, prompts)
        if len(prompts) == 0:
            return np.zeros(0, dtype=np.float32)
        body = encode_request(images, prompts)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:  # exponential backoff: room for a busy or restarting server to recover
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.timeout_s))
            try:
                status, data = self._post(body)
            except TimeoutError as e:  # before OSError, which it is a subclass of
                last = ActorTimeout(f"reward server {self.url}: no reply within {self.timeout_s}s")
                last.__cause__ = e
                continue
            # Refused, reset, closed mid-reply (RemoteDisconnected is a ConnectionResetError),
            # unreachable host: nothing is serving there, at least for now.
            except (OSError, http.client.IncompleteRead) as e:
                last = ActorDead(f"reward server {self.url}: connection failed: {e!r}")
                last.__cause__ = e
                continue
            except http.client.HTTPException as e:  # garbage status line or headers
                raise ProtocolError(f"reward server {self.url}: bad HTTP reply: {e!r}") from e
            if status == 200:
                return decode_scores(data, len(prompts), self.url)
            error = _error_text(data)
            if status in _RETRY_STATUSES:
                last = ActorTimeout(f"reward server {self.url}: HTTP {status}: {error}")
                continue
            raise ProtocolError(f"reward server {self.url}: HTTP {status}: {error}")
        assert last is not None
        log.warning("reward server %s failed %d attempt(s): %s", self.url, self.retries + 1, last)
        raise last

    def _post(self, body: bytes) -> tuple[int, bytes]:
        """One attempt under one deadline: socket timeouts are per operation, so each read
        gets only the time left, and a server trickling bytes cannot stretch the attempt."""
        deadline = time.monotonic() + self.timeout_s

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            return left

        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        try:
            conn.request("POST", self._path, body=body,
                         headers={"Content-Type": "application/json", "Connection": "close"})
            # Keep our own handle: with "Connection: close" getresponse() hands the socket to
            # the response and sets conn.sock to None, but the timeout still has to shrink.
            sock = conn.sock
            sock.settimeout(remaining())
            resp = conn.getresponse()
            chunks, size = [], 0
            # The response closes the socket itself once the body is complete.
            while not resp.isclosed():
                sock.settimeout(remaining())
                chunk = resp.read(64 * 1024)
                if not chunk:
                    break
                size += len(chunk)
                if size > self.max_reply_bytes:
                    raise ProtocolError(f"reward server {self.url}: reply is over the "
                                        f"{self.max_reply_bytes}-byte limit")
                chunks.append(chunk)
            return resp.status, b"".join(chunks)
        finally:
            conn.close()

    def __repr__(self) -> str:
        return f"HttpReward({self.url!r}, timeout_s={self.timeout_s}, retries={self.retries})"


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"])
    except Exception:  # not our JSON error shape: show the start of whatever came back
        return repr(data[:200])


# --- server -------------------------------------------------------------------------------------
def _make_handler(reward_fn: RewardFn, lock: threading.Lock,
                  max_request_bytes: int) -> type[BaseHTTPRequestHandler]:
    class RewardHandler(BaseHTTPRequestHandler):
        # A client that connects and then stalls must not hold a server thread forever.
        timeout = 60

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path != "/health":
                return self._reply(404, {"error": f"no such path {self.path!r}"})
            self._reply(200, {"status": "ok", "reward": reward_fn.name})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != SCORE_PATH:
                return self._reply(404, {"error": f"POST to {SCORE_PATH}, not {self.path!r}"})
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                return self._reply(411, {"error": f"need a Content-Length, got {length!r}"})
            if int(length) > max_request_bytes:
                # Drain (bounded) before answering: closing on unread data sends a TCP reset,
                # which can destroy the 413 before the client reads it.
                left = min(int(length), 4 * max_request_bytes)
                while left > 0 and (chunk := self.rfile.read(min(left, 1 << 16))):
                    left -= len(chunk)
                self.close_connection = True
                return self._reply(413, {"error": f"body over {max_request_bytes} bytes"})
            body = self.rfile.read(int(length))
            if len(body) != int(length):
                return self._reply(400, {"error": "body shorter than Content-Length"})
            try:
                images, prompts = decode_request(body)
            except BadRequest as e:
                return self._reply(400, {"error": str(e)})
            if not prompts:
                return self._reply(200, {"scores": []})
            try:
                # One batch at a time: reward models (GPU or not) are rarely thread-safe.
                with lock:
                    scores = check_scores(reward_fn(images, prompts), len(prompts), reward_fn.name)
            except Exception as e:
                log.exception("reward %s failed on a batch of %d", reward_fn.name, len(prompts))
                return self._reply(500, {"error": f"reward failed: {type(e).__name__}: {e}"})
            self._reply(200, {"scores": [float(s) for s in scores]})

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload, allow_nan=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("%s " + format, self.address_string(), *args)  # not raw stderr

    return RewardHandler


class RewardServer:
    """Serves one RewardFn over HTTP; a context manager that runs it on a background thread.

    Malformed requests get a 400 with a JSON error and the server keeps serving; a reward that
    raises gets a 500. ``port=0`` picks a free port; read it back from ``url``/``address``.
    """

    def __init__(self, reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0, *,
                 max_request_bytes: int = 256 << 20) -> None:
        handler = _make_handler(reward_fn, threading.Lock(), max_request_bytes)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return str(self._httpd.server_address[0]), int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return "http://{}:{}".format(*self.address)

    def start(self) -> RewardServer:
        """Serve on a daemon thread; returns self. The socket is already listening."""
        if self._thread is not None:
            raise RuntimeError("RewardServer already started")
        # A short poll interval makes close() (shutdown waits for the next poll) quick.
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        name="reward-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until interrupted."""
        self._httpd.serve_forever()

    def close(self) -> None:
        # shutdown() waits for serve_forever to stop, so call it only if a thread runs one.
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_reward(reward_fn: RewardFn, host: str = "127.0.0.1", port: int = 0, *,
                 on_ready: Callable[[str], None] | None = None) -> None:
    """Serve ``reward_fn`` on the calling thread until interrupted; ``on_ready(url)`` is called
    once the socket listens (useful with ``port=0``)."""
    server = RewardServer(reward_fn, host, port)
    try:
        if on_ready is not None:
            on_ready(server.url)
        server.serve_forever()
    finally:
        server.close()


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, lists
    except json.JSONDecodeError:
        return key, value  # a bare string


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotlight.rewards.http",
                                     description="Serve a registered reward over HTTP.")
    parser.add_argument("--reward", required=True, help="registered reward name, e.g. jpeg")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed)")
    parser.add_argument("--option", type=_parse_option, action="append", default=[],
                        metavar="KEY=VALUE", help="reward constructor argument (JSON value)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    reward = make_reward(args.reward, **dict(args.option))
    # SIGTERM (from a launcher or a test) leaves like Ctrl-C, through the finally blocks that close
    # the socket, even when it lands in a finalizer
    try:
        with sigterm_as_interrupt():
            serve_reward(reward, args.host, args.port, on_ready=lambda url: print(
                f"serving reward {reward.name!r} at {url}{SCORE_PATH}", flush=True))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
