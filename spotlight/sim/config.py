"""The recipe's ``[sim]`` section: what a ``run.mode = "sim"`` run simulates.

    [sim]
    profile = "qwen-image-20b"   # or "tiny" (this machine's CPU model, measured)
    gpu = "h200"                 # h100, h200 (qwen-image-20b); cpu (tiny)
    resolution = 1280            # pixels per side; unset = the profile's default
    gpus_per_node = 8            # GPUs of each spot node; unset = spot.workers_per_node
    gpus_per_instance = 1        # GPU-level preemption: a trace node is 1 GPU of a host; unset = a node
    trainer_gpus = 8             # the reserved trainer pool (billed as reserved)
    spot_gpus = 64               # without a [spot] trace: a fixed spot pool of this many GPUs
    calibration = "cal.json"     # tiny: this machine's measured primitives (spotlight.sim.calibrate)

Everything else comes from the rest of the recipe, as in a real run: prompts and group size
(``[run]``), denoising steps (``[sampler]``), the exploration schedule and planner (``[explore]``),
lease, heartbeat, SP degree, reserved rollout workers (``[runtime]``), the trace, its replay and
prices (``[spot]``). A bad value is one ``ConfigError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotlight.errors import ConfigError
from spotlight.sim.timing import Calibration, TimingModel


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """A simulated run (recipe section ``[sim]``; used when ``run.mode = "sim"``)."""

    profile: str = "tiny"
    """Timing profile of the model: "qwen-image-20b" or "tiny" (spotlight.sim.timing.PROFILES)."""
    gpu: str = "cpu"
    """GPU kind every worker and the trainer runs on: "h100", "h200" (20B) or "cpu" (tiny)."""
    resolution: int | None = None
    """Image side in pixels; None = the profile's (1280 for qwen-image-20b, 32 for tiny)."""
    gpus_per_node: int | None = None
    """GPUs (workers) of each spot node; None = spot.workers_per_node."""
    gpus_per_instance: int | None = None
    """GPU-level preemption: each trace node is a spot instance of this many GPUs, placed on a host
    of ``gpus_per_node`` GPUs (which it must divide) beside others, so a removal takes a share of a
    host's GPUs out of its SP groups (``spotlight.sim.host``); None = a trace node is a whole node."""
    trainer_gpus: int = 1
    """GPUs of the reserved trainer pool (FSDP: the update splits across them), >= 1."""
    spot_gpus: int | None = None
    """Without a spot trace: a fixed pool of this many spot GPUs, present throughout;
    None = runtime.spot_workers."""
    samples_per_request: int | None = None
    """Rollout samples per request; None = a prompt's whole group (one request per prompt, as
    the runtime sends). Smaller spreads a group over several workers."""
    train_timesteps: int | None = None
    """Denoising steps the update trains per sample; None = sampler.steps x grpo.timestep_fraction."""
    hours: float | None = None
    """Stop after the iteration that crosses this many simulated hours (besides run.iterations)."""
    calibration: str | None = None
    """Profile tiny: a JSON file of the primitives measured on one machine (``python -m
    spotlight.sim.calibrate``), priced instead of the profile's built-in figures; with it every spot
    worker shares the spot cores and the reserved workers share the trainer's, as measured there
    (the trainer is still billed as ``trainer_gpus`` reserved GPUs, as the runtime bills its
    trainer's device). None = the built-in figures, a processor per worker."""
    setup_s: float = 0.0
    """Simulated seconds from the replay's run second 0 to the first iteration (a runtime run's
    trainer set-up and base evaluation after its replay starts), >= 0."""

    def __post_init__(self) -> None:
        self.timing()  # unknown profile or GPU kind, a resolution off the latent grid: one line here
        for name in ("gpus_per_node", "gpus_per_instance", "spot_gpus", "samples_per_request",
                     "train_timesteps"):
            v = getattr(self, name)
            least = 0 if name == "spot_gpus" else 1
            if v is not None and v < least:
                raise ConfigError(f"sim.{name} must be >= {least} or unset, got {v}")
        if self.trainer_gpus < 1:
            raise ConfigError(f"sim.trainer_gpus must be >= 1, got {self.trainer_gpus}")
        if not (math.isfinite(self.setup_s) and self.setup_s >= 0):
            raise ConfigError(f"sim.setup_s must be a finite number >= 0, got {self.setup_s}")
        if self.hours is not None and not (math.isfinite(self.hours) and self.hours > 0):
            raise ConfigError(f"sim.hours must be a finite number > 0 or unset, got {self.hours}")

    def timing(self) -> TimingModel:
        cal = None if self.calibration is None else Calibration.load(self.calibration)
        return TimingModel(self.profile, self.gpu, self.resolution, cal)
