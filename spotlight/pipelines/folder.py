"""A diffusers pipeline folder, read without loading any weights: which family it is, its latent
shape for an image size, its scheduler's time shift, its LoRA targets.

Everything here reads JSON only (`model_index.json` and the components' configs), so a recipe is
checked — folder, pipeline class, components, image size — before anything is started, and each
bad input is one line (`ConfigError` / `NotFound`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from spotlight.errors import ConfigError, NotFound

PIPELINES = {
    "QwenImagePipeline": "qwen-image",
    "FluxPipeline": "flux",
    "StableDiffusion3Pipeline": "sd3",
}
"""Supported pipeline classes (model_index.json's `_class_name`) and their family."""

COMPONENTS = {
    "qwen-image": ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"),
    "flux": ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"),
    "sd3": (
        "transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
        "text_encoder_3", "tokenizer_3",
    ),
}

LORA_TARGETS = {
    # diffusers examples/dreambooth/train_dreambooth_lora_qwen_image.py
    "qwen-image": ["to_k", "to_q", "to_v", "to_out.0"],
    # diffusers examples/dreambooth/train_dreambooth_lora_flux.py (default --lora_layers)
    "flux": [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
        "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
        "ff_context.net.2",
    ],
    # diffusers examples/dreambooth/train_dreambooth_lora_sd3.py (the same list Flow-GRPO's SD3 uses)
    "sd3": [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
        "attn.to_out.0", "attn.to_q", "attn.to_v",
    ],
}
"""LoRA target modules per family: the lists diffusers' own training scripts use."""

# scheduler options whose sigma schedule the project's sampler does not reproduce
_UNSUPPORTED_SCHEDULE = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                         "stochastic_sampling")


@dataclass(frozen=True, slots=True)
class PipelineFolder:
    """What a pipeline folder says about itself (JSON only)."""

    path: Path
    pipeline_class: str
    family: str
    index: dict
    transformer: dict
    vae: dict
    scheduler: dict

    @property
    def vae_scale(self) -> int:
        """Pixels per latent side."""
        if self.family == "qwen-image":
            return 2 ** len(self.vae["temperal_downsample"])
        return 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def latent_channels(self) -> int:
        return self.vae["z_dim"] if self.family == "qwen-image" else self.vae["latent_channels"]

    @property
    def patch(self) -> int:
        """Latent pixels per transformer token side (2x2 packing for Qwen-Image and FLUX)."""
        return 2 if self.family in ("qwen-image", "flux") else self.transformer["patch_size"]

    def latent_shape(self, image_size: int) -> tuple[int, int, int]:
        """(C, h, w) of the normalised latent of a square image; the size must divide evenly."""
        unit = self.vae_scale * self.patch
        if image_size % unit:
            raise ConfigError(
                f"model.image_size {image_size} must be a multiple of {unit} for {self.path} "
                f"(VAE scale {self.vae_scale} x patch {self.patch})"
            )
        side = image_size // self.vae_scale
        return (self.latent_channels, side, side)

    def tokens(self, image_size: int) -> int:
        _, h, w = self.latent_shape(image_size)
        return (h // self.patch) * (w // self.patch)

    def shift(self, image_size: int) -> float:
        """The scheduler's time shift s for this image size, in t' = s·t / (1 + (s−1)·t): its static
        `shift`, or with `use_dynamic_shifting` exp(mu) (mu linear in the image's token count, as
        the pipelines' `calculate_shift`; 'linear' time_shift_type: mu itself)."""
        s = self.scheduler
        if not s.get("use_dynamic_shifting"):
            return float(s.get("shift", 1.0))
        lo, hi = s.get("base_image_seq_len", 256), s.get("max_image_seq_len", 4096)
        b0, b1 = s.get("base_shift", 0.5), s.get("max_shift", 1.15)
        m = (b1 - b0) / (hi - lo)
        mu = self.tokens(image_size) * m + (b0 - m * lo)
        return math.exp(mu) if s.get("time_shift_type", "exponential") == "exponential" else mu

    @property
    def shift_terminal(self) -> float | None:
        return self.scheduler.get("shift_terminal") or None


def read_folder(path: str | Path) -> PipelineFolder:
    """Check and read a pipeline folder's JSON: model_index.json, a supported class, every
    component its family needs."""
    path = Path(path)
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise NotFound(f"model.pipeline: {path} has no model_index.json (not a diffusers pipeline folder)")
    index = json.loads(index_file.read_text())
    cls = index.get("_class_name")
    if cls not in PIPELINES:
        raise ConfigError(
            f"model.pipeline: {path} is a {cls}; supported pipelines: {', '.join(PIPELINES)}"
        )
    family = PIPELINES[cls]
    for name in COMPONENTS[family]:
        entry = index.get(name)
        if not entry or entry[0] is None or not (path / name).is_dir():
            raise ConfigError(f"model.pipeline: {path} lacks the {name} component {cls} needs")
    configs = {}
    for name, file in (("transformer", "config.json"), ("vae", "config.json"),
                       ("scheduler", "scheduler_config.json")):
        f = path / name / file
        if not f.is_file():
            raise ConfigError(f"model.pipeline: {path} lacks {name}/{file}")
        configs[name] = json.loads(f.read_text())
    if bad := [k for k in _UNSUPPORTED_SCHEDULE if configs["scheduler"].get(k)]:
        raise ConfigError(f"model.pipeline: {path}: scheduler option(s) {', '.join(bad)} are not supported")
    return PipelineFolder(path, cls, family, index, **configs)


def check_lora_targets(folder: PipelineFolder, targets: list[str], module_names: list[str]) -> None:
    """Every target must name at least one module of the transformer (peft's suffix match)."""
    for t in targets:
        if not any(n == t or n.endswith("." + t) for n in module_names):
            raise ConfigError(f"model.lora_targets: {t!r} matches no module of {folder.path}/transformer")
