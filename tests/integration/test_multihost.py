"""Two hosts in two network namespaces (root + `ip netns`): a reserved host and a spot host joined
by a veth pair, talking over TCP with CURVE keys; nothing shared but the wire.

- A cluster run: `spotlight reserved` in one namespace, `spotlight agent` in the other under its
  own mount namespace with a private /dev/shm (so the store client cannot take the shared-memory
  shortcut). The run finishes with rewards for every iteration; the spot host ran rollouts, seen
  on the wire: its veth received at least one weights version (a worker fetches weights only to
  run a request) and sent at least one trajectory. SIGTERM makes the agent leave; nothing of
  either host is left.
- A spot agent with a node key the reserved host does not list is refused at the CURVE handshake
  and gives up with a clear error; the reserved host never registers it and runs on.

Key folders, one per host: reserved holds controller.key_secret, controller.key and nodes/*.key
(and serves as the client folder of its own agent); spot holds node.key_secret and controller.key.

    sudo .venv/bin/pytest tests/integration/test_multihost.py
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest

from spotlight.actors.procs import alive, descendants
from spotlight.comm.auth import keys_main, load_public_key

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(240)]

RESERVED_IP, SPOT_IP = "10.231.0.1", "10.231.0.2"
ITERATIONS, PROMPTS, GROUP, STEPS, IMAGE = 2, 8, 2, 4, 16
TINY = [
    "model.checkpoint=none",
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=16",
    f"model.image_size={IMAGE}",
    "model.patch=4",
    "model.text_dim=32",
    "model.text_layers=1",
    f"sampler.steps={STEPS}",
    "sampler.sde_steps=2",
    "sampler.eval_steps=4",
    "sampler.noise_patch=4",
    f"run.prompts_per_iteration={PROMPTS}",
    f"run.group_size={GROUP}",
    "explore.schedule=off",
    "run.eval_seeds=1",
    "run.eval_samples=1",
    "runtime.reserved_workers=0",
]  # the reserved host only trains: every rollout is the spot host's
START_S = 120.0  # a process's readiness line (2 cores: torch imports in several processes at once)
LEAVE_S = 5.0  # SIGTERM to exit, for a spot agent whose reserved host is already gone
_ids = count()


# --- two hosts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hosts:
    reserved: str
    """netns of the reserved host."""
    spot: str
    """netns of the spot host."""
    spot_link: str
    """the spot host's end of the veth pair."""

    def spot_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes on the spot host's veth."""
        stats = f"/sys/class/net/{self.spot_link}/statistics"
        out = _ip("netns", "exec", self.spot, "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes")
        rx, tx = out.split()
        return int(rx), int(tx)


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root for ip netns")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool!r}")
    tag = f"{os.getpid()}x{next(_ids)}"  # unique per test run: parallel or aborted runs do not collide
    h = Hosts(reserved=f"spl-res-{tag}", spot=f"spl-spot-{tag}", spot_link=f"spls{tag}")
    made: list[str] = []
    try:
        for ns in (h.reserved, h.spot):
            try:
                _ip("netns", "add", ns)
            except RuntimeError as e:
                pytest.skip(f"ip netns add failed: {e}")
            made.append(ns)
        res_link = f"splr{tag}"  # interface names: at most 15 characters
        try:
            _ip("link", "add", res_link, "type", "veth", "peer", "name", h.spot_link)
        except RuntimeError as e:
            pytest.skip(f"no veth pair: {e}")
        _ip("link", "set", res_link, "netns", h.reserved)
        _ip("link", "set", h.spot_link, "netns", h.spot)
        for ns, link, addr in ((h.reserved, res_link, RESERVED_IP), (h.spot, h.spot_link, SPOT_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield h
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=30)


# --- processes on them ------------------------------------------------------------------------------
class Proc:
    """A child whose stdout and stderr lines are read by two threads; ``wait_line`` awaits a line
    (an event, not a sleep). ``seen`` collects the pids of its tree, for the no-leftovers check."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._eof: set[str] = set()
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in self.lines]
        for t in self._readers:
            t.start()
        self.seen = {self.popen.pid}

    def _read(self, stream: str) -> None:
        pipe = getattr(self.popen, stream)
        for raw in iter(pipe.readline, b""):
            with self._cond:
                self.lines[stream].append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof.add(stream)
            self._cond.notify_all()

    def wait_line(self, stream: str, pattern: str, timeout: float) -> re.Match:
        """The first line of ``stream`` matching ``pattern``; fails on timeout or EOF."""
        rx, lines, hit, seen = re.compile(pattern), self.lines[stream], None, 0

        def found() -> bool:
            nonlocal hit, seen
            while hit is None and seen < len(lines):  # each line is looked at once
                hit, seen = rx.search(lines[seen]), seen + 1
            return hit is not None or stream in self._eof

        with self._cond:
            self._cond.wait_for(found, timeout)
        if hit is None:
            raise AssertionError(
                f"{self.name}: no {stream} line matching {pattern!r} within {timeout}s "
                f"(exit {self.popen.poll()})\n{self.tail()}"
            )
        return hit

    def wait(self, timeout: float) -> int:
        """The exit code, once the process and both of its streams have ended."""
        try:
            rc = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s\n{self.tail()}") from None
        for t in self._readers:
            t.join(10)
        return rc

    def text(self, stream: str) -> str:
        with self._cond:
            return "\n".join(self.lines[stream])

    def tail(self, n: int = 3000) -> str:
        return "".join(f"--- {self.name} {s}:\n{self.text(s)[-n:]}\n" for s in ("stdout", "stderr"))

    def snapshot(self) -> set[int]:
        self.seen.update(descendants(self.popen.pid))
        return set(self.seen)

    def left(self) -> list[int]:
        return sorted(p for p in self.seen if alive(p))


class Procs:
    """Every process a test starts; teardown stops them (SIGTERM, then SIGKILL) whatever happened."""

    def __init__(self) -> None:
        self.all: list[Proc] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(name, cmd, env)
        self.all.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.all:
            proc.snapshot()
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        for proc in self.all:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            for pid in proc.left():  # only pids this test started (checked: still a spotlight process)
                try:
                    if b"spotlight" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
                except (OSError, ProcessLookupError):
                    pass
            if proc.popen.poll() is None:
                proc.popen.kill()
            proc.popen.wait(10)
            for pipe in (proc.popen.stdout, proc.popen.stderr):
                pipe.close()


@pytest.fixture
def procs(hosts):  # after `hosts`: torn down before the namespaces go
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTLIGHT_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


SPOTLIGHT = [sys.executable, "-m", "spotlight.cli"]


def start_reserved(procs: Procs, hosts: Hosts, keys: Path, out: Path, *overrides: str) -> tuple[Proc, str]:
    """`spotlight reserved` on the reserved host; returns it and the controller endpoint it prints."""
    cmd = [
        "ip",
        "netns",
        "exec",
        hosts.reserved,
        *SPOTLIGHT,
        "-v",
        "reserved",
        "tiny",
        *TINY,
        f'run.out_dir="{out}"',
        'run.name="multihost"',
        *overrides,
        "--host",
        RESERVED_IP,
        "--port",
        "0",
        "--keys",
        str(keys),
        "--no-progress",
    ]
    proc = procs.start("reserved", cmd, _env())
    endpoint = proc.wait_line("stdout", r"^controller listening on (tcp://\S+)", START_S).group(1)
    assert endpoint.startswith(f"tcp://{RESERVED_IP}:")
    proc.snapshot()
    return proc, endpoint


def start_spot(procs: Procs, hosts: Hosts, endpoint: str, keys: Path, node_id: str, *extra: str) -> Proc:
    """`spotlight agent` on the spot host, in its own mount namespace with a private /dev/shm;
    ``extra``: more agent options."""
    shell = 'mount -t tmpfs -o size=64m,mode=1777 spl-private-shm /dev/shm && exec "$@"'
    cmd = [
        "ip",
        "netns",
        "exec",
        hosts.spot,
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        shell,
        "spot-host",
        *SPOTLIGHT,
        "agent",
        "--controller",
        endpoint,
        "--workers",
        "1",
        "--keys",
        str(keys),
        "--node-id",
        node_id,
        "--log-level",
        "INFO",
        *extra,
    ]
    return procs.start(node_id, cmd, _env())


def make_keys(tmp: Path) -> tuple[Path, Path, Path]:
    """(reserved, spot, intruder) key folders; the intruder's node key is not in reserved/nodes."""
    reserved, spot, intruder = tmp / "keys-reserved", tmp / "keys-spot", tmp / "keys-intruder"
    keys_main(str(reserved), "controller")
    keys_main(str(spot), "node")
    keys_main(str(intruder), "node")
    (reserved / "nodes").mkdir()
    shutil.copy(spot / "node.key", reserved / "nodes" / "spot.key")
    for folder in (spot, intruder):
        shutil.copy(reserved / "controller.key", folder / "controller.key")
    return reserved, spot, intruder


def published_weight_bytes(out: Path) -> int:
    """Bytes of one weights version: the model the trainer publishes is the one its checkpoint holds."""
    from safetensors.numpy import load_file

    return sum(
        a.nbytes for a in load_file(str(out / "checkpoints" / f"iter_{ITERATIONS:04d}.safetensors")).values()
    )


# --- the tests ----------------------------------------------------------------------------------------
def test_spot_host_does_rollouts_over_tcp(hosts, procs, tmp_path):
    res_keys, spot_keys, _ = make_keys(tmp_path)
    out = tmp_path / "runs"
    node = f"spot-{os.getpid()}"
    t0 = time.monotonic()
    reserved, endpoint = start_reserved(procs, hosts, res_keys, out, f"run.iterations={ITERATIONS}")
    rx0, tx0 = hosts.spot_bytes()
    t_up = time.monotonic() - t0
    spot = start_spot(procs, hosts, endpoint, spot_keys, node)
    spot.wait_line("stdout", rf"^agent ready {node} workers=1", START_S)
    t_ready = time.monotonic() - t0
    spot_tree = spot.snapshot()
    assert len(spot_tree) >= 2, f"the spot agent runs a worker process: {spot_tree}"
    reserved.snapshot()

    assert reserved.wait(180) == 0, reserved.tail()
    t_run = time.monotonic() - t0
    reserved_tree = reserved.snapshot()
    assert len(reserved_tree) >= 3, f"reserved: cli, queue, store: {reserved_tree}"
    assert re.search(rf"node {node} \(spot, 1 workers\) registered", reserved.text("stderr")), reserved.tail()

    # The run: the summary JSON it prints last, and a reward for every rollout of every iteration.
    stdout = reserved.text("stdout")
    summary = json.loads(stdout[stdout.index("\n{") + 1 :])
    run_dir = out / "multihost"
    assert summary["iterations"] == ITERATIONS and Path(summary["out"]) == run_dir, summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in records if r["event"] == "iteration"]
    assert [r["iteration"] for r in iters] == list(range(ITERATIONS)), records
    for r in iters:
        assert len(r["rewards"]) == PROMPTS and all(len(g) == GROUP for g in r["rewards"]), r
        assert all(math.isfinite(x) for g in r["rewards"] for x in g), r
    assert [r["iteration"] for r in records if r["event"] == "eval"] == [0, ITERATIONS]

    # The spot host did every rollout, over its wire: it fetched each iteration's weights version
    # and sent every trajectory's latents. Through shared memory neither would have crossed the veth.
    rx, tx = (b - b0 for b, b0 in zip(hosts.spot_bytes(), (rx0, tx0)))
    weights = published_weight_bytes(run_dir)
    trajectory = GROUP * (STEPS + 1) * 3 * IMAGE * IMAGE * 4  # one rollout's float32 latents (sent
    # to the store once: the first commit carries x_1 and x_t1, each later one appends a step)
    assert rx >= ITERATIONS * weights, (
        f"spot host received {rx} B, < {ITERATIONS} weights versions of {weights} B"
    )
    assert tx >= ITERATIONS * PROMPTS * trajectory, (
        f"spot host sent {tx} B, < {ITERATIONS * PROMPTS} trajectories of {trajectory} B"
    )

    # The reserved host is gone; SIGTERM makes the spot agent leave, and nothing is left.
    t1 = time.monotonic()
    spot.popen.send_signal(signal.SIGTERM)
    rc = spot.wait(LEAVE_S + 10)
    left_s = time.monotonic() - t1
    assert rc == 0, spot.tail()
    assert left_s < LEAVE_S, f"spot agent took {left_s:.1f}s to leave"
    assert spot.left() == [] and reserved.left() == [], (spot.left(), reserved.left())
    print(
        f"reserved up at {t_up:.1f}s, spot ready at {t_ready:.1f}s, run done at {t_run:.1f}s, "
        f"spot rx {rx} B tx {tx} B, left in {left_s:.1f}s"
    )


