"""One flat buffer per weights version, whose views ARE a model's parameters: the store fills the
views in place, a neighbour on the node reads the whole version with one copy, and switching the
model between held versions rebinds its parameters (no copy).

- CPU: the buffer is a POSIX shared-memory segment (``spotlight.comm.shm.OwnedSegment``) the worker
  owns; its 64-byte header holds a **generation** word, bumped before each reload, so a reader in
  another process that copied while the owner reloaded sees a changed word and drops the copy.
- GPU: the buffer is one flat CUDA tensor; a neighbour maps it with one CUDA IPC handle
  (``spotlight.parallel.device.cuda_ipc_export``) and copies device to device. The generation is
  kept here only (no word a reader could check): the owner's pin (``runtime.peer_weights_s``) is
  the bound.

The layout (name -> [dtype, shape, byte offset], ``spotlight.parallel.peer.layout_of``) is the
model's state dict in order, 64-byte aligned; two workers of one recipe have the same layout, so a
version moves between them as ONE copy of ``nbytes``.

Knows tensors, segments and modules; nothing of versions' lifetimes, sockets or stores.
"""

from __future__ import annotations

import numpy as np
import torch

from spotlight.comm.shm import HEADER, OwnedSegment
from spotlight.parallel.peer import layout_of


class FlatWeights:
    """One version's memory: ``flat`` (uint8 [nbytes] on ``device``) and ``tensors``, the views a
    model binds as its parameters; on the CPU also ``arrays`` (numpy views of the same bytes, what
    the store's ``get_weights(out=...)`` fills) and ``segment`` (its shared-memory name)."""

    def __init__(self, layout: dict[str, list], nbytes: int, device: torch.device) -> None:
        self.layout, self.nbytes, self.device = layout, nbytes, device
        self.version: int | None = None  # what it holds now (None: nothing whole)
        self._seg: OwnedSegment | None = None
        self._gen = 0
        if device.type == "cpu":
            self._seg = OwnedSegment(nbytes, populate=True)  # warm pages from the start
            raw = torch.frombuffer(memoryview(self._seg.mm), dtype=torch.uint8)
            self.flat = raw[HEADER:HEADER + nbytes]
            self._word = np.frombuffer(self._seg.mm, dtype=np.uint64, count=1)
        else:
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.tensors = {name: _view(self.flat, dtype, shape, off)
                        for name, (dtype, shape, off) in layout.items()}
        self.arrays = {k: v.numpy() for k, v in self.tensors.items()} if device.type == "cpu" else None

    @classmethod
    def like(cls, model: torch.nn.Module, device: torch.device | None = None) -> FlatWeights:
        layout, nbytes = layout_of(model.state_dict())
        return cls(layout, nbytes, device or next(model.parameters()).device)

    @property
    def segment(self) -> str:
        """The shared-memory segment's name (CPU only)."""
        if self._seg is None:
            raise ValueError("a GPU buffer has no shared-memory segment")
        return self._seg.name

    @property
    def generation(self) -> int:
        return self._gen

    def reload(self) -> int:
        """About to be overwritten: it holds no version, and a reader that copied under the previous
        generation finds the word changed. Returns the new generation."""
        self.version = None
        self._gen += 1
        if self._seg is not None:
            self._word[0] = self._gen  # before any byte of the new version (x86 stores are ordered)
        return self._gen

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (same names, dtypes and shapes) into the views."""
        if set(state) != set(self.tensors):
            raise ValueError("the state dict's names differ from the layout's")
        with torch.no_grad():
            for name, t in state.items():
                self.tensors[name].copy_(t)

    def close(self) -> None:
        """Free the memory; a model still bound to the views keeps the mapping alive until dropped."""
        self.tensors, self.arrays = {}, None
        if self._seg is not None:
            del self.flat, self._word
            self._seg.close()
            self._seg = None


def _view(flat: torch.Tensor, dtype: str, shape: list[int], off: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    count = int(np.prod(shape, dtype=np.int64))
    n = count * torch.empty(0, dtype=dt).element_size()
    return flat[off:off + n].view(dt).view(shape)


def bind(model: torch.nn.Module, weights: FlatWeights) -> None:
    """Make ``model``'s parameters and buffers the views of ``weights`` (their values become the
    buffer's; the old memory is dropped). Parameters stay the same objects (``.data`` is swapped), so
    anything holding them (an SP wrapper, hooks) sees the new memory."""
    state = model.state_dict(keep_vars=True)
    if set(state) != set(weights.tensors):
        raise ValueError("the model's state dict does not match the buffer's layout")
    with torch.no_grad():
        for name, t in state.items():
            view = weights.tensors[name]
            if isinstance(t, torch.nn.Parameter):
                t.data = view
            else:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, view)  # a registered buffer's name: replaced


def is_bound(model: torch.nn.Module, weights: FlatWeights) -> bool:
    """Every parameter and buffer of ``model`` is the view of ``weights`` at its layout's offset."""
    base = weights.flat.data_ptr()
    state = model.state_dict()
    return set(state) == set(weights.layout) and all(
        t.data_ptr() == base + weights.layout[name][2] for name, t in state.items())


def host_staging(weights: FlatWeights) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """A host buffer of ``weights``' layout (pinned memory when CUDA is present) and numpy views of
    it: where a GPU worker's store loads land before one host-to-device copy of the whole buffer."""
    host = torch.empty(weights.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return host, {name: _view(host, dtype, shape, off).numpy()
                  for name, (dtype, shape, off) in weights.layout.items()}
