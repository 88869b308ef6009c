"""Device resolution and the GPU paths. The CPU half runs everywhere; the tests marked `gpu` need a
CUDA device and skip without one (they run on a GPU machine and in bench/gpu_check.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from spotlight.errors import ConfigError
from spotlight.parallel import device as dev

NO_CUDA = dev.probe_cuda()


def test_cpu_and_auto_resolve_and_a_missing_cuda_is_one_line_naming_the_field():
    assert dev.resolve_device("cpu") == torch.device("cpu")
    assert dev.resolve_device("auto").type == ("cpu" if NO_CUDA else "cuda")
    with pytest.raises(ConfigError, match="run.device must be one of auto, cpu, cuda") as e:
        dev.resolve_device("tpu")
    assert "\n" not in str(e.value)
    if NO_CUDA:
        with pytest.raises(ConfigError, match=r"run.device = 'cuda' but CUDA is not usable here: ") as e:
            dev.resolve_device("cuda")
        assert "\n" not in str(e.value)
        assert dev.probe_cupy() is not None and dev.probe_nccl() is not None


def test_group_backend_is_gloo_on_cpu():
    assert dev.group_backend(torch.device("cpu")) == "gloo"


def test_cuda_ipc_refuses_a_cpu_tensor():
    with pytest.raises(ValueError, match="CUDA IPC needs a CUDA tensor"):
        dev.cuda_ipc_export(torch.ones(3))


_IMPORTER = """
import json, sys, torch
from spotlight.parallel.device import cuda_ipc_import
h = json.loads(sys.stdin.read())
for k in ("handle", "ref_counter_handle", "event_handle"):
    h[k] = None if h[k] is None else bytes.fromhex(h[k])
t = cuda_ipc_import(h)
print(json.dumps({"sum": float(t.sum()), "shape": list(t.shape)}))
t.mul_(2)  # write through the mapping: the exporter sees it
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA: {NO_CUDA}")
def test_cuda_ipc_hands_a_tensor_to_another_process_without_a_copy():
    t = torch.arange(12.0, device="cuda").reshape(3, 4)[1:]  # a view with a storage offset
    h = dev.cuda_ipc_export(t).to_wire()
    for k in ("handle", "ref_counter_handle", "event_handle"):
        h[k] = None if h[k] is None else h[k].hex()
    out = subprocess.run([sys.executable, "-c", _IMPORTER], input=json.dumps(h), capture_output=True,
                         text=True, timeout=100, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"sum": float(torch.arange(4.0, 12.0).sum()), "shape": [2, 4]}
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), 2 * torch.arange(4.0, 12.0).reshape(2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA: {NO_CUDA}")
def test_peer_copy_moves_the_bytes():
    src = torch.randn(1 << 20, device="cuda:0")
    dst = torch.empty(1 << 20, device=f"cuda:{torch.cuda.device_count() - 1}")
    path = dev.peer_copy(dst, src)
    torch.cuda.synchronize()
    assert path in ("cupy", "torch") and torch.equal(dst.cpu(), src.cpu())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA: {NO_CUDA}")
def test_sp_over_nccl_matches_single_process():
    from spotlight.parallel.exactness import check

    degree = 2 if torch.cuda.device_count() >= 2 else 1  # NCCL needs one GPU per rank
    r = check(degree, device="cuda", timeout_s=280)
    assert r["velocity"] <= 1e-4 * max(1.0, r["scale"]["velocity"])
    assert r["log_prob"] <= 1e-4 * max(1.0, r["scale"]["log_prob"])


def test_run_device_is_checked_where_the_recipe_is_read():
    from spotlight.recipe import load_recipe

    with pytest.raises(ConfigError, match="run.device must be one of auto, cpu, cuda, got 'gpu'"):
        load_recipe("tiny", ['run.device="gpu"'])
    if NO_CUDA:  # asked for and absent: the Loop refuses before it builds anything
        from spotlight.loop import Loop

        with pytest.raises(ConfigError, match="run.device = 'cuda' but CUDA is not usable here"):
            Loop(load_recipe("tiny", ['run.device="cuda"', "model.checkpoint=none"]), progress=False)
        # ... and so does the runtime, before any actor starts (not a worker's traceback).
        from spotlight.api import Experiment

        exp = Experiment("demo", ['run.device="cuda"', "model.checkpoint=none"])
        with pytest.raises(ConfigError, match="run.device = 'cuda' but CUDA is not usable here"):
            exp.run(progress=False)
        assert exp.runtime is None


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(NO_CUDA is not None, reason=f"no CUDA: {NO_CUDA}")
def test_a_rollout_and_a_trainer_update_on_the_gpu_follow_the_cpu(tmp_path):
    """run.device = cuda: the same seeds give the same trajectory as on the CPU up to float
    rounding (counter-based noise is drawn on the host), and one GRPO update moves the weights alike."""
    from tiny_recipe import TINY_MODEL

    from spotlight import work
    from spotlight.comm.messages import RolloutWork
    from spotlight.loop import Loop
    from spotlight.recipe import load_recipe

    out = {}
    for device in ("cpu", "cuda"):
        recipe = load_recipe("tiny", [*TINY_MODEL, f'run.device="{device}"', f'run.out_dir="{tmp_path}"'])
        loop = Loop(recipe, progress=False)
        assert next(loop.model.parameters()).device.type == device
        job = RolloutWork(prompt="two red circles", seeds=list(range(8)), version=0, init_seed=None)
        g = work.rollout(loop.model, job, recipe.sampler, loop.reward, loop.shape)
        assert g.latents.device.type == "cpu"  # groups live in host memory
        g.rewards = torch.linspace(0, 1, 8)  # a spread, so the update has something to follow
        stats = loop.trainer.update([g])
        out[device] = (g.latents, torch.cat([p.detach().cpu().flatten() for p in loop.trainer.params]), stats)
    assert (out["cpu"][0] - out["cuda"][0]).abs().max() < 1e-3
    moved_cpu = out["cpu"][2]["update_norm"]
    assert moved_cpu > 0 and abs(out["cuda"][2]["update_norm"] - moved_cpu) < 0.05 * moved_cpu
    assert (out["cpu"][1] - out["cuda"][1]).abs().max() < 1e-3


@pytest.mark.skipif(NO_CUDA is None, reason="CUDA is usable here")
async def test_a_worker_that_cannot_run_the_recipe_says_so_in_one_line(tmp_path):
    # A worker process started by hand (a spot host's agent does this) with a setting it cannot
    # run with: its start fails with the worker's one line, not "failed to start (exit 1)".
    from spotlight.actors.store.service import TensorStoreService
    from spotlight.actors.worker.client import WorkerHandle
    from spotlight.recipe import load_recipe

    recipe = load_recipe("tiny", ["model.checkpoint=none", "model.layers=1"]).to_dict()
    recipe["run"]["device"] = "cuda"
    h = WorkerHandle(0, "cpu-node", str(tmp_path))
    async with TensorStoreService(f"ipc://{tmp_path}/s.sock", shm=False) as store:
        with pytest.raises(ConfigError, match=r"^worker cpu-node/w0: run.device = 'cuda' but CUDA is not"):
            await h.start(store.endpoint, recipe, timeout=60, rpc_timeout=5)
    assert not h.alive
