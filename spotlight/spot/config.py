"""The recipe's ``[spot]`` section: where spot capacity comes from, how it is replayed onto a run,
how nodes are taken away, and what GPUs cost.

    [spot]
    trace = "../shared/traces/aws-g4dn-xlarge-us-east-1c-2020-11-20.csv"  # or "synthetic", or unset
    trace_hour_s = 2.5           # 1 trace hour = 2.5 run seconds
    nodes = "proportional"       # 12 trace instances -> 3 local spot nodes at factor 0.25
    factor = 0.25
    cloud = "aws"                # spot notice 120 s before the kill (gcp: 30 s), scaled like the trace
    hard_kill_fraction = 0.2     # a fifth of the removals are SIGKILLs with no notice
    reserved_usd_per_gpu_hour = 4.10

    [spot.synthetic]             # when trace = "synthetic"
    seed = 3
    preemption_rate = 0.5

``SpotConfig`` is flat except for its ``synthetic`` table; the pieces it configures keep their own
small configs (``ReplayConfig``, ``CostConfig``, ``SyntheticConfig``), built from it by
``replay_config()``, ``cost_config()`` and ``synthetic``, so their defaults are written once.
Every impossible value raises one ``ConfigError`` naming the field. ``spot_replay`` reads (or
draws) the trace: a bad trace is one ``TraceError`` line before anything is started.

Knows configuration only; the injector and the runtime act on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotlight.errors import ConfigError
from spotlight.sections import section
from spotlight.spot.cost import CostConfig
from spotlight.spot.replay import Replay, ReplayConfig
from spotlight.spot.synthetic import SyntheticConfig, synthetic_trace
from spotlight.spot.traces import FORMATS, read_trace

_REPLAY, _COST = ReplayConfig(), CostConfig()  # the components' own defaults, not a copy

NOTICE_S = {"aws": 120.0, "gcp": 30.0}
"""A cloud's spot warning in (trace) seconds: AWS two minutes, GCP thirty seconds."""
NOTICE_VIA = ("sigterm", "metadata")


