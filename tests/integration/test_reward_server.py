"""The HTTP reward client against real servers on loopback: the reference server, a silent
socket, canned misbehaving servers, and the ``python -m spotlight.rewards.http`` entry point."""

from __future__ import annotations

import base64
import http.client
import io
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from spotlight.errors import ActorDead, ActorTimeout, ConfigError, ProtocolError
from spotlight.rewards import make_reward
from spotlight.rewards.http import HttpReward, RewardServer, encode_request
from spotlight.rewards.jpeg import JpegCompressibility

RNG = np.random.default_rng(1)
IMAGES = RNG.integers(0, 256, size=(4, 24, 32, 3), dtype=np.uint8)
IMAGES[1] = 200  # one flat image so the scores differ
PROMPTS = ["a red cube", "two blue balls", "", "ünïcødé ✓"]


@pytest.fixture
def jpeg_server() -> Iterator[RewardServer]:
    with RewardServer(JpegCompressibility(quality=80)) as server:
        yield server


def _post(url: str, body: bytes, path: str = "/score") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _png_b64(img: np.ndarray, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


# --- the reference server -----------------------------------------------------------------------
def test_served_scores_equal_direct_call(jpeg_server: RewardServer) -> None:
    client = make_reward("http", url=jpeg_server.url, timeout_s=10.0, retries=0)
    served = client(IMAGES, PROMPTS)
    direct = JpegCompressibility(quality=80)(IMAGES, PROMPTS)
    assert served.dtype == np.float32 and served.shape == (4,)
    np.testing.assert_array_equal(served, direct)  # PNG is lossless: exactly equal
    assert served[1] > served[0]
    # The full endpoint URL works as well as the base URL.
    np.testing.assert_array_equal(HttpReward(jpeg_server.url + "/score", 10.0)(IMAGES, PROMPTS),
                                  direct)


def test_health(jpeg_server: RewardServer) -> None:
    host, port = jpeg_server.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok", "reward": "jpeg"}
    conn.close()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", '"images" and "prompts"'),
        (json.dumps({"images": [], "prompts": ["x"]}).encode(), "0 images, prompts ['str']"),
        (json.dumps({"images": ["@@@"], "prompts": ["x"]}).encode(), "base64"),
        (json.dumps({"images": [_png_b64(IMAGES[0], "JPEG")], "prompts": ["x"]}).encode(),
         "RGB PNG"),
        (json.dumps({"images": [_png_b64(IMAGES[0]), _png_b64(IMAGES[0, :8])],
                     "prompts": ["x", "y"]}).encode(), "differ in size"),
        (json.dumps({"images": [_png_b64(IMAGES[0])], "prompts": [3]}).encode(), "prompts ['int']"),
    ],
)
def test_malformed_request_gets_400_and_server_keeps_serving(
    jpeg_server: RewardServer, body: bytes, needle: str
) -> None:
    status, reply = _post(jpeg_server.url, body)
    assert status == 400
    assert needle in reply["error"]
    status, reply = _post(jpeg_server.url, body, path="/nope")
    assert status == 404
    # Still serving, with correct answers.
    client = HttpReward(jpeg_server.url, timeout_s=10.0, retries=0)
    np.testing.assert_array_equal(client(IMAGES[:2], PROMPTS[:2]),
                                  JpegCompressibility(quality=80)(IMAGES[:2], PROMPTS[:2]))


def test_reward_that_raises_gives_500_and_protocol_error_without_retry() -> None:
    calls = []

    class Broken:
        name = "broken"

        def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
            calls.append(len(prompts))
            raise RuntimeError("model fell over")

    with RewardServer(Broken()) as server:
        client = HttpReward(server.url, timeout_s=10.0, retries=3)
        with pytest.raises(ProtocolError, match="HTTP 500.*model fell over"):
            client(IMAGES, PROMPTS)
    assert calls == [4]  # a deterministic failure is not retried


