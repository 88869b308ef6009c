# .venv/bin/python bench/chaos.py --kills 100 --seed 0
"""Is any work lost or counted twice when spot nodes are killed at random?

Chaos: random SIGKILLs and SIGTERMs of spot agents and workers while rollout requests run on
the real runtime (processes over ipc, the tiny model), with per-step commits and under naive_spot
(no step commits: a preempted request restarts from scratch), side by side.

Each mode: a reserved node (1 worker) and ``--nodes`` spot nodes (1 worker each) under a
``FaultInjector`` (seeded); requests are submitted in rounds of ``--round`` (each with its own
seeds); whenever a spot node holds a request's commit (it is running one), one fault hits it: a
SIGKILL or SIGTERM of its agent (a fresh node replaces it) or of one of its workers (the agent
restarts it); after ``--idle-s`` without a busy one, any ready spot node is hit (never one
still starting: a node killed before it ever served is no test). Every trajectory is checked against
its no-fault twin (the in-process rollout with the same weights and seeds). Printed per mode:
requests submitted / completed / resumed from a commit / re-run from scratch / lost / counted twice,
trajectories not bit-identical, and steps lost per preempted request (from the workers' step log:
steps computed more than once) and the most lost in one preemption (``lost_max``: a request may be
preempted more than once)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotlight.actors.runtime import LocalRuntime  # noqa: E402
from spotlight.comm import messages as m  # noqa: E402
from spotlight.policy.sampler import sde_rollout  # noqa: E402
from spotlight.recipe import load_recipe  # noqa: E402
from spotlight.spot.injector import FaultInjector  # noqa: E402
from spotlight.work import policy_model  # noqa: E402

PROMPTS = ["two red circles", "three blue squares", "three yellow circles", "two green triangles"]
MODEL = ["model.checkpoint=none", "model.layers=1", "model.heads=2", "model.head_dim=16",
         "model.image_size=16", "model.patch=4", "sampler.sde_steps=none", 'sampler.sde_type="flow"']


def run_mode(name: str, args, out: Path) -> dict:
    recipe = load_recipe("tiny", [
        *MODEL, f"sampler.steps={args.steps}", "run.group_size=2", f'run.out_dir="{out}"',
        f'run.name="{name}"', "runtime.reserved_workers=1", "runtime.spot_workers=0", "runtime.lease_s=1.5",
        "runtime.heartbeat_s=0.4",
        "runtime.node_lost_s=6", f"runtime.step_commits={'false' if name == 'naive_spot' else 'true'}",
        "runtime.max_attempts=100",  # chaos hits one request many times; none may be dead-lettered
        f"runtime.step_delay_s={args.step_delay}",  # a slow device: faults land mid-request
    ])
    torch.manual_seed(args.seed)
    model = policy_model(recipe)
    shape = (3, 16, 16)
    twins: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    submitted, faults = [], []
    completed = mismatched = dead = 0
    t0 = time.monotonic()
    with LocalRuntime(recipe) as rt:
        rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
        injector = FaultInjector(rt, [], warning_s=1.0, seed=args.seed, expect=rt.account.expect)
        for i in range(args.nodes):
            injector.add(f"spot{i}")
        before = rt.call(rt.queue.stats()).stats
        rounds = 0
        while len(faults) < args.kills:
            rounds += 1
            batch = f"r{rounds}"
            ids, jobs = [], []
            for i in range(args.round):
                prompt = PROMPTS[(rounds + i) % len(PROMPTS)]
                seeds = [1000 * rounds + 2 * i, 1000 * rounds + 2 * i + 1]
                ids.append(f"{batch}/{i}")
                jobs.append(m.RolloutWork(prompt=prompt, seeds=seeds, version=0))
            for rid, job in zip(ids, jobs):  # the no-fault twins, before the round (faults start with it)
                ref = sde_rollout(model, [job.prompt] * 2, job.seeds, recipe.sampler, shape)
                twins[rid] = (torch.stack(ref.latents), torch.stack(ref.log_probs))
            requests = [m.WorkRequest(request_id=r, batch=batch, work=j) for r, j in zip(ids, jobs)]
            rt.call(rt.queue.submit(requests))
            submitted += ids
            handle = rt.bg.submit(rt.queue.wait_batch(batch, 600))
            idle_since = time.monotonic()
            while not handle.done() and len(faults) < args.kills:
                injector.replace_gone()  # capacity is kept, whatever took a node down
                held = (rt.call(rt.store.get_commit(r)) for r in ids)
                busy = sorted({h[2]["worker"].split("/")[0] for h in held if h is not None}
                              & set(rt.spot_pids()))
                if not busy and time.monotonic() - idle_since > args.idle_s:  # a spot node that is ready
                    busy = sorted(n for n in rt.spot_pids() if rt.agents[n].ready.done()
                                  and rt.agents[n].ready.exception() is None)
                what = injector.random_fault(busy) if busy else None
                if what is not None and what != "no spot node alive":  # it went meanwhile: no fault
                    faults.append(what)
                    idle_since = time.monotonic()
                try:
                    handle.result(timeout=args.every_s)
                except TimeoutError:
                    pass
            done = handle.result(timeout=900)
            dead += len(done.dead)
            missing = [r for r, x in zip(ids, done.results) if x is None]
            if missing:
                print(f"  {name}: round {rounds}: no result for {missing} (dead {done.dead}, "
                      f"cancelled {done.cancelled}); queue {rt.call(rt.queue.stats()).stats}",
                      file=sys.stderr)
            for rid, result in zip(ids, done.results):
                if result is None:
                    continue
                completed += 1
                traj, _ = rt.call(rt.store.get(result.key))
                lat, lps = twins[rid]
                same = (torch.equal(torch.from_numpy(traj["latents"].copy()), lat)
                        and torch.equal(torch.from_numpy(traj["log_probs"].copy()), lps))
                mismatched += not same
                rt.call(rt.store.delete(result.key))
            print(f"  {name}: round {rounds}, {len(faults)} faults, {completed} completed",
                  file=sys.stderr)
        injector.stop()
        after = rt.call(rt.queue.stats()).stats
        rt.account.steps.refresh()
        per = {rid: rt.account.steps.requests.get(rid) for rid in submitted}
        wall_s = time.monotonic() - t0
    preempted = [r for r in per.values() if r is not None and len(r.first_step) > 1]
    lost = [r.lost for r in preempted]
    return {
        "mode": name, "faults": len(faults), "submitted": len(submitted), "completed": completed,
        "resumed": sum(r.resumed for r in preempted), "rerun": sum(r.rerun for r in preempted),
        "lost": len(submitted) - completed, "dead_lettered": dead,
        "counted_twice": (after["completed"] - before["completed"] - completed)
        + (after["duplicate_completions"] - before["duplicate_completions"]),
        "late_refused": after["late_results_dropped"] - before["late_results_dropped"],
        "not_identical": mismatched, "preempted": len(preempted),
        "steps_lost": sum(lost), "lost_mean": statistics.mean(lost) if lost else 0.0,
        "lost_max": max((r.lost / (len(r.first_step) - 1) for r in preempted), default=0.0),
        "wall_s": wall_s,
        "fault_kinds": {k: sum(f.startswith(k) for f in faults)
                        for k in ("SIGKILL agent", "SIGTERM agent", "SIGKILL worker", "SIGTERM worker")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100, help="faults per mode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=3, help="spot nodes kept present")
    p.add_argument("--round", type=int, default=12, help="requests per round")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds a worker waits after each step")
    p.add_argument("--every-s", type=float, default=0.3, help="how often to look for a busy spot node")
    p.add_argument("--idle-s", type=float, default=3.0,
                   help="fault any spot node after this long without a busy one")
    p.add_argument("--modes", default="step_commits,naive_spot")
    p.add_argument("--out", default=None, help="keep the runs' logs here (default: a temporary folder)")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="spl-chaos-") as tmp:
        out = args.out or tmp  # the runs' logs (steps.log, every actor's log) stay in --out
        for mode in args.modes.split(","):
            rows.append(run_mode(mode, args, Path(out)))
            print(f"{mode}: {rows[-1]}", flush=True)  # each mode's numbers as soon as they exist
    cols = ["mode", "faults", "submitted", "completed", "resumed", "rerun", "lost", "counted_twice",
            "late_refused", "not_identical", "preempted", "steps_lost", "lost_mean", "lost_max", "wall_s"]
    print(f"chaos: --kills {args.kills} --seed {args.seed}, {args.nodes} spot nodes, {args.steps} "
          f"steps/request, {args.step_delay} s/step delay")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    for r in rows:
        print(f"{r['mode']} faults: {r['fault_kinds']}")
    if len(rows) == 2 and rows[0]["lost_mean"] > 0:
        print(f"steps lost per preempted request: {rows[1]['mode']} / {rows[0]['mode']} = "
              f"{rows[1]['lost_mean'] / rows[0]['lost_mean']:.1f}x")
    ok = all(r["lost"] == 0 and r["counted_twice"] == 0 and r["not_identical"] == 0 for r in rows)
    ok &= all(r["lost_max"] <= 1 for r in rows if r["mode"] == "step_commits")
    print("goal (0 lost, 0 counted twice, all bit-identical, <= 1 step lost per preemption with commits):",
          "met" if ok else "MISSED")


if __name__ == "__main__":
    main()
