"""The node agent's process shell (``python -m spotlight.actors.node`` / ``spotlight agent``):
signals, argument parsing, logging; the agent itself is ``spotlight.actors.node.core``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from spotlight.actors.config import NODE_FIELDS, RuntimeConfig
from spotlight.actors.node.core import NodeAgent
from spotlight.actors.node.session import AgentConfig
from spotlight.actors.options import add_options, given
from spotlight.actors.procs import die_with_parent
from spotlight.errors import (
    ActorTimeout,
    SpotlightError,
)


# --- process shell ---------------------------------------------------------------------------------
async def serve(config: AgentConfig) -> None:
    notice = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGTERM is how clouds deliver a spot notice
        loop.add_signal_handler(sig, notice.set)
    agent = NodeAgent(config)
    await agent.run(notice)
    if agent.lost is not None:
        raise ActorTimeout(agent.lost)


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """Options from ``AgentConfig`` and from the ``RuntimeConfig`` fields a node may set for
    itself (``NODE_FIELDS``; not given: the run's ``[runtime]`` value, sent at registration)."""
    p = argparse.ArgumentParser(prog="python -m spotlight.actors.node", description="Run a node agent.",
                                add_help=add_help)
    add_options(p, AgentConfig, skip=("runtime",))
    add_options(p, RuntimeConfig, only=NODE_FIELDS, unset="default: the run's [runtime] value")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return run_from_args(build_parser().parse_args(argv))
    except SpotlightError as e:
        print(f"node agent: error: {e}", file=sys.stderr)
        return 2


def run_from_args(args: argparse.Namespace) -> int:
    """Run an agent from parsed ``build_parser`` arguments (also ``spotlight agent``)."""

    logging.basicConfig(level=args.log_level, format="%(asctime)s agent %(name)s %(levelname)s %(message)s")
    die_with_parent(only_if_asked=True)  # spawned by a LocalRuntime: never outlive it
    config = AgentConfig(**given(args, AgentConfig), runtime=given(args, RuntimeConfig, NODE_FIELDS))
    asyncio.run(serve(config))
    return 0

if __name__ == "__main__":
    sys.exit(main())
