"""The loop through the actor runtime (1 reserved + 2 spot workers, real processes over ipc) gives
the same run as the in-process reference: same per-iteration rewards and, stronger, bit-identical
trained weights (the GRPO update consumes every latent, log-prob and reward bit), under full and
LoRA fine-tuning, in every exploration schedule (overlap: iteration i+1's candidates scored at
weights v_i while the trainer updates, chunked across workers, with the rank-consistency check).
Also: leaving the runtime leaves no process behind."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_recipe import TINY_MODEL

from spotlight import Experiment, load_recipe
from spotlight.actors.procs import alive
from spotlight.actors.worker.peers import read_weights_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

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
    "runtime.reserved_workers=1",
    "runtime.spot_workers=2",
]


def run(tmp_path, mode: str, schedule: str, sampler: list[str]) -> tuple[Experiment, list[int]]:
    torch.set_num_threads(1)
    recipe = load_recipe(
        "tiny",
        [
            *TINY,
            *sampler,
            f'run.mode="{mode}"',
            f"explore.schedule={schedule}",
            f'run.out_dir="{tmp_path}"',
            f'run.name="{mode}"',
        ],
    )
    exp = Experiment(recipe)
    pids: list[int] = []
    exp.on_metrics(lambda rec: pids.extend(exp.runtime.pids()) if exp.runtime and not pids else None)
    exp.run(progress=False)
    return exp, pids


@pytest.mark.parametrize(
    "schedule,sampler",
    [
        ("critical", []),
        ("off", []),
        # Stale-weight exploration during training; wait_s: every result is used (no deadline
        # cut), so the runtime's selections must be the in-process ones.
        ("overlap", ["explore.wait_s=120", "explore.chunk=3", "explore.check_every=1", "run.iterations=3"]),
        # Every sampler option the workers must honour: shared x_1, an SDE window, block noise.
        (
            "critical",
            [
                "sampler.shared_init=true",
                "sampler.sde_steps=2",
                "sampler.noise_patch=2",
                'explore.cache="taylor:2"',
            ],
        ),
        # LoRA (the workers build the adapter the trainer trains), the coefficients-preserving SDE and
        # exploration through diffusers' first-block cache (which needs >= 2 blocks).
        (
            "critical",
            [
                'grpo.finetune="lora"',
                'sampler.sde_type="cps"',
                "sampler.sde_steps=2",  # cps: the last step lands on t=0 and carries no noise
                "sampler.noise_patch=2",
                "model.layers=2",
                'explore.cache="fbc:1.0"',
            ],
        ),  # 1.0: 2 of 3 calls reuse the cache
    ],
    ids=["explore", "random-seeds", "overlap", "explore-shared-init-sde-window-block-noise",
         "explore-lora-cps-cached"],
)
def test_runtime_matches_in_process_loop(tmp_path, monkeypatch, schedule, sampler):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers' threads, as the in-process loop's
    ref, _ = run(tmp_path, "in-process", schedule, sampler)
    got, pids = run(tmp_path, "runtime", schedule, sampler)

    iters = lambda exp: [r for r in exp.records if r["event"] == "iteration"]  # noqa: E731
    assert len(iters(got)) == ref.recipe.run.iterations
    for a, b in zip(iters(ref), iters(got), strict=True):
        assert a["rewards"] == b["rewards"]
        for key in ("loss", "ratio_dev", "grad_norm", "reward_mean", "group_spread"):
            assert a[key] == b[key], key  # exact: same bits in, same bits out
        if schedule != "off":
            for key in ("explore_spread", "explore_version", "explore_returned", "rank_consistency_prompts"):
                assert a.get(key) == b.get(key), key
    if schedule == "overlap":  # iteration 0: random seeds (no training window before it); then
        # candidates scored with the previous iteration's weights, every one back by the deadline
        assert [r.get("explore_version") for r in iters(got)] == [None, 0, 1]
        assert all(r["explore_cancelled"] == 0 for r in iters(got)[1:])
    # Bit-identical weights after two GRPO updates on the runtime's trajectories.
    ref_state, got_state = ref.loop.model.state_dict(), got.loop.model.state_dict()
    assert ref_state.keys() == got_state.keys()
    assert all(torch.equal(ref_state[k], got_state[k]) for k in ref_state)

    # Each weights version crossed to each node once; the node's other workers copied it from a
    # neighbour (runtime.peer_weights) instead of fetching it again.
    loads = [e for e in read_weights_log(got.runtime.log_dir / "weights.log") if e.how in ("store", "peer")]
    fetches = Counter((e.node, e.version) for e in loads if e.how == "store")
    assert loads and set(fetches.values()) == {1}, loads
    # 2 services + 2 agents + 3 workers, and none of them outlived the run.
    assert len(pids) == 7, pids
    assert [p for p in pids if alive(p)] == []
