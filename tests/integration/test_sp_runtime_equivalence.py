"""The loop through the actor runtime with SP groups (``runtime.sp_degree = 2``: each node agent
runs every request on a group of two workers, Ulysses attention over a gloo group) gives the
in-process run bit for bit: same per-iteration rewards, exploration spreads and trained weights. The
in-process loop runs the plain DiT, so this also holds a degree-2 trajectory equal to a degree-1 one
(the SP forward is exact on this machine; docs/BENCHMARKS.md "Elastic sequence parallelism"), which
is what makes a resume across SP degrees bit-identical here. Bad ``sp_degree`` values are one
ConfigError line naming the field."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe
from spotlight.actors.procs import alive
from spotlight.actors.worker.peers import read_weights_log
from spotlight.errors import ConfigError

TINY = [
    *TINY_MODEL,
    "sampler.eval_steps=2",
    "run.group_size=4",
    "explore.candidates=4",
    "run.iterations=2",
    "run.prompts_per_iteration=2",
    "run.eval_every=100",
    "run.eval_seeds=1",
    "run.eval_samples=2",
    "runtime.sp_degree=2",
    "runtime.reserved_workers=2",
    "runtime.spot_workers=2",
]


def run(tmp_path, mode: str) -> tuple[Experiment, list[int]]:
    torch.set_num_threads(1)
    recipe = load_recipe("tiny", [*TINY, f'run.mode="{mode}"', "explore.schedule=critical",
                                  f'run.out_dir="{tmp_path}"', f'run.name="{mode}"'])
    exp = Experiment(recipe)
    pids: list[int] = []
    exp.on_metrics(lambda rec: pids.extend(exp.runtime.pids()) if exp.runtime and not pids else None)
    exp.run(progress=False)
    return exp, pids


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sp_degree_2_runtime_matches_in_process_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ref, _ = run(tmp_path, "in-process")
    got, pids = run(tmp_path, "runtime")

    iters = lambda exp: [r for r in exp.records if r["event"] == "iteration"]  # noqa: E731
    assert len(iters(got)) == ref.recipe.run.iterations
    for a, b in zip(iters(ref), iters(got), strict=True):
        assert a["rewards"] == b["rewards"]
        for key in ("loss", "ratio_dev", "grad_norm", "reward_mean", "group_spread", "explore_spread"):
            assert a[key] == b[key], key
    ref_state, got_state = ref.loop.model.state_dict(), got.loop.model.state_dict()
    assert all(torch.equal(ref_state[k], got_state[k]) for k in ref_state)
    # Each weights version crossed to each node once; the node's other workers copied it from a
    # neighbour (runtime.peer_weights) instead of fetching it again.
    loads = [e for e in read_weights_log(got.runtime.log_dir / "weights.log") if e.how in ("store", "peer")]
    fetches = Counter((e.node, e.version) for e in loads if e.how == "store")
    assert loads and set(fetches.values()) == {1}, loads
    assert any(e.how == "peer" for e in loads), loads  # a group's second member copies from its first
    assert len(pids) == 2 + 2 + 4, pids  # services, two agents, two groups of two workers
    assert [p for p in pids if alive(p)] == []


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["runtime.sp_degree=3", "runtime.reserved_workers=3", "runtime.spot_workers=3"],
         "must divide the attention heads (model.heads = 2)"),
        (["runtime.sp_degree=2", "model.image_size=12"], "must divide the image tokens (9"),
        (["runtime.sp_degree=2", "runtime.spot_workers=1"], "more than the workers a node has "
                                                            "(runtime.spot_workers = 1)"),
        (["runtime.sp_degree=0"], "runtime.sp_degree must be >= 1"),
    ],
    ids=["heads", "tokens", "workers", "zero"],
)
def test_bad_sp_degree_is_one_line_naming_the_field(overrides, words):
    base = [*TINY_MODEL, "runtime.reserved_workers=2", "runtime.spot_workers=2"]
    with pytest.raises(ConfigError) as e:
        load_recipe("tiny", [*base, *overrides])
    msg = str(e.value)
    assert "runtime.sp_degree" in msg and words in msg and "\n" not in msg, msg
