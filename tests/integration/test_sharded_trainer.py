"""The sharded trainer (`trainer.ranks`, spotlight.parallel.trainer) on the CPU with gloo: one
iteration of a run whose GRPO update runs on 2 ranks (FSDP2: full fine-tuning and LoRA, with the
KL reference and gradient checkpointing on) ends at the same weights as the same run on 1 rank;
so does the embedded tiny DiT; bf16 full fine-tuning (FSDP2 mixed precision over float32 shards)
makes the update fp32 makes, to bf16's precision."""

from __future__ import annotations

import pytest
import torch

from spotlight.api import Experiment
from spotlight.recipe import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # runs of 1-2 iterations, 2 processes

ONE_ITERATION = ["run.iterations=1", "run.prompts_per_iteration=3", "run.group_size=4", "run.eval_seeds=1",
                 "run.eval_samples=1", "run.tensorboard=false", "sampler.steps=2", "sampler.eval_steps=2"]
"""3 groups over 2 ranks: the ranks' shares are uneven (one trains a weight-0 repeat)."""


def _run(recipe: str, tmp_path, ranks: int, *more: str) -> tuple[dict, dict]:
    """The run's trainable weights after one iteration, and its iteration record."""
    exp = Experiment(load_recipe(recipe, [*ONE_ITERATION, f"run.out_dir={tmp_path / 'runs'}",
                                          f"run.name=ranks{ranks}", f"trainer.ranks={ranks}", *more]))
    exp.run(progress=False)
    state = {k: v.detach().float().clone() for k, v in exp.loop.model.state_dict().items()}
    return state, next(r for r in exp.records if r["event"] == "iteration")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("finetune,dtype", [("lora", "float32"), ("full", "float32"), ("lora", "bfloat16")])
def test_two_ranks_equal_one(tiny_pipeline_dir, tmp_path, finetune, dtype):
    """(bf16 LoRA: the bf16 base and the fp32 adapter are sharded in the same FSDP units.)"""
    folder = tiny_pipeline_dir("qwen-image")
    more = [f"model.pipeline={folder}", f"model.text_cache={tmp_path / 'text'}", f"grpo.finetune={finetune}",
            "grpo.beta=0.04", "model.gradient_checkpointing=true", "grpo.timestep_fraction=1.0",
            f"model.dtype={dtype}"]
    one, rec1 = _run("tiny_pipeline", tmp_path, 1, *more)
    two, rec2 = _run("tiny_pipeline", tmp_path, 2, *more)
    if finetune == "lora":  # B starts at zero: the adapter's delta is what moved
        moved = max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k)
    else:
        from safetensors.torch import load_file

        base = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
        moved = max(float((v - base[k.removeprefix("dit.")]).abs().max()) for k, v in one.items())
    diff = _max_diff(one, two)
    print(f"{finetune} {dtype}: 2 ranks vs 1, max |diff| {diff:.2e}, max weight change {moved:.2e}")
    assert rec1["groups_trained"] == rec2["groups_trained"] == 3
    assert rec1["kl"] == pytest.approx(rec2["kl"], rel=1e-4, abs=1e-12)  # the reference ran on both
    assert rec1["grad_norm"] == pytest.approx(rec2["grad_norm"], rel=1e-4)
    assert moved > 5e-5  # the update did something (Adam's first step: ~lr per weight)
    assert diff < 1e-3 * moved, (diff, moved)


def test_embedded_dit_two_ranks_equal_one(tmp_path):
    # the demo's model and objective (awm, KL to a sharded reference copy); no moving average
    more = ["grpo.ema_decay=0.0", "explore.schedule=off", "grpo.lr=1e-3", "grpo.warmup_iterations=0"]
    one, _ = _run("tiny", tmp_path, 1, *more)
    two, _ = _run("tiny", tmp_path, 2, *more)
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import build_model

    base = {k: v.float() for k, v in build_model(load_recipe("tiny").model, VOCABULARY).state_dict().items()}
    moved = max(float((v - base[k]).abs().max()) for k, v in one.items())
    diff = _max_diff(one, two)
    print(f"embedded DiT: 2 ranks vs 1, max |diff| {diff:.2e}, max weight change {moved:.2e}")
    assert moved > 1e-4
    assert diff < 1e-3 * moved, (diff, moved)


