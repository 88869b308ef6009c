"""Diffusers pipeline folders as the model (spotlight.pipelines), on the tiny folders of each
family: built offline and reloaded by diffusers; one GRPO iteration in one process; the prompt
embeddings cached; export → diffusers reload → the project's own ODE sample; bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from spotlight.errors import ConfigError, NotFound
from spotlight.recipe import load_recipe

FAMILIES = ["qwen-image", "flux", "sd3"]
SIZE, STEPS, GUIDANCE = 32, 2, 2.5


def _recipe(folder, tmp_path, *more):
    return load_recipe("tiny_pipeline", [
        f"model.pipeline={folder}", f"model.image_size={SIZE}", f"model.text_cache={tmp_path / 'text'}",
        f"model.guidance_scale={GUIDANCE}", f"run.out_dir={tmp_path / 'runs'}", f"sampler.steps={STEPS}",
        f"sampler.eval_steps={STEPS}", "run.group_size=4", "run.prompts_per_iteration=1", *more,
    ])


def _diffusers_image(folder, lora_dir, family, prompt, x1):
    """The reloaded diffusers pipeline's deterministic output for the initial latent x1, in [0, 1]."""
    from diffusers import DiffusionPipeline

    from spotlight.models.dit import patchify

    pipe = DiffusionPipeline.from_pretrained(folder)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    kw = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="pt", max_sequence_length=32,
              sigmas=list(np.linspace(1.0, 1 / STEPS, STEPS)))
    if family == "qwen-image":
        kw.update(latents=patchify(x1, 2), negative_prompt="", true_cfg_scale=GUIDANCE)
    elif family == "flux":
        kw.update(latents=patchify(x1, 2), guidance_scale=GUIDANCE)
    else:  # SD3's default spacing differs from the pipelines' linspace(1, 1/N): pass the same sigmas
        kw.update(latents=x1, negative_prompt="", guidance_scale=GUIDANCE)
    return pipe(prompt, **kw).images


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_folder_reloads_and_generates(tiny_pipeline_dir, family):
    from diffusers import DiffusionPipeline

    folder = tiny_pipeline_dir(family)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 3_000_000
    pipe = DiffusionPipeline.from_pretrained(folder)
    kw = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="np", max_sequence_length=32)
    a, b = (pipe("two red", generator=torch.Generator().manual_seed(3), **kw).images for _ in range(2))
    assert a.shape == (1, SIZE, SIZE, 3) and np.isfinite(a).all() and a.std() > 0
    np.testing.assert_array_equal(a, b)


def test_make_pipeline_is_deterministic(tiny_pipeline_dir, tmp_path):
    from spotlight.pipelines.tiny import make_pipeline

    first, second = tiny_pipeline_dir("flux"), make_pipeline("flux", tmp_path / "again")
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for f in files:
        assert (first / f).read_bytes() == (second / f).read_bytes(), f


def test_qwen_tokenizer_template_prefix(tiny_pipeline_dir):
    """QwenImagePipeline drops the first 34 tokens of its chat template: exactly the prefix."""
    from transformers import AutoTokenizer

    from spotlight.pipelines.tiny import QWEN_DROP, QWEN_TEMPLATE_PREFIX

    tok = AutoTokenizer.from_pretrained(tiny_pipeline_dir("qwen-image") / "tokenizer")
    assert len(tok(QWEN_TEMPLATE_PREFIX).input_ids) == QWEN_DROP
    ids = tok(QWEN_TEMPLATE_PREFIX + "two red circles").input_ids
    assert tok.decode(ids[QWEN_DROP:]) == "two red circles"


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_iteration_then_lora_export_matches_diffusers(tiny_pipeline_dir, tmp_path, family):
    """One GRPO iteration (LoRA, KL to the adapter-disabled base) in one process on the pipeline's
    latents; the exported adapter loaded by diffusers reproduces the project's ODE sample."""
    from spotlight.loop import Loop
    from spotlight.pipelines.export import export_model
    from spotlight.policy.sampler import initial_noise, sample_ode
    from spotlight.work import image_shape

    folder = tiny_pipeline_dir(family)
    recipe = _recipe(folder, tmp_path)
    loop = Loop(recipe, progress=False)
    model = loop.model
    lora = {k: v.clone() for k, v in model.state_dict().items()}
    assert lora and all(".lora_" in k for k in lora)  # what a worker receives: the adapter only
    rec = loop.step(0)
    assert rec["ratio_dev"] < 1e-4  # sampling and training compute the same log-prob
    assert np.isfinite(rec["loss"]) and len(rec["rewards"][0]) == 4
    moved = sum(float((v - lora[k]).abs().sum()) for k, v in model.state_dict().items())
    assert moved > 0

    shape = image_shape(recipe)
    ours = (sample_ode(model, ["two red circles"], [11], recipe.sampler, shape) + 1) / 2
    export_model(model, tmp_path / "lora")
    ref = _diffusers_image(folder, tmp_path / "lora", family, "two red circles", initial_noise([11], shape))
    assert (ref - ours).abs().max() < 1e-4


