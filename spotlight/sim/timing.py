"""The simulation's timing model: how long each piece of work takes on a named GPU, instead of doing it.

``TimingModel(profile, gpu, resolution)`` answers, in seconds:

- ``step_s(batch, sp_degree)``: one denoising step of ``batch`` samples on an SP group of
  ``sp_degree`` GPUs of one node (classifier-free guidance included: ``cfg_forwards`` forwards);
- ``train_s(samples, timesteps, gpus)``: the GRPO update of one iteration on the reserved trainer pool;
- ``cold_load_s``, ``store_fetch_s(bytes)``, ``peer_copy_s(bytes)``: the model from cold storage,
  a weights update from the tensor store across nodes, a copy from a worker on the same node;
- ``regroup_s``, ``restart_s``: an SP group re-formed on its live workers; a worker restarted cold;
- ``node_start_s``: a spot node from the market's grant to its agent registering;
- ``request_s``: the runtime's own seconds per rollout request beyond its compute (a
  calibration's measurement; uncalibrated profiles price none: milliseconds of queue and commit
  round trips against requests of seconds to minutes);
- ``slowdown(kind)``: with a calibration, how much longer a unit of work takes with ``n`` processes
  computing at once on the cores of that node class (``spotlight.sim.cores``); None: a device each.

Profiles (``PROFILES``): ``qwen-image-20b`` (Qwen-Image's MMDiT, priced by FLOPs on ``h100`` or
``h200``) and ``tiny`` (this project's CPU model, priced by what was measured on this machine, on
``cpu``). A ``Calibration`` (``spotlight.sim.calibrate`` measures one; ``sim.calibration`` names
its JSON) replaces the tiny profile's built-in figures with a machine's measured primitives: step
seconds with 1..K processes computing at once on the spot cores and on the reserved cores, the
trainer's seconds per sample, a node agent's and a worker's start, the runtime's seconds per
request; with it, spot workers share the
spot cores and reserved workers share the trainer's, as on the machine it measured.

A FLOP-priced step is FLOPs / (peak x utilisation), the utilisation falling for short sequences
(``_utilisation``); an SP step adds Ulysses' four all-to-alls per block over NVLink. The utilisation
curves of the forward and of the LoRA training step and a worker's start are measured on one H200
(``bench/qwen_calibration.py``): the model prices each measured forward and training step within
10%. Every constant says where it comes from; "assumption" marks the ones no figure measured here or
published pins down (multi-GPU ones: the all-to-all, the regroup at degree > 1, the cold load).

Knows numbers only: nothing of queues, nodes or the clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from spotlight.errors import ConfigError

GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuKind:
    """One accelerator's figures."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s (0 for the measured CPU profile)."""
    memory_gb: float
    hbm_gbps: float
    nvlink_gbps: float
    """Per-GPU NVLink bandwidth one way (GB/s): intra-node peer copy and Ulysses all-to-all."""
    nic_gbps: float
    """Per-node network bandwidth (GB/s) into a node from the tensor store."""


GPUS: dict[str, GpuKind] = {
    # H100 SXM: 989 TFLOPS dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s (both ways) --
    # NVIDIA H100 Tensor Core GPU datasheet. A p5.48xlarge node has 3,200 Gb/s EFA (400 GB/s) for 8 GPUs
    # (AWS P5 instance page); the store side is one reserved node's NIC, taken as the same 400 GB/s.
    "h100": GpuKind("h100", 989e12, 80, 3350, 450, 400),
    # H200 SXM: the same GH100 compute (989 TFLOPS dense bf16), 141 GB HBM3e at 4.8 TB/s, NVLink 4 --
    # NVIDIA H200 datasheet; p5en.48xlarge: 3,200 Gb/s EFA (AWS P5en instance page).
    "h200": GpuKind("h200", 989e12, 141, 4800, 450, 400),
    # This machine's CPU (one core, torch 2.13 CPU): priced by measurement, not by FLOPs.
    "cpu": GpuKind("cpu", 0.0, 0, 0, 10, 1.0),
}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model's shape and the measured figures that price it."""

    name: str
    params: float
    """Transformer parameters."""
    layers: int
    hidden: int
    vae_factor: int
    """Pixels per latent pixel, each side."""
    patch: int
    """Latent pixels per token, each side (2x2 packing)."""
    text_tokens: int
    cfg_forwards: int
    """Transformer forwards per denoising step (2: true classifier-free guidance)."""
    update_bytes: float
    """Bytes a weights update ships to rollout workers each iteration."""
    weights_bytes: float
    """Bytes of the whole transformer (a cold load)."""
    gpus: tuple[str, ...]
    default_resolution: int
    token_params: float | None = None
    """Parameters each token passes through (the FLOP count per token is 2 x this); None: all of
    ``params``. A dual-stream block's image and text tokens each see one stream's weights, and its
    modulation acts once per sample, not per token."""
    measured_step_s: float | None = None
    """Measured seconds of one step at ``measured_batch`` and ``default_resolution`` (CPU profile)."""
    measured_batch: int = 1
    measured_train_s_per_sample: float | None = None
    """Measured trainer seconds per rollout sample (CPU profile)."""

    def tokens(self, resolution: int) -> int:
        side = resolution // (self.vae_factor * self.patch)
        return side * side + self.text_tokens


