"""JPEG compressibility, the reward of DDPO (Black et al., 2023): smaller files score higher.

Each image is JPEG-encoded with PIL at a fixed quality; the score is minus the file size in kB
(1 kB = 1000 bytes, as DDPO's ``jpeg_compressibility``). Flat, low-detail images compress well
and score high; noise scores low. The score ignores the prompt.

With ``normalize=True`` the score is instead minus the compressed size as a fraction of the raw
RGB size (``H * W * 3`` bytes), so runs at different resolutions report comparable numbers.

This module knows PIL and numpy; nothing of models or actors.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from spotlight.errors import ConfigError
from spotlight.rewards.base import check_batch

__all__ = ["JpegCompressibility", "JpegConfig", "jpeg_size_bytes"]


@dataclass(kw_only=True, slots=True, frozen=True)
class JpegConfig:
    """Settings of the JPEG compressibility reward."""

    quality: int = 95
    """JPEG quality passed to PIL, 1..95 (PIL warns that above 95 only grows files)."""

    normalize: bool = False
    """False: score = -kB (DDPO). True: score = -(compressed bytes / raw RGB bytes)."""

    def __post_init__(self) -> None:
        if isinstance(self.quality, bool) or not isinstance(self.quality, int):
            raise ConfigError(f"jpeg.quality must be an int in 1..95, got {self.quality!r}")
        if not 1 <= self.quality <= 95:
            raise ConfigError(f"jpeg.quality must be in 1..95, got {self.quality}")
        if not isinstance(self.normalize, bool):
            raise ConfigError(f"jpeg.normalize must be a bool, got {self.normalize!r}")


def jpeg_size_bytes(image: np.ndarray, quality: int) -> int:
    """Size in bytes of ``image`` (uint8 [H, W, 3]) encoded as JPEG at ``quality``."""
    buf = io.BytesIO()
    # uint8 [H, W, 3] is read as RGB. Fixed encoder options (no optimize pass, default 4:2:0
    # subsampling) keep the score a pure function of the pixels: same image, same reward.
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.tell()


class JpegCompressibility:
    """Reward = -(JPEG size in kB), or the normalised variant; see the module docstring."""

    name = "jpeg"

    def __init__(self, config: JpegConfig | None = None, *, quality: int | None = None,
                 normalize: bool | None = None) -> None:
        # Accept either a ready config or its fields as keywords, so that both
        # JpegCompressibility(cfg) and make_reward("jpeg", quality=90) work.
        if config is not None and (quality is not None or normalize is not None):
            raise ConfigError("pass either a JpegConfig or quality/normalize, not both")
        if config is None:
            fields = {k: v for k, v in (("quality", quality), ("normalize", normalize))
                      if v is not None}
            config = JpegConfig(**fields)
        self.config = config

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        check_batch(images, prompts)
        sizes = np.array([jpeg_size_bytes(img, self.config.quality) for img in images],
                         dtype=np.float64)
        if self.config.normalize:
            raw = float(images.shape[1] * images.shape[2] * 3)
            return (-sizes / raw).astype(np.float32)
        return (-sizes / 1000.0).astype(np.float32)

    def __repr__(self) -> str:
        return f"JpegCompressibility({self.config})"
