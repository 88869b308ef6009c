"""`spotlight compare` end to end on a tiny budget — two spot systems (naive_spot, spotlight_no_explore),
one seed, two iterations of real learning each on the shapes task (the shipped base, few steps and
samples), a short synthetic trace that preempts within the run, sim mode at the tiny profile — and
the report's invariants:

- every system's bill covers all its GPUs for its whole simulated time: the reserved trainer and
  rollout GPUs from 0 to the end, every spot node from the trace's grant (its boot included) to
  its leave;
- the same trace events (grants, notices, hard kills, at the same seconds) hit every spot system;
- iterations, hours and dollars to target are read from the records: the reported iteration is the
  first eval record at or over the target, its hours and dollars that iteration's simulated record;
- systems whose merged recipes learn the same way share a learning run (reserved_only with
  spotlight_no_explore), others do not.

Bad input — an unknown system, a target the base already meets, a trace too short for the budget —
is one ConfigError line, with no learning run started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotlight.cli import main
from spotlight.compare import ALONE, CompareConfig, compare, trace_events
from spotlight.errors import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAST = ("sampler.steps=3", "sampler.eval_steps=3", "run.group_size=4", "explore.candidates=4",
        "run.prompts_per_iteration=2", "run.eval_seeds=1", "run.eval_samples=1")
SIM = dict(mode="sim", profile="tiny", gpu="cpu", trainer_gpus=1, reserved_gpus=1, gpus_per_node=1)
BURSTY = ("spot.synthetic.duration_s=3600.0", "spot.synthetic.max_nodes=3", "spot.synthetic.seed=1",
          "spot.synthetic.preemption_rate=400.0", "spot.synthetic.arrival_rate=900.0",
          "spot.synthetic.burst_fraction=0.5", "spot.synthetic.burst_size=2")


def _config(tmp_path, **kw) -> CompareConfig:
    base = dict(task="tiny", systems=("naive_spot", "spotlight_no_explore"), seeds=(0,), iterations=2,
                eval_every=1, target="+0.0001", trace="synthetic", overrides=FAST, cluster=BURSTY,
                out_dir=str(tmp_path / "cmp"), **SIM)
    return CompareConfig(**{**base, **kw})


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_compare_end_to_end(tmp_path):
    result = compare(_config(tmp_path), progress=False)
    out = tmp_path / "cmp"
    assert (out / "compare.md").read_text().startswith("task `tiny`")
    assert "sim (tiny, cpu)" in (out / "compare.html").read_text()
    assert set(result.rows) == {"naive_spot", "spotlight_no_explore"}

    # the bill covers every GPU of every role for the whole run
    for system, t in result.timing.items():
        last = t["records"][-1]
        end = last["sim_s"]
        reserved = t["trainer_gpus"] + t["reserved_gpus"]
        assert last["gpu_s_reserved"] == pytest.approx(reserved * end, rel=1e-6)
        grants = {e["node"]: e["t"] for e in t["injector"] if e["action"] == "add"}
        left = {e["node"]: e["t"] for e in t["events"] if e["event"] != "join" and e["kind"] == "spot"}
        assert grants, "the trace granted no spot node"
        billed = sum((min(left.get(n, end), end) - g) for n, g in grants.items() if g < end)
        assert last["gpu_s_spot"] == pytest.approx(billed, abs=1e-3)  # 1 GPU per node
        assert last["cost_usd"] == pytest.approx(
            last["gpu_s_reserved"] / 3600 * 12.29 + last["gpu_s_spot"] / 3600 * 5.22, abs=2e-6)

    # the same trace events hit both spot systems, up to the shorter run's end
    ends = min(t["records"][-1]["sim_s"] for t in result.timing.values())
    seen = [trace_events(t, ends) for t in result.timing.values()]
    assert seen[0] == seen[1] and any(a != "add" for _, a, _ in seen[0]), "no preemption within the run"
    assert any(n.startswith(f"the same {len(seen[0])} trace events") for n in result.notes)

    # the target is read from the eval records, hours and dollars from that iteration's sim record
    bases = json.loads((out / "base.json").read_text())["bases"]
    assert {int(k): v for k, v in bases.items()} == result.bases
    for system, runs in result.rows.items():
        for reach in runs:
            folder = Path(result.learning_runs[system][reach.seed])
            evals = [r for r in _records(folder / "metrics.jsonl") if r["event"] == "eval"]
            assert evals[0]["eval_ode_heldout"] == pytest.approx(result.bases[reach.seed])
            first = next((e for e in evals if e["eval_ode_heldout"] >= result.targets[reach.seed]), None)
            assert reach.iteration == (None if first is None else first["iteration"])
            assert [c["score"] for c in reach.curve] == [e["eval_ode_heldout"] for e in evals]
            sim = result.timing[system]["records"]
            for c in reach.curve[1:]:
                assert c["dollars"] == sim[c["iteration"] - 1]["cost_usd"]
                assert c["hours"] == sim[c["iteration"] - 1]["sim_s"] / 3600
            if first is not None:
                assert reach.dollars == sim[first["iteration"] - 1]["cost_usd"]
    # different learning (critical vs random seeds): two runs, none shared
    assert result.learning_runs["naive_spot"][0] != result.learning_runs["spotlight_no_explore"][0]
    assert not result.shared


def test_learning_shared_by_equal_recipes(tmp_path):
    """reserved_only and spotlight_no_explore learn alike (random seeds): one run, said so; a
    second comparison over the same learning folder reuses it."""
    cfg = _config(tmp_path, systems=("reserved_only", "spotlight_no_explore"), iterations=1)
    result = compare(cfg, progress=False)
    runs = result.learning_runs
    assert runs["reserved_only"][0] == runs["spotlight_no_explore"][0]
    assert any("shared one learning run" in n for n in result.notes)
    assert set(result.rows) == {"reserved_only", f"reserved_only{ALONE}", "spotlight_no_explore"}
    ro, alone = result.timing["reserved_only"], result.timing[f"reserved_only{ALONE}"]
    assert ro["reserved_gpus"] == 1 + round(result.mean_spot_gpus) and alone["reserved_gpus"] == 1
    assert not ro["events"] or all(e["kind"] == "reserved" for e in ro["events"])
    metrics = Path(runs["reserved_only"][0]) / "metrics.jsonl"
    stamp = metrics.stat().st_mtime_ns
    again = compare(_config(tmp_path, systems=("reserved_only", "spotlight_no_explore"), iterations=1,
                            out_dir=str(tmp_path / "cmp2"), learning_dir=str(tmp_path / "cmp" / "learning")),
                    progress=False)
    assert metrics.stat().st_mtime_ns == stamp and again.bases == result.bases


def test_unknown_system_is_one_line(tmp_path, capsys):
    assert main(["compare", "--systems", "reserved_only,nope", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown system 'nope'" in err[0]
    assert not (tmp_path / "x").exists()


def test_target_the_base_meets_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="the base already scores"):
        compare(_config(tmp_path, target="0.0"), progress=False)
    assert not list((tmp_path / "cmp" / "learning").glob("*/metrics.jsonl"))  # no learning run started


def test_trace_too_short_is_one_line(tmp_path):
    short = (*BURSTY, "spot.synthetic.duration_s=0.5")
    with pytest.raises(ConfigError, match="needs .* h for 2 iterations"):
        compare(_config(tmp_path, cluster=short), progress=False)
    assert not (tmp_path / "cmp" / "learning").exists() and not (tmp_path / "cmp" / "base").exists()


def test_a_new_base_at_the_same_path_is_another_learning_run(tmp_path):
    """The learning key holds the checkpoint file's content, so re-pretraining a base into the same
    path (a new builtin:ocr_base) does not reuse the runs of the old one; a missing file is one line."""
    import shutil

    from spotlight.compare import learning_key
    from spotlight.errors import NotFound
    from spotlight.models.dit import resolve_checkpoint
    from spotlight.recipe import load_recipe

    ckpt = tmp_path / "base.safetensors"
    shutil.copy(resolve_checkpoint("builtin:base"), ckpt)
    recipe = load_recipe("tiny", [f'model.checkpoint="{ckpt}"'])
    before = learning_key(recipe)
    assert learning_key(load_recipe("tiny", [f'model.checkpoint="{ckpt}"'])) == before
    shutil.copy(resolve_checkpoint("builtin:ocr_base"), ckpt)
    assert learning_key(recipe) != before
    ckpt.unlink()
    with pytest.raises(NotFound, match="does not exist"):
        learning_key(recipe)


def test_a_planner_learns_with_the_arms_its_simulated_run_chose(tmp_path):
    """spotlight's planner chooses its arms on the simulated cluster it is billed on; its learning
    run explores with exactly those arms, iteration by iteration (this machine's own training
    window would fit none of them), and the report says so."""
    result = compare(_config(tmp_path, systems=("spotlight",), iterations=3, overrides=FAST),
                     progress=False)
    sim = [r.get("explore_arm") for r in result.timing["spotlight"]["records"]]
    assert sim[0] is None and all(sim[1:]) and len(set(sim[1:])) == 2  # the planner tried two arms
    folder = Path(result.learning_runs["spotlight"][0])
    learned = [r.get("explore_arm") for r in _records(folder / "metrics.jsonl") if r["event"] == "iteration"]
    assert learned == sim
    saved = json.loads((folder / "recipe.json").read_text())["explore"]
    assert saved["planner"] is False and saved["arm_plan"] == sim[1:]
    assert any(n.startswith("spotlight: its learning runs explore with the arms") for n in result.notes)
