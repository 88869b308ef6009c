"""`spotlight export`: a checkpoint becomes a diffusers model folder (+ a LoRA adapter in diffusers'
format under LoRA) that diffusers' own loaders read back into the same forward, bit for bit, for
every supported DiT class; the CLI writes it."""

from __future__ import annotations

import json

import diffusers
import pytest
import torch

from spotlight.cli import main
from spotlight.data.scenes import VOCABULARY
from spotlight.export import LORA_WEIGHTS, export, load_export
from spotlight.models.dit import DiffusionModel, ModelConfig, build_model
from spotlight.policy.grpo import GRPOConfig, add_lora

SIZE = 16
PROMPTS = ["a red circle", "two blue squares to the left of a green triangle"]


def trained_model(dit_class: str, lora: bool) -> DiffusionModel:
    """A tiny model whose weights (and adapter) are not at their initial values."""
    torch.manual_seed(0)
    cfg = ModelConfig(checkpoint=None, dit_class=dit_class, layers=2, heads=2, head_dim=16, image_size=SIZE,
                      patch=4, text_dim=32, text_layers=1)
    model = build_model(cfg, VOCABULARY)
    if lora:
        add_lora(model, GRPOConfig(finetune="lora", lora_rank=4, lora_alpha=8.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # lora_B starts at zero: make the adapter matter
    return model


def velocity(model: DiffusionModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x, t = torch.randn(2, 3, SIZE, SIZE, generator=gen), torch.tensor([0.9, 0.3])
    with torch.no_grad():
        return model.velocity(x, t, model.encode(PROMPTS))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("dit_class", ["QwenImageTransformer2DModel", "SD3Transformer2DModel",
                                       "FluxTransformer2DModel"])
def test_export_round_trips_through_diffusers(tmp_path, dit_class, lora):
    model = trained_model(dit_class, lora)
    model.save(tmp_path / "ckpt.safetensors", extra={"iteration": 7})
    expected = velocity(model)

    record = export(tmp_path / "ckpt.safetensors", tmp_path / "out")
    assert record["iteration"] == 7 and record["model"]["dit_class"] == dit_class
    assert (record["lora"] is not None) == lora == (tmp_path / "out" / "lora" / LORA_WEIGHTS).is_file()

    # diffusers alone reads the DiT (and the adapter): nothing of spotlight's loading code involved
    dit = getattr(diffusers, dit_class).from_pretrained(tmp_path / "out" / "transformer")
    if lora:
        dit.load_lora_adapter(tmp_path / "out" / "lora", weight_name=LORA_WEIGHTS)
        assert dit.peft_config["default_0"].r == 4 and dit.peft_config["default_0"].lora_alpha == 8.0
    assert torch.equal(velocity(DiffusionModel(model.cfg, dit, model.text, model.tokenizer)), expected)
    # ... and the whole model, text encoder and tokenizer included
    assert torch.equal(velocity(load_export(tmp_path / "out")), expected)


def test_cli_export_of_a_lora_checkpoint(tmp_path, capsys):
    model = trained_model("QwenImageTransformer2DModel", lora=True)
    model.save(tmp_path / "ckpt.safetensors")
    argv = ["export", "--checkpoint", str(tmp_path / "ckpt.safetensors"), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out" / "spotlight.json").read_text())
    assert printed["lora"] == "lora" and printed["transformer"] == "transformer"
    assert torch.equal(velocity(load_export(tmp_path / "out")), velocity(model))
