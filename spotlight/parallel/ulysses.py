"""Ulysses sequence parallelism for diffusers' `QwenImageTransformer2DModel`.

A group of d processes runs one DiT forward together: each holds the full weights, the full text
stream and 1/d of the image tokens (contiguous chunks, rank r holds tokens [r·S/d, (r+1)·S/d)).
Everything in the DiT except attention is per token, so only the attention processor talks to
the other ranks:

    image q/k/v [B, S/d, H, D] --all-to-all--> [B, S, H/d, D]   (all tokens, this rank's heads)
    text  q/k/v [B, L,   H, D] --slice heads-> [B, L, H/d, D]   (text is replicated, no traffic)
    joint attention over [text, image] for H/d heads (the same kernel diffusers calls)
    image out   [B, S, H/d, D] --all-to-all--> [B, S/d, H, D]
    text  out   [B, L, H/d, D] --all-gather--> [B, L, H, D]     (text stays replicated)

`parallelize(dit, group)` installs the processor with `set_attn_processor` and two hooks on the
DiT (slice the image tokens going in, gather the output tokens coming out); it changes no
parameter, so a state dict loads into a parallelized DiT key for key. The collectives are
autograd functions whose backward is the conjugate collective (all-to-all ↔ all-to-all, gather ↔
slice), so with the loss computed identically on every rank the sum of the ranks' parameter
gradients is the single-process gradient.

The group is any `torch.distributed.ProcessGroup` the caller built (gloo on CPU, NCCL on GPU;
`spotlight.parallel.comms.Communicators` builds one per membership epoch with explicit
timeouts). The model code never opens a socket.

Invariants: degree 1 is the plain DiT; `Parallelized.undo()` restores the processors the DiT had
and removes both hooks; the degree must divide the heads and the image tokens (one ConfigError
line otherwise); only `QwenImageTransformer2DModel` without `zero_cond_t` is supported.

This module knows the DiT's attention and the collectives; nothing of workers, schedulers or
commits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spotlight.errors import ConfigError


def check_degree(degree: int, heads: int, tokens: int | None = None, heads_from: str = "model.heads") -> None:
    """`runtime.sp_degree` must divide the attention heads (``heads_from`` names where they are
    set) and (when known) the image tokens."""
    if degree < 1:
        raise ConfigError(f"runtime.sp_degree must be >= 1, got {degree}")
    if heads % degree:
        raise ConfigError(
            f"runtime.sp_degree ({degree}) must divide the attention heads ({heads_from} = {heads})"
        )
    if tokens is not None and tokens % degree:
        raise ConfigError(
            f"runtime.sp_degree ({degree}) must divide the image tokens ({tokens} = "
            f"(model.image_size / model.patch)^2)"
        )


# --- collectives as autograd functions -------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; the result's chunk j came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    group.alltoall_base(out, x, [], [], dist.AllToAllOptions()).wait()
    return out


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    """All-gather along `dim`. Backward keeps this rank's slice of the gradient, summed over the
    ranks first when `partial`: a replicated activation inside the model (the text stream) gets
    on each rank only the gradient of that rank's paths; the model's output does not (the loss
    is computed whole on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int, partial: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.n, ctx.partial = group, dim, x.shape[dim], partial
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.partial:
            grad = grad.contiguous()
            ctx.group.allreduce([grad]).wait()
        return grad.narrow(ctx.dim, ctx.group.rank() * ctx.n, ctx.n), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S/d, H, D] (a token chunk, all heads) -> [B, S, H/d, D] (all tokens, a head chunk)."""
    d = group.size()
    b, s, h, hd = x.shape
    x = x.reshape(b, s, d, h // d, hd).permute(2, 1, 0, 3, 4)  # [d(dest), S/d, B, H/d, D]
    x = _AllToAll.apply(x, group)  # [d(source = token chunk), S/d, B, H/d, D]
    return x.permute(2, 0, 1, 3, 4).reshape(b, d * s, h // d, hd)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S, H/d, D] -> [B, S/d, H, D], the inverse of `seq_to_heads`."""
    d = group.size()
    b, s, h, hd = x.shape
    x = x.reshape(b, d, s // d, h, hd).permute(1, 2, 0, 3, 4)  # [d(dest = token chunk), S/d, B, H/d, D]
    x = _AllToAll.apply(x, group)  # [d(source = head chunk), S/d, B, H/d, D]
    return x.permute(2, 1, 0, 3, 4).reshape(b, s // d, d * h, hd)


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, S/d, ...] on every rank -> [B, S, ...] on every rank."""
    return _Gather.apply(x, group, 1, False)


# --- the attention processor -------------------------------------------------------------------------
class UlyssesAttnProcessor:
    """`QwenDoubleStreamAttnProcessor2_0` with the image tokens sharded over `group`.

    The signature mirrors diffusers' processor argument for argument: diffusers passes a processor
    only the keyword arguments its `__call__` names and drops the rest with a warning, so a missing
    `image_rotary_emb` or `encoder_hidden_states_mask` would silently give a wrong output."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.degree = group.rank(), group.size()

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.FloatTensor,  # image stream, this rank's token chunk
        encoder_hidden_states: torch.FloatTensor = None,  # text stream, replicated
        encoder_hidden_states_mask: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.FloatTensor, torch.FloatTensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        if encoder_hidden_states is None:
            raise ValueError("UlyssesAttnProcessor requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise ValueError("UlyssesAttnProcessor builds the joint mask from encoder_hidden_states_mask")
        d, r = self.degree, self.rank
        b, s_local = hidden_states.shape[:2]
        heads = attn.heads
        check_degree(d, heads, s_local * d)
        head_dim = attn.inner_dim // heads
        hs = slice(r * heads // d, (r + 1) * heads // d)

        img_q = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        img_k = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        img_v = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb  # img_freqs cover the whole image: take our chunk
            img_freqs = img_freqs[r * s_local : (r + 1) * s_local]
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)

        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones((b, s_local * d), dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]

        seq_txt = encoder_hidden_states.shape[1]
        query = torch.cat([txt_q[:, :, hs], seq_to_heads(img_q, self.group)], dim=1)
        key = torch.cat([txt_k[:, :, hs], seq_to_heads(img_k, self.group)], dim=1)
        value = torch.cat([txt_v[:, :, hs], seq_to_heads(img_v, self.group)], dim=1)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        ).to(query.dtype)  # [B, L + S, H/d, D]

        txt_out = _Gather.apply(out[:, :seq_txt].contiguous(), self.group, 2, True).flatten(2, 3)
        img_out = heads_to_seq(out[:, seq_txt:].contiguous(), self.group).flatten(2, 3)
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(txt_out.contiguous())
        return img_out, txt_out


# --- installing it on a DiT ----------------------------------------------------------------------------
class Parallelized:
    """What `parallelize` installed; `undo()` restores the single-process DiT."""

    def __init__(self, dit: torch.nn.Module, old_processors: dict, hooks: list) -> None:
        self.dit, self._old, self._hooks = dit, old_processors, hooks

    def undo(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.dit.set_attn_processor(self._old)


def parallelize(dit: torch.nn.Module, group: dist.ProcessGroup) -> Parallelized:
    """Make `dit` (a `QwenImageTransformer2DModel`) run sequence-parallel over `group`.

    Every rank calls the DiT with the same full inputs; the DiT slices out this rank's image
    tokens, and returns the full output on every rank. Degree 1 is the plain DiT."""
    cls = type(dit).__name__
    if cls != "QwenImageTransformer2DModel":
        raise ConfigError(
            f"runtime.sp_degree > 1 supports model.dit_class QwenImageTransformer2DModel, not {cls}"
        )
    if getattr(dit.config, "zero_cond_t", False):
        raise ConfigError("runtime.sp_degree > 1: a DiT with zero_cond_t is unsupported")
    heads = dit.config.num_attention_heads
    check_degree(group.size(), heads)
    rank, degree = group.rank(), group.size()

    def shard_input(module, args, kwargs):
        if args:
            raise ValueError("a sequence-parallel DiT takes keyword arguments only (hidden_states=...)")
        if kwargs.get("controlnet_block_samples") is not None:
            raise ValueError("controlnet_block_samples are not sequence-parallel")
        x = kwargs["hidden_states"]
        check_degree(degree, heads, x.shape[1])
        n = x.shape[1] // degree
        return args, {**kwargs, "hidden_states": x[:, rank * n : (rank + 1) * n]}

    def gather_output(module, args, kwargs, output):
        if isinstance(output, tuple):
            return (gather_tokens(output[0], group), *output[1:])
        output.sample = gather_tokens(output.sample, group)
        return output

    old = dit.attn_processors
    dit.set_attn_processor(UlyssesAttnProcessor(group))
    hooks = [
        dit.register_forward_pre_hook(shard_input, with_kwargs=True),
        dit.register_forward_hook(gather_output, with_kwargs=True),
    ]
    return Parallelized(dit, old, hooks)
