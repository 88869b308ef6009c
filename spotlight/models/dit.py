"""Diffusion transformers: diffusers DiT classes behind one velocity interface.

`DiffusionModel` = a diffusers DiT (the denoiser) + the project's text encoder. Its one job is
`velocity(x_t, t, prompts)`: the flow-matching velocity (≈ ε − x_0) for images in pixel space
[B, C, H, W] at times t in [0, 1]. Each supported diffusers class has a small adapter that knows
that class's calling convention (token packing, RoPE ids, timestep scale). The default is
`QwenImageTransformer2DModel` — the class of the paper's Qwen-Image — with a tiny config.

Models know nothing of RL, actors, queues or parallelism.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from spotlight.errors import ConfigError, NotFound
from spotlight.models.text import TextEncoder, WordTokenizer

SUPPORTED = ("QwenImageTransformer2DModel", "SD3Transformer2DModel", "FluxTransformer2DModel")


TEXT_EMBEDDINGS = ("token", "letter_place")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which DiT to build or load, and the image space it works in."""

    dit_class: str = "QwenImageTransformer2DModel"
    """diffusers class name of the denoiser; one of SUPPORTED."""
    dit_path: str | None = None
    """Local folder written by `save_pretrained`; None builds a fresh tiny model of `dit_class`."""
    checkpoint: str | None = "builtin:base"
    """Spotlight checkpoint (.safetensors with DiT + text encoder); 'builtin:base' = the shipped base.
    A checkpoint of LoRA fine-tuning starts a run (or an eval) from its base with the adapter merged."""
    image_size: int = 32
    """Height of the pixel canvas the model generates (and its width unless `image_width` is set)."""
    image_width: int = 0
    """Width of the canvas; 0 = `image_size` (a square). A text strip is e.g. 16x64."""
    channels: int = 3
    patch: int = 4
    """Pixels per token side; 32x32 at patch 4 = 64 image tokens."""
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    text_dim: int = 64
    text_layers: int = 2
    """Transformer layers of a fresh text encoder; 0 = none: each token is its embedding plus its
    position, whatever the prompt around it."""
    text_embedding: str = "token"
    """How a fresh text encoder embeds the spelled letters of quoted text (the text task): 'token'
    (a vector per letter-at-place token) or 'letter_place' (letter + place vectors, shared:
    `TextEncoder`'s `spelling`). A checkpoint's own encoder is loaded as it was saved."""
    pipeline: str | None = None
    """A diffusers pipeline folder (model_index.json: Qwen-Image, FLUX, SD3) to post-train instead
    of the embedded tiny model: the DiT works in its VAE's latent space (spotlight.pipelines);
    `image_size` is then the pixel side of the decoded image, and dit_*, channels, patch and the
    text fields are not used."""
    guidance_scale: float | None = None
    """Pipelines: true-CFG scale (Qwen-Image, SD3; > 1 runs a negative-prompt forward) or FLUX-dev's
    guidance embedding; None = the pipeline's own default (4.0, 3.5, 7.0)."""
    negative_prompt: str = ""
    """Pipelines: the CFG negative prompt (Qwen-Image, SD3)."""
    max_sequence_length: int = 128
    """Pipelines: text tokens kept per prompt (the pipelines' `max_sequence_length`)."""
    text_cache: str | None = None
    """Pipelines: folder of the prompt-embedding cache; None = ~/.cache/spotlight/text-embeddings."""
    lora_targets: list[str] | None = None
    """Pipelines: LoRA target modules; None = those diffusers' training script uses for the class."""
    pipeline_shift: bool = True
    """Pipelines: take sampler.shift (and shift_terminal) from the folder's scheduler (its static
    shift, or its dynamic shift for this image size); false keeps the recipe's."""
    dtype: str = "float32"
    """Pipelines: 'float32' or 'bfloat16' for the transformer's and VAE's weights; trainable LoRA
    weights (and their optimizer state) stay float32 either way."""
    gradient_checkpointing: bool = False
    """Pipelines: recompute each transformer block in the backward pass (diffusers'
    `enable_gradient_checkpointing`): activation memory of one block instead of all."""

    def __post_init__(self) -> None:
        if self.pipeline is not None:  # the folder itself is checked where the recipe is read
            if self.image_width:
                raise ConfigError("model.image_width is the embedded model's; a pipeline's canvas is "
                                  "model.image_size square")
            if self.max_sequence_length < 1:
                raise ConfigError(f"model.max_sequence_length must be >= 1, got {self.max_sequence_length}")
            if self.dtype not in ("float32", "bfloat16"):
                raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
            if self.guidance_scale is not None and self.guidance_scale < 0:
                raise ConfigError(f"model.guidance_scale must be >= 0, got {self.guidance_scale}")
        if self.dit_class not in SUPPORTED:
            raise ConfigError(f"model.dit_class: {self.dit_class!r} is not one of {', '.join(SUPPORTED)}")
        for name in (
            "image_size",
            "channels",
            "patch",
            "layers",
            "heads",
            "head_dim",
            "text_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.text_layers < 0:
            raise ConfigError(f"model.text_layers must be >= 0, got {self.text_layers}")
        if self.pipeline is None and self.image_size % self.patch:  # a pipeline's: its VAE and patch
            raise ConfigError(
                f"model.image_size ({self.image_size}) must be a multiple of model.patch ({self.patch})"
            )
        if self.image_width < 0 or self.image_width % self.patch:
            raise ConfigError(
                f"model.image_width ({self.image_width}) must be 0 or a positive multiple of model.patch"
            )
        if self.shape[1] != self.shape[2] and self.dit_class == "SD3Transformer2DModel":
            raise ConfigError("model.image_width: SD3's position grid is square (use Qwen-Image, Flux)")
        if self.text_embedding not in TEXT_EMBEDDINGS:
            raise ConfigError(f"model.text_embedding must be one of {', '.join(TEXT_EMBEDDINGS)}, "
                              f"got {self.text_embedding!r}")
        if self.head_dim % 4:
            raise ConfigError(f"model.head_dim must be a multiple of 4 (RoPE axes), got {self.head_dim}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one generated image."""
        return (self.channels, self.image_size, self.image_width or self.image_size)

    @property
    def tokens(self) -> int:
        """Image tokens per sample."""
        return (self.image_size // self.patch) * ((self.image_width or self.image_size) // self.patch)


def tiny_dit(cfg: ModelConfig) -> nn.Module:
    """A fresh tiny diffusers DiT of `cfg.dit_class`."""
    import diffusers

    cls = getattr(diffusers, cfg.dit_class)
    tokens_in = cfg.channels * cfg.patch**2
    # RoPE axes (frame, row, column) must sum to the head dim; rows and columns get 3/8 each
    side = cfg.head_dim * 3 // 8
    rope = (cfg.head_dim - 2 * side, side, side)
    if cfg.dit_class == "QwenImageTransformer2DModel":
        return cls(
            patch_size=cfg.patch,
            in_channels=tokens_in,
            out_channels=cfg.channels,
            num_layers=cfg.layers,
            attention_head_dim=cfg.head_dim,
            num_attention_heads=cfg.heads,
            joint_attention_dim=cfg.text_dim,
            axes_dims_rope=rope,
        )
    if cfg.dit_class == "FluxTransformer2DModel":
        return cls(
            patch_size=1,
            in_channels=tokens_in,
            out_channels=tokens_in,
            num_layers=cfg.layers // 2 or 1,
            num_single_layers=cfg.layers - cfg.layers // 2,
            attention_head_dim=cfg.head_dim,
            num_attention_heads=cfg.heads,
            joint_attention_dim=cfg.text_dim,
            pooled_projection_dim=cfg.text_dim,
            axes_dims_rope=rope,
        )
    return cls(
        sample_size=cfg.image_size,
        patch_size=cfg.patch,
        in_channels=cfg.channels,
        num_layers=cfg.layers,
        attention_head_dim=cfg.head_dim,
        num_attention_heads=cfg.heads,
        joint_attention_dim=cfg.text_dim,
        caption_projection_dim=cfg.heads * cfg.head_dim,
        pooled_projection_dim=cfg.text_dim,
        out_channels=cfg.channels,
        pos_embed_max_size=cfg.image_size // cfg.patch,
    )


def load_dit(dit_class: str, path: str | Path) -> nn.Module:
    """`from_pretrained` of a diffusers DiT class from a local folder (no hub access)."""
    import diffusers

    if dit_class not in SUPPORTED:
        raise ConfigError(f"model.dit_class: {dit_class!r} is not one of {', '.join(SUPPORTED)}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise NotFound(f"model.dit_path: {path} is not a saved diffusers model folder (no config.json)")
    return getattr(diffusers, dit_class).from_pretrained(path, local_files_only=True)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)(W/p), C·p·p] tokens, row-major over the token grid."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(tokens: torch.Tensor, p: int, c: int, h: int, w: int) -> torch.Tensor:
    b = tokens.shape[0]
    x = tokens.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class DiffusionModel(nn.Module):
    """A diffusers DiT + the project's text encoder, with one `velocity` call for every class."""

    def __init__(self, cfg: ModelConfig, dit: nn.Module, text: TextEncoder, tokenizer: WordTokenizer):
        super().__init__()
        self.cfg, self.dit, self.text, self.tokenizer = cfg, dit, text, tokenizer

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Text hidden states [B, L, D] and mask [B, L] (computed once per prompt batch)."""
        ids, mask = self.tokenizer(prompts)
        device = next(self.text.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        return self.text(ids, mask), mask

    def velocity(
        self, x: torch.Tensor, t: torch.Tensor, text: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Velocity for pixels x [B, C, H, W] at times t [B] in [0, 1] given encoded text."""
        hidden, mask = text
        cfg, (b, c, h, w) = self.cfg, x.shape
        if cfg.dit_class == "SD3Transformer2DModel":
            return self.dit(
                hidden_states=x,
                encoder_hidden_states=hidden,
                pooled_projections=_pool(hidden, mask),
                timestep=t * 1000,
                return_dict=False,
            )[0]
        tokens = patchify(x, cfg.patch)
        gh, gw = h // cfg.patch, w // cfg.patch
        if cfg.dit_class == "QwenImageTransformer2DModel":
            out = self.dit(
                hidden_states=tokens,
                encoder_hidden_states=hidden,
                encoder_hidden_states_mask=mask,
                timestep=t,
                img_shapes=[[(1, gh, gw)]] * b,
                return_dict=False,
            )[0]
        else:  # Flux: explicit RoPE position ids, timestep in [0, 1]
            img_ids = torch.zeros(gh, gw, 3, device=x.device)
            img_ids[..., 1] = torch.arange(gh, device=x.device)[:, None]
            img_ids[..., 2] = torch.arange(gw, device=x.device)[None, :]
            out = self.dit(
                hidden_states=tokens,
                encoder_hidden_states=hidden,
                pooled_projections=_pool(hidden, mask),
                timestep=t,
                img_ids=img_ids.reshape(-1, 3),
                txt_ids=torch.zeros(hidden.shape[1], 3, device=x.device),
                return_dict=False,
            )[0]
        return unpatchify(out, cfg.patch, c, h, w)

    # --- checkpoints -----------------------------------------------------------------------
    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """One safetensors file holding DiT + text encoder weights; configs in its metadata."""
        from safetensors.torch import save_file

        meta = {
            "model": json.dumps(asdict(self.cfg)),
            "dit_config": json.dumps(dict(self.dit.config)),
            "text": json.dumps(self.text.config),
            "vocabulary": json.dumps(self.tokenizer.vocabulary),
            "extra": json.dumps(extra or {}),
        }
        if (lora := lora_config(self.dit)) is not None:  # the adapter's peft config, to re-attach it on load
            meta["lora"] = json.dumps(lora)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata=meta)


def lora_config(dit: nn.Module) -> dict | None:
    """The peft config of the DiT's LoRA adapter (JSON-ready), or None without one."""
    config = getattr(dit, "peft_config", {}).get("default")
    if config is None:
        return None
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def attach_lora(dit: nn.Module, config: dict) -> None:
    """Re-attach a LoRA adapter saved with `lora_config` (its weights come from the state dict)."""
    from peft import LoraConfig

    dit.add_adapter(LoraConfig(**config))


def _pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


BUILTIN_BASE = Path(__file__).resolve().parent.parent / "assets" / "base.safetensors"


def resolve_checkpoint(path: str) -> Path:
    """'builtin:NAME' = the shipped `spotlight/assets/NAME.safetensors` (base: the shapes task,
    ocr_base: the text task); anything else is a file path."""
    builtin = path.startswith("builtin:")
    p = BUILTIN_BASE.with_name(path.removeprefix("builtin:") + ".safetensors") if builtin else Path(path)
    if not p.is_file():
        raise NotFound(
            f"model.checkpoint: {p} does not exist" + (" (run `spotlight pretrain`)" if builtin else "")
        )
    return p


def build_model(cfg: ModelConfig, vocabulary, *, merge_lora: bool = True) -> DiffusionModel:
    """Build (fresh or from a checkpoint / diffusers folder) the model a recipe names.

    A checkpoint saved with a LoRA adapter gets it back; `merge_lora` folds it into the base weights
    (W + scale·B·A, peft's fuse) so the result is a plain model of the same forward up to float
    rounding — what a run or an eval starts from. `merge_lora=False` keeps the adapter (export)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if cfg.pipeline is not None:
        raise ConfigError("model.pipeline names a diffusers pipeline folder: build it with "
                          "spotlight.work.recipe_model (spotlight.pipelines), not the embedded DiT's builder")
    if cfg.checkpoint is not None:
        path = resolve_checkpoint(cfg.checkpoint)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        saved = json.loads(meta["model"])
        keep = {"checkpoint": cfg.checkpoint, "dit_path": cfg.dit_path}
        if cfg.dit_path:  # the DiT comes from the diffusers folder, only the text encoder from here
            keep["dit_class"] = cfg.dit_class
        cfg = ModelConfig(**{**saved, **keep})
        vocabulary = json.loads(meta["vocabulary"])
        model = _assemble(cfg, vocabulary, json.loads(meta["text"]))
        state = load_file(str(path))
        if cfg.dit_path:
            state = {k: v for k, v in state.items() if k.startswith("text.")}
        elif "lora" in meta:
            attach_lora(model.dit, json.loads(meta["lora"]))
        elif any(".lora_A." in k for k in state):
            raise ConfigError(
                f"model.checkpoint {path}: LoRA weights without the adapter's config (saved "
                f"before checkpoints recorded it), so its scale lora_alpha/r is unknown"
            )
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or (missing and cfg.dit_path is None):
            raise ConfigError(
                f"model.checkpoint {path}: weights do not match "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        if merge_lora and lora_config(model.dit) is not None:
            model.dit.fuse_lora()
            model.dit.unload_lora()  # the fused base layers stay, the adapter layers go
            model.dit.requires_grad_(True)  # peft froze the base while the adapter was attached
        return model
    return _assemble(cfg, vocabulary, None)


def _assemble(cfg: ModelConfig, vocabulary, text_cfg: dict | None) -> DiffusionModel:
    tokenizer = WordTokenizer(vocabulary)
    if text_cfg is None:
        text_cfg = dict(
            vocab_size=len(tokenizer),
            dim=cfg.text_dim,
            layers=cfg.text_layers,
            heads=4,
            max_length=tokenizer.max_length,
        )
        if cfg.text_embedding == "letter_place":
            if (spelling := tokenizer.spelling()) is None:
                raise ConfigError("model.text_embedding = 'letter_place' needs spelled letters in the "
                                  "vocabulary (the text task's); this one has none: use 'token'")
            text_cfg["spelling"] = spelling
    dit = load_dit(cfg.dit_class, cfg.dit_path) if cfg.dit_path else tiny_dit(cfg)
    return DiffusionModel(cfg, dit, TextEncoder(**text_cfg), tokenizer)
