"""`spotlight export`: a Spotlight checkpoint as files the diffusers / peft ecosystem reads.

    spotlight export --checkpoint runs/tiny/checkpoints/iter_0200.safetensors --out exported/tiny

The folder it writes (`spotlight.json` says which parts exist):

- `transformer/` — the DiT as a diffusers model folder (`save_pretrained`: config.json + safetensors);
  under LoRA, the base weights. Read: `QwenImageTransformer2DModel.from_pretrained(DIR / "transformer")`
  (the checkpoint's DiT class).
- `lora/` — under LoRA only: the adapter in diffusers' LoRA format, `pytorch_lora_weights.safetensors`
  with keys `transformer.<module>.lora_A/B.weight` and the peft `LoraConfig` in its metadata. Read:
  `transformer.load_lora_adapter(DIR / "lora", weight_name="pytorch_lora_weights.safetensors")`, or a
  pipeline's `load_lora_weights(DIR / "lora")`.
- `text_encoder/` — the project's own text encoder (`spotlight.models.text.TextEncoder`, no hub
  encoder exists here): `config.json` (its constructor arguments) + `model.safetensors` (its state).
- `tokenizer/vocabulary.json` — the word tokenizer: `{"vocabulary": [...], "max_length": N}`.
- `spotlight.json` — the `ModelConfig` (canvas, patch, channels, DiT class), the parts, the source
  checkpoint and its iteration; `load_export(DIR)` reassembles the whole `DiffusionModel`.

The re-loaded model's forward equals the checkpoint's bit for bit (adapter attached, not merged).
Knows the model and its checkpoint format; nothing of training or actors.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from spotlight.data.scenes import VOCABULARY
from spotlight.errors import NotFound
from spotlight.models.dit import (
    DiffusionModel,
    ModelConfig,
    build_model,
    load_dit,
    lora_config,
    resolve_checkpoint,
)
from spotlight.models.text import TextEncoder, WordTokenizer

FORMAT = "spotlight-export/1"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
# The diffusers LoRA loader (pipeline mixin) whose file format each supported DiT class reads.
_LORA_LOADERS = {"QwenImageTransformer2DModel": "QwenImageLoraLoaderMixin",
                 "SD3Transformer2DModel": "SD3LoraLoaderMixin",
                 "FluxTransformer2DModel": "FluxLoraLoaderMixin"}


def export(checkpoint: str | Path, out: str | Path) -> dict:
    """Write `checkpoint` (a Spotlight .safetensors, or 'builtin:base') to the folder `out`; returns
    the `spotlight.json` record."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, out = resolve_checkpoint(str(checkpoint)), Path(out)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    if "pipeline_class" in meta:  # a run on a diffusers pipeline folder: back into diffusers
        from spotlight.pipelines.export import export_checkpoint

        return export_checkpoint(path, out)
    model = build_model(ModelConfig(checkpoint=str(path)), VOCABULARY, merge_lora=False)
    extra = json.loads(meta.get("extra", "{}"))
    out.mkdir(parents=True, exist_ok=True)
    lora = lora_config(model.dit)
    if lora is not None:
        from diffusers.loaders import lora_pipeline

        loader = getattr(lora_pipeline, _LORA_LOADERS[model.cfg.dit_class])
        loader.save_lora_weights(out / "lora", transformer_lora_layers=get_peft_model_state_dict(model.dit),
                                 weight_name=LORA_WEIGHTS, transformer_lora_adapter_metadata=lora)
        model.dit.unload_lora()  # the adapter layers go; the base weights under them stay
    model.dit.save_pretrained(out / "transformer", safe_serialization=True)
    (out / "text_encoder").mkdir(exist_ok=True)
    (out / "text_encoder" / "config.json").write_text(json.dumps(model.text.config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.text.state_dict().items()},
              str(out / "text_encoder" / "model.safetensors"))
    (out / "tokenizer").mkdir(exist_ok=True)
    vocabulary = {"vocabulary": model.tokenizer.vocabulary, "max_length": model.tokenizer.max_length}
    (out / "tokenizer" / "vocabulary.json").write_text(json.dumps(vocabulary, indent=2) + "\n")
    record = {"format": FORMAT, "model": asdict(replace(model.cfg, checkpoint=None, dit_path=None)),
              "transformer": "transformer", "lora": "lora" if lora is not None else None,
              "text_encoder": "text_encoder", "tokenizer": "tokenizer", "source": str(path),
              "iteration": extra.get("iteration")}
    (out / "spotlight.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def load_export(folder: str | Path) -> DiffusionModel:
    """The `DiffusionModel` an `export` folder holds (LoRA adapter attached, as trained)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "spotlight.json").is_file():
        raise NotFound(f"{folder}: not a spotlight export folder (no spotlight.json)")
    record = json.loads((folder / "spotlight.json").read_text())
    dit_path = str(folder / record["transformer"])
    cfg = ModelConfig(**{**record["model"], "checkpoint": None, "dit_path": dit_path})
    dit = load_dit(cfg.dit_class, cfg.dit_path)
    if record["lora"]:
        dit.load_lora_adapter(folder / record["lora"], weight_name=LORA_WEIGHTS, adapter_name="default")
    text_dir = folder / record["text_encoder"]
    text = TextEncoder(**json.loads((text_dir / "config.json").read_text()))
    text.load_state_dict(load_file(str(text_dir / "model.safetensors")), strict=True)
    vocab = json.loads((folder / record["tokenizer"] / "vocabulary.json").read_text())
    return DiffusionModel(cfg, dit, text, WordTokenizer(vocab["vocabulary"], vocab["max_length"]))
