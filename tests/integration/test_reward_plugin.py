"""A user's reward named by import path in the recipe reaches every worker process: the module
lives only in a temporary folder on PYTHONPATH, the recipe travels to the workers as JSON, and the
rollout rewards come from that module, computed in the workers (their pids), with the recipe's
arguments."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

from spotlight import Experiment, load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODULE = "user_reward_plugin_mod"
SOURCE = '''
import os
from pathlib import Path

import numpy as np


class Brightness:
    """offset + mean pixel / 255; notes the pid of every process that scores."""

    name = "brightness"

    def __init__(self, offset, seen):
        self.offset, self.seen = offset, Path(seen)

    def __call__(self, images, prompts):
        (self.seen / str(os.getpid())).touch()
        return (self.offset + images.reshape(len(images), -1).mean(1) / 255.0).astype(np.float32)


def make(offset: float, seen: str):
    return Brightness(offset, seen)
'''

TINY = [
    "model.checkpoint=none",
    "model.layers=1",
    "model.heads=2",
    "model.head_dim=16",
    "model.image_size=16",
    "model.patch=4",
    "sampler.steps=2",
    "sampler.sde_steps=none", 'sampler.sde_type="flow"',
    "sampler.eval_steps=2",
    "run.group_size=2",
    "explore.schedule=off",
    "run.iterations=1",
    "run.prompts_per_iteration=2",
    "run.eval_every=100",
    "run.eval_seeds=1",
    "run.eval_samples=1",
    "runtime.reserved_workers=1",
    "runtime.spot_workers=0",
    'run.mode="runtime"',
]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The reward module in its own folder, importable here and (PYTHONPATH) in every child."""
    folder = tmp_path / "userpkg"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(folder))
    path = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    yield MODULE
    sys.modules.pop(MODULE, None)


def test_import_path_reward_is_loaded_in_every_worker(tmp_path, user_module):
    torch.set_num_threads(1)
    seen = tmp_path / "seen"
    seen.mkdir()
    recipe = load_recipe(
        "tiny",
        [
            *TINY,
            f'run.out_dir="{tmp_path}"',
            f"reward.name={user_module}:make",
            "reward.offset=100.0",
            f'reward.seen="{seen}"',
        ],
    )
    exp = Experiment(recipe)
    children: list[int] = []  # every process the runtime started, workers included
    exp.on_metrics(lambda rec: children.extend(exp.runtime.pids()) if exp.runtime and not children else None)
    exp.run(progress=False)

    rollouts = [r for r in exp.records if r["event"] == "iteration"]
    assert len(rollouts) == 1
    rewards = [x for group in rollouts[0]["rewards"] for x in group]
    # the module's scores, with the recipe's offset
    assert len(rewards) == 4 and all(100.0 <= x <= 101.0 for x in rewards), rewards
    scorers = {int(p.name) for p in seen.iterdir()}
    assert os.getpid() in scorers  # the trainer's evaluation
    assert scorers - {os.getpid()}, "no worker process scored a rollout"
    assert scorers - {os.getpid()} <= set(children), (scorers, children)
