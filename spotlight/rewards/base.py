"""The reward plug-in interface: what a reward is, how one is found by name, how rewards combine.

A reward scores a batch of finished images against their prompts:
``reward(images: uint8 [B, H, W, 3], prompts: list[str]) -> float32 [B]``. Rewards know nothing of
actors, queues or models; a worker converts its decoded latents with :func:`to_uint8_images` and
calls the reward it was configured with.

A reward may also say *where* in each image it was earned: ``reward.columns(images, prompts) ->
(scores [B], credit [B, W])``, a score per image column (the OCR reward's: 1 on the letters read
right, 0 on wrong ones). :func:`column_scores` gives every reward's map (a reward without one: its
score at every column); GRPO's ``awm_credit = "columns"`` weights each pixel's loss by it.

Rewards are found by name through a small registry. Built-in names map to ``"module:attr"``
strings that are imported only when first asked for, so importing this module (e.g. in a
controller that never scores) pulls in neither PIL-heavy scorers nor the compositional detector.
Third-party code adds names with ``@register_reward("name")``, or is named by import path
(``"mypkg.rewards:make_score"``, a factory), which also reaches worker processes that never ran
the registering script. A recipe's ``[reward]`` section is :class:`spotlight.rewards.config.RewardConfig`.

This module imports numpy only; torch is touched through the tensor's own methods.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from spotlight.errors import ConfigError

if TYPE_CHECKING:  # only for annotations: importing base must stay cheap
    import torch

__all__ = [
    "RewardFn",
    "WeightedSum",
    "check_arguments",
    "check_batch",
    "check_scores",
    "column_scores",
    "flat_columns",
    "known_rewards",
    "make_reward",
    "register_reward",
    "resolve_reward",
    "unregister_reward",
    "to_uint8_images",
]


@runtime_checkable
class RewardFn(Protocol):
    """Anything with a ``name`` that maps (images, prompts) to one float32 score per image.

    Structural, so a reward need not inherit from anything here. Implementations should call
    :func:`check_batch` on their input: a shape mistake should fail loudly, not score garbage.
    """

    name: str

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """Score ``images`` (uint8 [B, H, W, 3]) against ``prompts`` (len B); float32 [B]."""
        ...


def column_scores(reward, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(scores float32 [B], per-column credit float32 [B, W]): where in each image the reward was
    earned. A reward with ``columns(images, prompts)`` says so itself (the OCR reward: the columns
    where the text is right); any other reward's map is its score at every column. A
    ``WeightedSum`` weighs its terms' maps."""
    fn = getattr(reward, "columns", None)
    if fn is None:
        return _checked(reward, images, reward(images, prompts))
    return _checked(reward, images, *fn(images, prompts))


