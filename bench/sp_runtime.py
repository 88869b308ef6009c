# .venv/bin/python bench/sp_runtime.py [--trials 3]
"""How long from a killed SP group member to the resumed request's first step: regroup or cold restart?

Elastic SP in the real runtime: a killed group member, regroup with a warm spare vs waiting for
a cold replacement, from the kill to the resumed request's first step in the tensor store.

One LocalRuntime (queue, store, controller, one node agent with three workers, runtime.sp_degree
= 2: one group and a spare; the same 6-step rollout of a 2-layer, 4-head DiT with 64 image tokens
as bench/elastic_sp.py), rounds interleaved:
- **regroup**: at step >= 2 the group's rank 0 (the worker that commits) is SIGKILLed; the agent
  sees the death, the survivor comes out of its collective, the scheduler re-forms the request at
  a new epoch with the spare (no restart, no reload), and the new group's rank 0 reads the newest
  commit from the store and commits its first step.
- **cold**: rank 0 and the spare are SIGKILLed together, so the survivor's group waits for a
  restarted worker (process, imports, model build, weights from the store), as a system that
  cannot regroup from warm processes does.
The injected slow device (``SPOTLIGHT_WORKER_STEP_DELAY_S``) makes rank 0 wait after each commit,
so at the kill rank 1 is waiting in the next step's collective, as a peer of a slower rank does
(killing rank 1 instead would add the rest of rank 0's injected wait to the measurement).
Measured from the kill to the new group's first step: the wall time its rank 0 stamps on the
step's commit (``stepped_at`` in the commit's meta, which also names its group), and, second, to
when the bench first sees that commit in the tensor store (polled every 20 ms: a tighter poll is
itself load on 2 cores). Every resumed trajectory is checked bit-identical to the uninterrupted
one. Prints one table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from table import print_rows  # noqa: E402  (bench/table.py)

from spotlight.actors.procs import descendants  # noqa: E402
from spotlight.actors.runtime import LocalRuntime  # noqa: E402
from spotlight.comm import messages as m  # noqa: E402
from spotlight.comm.transport import RpcClient  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.work import policy_model  # noqa: E402

OVERRIDES = ["model.checkpoint=none", "model.layers=2", "model.heads=4", "model.head_dim=16",
             "model.image_size=16", "model.patch=2", "sampler.steps=6", "sampler.sde_steps=none",
             'sampler.sde_type="flow"', "runtime.sp_degree=2", "runtime.reserved_workers=3",
             "runtime.spot_workers=0", "runtime.heartbeat_s=0.5", "runtime.sp_timeout_s=2"]
JOB = m.RolloutWork(prompt="a red circle", seeds=[11, 12], version=0)


def workers(rt) -> dict[str, tuple[int, str]]:
    """worker id -> (pid, ipc endpoint) of the agent's live workers."""
    out = {}
    for pid in descendants(rt.agents["reserved"].pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in args:
            arg = lambda flag: args[args.index(flag) + 1].decode()  # noqa: E731
            out[arg(b"--worker-id")] = (pid, arg(b"--bind"))
    return out


async def answers(endpoint: str) -> bool:
    try:
        async with RpcClient(endpoint, timeout=0.5) as c:
            await c.call(m.WorkerStatus())
        return True
    except Exception:
        return False


def all_ready(rt, timeout: float = 300) -> dict[str, tuple[int, str]]:
    """Three workers that answer (loaded; the agent has them in its pool)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = workers(rt)
        if len(w) == 3 and all(rt.call(answers(e)) for _, e in w.values()):
            return w
        time.sleep(0.2)
    raise RuntimeError("workers not ready")


def logged(rt, rid: str, text: str) -> float | None:
    """Wall time of the agent's first log line about ``rid`` containing ``text``."""
    for line in (rt.log_dir / "agent-reserved.log").read_text().splitlines():
        if f"of {rid}:" in line or f"{rid} resumes" in line:
            if text in line:
                stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp()
    return None


def trial(rt, rid: str, cold: bool, reference: dict) -> dict[str, float]:
    before = all_ready(rt)
    rt.call(rt.queue.submit([m.WorkRequest(request_id=rid, batch=rid, work=JOB)]))
    while (held := rt.call(rt.store.get_commit(rid))) is None or held[0] < 2:
        time.sleep(0.002)
    group = held[2]["group"]
    victims = [group[0]] + ([w for w in before if w not in group] if cold else [])
    t_kill, wall_kill = time.monotonic(), time.time()
    for v in victims:
        os.kill(before[v][0], signal.SIGKILL)
    while (held := rt.call(rt.store.get_commit(rid))) is not None and held[2].get("group") == group:
        if time.monotonic() - t_kill > 300:
            raise RuntimeError(f"{rid}: no resumed commit")
        time.sleep(0.02)
    if held is None:  # sealed between two polls: the measurement missed the first resumed step
        raise RuntimeError(f"{rid}: finished before its first resumed commit was seen; raise the step delay")
    seen = time.monotonic() - t_kill
    first = held[2]["stepped_at"] - wall_kill
    (result,) = rt.call(rt.queue.wait_batch(rid, 300), timeout=320).results
    if held[0] != result.resumed_from + 1:
        raise RuntimeError(f"{rid}: the first resumed commit was overwritten before it was seen")
    traj, _ = rt.call(rt.store.get(result.key))
    same = all(torch.equal(torch.from_numpy(traj[k].copy()), reference[k]) for k in ("latents", "log_probs"))
    if not same:
        raise AssertionError(f"{rid}: resumed trajectory differs from the uninterrupted one")
    released, formed = logged(rt, rid, "left epoch"), logged(rt, rid, "resumes on a new group")
    return {"total": first, "seen": seen, "released": released - wall_kill if released else float("nan"),
            "formed": formed - wall_kill if formed else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=None, help="keep the run's logs here (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    # Rank 0 waits this long after each commit (not before it: the first resumed commit is not
    # delayed), so a kill lands between steps and the poll sees each commit.
    os.environ["SPOTLIGHT_WORKER_STEP_DELAY_S"] = "0.3"
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        recipe = load_recipe("tiny", [*OVERRIDES, f'run.out_dir="{out}"'])
        torch.manual_seed(0)
        model = policy_model(recipe)
        with torch.no_grad():  # a fresh DiT zero-initialises its output layer: give it real weights
            for p in model.parameters():
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
        with LocalRuntime(recipe) as rt:
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            all_ready(rt)
            rt.call(rt.queue.submit([m.WorkRequest(request_id="ref", batch="ref", work=JOB)]))
            (ref,) = rt.call(rt.queue.wait_batch("ref", 300), timeout=320).results
            traj, _ = rt.call(rt.store.get(ref.key))
            reference = {k: torch.from_numpy(traj[k].copy()) for k in ("latents", "log_probs")}
            runs: dict[str, list[dict[str, float]]] = {"regroup": [], "cold": []}
            for i in range(args.trials):
                for kind in ("regroup", "cold"):
                    t = trial(rt, f"{kind}{i}", kind == "cold", reference)
                    runs[kind].append(t)
                    print(f"  {kind} {i}: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items()), flush=True)
    times = {kind: [t["total"] for t in r] for kind, r in runs.items()}
    med = lambda kind, key: statistics.median(t[key] for t in runs[kind])  # noqa: E731
    regroup, cold = statistics.median(times["regroup"]), statistics.median(times["cold"])
    rows = [
        ("regroup with a warm spare: kill -> new group's first step (median)", f"{regroup:.3f} s",
         " ".join(f"{t:.3f}" for t in times["regroup"])),
        ("  kill -> that commit seen in the store (20 ms poll)", f"{med('regroup', 'seen'):.3f} s",
         " ".join(f"{t['seen']:.3f}" for t in runs["regroup"])),
        ("  kill -> survivor out of its collective / new group formed (agent log, ms)",
         f"{med('regroup', 'released'):.3f} / {med('regroup', 'formed'):.3f} s", ""),
        ("cold replacement: kill -> new group's first step (median)", f"{cold:.3f} s",
         " ".join(f"{t:.3f}" for t in times["cold"])),
        ("cold / regroup", f"{cold / regroup:.1f}x", ""),
        ("resumed trajectories bit-identical to the uninterrupted one",
         f"{2 * args.trials}/{2 * args.trials}", ""),
        ("machine load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}", f"{os.cpu_count()} cores"),
    ]
    print_rows(rows, ("measure", "value", "trials"))


if __name__ == "__main__":
    main()
