"""Recipes validate at load; diffusers DiTs load from a local folder; checkpoints round-trip."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spotlight.data.scenes import VOCABULARY
from spotlight.errors import ConfigError, NotFound
from spotlight.models.dit import ModelConfig, build_model, tiny_dit
from spotlight.recipe import load_recipe


def test_builtin_recipe_loads_with_overrides():
    r = load_recipe(
        "tiny", ["grpo.lr=5e-5", "run.iterations=3", "model.checkpoint=none", "explore.schedule=off"]
    )
    assert (
        r.grpo.lr == 5e-5 and r.run.iterations == 3 and r.model.checkpoint is None and not r.explore.enabled
    )


@pytest.mark.parametrize(
    "override, field",
    [
        ("grpo.bogus=1", "grpo.bogus"),
        ("nosuch.x=1", "nosuch"),
        ("sampler.steps=-3", "sampler.steps"),
        ("run.group_size=7", "run.group_size"),
        ("explore.candidates=4", "explore.candidates"),
        ('grpo.lr="fast"', "grpo.lr"),
        ('model.dit_class="UNet2DModel"', "model.dit_class"),
        ('run.mode="cloud"', "run.mode"),
        ("runtime.reserved_workers=-1", "runtime.reserved_workers"),
        ("runtime.spot_workers=-2", "runtime.spot_workers"),
        ("runtime.heartbeat_s=30", "runtime.heartbeat_s"),  # not < the 30 s lease
        ("runtime.leave_s=0", "runtime.leave_s"),
        ('runtime.transport="udp"', "runtime.transport"),
        ("runtime.max_attempts=0", "runtime.max_attempts"),
        ("runtime.store_keep_versions=0", "runtime.store_keep_versions"),
    ],
)
def test_bad_recipe_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        # with seed selection on, whatever the demo recipe chooses: group size and candidates are checked then
        load_recipe("tiny", ["explore.schedule=critical", override])


def test_runtime_on_one_machine_needs_a_worker():
    from spotlight import Experiment

    recipe = load_recipe(
        "tiny", ['run.mode="runtime"', "runtime.reserved_workers=0", "runtime.spot_workers=0"]
    )
    with pytest.raises(ConfigError, match="needs a worker"):  # before any process starts
        Experiment(recipe).run(progress=False)
    # a train-only reserved node
    assert load_recipe("tiny", ["runtime.reserved_workers=0"]).runtime.reserved_workers == 0


def test_bad_recipe_file(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_text("[run\nname=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(bad)
    with pytest.raises(NotFound, match="no such file"):
        load_recipe(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "cls", ["QwenImageTransformer2DModel", "SD3Transformer2DModel", "FluxTransformer2DModel"]
)
def test_diffusers_dit_saves_and_loads_from_local_folder(tmp_path, cls):
    cfg = ModelConfig(
        dit_class=cls,
        checkpoint=None,
        layers=2,
        heads=2,
        head_dim=16,
        image_size=16,
        patch=4,
        text_dim=32,
        text_layers=1,
    )
    torch.manual_seed(0)
    tiny_dit(cfg).save_pretrained(tmp_path / "dit")
    loaded = build_model(
        ModelConfig(
            dit_class=cls,
            dit_path=str(tmp_path / "dit"),
            checkpoint=None,
            layers=2,
            heads=2,
            head_dim=16,
            image_size=16,
            patch=4,
            text_dim=32,
            text_layers=1,
        ),
        VOCABULARY,
    )
    torch.manual_seed(0)
    again = tiny_dit(cfg)
    for (n, a), (_, b) in zip(loaded.dit.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    x = torch.randn(2, 3, 16, 16)
    v = loaded.velocity(x, torch.tensor([0.3, 0.9]), loaded.encode(["a red circle", "two blue squares"]))
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_missing_model_folder_and_checkpoint_are_clear(tmp_path):
    with pytest.raises(NotFound, match="model.dit_path"):
        build_model(ModelConfig(dit_path=str(tmp_path / "nope"), checkpoint=None), VOCABULARY)
    with pytest.raises(NotFound, match="model.checkpoint"):
        build_model(ModelConfig(checkpoint=str(tmp_path / "nope.safetensors")), VOCABULARY)


def test_spotlight_checkpoint_round_trip(tmp_path, tiny_model):
    tiny_model.save(tmp_path / "m.safetensors")
    loaded = build_model(ModelConfig(checkpoint=str(tmp_path / "m.safetensors")), VOCABULARY)
    assert loaded.cfg.image_size == 16
    for (n, a), (_, b) in zip(tiny_model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n


def test_cli_errors_are_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "run", "tiny", "grpo.bogus=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip().count("\n") == 0 and "grpo.bogus" in out.stderr and "Traceback" not in out.stderr
    )
    out = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "eval", "--checkpoint", str(tmp_path / "x.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "x.safetensors" in out.stderr and "Traceback" not in out.stderr
