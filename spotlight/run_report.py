"""``spotlight report RUN_DIR``: one self-contained HTML page about a run, viewable with no network.

It reads what a run folder holds — ``metrics.jsonl``, ``recipe.json``, ``samples/eval_*.png`` —
and writes ``report.html``: the recipe, the headline evaluation curve with its spreads, the base
and trained sample grids side by side, spot capacity and preemptions over time, reward against
cost, and where each iteration's time went. Every figure is inline (SVG or PNG as a data URI);
the page loads nothing and runs no script. A folder that is not a run is one ``ConfigError`` line.

This module knows the run folder's files and the metrics' field names; it never imports the
loop, the model or the runtime.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from spotlight.errors import ConfigError
from spotlight.report import EVAL_CURVES, MetricsLog

PHASES = (("explore_s", "exploration wait"), ("rollout_s", "rollout"), ("train_s", "training update"),
          ("check_s", "rank check"))

CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.headline{font-size:1.15em} .muted{color:#777} figure{margin:1em 0} img.plot{max-width:100%}
.grids{display:flex;gap:1.5em;flex-wrap:wrap} .grids figure{flex:1;min-width:280px}
.grids img{width:100%;max-width:460px;image-rendering:pixelated}
pre{background:#f6f6f6;padding:1em;overflow:auto}
table{border-collapse:collapse} td,th{padding:.2em .8em;text-align:right;border-bottom:1px solid #eee}
"""


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The run's metrics records and its recipe (None when the run did not record one)."""
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run folder: it does not exist")
    if not metrics.is_file():
        raise ConfigError(f"{run_dir} is not a run folder: no metrics.jsonl "
                          "(`spotlight run RECIPE` writes one)")
    try:
        records = MetricsLog(metrics).read()
    except json.JSONDecodeError as e:
        raise ConfigError(f"{metrics} is not a metrics log: line {e.lineno} is not JSON") from None
    if not any(isinstance(r, dict) and r.get("event") in ("eval", "iteration") for r in records):
        raise ConfigError(f"{run_dir} is not a run folder: {metrics.name} holds no iteration or evaluation")
    recipe_path = run_dir / "recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else None
    return records, recipe


def _figure(fig) -> str:
    """A matplotlib figure as an <img> with an SVG data URI (closed afterwards)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img class="plot" alt="plot" src="data:image/svg+xml;base64,{data}">'


def _png(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img class="grid" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def eval_curve(evals: list[dict]) -> str | None:
    """Held-out ODE (headline) and the other suites against iteration, mean ± spread."""
    curves = [(k, label) for k, label in EVAL_CURVES if any(k in r for r in evals)]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for key, label in curves:
        ev = [r for r in evals if key in r]
        x = [r["iteration"] for r in ev]
        mean = [r[key] for r in ev]
        spread = [r.get(f"{key}_std", 0.0) for r in ev]
        ax.plot(x, mean, "o-", lw=2.5 if key == "eval_ode_heldout" else 1.2, label=label)
        low, high = [m - s for m, s in zip(mean, spread)], [m + s for m, s in zip(mean, spread)]
        ax.fill_between(x, low, high, alpha=0.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward (mean ± spread over seed sets)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _figure(fig)


def capacity_plot(its: list[dict]) -> str | None:
    """Spot nodes present at each iteration's end, and preemptions so far, against run time."""
    spot = [r for r in its if "spot_nodes" in r]
    if not spot:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    t = [r.get("spot_elapsed_s", r["wall_s"]) for r in spot]
    ax.step(t, [r["spot_nodes"] for r in spot], where="post", label="spot nodes")
    ax.set_xlabel("run seconds")
    ax.set_ylabel("spot nodes")
    twin = ax.twinx()
    twin.plot(t, [r.get("preemptions", 0) for r in spot], color="tab:red", label="preemptions so far")
    twin.set_ylabel("preemptions so far", color="tab:red")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _figure(fig)


def cost_plot(its: list[dict], evals: list[dict]) -> str | None:
    """Rollout reward (and the held-out evaluation where it fell) against dollars spent so far."""
    costed = [r for r in its if "cost_usd" in r]
    if not costed:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot([r["cost_usd"] for r in costed], [r["reward_mean"] for r in costed], ".-", alpha=0.6,
            label="rollout reward")
    at = {r["iteration"] + 1: r["cost_usd"] for r in costed}  # eval at k follows iteration k-1
    ev = [(at[e["iteration"]], e["eval_ode_heldout"]) for e in evals
          if e["iteration"] in at and "eval_ode_heldout" in e]
    if ev:
        ax.plot(*zip(*ev), "o-", lw=2, label="held-out ODE evaluation")
    ax.set_xlabel("cost so far ($)")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _figure(fig)


