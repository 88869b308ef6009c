"""`spotlight run`, `spotlight run --resume`, `spotlight eval` and `spotlight export` end to end,
through the command line's own entry point, on a tiny model that takes seconds:

- a run stopped after 2 iterations and resumed to 3 ends bit-identical to a run of 3 (weights,
  optimizer-driven rewards), under full fine-tuning and under LoRA with a moving average of the
  weights (`grpo.ema_decay`: the checkpoint's model is the average, the trained weights resume too),
  and the adaptive KL weight (`grpo.kl_target`) resumes at the value it had;
- `spotlight eval` of the final checkpoint (a LoRA one included) reproduces the run's own final
  evaluation (with a moving average: the average is what the run evaluated);
- `spotlight export` writes a diffusers folder (and, under LoRA, a peft adapter) whose re-loaded
  model has the trained model's forward, bit for bit."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch
from safetensors.torch import load_file

from spotlight.cli import main
from spotlight.data.scenes import VOCABULARY
from spotlight.export import load_export
from spotlight.models.dit import ModelConfig, build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The shipped base model (its rewards are not all zero, so equal evaluations mean something), few
# steps and samples.
TINY = ["sampler.steps=4", "sampler.eval_steps=4", "sampler.sde_steps=2", "run.group_size=4",
        "explore.candidates=4", "run.prompts_per_iteration=2", "run.eval_every=100", "run.eval_seeds=1",
        "run.eval_samples=1", "run.checkpoint_every=100"]
LORA = ['grpo.finetune="lora"', "grpo.lora_rank=4", "grpo.lora_alpha=8.0"]
EMA = ["grpo.ema_decay=0.5"]  # with LoRA: one run for both (this file is minutes of CI)
# full fine-tuning without the average, with the adaptive β at a target so small that β rises after
# every iteration from the second on: the resumed run must go on with the β it had
FULL = ["grpo.ema_decay=0", "grpo.kl_target=1e-12", "grpo.kl_horizon=4"]


@pytest.fixture(autouse=True)
def sigterm_handler_is_put_back():
    """`spotlight run` turns SIGTERM into KeyboardInterrupt while it runs, and puts the handler (and
    the unraisable hook) back when it ends, in-process as here too."""
    handler, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    yield
    assert signal.getsignal(signal.SIGTERM) is handler and sys.unraisablehook is hook


def cli(capsys, *argv: str) -> dict:
    """Run `spotlight ARGV` in this process; the JSON summary that ends its output."""
    capsys.readouterr()
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("\n{") + 1 if not out.startswith("{") else 0:])


def run(capsys, out, name: str, iterations: int, extra: list[str], resume: bool = False) -> dict:
    return cli(capsys, "run", "tiny", *TINY, *extra, f"run.iterations={iterations}", f'run.out_dir="{out}"',
               f'run.name="{name}"', "--no-progress", *(["--resume"] if resume else []))


def records(out, name: str, event: str) -> list[dict]:
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.mark.parametrize("finetune", [FULL, LORA + EMA], ids=["full", "lora-ema"])
def test_resume_is_bit_identical_and_eval_reproduces_the_run(tmp_path, capsys, finetune):
    torch.set_num_threads(1)
    run(capsys, tmp_path, "whole", 3, finetune)
    run(capsys, tmp_path, "split", 2, finetune)
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir()) == [
        "iter_0002.optim.safetensors", "iter_0002.safetensors"]
    summary = run(capsys, tmp_path, "split", 3, finetune, resume=True)
    assert summary["iterations"] == 3

    whole, split = records(tmp_path, "whole", "iteration"), records(tmp_path, "split", "iteration")
    assert [r["iteration"] for r in split] == [0, 1, 2]  # each once: the resumed run rewrote nothing
    # the cut run's last evaluation (of the checkpoint's weights) is kept, the resumed run's added
    assert [r["iteration"] for r in records(tmp_path, "split", "eval")] == [0, 2, 3]
    for a, b in zip(whole, split, strict=True):
        assert (a["rewards"], a["loss"], a["beta"]) == (b["rewards"], b["loss"], b["beta"]), a["iteration"]
    if finetune == FULL:
        assert whole[2]["beta"] > whole[1]["beta"] >= whole[0]["beta"]  # the adaptive β moved, resumed there
    ckpt = "checkpoints/iter_0003.safetensors"
    w, s = load_file(tmp_path / "whole" / ckpt), load_file(tmp_path / "split" / ckpt)
    assert w.keys() == s.keys() and all(torch.equal(w[k], s[k]) for k in w)  # Adam state restored too
    lora = finetune != FULL
    if lora:
        assert any(".lora_A." in k for k in w)
    optim = ckpt.replace(".safetensors", ".optim.safetensors")
    wo, so = load_file(tmp_path / "whole" / optim), load_file(tmp_path / "split" / optim)
    assert wo.keys() == so.keys() and all(torch.equal(wo[k], so[k]) for k in wo)
    online = {k[len("model."):]: v for k, v in wo.items() if k.startswith("model.")}
    if lora:  # the model file is the average; the trained weights are in the optimizer file
        assert online.keys() == w.keys() and not all(torch.equal(online[k], w[k]) for k in w)
    else:
        assert not online

    final = records(tmp_path, "whole", "eval")[-1]
    assert final["iteration"] == 3
    ev = cli(capsys, "eval", "--checkpoint", str(tmp_path / "whole" / ckpt), "--out", str(tmp_path / "eval"),
             *TINY)
    # Same weights, same seeds: the run's own numbers. (A LoRA checkpoint is evaluated with the adapter
    # merged into the base, the same forward up to float rounding — here the same rewards.)
    assert ev["eval_reward"] == final["eval_reward"]
    assert ev["ode_train"]["reward"] == final["eval_ode_train"]
    assert ev["sde_train"]["reward"] == final["eval_sde_train"]
    assert ev["ode_train"]["shortfall"] == final["eval_ode_train_shortfall"]  # what it missed, by cause

    # The trained checkpoint, exported, re-loads (diffusers folder + LoRA adapter) to its forward.
    path = str(tmp_path / "whole" / ckpt)
    exported = cli(capsys, "export", "--checkpoint", path, "--out", str(tmp_path / "x"))
    assert (exported["lora"] == "lora") == lora and exported["iteration"] == 3
    trained = build_model(ModelConfig(checkpoint=path), VOCABULARY, merge_lora=False)
    assert torch.equal(velocity(load_export(tmp_path / "x")), velocity(trained))


def velocity(model) -> torch.Tensor:
    x, t = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([0.8, 0.2])
    with torch.no_grad():
        return model.velocity(x, t, model.encode(["a red circle", "two blue squares"]))