def _qwen_lora_bytes() -> float:
    # LoRA rank 32 on the 8 attention projections of each of the 60 dual-stream blocks (to_q/k/v/out
    # and add_q/k/v/to_add_out, 3072 x 3072 each): r x (in + out) params per projection, bf16. Rank 32
    # is Flow-GRPO's LoRA setting (its public training configs: lora rank 32, alpha 64).
    return 60 * 8 * 32 * (3072 + 3072) * 2.0


PROFILES: dict[str, ModelProfile] = {
    # Qwen-Image's transformer (Hugging Face Qwen/Qwen-Image, transformer/config.json): 60 layers,
    # 24 heads x 128 = 3072 hidden, patch 2 over a 16-channel VAE latent at 1/8 scale, 20.43 B
    # parameters (the model card's 20B MMDiT; counted on the meta device) = 41 GB in bf16. A token
    # passes through 6.80 B of them: each block's image (or text) stream -- q, k, v, out (4 x 3072^2)
    # and the MLP (2 x 3072 x 12288), biases included; the two modulations (3.4 B each) act once per
    # sample. 512^2 -> 1,024 image tokens, 1280^2 -> 6,400 (DESIGN.md §9). text_tokens 128: an
    # assumption for a short prompt after the pipeline drops its template (under 2% of the FLOPs at
    # 1280^2). cfg_forwards 2: the pipeline's true CFG (true_cfg_scale), which Flow-GRPO-style rollouts
    # keep.
    "qwen-image-20b": ModelProfile(
        "qwen-image-20b", params=20.43e9, token_params=6.796e9, layers=60, hidden=3072, vae_factor=8, patch=2,
        text_tokens=128, cfg_forwards=2, update_bytes=_qwen_lora_bytes(), weights_bytes=20.4e9 * 2,
        gpus=("h100", "h200"), default_resolution=1280),
    # The tiny CPU model of recipes/tiny.toml (32x32 pixels, patch 2), measured on this machine pinned
    # to one core (docs/BENCHMARKS.md "Simulated cluster", calibration): 4 iterations of `spotlight
    # run tiny` in-process, rollout 4.69-5.10 s (median 4.79) for 8 prompts x 8 samples x 10 steps ->
    # 0.0599 s per step of a batch of 8 (reward scoring included); update 5.56-6.16 s (median 5.60)
    # for 64 samples -> 0.0875 s per sample. Its weights (base.safetensors) are 10 MB, sent whole.
    "tiny": ModelProfile(
        "tiny", params=2.5e6, layers=4, hidden=128, vae_factor=1, patch=2, text_tokens=0, cfg_forwards=1,
        update_bytes=10e6, weights_bytes=10e6, gpus=("cpu",), default_resolution=32,
        measured_step_s=4.79 / 80, measured_batch=8, measured_train_s_per_sample=5.60 / 64),
}

