"""Tiny random-initialised diffusers pipelines, built offline: `spotlight make-pipeline FAMILY OUT`.

Each family's folder is what `DiffusionPipeline.save_pretrained` writes for a real Qwen-Image,
FLUX.1-dev or SD3 pipeline — the same classes, in miniature (2-layer transformer, small VAE, small
text encoders), configured the way diffusers' own pipeline tests configure them — so the code
path a user with a downloaded folder takes is the one the tests take. Tokenizers are made here:
a BPE (byte-level for Qwen2, CLIP's end-of-word BPE) or a unigram vocabulary (T5) trained with the
`tokenizers` library on the project's caption grammar plus a few general words, with the
vocabulary renumbered in a fixed order, so the same seed writes the same folder bit for bit.

Contracts a folder keeps (checked here, not hoped for):
- Qwen-Image drops the first `prompt_template_encode_start_idx` (34) tokens of its chat template;
  the tokenizer encodes that prefix to exactly 34 tokens, and the text encoder's image / video
  token ids lie outside the text vocabulary.
- every component is in eval mode before saving (a fresh model is in train mode, a loaded one is
  not; T5's dropout would make the two differ);
- CLIP's bos / eos / pad ids are the tokenizer's (its pooling reads the eos token);
- SD3: T5's width is at least the two CLIP widths together (the pipeline pads CLIP to T5's width).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spotlight.errors import ConfigError

FAMILIES = ("qwen-image", "flux", "sd3")
QWEN_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
QWEN_DROP = 34  # QwenImagePipeline.prompt_template_encode_start_idx
_EXTRA_WORDS = (
    "a an the of and to in on with at by for is are photo picture image sign word text letters reads says "
    "written poster board label small large big bright dark white black gray orange purple pink brown "
    "left right above below top bottom middle center one four five six seven eight nine ten"
).split()


def corpus() -> list[str]:
    """The text the tokenizers are trained on: every caption of the project's grammar, the Qwen
    chat template, a few general words, and the printable ASCII characters (so any prompt encodes)."""
    from spotlight.data.prompts import all_captions

    printable = "".join(chr(c) for c in range(32, 127))
    return [*all_captions(), QWEN_TEMPLATE_PREFIX * 4, " ".join(_EXTRA_WORDS), printable]


def _train_bpe(backend, vocab_size: int, specials: list[str], suffix: str | None) -> tuple[dict, list]:
    """A BPE for `backend`'s normalizer and pre-tokenizer, learnt on `corpus()` by plain BPE with
    ties broken by the pair itself (the `tokenizers` trainer orders tied merges differently from
    run to run), so the vocabulary and merges are the same every time. The alphabet is every
    byte-level character (with and without `suffix`, CLIP's end-of-word mark)."""
    from collections import Counter

    from tokenizers.pre_tokenizers import ByteLevel

    words: Counter = Counter()
    for line in corpus():
        text = backend.normalizer.normalize_str(line) if backend.normalizer else line
        words.update(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text))
    alphabet = sorted(ByteLevel.alphabet())
    vocab = [*specials, *alphabet, *([a + suffix for a in alphabet] if suffix else [])]
    split = {w: [*w[:-1], w[-1] + suffix] if suffix else list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        pairs: Counter = Counter()
        for w, n in words.items():
            sym = split[w]
            for pair in zip(sym, sym[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        vocab.append(best[0] + best[1])
        for w, sym in split.items():
            i, out = 0, []
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            split[w] = out
    return {t: i for i, t in enumerate(dict.fromkeys(vocab))}, merges


def qwen_tokenizer():
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, merges = _train_bpe(Qwen2Tokenizer().backend_tokenizer, 1200, specials, None)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    n = len(tok(QWEN_TEMPLATE_PREFIX).input_ids)
    if n != QWEN_DROP:  # the pipeline would silently keep template tokens or drop prompt tokens
        raise RuntimeError(f"Qwen template prefix encodes to {n} tokens, the pipeline drops {QWEN_DROP}")
    return tok


def clip_tokenizer(max_length: int):
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    vocab, merges = _train_bpe(CLIPTokenizer().backend_tokenizer, 1000, specials, "</w>")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int):
    """T5's unigram vocabulary: specials, then every corpus word (score by frequency), then single
    characters (low score), so any word segments into known pieces."""
    from collections import Counter

    from transformers import T5Tokenizer

    words = Counter(w for line in corpus() for w in line.replace("\n", " ").split())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("▁" + w, -1.0 / (1 + c)) for w, c in sorted(words.items())]
    chars = sorted({ch for line in corpus() for ch in line if not ch.isspace()})
    pieces += [("▁", -5.0)] + [(ch, -10.0) for ch in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def _clip_encoder(tok, width: int, projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=tok.model_max_length, projection_dim=width,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        hidden_act="gelu",
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def _t5_encoder(tok, width: int):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=len(tok), d_model=width, d_ff=2 * width, d_kv=8, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return T5EncoderModel(cfg)


def _vae(latent_channels: int, shift: float | None, scaling: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32,
        shift_factor=shift, scaling_factor=scaling, use_quant_conv=False, use_post_quant_conv=False,
    )


def build(family: str, seed: int = 0):
    """A tiny random pipeline of `family` (one of FAMILIES), every component in eval mode."""
    import diffusers

    if family not in FAMILIES:
        raise ConfigError(f"make-pipeline: family {family!r} is not one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    if family == "qwen-image":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        tok = qwen_tokenizer()
        n = len(tok)
        cfg = Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=n + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2,
                rope_scaling={"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"},
                rope_theta=1_000_000.0, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
            ),
            vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32),
            vocab_size=n + 8, image_token_id=n + 1, video_token_id=n + 2,
            vision_start_token_id=n + 3, vision_end_token_id=n + 4,
        )
        text = Qwen2_5_VLForConditionalGeneration(cfg)
        z = 4
        vae = diffusers.AutoencoderKLQwenImage(
            base_dim=z * 4, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            latents_mean=[0.1, -0.2, 0.05, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
        )
        transformer = diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        )
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            shift=1.0, shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True,
        )
        pipe = diffusers.QwenImagePipeline(
            scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tok, transformer=transformer
        )
    elif family == "flux":
        clip_tok, t5_tok = clip_tokenizer(77), t5_tokenizer(64)
        transformer = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            axes_dims_rope=[4, 6, 6], guidance_embeds=True,
        )
        pipe = diffusers.FluxPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
                base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                shift=3.0, use_dynamic_shifting=True,
            ),
            vae=_vae(4, 0.1159, 0.3611),
            text_encoder=_clip_encoder(clip_tok, 16, projection=False),
            tokenizer=clip_tok,
            text_encoder_2=_t5_encoder(t5_tok, 32),
            tokenizer_2=t5_tok,
            transformer=transformer,
        )
    else:
        clip_tok, t5_tok = clip_tokenizer(77), t5_tokenizer(64)
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
            pooled_projection_dim=32, out_channels=4, pos_embed_max_size=16,
        )
        pipe = diffusers.StableDiffusion3Pipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=_vae(4, 0.0609, 1.5035),
            text_encoder=_clip_encoder(clip_tok, 16, projection=True),
            tokenizer=clip_tok,
            text_encoder_2=_clip_encoder(clip_tok, 16, projection=True),
            tokenizer_2=clip_tok,
            text_encoder_3=_t5_encoder(t5_tok, 32),
            tokenizer_3=t5_tok,
            transformer=transformer,
        )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def make_pipeline(family: str, out: str | Path, seed: int = 0) -> Path:
    """Build the tiny `family` pipeline and `save_pretrained` it to `out` (safetensors)."""
    out = Path(out)
    pipe = build(family, seed)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
