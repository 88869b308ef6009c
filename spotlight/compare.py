"""`spotlight compare`: the systems of the literature and Spotlight on the same task, base, seeds,
trace and prices, reported as iterations, hours and dollars to a target held-out score.

    from spotlight.compare import CompareConfig, compare
    result = compare(CompareConfig(task="ocr", systems=("reserved_only", "naive_spot", "spotlight"),
                                   seeds=(0, 1, 2), trace="../shared/traces/aws.csv"))
    print(result.table())

A *system* is a recipe file of ``spotlight/recipes`` (``SYSTEMS``) whose own tables — not its
``extends`` chain — are laid over the *task* recipe (base, reward, prompts, learning settings):
``merge_tables(recipe_tables(task), recipe_tables(system, own=True))``, then the caller's
``overrides``. Every system must state the same prices.

Each (system, seed) is judged by a real RL run on the task, in process, evaluated by the ODE sampler
on held-out prompts every ``eval_every`` iterations (the metrics' ``eval`` records). Systems whose
merged recipes agree on everything learning reads (``learning_key``: the model, sampler, GRPO,
exploration and reward sections, the content of the model's checkpoint file, and the run's
prompts, batch shape, seed and evaluation; the runtime, spot and sim sections and the run's
bookkeeping left out; an ``explore.schedule = "off"``
exploration table reduced to that) share one learning run per seed — the runtime's results are
bit-identical to in-process (tests/integration/test_runtime_equivalence.py) — and the report says
which shared. A learning run whose folder already holds a finished run of the same recipe is
reused (one run further serves a shorter budget, but for the overlap schedule: ``_finished``), so a
second comparison on another trace costs no learning — but for a system with the exploration
planner (``explore.planner``): its learning run explores with the arms its planner chose in its
simulated run (``arm_plan``: the arms it is billed for; this machine's training window, the
in-process planner's budget, fits none), and those follow the trace.

Time and cost per iteration come from ``mode``:

- ``"sim"``: a ``SimRun`` of each system's recipe on the simulated cluster (``profile``, ``gpu``):
  ``trainer_gpus`` reserved trainer GPUs, ``reserved_gpus`` reserved rollout GPUs, and for a spot
  system (``runtime.spot_workers > 0`` in its merged recipe) spot nodes of ``gpus_per_node`` GPUs
  replayed from ``trace`` (from ``trace_start_s``, one trace hour = one simulated hour, one trace
  node = ``node_factor`` nodes). A reserved-only system gets the reserved part plus the mean spot
  GPUs the trace gives over the longest spot system's run as reserved rollout GPUs; it is also
  reported with the reserved part alone (``<name> (reserved part alone)``). The sims run before
  any learning: a trace shorter than a system's simulated run is a ConfigError, nothing learned.
- ``"runtime"``: each (system, seed) is one run of the actor runtime on this machine under the
  trace; learning, seconds and dollars come from that one run (no sharing).

Iterations to target = the first eval record whose ``eval_ode_heldout`` reaches the target, read
from the records; hours and dollars to target = that iteration's cumulative simulated (or real)
seconds and bill. Target: an absolute score, or ``+x`` over the base (the held-out score of the
untrained base, evaluated first, before any RL, once per seed: the evaluation's seed sets derive
from ``run.seed``, so each seed's runs are measured against their own base; a base already at an
absolute target is a ConfigError).
Over seeds: the mean and a 95% t-interval; a system that misses the target in any seed is reported
as not reached (how many seeds reached it), never extrapolated.

Writes ``<out_dir>/compare.json`` (everything the tables and figures are made of), ``compare.md``
and ``compare.html`` (``spotlight.compare_report``); ``learning/`` and ``sim/`` hold the runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotlight.errors import ConfigError
from spotlight.recipe import Recipe, load_recipe, merge_tables, recipe_tables

SYSTEMS = ("reserved_only", "reserved_best_of_n", "naive_spot", "spotlight_no_explore", "spotlight")
"""The built-in systems, in the report's order (each a recipe of spotlight/recipes)."""
BASELINES = ("reserved_only", "naive_spot")
"""The systems every other one is compared against (ratios), when they are in the comparison."""
MODES = ("sim", "runtime")
_BOOKKEEPING = ("name", "out_dir", "mode", "device", "tensorboard", "checkpoint_every", "minutes",
                "iterations")
