"""Shard a model's DiT across the trainer's ranks with FSDP2 (`fully_shard`), and move whole
weights in and out of the shards.

Each transformer block is its own FSDP unit (its parameters are all-gathered for its forward and
freed after), then the DiT itself; everything else of the model (the VAE, the text encoder, the
prompt embeddings) stays whole on every rank — frozen, never trained. Trainable parameters of a
unit must share one dtype (FSDP2's reduce-scatter): a LoRA adapter in float32 over a bfloat16
base is fine (the base is frozen); a bfloat16 model trained in full is held as float32 shards and
computed in bfloat16 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`), so the
sharded parameters and AdamW's state are float32.

The process group is the caller's (gloo on the CPU, NCCL on GPUs); every function here that
gathers or scatters is a collective: every rank calls it, in the same order. Knows nothing of RL,
actors or recipes.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
"""The block lists of the supported transformers (Qwen-Image, SD3: the first; FLUX: both)."""


def mesh(device_type: str):
    """A 1-D device mesh over every rank of the default process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard(model: nn.Module, device_mesh) -> bool:
    """`fully_shard` each block of `model.dit`, then `model.dit`, over `device_mesh`. A DiT whose
    trainable parameters are bfloat16 is first made float32 and computed in bfloat16 (the module
    docstring). Returns whether that mixed precision is on."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    trainable = {p.dtype for p in model.dit.parameters() if p.requires_grad}
    mixed = torch.bfloat16 in trainable
    policy = MixedPrecisionPolicy()
    if mixed:
        model.dit.float()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in BLOCK_LISTS:
        for block in getattr(model.dit, name, None) or []:
            fully_shard(block, mesh=device_mesh, mp_policy=policy)
    fully_shard(model.dit, mesh=device_mesh, mp_policy=policy)
    return mixed


def whole(x: torch.Tensor) -> torch.Tensor:
    """`x` gathered whole when it is a sharded DTensor (a collective), else `x`."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every sharded tensor gathered whole, on the CPU (a collective)."""
    return {k: whole(v).detach().cpu() for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full(model: nn.Module, state: dict[str, torch.Tensor] | None, src: int = 0) -> None:
    """Set every tensor of `model.state_dict()` from rank `src`'s whole `state` (same keys; other
    ranks pass None): each rank keeps its shard (a collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, target in model.state_dict().items():
        if isinstance(target, DTensor):
            full = (state[name].to(target.device, target.dtype) if dist.get_rank() == src
                    else torch.empty(target.shape, dtype=target.dtype, device=target.device))
            target.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=src))
        else:
            full = (state[name].to(target.device, target.dtype) if dist.get_rank() == src
                    else torch.empty_like(target))
            dist.broadcast(full, src)
            target.copy_(full)
