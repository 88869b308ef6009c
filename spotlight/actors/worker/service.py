"""The GPU worker's process shell (``python -m spotlight.actors.worker``): an ipc ``RpcServer``
its node agent drives with WorkerRun / WorkerStatus / WorkerStop / WorkerLeave, in front of a
``WorkerCore``; the node's other workers call it too, to borrow weights (LendWeights /
WeightsReturned, ``spotlight.actors.worker.peers``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from typing import Any

import torch

from spotlight.actors.procs import announce_ready, die_with_parent
from spotlight.actors.store.client import TensorStoreClient
from spotlight.actors.worker.core import WorkerCore
from spotlight.comm import messages as m
from spotlight.comm.auth import cluster_client_keys
from spotlight.comm.transport import RpcServer
from spotlight.errors import ConfigError
from spotlight.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)


def worker_handlers(core: WorkerCore) -> dict[type[m.Message], Any]:
    async def run(msg: m.WorkerRun) -> m.WorkerResult:
        result = await core.run(msg.lease, msg.group, msg.peer)
        return m.WorkerResult(request_id=msg.lease.request_id, attempt=msg.lease.attempt, result=result)

    def leave(msg: m.WorkerLeave) -> m.Ok:
        core.sp.leave(msg.epoch)
        return m.Ok()

    def cancel(msg: m.WorkerCancel) -> m.Ok:
        core.cancel(msg.request_id, msg.attempt)
        return m.Ok()

    def returned(msg: m.WeightsReturned) -> m.Ok:
        core.weights_returned(msg.token)
        return m.Ok()

    return {m.WorkerRun: run, m.WorkerStatus: lambda msg: core.progress(),
            m.WorkerStop: lambda msg: core.stop(), m.WorkerLeave: leave, m.WorkerCancel: cancel,
            m.LendWeights: lambda msg: core.lend_weights(msg.version), m.WeightsReturned: returned}


async def serve(bind: str, store: str, recipe: Recipe, worker_id: str, keys: str | None = None,
                log_dir: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    curve = cluster_client_keys(keys) if keys else None
    async with TensorStoreClient.remote(store, timeout=recipe.runtime.store_timeout_s, curve=curve) as client:
        core = WorkerCore(recipe, client, worker_id=worker_id, log_dir=log_dir)
        try:
            async with RpcServer(worker_handlers(core), bind=bind) as server:
                announce_ready(f"ready {server.endpoint}")  # the agent waits for this line
                await stop.wait()
                try:  # SIGTERM is a notice too: finish the step, flush, then leave
                    await core.stop()
                except TimeoutError:
                    log.warning("worker stop: the running step did not finish in time")
        finally:
            core.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spotlight.actors.worker",
                                     description="Serve a GPU worker (the run's recipe, [runtime] "
                                                 "included, comes from the node agent).")
    parser.add_argument("--bind", required=True, help="ipc:///path the node agent connects to")
    parser.add_argument("--store", required=True, help="tensor store endpoint")
    parser.add_argument("--recipe-json", required=True, help="the run's recipe as JSON (Recipe.to_dict())")
    parser.add_argument("--worker-id", default="worker")
    parser.add_argument("--keys", default=None, help="the node's CURVE folder (for the tensor store)")
    parser.add_argument("--log-dir", default=None,
                        help="the node's log folder: steps.log and weights.log are appended to there")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    die_with_parent()
    torch.set_num_threads(1)  # one worker = one device; on CPU, one core's worth
    logging.basicConfig(level=args.log_level, format="%(asctime)s worker %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(args.bind, args.store, load_recipe(json.loads(args.recipe_json)), args.worker_id,
                          args.keys, args.log_dir))
    except ConfigError as e:  # e.g. kept versions that do not fit the device: the agent's one line
        print(f"error {e}", flush=True)
        print(f"worker: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