def test_full_finetune_export_is_a_pipeline_folder(tiny_pipeline_dir, tmp_path):
    from spotlight.loop import Loop
    from spotlight.pipelines.export import export_model
    from spotlight.policy.sampler import initial_noise, sample_ode
    from spotlight.work import image_shape

    folder = tiny_pipeline_dir("sd3")
    recipe = _recipe(folder, tmp_path, "grpo.finetune=full", "grpo.lr=1e-3")
    loop = Loop(recipe, progress=False)
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    assert before and all(k.startswith("dit.") for k in before)  # the VAE stays in the folder
    loop.step(0)
    assert any(not torch.equal(v, before[k]) for k, v in loop.model.state_dict().items())
    shape = image_shape(recipe)
    ours = (sample_ode(loop.model, ["a red circle"], [5], recipe.sampler, shape) + 1) / 2
    export_model(loop.model, tmp_path / "full")
    ref = _diffusers_image(tmp_path / "full", None, "sd3", "a red circle", initial_noise([5], shape))
    assert (ref - ours).abs().max() < 1e-4


def test_prompt_embeddings_cached_workers_load_no_text_encoder(tiny_pipeline_dir, tmp_path):
    from spotlight.work import policy_model

    recipe = _recipe(tiny_pipeline_dir("qwen-image"), tmp_path)
    trainer_side = policy_model(recipe)
    prompts = ["two red circles", "a blue square above a red circle"]
    first = trainer_side.encode(prompts)
    assert trainer_side.text.encoded == 3  # two prompts + the negative prompt, once each
    trainer_side.encode(prompts)
    assert trainer_side.text.encoded == 3
    worker = policy_model(recipe)  # a fresh process's model: embeddings from the disk cache
    again = worker.encode(prompts)
    assert worker.text.encoder is None and worker.text.encoded == 0
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert "mask" in first  # different prompt lengths: padded with a mask, as Qwen-Image's pipeline
    assert not any(n.startswith(("text_encoder", "vae.encoder")) for n, _ in worker.named_parameters()
                   if "qwen" not in recipe.model.pipeline)


def _copy(folder, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_bad_pipeline_folders_are_one_line(tiny_pipeline_dir, tmp_path):
    folder = tiny_pipeline_dir("flux")
    with pytest.raises(NotFound) as e:
        load_recipe(None, [f"model.pipeline={tmp_path}"])
    assert "model_index.json" in _one_line(e)

    bad = _copy(folder, tmp_path)
    index = json.loads((bad / "model_index.json").read_text())
    (bad / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f"model.pipeline={bad}"])
    assert "QwenImagePipeline, FluxPipeline, StableDiffusion3Pipeline" in _one_line(e)

    (bad / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(bad / "text_encoder_2")
    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f"model.pipeline={bad}"])
    assert "text_encoder_2" in _one_line(e)

    with pytest.raises(ConfigError) as e:
        load_recipe(None, [f"model.pipeline={folder}", "model.image_size=34"])
    assert "multiple of 4" in _one_line(e)

    with pytest.raises(ConfigError) as e:  # a pipeline's canvas is square: no silent square strip
        load_recipe(None, [f"model.pipeline={folder}", "model.image_width=64"])
    assert "model.image_width" in _one_line(e)

    with pytest.raises(ConfigError) as e:  # the Ulysses processor is Qwen-Image's joint attention
        load_recipe("tiny_pipeline", [f"model.pipeline={folder}", "runtime.sp_degree=2",
                                      "runtime.reserved_workers=2", "runtime.spot_workers=2"])
    assert "sp_degree > 1 with model.pipeline supports Qwen-Image folders" in _one_line(e)
    with pytest.raises(ConfigError) as e:  # the tiny Qwen-Image transformer has 2 heads
        load_recipe("tiny_pipeline", [f"model.pipeline={tiny_pipeline_dir('qwen-image')}",
                                      "runtime.sp_degree=4", "runtime.reserved_workers=4",
                                      "runtime.spot_workers=4"])
    assert "must divide the attention heads" in _one_line(e)


