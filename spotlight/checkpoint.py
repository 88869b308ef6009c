"""Run checkpoints for `--resume`: model weights and optimizer state, both as safetensors.

`iter_NNNN.safetensors` holds the model (DiT + text encoder, LoRA weights included, the adapter's
peft config in the metadata so `model.checkpoint` / `spotlight eval` can load it on its own);
`iter_NNNN.optim.safetensors` holds AdamW's moments and step counts, flattened by parameter index.
With `grpo.ema_decay` the model file is the weights' moving average (what the run evaluated, and
what a user deploys) and the online weights the run trains go in the optimizer file (`model.*`).
No pickle: optimizer state is tensors plus a JSON header in the file's metadata. `spotlight export`
(spotlight.export) turns a model file into a diffusers folder.
"""

from __future__ import annotations

import json
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
    trainer.deployed.save(path, extra={"iteration": iteration, "wall_s": wall_s, "state": state or {}})
    state = trainer.opt.state_dict()
    tensors, steps = {}, {}
    if trainer.ema is not None:
        tensors.update({f"{ONLINE}{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()})
    for idx, st in state["state"].items():
        for key, value in st.items():
            if key == "step":
                steps[str(idx)] = float(value)
            else:
                tensors[f"{idx}.{key}"] = value.contiguous()
    meta = {"steps": json.dumps(steps), "param_groups": json.dumps(state["param_groups"]),
            "trainer_iteration": str(trainer.iteration), "trainer_beta": json.dumps(trainer.beta)}
    save_file(tensors, str(folder / f"iter_{iteration:04d}.optim.safetensors"), metadata=meta)
    return path


def latest(folder: Path) -> Path:
    """The newest checkpoint's model file in ``folder``; NotFound (one line) when there is none,
    so ``--resume`` can fail before anything is started."""
    found = sorted(p for p in Path(folder).glob("iter_*.safetensors")
                   if not p.name.endswith(".optim.safetensors"))
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
    optim_path = path.with_name(path.name.replace(".safetensors", ".optim.safetensors"))
    tensors = load_file(str(optim_path))
    online = {k[len(ONLINE):]: tensors.pop(k) for k in list(tensors) if k.startswith(ONLINE)}
    # a run with a moving average resumes both; a checkpoint from a run without one starts the
    # average at its weights, and a run without one resumes the online weights of one with it
    model.load_state_dict(online or deployed, strict=True)
    if trainer.ema is not None:
        trainer.ema.load_state_dict(deployed, strict=True)
    with safe_open(str(optim_path), "pt") as f:
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
