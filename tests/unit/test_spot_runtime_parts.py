"""The plain parts of spot capacity in the runtime, in one process: the ``[spot]`` recipe section
and its errors, node liveness in the controller on a fake clock (a silent node is declared lost
within the bound; a beat from it afterwards is refused so it registers again), the step log's
resumed / re-run / lost counts, and the accounting fed by controller events.

    .venv/bin/python -m pytest -q tests/unit/test_spot_runtime_parts.py
"""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from spotlight.actors.controller.core import ControllerCore
from spotlight.comm import messages as m
from spotlight.errors import ConfigError, NotFound, TraceError
from spotlight.recipe import load_recipe
from spotlight.spot.accounting import SpotAccount, StepLog
from spotlight.spot.config import SpotConfig, spot_replay
from spotlight.spot.cost import CostConfig


# --- [spot] ---------------------------------------------------------------------------------------
def test_spot_section_round_trips_and_defaults():
    r = load_recipe("tiny", ['spot.trace="synthetic"', "spot.synthetic.seed=3",
                             "spot.hard_kill_fraction=0.25"])
    assert r.spot.synthetic.seed == 3 and r.spot.hard_kill_fraction == 0.25
    assert load_recipe(r.to_dict()).spot == r.spot  # what a worker rebuilds from the registration
    cfg = SpotConfig()
    assert cfg.cost_config().spot_price() == pytest.approx(0.3 * cfg.reserved_usd_per_gpu_hour)
    assert cfg.warning_s == 120 and SpotConfig(cloud="gcp").warning_s == 30
    assert SpotConfig(notice_s=5).warning_s == 5


@pytest.mark.parametrize("override, message", [
    ("spot.reserved_usd_per_gpu_hour=-1", "spot.reserved_usd_per_gpu_hour must be a finite $/GPU-hour >= 0"),
    ("spot.spot_usd_per_gpu_hour=-0.5", "spot.spot_usd_per_gpu_hour must be a finite $/GPU-hour >= 0"),
    ("spot.hard_kill_fraction=1.5", "spot.hard_kill_fraction must be in [0, 1]"),
    ('spot.cloud="azure"', "spot.cloud must be one of aws, gcp"),
    ('spot.notice_via="email"', "spot.notice_via must be one of sigterm, metadata"),
    ("spot.trace_hour_s=0", "spot.trace_hour_s must be a finite number of run seconds > 0"),
    ('spot.nodes="all"', "spot.nodes must be one of cap, proportional"),
    ("spot.synthetic.max_nodes=0", "spot.synthetic.max_nodes must be >= 1"),
    ("spot.workers_per_node=0", "spot.workers_per_node must be >= 1"),
    ("spot.bogus=1", "unknown field spot.bogus"),
])
def test_bad_spot_values_are_one_clear_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_trace_is_one_line_before_anything_starts(tmp_path):
    unsorted = tmp_path / "unsorted.csv"
    unsorted.write_text("0,add,node0\n5000,add,node1\n1000,remove,node0\n")
    with pytest.raises(TraceError, match="unsorted.csv:3"):
        spot_replay(SpotConfig(trace=str(unsorted)))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty"):
        spot_replay(SpotConfig(trace=str(empty)))
    with pytest.raises(ConfigError, match="no such file"):
        spot_replay(SpotConfig(trace=str(tmp_path / "missing.csv")))
    assert spot_replay(SpotConfig()) is None
    replay = spot_replay(SpotConfig(trace="synthetic", trace_hour_s=60))
    assert "synthetic(seed=0" in replay.describe() and "1 trace hour = 60 run s" in replay.describe()


# --- node liveness ----------------------------------------------------------------------------------
def test_a_silent_node_is_declared_lost_within_the_bound_and_may_come_back():
    clock = FakeClock(100.0)
    recipe = load_recipe("tiny", ["runtime.node_lost_s=4", "runtime.heartbeat_s=1", "runtime.lease_s=3"])
    core = ControllerCore(recipe, "ipc://q", "ipc://s", clock=clock)
    events = []
    core.on_event = lambda ev, node, rec: events.append((ev, node))
    core.register(m.Register(node_id="a", kind="spot", workers=2))
    core.register(m.Register(node_id="b", kind="spot", workers=1))
    assert core.sweep_s == 1.0
    for _ in range(3):  # b beats, a is silent (SIGKILLed: no goodbye)
        clock.t += 1.0
        core.beat(m.NodeBeat(node_id="b"))
        assert core.sweep() == []
    clock.t += 1.0
    core.beat(m.NodeBeat(node_id="b"))
    assert core.sweep() == ["a"]  # silent node_lost_s = 4 s: lost, within one sweep period
    assert "a" not in core.nodes and core.left[-1]["reason"].startswith("lost: no heartbeat for 4.0 s")
    with pytest.raises(NotFound):  # a frozen node that wakes is told, and registers again
        core.beat(m.NodeBeat(node_id="a"))
    core.register(m.Register(node_id="a", kind="spot", workers=2))
    core.deregister(m.Deregister(node_id="b", reason="leaving"))
    assert events == [("join", "a"), ("join", "b"), ("lost", "a"), ("join", "a"), ("leave", "b")]


