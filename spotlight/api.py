"""The Python API for scripted experiments.

    from spotlight import Experiment, load_recipe
    exp = Experiment(load_recipe("tiny", ["run.iterations=20"]))
    exp.on_metrics(lambda record: print(record["event"], record.get("eval_reward")))
    summary = exp.run()

`Experiment` picks the executor the recipe's `run.mode` names: the in-process reference loop, or
the actor runtime in local processes (reserved side + spot workers), whose queue and tensor store
clients are reachable as `exp.queue` / `exp.store` while it runs. It is the one wiring of a run:
`spotlight run` and the reserved side of a cluster (`spotlight reserved`, which serves the actors
on TCP through `runtime_options["serve"]`) both start through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from spotlight import checkpoint
from spotlight.errors import ConfigError
from spotlight.recipe import Recipe, load_recipe


class Experiment:
    def __init__(self, recipe: Recipe | str | dict | None = None, overrides: list[str] | None = None):
        self.recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, overrides)
        self._hooks: list[Callable[[dict], None]] = []
        self.records: list[dict] = []
        self.loop = None
        self.runtime = None
        self.runtime_options: dict = {}
        """Keyword arguments of the ``LocalRuntime`` a runtime run starts (``serve``: where the actors
        listen for nodes on other hosts; benches: ``spot_cpus``)."""
        self.on_runtime: list[Callable[[object], None]] = []
        """Called with the ``LocalRuntime`` once its actors are up, before the first iteration."""

    def on_metrics(self, hook: Callable[[dict], None]) -> None:
        """Call `hook(record)` for every metrics record (iteration, eval) as it is written."""
        self._hooks.append(hook)

    @property
    def queue(self):
        return None if self.runtime is None else self.runtime.queue

    @property
    def store(self):
        return None if self.runtime is None else self.runtime.store

    def run(self, resume: bool = False, progress: bool = True) -> dict:
        """The recipe's run to its end (or from its latest checkpoint with ``resume``); returns the
        loop's summary. A missing checkpoint or device, or a runtime run on one machine without a
        worker, fails in one line before anything is started."""
        from spotlight.loop import Loop

        hooks = [self.records.append, *self._hooks]
        if resume:  # no checkpoint: one line, before anything is started or written
            checkpoint.latest(Path(self.recipe.run.out_dir) / self.recipe.run.name / "checkpoints")
        if self.recipe.run.mode == "sim":  # the control plane on a virtual clock: no model, no processes
            from spotlight.sim.run import SimRun

            self.loop = SimRun(self.recipe, hooks)
            return self.loop.run()
        from spotlight.parallel.ranks import trainer_ranks

        out = Path(self.recipe.run.out_dir) / self.recipe.run.name
        if self.recipe.run.mode == "in-process":
            with trainer_ranks(self.recipe, out / "logs") as ranks:
                self.loop = Loop(self.recipe, resume=resume, hooks=hooks, progress=progress,
                                 trainer=ranks and ranks.factory)
                return self.loop.run()
        from spotlight.actors.runtime import LocalRuntime
        from spotlight.parallel.device import resolve_device

        r = self.recipe.runtime
        if "serve" not in self.runtime_options and r.reserved_workers + r.spot_workers < 1:
            raise ConfigError("run.mode=\"runtime\" on one machine needs a worker: "
                              "runtime.reserved_workers + runtime.spot_workers >= 1")
        resolve_device(self.recipe.run.device)  # a device that is not here: one line, before any actor
        with LocalRuntime(self.recipe, **self.runtime_options) as self.runtime, \
                trainer_ranks(self.recipe, out / "logs") as ranks:
            for started in self.on_runtime:
                started(self.runtime)
            hooks.insert(0, self.runtime.metrics_hook)  # spot fields on every iteration record
            self.loop = Loop(self.recipe, executor=self.runtime.executor, resume=resume, hooks=hooks,
                             progress=progress, trainer=ranks and ranks.factory)
            summary = self.loop.run()
            self.runtime.plot_spot(self.loop.metrics.read(), self.loop.out / "spot.png")
            return summary
