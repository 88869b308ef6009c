# taskset -c 1 .venv/bin/python bench/peer_weights.py [--versions 9] [--workers 3] [--layers 4]
"""How often does a node fetch a weights version from the store, and how fast is the peer copy?

Weights from a peer on the same node, through the real runtime: store fetches per version per
node, and the peer copy's bandwidth against this machine's memcpy.

One invocation, the two modes side by side (the same code, ``runtime.peer_weights`` on and off):
a LocalRuntime (queue, tensor store, controller) and one node agent with ``--workers`` worker
processes; a DiT of ``--layers`` layers, 8 heads x 64 (155 MB of fp32 weights at 4 layers: big
enough that bytes, not per-tensor overhead, dominate). For each of ``--versions`` published
versions, one 2-step rollout request per worker is submitted and waited for; the workers' weights
log (``<logs>/weights.log``) says how every worker got each version:
- **store fetches per version per node**: the node's loads that crossed from the tensor store
  (the network, on a real spot node; here the store's shared-memory path on the same machine).
- **peer copy**: a worker copying the version from a neighbour (``LendWeights``: the lender lends
  the live shared-memory buffer its parameters are views of, pinned, no copy; the borrower copies
  it whole into its own buffer from a mapping it keeps per lender buffer). ``copy`` GB/s is one
  borrower's copy alone, split into copies that first mapped the lender's buffer (the first borrow
  from each of its ``runtime.worker_versions`` + 1 buffers) and copies from a buffer already
  mapped (the steady state); ``node copy`` GB/s is the bytes all borrowers of one version copied
  over the wall time from the first copy's start to the last one's end (the node's borrowers copy
  at the same time, here on one core); ``load`` GB/s is the borrower's whole load as it waited for
  it (the ask, the lender's wait for its own store load of that version, the copy, the reply), the
  number a joining worker sees. ``per CPU-s``: the bytes over the copying thread's CPU time
  (``time.thread_time``): what the copy costs the machine, without the time the one shared core
  spent on the node's other processes (the lender starts its rollout as the borrowers copy).
- **memcpy**: ``spotlight.parallel.peer.memcpy_gbps`` on a buffer of the model's size, in this
  process, on the same cores.
The injected slow device (0.2 s after each step) keeps workers idle between steps; a lender's
first step still runs while its borrowers copy (it starts its rollout once it has answered them),
on the same core when the bench is pinned to one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight.actors.runtime import LocalRuntime  # noqa: E402
from spotlight.actors.worker.peers import read_weights_log  # noqa: E402
from spotlight.comm import messages as m  # noqa: E402
from spotlight.parallel.peer import memcpy_gbps  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.work import policy_model  # noqa: E402


def overrides(args, peer: bool, out: str) -> list[str]:
    return ["model.checkpoint=none", f"model.layers={args.layers}", "model.heads=8", "model.head_dim=64",
            "model.image_size=16", "model.patch=4", "sampler.steps=2", "sampler.sde_steps=none",
            'sampler.sde_type="flow"', "run.group_size=2", f"runtime.reserved_workers={args.workers}",
            "runtime.spot_workers=0", f"runtime.peer_weights={str(peer).lower()}", f'run.out_dir="{out}"',
            f'run.name="{"peer" if peer else "store"}"', "runtime.step_delay_s=0.2"]


def run_mode(args, peer: bool, out: str) -> list:
    recipe = load_recipe("tiny", overrides(args, peer, out))
    torch.manual_seed(0)
    model = policy_model(recipe)
    with LocalRuntime(recipe) as rt:
        for v in range(args.versions):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            rt.call(rt.store.publish_weights(v, {k: t.numpy() for k, t in model.state_dict().items()}),
                    timeout=120)
            job = m.RolloutWork(prompt="a red circle", seeds=[1, 2], version=v)
            rt.call(rt.queue.submit([m.WorkRequest(request_id=f"v{v}/{i}", batch=f"b{v}", work=job)
                                     for i in range(args.workers)]))
            done = rt.call(rt.queue.wait_batch(f"b{v}", 300), timeout=330)
            assert not done.dead, done.dead
            print(f"  {'peer' if peer else 'store-only'}: version {v} done", flush=True)
        log = rt.log_dir / "weights.log"
    return [e for e in read_weights_log(log) if e.how in ("store", "peer")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=9)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    started, load0 = datetime.datetime.now(datetime.UTC), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        modes = {"peer": run_mode(args, True, out), "store-only": run_mode(args, False, out)}
    nbytes = next(e.nbytes for e in modes["peer"] if e.how == "store")
    mem = statistics.median(memcpy_gbps(nbytes) for _ in range(3))
    load = os.getloadavg()[0]

    rows = []
    for name, events in modes.items():
        per_node = Counter((e.node, e.version) for e in events if e.how == "store")
        peers = [e for e in events if e.how == "peer"]
        stores = [e for e in events if e.how == "store"]
        rows.append((f"{name}: store fetches per version per node (min-max)",
                     f"{min(per_node.values())}-{max(per_node.values())}",
                     f"{len(stores)} fetches, {len(peers)} peer copies, {args.versions} versions x "
                     f"{args.workers} workers"))
        if stores:
            rows.append((f"{name}: store fetch GB/s (median; the store's shm path here)",
                         f"{statistics.median(e.nbytes / e.copy_s / 1e9 for e in stores):.2f}", ""))
        if not peers:
            continue
        for label, group in (("from a mapped buffer", [e for e in peers if not e.mapped]),
                             ("first from a buffer (maps it)", [e for e in peers if e.mapped])):
            if group:
                copy = statistics.median(e.nbytes / e.copy_s / 1e9 for e in group)
                cpu = statistics.median(e.nbytes / e.cpu_s / 1e9 for e in group if e.cpu_s > 0)
                rows.append((f"{name}: peer copy GB/s, one borrower, {label} (median): wall / per CPU-s",
                             f"{copy:.2f} / {cpu:.2f}", f"{100 * copy / mem:.0f}% / {100 * cpu / mem:.0f}% "
                             f"of memcpy; {len(group)} copies"))
        node = []
        for v in {e.version for e in peers}:
            copies = [e for e in peers if e.version == v]
            span = max(e.end for e in copies) - min(e.end - e.copy_s for e in copies)
            node.append(sum(e.nbytes for e in copies) / span / 1e9)
        rows.append((f"{name}: node copy GB/s, a version's borrowers together (median)",
                     f"{statistics.median(node):.2f}",
                     f"{100 * statistics.median(node) / mem:.0f}% of memcpy (goal >= 50%); "
                     f"{len(peers) / len(node):.1f} borrowers per version"))
        whole = statistics.median(e.nbytes / e.seconds / 1e9 for e in peers)
        rows.append((f"{name}: peer whole load GB/s (median)", f"{whole:.2f}",
                     f"{100 * whole / mem:.0f}% of memcpy (includes the wait for the lender's store load)"))
    rows.append((f"memcpy GB/s ({nbytes / 1e6:.0f} MB, median of 3)", f"{mem:.2f}", ""))
    rows.append(("machine load average (1 min) at the start / end", f"{load0:.1f} / {load:.1f}",
                 f"{os.cpu_count()} cores; started {started:%Y-%m-%d %H:%M} UTC"))
    print_rows(rows, leading_blank=True)


if __name__ == "__main__":
    main()
