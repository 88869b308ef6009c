"""The sharded trainer: the GRPO update on N ranks (torch.distributed), its rank 0 the run's trainer.

Rank 0 is the run's own process (`spotlight.loop.Loop`). It keeps the run's model whole — what
rollouts, evaluation, checkpoints and publishing to workers use, exactly as with one process — and
trains a second, sharded copy of it (FSDP2, `spotlight.parallel.fsdp`) together with ranks 1..N-1,
each a process that holds its own shard (`follow`). Per iteration, rank 0 sends a command and the
batch, and every rank runs the same `GRPOTrainer.update` on its share of the groups:

1. a JSON header (the command, the trainer's iteration and β, each group's prompt and seeds, the
   tensors' shapes) as a uint8 tensor, broadcast;
2. every group's rewards [n, G], broadcast (every rank computes the same advantages and split);
3. to each rank, the latents and log-probs of the groups it trains (`GRPOTrainer.needs`), sent
   point to point.

After the update the trainable weights are gathered whole into rank 0's model, which then publishes
them as with one process (workers receive only the trainable weights: the LoRA adapter or the
transformer). The first update first scatters rank 0's model into the shards (the other ranks'
random LoRA initialisations, a resumed checkpoint), and a checkpoint gathers AdamW's state whole
(`optimizer_state` / `load_optimizer_state`), so checkpoints are the one-process format.

Nothing crosses between ranks but tensors (no pickle). The process group is the caller's
(`spotlight.parallel.ranks` starts the processes and joins the group): gloo on the CPU, NCCL on
GPUs, each collective under the group's timeout. Knows the trainer and the model; nothing of the
loop's schedule, actors or queues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spotlight.errors import ConfigError
from spotlight.parallel.fsdp import full_state, load_full, mesh, whole
from spotlight.policy.grpo import Group, GRPOTrainer, add_lora


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """How many processes the GRPO update runs on (`[trainer]`)."""

    ranks: int = 1
    """Ranks of the update: 1 = the run's own process, no process group (the reference); N > 1 =
    the run's process and N-1 more on this machine (`spotlight.parallel.trainer`), the DiT
    sharded over them with FSDP2 (full fine-tuning and LoRA alike), each rank training 1/N of
    every optimizer step's groups. gloo on the CPU; NCCL and one GPU per rank (cuda:0..N-1)
    when the run computes on CUDA."""
    timeout_s: float = 600.0
    """How long the ranks may take to start and join, and any one collective to finish: a rank
    that died or hangs fails the run with an error instead of stalling it."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"trainer.ranks must be >= 1, got {self.ranks}")
        if self.timeout_s <= 0:
            raise ConfigError(f"trainer.timeout_s must be > 0, got {self.timeout_s}")


# --- the wire: tensors only -----------------------------------------------------------------------
def _send_header(header: dict, device) -> None:
    data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
    dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=device), 0)
    dist.broadcast(data, 0)


def _recv_header(device) -> dict:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return json.loads(bytes(data.cpu().tolist()).decode())


def _batch_header(trainer: GRPOTrainer, groups: list[Group]) -> dict:
    return {"cmd": "update", "iteration": trainer.iteration, "beta": trainer.beta,
            "groups": [{"prompt": g.prompt, "seeds": list(g.seeds)} for g in groups],
            "latents": list(groups[0].latents.shape), "log_probs": list(groups[0].log_probs.shape),
            "credit": list(groups[0].credit.shape) if _sends_credit(trainer, groups) else None}


def _sends_credit(trainer: GRPOTrainer, groups: list[Group]) -> bool:
    """Whether the ranks need the groups' credit maps (a group without one falls back to its
    rewards on every rank alike)."""
    return trainer.cfg.awm_credit == "columns" and all(g.credit is not None for g in groups)


def _send_batch(trainer: GRPOTrainer, groups: list[Group], device) -> None:
    rewards = torch.stack([g.rewards for g in groups]).float()
    dist.broadcast(rewards.to(device), 0)
    credits = None
    if _sends_credit(trainer, groups):  # every rank needs every map: they decide which groups train
        credits = torch.stack([g.credit for g in groups]).float()
        dist.broadcast(credits.contiguous().to(device), 0)
    for rank in range(1, trainer.world):
        for gi in trainer.needs(list(rewards), rank, None if credits is None else list(credits)):
            dist.send(groups[gi].latents.float().contiguous().to(device), rank)
            dist.send(groups[gi].log_probs.float().contiguous().to(device), rank)


def _recv_batch(trainer: GRPOTrainer, header: dict, device) -> list[Group]:
    specs = header["groups"]
    rewards = torch.empty(len(specs), len(specs[0]["seeds"]), dtype=torch.float32, device=device)
    dist.broadcast(rewards, 0)
    rewards = rewards.cpu()
    credits = [None] * len(specs)
    if header.get("credit") is not None:
        stacked = torch.empty([len(specs), *header["credit"]], dtype=torch.float32, device=device)
        dist.broadcast(stacked, 0)
        credits = list(stacked.cpu())
    groups = [Group(prompt=s["prompt"], seeds=s["seeds"], latents=torch.empty(0), log_probs=torch.empty(0),
                    rewards=r, credit=c) for s, r, c in zip(specs, rewards, credits)]
    for gi in trainer.needs(list(rewards), trainer.rank, credits):
        latents = torch.empty(header["latents"], dtype=torch.float32, device=device)
        log_probs = torch.empty(header["log_probs"], dtype=torch.float32, device=device)
        dist.recv(latents, 0)
        dist.recv(log_probs, 0)
        groups[gi].latents, groups[gi].log_probs = latents.cpu(), log_probs.cpu()
    return groups


