"""Measure the tiny profile's primitives on this machine: a ``Calibration`` for ``sim.calibration``.

    python -m spotlight.sim.calibrate --spot-cpus 1 --reserved-cpus 0 --out cal.json [recipe overrides]

What it measures, each with the project's own code in fresh processes pinned as a one-machine run
pins its actors (``LocalRuntime(spot_cpus=...)``: spot agents and their workers on the spot CPUs;
the trainer, and the reserved node it starts, on the others):

- step seconds with k = 1..``concurrency`` processes computing at once on the spot CPUs: each
  probe builds the worker's model (``work.policy_model``); then the first k run ``requests``
  rollouts of one prompt's group each (``work.rollout``: text encoding, every denoising step,
  reward scoring) together; a request's seconds over its steps, the median over the requests
  after each probe's first;
- on the reserved CPUs meanwhile (as a run's reserved worker computes while its spot workers do):
  one iteration's groups rolled out one after another (the step seconds of one process there),
  then the trainer's update (``GRPOTrainer`` on the trainer's model) of them three times, seconds
  per sample the median of the last two;
- a worker's start (process start to its model built: interpreter, imports, model), the first
  spot probe's, alone; a node agent's (process start to its service module imported), alone.

Nothing here is fitted to a run's iteration seconds: these are the pieces the simulation prices.

Knows processes, CPUs and the work functions; nothing of queues or the simulation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from spotlight.sim.timing import Calibration


def _spawn(args: list[str], cpus: set[int]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spotlight.sim.calibrate", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))


def _line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"calibration probe exited with status {proc.returncode} before reporting")
    return json.loads(line)


def _send(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def agent_start_s(cpus: set[int]) -> float:
    """A node agent process from its start to its service imported."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import spotlight.actors.node.service"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"},
                   preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    return time.perf_counter() - t0


def measure(spot_cpus: set[int], reserved_cpus: set[int], overrides: list[str], concurrency: int = 2,
            requests: int = 3) -> Calibration:
    """The primitives (module docstring) for the tiny recipe with ``overrides``. The reserved
    probe (its rollouts, then the trainer's updates) runs on its CPUs while the spot probes run
    on theirs, as a run's reserved and spot workers do."""
    from spotlight import load_recipe

    recipe = load_recipe("tiny", overrides)
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        procs.append(_spawn(["--probe", "rollout", *overrides], spot_cpus))
        _line(procs[0])  # built, alone on the spot CPUs: a worker's start
        worker_start = time.perf_counter() - t0
        procs += [_spawn(["--probe", "rollout", *overrides], spot_cpus) for _ in range(concurrency - 1)]
        for p in procs[1:]:
            _line(p)
        reserved = _spawn(["--probe", "train", *overrides], reserved_cpus)
        procs.append(reserved)
        _line(reserved)
        _send(reserved, "go")
        spot = []
        for k in range(1, concurrency + 1):  # k probes computing at once, the first k
            for p in procs[:k]:
                _send(p, f"go {requests}")
            per_step = []
            for p in procs[:k]:
                per_step += _line(p)["step_s"][1:]  # each probe's first request warms up
            spot.append(statistics.median(per_step))
        got = _line(reserved)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return Calibration(batch=recipe.run.group_size, steps=recipe.sampler.steps, spot_step_s=tuple(spot),
                       reserved_step_s=(got["step_s"],), train_s_per_sample=got["train_s_per_sample"],
                       node_start_s=agent_start_s(spot_cpus), worker_start_s=worker_start)


# --- the probes (child processes) -------------------------------------------------------------------
def _probe(kind: str, overrides: list[str]) -> None:
    import torch

    from spotlight import load_recipe, work
    from spotlight.comm import messages as m
    from spotlight.data.prompts import prompt_set

    torch.set_num_threads(1)
    recipe = load_recipe("tiny", overrides)
    prompts, G = prompt_set(recipe.run.prompts), recipe.run.group_size
    reward, shape = work.recipe_reward(recipe), work.image_shape(recipe)

    def job(i: int) -> m.RolloutWork:
        seeds = list(range(i * G, (i + 1) * G))
        return m.RolloutWork(prompt=prompts[i % len(prompts)], seeds=seeds, version=0)

    if kind == "rollout":  # "go R": R rollouts, their seconds per step; until stdin closes
        model = work.policy_model(recipe)
        print(json.dumps({"built": True}), flush=True)
        done = 0
        for line in sys.stdin:
            step_s = []
            for _ in range(int(line.split()[1])):
                t = time.perf_counter()
                work.rollout(model, job(done), recipe.sampler, reward, shape)
                step_s.append((time.perf_counter() - t) / recipe.sampler.steps)
                done += 1
            print(json.dumps({"step_s": step_s}), flush=True)
        return
    from spotlight.policy.grpo import GRPOTrainer

    torch.manual_seed(recipe.run.seed)
    model = work.recipe_model(recipe.model)
    trainer = GRPOTrainer(model, recipe.grpo, recipe.sampler, seed=recipe.run.seed)
    deployed = work.policy_model(recipe)
    deployed.load_state_dict(model.state_dict())
    print(json.dumps({"built": True}), flush=True)
    sys.stdin.readline()  # go
    n, step_s, groups = recipe.run.prompts_per_iteration, [], []
    for p in range(n):
        t = time.perf_counter()
        groups.append(work.rollout(deployed, job(p), recipe.sampler, reward, shape))
        step_s.append((time.perf_counter() - t) / recipe.sampler.steps)
    seconds = []
    for _ in range(3):  # the same groups each time: the update's cost does not depend on the weights
        t = time.perf_counter()
        trainer.update(groups)
        seconds.append((time.perf_counter() - t) / (n * G))
    print(json.dumps({"step_s": statistics.median(step_s[1:]),
                      "train_s_per_sample": statistics.median(seconds[1:])}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spot-cpus", default="1", help="CPUs of the spot nodes, comma-separated")
    p.add_argument("--reserved-cpus", default="0", help="CPUs of the trainer and reserved node")
    p.add_argument("--concurrency", type=int, default=2, help="most processes at once on the spot CPUs")
    p.add_argument("--requests", type=int, default=3, help="rollouts per probe and k (the first warms up)")
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--probe", choices=("rollout", "train"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="tiny recipe overrides (key=value)")
    args = p.parse_args()
    if args.probe:
        _probe(args.probe, args.overrides)
        return
    cpus = [{int(c) for c in s.split(",")} for s in (args.spot_cpus, args.reserved_cpus)]
    cal = measure(cpus[0], cpus[1], args.overrides, args.concurrency, args.requests)
    cal.save(args.out)
    print(json.dumps(json.loads(open(args.out).read())))


if __name__ == "__main__":
    main()
