"""A diffusers pipeline folder as the project's model: velocity in the pipeline's latent space.

`PipelineModel` has the interface the sampler, the trainer and the workers use
(`encode(prompts)`, `velocity(x, t, text)`, `dit`, `text`) plus `decode(x)` → images. Its state
x is the pipeline's *normalised* latent [B, C, h, w] — what the pipeline's denoising loop
iterates on, before packing — so the flow-matching SDE/ODE, the exact log-probs and the GRPO/AWM
objectives run on it unchanged, and rewards see `decode(x)`. Per family it calls the transformer
exactly as that pipeline's `__call__` does:

- qwen-image: 2x2 packing, `img_shapes` for the RoPE, timestep = t, true CFG with a negative
  prompt and the pipeline's norm rescale; latents de-normalised with the VAE's latents_mean/std;
- flux: 2x2 packing, `img_ids` / `txt_ids` RoPE positions, timestep = t, the guidance embedding
  (FLUX.1-dev) when the transformer has one; latents / scaling_factor + shift_factor;
- sd3: unpacked latents (the transformer patchifies), timestep = 1000·t, CFG with a negative prompt;
  latents / scaling_factor + shift_factor.

Only the transformer and the VAE (its decoder; the encoder is dropped) are loaded here; the text
encoders run once per prompt through `spotlight.pipelines.text.PromptEmbeddings`.
Knows nothing of RL, actors or queues.
"""

from __future__ import annotations

import torch
from torch import nn

from spotlight.errors import ConfigError
from spotlight.models.dit import lora_config, patchify, unpatchify
from spotlight.pipelines.folder import LORA_TARGETS, PipelineFolder, check_lora_targets, read_folder
from spotlight.pipelines.text import PromptEmbeddings

GUIDANCE = {"qwen-image": 4.0, "flux": 3.5, "sd3": 7.0}
"""Each pipeline's default guidance scale (`true_cfg_scale` / `guidance_scale` of its __call__)."""


class Conditioning(dict):
    """A batch's text conditioning: name → batched tensor ('embeds', 'mask', 'pooled', and the
    negative prompt's 'neg_*' when CFG is on)."""


