"""The spot plots of a run: capacity over time with preemption marks, and reward against cost.

``plot_spot(events, records, path)``: ``events`` are ``SpotAccount.events`` (each join, leave
and lost node, in run seconds), ``records`` the run's metrics records (iteration records carry
``cost_usd`` once the runtime's hook ran). Left: spot nodes present over time (a step line), a red
cross at each preemption (a node taken away by the injector or found dead), iteration ends as
ticks. Right: reward (rollout mean) against dollars spent so far. Knows matplotlib and these two
record shapes only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def capacity_series(events: list[dict[str, Any]], kind: str = "spot") -> tuple[list[float], list[int]]:
    """(times, nodes of ``kind`` present from then on) from join/leave/lost events."""
    times, counts, n = [0.0], [0], 0
    for e in events:
        if e["kind"] != kind:
            continue
        n += 1 if e["event"] == "join" else -1
        times.append(e["t"])
        counts.append(n)
    return times, counts


def plot_spot(events: list[dict[str, Any]], records: list[dict[str, Any]], path: Path,
              label: str | None = None) -> None:
    """Write the two panels to ``path`` (PNG); an event with ``preempted`` true is a preemption.
    ``label`` (e.g. "sim") prefixes both titles; records without ``reward_mean`` (a simulated run)
    get cost against run seconds in the right panel instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cap, cost) = plt.subplots(1, 2, figsize=(11, 3.6))
    times, counts = capacity_series(events)
    end = max([times[-1], *(r.get("spot_elapsed_s", 0.0) for r in records)])
    cap.step([*times, end], [*counts, counts[-1]], where="post", color="tab:blue", label="spot nodes")
    marks = [e for e in events if e["kind"] == "spot" and e.get("preempted")]
    at = {t: c for t, c in zip(times, counts)}
    cap.scatter([e["t"] for e in marks], [at.get(e["t"], 0) for e in marks], marker="x", color="tab:red",
                zorder=3, label=f"preemption ({len(marks)})")
    ends = [r["spot_elapsed_s"] for r in records if "spot_elapsed_s" in r]
    cap.plot(ends, [-0.15] * len(ends), "|", color="gray", label="iteration ends")
    cap.set_xlabel("run seconds")
    cap.set_ylabel("spot nodes present")
    prefix = f"{label}: " if label else ""
    cap.set_title(f"{prefix}spot capacity")
    cap.legend(loc="upper right", fontsize=8)
    iters = [r for r in records if r.get("event") == "iteration" and "cost_usd" in r]
    if all("reward_mean" in r for r in iters):
        cost.plot([r["cost_usd"] for r in iters], [r["reward_mean"] for r in iters], marker=".",
                  color="tab:green")
        cost.set_xlabel("cost so far ($)")
        cost.set_ylabel("rollout reward (mean)")
        cost.set_title(f"{prefix}reward against cost")
    else:
        cost.plot([r.get("spot_elapsed_s", 0.0) for r in iters], [r["cost_usd"] for r in iters], marker=".",
                  color="tab:green")
        cost.set_xlabel("run seconds")
        cost.set_ylabel("cost so far ($)")
        cost.set_title(f"{prefix}cost (rewards not simulated)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