def test_spot_host_with_unknown_key_is_refused(hosts, procs, tmp_path):
    res_keys, _, intruder_keys = make_keys(tmp_path)
    node = f"intruder-{os.getpid()}"
    # Long enough a run that the reserved host is up for the whole attempt; stopped below.
    reserved, endpoint = start_reserved(procs, hosts, res_keys, tmp_path / "runs", "run.iterations=1000")
    # Asks again for queue_lost_s (8 s here, not the default 30) before giving up.
    intruder = start_spot(procs, hosts, endpoint, intruder_keys, node, "--queue-lost-s", "8")
    key = load_public_key(intruder_keys / "node.key").decode()
    reserved.wait_line("stderr", rf"CURVE: refused client key {re.escape(key)}", START_S)
    # The agent's Register gets no reply (asked again for queue_lost_s, the reserved side may be
    # starting; the refused handshake leaves later asks unsent): it gives up with one clear line.
    assert intruder.wait(START_S) == 2, intruder.tail()
    line = r"spotlight: error: Register to tcp://\S+: (no reply|not sent) within .*accept this node's key\?\)"
    assert re.search(line, intruder.text("stderr")), intruder.tail()
    assert "agent ready" not in intruder.text("stdout")
    assert intruder.left() == []
    assert reserved.popen.poll() is None, reserved.tail()  # the reserved host runs on, unharmed
    assert not re.search(rf"node {node} .*registered", reserved.text("stderr"))

    reserved.snapshot()
    reserved.popen.send_signal(signal.SIGTERM)  # stops like Ctrl-C: its runtime tears down in order
    assert reserved.wait(60) == 130, reserved.tail()
    assert reserved.left() == []
