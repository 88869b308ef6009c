"""Shared fixtures: a tiny model that runs in milliseconds, single-threaded torch for stable
timing, and actor processes started by their readiness line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
import torch

torch.set_num_threads(1)  # 2-core CI machine: oversubscribed intra-op threads crawl


# Set by the tools themselves, not by a test: pytest's phase marker, and torch's inductor, which
# writes its default cache folder into the environment the first time it is asked for it.
# On the GPU image (H200, 2026-11-30) a library the CUDA paths load sets the two KMP_ variables.
# opencv-python (under the OCR reward's rapidocr) sets its library and Qt paths on first import.
_ENV_SET_BY_TOOLS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                    "KMP_INIT_AT_FORK", "LD_LIBRARY_PATH", "QT_QPA_FONTDIR", "QT_QPA_PLATFORM_PLUGIN_PATH"}


def _global_state() -> tuple[dict, set]:
    from spotlight.rewards import base

    return dict(os.environ), set(base._REGISTRY)


def _assert_unchanged(before: tuple[dict, set], who: str) -> None:
    from spotlight.rewards import base

    (env, rewards), (env_now, rewards_now) = before, _global_state()
    leaked_env = {k for k in env.keys() | env_now.keys() if env.get(k) != env_now.get(k)}
    leaked_env -= _ENV_SET_BY_TOOLS
    # a built-in module registering its own name on first import is no leak
    leaked_rewards = (rewards ^ rewards_now) - base._BUILTIN.keys()
    assert not leaked_env, f"{who} changed environment variables {sorted(leaked_env)}"
    assert not leaked_rewards, f"{who} left registered rewards {sorted(leaked_rewards)}"


@pytest.fixture(autouse=True)
def no_leaked_global_state():
    """Every test leaves the environment and the reward registry as it found them: set variables
    with ``monkeypatch.setenv``, register rewards in a fixture that unregisters them."""
    before = _global_state()
    yield
    _assert_unchanged(before, "test")


@pytest.fixture(scope="module", autouse=True)
def no_leaked_module_state():
    """The same for a module's module-scoped fixtures (set up after this one, torn down before)."""
    before = _global_state()
    yield
    _assert_unchanged(before, "module fixture")


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
        pipe = asyncio.subprocess.PIPE
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", module, *args,
                                                    stdout=pipe, stderr=pipe)
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


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """``tiny_pipeline_dir(family)``: that family's tiny diffusers pipeline folder (`spotlight
    make-pipeline`), built once per session."""
    built = {}

    def get(family: str):
        if family not in built:
            from spotlight.pipelines.tiny import make_pipeline

            built[family] = make_pipeline(family, tmp_path_factory.mktemp(family) / "pipe")
        return built[family]

    return get