# --- misbehaving servers ------------------------------------------------------------------------
def test_silent_server_times_out_within_bound() -> None:
    # A listening socket that is never accept()ed: the kernel completes the handshake and
    # buffers the request, but no reply ever comes.
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        client = HttpReward(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=1, backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(ActorTimeout, match="no reply within 0.3s"):
            client(IMAGES, PROMPTS)
        elapsed = time.monotonic() - start
    assert 0.6 <= elapsed < 0.6 + 0.05 + 2.0  # two attempts, one backoff, generous slack


def test_refused_connection_is_actor_dead() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed on exit: nothing listens there any more
    with pytest.raises(ActorDead, match="connection failed"):
        HttpReward(f"http://127.0.0.1:{port}", timeout_s=2.0, retries=1, backoff_s=0.0)(
            IMAGES, PROMPTS)


@contextmanager
def canned_server(replies: list[tuple[int, bytes]]) -> Iterator[tuple[list[int], str]]:
    """A server answering POSTs with ``replies`` in order (the last one repeats); yields (the
    batch sizes it was asked to score, one per request; its URL)."""
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(len(json.loads(body)["images"]))
            status, data = replies[min(len(seen), len(replies)) - 1]
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield seen, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join(timeout=10)
        httpd.server_close()


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (b'{"scores": [1.0, 2.0, 3.0]}', "3 scores for 4 images"),
        (b'{"scores": [1.0, 2.0, 3.0, 4.0, 5.0]}', "5 scores for 4 images"),
        (b'{"scores": [1.0, NaN, 3.0, 4.0]}', r"scores\[1\] is not a finite number"),
        (b'{"scores": [1.0, 2.0, "3", 4.0]}', r"scores\[2\] is not a finite number"),
        (b'{"scores": [1.0, 2.0, 3.0, true]}', r"scores\[3\] is not a finite number"),
        (b'{"score": [1, 2, 3, 4]}', 'no "scores" list'),
        (b"<html>oops</html>", "not JSON"),
    ],
)
def test_malformed_reply_is_protocol_error(reply: bytes, needle: str) -> None:
    with canned_server([(200, reply)]) as (seen, url):
        with pytest.raises(ProtocolError, match=needle):
            HttpReward(url, timeout_s=5.0, retries=2)(IMAGES, PROMPTS)
    assert seen == [4]  # a malformed reply is a broken protocol, not retried


def test_overloaded_server_is_retried_then_succeeds() -> None:
    ok = json.dumps({"scores": [0.5, 1.5, 2.5, 3.5]}).encode()
    with canned_server([(503, b'{"error": "busy"}'), (503, b"{}"), (200, ok)]) as (seen, url):
        scores = HttpReward(url, timeout_s=5.0, retries=2, backoff_s=0.01)(IMAGES, PROMPTS)
    np.testing.assert_array_equal(scores, np.array([0.5, 1.5, 2.5, 3.5], np.float32))
    assert seen == [4, 4, 4]


def test_overloaded_server_exhausts_retries() -> None:
    with canned_server([(503, b'{"error": "busy"}')]) as (seen, url):
        with pytest.raises(ActorTimeout, match="HTTP 503: busy"):
            HttpReward(url, timeout_s=5.0, retries=1, backoff_s=0.01)(IMAGES, PROMPTS)
    assert seen == [4, 4]


def test_oversized_reply_is_protocol_error() -> None:
    big = json.dumps({"scores": [0.0] * 4, "pad": "x" * 5000}).encode()
    with canned_server([(200, big)]) as (_, url):
        with pytest.raises(ProtocolError, match="over the 1000-byte limit"):
            HttpReward(url, timeout_s=5.0, max_reply_bytes=1000)(IMAGES, PROMPTS)


def test_client_config_and_input_checks() -> None:
    with pytest.raises(ConfigError, match="url"):
        HttpReward("ftp://host/x")
    with pytest.raises(ConfigError, match="timeout_s"):
        HttpReward("http://127.0.0.1:1", timeout_s=0)
    with pytest.raises(ConfigError, match="retries"):
        HttpReward("http://127.0.0.1:1", retries=-1)
    client = HttpReward("http://127.0.0.1:1", timeout_s=1.0)
    with pytest.raises(ValueError, match="one prompt per image"):
        client(IMAGES, PROMPTS[:3])
    # An empty batch needs no server (nothing listens on port 1).
    assert client(np.zeros((0, 4, 4, 3), np.uint8), []).shape == (0,)
    assert len(encode_request(IMAGES[:1], ["x"])) > 0


# --- the command-line server --------------------------------------------------------------------
@pytest.mark.slow
def test_module_entry_point_serves_jpeg() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotlight.rewards.http", "--reward", "jpeg", "--port", "0",
         "--option", "quality=70"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        # Read the "serving ... at URL" line on a thread so the wait is bounded.
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
        line = lines.get(timeout=30)
        assert "serving reward 'jpeg' at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].strip()
        scores = HttpReward(url, timeout_s=10.0, retries=0)(IMAGES, PROMPTS)
        np.testing.assert_array_equal(scores, JpegCompressibility(quality=70)(IMAGES, PROMPTS))
    finally:
        proc.terminate()  # SIGTERM: the server exits cleanly
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()


def test_oversized_request_gets_413_and_server_keeps_serving() -> None:
    with RewardServer(JpegCompressibility(), max_request_bytes=2000) as server:
        status, reply = _post(server.url, encode_request(IMAGES, PROMPTS))
        assert status == 413 and "over 2000 bytes" in reply["error"]
        flat = np.zeros((1, 8, 8, 3), np.uint8)
        np.testing.assert_array_equal(HttpReward(server.url, timeout_s=10.0)(flat, ["x"]),
                                      JpegCompressibility()(flat, ["x"]))
