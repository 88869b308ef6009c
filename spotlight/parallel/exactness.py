"""SP exactness: one rank of a d-process group compares the sequence-parallel DiT with the plain one.

    python -m spotlight.parallel.exactness --rank R --world D --port P --out result.json

Every rank builds the same model (the shipped base checkpoint, a seeded tiny model, or with
`--pipeline` a Qwen-Image diffusers folder's transformer with its cached prompt embeddings and true
CFG), joins the
group at the agent's store on `--port`, and runs, with the DiT parallelized over the group:
the velocity of a batch, the trainer's per-step log-prob (`sampler.step_log_prob`), a 3-step SDE
rollout, and a backward pass (parameter gradients summed over the group). Rank 0 computes the same
things single-process and writes the max abs differences to `--out`. The integration test, the
benchmark and `bench/gpu_check.py` all run this one program.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PIPELINE_IMAGE = 32
"""Image side of a `--pipeline` check (a tiny folder's VAE scale x patch divides it)."""


def _model(device: str, checkpoint: str | None, pipeline: str | None = None, text_cache: str | None = None):
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model

    torch.manual_seed(0)
    if pipeline:  # a diffusers folder's transformer, VAE and cached prompt embeddings
        from spotlight.pipelines.model import load_pipeline_model

        model = load_pipeline_model(ModelConfig(pipeline=pipeline, image_size=PIPELINE_IMAGE,
                                                max_sequence_length=32, guidance_scale=2.0,
                                                text_cache=text_cache))
    elif checkpoint:
        model = build_model(ModelConfig(checkpoint=checkpoint), VOCABULARY)
    else:  # 4 heads, 64 image tokens: degrees 1, 2 and 4 all divide both
        cfg = ModelConfig(checkpoint=None, layers=2, heads=4, head_dim=16, image_size=16, patch=2)
        model = build_model(cfg, VOCABULARY)
    if not checkpoint:  # a fresh DiT zero-initialises its output layer: give it real weights
        with torch.no_grad():  # drawn on the host: the same weights on every device
            for p in (model.dit if pipeline else model).parameters():
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    return model.to(device).eval()


def _shape(model) -> tuple[int, int, int]:
    if getattr(model, "folder", None) is not None:  # a pipeline: its normalised latent
        return model.folder.latent_shape(PIPELINE_IMAGE)
    return (model.cfg.channels, model.cfg.image_size, model.cfg.image_size)


def _run(model, device: str) -> dict[str, torch.Tensor]:
    from spotlight.policy.sampler import SamplerConfig, sde_rollout, step_log_prob

    shape = _shape(model)
    prompts, seeds = ["a red circle left of a blue square", "two green triangles"], [3, 4]
    sampler = SamplerConfig(steps=3, noise_level=0.7)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *shape, generator=g).to(device)
    t = torch.tensor([0.9, 0.4], device=device)
    out = {}
    with torch.no_grad():
        text = model.encode(prompts)
        out["velocity"] = model.velocity(x, t, text)
        state = sde_rollout(model, prompts, seeds, sampler, shape)
        out["rollout"] = torch.stack(state.latents)
        out["rollout_log_probs"] = torch.stack(state.log_probs)
        x0, x1 = state.latents[0], state.latents[1]
        out["log_prob"] = step_log_prob(model, x0, x1, 0, text, sampler)[0]
    model.zero_grad(set_to_none=True)
    loss = model.velocity(x, t, model.encode(prompts)).square().mean()
    loss.backward()
    out["grads"] = torch.cat([p.grad.flatten() for p in model.dit.parameters() if p.grad is not None])
    return out


def check(
    degree: int, *, timeout_s: float = 240.0, device: str = "cpu", checkpoint: str | None = None,
    pipeline: str | None = None,
) -> dict:
    """Spawn `degree` ranks (this process hosts the store, as a node agent does); rank 0's report."""
    import os
    import subprocess
    import sys
    import tempfile

    from spotlight.parallel.comms import host_store

    store = host_store()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "spotlight.parallel.exactness", "--world", str(degree),
               "--port", str(store.port), "--out", out, "--device", device]
        cmd += ["--checkpoint", checkpoint] if checkpoint else []
        cmd += ["--pipeline", str(pipeline), "--text-cache", os.path.join(tmp, "text")] if pipeline else []
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(degree)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"SP exactness at degree {degree} did not finish in {timeout_s} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            errors = [p.stderr.read().decode(errors="replace")[-2000:] for p in procs]
            for p in procs:
                p.stderr.close()
        bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
        if bad:
            raise RuntimeError(f"SP ranks failed {bad}: {errors[bad[0][0]]}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    from spotlight.parallel.comms import Communicators
    from spotlight.parallel.ulysses import parallelize

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--pipeline", default=None, help="a Qwen-Image diffusers folder, not the embedded DiT")
    ap.add_argument("--text-cache", default=None, help="the pipeline's prompt-embedding cache folder")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = args.device if args.device == "cpu" else f"cuda:{args.rank % torch.cuda.device_count()}"
    if device != "cpu":
        torch.cuda.set_device(device)
    model = _model(device, args.checkpoint, args.pipeline, args.text_cache)
    comms = Communicators(
        "127.0.0.1", args.port, timeout_s=60, backend="gloo" if device == "cpu" else "nccl"
    )
    group = comms.open(0, args.rank, args.world)
    sp = parallelize(model.dit, group)
    seen: list[int] = []  # image tokens each DiT call saw on this rank: proves the input was sharded
    probe = model.dit.img_in.register_forward_hook(lambda m, i, o: seen.append(o.shape[1]))
    t0 = time.perf_counter()
    par = _run(model, device)
    wall = time.perf_counter() - t0
    # each rank's parameter gradient is its share; their sum is the full gradient
    group.allreduce([par["grads"]]).wait()
    sp.undo()
    probe.remove()
    if args.rank != 0:
        return
    ref = _run(model, device)
    result = {k: float((par[k] - ref[k]).abs().max()) for k in ref}
    result["scale"] = {k: float(ref[k].abs().max()) for k in ref}
    result["sp_wall_s"] = wall
    result["tokens_per_rank"] = max(seen)
    result["tokens"] = (model.folder.tokens(PIPELINE_IMAGE) if args.pipeline
                        else (model.cfg.image_size // model.cfg.patch) ** 2)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
