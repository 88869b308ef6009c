"""Supervised actors: a LocalRuntime run whose queue or tensor store is SIGKILLed mid-run stops
within seconds with one line naming the actor and its exit status (not after a timeout), and a
child that writes a lot of output neither blocks nor loses it (its log grows past a pipe's 64 KiB
while it still answers). A child whose parent died before it asked to die with it (a worker still
importing when its node is SIGKILLed) kills itself instead of living on as an orphan."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from spotlight import Experiment, load_recipe
from spotlight.actors import procs
from spotlight.actors.queue.client import QueueClient
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorDead

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TINY = ["model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16",
        "model.image_size=16", "model.patch=4", "sampler.steps=3", "sampler.sde_steps=2",
        "sampler.eval_steps=2",
        "run.group_size=4", "explore.schedule=off", "run.iterations=1000", "run.prompts_per_iteration=2",
        "run.eval_every=1000", "run.eval_seeds=1", "run.eval_samples=2", "run.checkpoint_every=1000",
        'run.mode="runtime"', "runtime.reserved_workers=1", "runtime.spot_workers=0"]
STOP_WITHIN_S = 10.0  # the bound: from the kill to the run's exception, teardown included


@pytest.mark.parametrize("victim", ["queue", "store"])
def test_a_killed_service_stops_the_run_with_one_line(tmp_path, monkeypatch, victim):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    exp = Experiment(load_recipe("tiny", [*TINY, f'run.out_dir="{tmp_path}"', f'run.name="{victim}"']))
    killed: dict[str, float] = {}

    def kill_after_first_iteration(record: dict) -> None:  # runs on the driver's thread, mid-run
        if record["event"] == "iteration" and not killed:
            killed["pid"] = exp.runtime.services[victim].pid
            os.kill(killed["pid"], signal.SIGKILL)
            killed["at"] = time.monotonic()

    exp.on_metrics(kill_after_first_iteration)
    with pytest.raises(ActorDead) as err:
        exp.run(progress=False)
    elapsed = time.monotonic() - killed["at"]
    message = str(err.value)
    assert elapsed < STOP_WITHIN_S, (elapsed, message)
    assert message.startswith(f"{victim} (pid {killed['pid']}) exited with status -9 (SIGKILL)"), message
    assert "\n" not in message and "last log lines" in message  # one line, with the actor's last words
    assert (tmp_path / victim / "logs" / f"{victim}.log").is_file()
    assert sum(r["event"] == "iteration" for r in exp.records) >= 1  # it died mid-run, not at start
    assert [p for p in exp.runtime.pids() if procs.alive(p)] == []  # and nothing outlived the run


# A real actor (the request queue) that chatters: 300 KiB on stdout before its readiness line
# (the parent drains it while it waits) and more from a thread after it (stdout is the log then).
CHATTY_QUEUE = r"""
import sys, threading
from spotlight.actors.queue.service import main
for i in range(300):
    print(f"before {i:04d} " + "x" * 1000, flush=True)
def chatter():  # whole lines per write, as a logger does
    for i in range(300):
        sys.stdout.write(f"after {i:04d} " + "y" * 1000 + "\n")
        sys.stdout.flush()
    sys.stdout.write("chatter done\n")
    sys.stdout.flush()
threading.Thread(target=chatter, daemon=True).start()
main(["--bind", sys.argv[1]])
"""


async def test_a_chatty_child_neither_blocks_nor_loses_output(tmp_path):
    log = tmp_path / "queue.log"
    child = procs.spawn("queue", [sys.executable, "-c", CHATTY_QUEUE, f"ipc://{tmp_path}/q.sock"],
                        log_path=log, ready_prefix="ready ")
    try:
        endpoint = (await asyncio.to_thread(child.wait_ready, 60)).split()[-1]
        async with RpcClient(endpoint, timeout=10) as rpc:
            queue = QueueClient.remote(rpc)
            await queue.stats()  # it answers while (and after) it chatters
            async with asyncio.timeout(30):  # bounded wait for the chatter thread's last line
                while b"chatter done" not in log.read_bytes():
                    await asyncio.sleep(0.05)
            await queue.stats()
        text = log.read_text()
        assert log.stat().st_size > 2 * 64 * 1024  # well past a pipe's buffer
        assert "before 0299" in text and "after 0299" in text  # nothing lost on either path
        assert not child.exited.done()
    finally:
        await asyncio.to_thread(procs.stop, [child], 10.0)
    assert child.exited.result() == 0  # SIGTERM: a clean exit


# A supervisor that adopts orphans (PR_SET_CHILD_SUBREAPER) starts a parent that starts a child.
# "gone": the parent exits at once and the child calls die_with_parent only after that (a worker
# still importing torch when its node is SIGKILLed); "right": the parent waits for the child. The
# child prints "alive" if it gets past die_with_parent.
ORPHAN = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL("libc.so.6").prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: an orphan is reparented to us
mode = sys.argv[1]
child = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.close(w); os.read(r, 1); "
         "from spotlight.actors.procs import die_with_parent; die_with_parent(); print('alive', flush=True)")
parent = ("import os, subprocess, sys; r, w, o = (int(a) for a in sys.argv[1:4]); "
          "env = dict(os.environ, SPOTLIGHT_PARENT_PID=str(os.getpid())); "
          "p = subprocess.Popen([sys.executable, '-c', sys.argv[5], str(r), str(w)], pass_fds=(r, w), "
          "env=env, stdout=o, stderr=o); print(p.pid, flush=True); "
          "sys.exit(0 if sys.argv[4] == 'gone' else p.wait())")
r, w = os.pipe()
out = os.dup(1)  # the child's output: ours, not the pipe we read the parent's from
proc = subprocess.Popen([sys.executable, "-c", parent, str(r), str(w), str(out), mode, child],
                        pass_fds=(r, w, out), stdout=subprocess.PIPE, text=True)
grandchild = int(proc.stdout.readline())
if mode == "gone":
    proc.wait()  # the parent is dead before the child goes on
os.close(r); os.write(w, b"x"); os.close(w)
if mode == "gone":
    _, status = os.waitpid(grandchild, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print("killed" if killed else "exited", flush=True)
else:
    print("parent", proc.wait(), flush=True)
"""


@pytest.mark.parametrize("parent", ["gone", "right"])
def test_a_child_whose_parent_died_before_it_asked_does_not_live_on(parent):
    import subprocess

    out = subprocess.run([sys.executable, "-c", ORPHAN, parent], capture_output=True, text=True,
                         timeout=60, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if parent == "gone":
        assert out.stdout.split() == ["killed"], out
    else:
        assert out.stdout.split() == ["alive", "parent", "0"], out
