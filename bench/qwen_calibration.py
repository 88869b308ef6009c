"""Full-size Qwen-Image transformer on one GPU: the simulator's calibration figures, measured.

    PYTHONPATH=. python bench/qwen_calibration.py [--out calib.json] [--resolutions 512 1280]

Builds a random-initialized ``QwenImageTransformer2DModel`` from the published config (the one
``bench/pipeline_memory.py`` counts: 60 blocks, 24 heads x 128, 20.4 B parameters) directly on the
GPU in bf16 -- no download, no weights; a random model costs what the trained one costs -- and times,
with CUDA events after warm-up:

- one denoising step as the ``qwen_image_lora`` recipe runs it: a forward of the CFG pair (batch 2:
  the prompt and the negative prompt) and, for the curve, a forward of batch 1, at each resolution
  (512^2 -> 1,024 image tokens, 1280^2 -> 6,400) with the sim profile's 128 prompt tokens;
- one LoRA training step as the recipe's trainer runs it (rank 32 / alpha 64 on the family's targets,
  the adapter in fp32 over the bf16 base, gradient checkpointing, AdamW): forward and backward of the
  CFG pair, then the optimizer step;
- the full-size VAE's decode of one image (a rollout request decodes each sample for its reward;
  the sim does not price it);
- the peak GPU memory of each, and the seconds a process takes to import torch and diffusers and
  initialise CUDA (a worker's start before its model loads).

Each row is set beside what ``spotlight.sim.timing.TimingModel`` prices the same work at on an H200
(``sim/measured``: above 1 the sim is too slow, below 1 too fast), and the FLOP rate achieved.
Writes the figures as JSON with ``--out``. Needs CUDA; one H200 runs it in about two minutes.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time

import torch

from bench.pipeline_memory import FULL
from spotlight.pipelines.folder import LORA_TARGETS
from spotlight.sim.timing import GPUS, PROFILES, TimingModel

PEAK = GPUS["h200"].peak_flops
TEXT_TOKENS = PROFILES["qwen-image-20b"].text_tokens  # the sim's prompt length, so the rows compare


def inputs(res: int, batch: int, text_tokens: int, device: str) -> dict:
    """The transformer's inputs for ``batch`` images of ``res``^2, as QwenImagePipeline builds them:
    packed 2x2 latent patches of the 16-channel VAE latent at 1/8 scale, prompt embeddings of the
    text encoder's width, the timestep as a fraction of 1000."""
    side = res // 16
    g = torch.Generator(device).manual_seed(0)
    return dict(
        hidden_states=torch.randn(batch, side * side, 64, device=device, dtype=torch.bfloat16, generator=g),
        encoder_hidden_states=torch.randn(batch, text_tokens, 3584, device=device, dtype=torch.bfloat16,
                                          generator=g),
        encoder_hidden_states_mask=None,  # a prompt pair of one length: no padding to mask
        timestep=torch.full((batch,), 0.5, device=device, dtype=torch.bfloat16),
        img_shapes=[[(1, side, side)]] * batch,
        return_dict=False,
    )


