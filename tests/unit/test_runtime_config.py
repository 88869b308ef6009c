"""One place for every runtime knob: ``RuntimeConfig`` is the recipe's documented ``[runtime]``,
process mains take their options from the config dataclasses (no second copy of a default),
overrides may follow options on the command line, and the controller's ``BackgroundLoop`` fails
every pending and later call at once when told an actor died (or when it dies itself)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import tomllib

import pytest

from spotlight.actors.config import DEFAULTS, NODE_FIELDS, RuntimeConfig, ServeConfig
from spotlight.actors.controller.service import BackgroundLoop
from spotlight.actors.node.service import build_parser as agent_parser
from spotlight.actors.node.session import AgentConfig
from spotlight.actors.options import add_options, field_docs, given, to_argv
from spotlight.actors.queue.core import QueueConfig
from spotlight.actors.store.core import TensorStoreConfig
from spotlight.cli import parse_args
from spotlight.errors import ActorDead, ActorTimeout, ConfigError
from spotlight.recipe import RECIPES_DIR, load_recipe


def test_every_field_is_documented_and_in_the_shipped_recipe():
    docs = field_docs(RuntimeConfig)
    names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert names == set(docs) and all(docs.values())
    shipped = tomllib.loads((RECIPES_DIR / "tiny.toml").read_text())["runtime"]
    assert set(shipped) == names  # tiny.toml documents the whole section
    assert load_recipe("tiny", ["runtime.lease_s=5", "runtime.heartbeat_s=1"]).runtime.lease_s == 5


def test_the_components_configs_come_from_it():
    rt = RuntimeConfig(lease_s=4.0, heartbeat_s=1.0, max_attempts=5, store_max_bytes=1 << 20,
                       store_keep_versions=3)
    assert rt.queue() == QueueConfig(lease_s=4.0, max_attempts=5)
    assert rt.store() == TensorStoreConfig(max_bytes=1 << 20, keep_versions=3)
    # one default, owned by the component: the runtime reads it instead of copying it
    assert (DEFAULTS.lease_s, DEFAULTS.max_attempts) == (QueueConfig().lease_s, QueueConfig().max_attempts)
    assert DEFAULTS.store_max_bytes == TensorStoreConfig().max_bytes


def test_the_leave_budget_is_shared_not_exceeded():
    rt = RuntimeConfig(leave_s=3.0)
    assert rt.worker_stop_s + rt.worker_kill_s + rt.deregister_s < rt.leave_s


@pytest.mark.parametrize("change, field", [
    ({"heartbeat_s": 30.0}, "runtime.heartbeat_s"), ({"rpc_timeout_s": 0}, "runtime.rpc_timeout_s"),
    ({"transport": "udp"}, "runtime.transport"), ({"spot_workers": -1}, "runtime.spot_workers"),
    ({"step_delay_s": -0.1}, "runtime.step_delay_s"),
    ({"lend_delay_s": float("nan")}, "runtime.lend_delay_s"),
])
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RuntimeConfig(**change)


def test_service_options_rebuild_the_config():
    parser = argparse.ArgumentParser()
    add_options(parser, QueueConfig)
    assert parser.parse_args([]).lease_s == QueueConfig().lease_s  # the dataclass's default, not a copy
    config = QueueConfig(lease_s=2.5, max_attempts=7)
    assert QueueConfig(**given(parser.parse_args(to_argv(config)), QueueConfig)) == config
    assert "heartbeat" in parser.format_help()  # the field's docstring is the help


def test_agent_options_are_its_config_and_the_nodes_runtime_fields():
    args = agent_parser().parse_args(["--controller", "ipc:///x", "--leave-s", "3", "--workers", "2"])
    config = AgentConfig(**given(args, AgentConfig), runtime=given(args, RuntimeConfig, NODE_FIELDS))
    assert (config.controller, config.workers, config.kind) == ("ipc:///x", 2, "spot")
    assert config.runtime == {"leave_s": 3.0}  # the rest comes from the run's [runtime] at registration
    with pytest.raises(ConfigError, match="lease_s"):
        AgentConfig(controller="ipc:///x", runtime={"lease_s": 1.0})  # a run-wide knob, not a node's


@pytest.mark.parametrize("argv, overrides", [
    (["reserved", "tiny", "--port", "5599", "run.iterations=12"], ["run.iterations=12"]),
    (["reserved", "tiny", "run.iterations=12", "--port", "5599"], ["run.iterations=12"]),
    (["reserved", "tiny", "a.b=1", "--port", "5599", "c.d=2"], ["a.b=1", "c.d=2"]),
])
def test_overrides_may_stand_before_or_after_options(argv, overrides):
    args = parse_args(argv)
    assert args.overrides == overrides and args.port == 5599 and args.host == ServeConfig().host


def test_unknown_words_are_still_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["reserved", "tiny", "--port", "5599", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# --- BackgroundLoop ---------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def crashable():
    """A loop main whose ``crash`` event, once set, kills the loop (as a failed server task would)."""
    crash = asyncio.Event()

    async def crash_when_told() -> None:
        await crash.wait()
        raise RuntimeError("boom")

    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(crash_when_told())
        try:
            yield crash
        finally:  # leaving: the server task ends (else the group waits for it and close times out)
            task.cancel()


@pytest.fixture
def bg():
    loop = BackgroundLoop(crashable, start_timeout=10)
    yield loop
    loop.close(10)
    assert not loop._thread.is_alive(), "close() left the loop's thread running"


def test_submit_returns_at_once_and_call_waits(bg):
    gate = threading.Event()

    async def wait_for_gate() -> str:
        await asyncio.to_thread(gate.wait, 10)
        return "done"

    fut = bg.submit(wait_for_gate())
    assert not fut.done()
    gate.set()
    assert fut.result(10) == "done"
    assert bg.call(asyncio.sleep(0, "x"), timeout=10) == "x"
    with pytest.raises(ActorTimeout):
        bg.call(asyncio.sleep(3600), timeout=0.05)


def test_fail_fails_pending_and_later_calls_at_once(bg):
    pending = bg.submit(asyncio.sleep(3600))
    dead = ActorDead("queue (pid 1) exited with status -9 (SIGKILL)")
    bg.fail(dead)
    with pytest.raises(ActorDead, match="queue"):
        pending.result(0)  # already failed: no wait
    with pytest.raises(ActorDead, match="queue"):
        bg.call(asyncio.sleep(0), timeout=3600)
    bg.fail(ActorDead("later"))  # the first failure sticks
    assert bg.failure is dead


def test_a_dead_loop_fails_the_next_call_at_once(bg):
    pending = bg.submit(asyncio.sleep(3600))
    bg.loop.call_soon_threadsafe(bg.value.set)  # the loop's main task fails
    with pytest.raises(ActorDead, match="controller loop failed"):
        pending.result(10)
    with pytest.raises(ActorDead):
        bg.call(asyncio.sleep(0), timeout=3600)


def test_a_cancelled_handle_cancels_its_coroutine(bg):
    started, cancelled = threading.Event(), threading.Event()

    async def long() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = bg.submit(long())
    assert started.wait(10)
    fut.cancel()
    assert cancelled.wait(10)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(0)