class PipelineModel(nn.Module):
    """Transformer + VAE decoder of a pipeline folder, with its cached prompt embeddings."""

    def __init__(self, cfg, folder: PipelineFolder, dit: nn.Module, vae: nn.Module, text: PromptEmbeddings):
        super().__init__()
        self.cfg, self.folder, self.dit, self.vae, self.text = cfg, folder, dit, vae, text
        self.family = folder.family
        self.guidance = cfg.guidance_scale if cfg.guidance_scale is not None else GUIDANCE[self.family]
        self.lora_targets = list(cfg.lora_targets or LORA_TARGETS[self.family])
        check_lora_targets(folder, self.lora_targets, [n for n, _ in dit.named_modules()])

    @property
    def cfg_on(self) -> bool:
        """True CFG (a second, negative-prompt forward): Qwen-Image and SD3 with guidance > 1."""
        return self.family in ("qwen-image", "sd3") and self.guidance > 1

    # --- text ------------------------------------------------------------------------------------
    def conditioning_prompts(self, prompts: list[str]) -> list[str]:
        """The prompts whose embeddings `encode(prompts)` reads (the negative prompt under CFG)."""
        return list(dict.fromkeys([*prompts, *([self.cfg.negative_prompt] if self.cfg_on else [])]))

    def encode(self, prompts: list[str]) -> Conditioning:
        device = next(self.dit.parameters()).device
        cond = Conditioning(_batch(self.text.get(prompts), device))
        if self.cfg_on:
            neg = _batch(self.text.get([self.cfg.negative_prompt] * len(prompts)), device)
            cond.update({f"neg_{k}": v for k, v in neg.items()})
        return cond

    # --- the denoiser ------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, t: torch.Tensor, text: Conditioning) -> torch.Tensor:
        """Velocity (≈ ε − x_0) of normalised latents x [B, C, h, w] at times t [B] in [0, 1]."""
        v = self._forward(x, t, text.get("embeds"), text.get("mask"), text.get("pooled"))
        if not self.cfg_on:
            return v
        neg = self._forward(x, t, text["neg_embeds"], text.get("neg_mask"), text.get("neg_pooled"))
        comb = neg + self.guidance * (v - neg)
        if self.family == "qwen-image":  # the pipeline rescales each token's prediction to the cond norm
            p = self.folder.patch
            cn = patchify(v, p).norm(dim=-1, keepdim=True)
            packed = patchify(comb, p)
            packed = packed * (cn / packed.norm(dim=-1, keepdim=True))
            return unpatchify(packed, p, *x.shape[1:])
        return comb

    def _forward(self, x, t, embeds, mask, pooled) -> torch.Tensor:
        """One transformer call in its weights' dtype; the velocity comes back in x's dtype."""
        dtype = getattr(torch, self.cfg.dtype)
        if dtype != x.dtype:
            pooled = None if pooled is None else pooled.to(dtype)
            return self._call(x.to(dtype), t, embeds.to(dtype), mask, pooled).to(x.dtype)
        return self._call(x, t, embeds, mask, pooled)

    def _call(self, x, t, embeds, mask, pooled) -> torch.Tensor:
        b, c, h, w = x.shape
        if self.family == "sd3":
            return self.dit(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                            timestep=t * 1000, return_dict=False)[0]
        p = self.folder.patch
        tokens = patchify(x, p)
        if self.family == "qwen-image":
            out = self.dit(hidden_states=tokens, encoder_hidden_states=embeds,
                           encoder_hidden_states_mask=mask, timestep=t,
                           img_shapes=[[(1, h // p, w // p)]] * b, return_dict=False)[0]
        else:
            img_ids = torch.zeros(h // p, w // p, 3, device=x.device, dtype=x.dtype)
            img_ids[..., 1] = torch.arange(h // p, device=x.device)[:, None]
            img_ids[..., 2] = torch.arange(w // p, device=x.device)[None, :]
            guidance = None
            if self.dit.config.guidance_embeds:
                guidance = torch.full((b,), float(self.guidance), device=x.device, dtype=torch.float32)
            out = self.dit(hidden_states=tokens, encoder_hidden_states=embeds, pooled_projections=pooled,
                           timestep=t, guidance=guidance, img_ids=img_ids.reshape(-1, 3),
                           txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype),
                           return_dict=False)[0]
        return unpatchify(out, p, c, h, w)

    # --- weights -------------------------------------------------------------------------------------
    def _own(self, key: str) -> bool:
        """Weights a run owns (the rest — the VAE, and under LoRA the base — stay in the folder)."""
        if not key.startswith("dit."):
            return False
        return ".lora_" in key if lora_config(self.dit) is not None else True

    def state_dict(self, *args, **kwargs):
        """The transformer's weights, or only the LoRA adapter's when one is attached: what a
        checkpoint holds and what a worker receives each iteration."""
        full = super().state_dict(*args, **kwargs)
        return type(full)((k, v) for k, v in full.items() if self._own(k))

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state, strict=False, assign=assign)
        missing = [k for k in missing if self._own(k)]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"pipeline weights do not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
        return missing, unexpected

    def save(self, path, extra: dict | None = None) -> None:
        """One safetensors file of `state_dict()`; the model config and LoRA config in its metadata."""
        import json
        from dataclasses import asdict
        from pathlib import Path

        from safetensors.torch import save_file

        meta = {"model": json.dumps(asdict(self.cfg)), "extra": json.dumps(extra or {}),
                "pipeline_class": self.folder.pipeline_class}
        if (lora := lora_config(self.dit)) is not None:
            meta["lora"] = json.dumps(lora)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path), metadata=meta)

    # --- images ----------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] of normalised latents x, as the pipeline decodes them."""
        vc = self.vae.config
        x = x.to(getattr(torch, self.cfg.dtype))
        if self.family == "qwen-image":
            mean = torch.tensor(vc.latents_mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
            std = torch.tensor(vc.latents_std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
            raw = (x * std + mean)[:, :, None]
            return self.vae.decode(raw, return_dict=False)[0][:, :, 0].float().clamp(-1, 1)
        raw = x / vc.scaling_factor + (vc.shift_factor or 0.0)
        return self.vae.decode(raw, return_dict=False)[0].float().clamp(-1, 1)


def _batch(items: list[dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    """Stack per-prompt embeddings; sequences of different lengths are zero-padded with a mask
    (Qwen-Image's variable-length text), otherwise no mask, as the pipeline passes."""
    out = {}
    lengths = {it["embeds"].shape[0] for it in items}
    if len(lengths) == 1:
        out["embeds"] = torch.stack([it["embeds"] for it in items]).to(device)
    else:
        n = max(lengths)
        out["embeds"] = torch.stack(
            [torch.cat([e := it["embeds"], e.new_zeros(n - e.shape[0], e.shape[1])]) for it in items]
        ).to(device)
        out["mask"] = torch.stack(
            [torch.arange(n) < it["embeds"].shape[0] for it in items]
        ).long().to(device)
    if "pooled" in items[0]:
        out["pooled"] = torch.stack([it["pooled"] for it in items]).to(device)
    return out


def load_pipeline_model(cfg) -> PipelineModel:
    """The model `cfg.pipeline` names: its transformer and VAE (decoder only) with the classes
    model_index.json names, frozen VAE, and its prompt-embedding cache."""
    import diffusers

    folder = read_folder(cfg.pipeline)
    folder.latent_shape(cfg.image_size)  # the size check, before any weights load
    classes = {name: folder.index[name][1] for name in ("transformer", "vae")}
    dtype = getattr(torch, cfg.dtype)
    try:
        dit = getattr(diffusers, classes["transformer"]).from_pretrained(
            folder.path / "transformer", local_files_only=True, torch_dtype=dtype)
        vae = getattr(diffusers, classes["vae"]).from_pretrained(
            folder.path / "vae", local_files_only=True, torch_dtype=dtype)
    except (OSError, AttributeError) as e:
        raise ConfigError(f"model.pipeline: {folder.path}: cannot load its transformer/vae ({e})") from None
    if folder.family != "qwen-image":  # rollouts decode only (Qwen-Image's VAE walks its encoder's
        vae.encoder = None  # convolutions to reset its decode cache, so it keeps it)
    vae.requires_grad_(False).eval()
    dit.eval()
    if cfg.gradient_checkpointing:
        dit.enable_gradient_checkpointing()
    text = PromptEmbeddings(folder, cfg.max_sequence_length, cfg.text_cache)
    return PipelineModel(cfg, folder, dit, vae, text)