def test_lora_target_matching_nothing_is_one_line(tiny_pipeline_dir, tmp_path):
    from spotlight.work import recipe_model

    recipe = _recipe(tiny_pipeline_dir("sd3"), tmp_path, 'model.lora_targets=["attn.to_q", "to_nothing"]')
    with pytest.raises(ConfigError) as e:
        recipe_model(recipe.model)
    assert "'to_nothing' matches no module" in _one_line(e)


def test_scheduler_shift_comes_from_the_folder(tiny_pipeline_dir, tmp_path):
    """Dynamic shift (exp(mu) of the image's token count) and shift_terminal, as the pipeline's
    scheduler computes its sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from spotlight.policy.sampler import timesteps

    folder = tiny_pipeline_dir("qwen-image")
    recipe = _recipe(folder, tmp_path)
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
    c = sched.config
    tokens = (SIZE // 2 // 2) ** 2
    mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=list(np.linspace(1.0, 1 / 6, 6)), mu=mu)
    ours = timesteps(6, recipe.sampler.shift, recipe.sampler.shift_terminal)
    np.testing.assert_allclose(ours.numpy(), sched.sigmas.numpy(), atol=1e-6)
    assert recipe.sampler.shift_terminal == pytest.approx(0.02)


RECIPES = [("qwen_image_lora", "qwen-image", 16), ("flux_lora", "flux", 24), ("sd3_lora", "sd3", 24)]


@pytest.mark.parametrize("name,family,group", RECIPES)
def test_shipped_recipes_load_on_a_folder_of_their_family(tiny_pipeline_dir, name, family, group):
    recipe = load_recipe(name, [f"model.pipeline={tiny_pipeline_dir(family)}"])
    assert recipe.model.image_size == 512 and recipe.grpo.finetune == "lora"
    assert recipe.run.group_size == group
    assert recipe.trainer.ranks == 8  # the update sharded over 8 GPUs (spotlight.parallel.trainer)
    with pytest.raises(NotFound):  # the placeholder path: one line, before anything starts
        load_recipe(name)


@pytest.mark.slow
def test_spotlight_run_tiny_pipeline(tiny_pipeline_dir, tmp_path):
    """The documented command: `spotlight run tiny_pipeline model.pipeline=OUT run.iterations=2`."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "spotlight.cli", "run", "tiny_pipeline",
         f"model.pipeline={tiny_pipeline_dir('sd3')}", "run.iterations=2", f"run.out_dir={tmp_path}",
         f"model.text_cache={tmp_path / 'text'}", "--no-progress"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert summary["iterations"] == 2
    metrics = [json.loads(x) for x in (tmp_path / "tiny_pipeline" / "metrics.jsonl").read_text().splitlines()]
    assert [m["event"] for m in metrics] == ["eval", "iteration", "iteration", "eval"]
    ckpt = tmp_path / "tiny_pipeline" / "checkpoints" / "iter_0002.safetensors"
    # `spotlight export` of the run's checkpoint: the adapter diffusers loads, with the trained weights
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    from spotlight.export import export

    record = export(ckpt, tmp_path / "exported")
    assert record["parts"] == ["lora"] and record["iteration"] == 2
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline_dir("sd3"))
    pipe.load_lora_weights(tmp_path / "exported")
    import re

    def plain(key: str) -> str:  # the adapter's name out of the key ("default", "default_0", ...)
        return re.sub(r"\.default(_\d+)?", "", key.removeprefix("dit."))

    trained = {plain(k): v for k, v in load_file(str(ckpt)).items()}
    loaded = {plain(k): v for k, v in pipe.transformer.state_dict().items() if "lora" in k}
    assert trained and trained.keys() == loaded.keys()
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())


def test_bf16_weights_train_a_float32_adapter(tiny_pipeline_dir, tmp_path):
    """model.dtype = bfloat16: bf16 transformer and VAE, the LoRA adapter and its AdamW state in
    float32; sampling and training still compute the same log-prob (ratio 1 at the first step)."""
    from spotlight.loop import Loop

    recipe = _recipe(tiny_pipeline_dir("flux"), tmp_path, "model.dtype=bfloat16")
    loop = Loop(recipe, progress=False)
    dit = loop.model.dit
    assert {p.dtype for n, p in dit.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for p in loop.trainer.params} == {torch.float32} and loop.trainer.params
    rec = loop.step(0)
    assert rec["ratio_dev"] < 1e-4 and rec["update_norm"] > 0
    state = loop.trainer.opt.state[loop.trainer.params[0]]
    assert state["exp_avg"].dtype == torch.float32


