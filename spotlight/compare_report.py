"""What `spotlight compare` writes: the markdown table and one self-contained HTML page.

``markdown_table(result)``: per reported system, iterations, hours and dollars to the target (mean
± the 95% t-interval's half width over seeds, or "not reached (k/n seeds)"), the ratios of
reserved_only's and naive_spot's means to the system's (> 1: the system needs less), and its seconds
by where they went (``spotlight.compare.breakdown``), every heading labelled with where the seconds
and dollars come from (sim or runtime). ``write_outputs(result, out)`` writes ``compare.json``,
``compare.md`` and ``compare.html``: reward against dollars and against hours per system (mean
over seeds, the band their range), the spot capacity each spot system had under the trace, and the
time breakdown, each figure titled sim or runtime.

Knows a ``CompareResult``; nothing of how its runs were made.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from spotlight.compare import BASELINES, CompareResult

_PARTS = ("rollout", "exploration (critical path)", "training", "waiting for capacity", "lost to preemption")


def _num(x: float, digits: int) -> str:
    """``digits`` decimals, or 3 significant digits for a number too small to show them."""
    return f"{x:.{digits}f}" if abs(x) >= 10 ** (2 - digits) or x == 0 else f"{x:.3g}"


def _fmt(stats: dict[str, Any], digits: int) -> str:
    if "mean" not in stats:
        return f"not reached ({stats['reached']}/{stats['n']} seeds)"
    half = "" if stats["half"] is None else f" ± {_num(stats['half'], digits)}"
    return f"{_num(stats['mean'], digits)}{half}"


def _ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def markdown_table(result: CompareResult) -> str:
    c = result.config
    label = c.label
    n = len(c.seeds)
    lines = [
        f"task `{c.task}`, base (held-out ODE) " + ", ".join(f"{b:.4f}" for b in result.bases.values())
        + f", target ({c.target}) " + ", ".join(f"{t:.4f}" for t in result.targets.values())
        + f" at seed{'s' * (n > 1)} {', '.join(map(str, c.seeds))}; {c.iterations} iterations, "
        f"eval every {c.eval_every}; seconds and dollars: **{label}**"
        + (f"; trace {c.trace} from {c.trace_start_s:g} s" if c.trace else "")
        + ("" if result.mean_spot_gpus is None else f"; mean spot GPUs under it {result.mean_spot_gpus:.1f}"),
        "",
        "| system | iterations to target | hours to target (" + label + ") | $ to target (" + label + ") | "
        + " | ".join(f"$ vs {b} | h vs {b}" for b in BASELINES) + " |",
        "| --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in BASELINES) + " |",
    ]
    for system in result.rows:
        cells = [system, _fmt(result.stats(system, "iteration"), 1), _fmt(result.stats(system, "hours"), 2),
                 _fmt(result.stats(system, "dollars"), 0)]
        for b in BASELINES:
            cells += [_ratio(result.ratio(system, b, "dollars")), _ratio(result.ratio(system, b, "hours"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Where the seconds went up to the target (or the end when not reached), mean over seeds, "
                  f"hours ({label}):", "",
              "| system | " + " | ".join(_PARTS) + " | GPU-h reserved | GPU-h spot |",
              "| --- | " + " | ".join("---" for _ in _PARTS) + " | --- | --- |"]
    for system, runs in result.rows.items():
        parts = [sum(r.breakdown[p] for r in runs) / len(runs) / 3600 for p in _PARTS]
        res = sum(r.bill["gpu_s_reserved"] for r in runs) / len(runs) / 3600
        spot = sum(r.bill["gpu_s_spot"] for r in runs) / len(runs) / 3600
        cells = [f"{x:.3g}" for x in parts] + [f"{res:.3g}", f"{spot:.3g}"]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    if result.notes:
        lines += ["", *[f"- {note}" for note in result.notes]]
    return "\n".join(lines) + "\n"


# --- figures ---------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig) -> str:
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="plot" src="data:image/svg+xml;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def reward_plot(result: CompareResult, x: str) -> str:
    """Held-out score against ``x`` ("dollars" or "hours") per system: the mean over seeds at each
    evaluation, the band the seeds' range."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for system, runs in result.rows.items():
        evals = len(runs[0].curve)
        xs = [sum(r.curve[i][x] for r in runs) / len(runs) for i in range(evals)]
        ys = [[r.curve[i]["score"] for r in runs] for i in range(evals)]
        ax.plot(xs, [sum(v) / len(v) for v in ys], marker="o", ms=3, label=system)
        ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], alpha=0.15)
    ax.axhline(result.target, color="k", ls="--", lw=0.8, label=f"target {result.target:.3f} (seeds' mean)")
    ax.set_xlabel(f"{'$' if x == 'dollars' else 'hours'} ({result.config.label})")
    ax.set_ylabel("held-out ODE score")
    ax.set_title(f"reward against {x} — {result.config.label}")
    ax.legend(fontsize=7)
    return _svg(fig)


def capacity_plot(result: CompareResult) -> str | None:
    """Spot GPUs present against hours in each spot system's timing run."""
    spot = {s: t for s, t in result.timing.items() if t.get("spot")}
    if not spot:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    for system, t in spot.items():
        recs = t["records"]
        ax.step([r["sim_s"] / 3600 for r in recs], [r["spot_gpus"] for r in recs], where="post", label=system)
    ax.set_xlabel(f"hours ({result.config.label})")
    ax.set_ylabel("spot GPUs at iteration end")
    ax.set_title(f"spot capacity under the trace — {result.config.label}")
    ax.legend(fontsize=7)
    return _svg(fig)


def breakdown_plot(result: CompareResult) -> str:
    """Stacked hours by where they went, per system (mean over seeds, up to the target or the end)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.5 * len(result.rows)))
    names = list(result.rows)
    left = [0.0] * len(names)
    for part in _PARTS:
        vals = [sum(r.breakdown[part] for r in result.rows[s]) / len(result.rows[s]) / 3600 for s in names]
        ax.barh(names, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel(f"hours ({result.config.label})")
    ax.set_title(f"where the time went, to the target or the end — {result.config.label}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.invert_yaxis()
    return _svg(fig)


def page(result: CompareResult) -> str:
    table = html.escape(markdown_table(result))
    figs = [reward_plot(result, "dollars"), reward_plot(result, "hours"), capacity_plot(result),
            breakdown_plot(result)]
    c = result.config
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>spotlight compare: "
        f"{html.escape(c.task)}</title><style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}"
        "pre{white-space:pre-wrap;font-size:0.85em} img{max-width:100%}</style></head><body>"
        f"<h1>Cost to target: {html.escape(c.task)} — {html.escape(c.label)}</h1>"
        f"<pre>{table}</pre>" + "".join(f"<p>{f}</p>" for f in figs if f) + "</body></html>\n")


def write_outputs(result: CompareResult, out: Path) -> None:
    """``compare.json``, ``compare.md`` and ``compare.html`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    (out / "compare.md").write_text(markdown_table(result))
    (out / "compare.html").write_text(page(result))