def test_the_controllers_own_stall_is_not_a_nodes_silence():
    """The controller's loop stalled 9 s (starved of CPU or of the GIL by the trainer under load):
    heartbeats sent meanwhile wait unread, so the late sweep must not declare the live node lost
    (the false positive seen under heavy load); a node that really went silent is still declared
    lost once it has been silent node_lost_s of the controller's listening time."""
    clock = FakeClock(100.0)
    recipe = load_recipe("tiny", ["runtime.node_lost_s=4", "runtime.heartbeat_s=1", "runtime.lease_s=3"])
    core = ControllerCore(recipe, "ipc://q", "ipc://s", clock=clock)
    core.register(m.Register(node_id="live", kind="spot", workers=1))
    core.register(m.Register(node_id="dead", kind="spot", workers=1))
    clock.t += 1.0
    core.beat(m.NodeBeat(node_id="live"))
    assert core.sweep() == []
    clock.t += 10.0  # the stall: the sweep due at t+2 runs at t+11, the beats are still unread
    assert core.sweep() == []  # without the credit: both lost (silent 10 and 11 s >= 4)
    core.beat(m.NodeBeat(node_id="live"))  # read just after the late sweep
    clock.t += 1.0
    assert core.sweep() == []  # "dead": silent 2 + 1 s while the controller listened
    clock.t += 1.0
    core.beat(m.NodeBeat(node_id="live"))
    assert core.sweep() == ["dead"]  # 4 s of listened silence
    assert list(core.nodes) == ["live"]
    assert recipe.runtime.node_beat_s == 0.8  # agents beat 5 times per node_lost_s (not every heartbeat_s)


# --- the step log and the accounting ----------------------------------------------------------------
def test_step_log_counts_resumed_rerun_and_lost(tmp_path):
    path = tmp_path / "steps.log"
    lines = [
        *(f"r/0 1 {k}" for k in (1, 2, 3)),  # attempt 1 computed 3 steps, committed 3, was killed
        *(f"r/0 2 {k}" for k in (4, 5)),  # attempt 2 resumed from step 3: nothing lost
        *(f"r/1 1 {k}" for k in (1, 2)),  # naive: attempt 1 computed 2 steps, nothing committed
        *(f"r/1 2 {k}" for k in (1, 2, 3, 4, 5)),  # attempt 2 from scratch: 2 steps lost
        *(f"r/2 1 {k}" for k in (1, 2, 3)),  # attempt 1 killed after computing step 3, commit of 2 kept
        *(f"r/2 2 {k}" for k in (3, 4, 5)),  # resumed from 2: step 3 computed twice, 1 lost
        *(f"r/3 1 {k}" for k in (1, 2, 3, 4, 5)),  # never preempted
    ]
    path.write_text("\n".join(lines[:7]) + "\nr/1 2 ")  # a half-written line waits for the rest
    log = StepLog(path)
    log.refresh()
    with open(path, "a") as f:
        f.write("1\n" + "\n".join(lines[8:]) + "\n")
    t = log.totals()
    assert t == {"requests_logged": 4, "requests_resumed": 2, "requests_rerun": 1, "steps_computed": 23,
                 "steps_lost": 3, "requests_preempted": 3}


def test_account_prices_real_joins_and_counts_preemptions(tmp_path):
    clock = FakeClock(0.0)
    acct = SpotAccount(CostConfig(reserved_usd_per_gpu_hour=3.6), tmp_path / "none.log", clock=clock)
    acct.on_event("join", "local-reserved", {"kind": "reserved", "workers": 1})
    acct.on_event("join", "spot0.1", {"kind": "spot", "workers": 2})
    clock.t = 100.0
    acct.expect("spot0.1")  # the injector takes it away: a preemption
    acct.on_event("leave", "spot0.1", {"kind": "spot", "workers": 2, "reason": "leaving"})
    acct.on_event("join", "spot1.1", {"kind": "spot", "workers": 1})
    clock.t = 200.0
    acct.on_event("lost", "spot1.1", {"kind": "spot", "workers": 1, "reason": "lost"})  # also one
    snap = acct.snapshot()
    assert snap["preemptions"] == 2 and snap["nodes_lost"] == 1 and snap["spot_nodes"] == 0
    assert snap["gpu_s_spot"] == pytest.approx(2 * 100 + 100) and snap["gpu_s_reserved"] == pytest.approx(200)
    assert snap["cost_usd"] == pytest.approx(200 / 3600 * 3.6 + 300 / 3600 * 3.6 * 0.3)
    assert snap["steps_lost"] == 0 and snap["requests_resumed"] == 0
    assert [e["event"] for e in acct.events] == ["join", "join", "leave", "join", "lost"]