def test_bf16_full_finetune_is_fp32_update_to_bf16_precision(tiny_pipeline_dir, tmp_path):
    """model.dtype = bfloat16, full fine-tuning, 2 ranks: float32 shards and AdamW state, bf16
    compute. AdamW with adam_eps ≫ |g| makes a first step Δ = −lr·g/(|g| + eps), Lipschitz in the
    gradient, so ‖Δ_bf16 − Δ_fp32‖ / ‖Δ_fp32‖ is the relative error of the gradient bf16 compute
    makes: unit roundoff 2⁻⁸ ≈ 0.4% per rounding, grown over the 2-layer transformer's forward and
    backward passes (and the GRPO ratio's exp of a log-prob difference) to a few percent — the bound
    is 10%. The lower bound (1e-4) shows bf16 was in use: float32 ranks differ from one process
    by float rounding only (the tests above)."""
    from spotlight import work
    from spotlight.comm.messages import RolloutWork
    from spotlight.parallel.ranks import TrainerRanks
    from spotlight.policy.grpo import GRPOTrainer

    folder = tiny_pipeline_dir("qwen-image")
    common = [f"model.pipeline={folder}", f"model.text_cache={tmp_path / 'text'}", "grpo.finetune=full",
              "grpo.beta=0.0", "grpo.lr=1.0", "grpo.adam_eps=1.0", "grpo.timestep_fraction=1.0",
              "sampler.steps=2", "trainer.ranks=2", f"run.out_dir={tmp_path / 'runs'}"]
    fp32 = load_recipe("tiny_pipeline", common)
    bf16 = load_recipe("tiny_pipeline", [*common, "model.dtype=bfloat16"])
    torch.manual_seed(0)
    model = work.recipe_model(fp32.model)
    reward, shape = work.recipe_reward(fp32), work.image_shape(fp32)
    prompts = ["two red circles", "a blue square above a red circle", "three green triangles"]
    jobs = [RolloutWork(prompt=p, seeds=[10 * i + s for s in range(1, 5)], version=0)
            for i, p in enumerate(prompts)]
    groups = [work.rollout(model, job, fp32.sampler, reward, shape) for job in jobs]
    start32 = {k: v.clone() for k, v in model.state_dict().items()}
    GRPOTrainer(model, fp32.grpo, fp32.sampler, seed=0).update(groups)
    d32 = {k: v - start32[k] for k, v in model.state_dict().items()}

    with TrainerRanks(bf16, tmp_path / "logs") as ranks:
        deployed = work.recipe_model(bf16.model)
        assert next(deployed.dit.parameters()).dtype == torch.bfloat16
        start16 = {k: v.float() for k, v in deployed.state_dict().items()}
        trainer = ranks.factory(deployed, bf16.grpo, bf16.sampler, seed=0)
        trainer.update(groups)
        assert trainer.local.mixed_precision
        after = trainer.trainable_state()
        moments = [v for s in trainer.opt.state_dict()["state"].values() for k, v in s.items() if k != "step"]
    assert {v.dtype for v in after.values()} == {torch.float32}  # the shards are float32 ...
    assert moments and {v.dtype for v in moments} == {torch.float32}  # ... and so is AdamW's state
    d16 = {k: v - start16[k] for k, v in after.items()}
    norm = torch.sqrt(sum((v ** 2).sum() for v in d32.values()))
    rel = float(torch.sqrt(sum(((d16[k] - d32[k]) ** 2).sum() for k in d32)) / norm)
    print(f"bf16 mixed precision vs fp32: relative update difference {rel:.2e}, norm {float(norm):.2e}")
    assert 1e-4 < rel < 0.1, rel


def test_sharded_run_resumes_where_it_stopped(tiny_pipeline_dir, tmp_path):
    """A 2-rank run stopped after iteration 1 and resumed (its checkpoint holds AdamW's state
    gathered whole; the resumed ranks get it back sharded) ends where the uninterrupted run ends."""
    folder = tiny_pipeline_dir("qwen-image")
    more = [f"model.pipeline={folder}", f"model.text_cache={tmp_path / 'text'}", "grpo.finetune=full",
            "grpo.lr=1e-3", "run.checkpoint_every=1", "trainer.ranks=2"]

    def run(name: str, iterations: int, resume: bool = False) -> dict:
        overrides = [*ONE_ITERATION, f"run.out_dir={tmp_path / 'runs'}", f"run.name={name}",
                     f"run.iterations={iterations}", *more]
        exp = Experiment(load_recipe("tiny_pipeline", overrides))
        exp.run(resume=resume, progress=False)
        return {k: v.detach().float().clone() for k, v in exp.loop.model.state_dict().items()}

    whole = run("whole", 2)
    run("cut", 1)
    resumed = run("cut", 2, resume=True)
    diff = _max_diff(whole, resumed)
    print(f"resumed 2-rank run vs uninterrupted: max |diff| {diff:.2e}")
    assert diff < 1e-6, diff


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ranks need 2 GPUs")
def test_two_ranks_on_nccl_equal_one(tiny_pipeline_dir, tmp_path):
    """The same equality on GPUs: NCCL, rank r on cuda:r (chosen from run.device)."""
    folder = tiny_pipeline_dir("qwen-image")
    more = [f"model.pipeline={folder}", f"model.text_cache={tmp_path / 'text'}", "grpo.finetune=lora",
            "grpo.beta=0.04", "model.gradient_checkpointing=true", "run.device=cuda"]
    one, _ = _run("tiny_pipeline", tmp_path, 1, *more)
    two, _ = _run("tiny_pipeline", tmp_path, 2, *more)
    moved = max(float(v.abs().max()) for k, v in one.items() if "lora_B" in k)
    assert moved > 5e-5
    assert _max_diff(one, two) < 1e-2 * moved  # GPU kernels: reduction order differs by rank count


def test_column_credit_two_ranks_equal_one(tmp_path):
    """The OCR task's per-column credit (`grpo.awm_credit = "columns"`) reaches every rank: rank 1's
    share trains on the same maps as one rank does (without them it would fall back to the
    rewards, and the weights would differ)."""
    more = ["grpo.ema_decay=0.0", "grpo.lr=1e-3", "grpo.warmup_iterations=0", 'grpo.awm_credit="columns"',
            "reward.threads=1"]
    one, _ = _run("ocr", tmp_path, 1, *more)
    two, _ = _run("ocr", tmp_path, 2, *more)
    flat, _ = _run("ocr", tmp_path, 1, *more, 'grpo.awm_credit="sample"')  # per-sample advantages
    assert _max_diff(one, two) < 1e-3 * _max_diff(one, flat), (_max_diff(one, two), _max_diff(one, flat))