# --- optimizer state, whole on rank 0 ---------------------------------------------------------------
def optimizer_state(trainer: GRPOTrainer) -> dict:
    """AdamW's state with every sharded moment gathered whole, in `torch.optim`'s own index form
    (a collective; every rank gets it)."""
    st = trainer.opt.state_dict()
    return {"state": {i: {k: whole(v).detach().cpu() for k, v in s.items()} for i, s in st["state"].items()},
            "param_groups": st["param_groups"]}


def _optimizer_layout(state: dict) -> dict:
    return {"keys": {str(i): sorted(s) for i, s in state["state"].items()},
            "param_groups": state["param_groups"]}


@torch.no_grad()
def load_optimizer_state(trainer: GRPOTrainer, layout: dict, state: dict | None) -> None:
    """Set AdamW's state from rank 0's whole `state` (`optimizer_state`'s form; None elsewhere),
    each rank keeping its shard of every moment (a collective; `layout` is `_optimizer_layout`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out: dict = {}
    for i, keys in sorted(layout["keys"].items(), key=lambda kv: int(kv[0])):
        p = trainer.params[int(i)]
        out[int(i)] = {}
        for key in keys:
            shape = () if key == "step" else p.shape
            full = (state["state"][int(i)][key].float() if state is not None
                    else torch.empty(shape, dtype=torch.float32))
            full = full.to(p.device)
            if key != "step" and isinstance(p, DTensor):
                out[int(i)][key] = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements)
            else:
                dist.broadcast(full, 0)
                out[int(i)][key] = full.cpu() if key == "step" else full.to(p.dtype)
    trainer.opt.load_state_dict({"state": out, "param_groups": layout["param_groups"]})


# --- rank 0 ------------------------------------------------------------------------------------------
class ShardedTrainer:
    """Rank 0's trainer: `GRPOTrainer`'s interface for the loop and checkpoints (`update`, `opt`,
    `deployed`, `ema`, `iteration`, `beta`, `cfg`) over the sharded update (module docstring).
    `model` is the run's model and stays whole; `twin` is a freshly built copy of it, sharded."""

    def __init__(self, model, twin, cfg, sampler, seed: int = 0, *, device) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        if cfg.finetune == "lora":  # the run's model carries the adapter the shards train
            add_lora(model, cfg)
        model.requires_grad_(False)
        self.local = GRPOTrainer(twin, cfg, sampler, seed, device_mesh=mesh(device.type))
        self.ema = None
        self.opt = _ShardedOptimizer(self)
        self.synced = False

    @property
    def deployed(self):
        return self.model

    @property
    def world(self) -> int:
        return self.local.world

    @property
    def iteration(self) -> int:
        """The update's iteration counter (every rank gets it with each batch)."""
        return self.local.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.local.iteration = value

    @property
    def beta(self) -> float:
        """The KL weight of the next update (every rank gets it with each batch)."""
        return self.local.beta

    @beta.setter
    def beta(self, value: float) -> None:
        self.local.beta = value

    def command(self, header: dict) -> None:
        """Tell ranks 1..N-1 what comes next (every command is then a collective of all ranks)."""
        _send_header(header, self.device)

    def update(self, groups: list[Group]) -> dict[str, float]:
        if not self.synced:  # the shards start from the run's model (a resumed one included)
            self.command({"cmd": "sync"})
            load_full(self.local.model, self.model.state_dict())
            self.synced = True
        self.command(_batch_header(self.local, groups))
        _send_batch(self.local, groups, self.device)
        out = self.local.update(groups)
        self.model.load_state_dict(full_state(self.local.model), strict=True)
        return out

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The shards' `state_dict()` gathered whole at their own precision (the float32 weights of
        a mixed-precision full fine-tune, which rank 0's bfloat16 model holds rounded)."""
        self.command({"cmd": "state"})
        return full_state(self.local.model)

    def stop(self) -> None:
        """Ranks 1..N-1 leave their loop."""
        self.command({"cmd": "stop"})


class _ShardedOptimizer:
    """What a checkpoint reads and writes of a sharded trainer's AdamW: its state whole."""

    def __init__(self, owner: ShardedTrainer) -> None:
        self.owner = owner

    @property
    def param_groups(self):
        return self.owner.local.opt.param_groups

    def state_dict(self) -> dict:
        self.owner.command({"cmd": "optimizer_state"})
        return optimizer_state(self.owner.local)

    def load_state_dict(self, state: dict) -> None:
        layout = _optimizer_layout(state)
        self.owner.command({"cmd": "load_optimizer_state", "layout": layout})
        load_optimizer_state(self.owner.local, layout, state)


# --- ranks 1..N-1 -------------------------------------------------------------------------------------
def follow(model, recipe, device) -> None:
    """Rank ≥ 1's loop: shard `model` (built from `recipe` as rank 0 built its twin), then answer
    rank 0's commands until it says stop."""
    trainer = GRPOTrainer(model, recipe.grpo, recipe.sampler, seed=recipe.run.seed,
                          device_mesh=mesh(device.type))
    while True:
        header = _recv_header(device)
        cmd = header["cmd"]
        if cmd == "stop":
            return
        if cmd == "sync":
            load_full(model, None)
        elif cmd == "update":
            trainer.iteration, trainer.beta = header["iteration"], header["beta"]
            trainer.update(_recv_batch(trainer, header, device))
            full_state(model)
        elif cmd == "state":
            full_state(model)
        elif cmd == "optimizer_state":
            optimizer_state(trainer)
        elif cmd == "load_optimizer_state":
            load_optimizer_state(trainer, header["layout"], None)
        else:
            raise ValueError(f"trainer rank: unknown command {cmd!r}")
