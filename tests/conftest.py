"""Shared fixtures: a tiny model that runs in milliseconds, single-threaded torch for stable timing."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)  # 2-core CI machine: oversubscribed intra-op threads crawl


@pytest.fixture
def tiny_cfg():
    from spotlight.models.dit import ModelConfig

    return ModelConfig(checkpoint=None, layers=1, heads=2, head_dim=16, image_size=16, patch=4, text_dim=32,
                       text_layers=1)


@pytest.fixture
def tiny_model(tiny_cfg):
    from spotlight.data.scenes import VOCABULARY
    from spotlight.models.dit import build_model

    torch.manual_seed(0)
    return build_model(tiny_cfg, VOCABULARY)
