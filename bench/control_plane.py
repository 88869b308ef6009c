# python bench/control_plane.py --clients 4 --batch 64
"""How many requests a second does the queue serve, at what latency, over real sockets?

Control-plane throughput and latency of the request queue over real sockets.

Starts ``python -m spotlight.actors.queue`` in a subprocess per transport (ipc, tcp loopback) and
drives it with several concurrent ``QueueClient``s (one DEALER socket each, one asyncio loop):

- unbatched: each request costs three round trips, Pull -> Heartbeat -> Complete;
- batched: PullMany(max_n=B) -> CompleteMany(B) (two round trips per B requests). Batching is how
  the goal is meant to be reached: one Python round trip costs ~100-300 us of CPU on each side,
  so per-request round trips cannot reach 20k lease+complete/s on a couple of cores;
- pull latency: one client, sequential Pulls with work queued; p50 / p99.

Baseline, measured in the same run: the in-process ``RequestQueueCore`` called directly (the
upper bound the wire can approach). Goals: >= 20,000 lease+complete/s, p50 pull <= 1 ms.
Work per run is a fixed request count (timed from first pull to last complete; submission is
not timed).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time

from spotlight.actors.queue.client import QueueClient
from spotlight.actors.queue.core import RequestQueueCore
from spotlight.comm import messages as m
from spotlight.comm.transport import RpcClient

GOAL_LC_PER_S = 20_000
GOAL_P50_MS = 1.0


def requests(prefix: str, n: int, iteration: int) -> list[m.WorkRequest]:
    return [
        m.WorkRequest(
            request_id=f"{prefix}{i}",
            batch=str(iteration),
            work=(m.RolloutWork if i % 4 else m.ExploreWork)(prompt=f"p{i % 64}", seeds=[i], version=0),
        )
        for i in range(n)
    ]


RESULT = {
    "rollout": m.RolloutResult(key="traj/x", nbytes=1024, rewards=[0.5]),
    "explore": m.ExploreResult(rewards=[0.5]),
}


def bench_core(n: int) -> dict:
    core = RequestQueueCore()
    core.submit(requests("c", n, 0))
    t0 = time.perf_counter()
    while (lease := core.pull("w")) is not None:
        core.heartbeat(lease.request_id, lease.attempt, "w", committed_step=1)
        core.complete(lease.request_id, lease.attempt, "w", RESULT[lease.kind])
    dt = time.perf_counter() - t0
    return {"lc": n / dt, "ops": 3 * n / dt}


async def submit_all(q: QueueClient, prefix: str, n: int, iteration: int) -> None:
    reqs = requests(prefix, n, iteration)
    for i in range(0, n, 2000):  # keep each Submit header well under the header limit
        await q.submit(reqs[i : i + 2000])


async def unbatched(clients: list[QueueClient], n: int, iteration: int) -> dict:
    await submit_all(clients[0], f"u{iteration}-", n, iteration)

    async def worker(q: QueueClient, wid: str) -> None:
        while (lease := await q.pull(wid)) is not None:
            await q.heartbeat(lease.request_id, lease.attempt, wid, committed_step=1)
            await q.complete(lease.request_id, lease.attempt, wid, RESULT[lease.kind])

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i, q in enumerate(clients):
            tg.create_task(worker(q, f"w{i}"))
    dt = time.perf_counter() - t0
    return {"lc": n / dt, "ops": 3 * n / dt}


async def batched(clients: list[QueueClient], n: int, batch: int, iteration: int) -> dict:
    await submit_all(clients[0], f"b{iteration}-", n, iteration)

    async def worker(q: QueueClient, wid: str) -> None:
        while leases := await q.pull_many(wid, max_n=batch):
            done = await q.complete_many(
                [
                    m.Complete(
                        request_id=g.request_id, attempt=g.attempt, worker_id=wid, result=RESULT[g.kind]
                    )
                    for g in leases
                ]
            )
            assert done.accepted == len(leases), done.rejected[:3]

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i, q in enumerate(clients):
            tg.create_task(worker(q, f"w{i}"))
    dt = time.perf_counter() - t0
    return {"lc": n / dt, "ops": 2 * n / batch / dt}


async def pull_latency(q: QueueClient, n: int, iteration: int) -> tuple[float, float]:
    await submit_all(q, f"l{iteration}-", n, iteration)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await q.pull("lat")
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


async def bench_transport(bind: str, args: argparse.Namespace) -> list[tuple]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "spotlight.actors.queue",
        "--bind",
        bind,
        "--lease-s",
        "600",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(30):
            endpoint = (await proc.stdout.readline()).decode().split()[1]
        rpcs = [RpcClient(endpoint, timeout=30) for _ in range(args.clients)]
        for rpc in rpcs:
            await rpc.__aenter__()
        try:
            clients = [QueueClient.remote(rpc) for rpc in rpcs]
            p50, p99 = await pull_latency(clients[0], args.latency_n, 1)
            one = await unbatched(clients, args.n, 2)
            many = await batched(clients, args.n * args.batch // 4, args.batch, 3)
        finally:
            for rpc in rpcs:
                await rpc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    kind = bind.split(":")[0]
    return [
        (kind, f"unbatched x{args.clients} clients", one, p50, p99),
        (kind, f"batched {args.batch} x{args.clients} clients", many, None, None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n", type=int, default=3000, help="requests per unbatched run")
    parser.add_argument("--latency-n", type=int, default=2000)
    args = parser.parse_args()

    base = bench_core(args.n * args.batch // 4)
    rows = [("-", "in-process core (baseline)", base, None, None)]
    with tempfile.TemporaryDirectory(prefix="spl") as tmp:
        for bind in (f"ipc://{tmp}/bench.ipc", "tcp://127.0.0.1:0"):
            rows += asyncio.run(bench_transport(bind, args))

    print(
        f"control plane: queue service in a subprocess; goal >= {GOAL_LC_PER_S:,} "
        f"lease+complete/s and p50 pull <= {GOAL_P50_MS} ms; baseline = in-process core"
    )
    head = (
        f"{'wire':5} {'mode':30} {'lease+compl/s':>13} {'x goal':>7} {'x base':>7} "
        f"{'round trips/s':>13} {'p50 pull ms':>11} {'p99 pull ms':>11} {'p50 x goal':>10}"
    )
    print(head)
    print("-" * len(head))
    for wire, mode, r, p50, p99 in rows:
        lat = (
            f"{p50:11.3f} {p99:11.3f} {GOAL_P50_MS / p50:10.2f}"
            if p50 is not None
            else f"{'':11} {'':11} {'':10}"
        )
        print(
            f"{wire:5} {mode:30} {r['lc']:13,.0f} {r['lc'] / GOAL_LC_PER_S:7.2f} "
            f"{r['lc'] / base['lc']:7.3f} {r['ops']:13,.0f} {lat}"
        )
    print(
        "round trips/s: unbatched = Pull+Heartbeat+Complete calls; batched = PullMany+CompleteMany;"
        " baseline = core method calls. 'x goal' > 1 and 'p50 x goal' > 1 meet the goals."
    )


if __name__ == "__main__":
    main()
