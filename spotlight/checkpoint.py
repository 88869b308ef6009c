"""Run checkpoints for `--resume`: model weights and optimizer state, both as safetensors.

`iter_NNNN.safetensors` holds the model (DiT + text encoder, LoRA weights included, the adapter's
peft config in the metadata so `model.checkpoint` / `spotlight eval` can load it on its own);
`iter_NNNN.optim.safetensors` holds AdamW's moments and step counts, flattened by parameter index.
With `grpo.ema_decay` the model file is the weights' moving average (what the run evaluated, and
what a user deploys) and the online weights the run trains go in the optimizer file (`model.*`).
No pickle: optimizer state is tensors plus a JSON header in the file's metadata. `spotlight export`
(spotlight.export) turns a model file into a diffusers folder.

A checkpoint is committed by its model file: each file is written under a `.partial` name and
renamed into place, the optimizer file first, so a process killed at any moment leaves either the
whole pair or no model file for `latest` to find (the previous checkpoint is then the newest).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from spotlight.errors import NotFound

ONLINE = "model."
"""Prefix of the online weights in the optimizer file of a run with a moving average."""


def save(folder: Path, iteration: int, model, trainer, wall_s: float, state: dict | None = None) -> Path:
    """``state``: the driver's own JSON state (e.g. the exploration planner's), back from
    ``load_latest``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"iter_{iteration:04d}.safetensors"
    opt_state = trainer.opt.state_dict()
    tensors, steps = {}, {}
    if trainer.ema is not None:
        tensors.update({f"{ONLINE}{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()})
    for idx, st in opt_state["state"].items():
        for key, value in st.items():
            if key == "step":
                steps[str(idx)] = float(value)
            else:
                tensors[f"{idx}.{key}"] = value.contiguous()
    meta = {"steps": json.dumps(steps), "param_groups": json.dumps(opt_state["param_groups"]),
            "trainer_iteration": str(trainer.iteration), "trainer_beta": json.dumps(trainer.beta)}
    _commit(optim_path(path), lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    extra = {"iteration": iteration, "wall_s": wall_s, "state": state or {}}
    _commit(path, lambda tmp: trainer.deployed.save(tmp, extra=extra))  # the pair is complete from here
    return path


def optim_path(path: Path) -> Path:
    """The optimizer file beside the model file ``path``."""
    return path.with_name(path.name.replace(".safetensors", ".optim.safetensors"))


def _commit(final: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary name beside ``final``, then rename it into place (atomic on one
    file system): a process killed mid-write leaves no partial file under the final name."""
    tmp = final.with_name(final.name + ".partial")
    write(tmp)
    os.replace(tmp, final)


def latest(folder: Path) -> Path:
    """The newest complete checkpoint's model file in ``folder`` (one with its optimizer file: a
    model file alone is a save that was cut short before this module wrote the pair in order);
    NotFound (one line) when there is none, so ``--resume`` can fail before anything is started."""
    found = sorted(p for p in Path(folder).glob("iter_*.safetensors")
                   if not p.name.endswith(".optim.safetensors") and optim_path(p).exists())
    if not found:
        raise NotFound(f"--resume: no checkpoint in {folder}")
    return found[-1]


def load_latest(folder: Path, model, trainer) -> tuple[int, float, dict]:
    """Restore the newest checkpoint in `folder`; returns (iteration, wall seconds so far, the
    driver's state saved with it)."""
    path = latest(folder)
    with safe_open(str(path), "pt") as f:
        extra = json.loads(f.metadata()["extra"])
    deployed = load_file(str(path))
    tensors = load_file(str(optim_path(path)))
    online = {k[len(ONLINE):]: tensors.pop(k) for k in list(tensors) if k.startswith(ONLINE)}
    # a run with a moving average resumes both; a checkpoint from a run without one starts the
    # average at its weights, and a run without one resumes the online weights of one with it
    model.load_state_dict(online or deployed, strict=True)
    if trainer.ema is not None:
        trainer.ema.load_state_dict(deployed, strict=True)
    with safe_open(str(optim_path(path)), "pt") as f:
        meta = f.metadata()
    steps = json.loads(meta["steps"])
    state: dict = {"state": {}, "param_groups": json.loads(meta["param_groups"])}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state["state"].setdefault(int(idx), {})[key] = value
    for idx, step in steps.items():
        state["state"].setdefault(int(idx), {})["step"] = torch.tensor(step)
    trainer.opt.load_state_dict(state)
    trainer.iteration = int(meta["trainer_iteration"])
    if trainer.cfg.kl_target > 0 and "trainer_beta" in meta:  # the adaptive β goes on where it was
        trainer.beta = max(trainer.cfg.beta, float(json.loads(meta["trainer_beta"])))
    return int(extra["iteration"]), float(extra["wall_s"]), dict(extra.get("state", {}))
