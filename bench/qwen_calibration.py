"""Full-size Qwen-Image transformer on one GPU: the simulator's calibration figures, measured.

    PYTHONPATH=. python bench/qwen_calibration.py --out calib.json    # a CUDA machine (~2 min on an H200)
    PYTHONPATH=. python bench/qwen_calibration.py --from bench/data/qwen_calibration_h200.json   # no GPU

Builds a random-initialized ``QwenImageTransformer2DModel`` from the published config (the one
``bench/pipeline_memory.py`` counts: 60 blocks, 24 heads x 128, 20.43 B parameters) directly on the
GPU in bf16 -- no download, no weights; a random model costs what the trained one costs -- and times,
with CUDA events after warm-up:

- a forward of batch 1 and of batch 2 at each resolution (512^2 -> 1,024 image tokens, 1280^2 ->
  6,400) with the sim profile's 128 prompt tokens (a denoising step of the ``qwen_image_lora``
  recipe is two such forwards, the prompt's and the negative prompt's, one after the other);
- one LoRA training step (rank 32 / alpha 64 on the family's targets, the adapter in fp32 over the
  bf16 base, gradient checkpointing, AdamW): forward and backward of two samples (a trained
  timestep's CFG pair), then the optimizer step; and the KL term's reference forward of the same two
  samples (the adapter disabled, no gradients);
- the full-size VAE's decode of one image (a rollout request decodes each sample for its reward;
  the sim does not price it);
- the peak GPU memory of each, and the seconds a fresh process takes to import torch and diffusers
  and initialise CUDA (a worker's start before its model loads).

Prints each row beside what ``spotlight.sim.timing.TimingModel`` prices the same work at on an H200
now (``sim / measured``: above 1 the sim is too slow, below 1 too fast) and the FLOP rate achieved
by the sim's FLOP count. ``--out`` saves the measurement as JSON; ``--from`` prints the table of a
saved one, so the sim's prices can be checked against it on any machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from bench.pipeline_memory import FULL
from spotlight.pipelines.folder import LORA_TARGETS
from spotlight.sim.timing import GPUS, PROFILES, TRAIN_FORWARDS, WORKER_START_S, TimingModel

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


def measure(args: argparse.Namespace) -> dict:
    """Seconds and peak memory of the full-size model's work on this machine's GPU."""
    if not torch.cuda.is_available():
        sys.exit("qwen_calibration: needs a CUDA device (this bench times the full-size model on a GPU)")
    import diffusers

    from spotlight.policy.grpo import GRPOConfig, add_lora

    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    out: dict = {"gpu": props.name, "torch": torch.__version__, "diffusers": diffusers.__version__,
                 "text_tokens": TEXT_TOKENS, "worker_start_s": worker_start_s(), "forward": [], "train": [],
                 "reference": [], "decode": []}
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
    print(f"{props.name}: {out['params'] / 1e9:.2f} B parameters built on the GPU in {out['build_s']:.1f} s",
          flush=True)

    for res in args.resolutions:
        for batch in (1, 2):
            x = inputs(res, batch, TEXT_TOKENS, dev)
            torch.cuda.reset_peak_memory_stats()
            with torch.inference_mode():
                s = timed(functools.partial(dit, **x), args.warmup, args.iters)
            out["forward"].append(dict(resolution=res, batch=batch, seconds=s, peak_gb=peak_gb()))
            print(f"forward {res}^2 batch {batch}: {s:.3f} s, peak {peak_gb():.1f} GB", flush=True)
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

    # the trainer's own adapter wiring (fp32 adapter over the bf16 base), at qwen_image_lora's r=32 / alpha=64
    add_lora(SimpleNamespace(dit=dit, lora_targets=LORA_TARGETS["qwen-image"]),
             GRPOConfig(lora_rank=32, lora_alpha=64.0))
    lora = [p for n, p in dit.named_parameters() if ".lora_" in n]
    out["lora_params"] = sum(p.numel() for p in lora)
    dit.enable_gradient_checkpointing()
    dit.train()
    opt = torch.optim.AdamW(lora, lr=3e-4, weight_decay=1e-4)

    def step(x: dict) -> None:
        loss = dit(**x)[0].float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for res in args.train_resolutions:
        x = inputs(res, 2, TEXT_TOKENS, dev)
        torch.cuda.reset_peak_memory_stats()
        s = timed(functools.partial(step, x), args.warmup, args.iters)
        out["train"].append(dict(resolution=res, batch=2, seconds=s, peak_gb=peak_gb()))
        print(f"LoRA train step {res}^2 (CFG pair): {s:.3f} s, peak {peak_gb():.1f} GB", flush=True)
        dit.disable_adapters()  # the KL term's reference: the base, the adapter off, no gradients
        with torch.no_grad():
            s = timed(functools.partial(dit, **x), args.warmup, args.iters)
        dit.enable_adapters()
        out["reference"].append(dict(resolution=res, batch=2, seconds=s, peak_gb=peak_gb()))
        print(f"reference forward {res}^2 (CFG pair, adapter off): {s:.3f} s", flush=True)
        del x
    return out


def priced(kind: str, row: dict) -> tuple[float, float]:
    """(FLOPs by the sim's count, the sim's seconds) of one measured ``row`` of ``kind`` ("forward",
    "train" or "reference"), as ``TimingModel`` prices that work on an H200."""
    sim = TimingModel("qwen-image-20b", "h200", row["resolution"])
    if kind == "forward":  # a sim step is the CFG pair's forwards of one batch, one after the other
        return sim.forward_flops(row["batch"]), sim.step_s(row["batch"]) / sim.profile.cfg_forwards
    if row["batch"] != 2:
        raise ValueError(f"a {kind} row times a trained timestep of one sample — its CFG pair, a batch of "
                         f"2 — not a batch of {row['batch']}")
    if kind == "train":
        return TRAIN_FORWARDS * sim.forward_flops(2), sim.train_s(1, 1, 1)
    return sim.forward_flops(2), sim.train_s(1, 1, 1, reference=True) - sim.train_s(1, 1, 1)  # a KL term's


def table(m: dict) -> str:
    """The measurement ``m`` beside the sim's current prices (TimingModel on an H200): FLOP rate
    achieved by the sim's FLOP count, its share of the H200's 989 TFLOP/s, sim seconds / measured."""
    lines = [f"{m['gpu']}, torch {m['torch']}, diffusers {m['diffusers']}, "
             f"{m['params'] / 1e9:.2f} B parameters (built in {m['build_s']:.1f} s, "
             f"{m['weights_gb']:.1f} GB), "
             f"LoRA r=32 {m['lora_params'] / 1e6:.1f} M, {m['text_tokens']} text tokens; "
             f"worker start (imports + CUDA) {m['worker_start_s']:.1f} s (sim {WORKER_START_S:.1f} s)", "",
             "| work | resolution | tokens | batch | seconds | TFLOP/s | MFU | peak GB | sim s "
             "| sim / measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    labels = {"forward": "forward", "train": "LoRA train step", "reference": "KL reference forward"}
    for kind, label in labels.items():
        for r in m.get(kind, []):
            flops, sim_s = priced(kind, r)
            s, tokens = r["seconds"], TimingModel("qwen-image-20b", "h200", r["resolution"]).tokens
            lines.append(f"| {label} | {r['resolution']}^2 | {tokens} | {r['batch']} | {s:.3f} | "
                         f"{flops / s / 1e12:.0f} | {flops / s / PEAK:.2f} | {r['peak_gb']:.1f} | "
                         f"{sim_s:.3f} | {sim_s / s:.2f} |")
    for r in m["decode"]:
        lines.append(f"| VAE decode | {r['resolution']}^2 | | 1 | {r['seconds']:.3f} | | | "
                     f"{r['peak_gb']:.1f} | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resolutions", type=int, nargs="+", default=[512, 768, 1024, 1280])
    ap.add_argument("--train-resolutions", type=int, nargs="+", default=[512, 768, 1024, 1280])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="write the measurement as JSON here")
    ap.add_argument("--from", dest="source", metavar="JSON",
                    help="print the table of a saved measurement (no GPU), priced by the sim as it is now")
    args = ap.parse_args()
    if args.source:
        with open(args.source) as f:
            m = json.load(f)
    else:
        m = measure(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(m, f, indent=1)
    print("\n" + table(m))


if __name__ == "__main__":
    main()
