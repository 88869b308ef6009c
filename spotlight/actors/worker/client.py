"""The worker's client, as its node agent holds it: the worker process and the ipc ``RpcClient``
that drives it (start and wait for readiness, stop with a grace period). The worker's stderr is
the agent's (its log); after the readiness line its stdout is too (``procs.announce_ready``), so
the pipe read here never fills."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from spotlight.actors import procs
from spotlight.comm.shm import sweep_dead
from spotlight.comm.transport import RpcClient
from spotlight.errors import (
    ActorTimeout,
    ConfigError,
    SpotlightError,
)


class WorkerHandle:
    """One worker process and the ipc client that drives it."""

    def __init__(self, index: int, node_id: str, sock_dir: str) -> None:
        self.index, self.worker_id = index, f"{node_id}/w{index}"
        self.endpoint = f"ipc://{sock_dir}/w{index}.sock"
        self.proc: asyncio.subprocess.Process | None = None
        self.rpc: RpcClient | None = None
        self.restarts = -1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, store: str, recipe: dict, timeout: float, rpc_timeout: float,
                    keys: str | None = None, log_dir: str | None = None) -> None:
        self.restarts += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", procs.PARENT_PID_ENV: str(os.getpid())}
        args = ["--bind", self.endpoint, "--store", store, "--recipe-json", json.dumps(recipe),
                "--worker-id", self.worker_id, *(["--keys", keys] if keys else []),
                *(["--log-dir", log_dir] if log_dir else [])]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "spotlight.actors.worker", *args, stdout=asyncio.subprocess.PIPE, env=env,
            start_new_session=True)  # a terminal's Ctrl-C reaches the agent only; it stops workers
        try:
            async with asyncio.timeout(timeout):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            await self.kill()
            raise ActorTimeout(f"worker {self.worker_id} not ready within {timeout}s") from None
        if line.startswith(b"error "):  # a setting this worker cannot run with: one line
            await self.kill()
            raise ConfigError(f"worker {self.worker_id}: {line[6:].decode(errors='replace').strip()}")
        if not line.startswith(b"ready "):
            await self.kill()
            raise SpotlightError(f"worker {self.worker_id} failed to start (exit {self.proc.returncode})")
        self.rpc = RpcClient(self.endpoint, timeout=rpc_timeout)
        await self.rpc.__aenter__()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM (the worker finishes its step and flushes), SIGKILL after ``grace_s``;
        returns once the process is reaped."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await self.proc.wait()
            except TimeoutError:
                pass
        await self.kill()

    async def kill(self) -> None:
        """SIGKILL (a hung or dead worker) and reap; closes the client."""
        if self.rpc is not None:
            await self.rpc.close()
            self.rpc = None
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()  # SIGKILL cannot be caught: the kernel bounds this
            # Its weights live in shared-memory segments it could not unlink (named by its pid).
            sweep_dead()