def timed(fn, warmup: int, iters: int) -> float:
    """Mean seconds of ``fn()`` over ``iters`` calls after ``warmup`` (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9


def worker_start_s() -> float:
    """A fresh interpreter importing torch and diffusers and initialising CUDA (median of 3)."""
    code = "import torch, diffusers; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        runs.append(time.perf_counter() - t)
    return sorted(runs)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolutions", type=int, nargs="+", default=[512, 768, 1024, 1280])
    ap.add_argument("--train-resolutions", type=int, nargs="+", default=[512, 1280])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("qwen_calibration: needs a CUDA device (this bench times the full-size model on a GPU)")
    import diffusers
    from peft import LoraConfig

    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    out: dict = {"gpu": props.name, "torch": torch.__version__, "diffusers": diffusers.__version__,
                 "text_tokens": TEXT_TOKENS, "worker_start_s": worker_start_s(), "forward": [], "train": [],
                 "decode": []}
    cls, kw = FULL["qwen-image"]["transformer"]
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        dit = getattr(diffusers, cls)(**kw).eval()
    torch.set_default_dtype(torch.float32)
    torch.cuda.synchronize()
    out["params"] = sum(p.numel() for p in dit.parameters())
    out["build_s"] = time.perf_counter() - t
    out["weights_gb"] = peak_gb()
    print(f"{props.name}: {out['params'] / 1e9:.2f} B parameters built on the GPU in {out['build_s']:.1f} s, "
          f"{out['weights_gb']:.1f} GB; worker start (imports + CUDA) {out['worker_start_s']:.1f} s",
          flush=True)

    for res in args.resolutions:
        sim = TimingModel("qwen-image-20b", "h200", res)
        for batch in (1, 2):
            x = inputs(res, batch, TEXT_TOKENS, dev)
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                s = timed(functools.partial(dit, **x), args.warmup, args.iters)
            flops = sim.forward_flops(batch)
            # the sim prices a step = cfg_forwards (2) forwards of `batch`; a CFG pair is one step of batch 1
            sim_s = sim.step_s(1) if batch == 2 else sim.step_s(1) / sim.profile.cfg_forwards
            row = dict(resolution=res, tokens=sim.tokens, batch=batch, seconds=s, tflops=flops / s / 1e12,
                       mfu=flops / s / PEAK, peak_gb=peak_gb(), sim_s=sim_s)
            out["forward"].append(row)
            print(f"forward {res}^2 batch {batch}: {s:.3f} s, {row['tflops']:.0f} TFLOP/s "
                  f"(MFU {row['mfu']:.2f}), peak {row['peak_gb']:.1f} GB, sim/measured {sim_s / s:.2f}",
                  flush=True)
            del x

    vcls, vkw = FULL["qwen-image"]["vae"]
    with torch.device(dev):
        vae = getattr(diffusers, vcls)(**vkw).to(torch.bfloat16).eval()
    for res in args.train_resolutions:
        z = torch.randn(1, 16, 1, res // 8, res // 8, device=dev, dtype=torch.bfloat16)
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            s = timed(functools.partial(vae.decode, z, return_dict=False), args.warmup, args.iters)
        out["decode"].append(dict(resolution=res, seconds=s, peak_gb=peak_gb()))
        print(f"VAE decode {res}^2: {s:.3f} s, peak {peak_gb():.1f} GB", flush=True)
    del vae

    dit.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian",
                               target_modules=LORA_TARGETS["qwen-image"]))
    lora = [p for n, p in dit.named_parameters() if ".lora_" in n]
    for p in lora:
        p.data = p.data.float()
    out["lora_params"] = sum(p.numel() for p in lora)
    dit.enable_gradient_checkpointing()
    dit.train()
    opt = torch.optim.AdamW(lora, lr=3e-4, weight_decay=1e-4)
    for res in args.train_resolutions:
        sim = TimingModel("qwen-image-20b", "h200", res)
        x = inputs(res, 2, TEXT_TOKENS, dev)

        def step(x: dict) -> None:
            loss = dit(**x)[0].float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        torch.cuda.reset_peak_memory_stats()
        s = timed(functools.partial(step, x), args.warmup, args.iters)
        flops = 3 * sim.forward_flops(2)  # forward, recompute, activation gradients
        sim_s = sim.train_s(1, 1, 1)
        row = dict(resolution=res, tokens=sim.tokens, batch=2, seconds=s, tflops=flops / s / 1e12,
                   mfu=flops / s / PEAK, peak_gb=peak_gb(), sim_s=sim_s)
        out["train"].append(row)
        print(f"LoRA train step {res}^2 (CFG pair): {s:.3f} s, {row['tflops']:.0f} TFLOP/s "
              f"(MFU {row['mfu']:.2f}, 3 forwards), peak {row['peak_gb']:.1f} GB, "
              f"sim (4 forwards) / measured {sim_s / s:.2f}", flush=True)
        del x

    print(f"\n{props.name}, torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"{out['params'] / 1e9:.2f} B parameters, LoRA r=32 {out['lora_params'] / 1e6:.1f} M, "
          f"{TEXT_TOKENS} text tokens\n")
    print("| work | resolution | tokens | batch | seconds | TFLOP/s | MFU | peak GB | sim s "
          "| sim / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, rows in (("forward", out["forward"]), ("LoRA train step", out["train"])):
        for r in rows:
            print(f"| {kind} | {r['resolution']}^2 | {r['tokens']} | {r['batch']} | {r['seconds']:.3f} | "
                  f"{r['tflops']:.0f} | {r['mfu']:.2f} | {r['peak_gb']:.1f} | {r['sim_s']:.3f} | "
                  f"{r['sim_s'] / r['seconds']:.2f} |")
    for r in out["decode"]:
        print(f"| VAE decode | {r['resolution']}^2 | | 1 | {r['seconds']:.3f} | | | {r['peak_gb']:.1f} | | |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
