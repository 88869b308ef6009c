"""Start and stop the sharded trainer's processes (`trainer.ranks > 1`).

`TrainerRanks(recipe, log_dir)` is a context manager the run's wiring (`spotlight.api`) enters
around the loop: it starts ranks 1..N-1 on this machine (`python -m spotlight.parallel.ranks`,
through `spotlight.actors.procs`: they die with the run), joins the default process group as rank 0
(gloo on the CPU, NCCL when the run computes on CUDA, rank r on cuda:r), and hands the loop a
trainer factory (`factory`) that builds rank 0's `ShardedTrainer`. On exit rank 0 tells the ranks
to stop, waits for them and leaves the group. A rank that exits early fails the start in one line
naming its log; one that dies during the run fails it with `ActorDead` naming it (a live but
stuck rank: after `trainer.timeout_s`). Knows processes and the process group; the update itself is
`spotlight.parallel.trainer`'s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from spotlight.actors import procs
from spotlight.errors import ActorDead, ConfigError

READY = "trainer rank ready"
DEATH_WAIT_S = 5.0
"""After a failed run, how long to wait for a rank's exit to be seen before blaming none."""

VIEW_WARNING = "FSDP2-wrapped module .* returned a view tensor"
"""FSDP2 (torch 2.13) warns once per process that diffusers' transformers return a view; nothing
changes the velocity in place (the models only reshape it), so each rank's process hides it."""


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


class TrainerRanks:
    """See the module docstring."""

    def __init__(self, recipe, log_dir: Path) -> None:
        from spotlight.parallel.device import resolve_device

        self.recipe, self.log_dir = recipe, Path(log_dir)
        self.world = recipe.trainer.ranks
        self.device = resolve_device(recipe.run.device)
        if self.device.type == "cuda" and torch.cuda.device_count() < self.world:
            raise ConfigError(f"trainer.ranks = {self.world} needs that many GPUs, "
                              f"this machine has {torch.cuda.device_count()}")
        self.children: list[procs.Child] = []
        self.trainer = None

    def __enter__(self) -> TrainerRanks:
        warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)
        timeout = datetime.timedelta(seconds=self.recipe.trainer.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, self.world, True, timeout, wait_for_workers=False)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        recipe_json = json.dumps(self.recipe.to_dict())
        try:
            for rank in range(1, self.world):
                cmd = [sys.executable, "-m", "spotlight.parallel.ranks", "--rank", str(rank),
                       "--world", str(self.world), "--port", str(store.port),
                       "--device", self.device.type, "--recipe-json", recipe_json]
                self.children.append(procs.spawn(f"trainer-rank-{rank}", cmd, ready_prefix=READY,
                                                 log_path=self.log_dir / f"trainer-rank-{rank}.log"))
            for child in self.children:
                child.wait_ready(self.recipe.trainer.timeout_s)
            dist.init_process_group(_backend(self.device), store=store, rank=0, world_size=self.world,
                                    timeout=timeout)
        except BaseException:
            procs.stop(self.children, grace_s=0)
            raise
        return self

    def factory(self, model, cfg, sampler, seed: int = 0):
        """The loop's trainer: rank 0's `ShardedTrainer` around the run's `model`."""
        from spotlight import work
        from spotlight.parallel.trainer import ShardedTrainer

        with torch.random.fork_rng(devices=[]):  # the twin draws nothing from the run's RNG stream
            twin = work.recipe_model(self.recipe.model).to(self.device)
        self.trainer = ShardedTrainer(model, twin, cfg, sampler, seed, device=self.device)
        return self.trainer

    def __exit__(self, exc_type, exc, tb) -> None:
        """Stop the ranks. When the run failed because a rank died (a collective's error names
        only a closed connection), raise `ActorDead` naming that rank, its status and its log."""
        dead: list[procs.Child] = []
        try:
            if exc_type is None and self.trainer is not None:
                self.trainer.stop()
                for child in self.children:
                    child.exited.result(self.recipe.trainer.timeout_s)
            elif exc_type is not None:  # a rank that died has exited, or is exiting, by now
                concurrent.futures.wait([c.exited for c in self.children], timeout=DEATH_WAIT_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                dead = [c for c in self.children if c.exited.done()]
        finally:
            procs.stop(self.children, grace_s=0)
            if dist.is_initialized():
                dist.destroy_process_group()
        if dead:
            raise ActorDead(f"the sharded trainer lost {dead[0].death()}") from exc


@contextlib.contextmanager
def _no_trainer():
    yield None


def trainer_ranks(recipe, log_dir: Path):
    """`TrainerRanks` when the recipe shards its trainer, else a context holding None."""
    return TrainerRanks(recipe, log_dir) if recipe.trainer.ranks > 1 else _no_trainer()


def main(argv: list[str] | None = None) -> None:
    """Rank r ≥ 1 of the sharded trainer: join the group, build the model, follow rank 0."""
    from spotlight import work
    from spotlight.parallel.trainer import follow
    from spotlight.recipe import load_recipe

    parser = argparse.ArgumentParser(description="a rank of the sharded trainer (started by the run)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's rendezvous store")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--recipe-json", required=True, help="the run's recipe (Recipe.to_dict())")
    args = parser.parse_args(argv)
    procs.die_with_parent(only_if_asked=True)
    warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)
    recipe = load_recipe(json.loads(args.recipe_json))
    device = _rank_device(torch.device(args.device), args.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=recipe.trainer.timeout_s)
    procs.announce_ready(f"{READY} {args.rank}")
    store = dist.TCPStore("127.0.0.1", args.port, args.world, False, timeout)
    dist.init_process_group(_backend(device), store=store, rank=args.rank, world_size=args.world,
                            timeout=timeout)
    try:
        torch.manual_seed(recipe.run.seed)
        follow(work.recipe_model(recipe.model).to(device), recipe, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
