"""Shard a pipeline model's transformer across the trainer's ranks with FSDP2 (`fully_shard`).

Each transformer block is its own FSDP unit (its parameters are gathered for its forward and
freed after), then the root; the VAE and the prompt embeddings stay whole (frozen, not trained).
Every rank trains on its own share of the groups; FSDP2 averages the gradients, so with equal
shares one update equals a single process's update on all the groups (float tolerance).

The process group is the caller's (`torch.distributed.init_process_group`, gloo on the CPU or
NCCL on GPUs); this module only shards and gathers. Knows nothing of RL or actors.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
"""The block lists of the supported transformers (Qwen-Image, SD3: the first; FLUX: both)."""


def shard(model: nn.Module, device_type: str = "cpu") -> nn.Module:
    """`fully_shard` each block of `model.dit`, then `model.dit`, over all ranks; returns model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for name in BLOCK_LISTS:
        for block in getattr(model.dit, name, None) or []:
            fully_shard(block, mesh=mesh)
    fully_shard(model.dit, mesh=mesh)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's `state_dict` with every sharded tensor gathered whole (a collective: every
    rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}
