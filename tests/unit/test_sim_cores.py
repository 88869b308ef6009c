"""The simulation's processors (spotlight.sim.cores) and the tiny profile's calibration: tasks
sharing cores slow down as the measured table says and speed up when one leaves; a device each
never slows; a notice's step boundary moves with the load; a calibration file is read or refused
with one line; a calibrated run prices two spot workers on one core slower than one."""

from __future__ import annotations

import json

import pytest

from spotlight.errors import ConfigError
from spotlight.recipe import load_recipe
from spotlight.sim.clock import VirtualClock
from spotlight.sim.cores import Cores
from spotlight.sim.run import SimRun
from spotlight.sim.timing import Calibration, TimingModel


def _finish_times(slowdown):
    clock, done = VirtualClock(), {}
    cores = Cores(clock, slowdown)
    cores.start(12, 1.0, lambda: done.setdefault("a", clock()))
    clock.call_at(5.0, lambda: cores.start(5, 1.0, lambda: done.setdefault("b", clock())))
    clock.run()
    return done


def test_shared_cores_share_and_a_device_each_does_not():
    # a: 5 units alone by 5 s; then both at half speed: b's 5 units by 15 s, a at 10 units;
    # then a alone again: its last 2 by 17 s
    assert _finish_times(lambda n: float(n)) == pytest.approx({"a": 17.0, "b": 15.0})
    assert _finish_times(None) == pytest.approx({"a": 12.0, "b": 10.0})


def test_a_task_cut_short_ends_at_its_boundary_and_keeps_its_progress():
    clock, log = VirtualClock(), []
    cores = Cores(clock, lambda n: float(n))
    a = cores.start(10, 1.0, lambda: log.append("completed"))
    b = cores.start(10, 1.0, lambda: log.append("b"))
    clock.run(end=3.0)  # 1.5 units each
    assert cores.progress(a) == pytest.approx(1.5)
    cores.end_at(a, 2, lambda: log.append(("stopped", clock())))
    clock.call_at(3.5, lambda: cores.stop(b))  # b leaves: a finishes its step alone, at full speed
    clock.run()
    assert log == [("stopped", pytest.approx(3.75))]
    assert cores.progress(a) == 2 and cores.progress(b) == pytest.approx(1.75)


def _cal(**kw):
    base = dict(batch=8, steps=10, spot_step_s=(0.05, 0.1), reserved_step_s=(0.05,), train_s_per_sample=0.02,
                node_start_s=0.5, worker_start_s=1.0, request_s=0.0)
    return Calibration(**{**base, **kw})


def test_calibration_file_round_trip_and_bad_input(tmp_path):
    path = tmp_path / "cal.json"
    _cal().save(path)
    assert Calibration.load(path) == _cal()
    assert Calibration.load(path).slowdown("spot")(3) == pytest.approx(3.0)  # linear past the table
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batch": 8}))
    with pytest.raises(ConfigError, match="sim.calibration"):
        Calibration.load(bad)
    with pytest.raises(ConfigError, match="spot_step_s"):
        _cal(spot_step_s=())
    with pytest.raises(ConfigError, match="request_s"):
        _cal(request_s=-0.1)
    with pytest.raises(ConfigError, match="measures the tiny profile"):
        TimingModel("qwen-image-20b", "h200", calibration=_cal())
    with pytest.raises(ConfigError, match="sim.calibration"):
        load_recipe("tiny", ['run.mode="sim"', f'sim.calibration="{tmp_path / "missing.json"}"'])


def _rollout_s(tmp_path, spot_step_s, request_s=0.0):
    path = tmp_path / f"cal{spot_step_s[1]}-{request_s}.json"
    _cal(spot_step_s=spot_step_s, request_s=request_s).save(path)
    recipe = load_recipe("tiny", ['run.mode="sim"', "run.iterations=2", "runtime.reserved_workers=0",
                                  "runtime.spot_workers=2", "spot.workers_per_node=2",
                                  f'sim.calibration="{path}"'])
    run = SimRun(recipe, write=False)
    run.run()
    return run.records[-1]["rollout_s"]


def test_calibrated_spot_workers_share_their_core(tmp_path):
    # 8 requests of 10 steps on two workers: alone 0.05 s a step -> 4 x 0.5 s each; sharing one core
    # (0.1 s a step with two computing) -> 4 x 1.0 s
    assert _rollout_s(tmp_path, (0.05, 0.05)) == pytest.approx(2.0, abs=0.05)
    assert _rollout_s(tmp_path, (0.05, 0.1)) == pytest.approx(4.0, abs=0.05)


def test_the_runtimes_own_seconds_per_request_hold_the_worker(tmp_path):
    # the same 4 requests a worker, each held 0.1 s longer by the runtime's own work: + 4 x 0.1 s
    assert _rollout_s(tmp_path, (0.05, 0.05), request_s=0.1) == pytest.approx(2.4, abs=0.05)
