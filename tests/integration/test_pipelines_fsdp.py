"""FSDP2 on the CPU (gloo): one GRPO update of a tiny pipeline's transformer sharded over two
processes equals the same update in one process on all the groups."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

RANK = textwrap.dedent('''
    import os, sys, torch
    import torch.distributed as dist
    from datetime import timedelta
    from spotlight.recipe import load_recipe
    from spotlight.work import recipe_model
    from spotlight.policy.grpo import GRPOTrainer
    from spotlight.comm.messages import RolloutWork
    from spotlight import work
    from spotlight.pipelines.fsdp import shard, full_state

    torch.set_num_threads(1)
    folder, cache, out, world, rank, port = sys.argv[1:7]
    world, rank = int(world), int(rank)
    recipe = load_recipe("tiny_pipeline", [f"model.pipeline={folder}", f"model.text_cache={cache}",
                         "sampler.steps=2", "grpo.finetune=full", "grpo.beta=0.0", "grpo.lr=1e-3",
                         "grpo.timestep_fraction=1.0"])
    torch.manual_seed(0)
    model = recipe_model(recipe.model)
    reward, shape = work.recipe_reward(recipe), work.image_shape(recipe)
    prompts = ["two red circles", "a blue square above a red circle"]
    groups = [work.rollout(model, RolloutWork(prompt=p, seeds=[10 * i + 1, 10 * i + 2, 10 * i + 3],
                                              version=0), recipe.sampler, reward, shape)
              for i, p in enumerate(prompts)]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        shard(model)
        groups = groups[rank::world]
    trainer = GRPOTrainer(model, recipe.grpo, recipe.sampler, seed=0)
    trainer.update(groups)
    state = full_state(model) if world > 1 else dict(model.state_dict())
    if rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, out)
    if world > 1:
        dist.destroy_process_group()
''')


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fsdp2_world_two_equals_world_one(tiny_pipeline_dir, tmp_path):
    folder = tiny_pipeline_dir("qwen-image")
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cache = tmp_path / "text"

    def run(world: int, out) -> None:
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(cache), str(out), str(world),
                                   str(r), port], env=env, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]

    run(1, tmp_path / "one.pt")
    run(2, tmp_path / "two.pt")
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    base = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    assert one.keys() == two.keys()
    moved = max(float((one[k] - base[k.removeprefix("dit.")]).abs().max()) for k in one)
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"FSDP2 world 2 vs 1: max |diff| {diff:.2e}, max weight change {moved:.2e}")
    assert moved > 1e-4  # the update did something
    assert diff < 1e-5, (diff, moved)
