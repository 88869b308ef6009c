"""The short version of bench/sim_fidelity.py: one recipe, trace and seed in run.mode = "runtime"
(real processes) and run.mode = "sim". Each request is 10 steps of ``runtime.step_delay_s`` (a
modelled slower device, which the sim prices as the runtime sleeps it) on a model that computes in
milliseconds, so where every request is when a removal lands does not depend on this machine's
load: three workers (the reserved one and two spot nodes) start one request each; the trace takes
a spot node at 3 s and the other at 5 s, both with a notice, mid-request. Both modes must play the
same injector actions on the same node incarnations at the same run seconds, resume the same two
requests from their commits on the reserved worker, and lose no step. Seconds per iteration are
not compared here (they depend on the machine's load; the bench prints them)."""

from __future__ import annotations

import pytest
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _recipe(mode: str, tmp_path, trace):
    return load_recipe("tiny", [
        *TINY_MODEL, "sampler.steps=10", "runtime.step_delay_s=0.6",
        f'run.mode="{mode}"', "run.iterations=2", "run.minutes=none", "run.eval_every=100000",
        "run.eval_seeds=1", "run.eval_samples=1", "run.group_size=4",
        "run.checkpoint_every=100000", "run.prompts_per_iteration=3", 'explore.schedule="off"',
        f'run.out_dir="{tmp_path}"', f'run.name="{mode}"', "runtime.reserved_workers=1",
        "runtime.lease_s=2", "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f'spot.trace="{trace}"', "spot.trace_hour_s=3600.0", "spot.max_nodes=2",
        "spot.hard_kill_fraction=0", "spot.seed=0", "spot.notice_s=2.0", "spot.workers_per_node=1"])


def test_sim_and_runtime_play_the_same_preemptions_and_resumes(tmp_path):
    trace = tmp_path / "trace.csv"  # seconds,count: 2 nodes, one taken at 3 s, the other at 5 s
    trace.write_text("0,2\n3,1\n5,0\n")
    runs = {}
    for mode in ("runtime", "sim"):
        runs[mode] = Experiment(_recipe(mode, tmp_path, trace))
        runs[mode].run(progress=False)
    acted, last = {}, {}
    for mode, exp in runs.items():
        injector = exp.runtime.injector if mode == "runtime" else exp.loop.injector
        acted[mode] = [(x["action"], x["node"], x["t"]) for x in injector.log
                       if x["action"] in ("add", "notice", "hard_kill")]
        last[mode] = [r for r in exp.records if r["event"] == "iteration"][-1]
    assert [a[:2] for a in acted["runtime"]] == [a[:2] for a in acted["sim"]]
    assert [a[0] for a in acted["sim"]] == ["add", "add", "notice", "notice"]
    for (_, _, t_real), (_, _, t_sim) in zip(acted["runtime"], acted["sim"]):
        assert abs(t_real - t_sim) < 0.5
    for mode in runs:
        assert last[mode]["preemptions"] == 2, mode
        assert last[mode]["requests_resumed"] == 2, mode  # both notices caught a request mid-way
        assert last[mode]["requests_rerun"] == 0, mode
        assert last[mode]["steps_lost"] == 0, mode
