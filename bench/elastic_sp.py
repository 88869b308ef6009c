"""Elastic sequence parallelism: regroup vs cold restart, peer weight copy vs memcpy, SP exactness.

    .venv/bin/python bench/elastic_sp.py [--trials 3] [--skip-exactness]

One invocation, side by side on this machine, with real processes:
- **regroup**: a degree-2 group of persistent members runs a 6-step rollout; at step >= 2 one
  member is SIGKILLed; the survivor is released from its collective, regroups with a warm spare at
  a new epoch (no restart, no reload) and resumes from the last commit. Measured from the kill to
  the first committed step of the resumed request; the final sample is checked bit-identical to
  an uninterrupted degree-2 run. A new spare then joins by copying a survivor's weights (peer copy).
- **cold restart**: the same, but the group restarts the way a non-elastic system does: every
  member killed, two new processes started (Python + torch + diffusers imports, model build, weights
  from the store file), new group init, resume. Same measurement, from the kill.
- **peer copy**: bytes/s of a joiner filling its parameters from a peer's shared-memory segment,
  against a warm memcpy (torch copy_) of the same bytes, for the tiny model (inside the member)
  and for a 256 MiB synthetic model (in this process, preadv from the segment), median of 3.
- **SP exactness**: max |SP − single-process| over the velocity, the trainer's log-prob, a
  3-step rollout and the parameter gradients, for degrees 1, 2, 4 (gloo).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight.actors.node.group_shell import GroupAgent  # noqa: E402
from spotlight.comm.messages import RolloutWork  # noqa: E402

MODEL = dict(checkpoint=None, layers=2, heads=4, head_dim=16, image_size=16, patch=2)
SAMPLER = dict(steps=6, noise_level=0.7)
STEPS = SAMPLER["steps"]
JOB = RolloutWork(prompt="a red circle left of a blue square", seeds=[11, 12], version=0)


def store_weights(path: Path) -> None:
    from safetensors.torch import save_file

    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import ModelConfig, build_model

    model = build_model(ModelConfig(**MODEL), VOCABULARY)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))


def same_bits(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def interrupt(agent: GroupAgent, rid: str, cold: bool, spawn_names: list[str]) -> dict:
    """Run `rid`, kill at step >= 2 (one member, or all for a cold restart), wait for the end."""
    agent.submit(rid, JOB)
    agent.run_until(lambda: agent.committed_step(rid) >= 2, 120)
    epoch = agent.sched.requests[rid].epochs[0]
    members = agent.sched.groups[epoch].members
    victims = list(agent.procs_alive()) if cold else [members[-1]]
    t_kill = time.monotonic()
    for v in victims:
        agent.kill(v)
    for name in spawn_names:  # cold: the replacement processes start right after the kill
        agent.spawn(name)
    agent.run_until(lambda: rid in agent.finished, 180)
    resumed = agent.sched.requests[rid].epochs[-1]
    t_step = agent.first("committed", f"epoch={resumed} ", t_kill) or agent.first("committed", "", t_kill)
    return {
        "s": t_step - t_kill,
        "died": (agent.first("died", victims[0], t_kill) or t_kill) - t_kill,
        "released": (agent.first("released", f"epoch={epoch} ", t_kill) or t_kill) - t_kill,
        "formed": agent.first("form", f"epoch={resumed} ", t_kill) - t_kill,
        "exact": same_bits(agent.commit_file(rid, STEPS), agent.commit_file("ref", STEPS)),
        "victims": victims,
    }


def elastic(trials: int) -> tuple[list[dict], list[dict], list[dict]]:
    regroups, colds, copies = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        store_weights(Path(tmp) / "weights.safetensors")
        spec = {"model": MODEL, "sampler": SAMPLER, "weights": str(Path(tmp) / "weights.safetensors"),
                "timeout_s": 5.0}
        with GroupAgent(2, spec, tmp, stall_s=30.0, release_s=5.0) as agent:
            for h in agent.add_many(["m0", "m1", "m2"]):
                copies.append({"from": "store", "bytes": h.weights_bytes, "s": h.weights_s})
            agent.submit("ref", JOB)  # the uninterrupted degree-2 run every resume must equal
            agent.run_until(lambda: "ref" in agent.finished, 120)
            n = 3
            for i in range(trials):
                r = interrupt(agent, f"regroup{i}", cold=False, spawn_names=[])
                regroups.append(r)
                donor = next(iter(agent.procs_alive()))
                peer = agent.lend_weights(donor)
                h = agent.add(f"m{n}", peer=peer)  # the next spare joins by peer copy
                n += 1
                copies.append({"from": "peer", "bytes": h.weights_bytes, "s": h.weights_s})
            for i in range(max(1, trials - 1)):
                names = [f"m{n}", f"m{n + 1}"]  # a new group of degree 2
                n += 2
                colds.append(interrupt(agent, f"cold{i}", cold=True, spawn_names=names))
                agent.run_until(lambda: all(x in agent.hello for x in names), 120)
    return regroups, colds, copies


def big_peer_copy(mib: int = 256) -> tuple[float, float]:
    """(peer copy GB/s, memcpy GB/s) for a synthetic model of `mib` MiB, medians of 3."""
    from spotlight.parallel.peer import copy_from_segment, share

    class Big(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(mib // 8, 1 << 18)) for _ in range(8)]
            )

    a, b = Big(), Big()
    nbytes = sum(p.numel() * 4 for p in a.parameters())
    seg, layout, _ = share(a)
    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    peer, mem = [], []
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            copy_from_segment(b, seg.name, layout)
            peer.append(nbytes / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            dst.copy_(src)
            mem.append(nbytes / (time.perf_counter() - t0) / 1e9)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    finally:
        seg.close()
    return statistics.median(peer), statistics.median(mem)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--skip-exactness", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    regroups, colds, copies = elastic(args.trials)
    reg = statistics.median(r["s"] for r in regroups)
    cold = statistics.median(c["s"] for c in colds)
    rows.append(("regroup: kill -> first resumed step (median of %d)" % len(regroups), f"{reg:.3f} s",
                 "goal <= 0.2 s"))
    rows.append(("  kill -> death seen (pidfd) / survivor out of its collective",
                 f"{statistics.median(r['died'] for r in regroups):.3f} / "
                 f"{statistics.median(r['released'] for r in regroups):.3f} s",
                 "the victim's exit (kernel teardown) under this load"))
    rows.append(("  survivor released -> new group's first step committed",
                 f"{statistics.median(r['s'] - r['released'] for r in regroups):.3f} s",
                 "new gloo group + resume + one SP step"))
    rows.append(("cold restart: kill -> first resumed step (median of %d)" % len(colds), f"{cold:.3f} s", ""))
    rows.append(("cold restart / regroup", f"{cold / reg:.1f}x", "goal >= 50x"))
    rows.append(("resumed sample bit-identical to uninterrupted degree 2",
                 f"{sum(r['exact'] for r in regroups + colds)}/{len(regroups + colds)}", "must be all"))
    peer = [c for c in copies if c["from"] == "peer"]
    store = [c for c in copies if c["from"] == "store"]
    tiny_peer = statistics.median(c["bytes"] / c["s"] / 1e9 for c in peer)
    tiny_store = statistics.median(c["bytes"] / c["s"] / 1e9 for c in store)
    rows.append((f"tiny model weights ({peer[0]['bytes'] / 1e6:.2f} MB): peer copy / store file load",
                 f"{tiny_peer:.2f} / {tiny_store:.2f} GB/s", ""))
    big, mem = big_peer_copy()
    rows.append(("256 MiB weights: peer copy (preadv from the segment) / memcpy",
                 f"{big:.2f} / {mem:.2f} GB/s",
                 f"{100 * big / mem:.0f}% of memcpy (goal >= 50%)"))
    if not args.skip_exactness:
        from spotlight.parallel.exactness import check

        for d in (1, 2, 4):
            r = check(d, timeout_s=600)
            worst = max(r[k] for k in ("velocity", "log_prob", "rollout", "rollout_log_probs"))
            rows.append((f"SP exactness degree {d}: max |diff| forward+log-prob+rollout / grads",
                         f"{worst:.1e} / {r['grads']:.1e}", f"grad scale {r['scale']['grads']:.2f}"))
    import os

    rows.append(("machine load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}",
                 f"{os.cpu_count()} cores, shared"))
    print_rows(rows)


if __name__ == "__main__":
    main()
