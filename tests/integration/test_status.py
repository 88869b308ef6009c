"""``spotlight status`` against a real reserved side (queue, store, controller and a reserved
agent with one worker, on TCP with CURVE): nodes, workers, SP groups, queue, leases, the trainer's
iteration and phase, cost; ``--watch`` refreshes; a wrong key or nothing listening is one line
within the timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from tiny_recipe import TINY_MODEL

from spotlight.actors.config import ServeConfig
from spotlight.actors.runtime import LocalRuntime
from spotlight.cli import main
from spotlight.comm import messages as m
from spotlight.recipe import load_recipe
from spotlight.work import policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]



def _one_line_error(capsys, argv: list[str], within: float) -> str:
    t0 = time.monotonic()
    assert main(argv) == 2
    elapsed = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("spotlight: error: "), err
    assert elapsed < within, elapsed
    return err


def test_status_of_a_running_reserved_side(keys, tmp_path, capsys):
    recipe = load_recipe("tiny", [*TINY_MODEL, "run.group_size=4", f'run.out_dir="{tmp_path}"',
                                  'run.name="st"', 'runtime.transport="tcp"', "runtime.reserved_workers=1",
                                  "runtime.spot_workers=0"])
    serve = ServeConfig(host="127.0.0.1", port=0, keys=str(keys["reserved"]))
    with LocalRuntime(recipe, serve=serve) as rt:
        executor = rt.executor(policy_model(recipe), recipe, 0)
        job = m.RolloutWork(prompt="a red circle", seeds=[1, 2, 3, 4], version=0)
        (group,) = executor.rollout("it0/rollout", [job]).result(timeout=120)
        assert group.rewards.shape == (4,)
        ep = rt.endpoint

        assert main(["status", "--controller", ep, "--keys", str(keys["good"]), "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["run"] == "st" and s["sp_degree"] == 1 and s["left"] == 0
        assert [(n["node_id"], n["kind"], n["workers"], n["sp_groups"]) for n in s["nodes"]] == [
            ("local-reserved", "reserved", 1, 1)]
        assert s["queue"]["completed"] == s["queue"]["submitted"] == 1 and s["queue"]["now_leased"] == 0
        assert s["progress"]["phase"] == "train" and s["progress"]["iteration"] == 0
        assert s["progress"]["version"] == 0
        assert s["cost"]["gpu_s_reserved"] > 0 and "cost_usd" in s["cost"]

        assert main(["status", "--controller", ep, "--keys", str(keys["reserved"])]) == 0
        text = capsys.readouterr().out
        assert "iteration 0, train" in text and "local-reserved" in text
        assert "1 of 1 requests completed" in text

        err = _one_line_error(capsys, ["status", "--controller", ep, "--keys", str(keys["bad"]),
                                       "--timeout", "1"], within=3.0)
        assert "no answer" in err and "does not accept the keys" in err
        err = _one_line_error(capsys, ["status", "--controller", ep, "--timeout", "1"], within=3.0)
        assert "wants CURVE keys" in err

        watch = subprocess.Popen(
            [sys.executable, "-m", "spotlight.cli", "status", "--controller", ep, "--keys", str(keys["good"]),
             "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            assert watch.stdout is not None
            headers = 0
            for line in watch.stdout:  # bounded by the test's timeout
                headers += line.startswith("run st at ")
                if headers == 2:
                    break
            assert headers == 2
        finally:
            watch.send_signal(signal.SIGINT)
            try:  # drains both pipes while it waits: a full pipe cannot hold the process up
                _, err = watch.communicate(timeout=30)
            finally:
                if watch.poll() is None:  # still polling after Ctrl-C: fail, and leave no process behind
                    watch.kill()
                    watch.communicate()
        assert watch.returncode == 130 and "interrupted" in err

    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    err = _one_line_error(capsys, ["status", "--controller", f"tcp://127.0.0.1:{port}", "--timeout", "1"],
                          within=3.0)
    assert "nothing listening" in err
