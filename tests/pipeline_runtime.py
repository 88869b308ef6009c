"""A real runtime serving a tiny diffusers pipeline, for the pipeline fault tests
(`from pipeline_runtime import serving`; tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import contextlib

import pytest

from spotlight.actors.procs import alive
from spotlight.actors.runtime import LocalRuntime
from spotlight.pipelines.text import publish_prompts


@contextlib.contextmanager
def serving(recipe, model, prompts: list[str]):
    """A `LocalRuntime` of `recipe` (its processes one thread each) with `model`'s weights
    published as version 0 and `prompts`' embeddings put in its store, as the runtime's executor
    does before a rollout. On exit every process it started must be gone."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        with LocalRuntime(recipe) as rt:
            rt.call(rt.store.publish_weights(0, {k: v.numpy() for k, v in model.state_dict().items()}))
            rt.call(publish_prompts(rt.store, model, prompts, set()))
            yield rt
            pids = rt.pids()
    assert [p for p in pids if alive(p)] == []