@dataclass(kw_only=True, slots=True)
class SpotConfig:
    """Spot capacity of one run (recipe section ``[spot]``)."""

    trace: str | None = None
    """A trace file (any of spotlight.spot.traces.FORMATS), "synthetic" (``[spot.synthetic]``), or
    unset: no replay, the run keeps ``runtime.spot_workers`` local spot workers throughout."""
    format: str | None = None
    """The trace's format when its content is ambiguous (counts, events, jsonl, skypilot)."""
    trace_hour_s: float = _REPLAY.trace_hour_s
    """Run seconds one trace hour takes (60: 1 trace hour = 1 run minute), > 0."""
    start_s: float = _REPLAY.start_s
    """Trace second the replay starts from (skip an empty prefix), >= 0."""
    nodes: str = _REPLAY.nodes
    """Trace count -> local spot nodes: "cap" (min(count, max_nodes)) or "proportional"."""
    max_nodes: int = _REPLAY.max_nodes
    """Local spot nodes at most under nodes = "cap", >= 1."""
    factor: float = _REPLAY.factor
    """Local nodes per trace node under nodes = "proportional", > 0."""
    workers_per_node: int = 1
    """Worker processes (GPUs) of each local spot node the replay starts, >= 1."""
    cloud: str = "aws"
    """Whose spot notice: "aws" (120 s warning) or "gcp" (30 s), scaled with the trace."""
    notice_s: float | None = None
    """The warning in trace seconds, overriding the cloud's; 0 = every removal is a hard kill."""
    notice_via: str = "sigterm"
    """How the notice reaches an agent: "sigterm" (what cloud agents deliver) or "metadata" (a
    local endpoint in the cloud's form that the agent polls)."""
    hard_kill_fraction: float = 0.0
    """Share of removals that are a SIGKILL with no notice at all, in [0, 1]."""
    seed: int = 0
    """Seed of the injector's draws (which removals are hard kills)."""
    reserved_usd_per_gpu_hour: float = _COST.reserved_usd_per_gpu_hour
    """On-demand $/GPU-hour of reserved GPUs, >= 0."""
    spot_usd_per_gpu_hour: float | None = _COST.spot_usd_per_gpu_hour
    """Spot $/GPU-hour, >= 0; unset = the trace's price, else spot_fraction x reserved."""
    spot_fraction: float = _COST.spot_fraction
    """Spot price as a share of reserved when nothing names one, in (0, 1] (default 0.3)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The seeded generator's parameters (table ``[spot.synthetic]``) when trace = "synthetic"."""

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(f"spot.format must be one of {', '.join(FORMATS)} or unset, "
                              f"got {self.format!r}")
        if self.workers_per_node < 1:
            raise ConfigError(f"spot.workers_per_node must be >= 1, got {self.workers_per_node}")
        if self.cloud not in NOTICE_S:
            raise ConfigError(f"spot.cloud must be one of {', '.join(NOTICE_S)}, got {self.cloud!r}")
        if self.notice_s is not None and not (math.isfinite(self.notice_s) and self.notice_s >= 0):
            raise ConfigError(f"spot.notice_s must be a finite number of trace seconds >= 0 or unset, "
                              f"got {self.notice_s}")
        if self.notice_via not in NOTICE_VIA:
            raise ConfigError(f"spot.notice_via must be one of {', '.join(NOTICE_VIA)}, "
                              f"got {self.notice_via!r}")
        if not (math.isfinite(self.hard_kill_fraction) and 0 <= self.hard_kill_fraction <= 1):
            raise ConfigError(f"spot.hard_kill_fraction must be in [0, 1], got {self.hard_kill_fraction}")
        self.replay_config()  # the replay's and the cost's own checks, named spot.<field>
        self.cost_config()

    # --- the pieces' configs ---------------------------------------------------------------------
    def replay_config(self) -> ReplayConfig:
        return ReplayConfig(trace_hour_s=self.trace_hour_s, start_s=self.start_s, nodes=self.nodes,
                            max_nodes=self.max_nodes, factor=self.factor)

    def cost_config(self) -> CostConfig:
        return CostConfig(reserved_usd_per_gpu_hour=self.reserved_usd_per_gpu_hour,
                          spot_usd_per_gpu_hour=self.spot_usd_per_gpu_hour, spot_fraction=self.spot_fraction)

    @property
    def warning_s(self) -> float:
        """The spot warning in trace seconds (``notice_s``, else the cloud's)."""
        return NOTICE_S[self.cloud] if self.notice_s is None else self.notice_s

    # --- recipe table form -----------------------------------------------------------------------
    @classmethod
    def from_table(cls, values: dict[str, Any]) -> SpotConfig:
        """From ``[spot]`` (its ``synthetic`` sub-table, or ``synthetic.x`` override keys, included)."""
        own, synth = {}, {}
        for key, value in values.items():
            if key == "synthetic":
                if not isinstance(value, dict):
                    raise ConfigError("[spot.synthetic] must be a table")
                synth.update(value)
            elif key.startswith("synthetic."):
                synth[key.removeprefix("synthetic.")] = value
            else:
                own[key] = value
        config = section("spot", _Flat, own)
        return cls(**dataclasses.asdict(config), synthetic=section("spot.synthetic", SyntheticConfig, synth))

    def to_table(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_Flat = dataclasses.make_dataclass(  # SpotConfig's scalar fields, for the recipe's per-field checks
    "_Flat", [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(SpotConfig)
              if f.name != "synthetic"], kw_only=True)
_Flat.__module__ = __name__


def spot_replay(config: SpotConfig, base: Path | None = None) -> Replay | None:
    """The run's replay: the trace read (a relative path from ``base``, else the working folder)
    or drawn, mapped by the config's rules; None when ``config.trace`` is unset."""
    if config.trace is None:
        return None
    if config.trace == "synthetic":
        trace = synthetic_trace(config.synthetic)
    else:
        path = Path(config.trace)
        if not path.is_absolute() and base is not None and not path.exists():
            path = base / path
        if not path.is_file():
            raise ConfigError(f"spot.trace: no such file {config.trace!r}")
        trace = read_trace(path, config.format)
    return Replay(trace, config.replay_config())
