"""The short version of bench/sim_fidelity.py: one tiny recipe, trace and seed in run.mode =
"runtime" (real processes) and run.mode = "sim". The fault injector plays the same notices and
SIGKILLs on the same node incarnations at the same run seconds in both, and neither loses a step.
Seconds per iteration are not compared here (they depend on this machine's load; the bench
prints them)."""

from __future__ import annotations

import pytest

from spotlight import Experiment, load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _recipe(mode: str, tmp_path, trace):
    return load_recipe("tiny", [
        f'run.mode="{mode}"', "run.iterations=2", "run.minutes=none", "run.eval_every=100000",
        "run.eval_seeds=1", "run.eval_samples=1",
        "run.checkpoint_every=100000", "run.prompts_per_iteration=4", 'explore.schedule="off"',
        f'run.out_dir="{tmp_path}"', f'run.name="{mode}"', "runtime.reserved_workers=1",
        "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f'spot.trace="{trace}"', "spot.trace_hour_s=3600.0", "spot.max_nodes=2",
        "spot.hard_kill_fraction=0.5", "spot.seed=0", "spot.notice_s=0.5", "spot.workers_per_node=1"])


def test_sim_and_runtime_play_the_same_preemptions(tmp_path):
    trace = tmp_path / "trace.csv"  # seconds,count: 2 nodes, then one taken, back, taken again
    trace.write_text("0,2\n2,1\n4,2\n6,1\n8,0\n10,2\n")
    real = Experiment(_recipe("runtime", tmp_path, trace))
    real.run(progress=False)
    sim = Experiment(_recipe("sim", tmp_path, trace))
    sim.run(progress=False)
    end = min(10.5, *([r for r in e.records if r["event"] == "iteration"][-1]["spot_elapsed_s"]
                       for e in (real, sim)))
    acted = {}
    for name, injector in (("runtime", real.runtime.injector), ("sim", sim.loop.injector)):
        acted[name] = [(x["action"], x["node"], x["t"]) for x in injector.log
                       if x["action"] in ("add", "notice", "hard_kill") and x["t"] <= end - 0.5]
    assert [a[:2] for a in acted["runtime"]] == [a[:2] for a in acted["sim"]]
    assert len([a for a in acted["sim"] if a[0] != "add"]) >= 2  # the removals at 2 s and 6 s
    for (_, _, t_real), (_, _, t_sim) in zip(acted["runtime"], acted["sim"]):
        assert abs(t_real - t_sim) < 0.5
    for exp in (real, sim):
        last = [r for r in exp.records if r["event"] == "iteration"][-1]
        assert last["steps_lost"] == 0
