"""Run checkpoints survive being cut short: each file is written under a `.partial` name and
renamed into place, the optimizer file before the model file that commits the pair, so a run
killed at any moment of a save resumes from the newest complete checkpoint (the whole-run resume
fault test once caught a SIGKILL between the two files: `--resume` found the model file and died
on the missing optimizer file)."""

from __future__ import annotations

import pytest
import torch

from spotlight import checkpoint
from spotlight.errors import NotFound
from spotlight.policy.grpo import GRPOConfig, GRPOTrainer
from spotlight.policy.sampler import SamplerConfig


class Killed(BaseException):
    """Stands for the SIGKILL that ends a process in the middle of a write."""


def trainer_for(model) -> GRPOTrainer:
    return GRPOTrainer(model, GRPOConfig(), SamplerConfig(steps=2, eval_steps=2))


def test_a_save_cut_short_leaves_the_previous_checkpoint_the_newest(tmp_path, tiny_model, monkeypatch):
    folder = tmp_path / "checkpoints"
    trainer = trainer_for(tiny_model)
    checkpoint.save(folder, 1, tiny_model, trainer, 10.0, state={"planner": [1]})
    saved = {k: v.clone() for k, v in tiny_model.state_dict().items()}

    def killed_mid_write(path, extra=None):  # half a file on disk, then the process is gone
        path.write_bytes(b"\x00" * 100)
        raise Killed

    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(trainer.deployed, "save", killed_mid_write)
    with pytest.raises(Killed):
        checkpoint.save(folder, 2, tiny_model, trainer, 20.0)
    monkeypatch.undo()
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["iter_0001.optim.safetensors", "iter_0001.safetensors", "iter_0002.optim.safetensors",
                     "iter_0002.safetensors.partial"]
    assert checkpoint.latest(folder).name == "iter_0001.safetensors"

    fresh = trainer_for(tiny_model)
    assert checkpoint.load_latest(folder, tiny_model, fresh) == (1, 10.0, {"planner": [1]})
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_a_model_file_without_its_optimizer_file_is_not_resumed(tmp_path, tiny_model):
    folder = tmp_path / "checkpoints"
    trainer = trainer_for(tiny_model)
    checkpoint.save(folder, 1, tiny_model, trainer, 10.0)
    tiny_model.save(folder / "iter_0002.safetensors")  # a pair cut short before saves were ordered
    assert checkpoint.latest(folder).name == "iter_0001.safetensors"
    (folder / "iter_0001.optim.safetensors").unlink()
    with pytest.raises(NotFound, match="no checkpoint in"):
        checkpoint.latest(folder)
