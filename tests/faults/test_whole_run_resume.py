"""Whole-run resume: the reserved side (``spotlight reserved``, TCP) SIGKILLed mid-run, then started
again with ``--resume`` behind the same address. The run continues from its last checkpoint,
losing at most one iteration; a spot agent that was serving it waits (bounded by
``runtime.queue_lost_s``), registers with the restarted run (a new run epoch) and serves it,
instead of exiting. Request ids carry the epoch, so nothing from before the crash is counted.

    .venv/bin/python -m pytest -q tests/faults/test_whole_run_resume.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from polling import wait_for
from tiny_recipe import TINY_MODEL

from spotlight.actors.procs import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ITERATIONS = 8
KILL_AFTER = 3  # iterations written before the reserved side is killed
QUEUE_LOST_S = 20.0  # the spot node's patience: a restart on this machine takes ~10-15 s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iterations(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["iteration"] for r in records if r["event"] == "iteration"]


def test_reserved_side_killed_and_resumed_spot_node_rejoins(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    overrides = [*TINY_MODEL, "sampler.steps=4", "sampler.eval_steps=2", "run.group_size=4",
                 "explore.schedule=off", f"run.iterations={ITERATIONS}", "run.prompts_per_iteration=2",
                 "run.eval_every=1000", "run.eval_seeds=1", "run.eval_samples=1", "run.checkpoint_every=1",
                 f'run.out_dir="{tmp_path}"', 'run.name="resume"', "runtime.reserved_workers=1",
                 "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
                 "runtime.rpc_timeout_s=2", f"runtime.queue_lost_s={QUEUE_LOST_S}",
                 "runtime.step_delay_s=0.05"]
    reserved = [sys.executable, "-m", "spotlight.cli", "reserved", "tiny", *overrides, "--host", "127.0.0.1",
                "--port", str(port), "--no-progress"]
    metrics = tmp_path / "resume" / "metrics.jsonl"
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("first", "second", "agent")}
    first = subprocess.Popen(reserved, stdout=logs["first"], stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    agent = second = None
    try:
        agent = subprocess.Popen([sys.executable, "-m", "spotlight.actors.node", "--controller",
                                  f"tcp://127.0.0.1:{port}", "--workers", "1", "--node-id", "spot-a",
                                  "--log-level", "INFO"],
                                 stdout=logs["agent"], stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
        wait_for(lambda: len(iterations(metrics)) >= KILL_AFTER, 180, f"{KILL_AFTER} iterations", every=0.1)
        reserved_tree = [first.pid, *descendants(first.pid)]
        os.kill(first.pid, signal.SIGKILL)  # the reserved side dies: trainer, queue, store, its agent
        first.wait(10)
        wait_for(lambda: not any(alive(p) for p in reserved_tree), 20, "the reserved side's processes gone",
                 every=0.1)
        done_before = len(iterations(metrics))  # what the dead run had finished
        ckpts = sorted((tmp_path / "resume" / "checkpoints").glob("iter_*[0-9].safetensors"))
        resume_from = int(ckpts[-1].stem.removeprefix("iter_"))
        assert done_before - resume_from <= 1  # at most one iteration is redone
        assert agent.poll() is None  # the spot node waits for it
        second = subprocess.Popen([*reserved, "--resume"], stdout=logs["second"], stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
        assert second.wait(240) == 0, (tmp_path / "second.log").read_text()[-3000:]
        its = iterations(metrics)
        assert its == list(range(ITERATIONS))  # every iteration once: the resumed run rewrote the rest
        agent_log = (tmp_path / "agent.log").read_text()
        assert "joins the restarted run" in agent_log, agent_log[-3000:]
        assert agent.poll() is None, agent_log[-3000:]  # it rejoined instead of exiting
        assert "Traceback" not in agent_log
    finally:
        for proc in (second, first, agent):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for f in logs.values():
            f.close()