# Utilisation of the peak, measured: the full-size transformer, random-initialized in bf16 on one H200
# (torch 2.11, diffusers 0.42.1, SDPA attention; bench/qwen_calibration.py, docs/BENCHMARKS.md
# "Full-size Qwen-Image on one H200", 2026-12-04). Forwards of 1,152-13,056 tokens (512^2-1280^2,
# batch 1 and 2) reached 22-44% of 989 TFLOP/s; u(n) = MFU_INFER x n / (n + HALF_TOKENS) fitted to the
# eight prices each within 10% (least squares in log seconds). The H100 has the same compute: taken
# the same there.
MFU_INFER = 0.50
HALF_TOKENS = 1250.0
# The LoRA training step (rank 32 on the image stream's q, k, v, out; gradient checkpointing; fp32
# adapter and AdamW over the bf16 base) of a forward of two samples, same H200: 12% of the peak at
# 2 x 1,152 tokens, 31% at 2 x 6,528 -- the same curve's two figures (fitted exactly: two points).
MFU_TRAIN = 0.47
HALF_TRAIN_TOKENS = 7000.0
# All-to-all efficiency on NVLink (achieved / link bandwidth): an assumption, NCCL all-to-all inside
# one NVSwitch node typically reaches ~70% of the link rate at multi-MB messages.
A2A_EFFICIENCY = 0.7
# Cold load: the node reads 41 GB of safetensors from network storage at 2 GB/s (an assumption: a
# cloud volume or object store read by one node; local NVMe would be 3x faster) then copies to each
# GPU over PCIe Gen5 x16 at ~50 GB/s (PCIe 5.0 spec: 64 GB/s raw per direction).
COLD_READ_GBPS = 2.0
PCIE_GBPS = 50.0
# A spot node from the market's grant to a registered agent: VM boot and a multi-GB container image
# pull, 3 minutes (an assumption within the "minutes" the paper states for a cold start).
NODE_START_S = 180.0
# A group re-formed at a new epoch with its surviving workers (no reload): kill -> first resumed step
# 0.50-0.65 s, this project's H200 measurement of the degree-1 re-form under NCCL (docs/BENCHMARKS.md
# "The GPU paths on one H200"); 0.5 s taken for any degree (a larger group's NCCL init is not measured).
# The tiny profile: 0.142 s, the runtime's degree-2 regroup on this machine (BENCHMARKS "Elastic SP").
REGROUP_S = 0.5
# A worker process restarted on a GPU before its model loads: interpreter, torch + diffusers imports
# and the CUDA context, 8.9 s measured on the H200 (median of 3 fresh processes, bench/qwen_calibration.py);
# 9 s taken (a communicator's set-up is the regroup's 0.5 s).
WORKER_START_S = 9.0
# A trained timestep costs 3 forwards (forward, recompute under checkpointing, activation gradients;
# LoRA weight gradients are tiny), the measured step's FLOPs; the optimizer step is inside the
# measurement. A KL term (grpo.beta > 0) adds the reference's forward, priced as inference.
TRAIN_FORWARDS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """One machine's measured primitives of the tiny profile (what ``spotlight.sim.calibrate``
    measures; stored as JSON). Step seconds are per denoising step of a request of ``batch``
    samples, its text encoding and reward scoring spread over its ``steps``."""

    batch: int
    """Samples per request the step seconds were measured with."""
    steps: int
    """Denoising steps per request measured."""
    spot_step_s: tuple[float, ...]
    """Seconds per step with 1, 2, ... processes computing at once on the spot cores."""
    reserved_step_s: tuple[float, ...]
    """The same on the reserved cores (the trainer's)."""
    train_s_per_sample: float
    """The trainer's update seconds per rollout sample, alone on the reserved cores."""
    node_start_s: float
    """A node agent process from its start to registered (interpreter and imports), spot cores."""
    worker_start_s: float
    """A worker process from its start to its model loaded, spot cores."""
    request_s: float
    """The runtime's own seconds per rollout request beyond its compute (queue round trips, weights
    and prompt fetch, a store commit every step, the trajectory's seal and the trainer's read), on
    one worker whose batches nothing overlaps."""

    def __post_init__(self) -> None:
        for name in ("spot_step_s", "reserved_step_s"):
            v = getattr(self, name)
            if not v or not all(math.isfinite(x) and x > 0 for x in v):
                raise ConfigError(f"calibration {name} must be a non-empty list of seconds > 0, got {v!r}")
        for name in ("batch", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"calibration {name} must be >= 1, got {getattr(self, name)}")
        for name in ("train_s_per_sample", "node_start_s", "worker_start_s", "request_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"calibration {name} must be seconds >= 0, got {v!r}")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """The calibration in the JSON file ``path``; a missing or malformed file is one ConfigError."""
        try:
            raw = json.loads(Path(path).read_text())
            names = {f.name for f in fields(cls)}
            if not isinstance(raw, dict) or set(raw) - names or names - set(raw):
                raise ValueError(f"expected the keys {sorted(names)}")
            for k in ("spot_step_s", "reserved_step_s"):
                raw[k] = tuple(float(x) for x in raw[k])
            return cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"sim.calibration {str(path)!r}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    def slowdown(self, kind: str):
        """n -> step seconds with n computing at once over alone, on ``kind``'s cores: the measured
        ratio, linear in n past the last one measured (the spot cores' shape where the reserved
        cores' measurement is shorter)."""
        own = self.spot_step_s if kind == "spot" else self.reserved_step_s
        shape = own if len(own) >= len(self.spot_step_s) else self.spot_step_s
        ratios = [x / shape[0] for x in shape]

        def slowdown(n: int) -> float:
            if n <= len(ratios):
                return ratios[max(n, 1) - 1]
            return ratios[-1] * n / len(ratios)

        return slowdown


class TimingModel:
    """Seconds for the work of one run; see the module docstring."""

    def __init__(self, profile: str, gpu: str, resolution: int | None = None,
                 calibration: Calibration | None = None) -> None:
        if profile not in PROFILES:
            raise ConfigError(f"sim.profile must be one of {', '.join(PROFILES)}, got {profile!r}")
        if gpu not in GPUS:
            raise ConfigError(f"sim.gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
        self.profile, self.gpu = PROFILES[profile], GPUS[gpu]
        if gpu not in self.profile.gpus:
            raise ConfigError(f"sim.gpu {gpu!r} cannot run profile {profile!r}; it runs on "
                              f"{', '.join(self.profile.gpus)}")
        self.resolution = self.profile.default_resolution if resolution is None else resolution
        unit = self.profile.vae_factor * self.profile.patch
        if self.resolution < unit or self.resolution % unit:
            raise ConfigError(f"sim.resolution must be a positive multiple of {unit} for {profile!r}, "
                              f"got {self.resolution}")
        self.tokens = self.profile.tokens(self.resolution)
        if calibration is not None and self.profile.measured_step_s is None:
            raise ConfigError(f"sim.calibration measures the tiny profile; profile {profile!r} is priced "
                              "by FLOPs")
        self.calibration = calibration

    # --- compute -----------------------------------------------------------------------------------
    def forward_flops(self, batch: int = 1) -> float:
        """FLOPs of one transformer forward of ``batch`` samples: 2 x the parameters a token passes
        through, per token (the linear layers), plus 4 x layers x hidden x tokens^2 (attention scores
        and the weighted sum)."""
        p, n = self.profile, self.tokens
        return batch * (2 * (p.token_params or p.params) * n + 4 * p.layers * p.hidden * n * n)

    def step_s(self, batch: int = 1, sp_degree: int = 1, kind: str = "spot") -> float:
        """One denoising step of ``batch`` samples on ``sp_degree`` GPUs (CFG forwards included) of
        a ``kind`` node, alone on its processor."""
        p = self.profile
        if p.measured_step_s is not None:  # measured: linear in batch and in tokens, no SP speed-up
            base = self.profile.tokens(p.default_resolution)
            step, per = p.measured_step_s, p.measured_batch
            if self.calibration is not None:
                cal = self.calibration
                step = (cal.spot_step_s if kind == "spot" else cal.reserved_step_s)[0]
                per = cal.batch
            return step * (batch / per) * (self.tokens / base)
        per_gpu_tokens = batch * self.tokens / sp_degree
        flops = p.cfg_forwards * self.forward_flops(batch) / sp_degree
        compute = flops / (self.gpu.peak_flops * _utilisation(per_gpu_tokens))
        return compute + self.a2a_s(batch, sp_degree)

    def a2a_s(self, batch: int, sp_degree: int) -> float:
        """Ulysses' all-to-alls of one step: 4 per block (q, k, v in; the output back), each moving
        (d-1)/d of a GPU's activation shard (tokens/d x hidden, bf16) over NVLink."""
        if sp_degree == 1:
            return 0.0
        p = self.profile
        shard = batch * self.tokens / sp_degree * p.hidden * 2
        volume = 4 * p.layers * p.cfg_forwards * shard * (sp_degree - 1) / sp_degree
        return volume / (self.gpu.nvlink_gbps * GB * A2A_EFFICIENCY)

    def train_s(self, samples: int, timesteps: int, gpus: int, reference: bool = False) -> float:
        """The GRPO update of ``samples`` rollouts at ``timesteps`` trained steps each on ``gpus``
        reserved GPUs (FSDP2: the work splits evenly), each forward two samples' tokens (as
        measured); ``reference``: a KL term's reference forward too (``grpo.beta > 0``)."""
        p = self.profile
        if self.calibration is not None:
            return samples * self.calibration.train_s_per_sample / max(gpus, 1)
        if p.measured_train_s_per_sample is not None:
            return samples * p.measured_train_s_per_sample / max(gpus, 1)
        flops = samples * timesteps * p.cfg_forwards * self.forward_flops(1)
        tokens = 2 * self.tokens
        s = TRAIN_FORWARDS * flops / (self.gpu.peak_flops * _train_utilisation(tokens))
        if reference:
            s += flops / (self.gpu.peak_flops * _utilisation(tokens))
        return s / max(gpus, 1)

    # --- weights and nodes ----------------------------------------------------------------------
    @property
    def cold_load_s(self) -> float:
        """The whole model from cold storage into one GPU of a fresh node."""
        p = self.profile
        if self.calibration is not None:
            return self.calibration.worker_start_s
        if p.measured_step_s is not None:
            return 2.3  # a cold tiny worker: 2.3-3.4 s measured (DESIGN.md §7: imports + model)
        return p.weights_bytes / (COLD_READ_GBPS * GB) + p.weights_bytes / (PCIE_GBPS * GB)

    @property
    def request_s(self) -> float:
        """The runtime's own seconds per rollout request beyond its compute (module docstring)."""
        return 0.0 if self.calibration is None else self.calibration.request_s

    @property
    def regroup_s(self) -> float:
        """A broken SP group re-formed at a new epoch on live workers: new communicator, resume."""
        return 0.142 if self.profile.measured_step_s is not None else REGROUP_S

    @property
    def restart_s(self) -> float:
        """A worker restarted cold on a GPU it held: process start, then the model from storage."""
        if self.profile.measured_step_s is not None:
            return self.cold_load_s  # measured as a whole: imports + model
        return WORKER_START_S + self.cold_load_s

    def store_fetch_s(self, nbytes: float) -> float:
        """``nbytes`` through the store's NIC (the caller queues concurrent fetches on it)."""
        return nbytes / (self.gpu.nic_gbps * GB)

    def peer_copy_s(self, nbytes: float) -> float:
        """``nbytes`` from a worker of the same node (NVLink peer copy; shared memory on CPU)."""
        return nbytes / (self.gpu.nvlink_gbps * GB)

    @property
    def node_start_s(self) -> float:
        if self.calibration is not None:
            return self.calibration.node_start_s
        if self.profile.measured_step_s is not None:
            return 1.0  # a local agent process: imports and registration (DESIGN.md §7: import torch ~1 s)
        return NODE_START_S

    def slowdown(self, kind: str):
        """n -> how much longer work takes with n processes computing at once on a ``kind`` node's
        cores (the calibration's measurement); None: every worker has a device of its own."""
        return None if self.calibration is None else self.calibration.slowdown(kind)

    def describe(self) -> str:
        return (f"{self.profile.name} at {self.resolution}^2 ({self.tokens} tokens) on {self.gpu.name}: "
                f"{self.step_s(1):.3g} s/step (batch 1, SP 1)")


def _utilisation(tokens_per_gpu: float) -> float:
    """Share of peak reached by a forward of this many tokens per GPU (saturating curve)."""
    return MFU_INFER * tokens_per_gpu / (tokens_per_gpu + HALF_TOKENS)


def _train_utilisation(tokens_per_gpu: float) -> float:
    """Share of peak reached by a LoRA training step's forward of this many tokens per GPU."""
    return MFU_TRAIN * tokens_per_gpu / (tokens_per_gpu + HALF_TRAIN_TOKENS)


def expected_spread(candidates: int, group: int, draws: int = 2000, seed: int = 0) -> float:
    """The sim's stand-in for a reward spread (rewards are not simulated): the mean std of the G
    seeds kept from M i.i.d. N(0, 1) candidate rewards (G/2 highest, G/2 lowest), by seeded Monte
    Carlo. Only the planner's relative ranking of arms uses it."""
    import random

    rng, total = random.Random(seed), 0.0
    for _ in range(draws):
        xs = sorted(rng.gauss(0, 1) for _ in range(candidates))
        kept = xs[: group // 2] + xs[-(group // 2):]
        mean = sum(kept) / len(kept)
        total += math.sqrt(sum((x - mean) ** 2 for x in kept) / len(kept))
    return total / draws