def test_gradient_checkpointing_gives_the_same_gradients(tiny_pipeline_dir, tmp_path):
    from spotlight.policy.sampler import step_log_prob
    from spotlight.work import image_shape, recipe_model

    grads = []
    for gc in (False, True):
        flag = f"model.gradient_checkpointing={str(gc).lower()}"
        recipe = _recipe(tiny_pipeline_dir("qwen-image"), tmp_path, flag)
        model = recipe_model(recipe.model)
        model.dit.train()
        shape = image_shape(recipe)
        g = torch.Generator().manual_seed(0)
        x, x_next = torch.randn(2, *shape, generator=g), torch.randn(2, *shape, generator=g)
        lp, _, _ = step_log_prob(model, x, x_next, 0, model.encode(["a", "b"]), recipe.sampler)
        lp.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.dit.parameters() if p.grad is not None]))
    assert model.dit.is_gradient_checkpointing
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_explored_seeds_and_resume_on_a_pipeline(tiny_pipeline_dir, tmp_path):
    """Seed exploration (DanceGRPO's best-of-N, decoded images scored) on latents, and a run
    resumed from its iteration-1 checkpoint ends with the weights of the uninterrupted run."""
    from safetensors.torch import load_file

    from spotlight.loop import Loop

    folder = tiny_pipeline_dir("sd3")
    more = ["explore.schedule=critical", "explore.candidates=4", "run.eval_seeds=1", "run.eval_samples=1",
            "run.checkpoint_every=1", "run.eval_every=5"]
    whole = Loop(_recipe(folder, tmp_path / "a", *more, "run.iterations=2"), progress=False)
    whole.run()
    records = whole.metrics.read()
    assert [r["explore_returned"] for r in records if r["event"] == "iteration"] == [1, 1]
    Loop(_recipe(folder, tmp_path / "b", *more, "run.iterations=1"), progress=False).run()
    resumed = Loop(_recipe(folder, tmp_path / "b", *more, "run.iterations=2"), resume=True, progress=False)
    assert resumed.start_iteration == 1
    resumed.run()
    a = load_file(str(tmp_path / "a" / "runs" / "tiny_pipeline" / "checkpoints" / "iter_0002.safetensors"))
    b = load_file(str(tmp_path / "b" / "runs" / "tiny_pipeline" / "checkpoints" / "iter_0002.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grpo_iteration_with_the_ocr_reward_on_decoded_images(tiny_pipeline_dir, tmp_path):
    """The paper's text-rendering task on a real pipeline's latents: prompts that quote a word, the
    OCR reward reading the VAE-decoded images (detection then recognition), one GRPO iteration."""
    from spotlight.loop import Loop

    recipe = _recipe(tiny_pipeline_dir("qwen-image"), tmp_path, 'run.prompts="words"', 'reward.name="ocr"',
                     'reward.mode="full"', "reward.threads=1")
    assert all('"' in p for p in Loop(recipe, progress=False).prompts)
    rec = Loop(recipe, progress=False).step(0)
    rewards = np.asarray(rec["rewards"][0])
    assert rewards.shape == (4,) and ((0 <= rewards) & (rewards <= 1)).all()  # random weights read little
    assert rec["ratio_dev"] < 1e-4 and np.isfinite(rec["loss"])


def test_a_worker_s_awaited_ocr_score_reads_the_decoded_images(tiny_pipeline_dir, tmp_path):
    """The runtime's worker awaits `score_async`; it must score the VAE-decoded images, as the
    in-process `rewards` does, not the latents."""
    import asyncio

    from spotlight import work
    from spotlight.comm.messages import RolloutWork
    from spotlight.rewards import make_reward

    recipe = _recipe(tiny_pipeline_dir("qwen-image"), tmp_path)
    model = work.recipe_model(recipe.model)
    job = RolloutWork(prompt='a sign that says "SPOT"', seeds=[1, 2], version=0)
    run = work.Rollout(model, job, recipe.sampler, work.image_shape(recipe))
    while not run.done:
        run.step()
    assert run.images().shape == (2, SIZE, SIZE, 3)  # decoded pixels, not [2, C, h, w] latents
    reward = make_reward("ocr", mode="full", threads=1)
    (a, a_map), (b, b_map) = asyncio.run(run.scores_async(reward)), run.scores(reward)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a_map, b_map)
    np.testing.assert_array_equal(a_map, np.repeat(a[:, None], SIZE, 1))  # full mode: no columns


def test_qwen_image_recipe_takes_the_ocr_reward(tiny_pipeline_dir):
    recipe = load_recipe("qwen_image_lora", [f"model.pipeline={tiny_pipeline_dir('qwen-image')}",
                                             'reward.name="ocr"', 'run.prompts="words"'])
    assert recipe.reward.name == "ocr"
