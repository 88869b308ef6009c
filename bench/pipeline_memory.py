"""Parameters and memory per role for each pipeline family, at full size and on the tiny folders.

    PYTHONPATH=. python bench/pipeline_memory.py [--tiny DIR ...]

Full-size models are built on torch's `meta` device from their published configs (no weights, no
download), so parameter counts are exact for those configs. Bytes per role (DESIGN §9):

- text encoder(s): run once per prompt (bf16 weights); never on a rollout worker;
- rollout / exploration worker: transformer (bf16) + VAE decoder (bf16) + the LoRA delta;
- trainer, LoRA: transformer (bf16, frozen) + the adapter in fp32 with its fp32 gradient and
  AdamW's two fp32 moments (16 bytes per trainable parameter);
- trainer, full fine-tuning under FSDP2 on 8 GPUs: fp32 parameters, gradients and AdamW moments
  (16 bytes per parameter) sharded 8 ways, plus one gathered bf16 block at a time.

Activations are not in these figures (they depend on batch, tokens and gradient checkpointing;
the GPU calibration measures them). "fits" compares weights + optimizer state with 80 GB (H100) and
141 GB (H200), keeping 10% for the CUDA context and fragmentation.
"""

from __future__ import annotations

import argparse

import torch

GB = 1e9
LORA_RANK = 32

# The 16-channel VAE FLUX.1 and SD3/3.5 share, and their CLIP-L and T5-XXL text encoders (the folders'
# configs).
SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
              feed_forward_proj="gated-gelu")
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              vocab_size=49408)

FULL = {
    "qwen-image": {
        "transformer": (
            "QwenImageTransformer2DModel",
            dict(
                patch_size=2,
                in_channels=64,
                out_channels=16,
                num_layers=60,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=3584,
                axes_dims_rope=(16, 56, 56),
            ),
        ),
        "vae": (
            "AutoencoderKLQwenImage",
            dict(
                base_dim=96,
                z_dim=16,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=2,
                temperal_downsample=[False, True, True],
            ),
        ),
        "text": [
            (
                "Qwen2_5_VLForConditionalGeneration",
                "Qwen2_5_VLConfig",
                dict(
                    text_config=dict(
                        vocab_size=152064,
                        hidden_size=3584,
                        intermediate_size=18944,
                        num_hidden_layers=28,
                        num_attention_heads=28,
                        num_key_value_heads=4,
                    ),
                    vision_config=dict(
                        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584
                    ),
                    vocab_size=152064,
                ),
            )
        ],
    },
    "flux": {
        "transformer": (
            "FluxTransformer2DModel",
            dict(
                patch_size=1,
                in_channels=64,
                num_layers=19,
                num_single_layers=38,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            ),
        ),
        "vae": ("AutoencoderKL", SD_VAE),
        "text": [
            (
                "CLIPTextModel",
                "CLIPTextConfig",
                dict(
                    **CLIP_L,
                ),
            ),
            (
                "T5EncoderModel",
                "T5Config",
                T5_XXL,
            ),
        ],
    },
    "sd3": {  # SD3.5 Medium
        "transformer": (
            "SD3Transformer2DModel",
            dict(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                num_layers=24,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                out_channels=16,
                pos_embed_max_size=384,
                qk_norm="rms_norm",
                dual_attention_layers=tuple(range(13)),
            ),
        ),
        "vae": ("AutoencoderKL", SD_VAE),
        "text": [
            (
                "CLIPTextModelWithProjection",
                "CLIPTextConfig",
                dict(
                    **CLIP_L,
                    projection_dim=768,
                ),
            ),
            (
                "CLIPTextModelWithProjection",
                "CLIPTextConfig",
                dict(
                    hidden_size=1280,
                    intermediate_size=5120,
                    num_hidden_layers=32,
                    num_attention_heads=20,
                    vocab_size=49408,
                    projection_dim=1280,
                ),
            ),
            (
                "T5EncoderModel",
                "T5Config",
                T5_XXL,
            ),
        ],
    },
}


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lora_params(dit: torch.nn.Module, targets: list[str], rank: int = LORA_RANK) -> int:
    """Parameters of a rank-`rank` LoRA on every Linear whose name ends with a target (peft's match)."""
    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in dit.named_modules()
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    )


