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
  spot probe's, alone; a node agent's (process start to its service module imported), alone;
- the runtime's own seconds per rollout request, after the others: a one-machine runtime
  (``LocalRuntime``: queue, store and trainer on the reserved CPUs, one spot worker on the spot
  CPUs, no trace) runs a few iterations of the recipe; with one worker nothing overlaps, so a rollout
  batch's wall time (submit to its trajectories read) minus the worker's compute is what the
  runtime adds — queue round trips, the weights and prompt fetch, a store commit every step, the
  trajectory's seal and the trainer's read — over its requests, the median over the batches after
  the first.

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
            requests: int = 3, runtime_iterations: int = 3) -> Calibration:
    """The primitives (module docstring) for the tiny recipe with ``overrides``. The reserved
    probe (its rollouts, then the trainer's updates) runs on its CPUs while the spot probes run
    on theirs, as a run's reserved and spot workers do; then the runtime probe, alone, for
    ``runtime_iterations`` (>= 2: the first is left out)."""
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
    node_start = agent_start_s(spot_cpus)
    spot_list = ",".join(str(c) for c in sorted(spot_cpus))
    probe = _spawn(["--probe", "runtime", "--spot-cpus", spot_list, "--runtime-iterations",
                    str(runtime_iterations), *overrides], reserved_cpus)
    try:
        request_s = _line(probe)["request_s"]
        probe.wait()
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    return Calibration(batch=recipe.run.group_size, steps=recipe.sampler.steps, spot_step_s=tuple(spot),
                       reserved_step_s=(got["step_s"],), train_s_per_sample=got["train_s_per_sample"],
                       node_start_s=node_start, worker_start_s=worker_start, request_s=request_s)


def _runtime_probe(spot_cpus: set[int], iterations: int, overrides: list[str]) -> None:
    """The runtime's seconds per rollout request (module docstring), printed as one JSON line."""
    import tempfile

    from spotlight import load_recipe
    from spotlight.actors.runtime import LocalRuntime
    from spotlight.loop import Loop

    if iterations < 2:
        raise SystemExit("--runtime-iterations must be >= 2 (the first is left out)")
    with tempfile.TemporaryDirectory() as out:
        recipe = load_recipe("tiny", [*overrides, 'run.mode="runtime"', "runtime.reserved_workers=0",
                                      "runtime.spot_workers=1", "spot.trace=none", 'explore.schedule="off"',
                                      f"run.iterations={iterations}", f'run.out_dir="{out}"',
                                      'run.name="calibrate"'])
        with LocalRuntime(recipe, spot_cpus=spot_cpus) as rt:
            loop = Loop(recipe, executor=rt.executor, progress=False)
            for it in range(iterations):
                loop.step(it)
            batches = [t for t in loop.executor.timings if t["kind"] == "rollout"][1:]
    per = [(t["wall_s"] - t["compute_s"]) / t["requests"] for t in batches]
    print(json.dumps({"request_s": max(statistics.median(per), 0.0)}), flush=True)


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
    p.add_argument("--runtime-iterations", type=int, default=3,
                   help="iterations of the runtime probe (the first is left out)")
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--probe", choices=("rollout", "train", "runtime"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="tiny recipe overrides (key=value)")
    args = p.parse_args()
    cpus = [{int(c) for c in s.split(",")} for s in (args.spot_cpus, args.reserved_cpus)]
    if args.probe == "runtime":
        _runtime_probe(cpus[0], args.runtime_iterations, args.overrides)
        return
    if args.probe:
        _probe(args.probe, args.overrides)
        return
    cal = measure(cpus[0], cpus[1], args.overrides, args.concurrency, args.requests, args.runtime_iterations)
    cal.save(args.out)
    print(json.dumps(json.loads(open(args.out).read())))


if __name__ == "__main__":
    main()