async def column_scores_async(
    reward, images: np.ndarray, prompts: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """``column_scores``, awaited, with the same checks: a reward with ``columns_async`` or
    ``score_async`` (its own thread pool: ocr) scores while the caller's event loop keeps running;
    any other reward is called as ``column_scores`` calls it."""
    columns = getattr(reward, "columns_async", None)
    if columns is not None:
        return _checked(reward, images, *await columns(images, prompts))
    score = getattr(reward, "score_async", None)
    if score is None:
        return column_scores(reward, images, prompts)
    return _checked(reward, images, await score(images, prompts))


def flat_columns(scores: np.ndarray, width: int) -> np.ndarray:
    """The credit map of a reward that does not say where: each image's score at every column."""
    return np.repeat(np.asarray(scores, dtype=np.float32)[:, None], width, axis=1)


def _checked(reward, images: np.ndarray, scores, maps=None) -> tuple[np.ndarray, np.ndarray]:
    """A reward's (scores, map) as ``column_scores`` returns them, checked; no map: the flat one."""
    scores = check_scores(scores, images.shape[0], reward.name)
    if maps is None:
        return scores, flat_columns(scores, images.shape[2])
    return scores, _check_columns(maps, images, reward.name)


def _check_columns(maps, images: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(maps, dtype=np.float32)
    if arr.shape != images.shape[:1] + images.shape[2:3]:
        raise ValueError(f"reward {name!r} returned columns of shape {list(arr.shape)}, expected "
                         f"{[images.shape[0], images.shape[2]]}")
    if not np.isfinite(arr).all():
        raise ValueError(f"reward {name!r} returned non-finite column credit")
    return arr


# --- batch checks -------------------------------------------------------------------------------
def check_batch(images: np.ndarray, prompts: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``images`` is uint8 [B, H, W, 3] and ``prompts`` B strings."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"images must be a numpy array, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must have shape [B, H, W, 3], got {list(images.shape)}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        n = "a str" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"need one prompt per image: {images.shape[0]} images, {n}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompts[{i}] must be str, got {type(p).__name__}")


def check_scores(scores: Any, batch: int, name: str) -> np.ndarray:
    """Return ``scores`` as float32 [batch]; raise ``ValueError`` naming the reward otherwise.

    A NaN reward would silently poison the GRPO advantage normalisation of its whole group,
    so non-finite scores are an error here rather than downstream.
    """
    arr = np.asarray(scores, dtype=np.float32)
    if arr.shape != (batch,):
        raise ValueError(f"reward {name!r} returned shape {list(arr.shape)}, expected [{batch}]")
    if not np.isfinite(arr).all():
        raise ValueError(f"reward {name!r} returned non-finite scores: {arr.tolist()}")
    return arr


def to_uint8_images(x: torch.Tensor) -> np.ndarray:
    """Convert a float image tensor in [-1, 1] of shape [B, 3, H, W] to uint8 [B, H, W, 3].

    Values outside [-1, 1] are clipped (the VAE decoder overshoots slightly; that is normal),
    but NaN/inf raise: they mean the sample diverged and must not be scored as black pixels.
    """
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"expected a [B, 3, H, W] tensor, got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    x = x.detach()
    if not bool(x.isfinite().all()):
        raise ValueError("image tensor contains NaN or inf")
    # Map in float32 (bf16 cannot represent 255 steps exactly) and round to nearest, as
    # diffusers' image processor does, so x = -1 -> 0 and x = 1 -> 255.
    x = ((x.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(dtype=_torch_uint8(x))
    return x.permute(0, 2, 3, 1).contiguous().cpu().numpy()


def _torch_uint8(x: Any) -> Any:
    # Fetch torch.uint8 from the tensor's own module so this file never imports torch eagerly.
    return importlib.import_module(type(x).__module__.split(".")[0]).uint8


# --- registry -----------------------------------------------------------------------------------
# Built-ins resolve lazily: name -> "module:attr". Importing the module may also register the
# name itself (the lead's compositional module does); the registered factory then wins.
_BUILTIN: dict[str, str] = {
    "jpeg": "spotlight.rewards.jpeg:JpegCompressibility",
    "http": "spotlight.rewards.http:HttpReward",
    "compositional": "spotlight.rewards.compositional:CompositionalReward",
    "weighted": "spotlight.rewards.config:weighted_sum",
    "ocr": "spotlight.rewards.ocr:OcrReward",
}
_REGISTRY: dict[str, Callable[..., RewardFn]] = {}


def register_reward(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Decorator: make ``factory`` (a class or function returning a RewardFn) known as ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"reward name must be a non-empty str, got {name!r}")

    def decorator(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        old = _REGISTRY.get(name)
        # Re-running the same definition (module reload, `python -m` of a registering module)
        # is harmless; two different factories under one name is a bug worth stopping on.
        if old is not None and _qualname(old) != _qualname(factory):
            raise ValueError(f"reward {name!r} already registered by {_qualname(old)}")
        _REGISTRY[name] = factory
        return factory

    return decorator


def unregister_reward(name: str) -> None:
    """Forget a name :func:`register_reward` added (tests, notebooks re-defining a reward)."""
    if _REGISTRY.pop(name, None) is None:
        raise KeyError(f"reward {name!r} is not registered")


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def known_rewards() -> list[str]:
    """Every reward name :func:`make_reward` accepts, sorted."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def resolve_reward(name: str) -> Callable[..., RewardFn]:
    """The factory behind ``name``: a registered name, a built-in, or ``"module:attr"``.

    Imports the module that defines it but builds nothing. Raises ConfigError for an unknown
    name or an import path that does not import.
    """
    if ":" in name:
        return _import_path(name)
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name not in _BUILTIN:
        hint = "; an import path is written 'module:attribute'" if "." in name else ""
        raise ConfigError(f"unknown reward {name!r}; known rewards: {', '.join(known_rewards())}{hint}")
    module_name, _, attr = _BUILTIN[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but one of *its* imports is missing: show that
        raise ConfigError(f"reward {name!r}: module {module_name} is not available") from e
    if name in _REGISTRY:  # the module registered itself on import
        return _REGISTRY[name]
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"reward {name!r}: {module_name} has no attribute {attr!r}") from e


def _import_path(path: str) -> Callable[..., RewardFn]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(f"reward {path!r}: an import path is written 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user's module: any failure to import is a configuration problem
        raise ConfigError(f"reward {path!r}: cannot import {module_name} ({type(e).__name__}: {e}); "
                          f"is it installed or on PYTHONPATH in every process?") from e
    factory: Any = module
    for part in attr.split("."):  # "module:Class.method" reaches a nested attribute
        try:
            factory = getattr(factory, part)
        except AttributeError as e:
            raise ConfigError(f"reward {path!r}: {module_name} has no attribute {attr!r}") from e
    if not callable(factory):
        raise ConfigError(f"reward {path!r}: {attr} is a {type(factory).__name__}, not a factory "
                          f"(a class or function that returns a reward)")
    return factory


def check_arguments(name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise ConfigError if ``factory`` cannot be called with ``kwargs`` (an unknown or a missing
    argument), listing the arguments it accepts, without calling it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature; let the call decide
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        accepted = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        accepted_text = ", ".join(accepted) or "none"
        raise ConfigError(f"reward {name!r}: {e}; accepted arguments: {accepted_text}") from None


def make_reward(name: str, **kwargs: Any) -> RewardFn:
    """Build the reward ``name`` (registered, built-in or ``"module:attr"``) with ``kwargs``.

    Raises ConfigError for an unknown name (listing the known ones), for arguments the factory
    does not accept or misses (listing the ones it does), before the factory runs, and when the
    factory returns something that is not a reward.
    """
    factory = resolve_reward(name)
    check_arguments(name, factory, kwargs)
    reward = factory(**kwargs)
    if not isinstance(reward, RewardFn) or not isinstance(reward.name, str):
        raise ConfigError(f"reward {name!r}: the factory returned {type(reward).__name__}, not a reward "
                          f"(an object with a str `name` and `__call__(images, prompts)`)")
    return reward


# --- combinator ---------------------------------------------------------------------------------
class WeightedSum:
    """``sum_i w_i * reward_i(images, prompts)``: several rewards as one (e.g. GenEval + JPEG).

    ``evaluate`` also returns each term's scores so a worker can log the parts of the total.
    """

    def __init__(self, terms: Sequence[tuple[RewardFn, float]], name: str | None = None) -> None:
        if not terms:
            raise ConfigError("WeightedSum needs at least one (reward, weight) term")
        names = [r.name for r, _ in terms]
        if len(set(names)) != len(names):
            raise ConfigError(f"WeightedSum term names must be unique, got {names}")
        for r, w in terms:
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
                raise ConfigError(f"weight of reward {r.name!r} must be finite, got {w!r}")
        self.terms = [(r, float(w)) for r, w in terms]
        self.name = name or "+".join(f"{w:g}*{r.name}" for r, w in self.terms)

    def evaluate(
        self, images: np.ndarray, prompts: list[str]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Return (total float32 [B], {term name: its unweighted float32 [B] scores})."""
        check_batch(images, prompts)
        n = len(prompts)
        parts = {r.name: check_scores(r(images, prompts), n, r.name) for r, _ in self.terms}
        # Accumulate in float64 so the order of terms does not change the float32 result.
        total = np.zeros(n, dtype=np.float64)
        for r, w in self.terms:
            total += w * parts[r.name].astype(np.float64)
        return total.astype(np.float32), parts

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        return self.evaluate(images, prompts)[0]

    def columns(self, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(total [B], Σ_i w_i · term i's column credit [B, W]); see ``column_scores``."""
        check_batch(images, prompts)
        total = np.zeros(len(prompts), dtype=np.float64)
        maps = np.zeros(images.shape[:1] + images.shape[2:3], dtype=np.float64)
        for r, w in self.terms:
            scores, cols = column_scores(r, images, prompts)
            total += w * scores.astype(np.float64)
            maps += w * cols.astype(np.float64)
        return total.astype(np.float32), maps.astype(np.float32)

    def __repr__(self) -> str:
        return f"WeightedSum({self.name!r})"
