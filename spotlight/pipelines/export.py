"""Export a post-trained pipeline model back into diffusers.

- LoRA: `pytorch_lora_weights.safetensors` written by the pipeline class's own
  `save_lora_weights` (with the adapter's peft config as metadata, so lora_alpha ≠ rank survives
  the reload); read with `pipe.load_lora_weights(OUT)` on the base folder's pipeline.
- full fine-tuning: a complete pipeline folder — the base folder's components with the trained
  transformer `save_pretrained` in place of its own; read with `DiffusionPipeline.from_pretrained(OUT)`.

`spotlight.json` beside them names the base folder and what was written. Knows the pipeline model
and diffusers' public save / load functions; nothing of training or actors.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from spotlight.models.dit import attach_lora, lora_config

FORMAT = "spotlight-pipeline-export/1"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def export_model(model, out: str | Path, extra: dict | None = None) -> dict:
    """Write `model` (a `PipelineModel`) to `out`: the LoRA adapter, or a whole pipeline folder."""
    import diffusers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    folder, lora = model.folder, lora_config(model.dit)
    if lora is not None:
        from peft import get_peft_model_state_dict

        cls = getattr(diffusers, folder.pipeline_class)
        cls.save_lora_weights(
            out,
            transformer_lora_layers=get_peft_model_state_dict(model.dit),
            transformer_lora_adapter_metadata=model.dit.peft_config["default"].to_dict(),
            weight_name=LORA_WEIGHTS,
        )
        parts = ["lora"]
    else:
        for sub in folder.path.iterdir():
            if sub.name == "transformer":
                continue
            (shutil.copytree if sub.is_dir() else shutil.copy2)(sub, out / sub.name)
        model.dit.save_pretrained(out / "transformer", safe_serialization=True)
        parts = ["pipeline"]
    record = {"format": FORMAT, "base": str(folder.path.resolve()), "pipeline_class": folder.pipeline_class,
              "parts": parts, "model": asdict(model.cfg), **(extra or {})}
    (out / "spotlight.json").write_text(json.dumps(record, indent=2))
    return record


def export_checkpoint(path: str | Path, out: str | Path) -> dict:
    """A run's pipeline checkpoint (`PipelineModel.save`) exported with `export_model`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from spotlight.models.dit import ModelConfig
    from spotlight.pipelines.model import load_pipeline_model

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = load_pipeline_model(ModelConfig(**json.loads(meta["model"])))
    if "lora" in meta:
        attach_lora(model.dit, json.loads(meta["lora"]))
    model.load_state_dict(load_file(str(path)))
    return export_model(model, out, {"checkpoint": str(path), **json.loads(meta.get("extra", "{}"))})
