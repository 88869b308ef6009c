"""A run writes TensorBoard events beside metrics.jsonl, read back with TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest
from tiny_recipe import TINY_MODEL

from spotlight.loop import Loop
from spotlight.recipe import load_recipe
from spotlight.report import TensorBoardLog

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

RUN = [*TINY_MODEL, "run.iterations=3", "run.eval_every=2", "run.eval_seeds=2", "run.eval_samples=2",
       "run.prompts_per_iteration=2", "run.group_size=4", "run.checkpoint_every=100",
       'explore.schedule="critical"', "explore.planner=true", 'explore.arms=["4", "4@taylor:3"]']


def _events(folder):
    acc = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc


@pytest.mark.slow
def test_a_run_writes_scalars_and_sample_grids(tmp_path):
    recipe = load_recipe("tiny", [*RUN, f'run.out_dir="{tmp_path}"', 'run.name="tb"'])
    Loop(recipe, progress=False).run()
    out = tmp_path / "tb"
    acc = _events(out / "tensorboard")
    tags = acc.Tags()
    for tag in ("reward/mean", "reward/group_spread", "eval/ode_heldout", "eval/ode_heldout_spread",
                "eval/fm_drift", "train/lr", "explore/planner_arm", "explore/trainer_wait_share",
                "time/rollout_s"):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    its = [r for r in records if r["event"] == "iteration"]
    mean = acc.Scalars("reward/mean")
    assert [e.step for e in mean] == [r["iteration"] for r in its]
    assert [e.value for e in mean] == pytest.approx([r["reward_mean"] for r in its])
    assert [e.step for e in acc.Scalars("eval/ode_heldout")] == [0, 2, 3]
    assert {"samples/ode_heldout", "samples/ode_train", "samples/sde_train"} <= set(tags["images"])
    image = acc.Images("samples/ode_heldout")[-1]
    assert image.step == 3 and image.encoded_image_string.startswith(b"\x89PNG")


def test_spot_fields_and_switching_it_off(tmp_path):
    log = TensorBoardLog(tmp_path)
    log.write({"event": "iteration", "iteration": 4, "reward_mean": 0.5, "explore_s": 1.0, "iteration_s": 4.0,
               "spot_nodes": 3, "preemptions": 2, "steps_lost": 7, "gpu_s_reserved": 10.0,
               "gpu_s_spot": 30.0, "cost_usd": 0.25})
    log.close()
    acc = _events(tmp_path / "tensorboard")
    got = {t: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"]}
    assert got == pytest.approx({"reward/mean": 0.5, "time/explore_wait_s": 1.0, "time/iteration_s": 4.0,
                                 "explore/trainer_wait_share": 0.25, "spot/nodes": 3, "spot/preemptions": 2,
                                 "spot/steps_lost": 7, "cost/gpu_s_reserved": 10.0, "cost/gpu_s_spot": 30.0,
                                 "cost/gpu_s": 40.0, "cost/usd": 0.25})
    assert TensorBoardLog.open(tmp_path, enabled=False) is None
    recipe = load_recipe("tiny", [*RUN, "run.iterations=1", "run.tensorboard=false",
                                  f'run.out_dir="{tmp_path}"', 'run.name="off"'])
    Loop(recipe, progress=False).run()
    assert (tmp_path / "off" / "metrics.jsonl").exists() and not (tmp_path / "off" / "tensorboard").exists()