_LEARNING_SECTIONS = ("run", "model", "sampler", "grpo", "explore", "reward")
ALONE = " (reserved part alone)"


@dataclass(kw_only=True, slots=True)
class CompareConfig:
    """One comparison (the options of `spotlight compare`)."""

    task: str = "ocr"
    """The task recipe (a built-in name or a path): base, reward, prompts, learning settings."""
    systems: tuple[str, ...] = SYSTEMS
    """Systems compared, names of ``SYSTEMS``."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """``run.seed`` of each system's learning runs (the same for every system)."""
    mode: str = "sim"
    """Where seconds and dollars come from: "sim" (the simulated cluster) or "runtime" (this machine)."""
    target: str = "+0.10"
    """The held-out ODE score to reach: a number, or "+x" = x over the base's."""
    iterations: int = 40
    """RL iterations of every run (the budget)."""
    eval_every: int = 10
    """Iterations between held-out evaluations (the target is met only at one)."""
    trace: str | None = None
    """Spot trace of every spot system (a file, "synthetic", or None: a fixed pool of
    ``fixed_spot_gpus``)."""
    trace_start_s: float = 0.0
    """Trace second the replay starts from (the same offset for every system)."""
    profile: str = "qwen-image-20b"
    """sim: timing profile (spotlight.sim.timing.PROFILES)."""
    gpu: str = "h100"
    """sim: GPU kind of every worker and the trainer."""
    trainer_gpus: int = 8
    """sim: reserved trainer GPUs of every system."""
    reserved_gpus: int = 8
    """sim: reserved rollout GPUs of every system (the reserved part, with the trainer's)."""
    gpus_per_node: int = 8
    """sim: GPUs of each spot node."""
    node_factor: float = 0.5
    """sim: spot nodes per trace node (spot.nodes = "proportional")."""
    fixed_spot_gpus: int = 24
    """sim without a trace: the fixed spot pool of every spot system."""
    overrides: tuple[str, ...] = ()
    """``section.field=value`` for every system's recipe (learning and timing runs)."""
    cluster: tuple[str, ...] = ()
    """``section.field=value`` for the timing runs only (sim or runtime), after compare's own."""
    out_dir: str = "runs/compare"
    learning_dir: str | None = None
    """Where the learning runs live (default ``<out_dir>/learning``): comparisons of the same task
    on other traces pointed at one folder reuse its finished runs."""

    def __post_init__(self) -> None:
        if not self.systems:
            raise ConfigError("compare.systems: name at least one system")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ConfigError(f"compare.systems: unknown system {unknown[0]!r}; known: {', '.join(SYSTEMS)}")
        if len(set(self.systems)) != len(self.systems):
            raise ConfigError(f"compare.systems: a system named twice in {', '.join(self.systems)}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"compare.seeds must be distinct and at least one, got {list(self.seeds)}")
        if self.mode not in MODES:
            raise ConfigError(f"compare.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        parse_target(self.target)
        for name in ("iterations", "eval_every", "trainer_gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"compare.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("reserved_gpus", "fixed_spot_gpus"):
            if getattr(self, name) < 0:
                raise ConfigError(f"compare.{name} must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.node_factor) and self.node_factor > 0):
            raise ConfigError(f"compare.node_factor must be > 0, got {self.node_factor}")
        if not (math.isfinite(self.trace_start_s) and self.trace_start_s >= 0):
            raise ConfigError(f"compare.trace_start_s must be >= 0, got {self.trace_start_s}")

    @property
    def label(self) -> str:
        """What every figure's seconds and dollars come from."""
        return f"sim ({self.profile}, {self.gpu})" if self.mode == "sim" else "runtime (this machine)"


def parse_target(text: str) -> tuple[str, float]:
    """("rise", x) for "+x", ("absolute", x) for "x"; one ConfigError line otherwise."""
    s = str(text).strip()
    try:
        value = float(s[1:] if s.startswith("+") else s)
    except ValueError:
        raise ConfigError(f"compare.target must be a score or +rise over the base, got {text!r}") from None
    if not math.isfinite(value) or (s.startswith("+") and value <= 0):
        raise ConfigError(f"compare.target must be a finite score or a rise > 0, got {text!r}")
    return ("rise" if s.startswith("+") else "absolute"), value


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` (at least one) and the half-width of its 95% t-interval (None for
    a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    from scipy.stats import t

    return mean, float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


# --- recipes ------------------------------------------------------------------------------------
def system_tables(config: CompareConfig, system: str) -> dict[str, Any]:
    """The task recipe with the system's own tables over it (no run name: set per run)."""
    own = recipe_tables(system, own=True)
    own.get("run", {}).pop("name", None)
    return merge_tables(recipe_tables(config.task), own)


def learning_recipe(config: CompareConfig, system: str, seed: int, name: str, out_dir: Path,
                    arm_plan: list[str] | None = None) -> Recipe:
    """The in-process learning run of ``system`` at ``seed`` (its folder: ``out_dir/name``);
    ``arm_plan``: its exploration's arms, given in place of its planner (`arm_plan`)."""
    plan = [] if arm_plan is None else ["explore.planner=false", f"explore.arm_plan={json.dumps(arm_plan)}"]
    return load_recipe(system_tables(config, system), [
        *config.overrides, f"run.seed={seed}", f"run.iterations={config.iterations}",
        f"run.eval_every={config.eval_every}", f"run.checkpoint_every={config.iterations}",
        'run.mode="in-process"', f'run.name="{name}"', f'run.out_dir="{out_dir}"', "run.tensorboard=false",
        "run.minutes=none", *plan])


def arm_plan(records: list[dict[str, Any]]) -> list[str]:
    """The arms a simulated run explored with, one per exploration in iteration order (its records'
    ``explore_arm``). A planner's learning run given them (`learning_recipe`) explores as the run it
    is billed by: the in-process planner would price arms with this machine's seconds, whose
    training window fits none of them."""
    return [r["explore_arm"] for r in records if "explore_arm" in r]


def learning_key(recipe: Recipe) -> str:
    """What learning reads of ``recipe`` (module docstring), as canonical JSON. ``run.iterations``
    is left out: iteration i of a run does not depend on how many follow it, except under
    ``explore.schedule = "overlap"`` at the last one (``_finished`` holds that line)."""
    d = recipe.to_dict()
    out = {k: d[k] for k in _LEARNING_SECTIONS}
    out["run"] = {k: v for k, v in out["run"].items() if k not in _BOOKKEEPING}
    if recipe.model.pipeline is None and recipe.model.checkpoint is not None:
        # a base re-pretrained into the same path (a new builtin:ocr_base) is another learning run
        out["model"] = {**out["model"], "checkpoint_sha256": checkpoint_digest(recipe.model.checkpoint)}
    if out["explore"]["schedule"] == "off":
        out["explore"] = {"schedule": "off"}
    return json.dumps(out, sort_keys=True)


def checkpoint_digest(checkpoint: str) -> str:
    """sha256 of the file a ``model.checkpoint`` names ('builtin:…' resolved); NotFound if none."""
    from spotlight.models.dit import resolve_checkpoint

    path = Path(resolve_checkpoint(checkpoint)).resolve()
    st = path.stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a rewritten file misses
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def is_spot(recipe: Recipe) -> bool:
    """A system that rents spot GPUs (its merged recipe has spot workers)."""
    return recipe.runtime.spot_workers > 0


def _prices(recipe: Recipe) -> tuple[float, float | None, float]:
    s = recipe.spot
    return s.reserved_usd_per_gpu_hour, s.spot_usd_per_gpu_hour, s.spot_fraction


def timing_overrides(config: CompareConfig, spot: bool, reserved_gpus: int) -> list[str]:
    """compare's cluster for a timing run (sim or runtime) of a spot / reserved-only system."""
    out: list[str] = []
    if config.mode == "sim":
        out += ['run.mode="sim"', f'sim.profile="{config.profile}"', f'sim.gpu="{config.gpu}"',
                f"sim.trainer_gpus={config.trainer_gpus}", f"sim.gpus_per_node={config.gpus_per_node}",
                "sim.samples_per_request=1", f"runtime.reserved_workers={reserved_gpus}"]
        if spot and config.trace is None:
            out += [f"sim.spot_gpus={config.fixed_spot_gpus}"]
    else:
        out += ['run.mode="runtime"']
    if spot and config.trace is not None:
        out += [f'spot.trace="{config.trace}"', f"spot.start_s={config.trace_start_s}",
                f"spot.workers_per_node={config.gpus_per_node if config.mode == 'sim' else 1}"]
        if config.mode == "sim":
            out += ["spot.trace_hour_s=3600.0", 'spot.nodes="proportional"',
                    f"spot.factor={config.node_factor}"]
    if not spot:
        out += ["spot.trace=none"]
    return [*out, *config.cluster]


# --- the result -----------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Reach:
    """One (system, seed) run's way to the target."""

    seed: int
    iteration: int | None
    """The first evaluated iteration at or over the target; None: not reached within the budget."""
    hours: float | None
    dollars: float | None
    score: float | None
    """The eval record's held-out score that met the target."""
    final_score: float
    curve: list[dict[str, float]]
    """Per eval record: iteration, score, hours and dollars at it."""
    breakdown: dict[str, float]
    """Seconds by where they went, up to the target (or the run's end when not reached)."""
    bill: dict[str, float]
    """GPU-seconds and dollars per node class at the target (or the end)."""


@dataclass(kw_only=True, slots=True)
class CompareResult:
    config: CompareConfig
    bases: dict[int, float]
    """Per seed, the untrained base's held-out ODE score (evaluated before any RL)."""
    targets: dict[int, float]
    """Per seed, the absolute target score."""
    rows: dict[str, list[Reach]]
    """Per reported system (the reserved-only ones twice): its seeds' runs."""
    shared: dict[str, list[str]]
    """Learning runs shared by systems with the same learning settings: run folder -> systems."""
    learning_runs: dict[str, dict[int, str]]
    """System -> seed -> its learning run's folder."""
    timing: dict[str, dict[str, Any]] = field(default_factory=dict)
    """sim: per reported system, its simulated run (records, account events, injector log)."""
    mean_spot_gpus: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def base(self) -> float:
        """The bases' mean over seeds."""
        return statistics.fmean(self.bases.values())

    @property
    def target(self) -> float:
        """The targets' mean over seeds."""
        return statistics.fmean(self.targets.values())

    # --- summaries --------------------------------------------------------------------------------
    def stats(self, system: str, what: str) -> dict[str, Any]:
        """Mean and 95% t-interval over seeds of "iteration", "hours" or "dollars" to target."""
        runs = self.rows[system]
        vals = [getattr(r, what) for r in runs]
        reached = [v for v in vals if v is not None]
        out: dict[str, Any] = {"n": len(vals), "reached": len(reached)}
        if len(reached) < len(vals) or not vals:
            return out
        mean, half = mean_interval(reached)
        return {**out, "mean": mean, "half": half}

    def ratio(self, system: str, baseline: str, what: str) -> float | None:
        """baseline's mean / system's mean (>1: the system needs less); None when either missed."""
        if baseline not in self.rows:
            return None
        a, b = self.stats(baseline, what), self.stats(system, what)
        if "mean" not in a or "mean" not in b or b["mean"] <= 0:
            return None
        return a["mean"] / b["mean"]

    def table(self) -> str:
        from spotlight.compare_report import markdown_table

        return markdown_table(self)

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "base": self.base, "target": self.target,
                "bases": self.bases, "targets": self.targets,
                "rows": {k: [dataclasses.asdict(r) for r in v] for k, v in self.rows.items()},
                "shared": self.shared, "learning_runs": self.learning_runs, "timing": self.timing,
                "mean_spot_gpus": self.mean_spot_gpus, "notes": self.notes,
                "stats": {k: {w: self.stats(k, w) for w in ("iteration", "hours", "dollars")}
                          for k in self.rows}}


# --- the comparison ---------------------------------------------------------------------------------
def compare(config: CompareConfig, progress: bool = True) -> CompareResult:
    """Run the comparison (module docstring); writes its files under ``config.out_dir``."""
    out = Path(config.out_dir)
    say = print if progress else (lambda *a, **k: None)
    # every recipe first: a bad name, field or price is one line before anything runs
    names = {(s, seed): _run_name(s, seed) for s in config.systems for seed in config.seeds}
    learn_dir = Path(config.learning_dir) if config.learning_dir else out / "learning"
    learn = {(s, seed): learning_recipe(config, s, seed, names[s, seed], learn_dir)
             for seed in config.seeds for s in config.systems}  # seed-major: a cut bench has whole seeds
    merged = {s: load_recipe(system_tables(config, s), list(config.overrides)) for s in config.systems}
    prices = {s: _prices(r) for s, r in merged.items()}
    if len(set(prices.values())) > 1:
        raise ConfigError("compare: the systems' [spot] prices differ: "
                          + "; ".join(f"{s} {p[0]}/{p[1]}" for s, p in prices.items()))
    out.mkdir(parents=True, exist_ok=True)

    timing: dict[str, dict[str, Any]] = {}
    mean_spot = None
    notes: list[str] = []
    plans: dict[str, list[str] | None] = {}
    if config.mode == "sim":
        timing, mean_spot = _simulate_all(config, merged, out / "sim", say)
        notes += _same_trace(timing)
        # a planner's arms are the ones its simulated run chose (and was billed for)
        plans = {s: arm_plan(timing[s]["records"]) if r.explore.enabled and r.explore.planner else None
                 for s, r in merged.items()}
        learn = {(s, seed): learning_recipe(config, s, seed, names[s, seed], learn_dir, plans[s])
                 for (s, seed) in learn}
        for s, plan in plans.items():
            if plan is not None:
                notes.append(f"{s}: its learning runs explore with the arms its planner chose on the "
                             f"simulated cluster ({_plan_summary(plan)})")
    elif config.trace is not None:
        _check_runtime_trace(config, merged)
    groups: dict[tuple[str, int], list[str]] = {}
    for (s, seed), r in learn.items():
        groups.setdefault((learning_key(r), seed), []).append(s)
    run_of: dict[tuple[str, int], str] = {}
    for (key, seed), members in groups.items():
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        for s in members:
            run_of[s, seed] = f"{'+'.join(members)}-{digest}-seed{seed}"

    say(f"compare: the base of {config.task} (held-out ODE) at each seed, before any RL")
    kind, value = parse_target(config.target)
    bases: dict[int, float] = {}
    for seed in config.seeds:
        bases[seed] = _base_eval(learn[config.systems[0], seed], out / "base", learn_dir)
        if kind == "absolute" and bases[seed] >= value:
            raise ConfigError(f"compare.target {config.target}: the base already scores {bases[seed]:.4f} "
                              f">= {value:.4f} on the held-out prompts (seed {seed}); nothing to reach")
    targets = {seed: b + value if kind == "rise" else value for seed, b in bases.items()}
    (out / "base.json").write_text(json.dumps({"bases": bases, "targets": targets}) + "\n")

    # learning: one run per learning group and seed (runtime mode: one per system and seed)
    runs: dict[tuple[str, int], Path] = {}
    for (s, seed), r in learn.items():
        if config.mode == "runtime":
            tables = merge_tables(r.to_dict(), {})
            rec = load_recipe(tables, [*timing_overrides(config, is_spot(merged[s]), config.reserved_gpus),
                                       f'run.name="{names[s, seed]}"', f'run.out_dir="{out / "runtime"}"'])
            runs[s, seed] = _learn(rec, say)
            continue
        folder = run_of[s, seed]
        if (folder, seed) in {(p.name, sd) for (_, sd), p in runs.items()}:
            runs[s, seed] = learn_dir / folder
            continue
        rec = learning_recipe(config, s, seed, folder, learn_dir, plans.get(s))
        runs[s, seed] = _learn(rec, say)
    shared: dict[str, list[str]] = {}
    if config.mode == "sim":
        for (s, seed), p in runs.items():
            shared.setdefault(str(p), []).append(s)
        shared = {k: v for k, v in shared.items() if len(v) > 1}
        if shared:
            notes.append("systems with identical learning settings (merged recipes) shared one learning run "
                         "per seed: " + "; ".join(sorted({", ".join(v) for v in shared.values()})))
    rows: dict[str, list[Reach]] = {}
    for s in config.systems:
        variants = [s] if is_spot(merged[s]) or config.mode == "runtime" else [s, s + ALONE]
        for v in variants:
            rows[v] = [_reach(runs[s, seed], seed, targets[seed], timing.get(v), config)
                       for seed in config.seeds]
    for (s, seed), p in runs.items():
        first = _evals(p)[0]["eval_ode_heldout"]
        if abs(first - bases[seed]) > 1e-6:
            notes.append(f"{p.name}: its iteration-0 eval {first:.4f} differs from the base eval "
                         f"{bases[seed]:.4f}")
    result = CompareResult(config=config, bases=bases, targets=targets, rows=rows, shared=shared,
                           learning_runs={s: {seed: str(runs[s, seed]) for seed in config.seeds}
                                          for s in config.systems},
                           timing=timing, mean_spot_gpus=mean_spot, notes=notes)
    from spotlight.compare_report import write_outputs

    write_outputs(result, out)
    say(result.table())
    return result


def _plan_summary(plan: list[str]) -> str:
    return ", ".join(f"{a} x{n}" for a, n in Counter(plan).most_common())


def _run_name(system: str, seed: int) -> str:
    return f"{system}-seed{seed}"


def _simulate_all(config: CompareConfig, merged: dict[str, Recipe], out: Path,
                  say) -> tuple[dict, float | None]:
    """Every system's simulated run (spot systems first: the reserved-only ones get their mean
    spot capacity); a trace shorter than a run is a ConfigError."""
    from spotlight.sim.run import SimRun
    from spotlight.spot.config import spot_replay

    timing: dict[str, dict[str, Any]] = {}
    longest = 0.0
    replay = None
    spot = [s for s in config.systems if is_spot(merged[s])]
    reserved = [s for s in config.systems if not is_spot(merged[s])]

    def sim(name: str, system: str, spot_system: bool, reserved_gpus: int) -> dict[str, Any]:
        recipe = load_recipe(system_tables(config, system), [
            *config.overrides, f"run.iterations={config.iterations}", f'run.name="{_slug(name)}"',
            f'run.out_dir="{out}"', *timing_overrides(config, spot_system, reserved_gpus)])
        say(f"compare: simulating {name} ({config.label}, {config.iterations} iterations)")
        run = SimRun(recipe)
        summary = run.run()
        end = run.clock()
        if run.replay is not None and end > run.replay.duration_s:
            raise ConfigError(
                f"spot trace {run.replay.trace.source}: {run.replay.duration_s / 3600:.2f} simulated h from "
                f"spot.start_s={config.trace_start_s:g}, but {name} needs {end / 3600:.2f} h for "
                f"{config.iterations} iterations (lower --iterations or start the trace earlier)")
        return {"records": run.records, "events": run.account.events,
                "injector": run.injector.log if run.injector is not None else [],
                "summary": summary, "reserved_gpus": reserved_gpus, "trainer_gpus": config.trainer_gpus,
                "spot": spot_system, "recipe": recipe.to_dict()}

    for s in spot:
        timing[s] = sim(s, s, True, config.reserved_gpus)
        longest = max(longest, timing[s]["records"][-1]["sim_s"])
        replay = replay or spot_replay(load_recipe(system_tables(config, s), [
            *config.overrides, *timing_overrides(config, True, config.reserved_gpus)]).spot)
    if replay is not None:
        mean_spot = _mean_capacity(replay.steps(), longest or replay.duration_s) * config.gpus_per_node
    elif spot or config.trace is None:
        mean_spot = float(config.fixed_spot_gpus)
    else:
        mean_spot = 0.0
    extra = round(mean_spot)
    for s in reserved:
        timing[s] = sim(s, s, False, config.reserved_gpus + extra)
        timing[s + ALONE] = sim(s + ALONE, s, False, config.reserved_gpus)
    return timing, mean_spot


def trace_events(run: dict[str, Any], until: float) -> list[tuple[float, str, str]]:
    """The trace's grants, notices and hard kills a timing run's injector applied up to ``until``."""
    return [(e["t"], e["action"], e["node"]) for e in run["injector"]
            if e["action"] in ("add", "notice", "hard_kill") and e["t"] <= until]


def _same_trace(timing: dict[str, dict[str, Any]]) -> list[str]:
    """A note saying whether every spot system met the same trace events (up to the shortest run)."""
    spot = {s: t for s, t in timing.items() if t["spot"] and t["injector"]}
    if len(spot) < 2:
        return []
    until = min(t["records"][-1]["sim_s"] for t in spot.values())
    seen = {s: trace_events(t, until) for s, t in spot.items()}
    first = next(iter(seen.values()))
    if all(v == first for v in seen.values()):
        return [f"the same {len(first)} trace events (grants, notices, kills) hit every spot system in the "
                f"first {until / 3600:.2f} simulated h"]
    counts = ", ".join(f"{s} {len(v)}" for s, v in seen.items())
    return [f"the spot systems met different trace events: {counts}"]


def _slug(name: str) -> str:
    return name.replace(ALONE, "-alone")


def _mean_capacity(steps: list[tuple[float, int]], until: float) -> float:
    """Time-weighted mean of a replay's (run second, nodes) step function over [0, until]."""
    area, last_t, last_n = 0.0, 0.0, 0
    for t, n in steps:
        if t >= until:
            break
        area += last_n * (t - last_t)
        last_t, last_n = t, n
    area += last_n * (until - last_t)
    return area / until if until > 0 else float(last_n)


def _check_runtime_trace(config: CompareConfig, merged: dict[str, Recipe]) -> None:
    from spotlight.spot.config import spot_replay

    for s, r in merged.items():
        if not is_spot(r):
            continue
        rec = load_recipe(system_tables(config, s), [*config.overrides, *timing_overrides(config, True, 1)])
        replay = spot_replay(rec.spot)
        if rec.run.minutes is not None and replay is not None and replay.duration_s < rec.run.minutes * 60:
            raise ConfigError(f"spot trace {replay.trace.source}: {replay.duration_s:.0f} run s, shorter "
                              f"than run.minutes={rec.run.minutes:g} of {s}")


def _base_eval(recipe: Recipe, out: Path, learn_dir: Path) -> float:
    """The held-out ODE score of the untrained base (the evaluation every run starts with); kept
    in ``learn_dir`` under a digest of what it reads, so a comparison over the same learning
    folder evaluates it once."""
    import torch

    what = json.loads(learning_key(recipe))
    what.pop("explore")
    kept = learn_dir / f"base-{hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]}.json"
    if kept.is_file():
        return float(json.loads(kept.read_text())["eval_ode_heldout"])

    from spotlight import work
    from spotlight.evaluation import Evaluator
    from spotlight.parallel.device import resolve_device

    torch.manual_seed(recipe.run.seed)
    model = work.recipe_model(recipe.model).to(resolve_device(recipe.run.device))
    folder = out / f"seed{recipe.run.seed}"
    folder.mkdir(parents=True, exist_ok=True)
    rec = Evaluator(model, recipe, work.recipe_reward(recipe), folder)(0, save_samples=True)
    (folder / "eval.json").write_text(json.dumps(rec) + "\n")
    learn_dir.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(rec) + "\n")
    return float(rec["eval_ode_heldout"])


def _finished(folder: Path, recipe: Recipe) -> bool:
    """``folder`` holds a finished run that serves ``recipe``: the same recipe (its bookkeeping
    aside) run to ``run.iterations`` — or further, with an evaluation at ``run.iterations``, when
    the schedule is not "overlap" (whose last iteration skips the next exploration: the records
    before it are those of a shorter run)."""
    try:
        saved = json.loads((folder / "recipe.json").read_text())
        evals = _evals(folder)
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    want = json.loads(json.dumps(recipe.to_dict()))
    if not evals or {**saved, "run": {}} != {**want, "run": {}}:
        return False
    skip = set(_BOOKKEEPING)
    if any(saved["run"].get(k) != v for k, v in want["run"].items() if k not in skip):
        return False
    n, done = recipe.run.iterations, evals[-1]["iteration"]
    return done == n or (done > n and recipe.explore.schedule != "overlap"
                         and any(e["iteration"] == n for e in evals))


def _learn(recipe: Recipe, say) -> Path:
    from spotlight.api import Experiment

    folder = Path(recipe.run.out_dir) / recipe.run.name
    if _finished(folder, recipe):
        say(f"compare: reusing the finished run {folder}")
        return folder
    say(f"compare: learning run {folder} ({recipe.run.mode}, {recipe.run.iterations} iterations)")
    Experiment(recipe).run(progress=False)
    return folder


def _records(folder: Path) -> list[dict[str, Any]]:
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _evals(folder: Path) -> list[dict[str, Any]]:
    return [r for r in _records(folder) if r.get("event") == "eval"]


def _clock(records: list[dict[str, Any]], iteration: int, mode: str) -> dict[str, float]:
    """Seconds and bill after ``iteration`` iterations (0: nothing yet) of a timing run's records."""
    if iteration <= 0:
        return {"s": 0.0, "cost_usd": 0.0, "gpu_s_reserved": 0.0, "gpu_s_spot": 0.0}
    rec = records[iteration - 1]
    return {"s": rec["sim_s"] if mode == "sim" else rec["wall_s"], "cost_usd": rec.get("cost_usd", 0.0),
            "gpu_s_reserved": rec.get("gpu_s_reserved", 0.0), "gpu_s_spot": rec.get("gpu_s_spot", 0.0)}


def breakdown(records: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of ``records`` (iteration records) by where they went; the parts sum to their
    iteration_s. "waiting for capacity" and "lost to preemption" are the records' own
    ``wait_capacity_s`` / ``preempt_lost_s`` (the sim's), taken out of the rollout (then the
    exploration) phase they happened in."""
    out = dict.fromkeys(("rollout", "exploration (critical path)", "training", "waiting for capacity",
                         "lost to preemption"), 0.0)
    for r in records:
        wait, lost = r.get("wait_capacity_s", 0.0), r.get("preempt_lost_s", 0.0)
        roll, expl = r["rollout_s"], r["explore_s"]
        take = min(roll, wait + lost)
        roll -= take
        expl = max(expl - (wait + lost - take), 0.0)
        out["rollout"] += roll
        out["exploration (critical path)"] += expl
        out["training"] += r["train_s"]
        out["waiting for capacity"] += wait
        out["lost to preemption"] += lost
    return out


def _reach(folder: Path, seed: int, target: float, sim: dict[str, Any] | None,
           config: CompareConfig) -> Reach:
    evals = [e for e in _evals(folder) if e["iteration"] <= config.iterations]  # a longer run: its first part
    if sim is not None:
        records = sim["records"]
    else:
        records = [r for r in _records(folder) if r.get("event") == "iteration"][:config.iterations]
    curve = []
    hit = None
    for ev in evals:
        c = _clock(records, ev["iteration"], config.mode)
        curve.append({"iteration": ev["iteration"], "score": ev["eval_ode_heldout"],
                      "hours": c["s"] / 3600, "dollars": c["cost_usd"]})
        if hit is None and ev["eval_ode_heldout"] >= target:
            hit = ev
    upto = hit["iteration"] if hit is not None else evals[-1]["iteration"]
    c = _clock(records, upto, config.mode)
    return Reach(seed=seed, iteration=None if hit is None else hit["iteration"],
                 hours=None if hit is None else c["s"] / 3600, dollars=None if hit is None else c["cost_usd"],
                 score=None if hit is None else hit["eval_ode_heldout"],
                 final_score=evals[-1]["eval_ode_heldout"],
                 curve=curve, breakdown=breakdown(records[:upto]),
                 bill={k: c[k] for k in ("cost_usd", "gpu_s_reserved", "gpu_s_spot")} | {"s": c["s"]})
