# .venv/bin/python bench/gpu_check.py            # or name sections: gpu_check.py ipc sp
"""Does every GPU path work on this machine, and how fast is it?

Every GPU path exercised once on a single- or multi-GPU machine (< 8 minutes).

Prints one table: the probes (CUDA, NCCL, cupy, xfuser), SP exactness under NCCL (degree = the
largest of 1, 2, 4 the GPUs allow: NCCL needs one GPU per rank), CUDA IPC and peer-copy bandwidth
against device memcpy, and a few rollout steps of the tiny model on the GPU against the CPU. A
path that is missing is a row saying why, not a crash.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight.parallel import device as dev  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"  {name}: {value} {note}", flush=True)


def section(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # one failing path must not hide the others
        traceback.print_exc()
        row(name, "FAILED", f"{type(e).__name__}: {e}"[:160].replace("\n", " "))
    print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)


def probes() -> None:
    for name, probe in (("CUDA", dev.probe_cuda), ("NCCL", dev.probe_nccl), ("cupy", dev.probe_cupy),
                        ("xfuser", dev.probe_xfuser)):
        reason = probe()
        row(f"probe {name}", "ok" if reason is None else "missing", reason or "")
    if torch.cuda.is_available():
        row("GPUs", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")


def sp_exactness() -> None:
    from spotlight.parallel.exactness import check

    n = torch.cuda.device_count()
    degree = 4 if n >= 4 else 2 if n >= 2 else 1
    r = check(degree, device="cuda", timeout_s=180)
    worst = max(r[k] for k in ("velocity", "log_prob", "rollout", "rollout_log_probs"))
    row(f"SP exactness NCCL degree {degree}", f"{worst:.1e} fwd / {r['grads']:.1e} grads",
        f"tokens/rank {r['tokens_per_rank']} of {r['tokens']}")


_IPC_CHILD = """
import json, sys, time, torch
from spotlight.parallel.device import cuda_ipc_import
h = json.loads(sys.stdin.read())
for k in ("handle", "ref_counter_handle", "event_handle"):
    h[k] = None if h[k] is None else bytes.fromhex(h[k])
t0 = time.perf_counter(); src = cuda_ipc_import(h); t_map = time.perf_counter() - t0
dst = torch.empty_like(src); dst.copy_(src); torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
best = 1e9
for _ in range(5):  # device time, as the memcpy yardstick is measured
    a.record(); dst.copy_(src); b.record(); b.synchronize()
    best = min(best, a.elapsed_time(b) / 1e3)
print(json.dumps({"gbps": src.nbytes / best / 1e9, "map_s": t_map, "ok": bool(torch.equal(dst, src))}))
"""


def ipc_and_peer_copy() -> None:
    nbytes = 1 << 30
    mem = dev.cuda_memcpy_gbps(nbytes)
    row("device memcpy (1 GiB, bytes copied / s)", f"{mem:.0f} GB/s")
    t = torch.randn(nbytes // 4, device="cuda:0")
    h = dev.cuda_ipc_export(t).to_wire()
    for k in ("handle", "ref_counter_handle", "event_handle"):
        h[k] = None if h[k] is None else h[k].hex()
    out = subprocess.run([sys.executable, "-c", _IPC_CHILD], input=json.dumps(h), capture_output=True,
                         text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    row("CUDA IPC: other process copies the tensor", f"{r['gbps']:.0f} GB/s",
        f"{100 * r['gbps'] / mem:.0f}% of memcpy, map {r['map_s'] * 1e3:.1f} ms, equal={r['ok']}")
    dst_dev = torch.cuda.device_count() - 1
    dst = torch.empty_like(t, device=f"cuda:{dst_dev}")
    path = dev.peer_copy(dst, t)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):  # device time between events on the default stream cupy's copy also uses
        a.record()
        dev.peer_copy(dst, t)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    gbps = nbytes / best / 1e9
    row(f"peer copy cuda:0 -> cuda:{dst_dev} ({path})", f"{gbps:.0f} GB/s",
        f"{100 * gbps / mem:.0f}% of memcpy, equal={torch.equal(dst.cpu(), t.cpu())}")


def rollout_on_gpu() -> None:
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model
    from spotlight.policy.sampler import SamplerConfig, sde_rollout

    cfg = SamplerConfig(steps=10)
    prompts, seeds = ["a red circle left of a blue square"] * 8, list(range(8))
    out = {}
    for device in ("cpu", "cuda"):
        model = build_model(ModelConfig(), VOCABULARY).to(device).requires_grad_(False)
        shape = (model.cfg.channels, model.cfg.image_size, model.cfg.image_size)
        sde_rollout(model, prompts, seeds, SamplerConfig(steps=1), shape)  # warm-up
        t0 = time.perf_counter()
        state = sde_rollout(model, prompts, seeds, cfg, shape)
        if device == "cuda":
            torch.cuda.synchronize()
        out[device] = (time.perf_counter() - t0, state.latents[-1].cpu())
    diff = float((out["cpu"][1] - out["cuda"][1]).abs().max())
    row("tiny model 10-step rollout x8 on GPU / CPU", f"{out['cuda'][0]:.3f} / {out['cpu'][0]:.3f} s",
        f"max |GPU - CPU| of the final sample {diff:.1e}")


def main() -> None:
    t0 = time.perf_counter()
    section("probes", probes)
    if dev.probe_cuda() is not None:
        row("GPU paths", "skipped", "no usable CUDA device on this machine")
    else:
        only = set(sys.argv[1:])  # e.g. `gpu_check.py regroup`: those sections alone
        for name, fn in (("rollout", rollout_on_gpu), ("ipc", ipc_and_peer_copy),
                         ("sp", sp_exactness)):
            if not only or name in only:
                section(name, fn)
    print_rows(ROWS, ("check", "result", "note"), leading_blank=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
