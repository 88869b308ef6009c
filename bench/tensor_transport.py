# python -m bench.tensor_transport  [--sizes-mb 1 16 64 256] [--reps 5]   (from the repo root)
"""How fast do tensors move through the store: ZeroMQ frames or shared memory?

Tensor store put/get throughput: ZeroMQ zero-copy frames on TCP loopback vs shared memory.

Starts a real tensor-store subprocess on ``tcp://127.0.0.1:0`` and, for each float32 tensor
size, times ``client.put`` then ``client.get`` of one key through (a) the zero-copy frame path
(``shm=False``) and (b) the shared-memory path (``shm=True``: lend a recycled segment, one copy
in; one copy out plus a generation check). The baseline is ``np.copyto`` of the same size into a
preallocated array, measured in the same run. Each figure is the median of ``--reps`` timed
calls after two warm-up calls (steady state: the service's recycled segments are warm, as they
are for a worker committing every denoising step). ``get(out)`` reads into a preallocated array.
GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import numpy as np

from spotlight.actors.store.client import TensorStoreClient


def median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def amedian_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def measure(endpoint: str, sizes_mb: list[int], reps: int) -> list[dict]:
    rows = []
    clients = {
        "tcp": TensorStoreClient.remote(endpoint, shm=False, timeout=60),
        "shm": TensorStoreClient.remote(endpoint, shm=True, timeout=60),
    }
    async with clients["tcp"] as tcp, clients["shm"] as shm:
        assert shm.uses_shm and not tcp.uses_shm
        for mb in sizes_mb:
            nbytes = mb << 20
            src = np.random.default_rng(mb).random(nbytes // 4, dtype=np.float32)
            dst = np.empty_like(src)
            row = {"MB": mb, "memcpy": nbytes / median_time(lambda d=dst, s=src: np.copyto(d, s), reps)}
            for name, client in (("tcp", tcp), ("shm", shm)):
                key = f"bench/{name}/{mb}"
                row[f"{name} put"] = nbytes / await amedian_time(
                    lambda c=client, k=key, s=src: c.put(k, {"x": s}), reps
                )
                got = (await client.get(key))[0]["x"]
                assert np.array_equal(got, src), f"{name}: round trip changed the data"
                del got
                row[f"{name} get"] = nbytes / await amedian_time(lambda c=client, k=key: c.get(k), reps)
                row[f"{name} get(out)"] = nbytes / await amedian_time(
                    lambda c=client, k=key, d=dst: c.get(k, out={"x": d}), reps
                )
                assert np.array_equal(dst, src)
                await client.delete(key)
            rows.append(row)
            del src, dst
    return rows


def print_table(rows: list[dict]) -> None:
    cols = ["memcpy", "tcp put", "tcp get", "tcp get(out)", "shm put", "shm get", "shm get(out)"]
    print(f"{'size':>7} | " + " | ".join(f"{c:>16}" for c in cols))
    print("-" * (10 + 19 * len(cols)))
    for r in rows:
        cells = [f"{r['memcpy'] / 1e9:6.2f} GB/s      "]
        cells += [f"{r[c] / 1e9:6.2f} GB/s ({r[c] / r['memcpy']:4.0%})" for c in cols[1:]]
        print(f"{r['MB']:>4} MB | " + " | ".join(f"{c:>16}" for c in cells))
    print("ratios in parentheses: throughput / np.copyto throughput of the same size, same run")
    print("get(out): copies into a preallocated array, as a worker refills its buffers; plain get")
    print("returns fresh arrays (tcp: views on the received frames; shm: a copy into new pages)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    max_bytes = 4 * (max(args.sizes_mb) << 20)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spotlight.actors.store",
            "--bind",
            "tcp://127.0.0.1:0",
            "--max-bytes",
            str(max_bytes),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the service prints its endpoint once bound
        if not line.startswith("tensor store ready on "):
            raise RuntimeError(f"tensor store did not start: {line!r}")
        t0 = time.perf_counter()
        rows = asyncio.run(measure(line.split()[-1], args.sizes_mb, args.reps))
        print_table(rows)
        print(f"measured in {time.perf_counter() - t0:.1f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
