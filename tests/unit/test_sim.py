"""run.mode = "sim": the real control-plane cores on a virtual clock (spotlight.sim).

The trace test is the chaos suite's invariants at cluster scale: a 64-GPU replay of the real AWS
trace, notices and SIGKILLs, every rollout request completed exactly once, nothing dead or lost,
resumed requests resuming from their commit.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from bench import qwen_calibration
from spotlight.errors import ConfigError
from spotlight.recipe import load_recipe
from spotlight.sim.clock import VirtualClock
from spotlight.sim.run import SimRun
from spotlight.sim.timing import TimingModel
from spotlight.spot.traces import shared_trace

TRACE = shared_trace()  # ../shared/traces beside the checkout (or a worktree's)


def _recipe(tmp_path, *extra: str):
    return load_recipe("tiny", [
        'run.mode="sim"', f'run.out_dir="{tmp_path}"', 'run.name="sim"', "run.iterations=1000",
        f'spot.trace="{TRACE}"', "spot.start_s=21529.0", "spot.trace_hour_s=3600.0", "spot.max_nodes=8",
        "spot.workers_per_node=8", "spot.hard_kill_fraction=0.3", "spot.seed=1",
        'sim.profile="qwen-image-20b"', 'sim.gpu="h200"', "sim.resolution=1280", "sim.trainer_gpus=32",
        "sim.samples_per_request=1", "sim.hours=4.0", "run.group_size=16", "run.prompts_per_iteration=32",
        "sampler.steps=20", "runtime.reserved_workers=0", 'explore.schedule="overlap"',
        "explore.planner=true",
        "explore.chunk=4", 'explore.arms=["32@taylor:3", "64", "128"]', *extra])


def _run(recipe):
    sim = SimRun(recipe)
    done: Counter[str] = Counter()
    inner = sim.cluster.on_complete

    def count(lease, result):
        done[lease.request_id] += 1
        inner(lease, result)

    sim.cluster.on_complete = count
    t = time.perf_counter()
    summary = sim.run()
    return sim, summary, done, time.perf_counter() - t


@pytest.mark.skipif(TRACE is None, reason="the AWS trace is not here")
def test_real_trace_at_64_gpus_conserves_work(tmp_path):
    sim, summary, done, _ = _run(_recipe(tmp_path))  # its wall time is the scale bench's figure
    its = sim.records
    assert len(its) >= 8 and summary["sim_s"] >= 4 * 3600
    q = summary["queue"]
    # every rollout request completed exactly once; nothing dead; exploration only ever cancelled
    rollouts = [rid for rid in done if "/rollout/" in rid]
    assert len(rollouts) == sum(r["rollout_samples"] for r in its)
    assert max(done.values()) == 1 and q["duplicate_completions"] == 0
    assert q["dead"] == 0 and summary["dead_letters"] == []
    assert q["completed"] + q["cancelled"] == q["submitted"] - q["now_queued"] - q["now_leased"]
    # the trace's preemptions happened, some mid-request; those requests resumed from their commit
    assert summary["preemptions"] >= 10
    assert q["expired"] + q["released"] + q["node_lost_requeued"] > 0
    assert summary["requests_resumed"] > 0 and summary["steps_lost"] == 0
    # the store holds no commit or trajectory left over (sealed, then dropped by the trainer)
    assert sim.cluster.store.keys("commit/") == [] and sim.cluster.store.keys("traj/") == []
    # the outputs a runtime run writes, labelled sim
    lines = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(its) and all(x["mode"] == "sim" for x in lines)
    for key in ("spot_nodes", "preemptions", "steps_lost", "gpu_s_spot", "gpu_s_reserved", "cost_usd"):
        assert key in lines[-1]
    assert "reward_mean" not in lines[-1]
    assert (tmp_path / "sim" / "spot.png").stat().st_size > 10_000


@pytest.mark.skipif(TRACE is None, reason="the AWS trace is not here")
def test_without_commits_preempted_steps_are_lost(tmp_path):
    _, summary, done, _ = _run(_recipe(tmp_path, "runtime.step_commits=false", "sim.hours=2.0"))
    assert summary["steps_lost"] > 0 and summary["requests_resumed"] == 0
    assert max(done.values()) == 1 and summary["queue"]["dead"] == 0


def test_tiny_fixed_pool_runs_like_the_loop(tmp_path):
    r = load_recipe("tiny", ['run.mode="sim"', f'run.out_dir="{tmp_path}"', "run.iterations=3",
                             "runtime.spot_workers=2", "runtime.reserved_workers=1"])
    sim = SimRun(r)
    summary = sim.run()
    assert summary["iterations"] == 3 and summary["preemptions"] == 0
    rec = sim.records[0]
    t = TimingModel("tiny", "cpu")
    # 8 prompts' groups on 3 single workers: 3 rounds of one request each (plus each worker's
    # fetch of the weights from the store, queued on its link), then the update
    loads = 3 * t.store_fetch_s(t.profile.update_bytes)
    assert 3 * 10 * t.step_s(8) < rec["rollout_s"] <= 3 * 10 * t.step_s(8) + loads + 1e-9
    assert rec["train_s"] == pytest.approx(t.train_s(64, 5, 1), rel=1e-6)


def test_timing_model_figures():
    t = TimingModel("qwen-image-20b", "h100", 1280)
    assert t.tokens == 6400 + 128 and TimingModel("qwen-image-20b", "h100", 512).tokens == 1024 + 128
    s1 = t.step_s(1, 1)
    # SP splits the work; the all-to-alls cost a little and shorter shards fill the GPU less
    assert t.step_s(1, 4) < t.step_s(1, 2) < s1 and t.step_s(1, 4) < s1 / 2
    assert 1.8 * s1 < t.step_s(2, 1) < 2 * s1  # a larger batch fills the GPU a little better
    assert t.peer_copy_s(1e9) < t.store_fetch_s(1e9) < t.cold_load_s
    assert t.train_s(1, 1, 1) < t.train_s(1, 1, 1, reference=True) < 1.5 * t.train_s(1, 1, 1)


# Seconds measured on one H200 with the full-size transformer, random bf16 weights (bench/qwen_calibration.py,
# docs/BENCHMARKS.md "Full-size Qwen-Image on one H200"), the run the model is fitted to: forwards of a batch,
# and LoRA training steps of a forward of two samples; priced as the bench prices them.
H200 = json.loads((Path(__file__).parents[2] / "bench/data/qwen_calibration_h200.json").read_text())


@pytest.mark.parametrize("kind, row", [(k, r) for k in ("forward", "train") for r in H200[k]],
                         ids=lambda v: v if isinstance(v, str) else f"{v['resolution']}-b{v['batch']}")
def test_timing_model_prices_the_h200_measurement_within_10_percent(kind, row):
    _, sim_s = qwen_calibration.priced(kind, row)
    assert sim_s == pytest.approx(row["seconds"], rel=0.10)


@pytest.mark.parametrize("override, message", [
    ('sim.gpu="a100"', "sim.gpu must be one of h100, h200, cpu, got 'a100'"),
    ('sim.profile="flux"', "sim.profile must be one of qwen-image-20b, tiny, got 'flux'"),
    ('sim.gpu="h100"', "sim.gpu 'h100' cannot run profile 'tiny'"),
])
def test_bad_profile_or_gpu_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny", ['run.mode="sim"', override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_trace_smaller_than_one_sp_group_is_one_line(tmp_path):
    trace = tmp_path / "one.csv"
    trace.write_text("0,1\n100,0\n")
    r = load_recipe("tiny", ['run.mode="sim"', f'spot.trace="{trace}"', "runtime.sp_degree=2",
                             "runtime.reserved_workers=0",
                             "spot.workers_per_node=2", "sim.gpus_per_node=1"])
    with pytest.raises(ConfigError) as e:
        SimRun(r)
    assert "at most 1 spot GPUs" in str(e.value) and "runtime.sp_degree=2" in str(e.value)
    assert "\n" not in str(e.value)


def test_virtual_clock_orders_and_cancels():
    c, seen = VirtualClock(), []
    c.call_at(2.0, lambda: seen.append(("b", c())))
    t = c.call_at(1.0, lambda: seen.append(("x", c())))
    c.call_at(1.0, lambda: seen.append(("a", c())))
    t.cancel()
    c.run(end=1.5)
    assert seen == [("a", 1.0)] and c() == 1.5
    c.run()
    assert seen[-1] == ("b", 2.0)


def test_synthetic_bursts_cluster_removals():
    from spotlight.spot.synthetic import SyntheticConfig, synthetic_trace

    def close_share(trace):
        rem = [e.time_s for e in trace.events if e.action == "remove"]
        gaps = [b - a for a, b in zip(rem, rem[1:])]
        return sum(g <= 180 for g in gaps) / len(gaps)

    base = dict(seed=3, max_nodes=8, preemption_rate=0.3, arrival_rate=3.0, duration_s=6 * 3600)
    plain = synthetic_trace(SyntheticConfig(**base))
    bursty = synthetic_trace(SyntheticConfig(**base, burst_fraction=0.5))
    assert bursty == synthetic_trace(SyntheticConfig(**base, burst_fraction=0.5))  # seeded
    assert close_share(bursty) >= 0.5 > 0.2 >= close_share(plain)
    assert "bursts 0.5" in bursty.source
    with pytest.raises(ConfigError, match="burst_size must be >= 2, got 1"):
        SyntheticConfig(burst_fraction=0.5, burst_size=1)
