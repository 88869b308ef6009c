"""``LocalRuntime``: the actor runtime as local processes, for `spotlight run` and the reserved side.

    with LocalRuntime(recipe) as rt:                     # queue, store, controller, agents up
        loop = Loop(recipe, executor_factory=rt.executor)
        loop.run()                                       # every batch runs on the workers
    # every process it started (and every worker they started) is gone here

It spawns the request queue and the tensor store as processes, runs the controller (its server
and its queue/store clients) on a background asyncio loop in this process (the trainer's
process: the reserved side), and spawns node agents: one with ``run.reserved_workers`` reserved
workers and, when ``run.spot_workers`` > 0, one with that many local "spot" workers. Over ipc by
default; ``transport="tcp"`` binds the queue, store and controller on TCP so spot nodes on other
hosts can join (``spotlight reserved``, ``launch/reserved.sh``).

Teardown: agents get SIGTERM (they stop their workers and release leases), then the controller
loop stops, then the services get SIGTERM; anything left after the grace period is killed.
Children also die with this process (PR_SET_PDEATHSIG) if it is killed outright.

This module knows processes and addresses; the protocols live in the actors it starts.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from spotlight.actors.controller.client import RuntimeExecutor
from spotlight.actors.controller.core import ControllerCore
from spotlight.actors.controller.service import BackgroundLoop, Controller
from spotlight.actors.procs import alive, descendants, die_with_parent
from spotlight.comm.auth import cluster_client_keys, cluster_server_keys
from spotlight.errors import ActorTimeout, SpotlightError
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


class LocalRuntime:
    """Context manager owning the runtime's processes; see the module docstring."""

    def __init__(self, recipe: Recipe, *, transport: str = "ipc", host: str = "127.0.0.1",
                 advertise: str | None = None, controller_port: int = 0, lease_s: float = 30.0,
                 spot_workers: int | None = None, reserved_workers: int | None = None,
                 log_dir: str | os.PathLike | None = None, start_timeout_s: float = 300.0,
                 curve_keys: str | None = None) -> None:
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        self.recipe, self.transport, self.host = recipe, transport, host
        self.advertise_host = advertise or host
        self.controller_port, self.lease_s, self.start_timeout_s = controller_port, lease_s, start_timeout_s
        self.spot_workers = recipe.run.spot_workers if spot_workers is None else spot_workers
        self.reserved_workers = recipe.run.reserved_workers if reserved_workers is None else reserved_workers
        self.log_dir = Path(log_dir) if log_dir else Path(recipe.run.out_dir) / recipe.run.name / "logs"
        self.curve_keys = curve_keys
        self.services: dict[str, subprocess.Popen] = {}
        self.agents: dict[str, subprocess.Popen] = {}
        self.bg: BackgroundLoop | None = None
        self.controller: Controller | None = None
        self.endpoint = ""
        self._dir = ""

    # --- addresses -----------------------------------------------------------------------------
    def _bind(self, name: str, port: int = 0) -> str:
        return f"ipc://{self._dir}/{name}.sock" if self.transport == "ipc" else f"tcp://{self.host}:{port}"

    def _advertised(self, endpoint: str) -> str:
        if self.transport == "ipc":
            return endpoint
        return f"tcp://{self.advertise_host}:{urlparse(endpoint).port}"

    # --- lifetime ------------------------------------------------------------------------------
    def __enter__(self) -> LocalRuntime:
        self._dir = tempfile.mkdtemp(prefix="spl-rt-")  # short: ipc paths are capped near 100 bytes
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _start(self) -> None:
        if self.recipe.model.checkpoint is not None:  # fail here, clearly, not in every worker
            from spotlight.models.dit import resolve_checkpoint

            resolve_checkpoint(self.recipe.model.checkpoint)
        py = [sys.executable, "-m"]
        # CURVE: every service serves with the reserved key pair; every local client uses it too.
        keys = ["--keys", str(self.curve_keys)] if self.curve_keys else []
        curve = cluster_server_keys(self.curve_keys) if self.curve_keys else None
        client_curve = cluster_client_keys(self.curve_keys) if self.curve_keys else None
        queue = self._spawn("queue", [*py, "spotlight.actors.queue", "--bind", self._bind("queue"),
                                      "--lease-s", str(self.lease_s), *keys], "ready ", self.services)
        store = self._spawn("store", [*py, "spotlight.actors.store", "--bind", self._bind("store"), *keys],
                            "tensor store ready on ", self.services)
        core = ControllerCore(self.recipe, self._advertised(queue), self._advertised(store), self.lease_s)
        bind = self._bind("controller", self.controller_port)
        self.bg = BackgroundLoop(lambda: Controller(core, bind=bind, queue=queue, store=store, curve=curve,
                                                    client_curve=client_curve))
        self.controller = self.bg.value
        self.endpoint = self._advertised(self.controller.endpoint)
        # The local agents reach the controller over loopback, with the reserved keys when given.
        local = self.controller.endpoint.replace("0.0.0.0", "127.0.0.1")
        agent = [*py, "spotlight.actors.node", "--controller", local, *keys]
        plan = [("reserved", self.reserved_workers), ("spot", self.spot_workers)]
        for kind, n in plan:  # start all agents first: their workers load the model in parallel
            if n > 0:
                self.agents[kind] = self._popen(f"agent-{kind}", [*agent, "--workers", str(n), "--kind", kind,
                                                                    "--node-id", f"local-{kind}"])
        for kind, proc in self.agents.items():
            self._wait_line(f"agent-{kind}", proc, "agent ready ", self.start_timeout_s)

    def _popen(self, name: str, cmd: list[str]) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTLIGHT_DIE_WITH_PARENT": "1"}
        with open(self.log_dir / f"{name}.log", "ab") as err:
            # Own session: a terminal's Ctrl-C reaches this process, which tears down in order.
            kw: dict[str, Any] = {"start_new_session": True}
            if self.bg is None:  # no other thread yet: preexec_fn is safe
                kw["preexec_fn"] = die_with_parent
            return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, **kw)

    def _spawn(self, name: str, cmd: list[str], ready: str, into: dict[str, subprocess.Popen]) -> str:
        proc = into[name] = self._popen(name, cmd)
        return self._wait_line(name, proc, ready, 60.0).split()[-1]

    def _wait_line(self, name: str, proc: subprocess.Popen, prefix: str, timeout: float) -> str:
        """The process's readiness line (an event, not a sleep), or a clear error with its log."""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ActorTimeout(f"{name} not ready within {timeout}s (log: {self.log_dir / name}.log)")
            if select.select([proc.stdout], [], [], min(left, 0.5))[0]:
                line = proc.stdout.readline().decode(errors="replace")
                if line.startswith(prefix):
                    return line.strip()
                if not line:  # EOF: it exited
                    proc.wait()
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise SpotlightError(f"{name} exited with {proc.returncode} before ready:\n{tail}")

    def close(self) -> None:
        """Stop everything, in order; safe to call twice."""
        started = set(self.pids())
        self._stop_all(self.agents, grace_s=10.0)
        if self.bg is not None:
            self.bg.close()
            self.bg = None
        self._stop_all(self.services, grace_s=10.0)
        mine = {p.pid for p in [*self.agents.values(), *self.services.values()]}  # reaped above
        for pid in sorted(started - mine):  # belt and braces: no worker may outlive its agent
            if not alive(pid):
                continue
            log.warning("killing leftover process %d", pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    @staticmethod
    def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", name, grace_s)
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    # --- what the loop and API users get -------------------------------------------------------
    def executor(self, loop) -> RuntimeExecutor:
        """The ``Loop``'s executor factory: publishes the trainer's weights as the first version."""
        assert self.controller is not None and self.bg is not None, "LocalRuntime is not started"
        return RuntimeExecutor(loop.model, self.recipe, self.bg, self.controller.queue, self.controller.store,
                               version=loop.start_iteration)

    @property
    def queue(self):
        """The queue's async client (lives on the controller loop: use ``call``)."""
        return None if self.controller is None else self.controller.queue

    @property
    def store(self):
        """The tensor store's async client (lives on the controller loop: use ``call``)."""
        return None if self.controller is None else self.controller.store

    def call(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        """Run a coroutine (e.g. ``rt.queue.stats()``) on the controller loop and return its result."""
        assert self.bg is not None, "LocalRuntime is not started"
        return self.bg.call(coro, timeout)

    def pids(self) -> list[int]:
        """Every process this runtime started, workers included (for tests and tooling)."""
        return [*(p.pid for p in [*self.agents.values(), *self.services.values()]),
                *(c for p in self.agents.values() for c in descendants(p.pid))]
