"""Recipes: a run's whole configuration, loaded from a TOML file a user copies and edits.

A recipe is a set of sections, each the small config dataclass of the component it configures
(`[model]` → ModelConfig, `[sampler]` → SamplerConfig, `[grpo]` → GRPOConfig, `[runtime]` →
spotlight.actors.config.RuntimeConfig, ...), plus command-line overrides `section.field=value`.
Unknown sections or fields and impossible values raise one ConfigError naming the field (and, for
files, the path).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from spotlight.actors.config import RuntimeConfig
from spotlight.errors import ConfigError, NotFound
from spotlight.models.dit import ModelConfig
from spotlight.parallel.trainer import TrainerConfig
from spotlight.policy.grpo import GRPOConfig
from spotlight.policy.sampler import SamplerConfig
from spotlight.policy.seeds import ExploreConfig
from spotlight.rewards.config import RewardConfig
from spotlight.sections import section
from spotlight.sim.config import SimConfig
from spotlight.spot.config import SpotConfig

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """What a run does: prompts, batch shape, how long, how it is evaluated and where it writes."""

    name: str = "run"
    seed: int = 0
    iterations: int = 40
    minutes: float | None = None
    """Optional wall-clock budget; the run stops after the iteration that crosses it."""
    prompts: str = "demo"
    """Prompt set: 'demo', 'counting', 'all' (spotlight.data.prompts)."""
    prompts_per_iteration: int = 8
    group_size: int = 8
    """G: rollouts per prompt; must be even when exploration selects seeds."""
    eval_every: int = 5
    eval_seeds: int = 3
    """Evaluation repeats with disjoint seed sets; the report gives mean and spread over them.
    Every evaluation runs the ODE sampler on the held-out prompts (the headline), the ODE sampler
    on the training prompts and the rollout SDE policy, and the flow-matching drift
    (spotlight.evaluation)."""
    eval_samples: int = 8
    """Samples per prompt per evaluation seed set."""
    out_dir: str = "runs"
    checkpoint_every: int = 10
    mode: str = "in-process"
    """'in-process' (the reference loop), 'runtime' (actors in local processes; ``[runtime]``) or
    'sim' (the control plane on a virtual clock, workers timed by a model; ``[sim]``)."""
    device: str = "auto"
    """Where the model, sampler, trainer and workers compute: 'auto' (CUDA when a device works,
    probed by using it; else the CPU), 'cpu', or 'cuda' (an error when none works)."""
    tensorboard: bool = True
    """Write TensorBoard event files to ``<out_dir>/<name>/tensorboard/`` beside metrics.jsonl
    (when the ``tensorboard`` package is installed; false: never)."""

    def __post_init__(self) -> None:
        for name in (
            "iterations",
            "prompts_per_iteration",
            "group_size",
            "eval_every",
            "eval_seeds",
            "eval_samples",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError(f"run.group_size must be >= 2 (GRPO needs a group), got {self.group_size}")
        if self.minutes is not None and self.minutes <= 0:
            raise ConfigError(f"run.minutes must be > 0, got {self.minutes}")
        if self.mode not in ("in-process", "runtime", "sim"):
            raise ConfigError(f"run.mode must be 'in-process', 'runtime' or 'sim', got {self.mode!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"run.device must be one of auto, cpu, cuda, got {self.device!r}")


@dataclass(kw_only=True, slots=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    spot: SpotConfig = field(default_factory=SpotConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        mc = self.model
        folder = None
        if mc.pipeline is not None:
            from spotlight.pipelines.folder import read_folder

            folder = read_folder(mc.pipeline)  # one line per bad input, nothing loaded
            folder.latent_shape(mc.image_size)
            if mc.pipeline_shift:  # the pipeline's own sigma schedule
                self.sampler.shift = folder.shift(mc.image_size)
                self.sampler.shift_terminal = folder.shift_terminal
        if self.trainer.ranks > 1:
            if self.grpo.ema_decay > 0:
                raise ConfigError("grpo.ema_decay > 0 is not supported with trainer.ranks > 1")
            if self.run.mode == "sim":
                raise ConfigError("trainer.ranks > 1: run.mode 'sim' trains no model (use 1)")
        if self.runtime.sp_degree > 1:  # groups split the heads and the image tokens
            from spotlight.parallel.ulysses import check_degree

            if folder is not None:  # the Ulysses processor is Qwen-Image's joint attention
                if folder.family != "qwen-image":
                    raise ConfigError(f"runtime.sp_degree > 1 with model.pipeline supports Qwen-Image "
                                      f"folders; {folder.path} is a {folder.pipeline_class}")
                check_degree(self.runtime.sp_degree, folder.transformer["num_attention_heads"],
                             folder.tokens(mc.image_size),
                             heads_from=f"num_attention_heads of {folder.path}/transformer")
            else:
                check_degree(self.runtime.sp_degree, mc.heads, mc.tokens)
                if mc.dit_class != "QwenImageTransformer2DModel":
                    raise ConfigError("runtime.sp_degree > 1 supports model.dit_class "
                                      f"QwenImageTransformer2DModel, not {mc.dit_class}")
            if self.spot.trace is not None:
                self.runtime.check_node_workers(self.spot.workers_per_node, "spot.workers_per_node")
        e = self.explore
        if e.enabled:
            if self.run.group_size % 2:
                raise ConfigError(
                    f"run.group_size must be even when explore.schedule={e.schedule!r}, "
                    f"got {self.run.group_size}"
                )
            field_name = ("explore.arms" if e.planner else
                          "explore.arm_plan" if e.arm_plan is not None else "explore.candidates")
            if too_few := [m for m in e.candidate_counts() if m < self.run.group_size]:
                raise ConfigError(
                    f"{field_name}: every candidate count must be >= run.group_size "
                    f"({self.run.group_size}), got {too_few}"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain tables `load_recipe` reads back (a section with its own table form uses it)."""
        return {
            f.name: (
                s.to_table() if hasattr(s := getattr(self, f.name), "to_table") else dataclasses.asdict(s)
            )
            for f in dataclasses.fields(self)
        }


