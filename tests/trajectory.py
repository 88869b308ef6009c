"""What the runtime fault tests assert of a finished rollout request."""

from __future__ import annotations

import torch


def same_as_reference(rt, result) -> tuple[dict, dict]:
    """The request's trajectory (and its metadata) from the store, asserted bit-identical to the
    uninterrupted rollout the test stored as ``rt.reference`` (latents and log-probs)."""
    traj, meta = rt.call(rt.store.get(result.key))
    assert torch.equal(torch.from_numpy(traj["latents"].copy()), torch.stack(rt.reference.latents))
    assert torch.equal(torch.from_numpy(traj["log_probs"].copy()), torch.stack(rt.reference.log_probs))
    return traj, meta
