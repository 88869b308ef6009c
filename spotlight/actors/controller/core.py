"""The controller: the reserved side's node registry and the Loop's executor over the runtime.

- ``ControllerCore``: which nodes are registered; answers a node's Register with the queue and
  tensor-store addresses, the lease length and the recipe, whose ``runtime`` section holds every
  runtime knob (so a spot node needs only the controller's address). ``controller_handlers``
  is its message API.
- ``Controller``: the async shell: the controller's ``RpcServer`` plus open queue and store
  clients (CURVE on both sides when keys are given).
- ``BackgroundLoop``: the trainer (``Loop``) is synchronous torch code on the main thread, so the
  controller's sockets live on an asyncio loop in one background thread; ``submit`` hands it a
  coroutine (``call`` also waits for the result), and ``fail`` makes every call raise at once
  when a supervisor sees an actor die.
- ``RuntimeExecutor``: the ``loop.Executor`` over the queue: one request per job (a job is one
  batch, never split, so samples are bit-identical to the in-process reference), wait for the
  batch, read trajectories from the store and build ``Group``s in job order; ``publish`` puts
  the trainer's ``state_dict`` into the store as an immutable weights version.

This module knows requests, weights versions and groups; the queue's rules, the store's and the
workers' math live in their own modules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from spotlight.comm import messages as m
from spotlight.errors import ProtocolError
from spotlight.recipe import Recipe

log = logging.getLogger(__name__)


class ControllerCore:
    """The node registry; ``queue``/``store`` are the addresses nodes are told to use. A node
    learns the run's runtime knobs (``[runtime]``: lease, heartbeat, timeouts) from the recipe."""

    def __init__(self, recipe: Recipe, queue: str, store: str) -> None:
        self.recipe_dict = recipe.to_dict()
        self.queue, self.store, self.lease_s = queue, store, recipe.runtime.lease_s
        self.nodes: dict[str, dict[str, Any]] = {}
        self.left: list[dict[str, Any]] = []

    def register(self, msg: m.Register) -> m.Registered:
        if not msg.node_id or msg.workers < 1:
            raise ProtocolError(
                f"Register needs a node_id and workers >= 1, got {msg.node_id!r}, {msg.workers}"
            )
        if msg.node_id in self.nodes:
            log.warning("node %s registered again (restarted?)", msg.node_id)
        self.nodes[msg.node_id] = {"kind": msg.kind, "workers": msg.workers, "since": time.time()}
        log.info("node %s (%s, %d workers) registered", msg.node_id, msg.kind, msg.workers)
        return m.Registered(
            node_id=msg.node_id,
            queue=self.queue,
            store=self.store,
            lease_s=self.lease_s,
            recipe=self.recipe_dict,
        )

    def deregister(self, msg: m.Deregister) -> m.Ok:
        node = self.nodes.pop(msg.node_id, None)
        if node is not None:
            self.left.append({"node_id": msg.node_id, "reason": msg.reason, **node})
        return m.Ok()


def controller_handlers(core: ControllerCore) -> dict[type[m.Message], Callable[[Any], Any]]:
    return {m.Register: core.register, m.Deregister: core.deregister}
