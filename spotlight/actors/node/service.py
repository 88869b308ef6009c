"""The node agent's process shell (``python -m spotlight.actors.node`` / ``spotlight agent``):
signals, argument parsing, logging; the agent itself is ``spotlight.actors.node.core``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from spotlight.actors.node.core import AgentConfig, NodeAgent
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
    p = argparse.ArgumentParser(prog="python -m spotlight.actors.node", description="Run a node agent.",
                                add_help=add_help)
    p.add_argument("--controller", required=True, help="tcp://HOST:PORT of the reserved side")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--kind", choices=["reserved", "spot"], default="spot")
    p.add_argument("--node-id", default="")
    p.add_argument("--metadata-url", default=None, help="spot-notice URL to poll (AWS or GCP form)")
    p.add_argument("--metadata-poll-s", type=float, default=2.0)
    p.add_argument("--queue-lost-s", type=float, default=30.0,
                   help="leave when the request queue has not answered for this long")
    p.add_argument("--rpc-timeout-s", type=float, default=10.0, help="reply timeout of every remote call")
    p.add_argument("--keys", default=None, help="folder with node.key_secret and controller.key (CURVE)")
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
    if os.environ.get("SPOTLIGHT_DIE_WITH_PARENT"):
        die_with_parent()  # spawned by a LocalRuntime: never outlive it
    config = AgentConfig(controller=args.controller, workers=args.workers, kind=args.kind, node_id=args.node_id,
                         metadata_url=args.metadata_url, metadata_poll_s=args.metadata_poll_s, queue_lost_s=args.queue_lost_s,
                         rpc_timeout_s=args.rpc_timeout_s, keys=args.keys)
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
