"""A sharded trainer's rank SIGKILLed mid-run: the run fails at its next update with `ActorDead`
naming that rank (not a hang, not a bare gloo error), and no rank process is left behind."""

from __future__ import annotations

import os
import signal

import pytest

from spotlight.actors import procs
from spotlight.api import Experiment
from spotlight.errors import ActorDead
from spotlight.recipe import load_recipe


def _rank_pids() -> list[int]:
    found = []
    for pid in procs.descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spotlight.parallel.ranks" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_rank_fails_the_run_with_its_name(tiny_pipeline_dir, tmp_path):
    recipe = load_recipe("tiny_pipeline", [
        f"model.pipeline={tiny_pipeline_dir('qwen-image')}", f"model.text_cache={tmp_path / 'text'}",
        f"run.out_dir={tmp_path / 'runs'}", "run.iterations=3", "run.prompts_per_iteration=2",
        "run.eval_samples=1", "run.tensorboard=false", "sampler.steps=2", "sampler.eval_steps=2",
        "trainer.ranks=2", "trainer.timeout_s=60"])
    killed = []

    def kill_rank_after_first_iteration(record: dict) -> None:
        if record["event"] == "iteration" and not killed:
            (pid,) = _rank_pids()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    exp = Experiment(recipe)
    exp.on_metrics(kill_rank_after_first_iteration)
    with pytest.raises(ActorDead, match=r"trainer-rank-1 .*\(SIGKILL\)"):
        exp.run(progress=False)
    assert killed and [r["iteration"] for r in exp.records if r["event"] == "iteration"] == [0]
    assert not _rank_pids() and not procs.alive(killed[0])
