"""Shared fixtures: a tiny model that runs in milliseconds, single-threaded torch for stable
timing, and actor processes started by their readiness line."""

from __future__ import annotations

import asyncio
import signal
import sys

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


@pytest.fixture
async def spawn():
    """``await spawn(module, *args, ready=PREFIX)``: start ``python -m module args``, wait for its
    readiness line (an event, bounded), return (process, the line's last word: its endpoint).
    Whatever is still running at teardown gets SIGTERM, then SIGKILL."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(module: str, *args: str, ready: str, timeout: float = 60.0):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", module, *args,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        procs.append(proc)
        async with asyncio.timeout(timeout):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith(ready), (line, (await proc.stderr.read()).decode()[-2000:])
        return proc, line.split()[-1]

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