SECTIONS: dict[str, type] = get_type_hints(Recipe)  # section name -> its config dataclass


def load_recipe(source: str | Path | dict | None = None, overrides: list[str] | None = None) -> Recipe:
    """A validated Recipe from a TOML path, a built-in recipe name, a dict, or None (defaults)."""
    data: dict[str, Any]
    where = "recipe"
    if source is None:
        data = {}
    elif isinstance(source, dict):
        data = {k: dict(v) for k, v in source.items()}
    else:
        path = _find(source)
        where = str(path)
        data = _read(path)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"override {item!r}: expected section.field=value")
        data.setdefault(section, {})[name] = _parse_value(raw.strip())
    try:
        return _build(data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def recipe_tables(source: str | Path, *, own: bool = False) -> dict[str, Any]:
    """A recipe file's (or built-in name's) tables, unvalidated: with its ``extends`` chain merged
    in, or with ``own`` only the tables the file itself states (``extends`` dropped), which is how
    a baseline recipe is laid over another task (``spotlight.compare``)."""
    path = _find(source)
    if not own:
        return _read(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    data.pop("extends", None)
    return data


def merge_tables(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s fields over ``base``'s, section by section (a new dict; the inputs are unchanged)."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for name, values in over.items():
        merged[name] = {**merged.get(name, {}), **values} if isinstance(values, dict) else values
    return merged


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's tables; ``extends = "tiny"`` (a built-in name or a path) at its top takes
    that recipe's tables first and this file's fields over them, section by section, so a
    baseline recipe states only what it switches."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends must be a recipe name or path, got {base!r}")
    base_path = _find(base if Path(base).is_absolute() or base in _builtin() else path.parent / base)
    if base_path in (*seen, path):
        raise ConfigError(f"{path}: extends {base!r} makes a cycle")
    return merge_tables(_read(base_path, (*seen, path)), data)


def _builtin() -> list[str]:
    return [p.stem for p in sorted(RECIPES_DIR.glob("*.toml"))]


def _find(source: str | Path) -> Path:
    path = Path(source)
    if path.is_file():
        return path
    builtin = RECIPES_DIR / f"{source}.toml"
    if builtin.is_file():
        return builtin
    raise NotFound(
        f"recipe {source}: no such file (built-in recipes: "
        f"{', '.join(p.stem for p in sorted(RECIPES_DIR.glob('*.toml')))})"
    )


def _parse_value(raw: str) -> Any:
    if raw.lower() in ("none", "null"):  # TOML has no null; optional fields take these words
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word: take it as a string


def _build(data: dict[str, Any]) -> Recipe:
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table")
        cls = SECTIONS[name]  # a section whose keys are open (e.g. a reward's arguments) reads its own table
        sections[name] = cls.from_table(values) if hasattr(cls, "from_table") else section(name, cls, values)
    return Recipe(**sections)