def time_plot(its: list[dict]) -> str | None:
    """Each iteration's wall time, stacked by phase (the remainder is bookkeeping)."""
    if not its:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = [r["iteration"] for r in its]
    bottom = [0.0] * len(its)
    for key, label in PHASES:
        h = [r.get(key, 0.0) for r in its]
        ax.bar(x, h, bottom=bottom, width=1.0, label=label)
        bottom = [b + v for b, v in zip(bottom, h)]
    rest = [max(0.0, r.get("iteration_s", b) - b) for r, b in zip(its, bottom)]
    ax.bar(x, rest, bottom=bottom, width=1.0, label="other", color="#bbb")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, ncol=5)
    return _figure(fig)


def _recipe_text(recipe: dict[str, Any]) -> str:
    lines = []
    for section, fields in recipe.items():
        if not isinstance(fields, dict):
            lines.append(f"{section} = {json.dumps(fields)}")
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
        lines.append("")
    return "\n".join(lines)


def _headline(evals: list[dict], its: list[dict]) -> str:
    key = "eval_ode_heldout" if any("eval_ode_heldout" in e for e in evals) else "eval_reward"
    ev = [e for e in evals if key in e]
    parts = []
    if ev:
        first, last = ev[0], ev[-1]
        parts.append(f"held-out ODE reward {first[key]:.3f} ± {first.get(key + '_std', 0):.3f} at iteration "
                     f"{first['iteration']} → <b>{last[key]:.3f} ± {last.get(key + '_std', 0):.3f}</b> at "
                     f"{last['iteration']} ({last[key] - first[key]:+.3f})")
    if its:
        parts.append(f"{len(its)} iterations in {its[-1]['wall_s']:.0f} s")
        if "cost_usd" in its[-1]:
            parts.append(f"${its[-1]['cost_usd']:.4f} ({its[-1].get('preemptions', 0)} preemptions)")
    return "; ".join(parts)


def render(run_dir: Path) -> str:
    """The report page of ``run_dir`` as one HTML string."""
    records, recipe = load_run(run_dir)
    evals = [r for r in records if r.get("event") == "eval"]
    its = [r for r in records if r.get("event") == "iteration"]
    name = (recipe or {}).get("run", {}).get("name", run_dir.name)
    title = f"Spotlight run {html.escape(name)}"
    out = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title>",
           f"<style>{CSS}</style></head><body>",
           f"<h1>Spotlight run <code>{html.escape(name)}</code></h1>",
           f"<p class=headline>{_headline(evals, its)}</p>"]

    def section(title: str, body: str | None, missing: str) -> None:
        out.append(f"<h2>{title}</h2>")
        out.append(f"<figure>{body}</figure>" if body else f'<p class="muted">{missing}</p>')

    section("Evaluation", eval_curve(evals), "no evaluation recorded")
    grids = sorted((run_dir / "samples").glob("eval_[0-9][0-9][0-9][0-9].png"))
    out.append("<h2>Base and trained samples (held-out prompts, ODE, same seeds)</h2>")
    if len(grids) >= 2:
        out.append('<div class="grids">' + "".join(
            f"<figure>{_png(g, label)}<figcaption>{label}</figcaption></figure>"
            for g, label in ((grids[0], f"base (iteration {int(grids[0].stem[5:])})"),
                             (grids[-1], f"trained (iteration {int(grids[-1].stem[5:])})"))) + "</div>")
    else:
        out.append('<p class="muted">fewer than two evaluations saved sample grids</p>')
    no_spot = "no spot capacity in this run (in-process, or a runtime without spot accounting)"
    section("Spot capacity and preemptions", capacity_plot(its), no_spot)
    section("Reward against cost", cost_plot(its, evals), no_spot)
    section("Where the time went, per iteration", time_plot(its), "no iteration recorded")
    out.append("<h2>Recipe</h2>")
    out.append(f"<pre>{html.escape(_recipe_text(recipe))}</pre>" if recipe else
               '<p class="muted">this run did not record its recipe (recipe.json)</p>')
    out.append("</body></html>")
    return "\n".join(out)


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``render(run_dir)`` to ``out`` (default ``RUN_DIR/report.html``); return the path."""
    page = render(Path(run_dir))
    out = Path(out) if out is not None else Path(run_dir) / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
