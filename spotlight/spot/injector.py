"""The fault injector: plays spot capacity events on real node-agent processes.

``FaultInjector`` takes local node events in run seconds (``Replay.events()``: ``spot0`` added at
0 s, removed at 12.5 s, ...) and acts on a ``Nodes`` target (``LocalRuntime``):

- an addition starts a fresh agent with its workers (``add_node``); it registers with the
  controller and starts pulling on its own. Each incarnation of a trace node gets its own node id
  (``spot0.1``, ``spot0.2``, ...), so a node coming back is never confused with its predecessor
  still leaving;
- a removal is a spot notice with the cloud's warning (``SpotConfig.warning_s`` scaled like the
  trace: AWS 120 s at 1 trace hour = 60 run s is 2 s), delivered as SIGTERM or through the
  metadata endpoint the agent polls (``MetadataServer``, the cloud's own form); an agent still
  alive when the warning runs out gets SIGKILL, as the cloud would. A ``hard_kill_fraction`` of
  removals (seeded draws) are a SIGKILL with no notice at all.

``random_fault`` is the chaos suite's action: SIGKILL or SIGTERM of a random spot agent or spot
worker, and a fresh node for an agent that went (capacity is kept; ``replace_gone`` also replaces
an agent that exited on its own).

Every removal is announced to the run's ``SpotAccount`` first (``expect``), so it is counted as a
preemption. One thread plays the schedule; it waits on an event (``stop`` ends it at once), never
a fixed sleep. Knows processes and signals through the target; nothing of queues or models.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from spotlight.spot.traces import CapacityEvent

log = logging.getLogger(__name__)


class Nodes(Protocol):
    """What the injector acts on (``LocalRuntime`` is one)."""

    def add_node(self, node_id: str, *, metadata_url: str | None = None) -> None: ...
    def signal_node(self, node_id: str, sig: int) -> bool: ...
    def node_alive(self, node_id: str) -> bool: ...
    def spot_pids(self) -> dict[str, list[int]]: ...


class MetadataServer:
    """A local metadata endpoint in the cloud's form, one path per node:
    ``/<node>/latest/meta-data/spot/instance-action`` (AWS: 404 until a notice, then a JSON
    action) and ``/<node>/computeMetadata/v1/instance/preempted`` (GCP: FALSE, then TRUE)."""

    def __init__(self) -> None:
        self.noticed: set[str] = set()
        noticed = self.noticed

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                node, _, rest = self.path.lstrip("/").partition("/")
                if rest == "latest/meta-data/spot/instance-action":
                    if node not in noticed:
                        self.send_error(404)
                        return
                    body = json.dumps({"action": "terminate", "time": "now"}).encode()
                elif rest == "computeMetadata/v1/instance/preempted":
                    body = b"TRUE" if node in noticed else b"FALSE"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="spot-metadata", daemon=True)
        self._thread.start()

    def url(self, node_id: str, cloud: str = "aws") -> str:
        path = ("latest/meta-data/spot/instance-action" if cloud == "aws"
                else "computeMetadata/v1/instance/preempted")
        return f"http://127.0.0.1:{self.server.server_port}/{node_id}/{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


class FaultInjector:
    """Plays ``events`` (run seconds from ``start``) on ``nodes``; see the module docstring.

    ``warning_s``: run seconds from a notice to the SIGKILL; ``hard_kill_fraction``: share of
    removals that are a SIGKILL with no notice; ``notice_via``: "sigterm" or "metadata";
    ``expect``: called with a node id before it is taken away (the run's accounting).
    ``clock`` and ``call_later`` (delay, callback): the time source and the timer of the warning's
    SIGKILL; defaults: the monotonic clock and a thread per notice. The simulator
    (``spotlight.sim``) passes its virtual clock's and plays events with ``apply``."""

    def __init__(self, nodes: Nodes, events: list[CapacityEvent], *, warning_s: float,
                 hard_kill_fraction: float = 0.0, notice_via: str = "sigterm", cloud: str = "aws",
                 seed: int = 0, expect: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 call_later: Callable[[float, Callable[[], None]], object] | None = None) -> None:
        self.nodes, self.events = nodes, sorted(events, key=lambda e: e.time_s)
        self.warning_s, self.hard_kill_fraction, self.notice_via = warning_s, hard_kill_fraction, notice_via
        self.cloud, self.expect = cloud, expect or (lambda node: None)
        self.rng = random.Random(seed)
        self.metadata = MetadataServer() if notice_via == "metadata" else None
        self.current: dict[str, str] = {}  # trace node name -> its live incarnation's node id
        self._incarnation: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.log: list[dict] = []
        """Every action taken: {"t": run s, "action": add|notice|kill|hard_kill|..., "node": id}."""
        self.error: BaseException | None = None
        self.clock, self.call_later = clock, call_later
        self._t0 = clock()

    # --- the schedule ----------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> FaultInjector:
        """Play the schedule on a thread from now (run second 0 = now)."""
        self._t0 = self.clock()
        self._thread = threading.Thread(target=self._play, name="fault-injector", daemon=True)
        self._thread.start()
        return self

    def play_initial(self) -> None:
        """Apply the events at run second 0 now, on the caller's thread (the nodes present at start)."""
        while self.events and self.events[0].time_s <= 0:
            self._apply(self.events.pop(0))

    def _play(self) -> None:
        try:
            for event in self.events:
                if self._stop.wait(max(0.0, self._t0 + event.time_s - self.clock())):
                    return
                self._apply(event)
        except BaseException as e:  # reported by stop() to the owner, never swallowed
            log.exception("fault injector failed")
            self.error = e

    def stop(self) -> None:
        """Stop playing (pending notices' kills are not sent). What the player raised is in
        ``error`` for the owner to raise once its own cleanup is done."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.metadata is not None:
            self.metadata.close()
            self.metadata = None

    def _record(self, action: str, node: str) -> None:
        with self._lock:
            self.log.append({"t": round(self.clock() - self._t0, 3), "action": action, "node": node})

    def apply(self, event: CapacityEvent) -> None:
        """Act on one event now (the schedule's thread does this at each event's time; a caller
        with its own clock calls it instead of ``start``)."""
        self._apply(event)

    def _apply(self, event: CapacityEvent) -> None:
        if event.action == "add":
            self.add(event.node)
        else:
            node_id = self.current.pop(event.node, None)
            if node_id is not None:
                self.remove(node_id)

    # --- actions ---------------------------------------------------------------------------------
    def add(self, name: str) -> str:
        """Start a fresh incarnation of trace node ``name``; its node id."""
        k = self._incarnation[name] = self._incarnation.get(name, 0) + 1
        node_id = f"{name}.{k}"
        url = self.metadata.url(node_id, self.cloud) if self.metadata is not None else None
        self.nodes.add_node(node_id, metadata_url=url)
        self.current[name] = node_id
        self._record("add", node_id)
        return node_id

    def remove(self, node_id: str) -> None:
        """Take ``node_id`` away: a notice with the warning, or (hard_kill_fraction) a SIGKILL."""
        self.expect(node_id)
        if self.warning_s <= 0 or self.rng.random() < self.hard_kill_fraction:
            self.nodes.signal_node(node_id, signal.SIGKILL)
            self._record("hard_kill", node_id)
            return
        if self.metadata is not None:
            self.metadata.noticed.add(node_id)
        else:
            self.nodes.signal_node(node_id, signal.SIGTERM)
        self._record("notice", node_id)
        if self.call_later is not None:
            self.call_later(self.warning_s, lambda: self._kill_if_alive(node_id))
            return
        threading.Thread(target=self._kill_after_warning, args=(node_id,), name=f"warning {node_id}",
                         daemon=True).start()

    def _kill_after_warning(self, node_id: str) -> None:
        if self._stop.wait(self.warning_s):
            return
        self._kill_if_alive(node_id)

    def _kill_if_alive(self, node_id: str) -> None:
        if self.nodes.node_alive(node_id):
            self.nodes.signal_node(node_id, signal.SIGKILL)
            self._record("kill_after_warning", node_id)

    def replace_gone(self) -> list[str]:
        """Chaos: a fresh incarnation of every node whose agent exited on its own (one that gave
        up on a worker killed again and again while it loaded), so capacity is kept; their ids."""
        return [self.add(name) for name, node_id in sorted(self.current.items())
                if not self.nodes.node_alive(node_id)]

    def random_fault(self, among: list[str] | None = None) -> str:
        """Chaos: SIGKILL or SIGTERM a random spot agent or one of its workers (of the nodes
        ``among``, e.g. those busy now; default any); a node whose agent was hit is replaced by a
        fresh one. Returns what was done, e.g. "SIGKILL worker 123 of spot1.2"."""
        pids = {n: p for n, p in self.nodes.spot_pids().items()
                if self.nodes.node_alive(n) and (among is None or n in among)}
        if not pids:
            return "no spot node alive"
        node_id = self.rng.choice(sorted(pids))
        sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
        workers = pids[node_id][1:]
        if workers and self.rng.random() < 0.5:  # a worker: the agent restarts it
            pid = self.rng.choice(workers)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            what = f"{sig.name} worker {pid} of {node_id}"
        else:
            self.expect(node_id)
            self.nodes.signal_node(node_id, sig)
            name = next((n for n, i in self.current.items() if i == node_id), node_id.partition(".")[0])
            self.current.pop(name, None)
            if sig == signal.SIGTERM:
                threading.Thread(target=self._kill_after_warning, args=(node_id,), daemon=True).start()
            self.add(name)
            what = f"{sig.name} agent {node_id}"
        self._record(what, node_id)
        return what