def full_size(family: str) -> dict:
    import diffusers
    import transformers

    spec = FULL[family]
    with torch.device("meta"):
        cls, kw = spec["transformer"]
        dit = getattr(diffusers, cls)(**kw)
        vcls, vkw = spec["vae"]
        vae = getattr(diffusers, vcls)(**vkw)
        text = sum(
            count(getattr(transformers, m)(getattr(transformers, c)(**ckw))) for m, c, ckw in spec["text"]
        )
    return {"dit": dit, "vae_decoder": count(vae) - count(vae.encoder), "text": text}


def tiny(folder: str) -> dict:
    import diffusers

    from spotlight.pipelines.folder import read_folder

    f = read_folder(folder)
    dit = getattr(diffusers, f.index["transformer"][1]).from_pretrained(f"{folder}/transformer")
    vae = getattr(diffusers, f.index["vae"][1]).from_pretrained(f"{folder}/vae")
    text = 0
    for name in f.index:
        if name.startswith("text_encoder") and f.index[name][0]:
            import transformers

            text += count(getattr(transformers, f.index[name][1]).from_pretrained(f"{folder}/{name}"))
    return {"dit": dit, "vae_decoder": count(vae) - count(vae.encoder), "text": text, "family": f.family}


def roles(family: str, parts: dict) -> dict:
    from spotlight.pipelines.folder import LORA_TARGETS

    p = count(parts["dit"])
    lora = lora_params(parts["dit"], LORA_TARGETS[family])
    block = max(
        count(b)
        for name in ("transformer_blocks", "single_transformer_blocks")
        for b in getattr(parts["dit"], name, None) or []
    )
    return {
        "dit_params": p,
        "lora_params": lora,
        "text_params": parts["text"],
        "vae_dec_params": parts["vae_decoder"],
        "text_gb": 2 * parts["text"] / GB,
        "worker_gb": (2 * p + 2 * parts["vae_decoder"] + 2 * lora) / GB,
        "trainer_lora_gb": (2 * p + 16 * lora) / GB,
        "trainer_full_fsdp8_gb": (16 * p / 8 + 2 * block) / GB,
        "trainer_full_1gpu_gb": 16 * p / GB,
    }


def fits(gb: float) -> str:
    return " / ".join("yes" if gb <= 0.9 * cap else "no" for cap in (80, 141))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", nargs="*", default=[], help="tiny pipeline folders to measure too")
    args = ap.parse_args()
    rows = [(fam + " (full)", roles(fam, full_size(fam))) for fam in FULL]
    for folder in args.tiny:
        parts = tiny(folder)
        rows.append((parts["family"] + " (tiny)", roles(parts["family"], parts)))
    print(
        "| model | transformer | LoRA r=32 | text enc. | VAE dec. | text role GB | worker GB | "
        "trainer LoRA GB | trainer full FSDP2/8 GB | full on 1 GPU GB | fits 80/141: worker | LoRA | full/8 |"
    )
    print("|" + " --- |" * 14)
    for name, r in rows:
        print(
            f"| {name} | {_n(r['dit_params'])} | {_n(r['lora_params'])} | {_n(r['text_params'])} | "
            f"{_n(r['vae_dec_params'])} | {_gb(r['text_gb'])} | {_gb(r['worker_gb'])} | "
            f"{_gb(r['trainer_lora_gb'])} | {_gb(r['trainer_full_fsdp8_gb'])} | "
            f"{_gb(r['trainer_full_1gpu_gb'])} | "
            f"{fits(r['worker_gb'])} | {fits(r['trainer_lora_gb'])} | {fits(r['trainer_full_fsdp8_gb'])} |"
        )


def _n(x: int) -> str:
    return f"{x / 1e9:.2f}B" if x >= 1e8 else f"{x / 1e6:.1f}M" if x >= 1e5 else f"{x / 1e3:.1f}k"


def _gb(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x * 1e3:.2f} MB"


if __name__ == "__main__":
    main()
