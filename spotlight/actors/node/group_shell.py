"""The process shell around `GroupScheduler`: spawns member processes, hosts the rendezvous store,
carries commands and events, and turns process deaths into scheduler events.

    with GroupAgent(degree=2, spec=spec, workdir=tmp) as agent:
        agent.add("a"); agent.add("b"); agent.add("spare")
        agent.submit("r1", job)
        agent.run_until(lambda: agent.committed_step("r1") >= 2)
        agent.kill("b")                       # SIGKILL; the survivors regroup with the spare
        agent.run_until(lambda: "r1" in agent.finished)

A member's death is seen the moment it happens (a pidfd per child in the same poll as the socket),
not at the next heartbeat. The agent never restarts a survivor: a regroup is a new epoch on the
same processes. One thread, one poll loop: every wait is bounded by the caller's timeout.

This shell knows processes, sockets and files; the decisions are the scheduler's.

It is a standalone harness (bench/elastic_sp.py, bench/gpu_check.py, tests/faults/test_elastic_sp.py:
regroup timing against a cold restart, peer weight copies, NCCL groups) with members that commit to
files. A run's node agent does not use it: with ``runtime.sp_degree`` > 1 the agent drives the same
``GroupScheduler`` over its ordinary workers (``spotlight.actors.node.sp``), which commit to the
tensor store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import zmq

from spotlight.actors.node.groups import Finished, Form, GroupScheduler, Kill, Leave
from spotlight.comm import messages as m
from spotlight.comm.codec import decode, encode
from spotlight.comm.shm import sweep_dead
from spotlight.errors import ActorTimeout


class GroupAgent:
    """Members of one node and their SP groups. `spec`: {"model": ModelConfig fields,
    "sampler": SamplerConfig fields, "weights": the store's safetensors file, "timeout_s":
    collective timeout}."""

    def __init__(self, degree: int, spec: dict, workdir: str | Path, *, stall_s: float = 30.0,
                 release_s: float = 5.0) -> None:
        from spotlight.parallel.comms import host_store

        self.workdir = Path(workdir)
        (self.workdir / "commits").mkdir(parents=True, exist_ok=True)
        self.store = host_store()
        self.spec = {**spec, "store_port": self.store.port, "commit_dir": str(self.workdir / "commits")}
        self.sched = GroupScheduler(degree, stall_s=stall_s, release_s=release_s)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.address = f"ipc://{self.workdir / 'agent.sock'}"
        self.sock.bind(self.address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.procs: dict[str, subprocess.Popen] = {}
        self.pidfds: dict[int, str] = {}
        self.idents: dict[str, bytes] = {}
        self.hello: dict[str, m.MemberHello] = {}
        self.jobs: dict[str, m.RolloutWork] = {}
        self.finished: dict[str, int] = {}  # request -> epoch that finished it
        self.log: list[tuple[float, str, str]] = []  # (monotonic time, event, detail)
        self.replies: dict[int, m.Message] = {}
        self._nonce = 0

    # --- members -----------------------------------------------------------------------------------
    def spawn(self, name: str, peer: dict | None = None, device: str = "cpu") -> None:
        """Start a member process on `device` (model from the store file, or from `peer`)."""
        spec = {**self.spec, "peer": peer, "device": device}
        path = self.workdir / f"{name}.spec.json"
        path.write_text(json.dumps(spec, default=_hex_bytes))  # CUDA IPC handles are bytes
        cmd = [sys.executable, "-m", "spotlight.actors.node.member", "--id", name,
               "--agent", self.address, "--spec", str(path)]
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        fd = os.pidfd_open(proc.pid)
        self.pidfds[fd] = name
        self.poller.register(fd, zmq.POLLIN)
        self._note("spawn", name)

    def add(self, name: str, *, timeout_s: float = 240.0, peer: dict | None = None,
            device: str = "cpu") -> m.MemberHello:
        """Spawn a member and wait until it is loaded and in the pool."""
        self.spawn(name, peer, device)
        self.run_until(lambda: name in self.hello, timeout_s)
        return self.hello[name]

    def add_many(self, names: list[str], *, timeout_s: float = 240.0) -> list[m.MemberHello]:
        """Spawn members side by side (their imports overlap) and wait until all are in the pool."""
        for name in names:
            self.spawn(name)
        self.run_until(lambda: all(n in self.hello for n in names), timeout_s)
        return [self.hello[n] for n in names]

    def kill(self, name: str) -> None:
        self._note("kill", name)
        self.procs[name].send_signal(signal.SIGKILL)

    def procs_alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    def stop_process(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    # --- requests ----------------------------------------------------------------------------------
    def submit(self, request_id: str, job: m.RolloutWork) -> None:
        self.jobs[request_id] = job
        self._do(self.sched.submit(request_id))

    def committed_step(self, request_id: str) -> int:
        return self.sched.requests[request_id].committed_step

    def status(self, name: str, timeout_s: float = 2.0) -> m.MemberProgress:
        """Ask a member what it is doing; it answers even when its compute is stuck."""
        self._nonce += 1
        nonce = self._nonce
        self._send(name, m.MemberStatus(nonce=nonce))
        self.run_until(lambda: nonce in self.replies, timeout_s)
        return self.replies.pop(nonce)

    def lend_weights(self, name: str, timeout_s: float = 10.0) -> dict:
        """Ask `name` to put its weights in shared memory: the `peer` argument of `add`."""
        self._nonce += 1
        nonce = self._nonce
        self._send(name, m.ShareWeights(nonce=nonce))
        self.run_until(lambda: nonce in self.replies, timeout_s)
        r = self.replies.pop(nonce)
        return {"segment": r.segment, "layout": r.layout, "nbytes": r.nbytes}

    # --- the loop -----------------------------------------------------------------------------------
    def run_until(self, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ActorTimeout(f"group agent: not reached in {timeout_s} s; {self.sched.status()}")
            for item, _ in self.poller.poll(min(left, 0.5) * 1000):
                if item is self.sock:
                    self._receive()
                else:
                    self._reap(item)
            self._do(self.sched.tick())

    def _receive(self) -> None:
        ident, *frames = self.sock.recv_multipart(copy=False)
        msg = decode(frames)
        name = getattr(msg, "member", None)
        if name is not None:
            self.idents[name] = bytes(ident.buffer)
        if isinstance(msg, m.MemberHello):
            self.hello[name] = msg
            self._note("hello", f"{name} load_s={msg.load_s:.3f} from={msg.weights_from}")
            self._do(self.sched.join(name))
        elif isinstance(msg, m.GroupCommitted):
            self._note("committed", f"{name} epoch={msg.epoch} step={msg.step}")
            self._do(self.sched.committed(name, msg.epoch, msg.step))
        elif isinstance(msg, m.GroupDone):
            self._note("done", f"{name} epoch={msg.epoch}")
            self._do(self.sched.done(name, msg.epoch))
        elif isinstance(msg, m.GroupReleased):
            self._note("released", f"{name} epoch={msg.epoch} {msg.error[:120]}")
            self._do(self.sched.released(name, msg.epoch))
        elif isinstance(msg, (m.MemberProgress, m.WeightsShared)):
            self.replies[msg.nonce] = msg

    def _reap(self, fd: int) -> None:
        name = self.pidfds.pop(fd)
        self.poller.unregister(fd)
        os.close(fd)
        code = self.procs[name].wait()
        sweep_dead()  # weights it was lending to a peer, if any
        self._note("died", f"{name} code={code}")
        self._do(self.sched.died(name, f"exit code {code}"))

    def _do(self, cmds: list) -> None:
        for c in cmds:
            if isinstance(c, Form):
                self._note("form", f"epoch={c.epoch} members={','.join(c.members)} resume={c.resume_step}")
                for rank, name in enumerate(c.members):
                    self._send(name, m.GroupForm(epoch=c.epoch, rank=rank, size=len(c.members),
                                                 request_id=c.request_id, job=self.jobs[c.request_id],
                                                 resume_step=c.resume_step))
            elif isinstance(c, Leave):
                self._send(c.member, m.GroupLeave(epoch=c.epoch))
            elif isinstance(c, Kill):
                self._note("kill", f"{c.member}: {c.reason}")
                if c.member in self.procs and self.procs[c.member].poll() is None:
                    self.procs[c.member].send_signal(signal.SIGKILL)
            elif isinstance(c, Finished):
                self._note("finished", f"{c.request_id} epoch={c.epoch}")
                self.finished[c.request_id] = c.epoch

    def _send(self, name: str, msg: m.Message) -> None:
        if name in self.idents and self.procs[name].poll() is None:
            self.sock.send_multipart([self.idents[name], *encode(msg)], copy=False)

    def _note(self, event: str, detail: str) -> None:
        self.log.append((time.monotonic(), event, detail))

    def first(self, event: str, contains: str = "", after: float = 0.0) -> float | None:
        """Time of the first logged `event` whose detail contains `contains`, after `after`."""
        return next((t for t, e, d in self.log if e == event and contains in d and t >= after), None)

    def commit_file(self, request_id: str, step: int) -> Path:
        from spotlight.actors.node.member import commit_path

        return commit_path(self.spec["commit_dir"], request_id, step)

    # --- shutdown -----------------------------------------------------------------------------------
    def close(self, grace_s: float = 5.0) -> None:
        for name in list(self.procs):
            self._send(name, m.MemberStop())
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> GroupAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _hex_bytes(value):
    """JSON for the bytes in a member's spec (a GPU peer's CUDA IPC handles); read back by
    `cuda_ipc_import`, which takes hex strings too."""
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"a member spec cannot hold {type(value).__name__}")
