"""A spot worker preempted mid-exploration loses only that exploration request: it is not retried
past the deadline, its prompt falls back to random seeds (counted), and the iteration goes on."""

from __future__ import annotations

import signal

import pytest
from polling import wait_for
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_spot_worker_killed_mid_exploration_costs_only_its_request(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    recipe = load_recipe("tiny", [
        # a slow device: each denoising step takes >= 1.5 s, so the kill below lands while the
        # spot worker holds an exploration lease
        "runtime.step_delay_s=1.5",
        *TINY_MODEL,
        "sampler.eval_steps=2",
        "run.group_size=4",
        "run.prompts_per_iteration=2",
        "run.iterations=3",
        "run.eval_every=100",
        "run.eval_seeds=1",
        "run.eval_samples=2",
        'run.mode="runtime"',
        "runtime.reserved_workers=1",
        "runtime.spot_workers=1",
        'runtime.explore_on="spot"',
        "explore.schedule=overlap",
        "explore.candidates=8",
        "explore.chunk=8",  # one exploration request per prompt
        "explore.wait_s=0.0",
        f'run.out_dir="{tmp_path}"',
    ])
    exp = Experiment(recipe)
    seen: dict = {}

    def on_record(rec: dict) -> None:
        if rec["event"] != "iteration":
            return
        if rec["iteration"] == 0:  # iteration 1's exploration is in flight on the spot worker
            stats = lambda: exp.runtime.call(exp.queue.stats()).stats  # noqa: E731
            seen["at_kill"] = wait_for(lambda: (s := stats())["now_leased"] >= 1 and s, 30,
                                       "the spot worker to lease an exploration request")
            assert exp.runtime.signal_node("spot", signal.SIGKILL)
        if rec["iteration"] == 2:
            seen["end"] = exp.runtime.call(exp.queue.stats()).stats

    exp.on_metrics(on_record)
    exp.run(progress=False)
    its = [r for r in exp.records if r["event"] == "iteration"]
    assert [r["iteration"] for r in its] == [0, 1, 2]  # nothing blocked the run
    assert seen["at_kill"]["now_leased"] == 1 and seen["at_kill"]["now_queued"] == 1
    for rec in its[1:]:  # the killed request and the queued one: nothing came back, both cancelled
        assert (rec["explore_requests"], rec["explore_returned"], rec["explore_cancelled"]) == (2, 0, 2)
        assert rec["explore_fallback_prompts"] == 2
    end = seen["end"]
    assert end["cancelled"] == 4 and end["now_queued"] == 0 and end["now_leased"] == 0
    # 6 rollouts + the one exploration the killed worker held: it never ran again anywhere, and no
    # exploration completed (none could, with no spot worker left)
    assert end["leased"] == 7 and end["completed"] == 6 and end["expired"] == 0
