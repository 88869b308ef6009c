"""Elastic SP on a real diffusers pipeline: a tiny Qwen-Image folder through the runtime with
runtime.sp_degree = 2 (a reserved node of three workers: a group and a spare). A request runs on a
group of two ranks, each holding half of the latent tokens (the Ulysses processor on
QwenImageTransformer2DModel, true CFG with the negative prompt, prompt embeddings from the tensor
store) and its trajectory is bit-identical to the single-process rollout; a member SIGKILLed
mid-request has its group re-formed with the spare, and the request resumes from its last commit on
latents, bit-identical again."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from pipeline_runtime import serving
from polling import wait_for
from trajectory import same_as_reference

from spotlight.actors.procs import descendants
from spotlight.comm import messages as m
from spotlight.policy.sampler import sde_rollout
from spotlight.recipe import load_recipe
from spotlight.work import image_shape, policy_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6
SEEDS = [11, 12, 13, 14]
PROMPT = "two red circles"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, tiny_pipeline_dir):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("pipeline_sp")
    recipe = load_recipe("tiny_pipeline", [
        f"model.pipeline={tiny_pipeline_dir('qwen-image')}", f"model.text_cache={out / 'text'}",
        f"run.out_dir={out}", f"sampler.steps={STEPS}", "run.group_size=4", "grpo.finetune=full",
        "runtime.sp_degree=2", "runtime.reserved_workers=3", "runtime.spot_workers=0",
        "runtime.lease_s=3", "runtime.heartbeat_s=0.3", "runtime.sp_timeout_s=2",
        "runtime.step_delay_s=0.05",  # a slow device: kills land mid-request
    ])
    torch.manual_seed(0)
    model = policy_model(recipe)
    reference = sde_rollout(model, [PROMPT] * 4, SEEDS, recipe.sampler, image_shape(recipe))
    with serving(recipe, model, [PROMPT]) as rt:
        rt.reference = reference
        yield rt


def test_a_pipeline_request_on_an_sp_group_is_bit_identical(runtime):
    rt = runtime
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="sp/0", batch="sp", work=job)]))
    (result,) = rt.call(rt.queue.wait_batch("sp", 120), timeout=150).results
    _, meta = same_as_reference(rt, result)
    assert result.resumed_from == 0 and len(meta["group"]) == 2  # two ranks ran it together


def test_a_killed_member_regroups_and_the_pipeline_request_resumes_bit_identical(runtime):
    rt = runtime
    job = m.RolloutWork(prompt=PROMPT, seeds=SEEDS, version=0)
    rt.call(rt.queue.submit([m.WorkRequest(request_id="kill/0", batch="kill", work=job)]))
    held = wait_for(lambda: rt.call(rt.store.get_commit("kill/0")), 90, "a commit of kill/0")
    rank0, victim = held[2]["group"]
    pids = {}
    for pid in descendants(rt.agents["reserved"].pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        if b"--worker-id" in args:
            pids[args[args.index(b"--worker-id") + 1].decode()] = pid
    os.kill(pids[victim], signal.SIGKILL)
    done = rt.call(rt.queue.wait_batch("kill", 120), timeout=150)
    (result,) = done.results
    assert done.dead == [] and result.resumed_from >= 1  # from a commit on latents, not from step 0
    _, meta = same_as_reference(rt, result)
    assert victim not in meta["group"]
