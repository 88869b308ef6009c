"""Spot traces: every public format, every malformed-line error, the synthetic generator, the
replay mapping, and the real AWS trace.

    taskset -c 0 .venv/bin/python -m pytest -q tests/unit/test_traces.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spotlight.errors import ConfigError, TraceError
from spotlight.spot.replay import Replay, ReplayConfig
from spotlight.spot.synthetic import SyntheticConfig, synthetic_trace
from spotlight.spot.traces import CapacityEvent, Trace, detect_format, parse_trace, read_trace

DATA = Path(__file__).parent.parent / "data" / "traces"
AWS = Path(__file__).parents[3] / "shared" / "traces" / "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"


def ev(t, action, node):
    return CapacityEvent(float(t), action, node)


# --- the four formats ------------------------------------------------------------------------------
def test_counts_csv_step_function_with_header():
    t = read_trace(DATA / "counts.csv")
    assert t.format == "counts" and t.end_s == 60.0 and t.spot_price is None
    assert t.capacity() == [(0.0, 0), (10.0, 3), (25.0, 1), (40.0, 2)]
    assert t.events == (ev(10, "add", "node0"), ev(10, "add", "node1"), ev(10, "add", "node2"),
                        ev(25, "remove", "node2"), ev(25, "remove", "node1"), ev(40, "add", "node1"))
    assert t.preemptions == 2
    assert t.summary() == {"events": 6, "preemptions": 2, "preemption_times": 1, "additions": 4,
                           "duration_s": 60.0, "max_nodes": 3, "min_nodes": 1}


def test_event_lines_in_ms():
    t = read_trace(DATA / "events.csv")
    assert t.format == "events" and t.end_s == 30.0
    assert t.events == (ev(0, "add", "node0"), ev(0, "add", "node1"), ev(5, "add", "node2"),
                        ev(12, "remove", "node1"), ev(20, "remove", "node0"), ev(30, "add", "node1"))
    assert t.capacity() == [(0.0, 2), (5.0, 3), (12.0, 2), (20.0, 1), (30.0, 2)]
    assert [t.capacity_at(x) for x in (0, 4.9, 5, 19.9, 20, 99)] == [2, 2, 3, 2, 1, 2]


def test_json_lines():
    t = read_trace(DATA / "events.jsonl")
    assert t.format == "jsonl" and t.end_s == 120.0
    assert t.events == (ev(0, "add", "a"), ev(0, "add", "b"), ev(0, "add", "c"), ev(60, "remove", "b"),
                        ev(90, "add", "d"), ev(120, "remove", "a"), ev(120, "remove", "c"))
    assert t.capacity() == [(0.0, 3), (60.0, 2), (90.0, 3), (120.0, 1)]
    assert t.preemptions == 3 and t.summary()["preemption_times"] == 2


def test_skypilot_json_with_price():
    t = read_trace(DATA / "skypilot.json")
    assert t.format == "skypilot" and t.end_s == 3000.0 and t.spot_price == 1.25
    assert t.capacity() == [(0.0, 2), (1200.0, 0), (1800.0, 1), (2400.0, 3)]
    assert t.preemptions == 2 and t.summary()["additions"] == 5


@pytest.mark.parametrize("name,fmt", [("counts.csv", "counts"), ("events.csv", "events"),
                                      ("events.jsonl", "jsonl"), ("skypilot.json", "skypilot")])
def test_explicit_format_equals_detected(name, fmt):
    text = (DATA / name).read_text()
    assert detect_format(text) == fmt
    assert parse_trace(text, format=fmt) == parse_trace(text)


def test_event_lines_header_and_crlf():
    t = parse_trace("ms,action,node\r\n0,add,a\r\n1500,remove,a\r\n")
    assert t.format == "events" and t.events == (ev(0, "add", "a"), ev(1.5, "remove", "a"))


def test_trace_built_in_memory_is_validated():
    t = Trace((ev(0, "add", "x"), ev(7, "remove", "x")), end_s=10.0)
    assert t.capacity() == [(0.0, 1), (7.0, 0)] and t.capacity_at(8) == 0
    with pytest.raises(TraceError, match="<memory>: event 1: node 'y' is removed but is not present"):
        Trace((ev(0, "add", "x"), ev(7, "remove", "y")), end_s=10.0)
    with pytest.raises(TraceError, match="end 5 s is before the last event"):
        Trace((ev(0, "add", "x"), ev(7, "remove", "x")), end_s=5.0)
    with pytest.raises(TraceError, match="empty trace"):
        Trace((), end_s=1.0)


# --- malformed input: file, line, expectation --------------------------------------------------
MALFORMED = [
    # (text, format or None, line, fragments of the message)
    ("0,0\n10,x\n", None, 2, ["count 'x'", "expected 'seconds,count'"]),
    ("0,1\n10,2,3\n", "counts", 2, ["3 fields", "expected 'seconds,count'"]),
    ("0,1\n10,2\n# note\n5,3\n", None, 4, ["time 5 s is before the previous line's 10 s", "time-ordered"]),
    ("0,-1\n", None, 1, ["count '-1'", "whole instance count >= 0"]),
    ("abc,1\n", None, 1, ["time 'abc'", "expected 'seconds,count'"]),
    ("seconds,count\n", None, 1, ["empty trace", "'seconds,count'"]),
    ("0,add,n0\n5,evict,n0\n", None, 2, ["action 'evict'", "expected 'ms,add|remove,node'"]),
    ("0,add,n0\nsoon,remove,n0\n", None, 2, ["time 'soon'", "time in milliseconds"]),
    ("0,add,n0\n5,add,n0\n", None, 2, ["node 'n0' is added while already present", "removal first"]),
    ("0,add,n0\n5,remove,n1\n", None, 2, ["node 'n1' is removed but is not present", "addition first"]),
    ("0,add,n0\n9,add,n1\n8,remove,n0\n", None, 3, ["time-ordered"]),
    ("0,add,\n", None, 1, ["node name ''", "a node name"]),
    ("0,add,n0\n5,remove\n", "events", 2, ["2 fields", "expected 'ms,add|remove,node'"]),
    ('[0, "add", {"nodes": ["a"]}]\n[5, "add", {"nodes": ["b"]\n', None, 2, ["invalid JSON", "JSON line"]),
    ('[0, "add", {"nodes": ["a"]}]\n[5, "remove", ["a"]]\n', None, 2, ['{"nodes": ["name", ...]}']),
    ('[0, "set", {"nodes": ["a"]}]\n', None, 1, ["'[0, \"set\"", '"add"|"remove"']),
    ('[0, "add", {"nodes": ["a"]}]\n\n[10, "remove", {"nodes": ["a", "z"]}]\n', None, 3,
     ["node 'z' is removed but is not present"]),
    ('[9, "add", {"nodes": ["a"]}]\n[3, "add", {"nodes": ["b"]}]\n', None, 2, ["time-ordered"]),
    ('{\n  "metadata": {"gap_seconds": 60},\n  "data": [1, 2,\n  ]\n}\n', None, 4,
     ["invalid JSON", "SkyPilot"]),
    ('{\n  "metadata": {},\n  "data": [1]\n}\n', None, 2, ["gap_seconds is None", "> 0"]),
    ('{\n  "metadata": {\n    "gap_seconds": -5},\n  "data": [1]\n}\n', None, 3, ["gap_seconds is -5"]),
    ('{"metadata": {"gap_seconds": 60},\n "data": [1, 2,\n   3, -1,\n 4]}\n', None, 3,
     ["data[3] is -1", "whole instance count >= 0"]),
    ('{"metadata": {"gap_seconds": 60},\n "data": [1, 2.5]}\n', None, 2, ["data[1] is 2.5"]),
    ('{"metadata": {"gap_seconds": 60},\n\n "data": []}\n', None, 3, ["'data' is []", "non-empty list"]),
    ('{"metadata": {"gap_seconds": 60,\n "spot_price": -1}, "data": [1]}\n', None, 2, ["spot_price is -1"]),
    ('{"data": [1]}\n', None, 1, ["no 'metadata' object"]),
    ("", None, 1, ["empty trace", "expected one of"]),
    ("# only a comment\n\n", None, 1, ["empty trace"]),
    ("\n0 1 2\n", None, 2, ["cannot tell the trace format from '0 1 2'", "'seconds,count'", "SkyPilot"]),
]


@pytest.mark.parametrize("text,fmt,line,fragments", MALFORMED)
def test_malformed_line_names_file_line_and_expectation(tmp_path, text, fmt, line, fragments):
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(path, format=fmt)
    msg = str(info.value)
    assert msg.startswith(f"{path}:{line}: "), msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert isinstance(info.value, ConfigError)  # a bad trace stops a run like a bad recipe field


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match="unknown trace format 'csv'; expected one of counts, events"):
        parse_trace("0,1\n", format="csv")
    with pytest.raises(TraceError, match=r"nope\.csv: cannot read the trace"):
        read_trace(tmp_path / "nope.csv")


# --- the real AWS trace ----------------------------------------------------------------------------
needs_aws = pytest.mark.skipif(not AWS.exists(), reason=f"the shared AWS trace is not at {AWS}")


@needs_aws
def test_real_aws_trace():
    t = read_trace(AWS)
    s = t.summary()
    assert t.format == "counts" and s["max_nodes"] == 12 and s["min_nodes"] == 2
    assert s["duration_s"] == 88194.0 and s["events"] == 177
    # preemptions counted independently from the raw rows: every drop in the count
    rows = [tuple(map(int, line.split(","))) for line in AWS.read_text().split()]
    drops = [(a[1] - b[1]) for a, b in zip(rows, rows[1:]) if b[1] < a[1]]
    assert t.preemptions == sum(drops) == 85 and s["preemption_times"] == len(drops) == 35
    assert t.capacity()[:4] == [(0.0, 0), (21529.0, 4), (21556.0, 12), (21637.0, 5)]
    assert t.capacity_at(88194) == 7


# --- the synthetic generator -----------------------------------------------------------------------
def test_synthetic_is_deterministic_in_its_seed():
    cfg = dict(preemption_rate=1.0, arrival_rate=3.0, max_nodes=5, duration_s=20 * 3600.0)
    a, b = synthetic_trace(SyntheticConfig(seed=7, **cfg)), synthetic_trace(SyntheticConfig(seed=7, **cfg))
    assert a == b and a.events and a.format == "synthetic" and "seed=7" in a.source
    assert synthetic_trace(SyntheticConfig(seed=8, **cfg)).events != a.events


def test_synthetic_rates_and_bounds():
    cfg = SyntheticConfig(seed=0, preemption_rate=0.5, arrival_rate=2.0, min_nodes=1, max_nodes=4,
                          initial_nodes=2, duration_s=3000 * 3600.0)
    t = synthetic_trace(cfg)
    steps = t.capacity() + [(t.end_s, None)]
    assert steps[0] == (0.0, 2)
    exposed_node_h = below_max_h = 0.0  # node-hours open to preemption; hours open to arrivals
    for (t0, n), (t1, _) in zip(steps, steps[1:]):
        assert 1 <= n <= 4
        exposed_node_h += n * (t1 - t0) / 3600 if n > cfg.min_nodes else 0.0
        below_max_h += (t1 - t0) / 3600 if n < cfg.max_nodes else 0.0
    s = t.summary()
    assert s["preemptions"] > 1000
    assert s["preemptions"] / exposed_node_h == pytest.approx(0.5, rel=0.06)
    assert (s["additions"] - 2) / below_max_h == pytest.approx(2.0, rel=0.06)


def test_synthetic_config_errors():
    for kw, field in [(dict(preemption_rate=-1), "preemption_rate"), (dict(max_nodes=0), "max_nodes"),
                      (dict(min_nodes=5, max_nodes=4), "min_nodes"), (dict(initial_nodes=9), "initial_nodes"),
                      (dict(duration_s=0), "duration_s"), (dict(arrival_rate=float("nan")), "arrival_rate")]:
        with pytest.raises(ConfigError, match=rf"spot\.synthetic\.{field} must be"):
            SyntheticConfig(**kw)
    with pytest.raises(ConfigError, match="drew no node"):
        synthetic_trace(SyntheticConfig(initial_nodes=0, arrival_rate=0.0))


# --- replay mapping --------------------------------------------------------------------------------
@needs_aws
def test_replay_time_scale_and_cap():
    r = Replay(read_trace(AWS), ReplayConfig(trace_hour_s=60.0, nodes="cap", max_nodes=4))
    assert r.run_s(3600.0) == 60.0 and r.scale_s(120.0) == 2.0 and r.duration_s == pytest.approx(1469.9)
    assert [r.local_nodes(n) for n in (0, 2, 4, 12)] == [0, 2, 4, 4]
    steps = r.steps()
    assert steps[:3] == [(0.0, 0), (pytest.approx(21529 / 60), 4), (pytest.approx(24475 / 60), 2)]
    assert all(a[1] != b[1] for a, b in zip(steps, steps[1:]))  # only changes
    events = r.events()
    assert [(e.action, e.node) for e in events[:5]] == [("add", "spot0"), ("add", "spot1"), ("add", "spot2"),
                                                       ("add", "spot3"), ("remove", "spot3")]
    assert Trace(tuple(events), end_s=r.duration_s).capacity() == steps  # events and steps agree


@needs_aws
def test_replay_proportional_rounds_halves_up_and_start_offset():
    r = Replay(read_trace(AWS), ReplayConfig(nodes="proportional", factor=0.25, trace_hour_s=3600.0,
                                             start_s=21529.0))
    assert [r.local_nodes(n) for n in (0, 1, 2, 5, 6, 12)] == [0, 0, 1, 1, 2, 3]
    assert r.run_s(21529.0) == 0.0 and r.run_s(21556.0) == 27.0
    assert r.steps()[:3] == [(0.0, 1), (27.0, 3), (108.0, 1)]


@needs_aws
def test_replay_describe_states_both_rules():
    r = Replay(read_trace(AWS), ReplayConfig(trace_hour_s=60.0, max_nodes=4))
    line = r.describe()
    for fragment in ("aws-g4dn-xlarge", "(counts; 24.5 trace h", "85 preemptions", "2..12 nodes",
                     "1 trace hour = 60 run s", "from trace 0 s", "1470 run s in all",
                     "cap: min(trace count, 4)", "trace max 12 -> 4 local"):
        assert fragment in line, (fragment, line)
    prop = Replay(read_trace(AWS), ReplayConfig(nodes="proportional", factor=0.5)).describe()
    assert "proportional: round(trace count x 0.5)" in prop and "trace max 12 -> 6 local" in prop


@needs_aws
def test_replay_config_errors():
    for kw, field in [(dict(trace_hour_s=0), "trace_hour_s"), (dict(start_s=-1), "start_s"),
                      (dict(nodes="all"), "nodes"), (dict(max_nodes=0), "max_nodes"),
                      (dict(factor=0), "factor")]:
        with pytest.raises(ConfigError, match=rf"spot\.{field} must be"):
            ReplayConfig(**kw)
    with pytest.raises(ConfigError, match=r"spot\.start_s \(90000\) must be before the end of"):
        Replay(read_trace(AWS), ReplayConfig(start_s=90000.0))
