"""Spot capacity traces: read the public formats and normalise them to one representation.

Formats (``FORMATS``; told apart by content, or named with ``format=``):

- ``counts``: ``seconds,count`` lines, a step function (the AWS trace in ../shared/traces/, from
  Bamboo): each change is two rows at the same time, old value then new; rows sharing a time
  collapse to the last one.
- ``events``: ``ms,add|remove,nodeN`` lines (Bamboo / Oobleck / Parcae).
- ``jsonl``: one JSON array a line, ``[ms, "add"|"remove", {"nodes": ["n1", ...]}]`` (SpotServe /
  Parcae style).
- ``skypilot``: SkyPilot's spot-traces JSON ``{"metadata": {"gap_seconds": N}, "data": [count, ...]}``,
  ``data[i]`` the instances available from ``i * N`` seconds on; an optional
  ``metadata.spot_price`` ($/GPU-hour) is carried as the trace's price.

In the text formats blank lines and ``#`` comments are skipped, and a first line of bare words
(``seconds,count``) is a header. Every format becomes a `Trace`: time-ordered `CapacityEvent`s
(trace seconds, add/remove, node name) and, derived from them, the capacity step function
(`Trace.capacity`). Count formats name nodes ``node0, node1, ...``: an addition takes the lowest free
numbers, a removal the highest present ones (which instance a cloud takes is not in the trace).

A malformed line raises `TraceError` as ``file:line: what was wrong; expected ...``. A trace that is
empty, unsorted, adds a node already present or removes one that is not, is malformed.

Knows nothing of run time, local nodes, processes or the cost meter: replay.py maps a trace onto
a run, synthetic.py makes one up, the fault injector acts on it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from spotlight.errors import TraceError

FORMATS = ("counts", "events", "jsonl", "skypilot")
ACTIONS = ("add", "remove")
_HEADER = re.compile(r"^[A-Za-z_][\w .()/-]*$")
_EXPECTED = {
    "counts": "'seconds,count' (a time in seconds >= 0, a whole instance count >= 0)",
    "events": "'ms,add|remove,node' (a time in milliseconds >= 0, 'add' or 'remove', a node name)",
    "jsonl": "a JSON line [ms, \"add\"|\"remove\", {\"nodes\": [\"name\", ...]}]",
    "skypilot": "a SkyPilot trace {\"metadata\": {\"gap_seconds\": N > 0}, \"data\": [count >= 0, ...]}",
}


@dataclass(frozen=True, slots=True)
class CapacityEvent:
    """One change of spot capacity: at ``time_s`` (trace seconds) ``node`` was added or removed."""

    time_s: float
    action: str
    node: str


@dataclass(frozen=True, slots=True)
class Trace:
    """A spot capacity trace: time-ordered events from trace time 0 to ``end_s``."""

    events: tuple[CapacityEvent, ...]
    end_s: float
    source: str = "<memory>"
    format: str = "events"
    spot_price: float | None = None
    """$/GPU-hour for spot capacity when the trace carries one (None: the config's price applies)."""
    _steps: tuple[tuple[float, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        builder = _EventBuilder()
        for i, e in enumerate(self.events):
            builder.push(f"{self.source}: event {i}", e.time_s, e.action, e.node)
        if not self.events:
            raise TraceError(f"{self.source}: empty trace; expected at least one capacity event")
        if not self.end_s >= self.events[-1].time_s:
            raise TraceError(f"{self.source}: end {self.end_s:g} s is before the last event "
                             f"({self.events[-1].time_s:g} s)")
        object.__setattr__(self, "_steps", tuple(_steps_of(self.events)))

    # --- the step-function view -----------------------------------------------------------------
    def capacity(self) -> list[tuple[float, int]]:
        """The capacity step function: [(time_s, nodes present from then on)], starting at (0, n0),
        one entry per time the count changes (events at one time count once, after all of them)."""
        return list(self._steps)

    def capacity_at(self, time_s: float) -> int:
        """Nodes present at ``time_s`` (events at exactly ``time_s`` included)."""
        count = 0
        for t, c in self._steps:
            if t > time_s:
                break
            count = c
        return count

    # --- numbers a run prints -------------------------------------------------------------------
    @property
    def preemptions(self) -> int:
        """Nodes removed over the trace (a drop of 3 at once is 3 preemptions)."""
        return sum(e.action == "remove" for e in self.events)

    def summary(self) -> dict[str, float | int]:
        """Events, preemptions (nodes and distinct times), additions, duration, and the largest and
        smallest capacity from the first event on (before it a count trace may simply be empty)."""
        counts = [c for t, c in self._steps if t >= self.events[0].time_s]
        return {
            "events": len(self.events),
            "preemptions": self.preemptions,
            "preemption_times": len({e.time_s for e in self.events if e.action == "remove"}),
            "additions": sum(e.action == "add" for e in self.events),
            "duration_s": self.end_s,
            "max_nodes": max(counts),
            "min_nodes": min(counts),
        }


def events_from_counts(steps: Iterable[tuple[float, int]], prefix: str = "node") -> list[CapacityEvent]:
    """Named events for a count step function [(time_s, count)]: additions take the lowest free
    numbers, removals the highest present ones, so the nodes present are always prefix0..prefix{n-1}."""
    events: list[CapacityEvent] = []
    n = 0
    for t, c in steps:
        while n < c:
            events.append(CapacityEvent(t, "add", f"{prefix}{n}"))
            n += 1
        while n > c:
            n -= 1
            events.append(CapacityEvent(t, "remove", f"{prefix}{n}"))
    return events


AWS_G4DN = "aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"
"""The AWS g4dn.xlarge trace (us-east-1c, 2020-11-20; from Bamboo) the benches replay."""


def shared_trace(name: str = AWS_G4DN) -> Path | None:
    """``shared/traces/<name>`` beside the repository (in the first folder above this package that
    has a ``shared/traces``), or None where there is none or it lacks ``name``."""
    for parent in Path(__file__).resolve().parents:
        folder = parent / "shared" / "traces"
        if folder.is_dir():
            return folder / name if (folder / name).is_file() else None
    return None


def read_trace(path: str | Path, format: str | None = None) -> Trace:
    """Read a trace file in any of `FORMATS` (detected from its content unless ``format`` names it)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror})") from None
    return parse_trace(text, source=str(path), format=format)


def parse_trace(text: str, *, source: str = "<memory>", format: str | None = None) -> Trace:
    """Parse a trace's text; ``source`` names it in errors."""
    if format is None:
        format = detect_format(text, source)
    elif format not in FORMATS:
        raise TraceError(f"{source}: unknown trace format {format!r}; expected one of {', '.join(FORMATS)}")
    return _PARSERS[format](text, source)


def detect_format(text: str, source: str = "<memory>") -> str:
    """Which of `FORMATS` ``text`` is, from its first data line (a JSON object is SkyPilot's)."""
    if text.lstrip().startswith("{"):
        return "skypilot"
    for lineno, line in _data_lines(text):
        if line.startswith("["):
            return "jsonl"
        fields = line.count(",") + 1
        if fields in (2, 3):
            return "counts" if fields == 2 else "events"
        raise TraceError(f"{source}:{lineno}: cannot tell the trace format from {line!r}; expected "
                         + "; or ".join(_EXPECTED.values()))
    raise TraceError(f"{source}:1: empty trace; expected one of: " + "; or ".join(_EXPECTED.values()))


# --- parsers ---------------------------------------------------------------------------------------
def _parse_counts(text: str, source: str) -> Trace:
    steps: list[tuple[float, int]] = []
    for lineno, line in _data_lines(text, header_fields=2):
        where = f"{source}:{lineno}"
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            raise TraceError(f"{where}: {len(parts)} fields in {line!r}; expected {_EXPECTED['counts']}")
        t, count = _time(parts[0], where, line, "counts"), _count(parts[1], where, line, "counts")
        if steps and t < steps[-1][0]:
            raise TraceError(f"{where}: time {t:g} s is before the previous line's {steps[-1][0]:g} s; "
                             "expected a time-ordered trace")
        if steps and t == steps[-1][0]:
            steps[-1] = (t, count)  # the step's new value replaces the old one at the same time
        else:
            steps.append((t, count))
    if not steps:
        raise TraceError(f"{source}:1: empty trace; expected {_EXPECTED['counts']} lines")
    return Trace(tuple(events_from_counts(steps)), end_s=steps[-1][0], source=source, format="counts")


def _parse_events(text: str, source: str) -> Trace:
    builder = _EventBuilder()
    for lineno, line in _data_lines(text, header_fields=3):
        where = f"{source}:{lineno}"
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{where}: {len(parts)} fields in {line!r}; expected {_EXPECTED['events']}")
        t = _time(parts[0], where, line, "events") / 1000.0
        if parts[1] not in ACTIONS:
            raise TraceError(f"{where}: action {parts[1]!r} in {line!r}; expected {_EXPECTED['events']}")
        if not parts[2] or any(ch.isspace() for ch in parts[2]):
            raise TraceError(f"{where}: node name {parts[2]!r} in {line!r}; expected {_EXPECTED['events']}")
        builder.push(where, t, parts[1], parts[2])
    return builder.trace(source, "events")


def _parse_jsonl(text: str, source: str) -> Trace:
    builder = _EventBuilder()
    for lineno, line in _data_lines(text):
        where = f"{source}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: invalid JSON ({e.msg}) in {line!r}; "
                             f"expected {_EXPECTED['jsonl']}") from None
        ok = (isinstance(row, list) and len(row) == 3 and _is_number(row[0]) and row[1] in ACTIONS
              and isinstance(row[2], dict) and isinstance(row[2].get("nodes"), list)
              and all(isinstance(n, str) and n and not any(c.isspace() for c in n) for n in row[2]["nodes"]))
        if not ok:
            raise TraceError(f"{where}: got {line!r}; expected {_EXPECTED['jsonl']}")
        t = _time(row[0], where, line, "jsonl") / 1000.0
        for node in row[2]["nodes"]:
            builder.push(where, t, row[1], node)
    return builder.trace(source, "jsonl")


def _parse_skypilot(text: str, source: str) -> Trace:
    expected = _EXPECTED["skypilot"]
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{source}:{e.lineno}: invalid JSON ({e.msg}); expected {expected}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict) or "data" not in doc:
        raise TraceError(f"{source}:1: no 'metadata' object or no 'data' list; expected {expected}")
    meta, data = doc["metadata"], doc["data"]
    gap = meta.get("gap_seconds")
    if not (_is_number(gap) and math.isfinite(gap) and gap > 0):
        where = f"{source}:{_line_of_key(text, 'gap_seconds' if 'gap_seconds' in meta else 'metadata')}"
        raise TraceError(f"{where}: metadata.gap_seconds is {gap!r}; "
                         f"expected a number of seconds > 0 in {expected}")
    price = meta.get("spot_price")
    if price is not None and not (_is_number(price) and math.isfinite(price) and price >= 0):
        raise TraceError(f"{source}:{_line_of_key(text, 'spot_price')}: metadata.spot_price is {price!r}; "
                         "expected a $/GPU-hour >= 0")
    if not isinstance(data, list) or not data:
        raise TraceError(f"{source}:{_line_of_key(text, 'data')}: 'data' is {data!r}; expected a non-empty "
                         f"list of counts in {expected}")
    for i, c in enumerate(data):
        if not (isinstance(c, int) and not isinstance(c, bool) and c >= 0):
            lines = _element_lines(text)
            lineno = lines[i] if i < len(lines) else _line_of_key(text, "data")
            raise TraceError(f"{source}:{lineno}: data[{i}] is {c!r}; expected a whole instance count >= 0")
    steps = [(i * float(gap), c) for i, c in enumerate(data)]
    return Trace(tuple(events_from_counts(steps)), end_s=len(data) * float(gap), source=source,
                 format="skypilot", spot_price=None if price is None else float(price))


_PARSERS = {"counts": _parse_counts, "events": _parse_events, "jsonl": _parse_jsonl,
            "skypilot": _parse_skypilot}


# --- helpers ---------------------------------------------------------------------------------------
class _EventBuilder:
    """Checks one event at a time (ordered, no double add, no removal of an absent node): the one
    definition of a well-formed event list, used by the parsers (with line numbers) and by `Trace`."""

    def __init__(self) -> None:
        self.events: list[CapacityEvent] = []
        self.present: set[str] = set()

    def push(self, where: str, time_s: float, action: str, node: str) -> None:
        if not (isinstance(time_s, (int, float)) and math.isfinite(time_s) and time_s >= 0):
            raise TraceError(f"{where}: time {time_s!r}; expected a finite time >= 0")
        if self.events and time_s < self.events[-1].time_s:
            raise TraceError(f"{where}: time {time_s:g} s is before the previous event's "
                             f"{self.events[-1].time_s:g} s; expected a time-ordered trace")
        if action == "add" and node in self.present:
            raise TraceError(f"{where}: node {node!r} is added while already present; "
                             "expected a removal first")
        if action == "remove" and node not in self.present:
            raise TraceError(f"{where}: node {node!r} is removed but is not present; "
                             "expected an addition first")
        if action not in ACTIONS:
            raise TraceError(f"{where}: action {action!r}; expected 'add' or 'remove'")
        (self.present.add if action == "add" else self.present.discard)(node)
        self.events.append(CapacityEvent(float(time_s), action, node))

    def trace(self, source: str, format: str) -> Trace:
        if not self.events:
            raise TraceError(f"{source}:1: empty trace; expected {_EXPECTED[format]} lines")
        return Trace(tuple(self.events), end_s=self.events[-1].time_s, source=source, format=format)


def _steps_of(events: Iterable[CapacityEvent]) -> Iterator[tuple[float, int]]:
    steps: list[tuple[float, int]] = [(0.0, 0)]
    n = 0
    for e in events:
        n += 1 if e.action == "add" else -1
        if e.time_s == steps[-1][0]:
            steps[-1] = (e.time_s, n)
        else:
            steps.append((e.time_s, n))
    last = None
    for t, c in steps:
        if c != last:
            yield t, c
            last = c


def _data_lines(text: str, header_fields: int | None = None) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of every line that is not blank or a comment; with
    ``header_fields``, a first line of that many bare words is a header and skipped."""
    first = True
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if first and header_fields:
            first = False
            words = [w.strip() for w in line.split(",")]
            if len(words) == header_fields and all(_HEADER.match(w) for w in words):
                continue
        first = False
        yield lineno, line


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _time(raw: object, where: str, line: str, format: str) -> float:
    try:
        t = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t >= 0):
        raise TraceError(f"{where}: time {raw!r} in {line!r}; expected {_EXPECTED[format]}")
    return t


def _count(raw: str, where: str, line: str, format: str) -> int:
    try:
        c = int(raw)
    except ValueError:
        c = -1
    if c < 0:
        raise TraceError(f"{where}: count {raw!r} in {line!r}; expected {_EXPECTED[format]}")
    return c


def _line_of_key(text: str, key: str) -> int:
    pos = text.find(f'"{key}"')
    return text.count("\n", 0, pos) + 1 if pos >= 0 else 1


def _element_lines(text: str) -> list[int]:
    """The line of each element of the top-level "data" array (only needed to point at a bad one)."""
    m = re.search(r'"data"\s*:\s*\[', text)
    if not m:
        return []
    decoder, pos, lines = json.JSONDecoder(), m.end(), []
    try:
        while True:
            while text[pos] in " \t\r\n,":
                pos += 1
            if text[pos] == "]":
                return lines
            lines.append(text.count("\n", 0, pos) + 1)
            _, pos = decoder.raw_decode(text, pos)
    except (IndexError, ValueError):
        return lines
