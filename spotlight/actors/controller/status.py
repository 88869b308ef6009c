"""``spotlight status``: ask a running reserved side's controller for the fleet's state over its
(authenticated) socket, and print it for an operator.

``fetch_status`` is one ``FleetStatus`` round trip: with a keys folder it authenticates as a spot
node or the reserved node would (``cluster_client_keys``). A CURVE server never answers a client
whose key it does not accept, and nothing answers where nothing listens, so both end as one
``ActorTimeout`` line after ``timeout`` seconds naming the two causes. ``format_status`` renders
the reply as text. This module knows the status message only; the controller builds the reply
(``ControllerCore.status``).
"""

from __future__ import annotations

import time
from typing import Any

from spotlight.comm import messages as m
from spotlight.comm.auth import cluster_client_keys
from spotlight.comm.transport import RpcClient
from spotlight.errors import ActorTimeout, ConfigError


async def fetch_status(endpoint: str, *, keys: str | None, timeout: float) -> m.FleetStatusReply:
    """The controller at ``endpoint``'s ``FleetStatusReply``; ``ActorTimeout`` (one line) when
    nothing answers within ``timeout`` seconds."""
    if not endpoint.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"--controller must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    if timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {timeout}")
    curve = cluster_client_keys(keys) if keys else None
    try:
        async with RpcClient(endpoint, timeout=timeout, curve=curve) as rpc:
            reply = await rpc.call(m.FleetStatus())
    except ActorTimeout:
        why = "it does not accept the keys in " + keys if keys else "it wants CURVE keys (--keys DIR)"
        raise ActorTimeout(f"no answer from {endpoint} within {timeout:g} s: nothing listening there, "
                           f"or {why}") from None
    if not isinstance(reply, m.FleetStatusReply):
        raise ConfigError(f"{endpoint} answered {type(reply).__name__}: it is not a Spotlight controller")
    return reply


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(s: m.FleetStatusReply, endpoint: str, now: float | None = None) -> str:
    """The reply as an operator reads it: run and phase, cost, queue, then one row per node."""
    now = time.time() if now is None else now
    p, c, q = s.progress, s.cost, s.queue
    it = "-" if p.get("iteration") is None else p["iteration"]
    version = "" if p.get("version") is None else f", weights v{p['version']}"
    since = f" for {_ago(now - p['since'])}" if p.get("since") else ""
    phase = p.get("phase", "?")
    lines = [f"run {s.run} at {endpoint} (epoch {s.epoch}): iteration {it}, {phase}{since}{version}"]
    if c:
        gpu_s = c.get("gpu_s_reserved", 0.0) + c.get("gpu_s_spot", 0.0)
        lines.append(
            f"cost so far: ${c.get('cost_usd', 0.0):.4f} (spot ${c.get('cost_usd_spot', 0.0):.4f}), "
            f"{gpu_s:.0f} GPU-s; spot nodes {c.get('spot_nodes', 0)}, preemptions {c.get('preemptions', 0)}, "
            f"nodes lost {c.get('nodes_lost', 0)}, steps lost {c.get('steps_lost', 0)}")
    if q:
        requeued = q.get("expired", 0) + q.get("node_lost_requeued", 0) + q.get("released", 0)
        lines.append(f"queue: {q.get('now_queued', 0)} queued, {q.get('now_leased', 0)} leased (in flight); "
                     f"{q.get('completed', 0)} of {q.get('submitted', 0)} requests completed, "
                     f"{requeued} leases returned (released, expired, node lost), "
                     f"{q.get('cancelled', 0)} cancelled, {q.get('dead', 0)} dead-lettered")
    else:
        lines.append("queue: no answer from the queue")
    workers = sum(n["workers"] for n in s.nodes)
    groups = sum(n["sp_groups"] for n in s.nodes)
    kinds = {k: sum(n["kind"] == k for n in s.nodes) for k in ("reserved", "spot")}
    lines.append(f"nodes: {len(s.nodes)} ({kinds['reserved']} reserved, {kinds['spot']} spot), "
                 f"{workers} workers, {groups} SP groups of {s.sp_degree}; {s.left} gone so far")
    if s.nodes:
        rows: list[list[Any]] = [["NODE", "KIND", "WORKERS", "SP GROUPS", "UP", "LAST BEAT"]]
        rows += [[n["node_id"], n["kind"], str(n["workers"]), str(n["sp_groups"]), _ago(n["up_s"]),
                  f"{_ago(n['beat_s'])} ago"] for n in s.nodes]
        lines += _table(rows)
    return "\n".join(lines)
