"""Cost accounting: exact GPU-second and dollar arithmetic on a fake clock, nodes joining and leaving
mid-interval, broken join/leave sequences, prices and their precedence, the snapshot.

    taskset -c 0 .venv/bin/python -m pytest -q tests/unit/test_cost.py
"""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from spotlight.errors import ConfigError, ProtocolError
from spotlight.spot.cost import CostConfig, CostMeter


@pytest.fixture
def clock():
    return FakeClock()


def meter(clock, **cfg):
    return CostMeter(CostConfig(reserved_usd_per_gpu_hour=4.0, **cfg), clock=clock)


def test_gpu_seconds_and_dollars_with_nodes_joining_and_leaving_mid_interval(clock):
    m = meter(clock)  # spot = 30% of 4.0 = 1.2 $/GPU-h
    m.join("reserved0", node_class="reserved", gpus=8)
    clock.t += 100
    m.join("spot0", node_class="spot", gpus=4)
    clock.t += 400
    m.join("spot1", node_class="spot", gpus=2)
    # mid-interval: present nodes accrue up to now
    assert m.gpu_seconds("reserved") == 8 * 500
    assert m.gpu_seconds("spot") == 4 * 400
    clock.t += 500  # t = 1000 s after start
    m.leave("spot0", preempted=True)
    clock.t += 2600  # t = 3600 s
    assert m.gpu_seconds("reserved") == 8 * 3600
    assert m.gpu_seconds("spot") == 4 * 900 + 2 * 3100
    assert m.cost_usd("reserved") == pytest.approx(8 * 4.0)
    assert m.cost_usd("spot") == pytest.approx((3600 + 6200) / 3600 * 1.2)
    assert m.cost_usd() == pytest.approx(32.0 + 9800 / 3600 * 1.2)
    # a node that left stops accruing; joining again starts a new interval
    clock.t += 400
    m.join("spot0", node_class="spot", gpus=4)
    clock.t += 50
    assert m.gpu_seconds("spot") == 4 * 900 + 2 * 3550 + 4 * 50
    m.leave_all()
    clock.t += 1000  # nothing present: nothing accrues
    assert m.gpu_seconds("spot") == 3600 + 7100 + 200 and m.gpu_seconds("reserved") == 8 * 4050
    assert m.preemptions == 1  # leave_all is the end of the run, not a preemption


def test_snapshot_contents(clock):
    m = meter(clock, spot_usd_per_gpu_hour=0.9)
    m.join("r", node_class="reserved", gpus=1)
    m.join("s0", node_class="spot", gpus=2)
    m.join("s1", node_class="spot", gpus=2)
    clock.t += 1800
    m.leave("s1", preempted=True)
    m.record_resumed(3)
    m.record_resumed()
    m.record_steps_lost(2)
    m.record_steps_lost(0)
    clock.t += 1800
    snap = m.snapshot()
    assert snap == {
        "elapsed_s": 3600.0, "spot_nodes": 1, "reserved_nodes": 1, "preemptions": 1, "requests_resumed": 4,
        "steps_lost": 2, "gpu_s_reserved": 3600.0, "gpu_s_spot": 2 * 3600.0 + 2 * 1800.0,
        "cost_usd_reserved": pytest.approx(4.0), "cost_usd_spot": pytest.approx(3.0 * 0.9),
        "cost_usd": pytest.approx(4.0 + 2.7),
    }
    m.leave("s0", preempted=False)  # a planned removal is no preemption
    assert m.snapshot()["preemptions"] == 1 and m.snapshot()["spot_nodes"] == 0


def test_broken_join_leave_sequences_are_clear_errors(clock):
    m = meter(clock)
    m.join("s0", node_class="spot", gpus=1)
    clock.t += 12.5
    m.leave("s0", preempted=True)
    with pytest.raises(ProtocolError, match=r"node 's0' leaves twice: it already left at 12\.500 s"):
        m.leave("s0", preempted=True)
    with pytest.raises(ProtocolError, match="node 'ghost' leaves but never joined"):
        m.leave("ghost", preempted=False)
    m.join("s1", node_class="spot", gpus=1)
    with pytest.raises(ProtocolError, match="node 's1' joins again while present .* expected a leave first"):
        m.join("s1", node_class="reserved", gpus=8)
    with pytest.raises(ValueError, match="node class must be one of reserved, spot, got 'ondemand'"):
        m.join("x", node_class="ondemand", gpus=1)
    with pytest.raises(ValueError, match="gpus must be a whole number >= 1, got 0"):
        m.join("x", node_class="spot", gpus=0)
    with pytest.raises(ValueError, match="steps lost must be a whole number >= 0"):
        m.record_steps_lost(-1)
    assert m.preemptions == 1  # the refused calls changed nothing
    assert m.gpu_seconds("spot") == 12.5


def test_spot_price_precedence_config_then_trace_then_fraction(clock):
    assert CostConfig().spot_price() == pytest.approx(0.3 * 4.10)
    assert CostConfig(reserved_usd_per_gpu_hour=10.0, spot_fraction=0.25).spot_price() == 2.5
    assert CostConfig(reserved_usd_per_gpu_hour=10.0).spot_price(trace_price=1.7) == 1.7
    explicit = CostConfig(reserved_usd_per_gpu_hour=10.0, spot_usd_per_gpu_hour=2.0)
    assert explicit.spot_price(trace_price=1.7) == 2.0
    m = CostMeter(CostConfig(reserved_usd_per_gpu_hour=10.0), trace_spot_price=1.7, clock=clock)
    assert m.prices == {"reserved": 10.0, "spot": 1.7}
    with pytest.raises(ConfigError, match="trace's spot price must be a finite"):
        CostMeter(trace_spot_price=-1.0, clock=clock)


@pytest.mark.parametrize("kw,field,allowed", [
    (dict(reserved_usd_per_gpu_hour=-1.0), "reserved_usd_per_gpu_hour", ">= 0"),
    (dict(reserved_usd_per_gpu_hour=float("inf")), "reserved_usd_per_gpu_hour", ">= 0"),
    (dict(spot_usd_per_gpu_hour=-0.5), "spot_usd_per_gpu_hour", ">= 0 or unset"),
    (dict(spot_fraction=0.0), "spot_fraction", "(0, 1]"),
    (dict(spot_fraction=1.5), "spot_fraction", "(0, 1]"),
])
def test_cost_config_errors_name_the_field_and_range(kw, field, allowed):
    with pytest.raises(ConfigError) as info:
        CostConfig(**kw)
    msg = str(info.value)
    assert msg.startswith(f"spot.{field} must be") and allowed in msg, msg
