"""``LocalRuntime``: the actor runtime as local processes, for `spotlight run` and the reserved side.

    with LocalRuntime(recipe) as rt:                     # queue, store, controller, agents up
        loop = Loop(recipe, executor=rt.executor)
        loop.run()                                       # every batch runs on the workers
    # every process it started (and every worker they started) is gone here

It spawns the request queue and the tensor store as processes, runs the controller (its server
and its queue/store clients) on a background asyncio loop in this process (the trainer's
process: the reserved side), and spawns node agents: one with ``runtime.reserved_workers``
reserved workers and, when ``runtime.spot_workers`` > 0, one with that many local "spot" workers.
Every knob comes from the recipe's ``[runtime]`` (``spotlight.actors.config.RuntimeConfig``).
Over ipc by default; ``runtime.transport = "tcp"`` binds the queue, store and controller on TCP
(where ``ServeConfig`` says) so spot nodes on other hosts can join (``spotlight reserved``).

Supervision: every child's stdout and stderr go to ``<run folder>/logs/<actor>.log``; a watcher
thread per child waits for its exit. When the queue, the store or the reserved agent exits
outside shutdown — or a local spot agent exits with a failure (status != 0; a spot agent that
leaves cleanly on a notice is a node leaving) — the controller loop is failed with one
``ActorDead`` line naming the actor, its exit status and its last log lines, so the driver's
pending and next calls raise at once instead of waiting out a timeout.

Teardown: agents get SIGTERM (they stop their workers and release leases), then the controller
loop stops, then the services get SIGTERM; anything left after ``runtime.stop_grace_s`` is
killed. After an actor died, nothing is left to leave cleanly for: everything is killed at once.
Children also die with this process (PR_SET_PDEATHSIG) if it is killed outright.

Spot capacity (the recipe's ``[spot]``): with ``spot.trace`` set, the local spot nodes are the
trace's, replayed by a ``FaultInjector`` (``spotlight.spot.injector``): nodes present at run second
0 start with the runtime, later ones come and go while the run goes on (``add_node``,
``signal_node``: a notice or a SIGKILL), and ``runtime.spot_workers`` is not used. Run second 0
of the replay is the run's start, the first ``executor`` (the trainer ready to roll out), not the
runtime's: the machine's start-up (cold workers, the trainer's model) never eats into the trace.
A spot agent's exit, of any status, is a node leaving, never the run's failure. The trace is
read (or drawn) before anything starts: a bad one is one ``ConfigError`` line. ``account``
(``SpotAccount``) counts GPU-seconds and dollars per node class from the controller's join, leave
and lost events (and the trainer's reserved GPU, from the start to the end), preemptions, and, from
the workers' step log (``<logs>/steps.log``), requests
resumed or re-run and steps lost; ``metrics_hook`` puts those on every iteration's metrics record.
Every weights version a worker loads (from the store, a neighbour or a kept copy) is a line of
``<logs>/weights.log`` (``spotlight.actors.worker.peers.read_weights_log``).

This module knows processes and addresses; the protocols live in the actors it starts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from spotlight.actors import procs
from spotlight.actors.config import ServeConfig
from spotlight.actors.controller.client import RuntimeExecutor
from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.controller.service import BackgroundLoop, Controller
from spotlight.actors.options import to_argv
from spotlight.comm import shm
from spotlight.comm.auth import cluster_client_keys, cluster_server_keys
from spotlight.errors import ActorDead, ActorTimeout
from spotlight.recipe import Recipe
from spotlight.spot.accounting import SpotAccount
from spotlight.spot.config import spot_replay
from spotlight.spot.injector import FaultInjector

log = logging.getLogger(__name__)


class LocalRuntime:
    """Context manager owning the runtime's processes; see the module docstring. ``serve``: where
    to bind and advertise under ``runtime.transport = "tcp"`` (and the CURVE keys, any transport)."""

    def __init__(self, recipe: Recipe, *, serve: ServeConfig | None = None,
                 log_dir: str | os.PathLike | None = None, spot_cpus: set[int] | None = None) -> None:
        self.recipe, self.config = recipe, recipe.runtime
        self.serve = serve or ServeConfig(host="127.0.0.1", port=0)
        self.log_dir = Path(log_dir) if log_dir else Path(recipe.run.out_dir) / recipe.run.name / "logs"
        self.services: dict[str, procs.Child] = {}  # "queue", "store"
        self.agents: dict[str, procs.Child] = {}  # "reserved", "spot" (static), or a spot node's id
        self._spot: set[str] = set()  # keys of self.agents that are spot nodes
        self.replay = spot_replay(recipe.spot)  # read (or drawn) before anything starts
        self.account = SpotAccount(recipe.spot.cost_config(), self.log_dir / "steps.log",
                                   trace_spot_price=self.replay.trace.spot_price if self.replay else None)
        self.injector: FaultInjector | None = None
        self.spot_cpus = spot_cpus
        """One-machine benches: the CPUs every local spot node's agent (and the workers it starts)
        is confined to, so spot work does not share the trainer's CPUs; None: no affinity."""
        self._agent_cmd: list[str] = []
        self.bg: BackgroundLoop | None = None
        self.controller: Controller | None = None
        self.endpoint = ""
        self._dir = ""
        self._lock = threading.Lock()  # orders a death report against the loop's start and close
        self._stopping = False
        self.death: ActorDead | None = None
        """The first actor death seen (the run's failure), or None."""
        self._died: concurrent.futures.Future = concurrent.futures.Future()  # raises ``death`` once set

    # --- addresses -----------------------------------------------------------------------------
    def _bind(self, name: str, port: int = 0) -> str:
        return f"ipc://{self._dir}/{name}.sock" if self.config.transport == "ipc" else f"tcp://{self.serve.host}:{port}"

    def _advertised(self, endpoint: str) -> str:
        if self.config.transport == "ipc":
            return endpoint
        host = self.serve.advertise or self.serve.host
        if host == "0.0.0.0":
            host = socket.gethostbyname(socket.gethostname())
        return f"tcp://{host}:{urlparse(endpoint).port}"

    # --- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> LocalRuntime:
        self._dir = tempfile.mkdtemp(prefix="spl-rt-")  # short: ipc paths are capped near 100 bytes
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "steps.log").unlink(missing_ok=True)  # this run's steps only
        (self.log_dir / "weights.log").unlink(missing_ok=True)  # and its weights loads
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _start(self) -> None:
        c = self.config
        if self.recipe.model.checkpoint is not None:  # fail here, clearly, not in every worker
            from spotlight.models.dit import resolve_checkpoint

            resolve_checkpoint(self.recipe.model.checkpoint)
        py = [sys.executable, "-m"]
        # CURVE: every service serves with the reserved key pair; every local client uses it too.
        keys = ["--keys", self.serve.keys] if self.serve.keys else []
        curve = cluster_server_keys(self.serve.keys) if self.serve.keys else None
        client_curve = cluster_client_keys(self.serve.keys) if self.serve.keys else None
        services = [("queue", "ready ", c.queue()), ("store", "tensor store ready on ", c.store())]
        for name, ready, config in services:  # both start at once; each readiness is awaited below
            port = self.serve.queue_port if name == "queue" else self.serve.store_port
            cmd = [*py, f"spotlight.actors.{name}", "--bind", self._bind(name, port), *to_argv(config), *keys]
            self.services[name] = self._spawn(name, cmd, ready)
        queue, store = (self._ready(self.services[n], c.service_start_s).split()[-1]
                        for n in ("queue", "store"))
        core = ControllerCore(self.recipe, self._advertised(queue), self._advertised(store))
        core.on_event = self.account.on_event
        # the trainer's device is a reserved GPU for the whole run, as the simulator bills its pool
        self.account.on_event("join", "trainer", {"kind": "reserved", "workers": 1})
        core.cost = self.account.snapshot
        bind = self._bind("controller", self.serve.port)
        bg = BackgroundLoop(lambda: Controller(core, bind=bind, queue=queue, store=store, curve=curve,
                                               timeout=c.store_timeout_s, client_curve=client_curve),
                            c.service_start_s)
        with self._lock:
            self.bg = bg
            if self.death is not None:  # an actor died before the loop existed
                bg.fail(self.death)
        self.controller = bg.value
        self.endpoint = self._advertised(self.controller.endpoint)
        # The local agents reach the controller over loopback, with the reserved keys when given.
        local = self.controller.endpoint.replace("0.0.0.0", "127.0.0.1")
        agent = self._agent_cmd = [*py, "spotlight.actors.node", "--controller", local, *keys,
                                   "--log-dir", str(self.log_dir)]
        static_spot = 0 if self.replay is not None else c.spot_workers  # a trace decides spot capacity
        for kind, n in [("reserved", c.reserved_workers), ("spot", static_spot)]:
            if n > 0:  # start all agents first: their workers load the model in parallel
                cmd = [*agent, "--workers", str(n), "--kind", kind, "--node-id", f"local-{kind}"]
                self.agents[kind] = self._spawn(f"agent-{kind}", cmd, "agent ready ")
                if kind == "spot":
                    self._spot.add(kind)
                    self._pin(self.agents[kind])
        if self.replay is not None:
            sp = self.recipe.spot
            log.warning("%s", self.replay.describe())
            self.injector = FaultInjector(
                self, self.replay.events(), warning_s=self.replay.scale_s(sp.warning_s),
                hard_kill_fraction=sp.hard_kill_fraction, notice_via=sp.notice_via, cloud=sp.cloud,
                seed=sp.seed, expect=self.account.expect)
            self.injector.play_initial()  # the nodes present at run second 0 start with the runtime
        for child in list(self.agents.values()):
            self._ready(child, c.agent_start_s)

    def _spawn(self, name: str, cmd: list[str], ready: str) -> procs.Child:
        return procs.spawn(name, cmd, log_path=self.log_dir / f"{name}.log", ready_prefix=ready,
                           on_exit=self._exited)

    # --- spot nodes that come and go -------------------------------------------------------------
    def add_node(self, node_id: str, *, metadata_url: str | None = None, wait: bool = False) -> None:
        """Start a spot node (an agent with ``spot.workers_per_node`` workers) named ``node_id``
        while the run goes on; it registers and pulls on its own (``wait``: until it is ready)."""
        with self._lock:
            if self._stopping or node_id in self.agents:
                return
            cmd = [*self._agent_cmd, "--workers", str(self.recipe.spot.workers_per_node), "--kind", "spot",
                   "--node-id", node_id, *(["--metadata-url", metadata_url] if metadata_url else [])]
            self._spot.add(node_id)
            child = self.agents[node_id] = self._spawn(f"agent-{node_id}", cmd, "agent ready ")
            self._pin(child)
        if wait:
            self._ready(child, self.config.agent_start_s)

    def _pin(self, agent: procs.Child) -> None:
        """A spot agent onto ``spot_cpus``, just spawned: it starts its workers only after it has
        imported and registered, so they inherit the affinity."""
        if self.spot_cpus:
            try:
                os.sched_setaffinity(agent.pid, self.spot_cpus)
            except ProcessLookupError:  # it died at once: its watcher reports that
                pass

    def signal_node(self, node_id: str, sig: int) -> bool:
        """Send ``sig`` to spot node ``node_id``'s agent (SIGTERM: a spot notice; SIGKILL: gone
        without a word); False when it is not running."""
        child = self.agents.get(node_id)
        if child is None or child.proc.poll() is not None:
            return False
        try:
            os.kill(child.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def node_alive(self, node_id: str) -> bool:
        child = self.agents.get(node_id)
        return child is not None and child.proc.poll() is None

    def spot_pids(self) -> dict[str, list[int]]:
        """Each running spot node's [agent pid, worker pids...]."""
        with self._lock:
            nodes = [(n, self.agents[n]) for n in sorted(self._spot)]
        return {n: [c.pid, *procs.descendants(c.pid)] for n, c in nodes if c.proc.poll() is None}

    def plot_spot(self, records: list[dict], path: Path) -> None:
        """Capacity over time with preemption marks, and reward against cost (``spot.png``)."""
        from spotlight.spot.plots import plot_spot

        plot_spot(self.account.events, records, path)

    def metrics_hook(self, record: dict) -> None:
        """A ``Loop`` hook: every iteration's record gets the spot fields (``SpotAccount.snapshot``)."""
        if record.get("event") == "iteration":
            record.update(self.account.snapshot())

    def _ready(self, child: procs.Child, timeout: float) -> str:
        """``child``'s readiness line; an actor's death (this one's or another's) fails at once."""
        try:
            return child.wait_ready(timeout, abort=self._died)
        except procs.ChildExited as e:
            raise ActorDead(str(e)) from None
        except TimeoutError as e:
            raise ActorTimeout(str(e)) from None

    def _exited(self, child: procs.Child) -> None:
        """Watcher thread: ``child`` exited. Outside shutdown, fail the run with one line."""
        if self._stopping:
            return
        if child.name.removeprefix("agent-") in self._spot:  # a spot node left (a notice) or died
            log.warning("%s", child.death())
            return
        with self._lock:
            if self._stopping or self.death is not None:
                return
            self.death = ActorDead(child.death())
            self._died.set_exception(self.death)
            log.error("%s", self.death)
            if self.bg is not None:
                self.bg.fail(self.death)

    def close(self) -> None:
        """Stop everything, in order; safe to call twice. After a death, kill without waiting."""
        with self._lock:
            self._stopping = True
        grace = 0.0 if self.death is not None else self.config.stop_grace_s
        if self.injector is not None:
            self.injector.stop()
        started = set(self.pids())
        for name in (c.name for c in procs.stop(list(self.agents.values()), grace)):
            log.warning("%s did not stop within %.0fs; killed it", name, grace)
        if self.bg is not None:
            self.bg.close(self.config.stop_grace_s)
        for name in (c.name for c in procs.stop(list(self.services.values()), grace)):
            log.warning("%s did not stop within %.0fs; killed it", name, grace)
        mine = {c.pid for c in [*self.agents.values(), *self.services.values()]}  # reaped above
        for pid in sorted(started - mine):  # belt and braces: no worker may outlive its agent
            if not procs.alive(pid):
                continue
            log.warning("killing leftover process %d", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Workers keep their weights in shared-memory segments; one killed with its agent (or
        # before it could unlink them) leaves them behind, named by its pid.
        shm.sweep_dead()
        self.account.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
        if self.injector is not None and self.injector.error is not None:
            error, self.injector.error = self.injector.error, None
            raise RuntimeError(f"the fault injector failed: {error!r}") from error

    # --- what the loop and API users get -------------------------------------------------------
    def executor(self, model, recipe: Recipe, version: int) -> RuntimeExecutor:
        """The driver's executor factory: an executor over this runtime with ``model``'s weights
        published as ``version`` (the weights the run starts from)."""
        assert self.controller is not None and self.bg is not None, "LocalRuntime is not started"
        if self.injector is not None and not self.injector.started:
            self.injector.start()  # run second 0 of the replay: the run starts now
        c = self.config
        nodes = self.controller.core.nodes  # the registry: nodes join and leave during a run

        def explorers() -> int:  # workers (SP groups) that pull exploration now: the planner's capacity
            return sum(n["workers"] // c.sp_degree for n in list(nodes.values())
                       if c.explore_on == "any" or n["kind"] == "spot")

        executor = RuntimeExecutor(self.bg, self.controller.queue, self.controller.store,
                                   wait_s=c.batch_timeout_s, rpc_s=c.call_timeout_s,
                                   explore_workers=explorers, epoch=self.controller.core.epoch,
                                   progress=self.controller.core.note)
        executor.publish(version, model)
        return executor

    @property
    def queue(self):
        """The queue's async client (lives on the controller loop: use ``call``)."""
        return None if self.controller is None else self.controller.queue

    @property
    def store(self):
        """The tensor store's async client (lives on the controller loop: use ``call``)."""
        return None if self.controller is None else self.controller.store

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine (e.g. ``rt.queue.stats()``) on the controller loop and return its
        result; ``timeout`` defaults to ``runtime.call_timeout_s``."""
        assert self.bg is not None, "LocalRuntime is not started"
        return self.bg.call(coro, self.config.call_timeout_s if timeout is None else timeout)

    def pids(self) -> list[int]:
        """Every process this runtime started, workers included (for tests and tooling)."""
        return [*(c.pid for c in [*self.agents.values(), *self.services.values()]),
                *(d for c in self.agents.values() for d in procs.descendants(c.pid))]
