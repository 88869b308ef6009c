"""Each family's tiny diffusers pipeline through the real runtime: a reserved and a spot
worker load the transformer and VAE from the folder, take the prompt embeddings the driver put in
the tensor store (no cache folder, no text encoder on a worker), commit the latent after every
step; a worker SIGKILLed mid-request is resumed elsewhere from its last commit, and the trajectory
equals an uninterrupted in-process one bit for bit; the trainer's update then recomputes its
log-probs."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from pipeline_runtime import serving
from polling import wait_for
from trajectory import same_as_reference

from spotlight.actors.procs import descendants
from spotlight.comm import messages as m
from spotlight.pipelines.text import fetch_prompts
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.work import image_shape, policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 6
SEEDS = [11, 12, 13, 14]
PROMPT = "two red circles"


@pytest.fixture(scope="module", params=["qwen-image", "flux", "sd3"])
def runtime(request, tmp_path_factory, tiny_pipeline_dir):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("pipeline_faults")
    recipe = load_recipe("tiny_pipeline", [
        f"model.pipeline={tiny_pipeline_dir(request.param)}", f"model.text_cache={out / 'text'}",
        f"run.out_dir={out}", f"sampler.steps={STEPS}", "run.group_size=4", "grpo.finetune=full",
        "runtime.reserved_workers=1", "runtime.spot_workers=1", "runtime.lease_s=0.9",
        "runtime.heartbeat_s=0.3", "runtime.step_delay_s=0.05",  # a slow device: kills land mid-request
    ])
    torch.manual_seed(0)
    model = policy_model(recipe)
    # the trainer's side encodes the prompts once; the workers read the cache (no text encoder)
    rt_ref = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, image_shape(recipe))
    assert model.text.encoded == (1 if request.param == "flux" else 2)  # + the CFG negative prompt
    # the workers have no cache folder: the embeddings reach them through the tensor store only
    shutil.rmtree(out / "text")
    with serving(recipe, model, [PROMPT]) as rt:
        rt.reference, rt.recipe = rt_ref, recipe
        yield rt
    assert not (out / "text").exists()  # no worker encoded a prompt (it would have cached it)


def test_pipeline_rollout_killed_mid_request_resumes_bit_identical(runtime):
    rt = runtime
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="pipe/0", batch="7", work=job)]))
    held = wait_for(lambda: rt.call(rt.store.get_commit("pipe/0")), 60, "a commit of pipe/0")
    worker = held[2]["worker"]
    kind = worker.split("/")[0].removeprefix("local-")
    (victim,) = descendants(rt.agents[kind].pid)
    os.kill(victim, signal.SIGKILL)
    done = rt.call(rt.queue.wait_batch("7", 90), timeout=120)
    (result,) = done.results
    assert done.dead == [] and result.resumed_from >= 1  # from a commit on latents, not from step 0
    traj, _ = same_as_reference(rt, result)
    # the trainer's update on the group the runtime returned: log-probs recomputed exactly
    from spotlight.policy.grpo import GRPOTrainer
    from spotlight.work import group

    recipe = rt.recipe
    trainer_model = policy_model(recipe).requires_grad_(True)
    trainer_model.vae.requires_grad_(False)
    rt.call(fetch_prompts(rt.store, trainer_model, [PROMPT]))  # as a worker does: no text encoder here
    trainer = GRPOTrainer(trainer_model, recipe.grpo, recipe.sampler)
    stats = trainer.update([group(job, traj["latents"], traj["log_probs"], [0.1, 0.4, 0.2, 0.9])])
    assert stats["ratio_dev"] < 1e-5 and stats["update_norm"] > 0