def test_account_bills_a_granted_node_from_its_grant(tmp_path):
    """A node the cloud granted is billed from the grant (its boot), not from its agent's join;
    one taken away while booting is billed for the boot and counted as preempted."""
    clock = FakeClock(0.0)
    acct = SpotAccount(CostConfig(reserved_usd_per_gpu_hour=1.0, spot_usd_per_gpu_hour=0.5),
                       tmp_path / "none.log", clock=clock)
    clock.t = 10.0
    acct.granted("spot0.1", 8)
    acct.granted("spot1.1", 8)
    clock.t = 190.0  # spot0.1 registers after a 180 s boot
    acct.on_event("join", "spot0.1", {"kind": "spot", "workers": 8})
    acct.expect("spot1.1")  # still booting: billed 10 -> 190, a preemption, no join ever
    clock.t = 290.0
    snap = acct.snapshot()
    assert snap["gpu_s_spot"] == pytest.approx(8 * 280 + 8 * 180)
    assert snap["preemptions"] == 1 and snap["spot_nodes"] == 1
    acct.on_event("leave", "spot0.1", {"kind": "spot", "workers": 8})  # not expected: no preemption
    assert acct.snapshot()["preemptions"] == 1


# --- baselines are recipes ----------------------------------------------------------------------------
def test_baselines_switch_options_of_the_one_recipe(tmp_path):
    tiny, reserved, naive = (load_recipe(n).to_dict() for n in ("tiny", "reserved_only", "naive_spot"))
    changed = {s: {k for k in tiny[s] if tiny[s][k] != reserved[s][k]} for s in tiny}
    assert {s: v for s, v in changed.items() if v} == {
        "run": {"name"}, "runtime": {"spot_workers", "reserved_workers"},
        "spot": {"reserved_usd_per_gpu_hour", "spot_usd_per_gpu_hour"}}  # H100 list prices
    assert reserved["runtime"]["spot_workers"] == 0 and reserved["spot"]["trace"] is None
    changed = {s: {k for k in tiny[s] if tiny[s][k] != naive[s][k]} for s in tiny}
    assert changed["runtime"] == {"step_commits", "sp_regroup", "peer_weights"}
    assert naive["runtime"]["step_commits"] is False and naive["runtime"]["peer_weights"] is False
    assert naive["runtime"]["sp_regroup"] is False
    assert naive["explore"]["schedule"] == "critical"
    mine = tmp_path / "mine.toml"  # a user's recipe may extend a built-in one, and be overridden
    mine.write_text('extends = "naive_spot"\n[run]\nname = "mine"\n')
    r = load_recipe(mine, ["runtime.step_commits=true"])
    assert r.run.name == "mine" and r.runtime.step_commits and r.explore.schedule == "critical"
    loop = tmp_path / "loop.toml"
    loop.write_text('extends = "loop.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_recipe(loop)


# --- --resume without a checkpoint ----------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "run in-process", "reserved"])
def test_resume_without_a_checkpoint_is_one_line_and_starts_nothing(tmp_path, capsys, command):
    from spotlight.cli import main

    extra = {"run": ['run.mode="runtime"'], "run in-process": [], "reserved": ["--port", "0"]}[command]
    argv = [command.split()[0], "tiny", f'run.out_dir="{tmp_path}"', *extra, "--resume", "--no-progress"]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--resume: no checkpoint in" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing was started, nothing written


# --- a sealed trajectory is not computed again ----------------------------------------------------
async def test_a_redelivered_request_already_sealed_is_returned_not_recomputed(tmp_path):
    import torch
    from tiny_recipe import TINY_MODEL

    from spotlight.actors.store.client import TensorStoreClient
    from spotlight.actors.worker.core import STEP_LOG, WorkerCore
    from spotlight.work import policy_model

    recipe = load_recipe("tiny", [*TINY_MODEL, "run.group_size=2"])
    torch.manual_seed(0)
    model = policy_model(recipe)
    job = m.RolloutWork(prompt="two red circles", seeds=[5, 6], version=0)
    async with TensorStoreClient.local() as store:
        await store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()})
        core = WorkerCore(recipe, store, model=model, worker_id="n/w0", log_dir=tmp_path)
        try:
            first = await core.run(m.LeaseGrant(request_id="r", attempt=1, deadline=0.0, lease_s=30.0,
                                                batch="b", work=job))
            # The worker died after the seal, before the queue heard: attempt 2 finds no commit.
            again = await core.run(m.LeaseGrant(request_id="r", attempt=2, deadline=0.0, lease_s=30.0,
                                                batch="b", work=job))
        finally:
            core.close()
    assert again.key == first.key and again.rewards == first.rewards
    assert again.resumed_from == recipe.sampler.steps  # nothing computed again
    log = StepLog(tmp_path / STEP_LOG).totals()
    assert log["steps_computed"] == recipe.sampler.steps and log["steps_lost"] == 0
