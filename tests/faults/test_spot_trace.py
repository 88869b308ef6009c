"""The shared AWS spot trace replayed end to end under a real run (time-scaled to under a minute):
spot agents start and are taken away as the trace says (notices by SIGTERM, a fifth as SIGKILLs),
the run completes, and every iteration's metrics record carries spot nodes alive, preemptions so
far, requests resumed, steps lost, GPU-seconds and cost, with preemptions counted. Skipped when
the shared trace is not beside the repository (../shared/traces/).

    .venv/bin/python -m pytest -q tests/faults/test_spot_trace.py
"""

from __future__ import annotations

import pytest
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe
from spotlight.spot.traces import shared_trace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AWS = shared_trace()
TRACE_START_S = 21529  # the trace is empty before (no instance granted yet)
TRACE_HOUR_S = 2.4  # 18.5 trace hours -> 44 run seconds
SPOT_FIELDS = ("spot_nodes", "preemptions", "requests_resumed", "steps_lost", "gpu_s_reserved", "gpu_s_spot",
               "cost_usd")


@pytest.mark.skipif(AWS is None, reason="the shared AWS trace is not beside the repository")
def test_aws_trace_replayed_end_to_end(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = load_recipe("tiny", [
        *TINY_MODEL, "sampler.steps=6", "sampler.eval_steps=2", "run.group_size=4", "explore.schedule=off",
        "run.iterations=1000", "run.minutes=0.8", "run.prompts_per_iteration=2", "run.eval_every=1000",
        "run.eval_seeds=1", "run.eval_samples=2", "run.checkpoint_every=1000", 'run.mode="runtime"',
        f'run.out_dir="{tmp_path}"', "runtime.reserved_workers=1", "runtime.lease_s=2",
        "runtime.heartbeat_s=0.5", "runtime.node_lost_s=3",
        f'spot.trace="{AWS}"', f"spot.start_s={TRACE_START_S}", f"spot.trace_hour_s={TRACE_HOUR_S}",
        'spot.nodes="proportional"', "spot.factor=0.2", "spot.hard_kill_fraction=0.2", "spot.seed=1",
    ])
    exp = Experiment(recipe)
    with caplog.at_level("WARNING", logger="spotlight.actors.runtime"):
        summary = exp.run(progress=False)
    # The replay's two rules were stated at start.
    stated = [r.message for r in caplog.records if "1 trace hour = 2.4 run s" in r.message]
    assert stated and "proportional" in stated[0]
    iters = [r for r in exp.records if r["event"] == "iteration"]
    assert iters and summary["iterations"] == len(iters)
    for rec in iters:
        assert all(k in rec for k in SPOT_FIELDS), rec
    assert [r["preemptions"] for r in iters] == sorted(r["preemptions"] for r in iters)  # "so far"
    assert [r["cost_usd"] for r in iters] == sorted(r["cost_usd"] for r in iters)
    last = iters[-1]
    assert last["preemptions"] >= 3, last  # the trace takes nodes away under the run
    assert last["gpu_s_spot"] > 0 and last["gpu_s_reserved"] > 0
    assert max(r["spot_nodes"] for r in iters) >= 1
    assert last["wall_s"] >= 0.8 * 44  # the run outlasted (most of) the replay
    log = exp.runtime.injector.log
    assert sum(a["action"] == "add" for a in log) >= 5
    assert any(a["action"] in ("notice", "hard_kill") for a in log)
