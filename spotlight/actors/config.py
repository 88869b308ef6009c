"""Every knob of the actor runtime, in one place: ``RuntimeConfig`` is the recipe's ``[runtime]``
section (lease, heartbeat, retries, store limits, timeouts, the leave budget, worker counts,
transport); ``ServeConfig`` is where a reserved node serves spot nodes on other hosts.

The process mains (``python -m spotlight.actors.<actor>``, ``spotlight agent``, ``spotlight
reserved``) build their command-line options from these dataclasses (``spotlight.actors.options``:
the field's type, default and docstring become the option), so no default is written twice.

A value derived from another (a share of the leave budget, a poll's slack) is a property here,
named and documented, never a literal at the place that uses it.

This module knows configuration only; the actors read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from spotlight.actors.queue.core import QueueConfig
from spotlight.actors.store.core import TensorStoreConfig
from spotlight.errors import ConfigError

_QUEUE, _STORE = QueueConfig(), TensorStoreConfig()  # the components' own defaults, not a copy
DELAYS = ("step_delay_s", "lend_delay_s", "borrow_delay_s")  # a modelled slow device: 0 is none


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """The actor runtime of one run (``run.mode = "runtime"``, ``spotlight reserved``/``agent``)."""

    transport: str = "ipc"
    """'ipc' (every actor on this machine) or 'tcp' (spot nodes on other hosts join;
    ``spotlight reserved`` sets it)."""
    reserved_workers: int = 1
    """Worker processes on the reserved node (0: it only trains; the work waits for spot nodes)."""
    spot_workers: int = 2
    """Local "spot" worker processes a one-machine run starts (its simulated spot node)."""
    lease_s: float = _QUEUE.lease_s
    """Lease length: a request whose worker sends no heartbeat for this long goes back to the queue."""
    heartbeat_s: float = 10.0
    """How often a node agent renews the lease of each running request (< lease_s)."""
    max_attempts: int = _QUEUE.max_attempts
    """Counted failures (expiries + fails) before a request is dead-lettered; releases don't count."""
    store_max_bytes: int = _STORE.max_bytes
    """Cap on the tensor bytes the store holds (commits, trajectories, weights)."""
    store_keep_versions: int = _STORE.keep_versions
    """Newest weights versions the store keeps (older, unpinned ones are dropped)."""
    rpc_timeout_s: float = 10.0
    """Reply timeout of a control call (agent to controller, queue and its workers)."""
    store_timeout_s: float = 30.0
    """Reply timeout of a tensor-store call, and of the controller's queue and store clients."""
    call_timeout_s: float = 60.0
    """Longest a trainer-side call on the controller's loop may take (publish, fetch, stats)."""
    batch_timeout_s: float = 3600.0
    """Longest the driver waits for one batch of work before it gives up."""
    request_timeout_s: float = 3600.0
    """Longest one request may run on a worker before the agent considers the worker hung."""
    pull_wait_s: float = 0.5
    """Long-poll length of a node agent's pull; also bounds how long a leaving agent waits for it."""
    leave_s: float = 2.0
    """A node's budget from a spot notice (SIGTERM, metadata) to exit: finish the step, flush the
    commit, release the leases, stop the workers, deregister."""
    explore_on: str = "any"
    """Which nodes' workers pull exploration requests: 'any', or 'spot' (reserved workers then
    serve rollouts only, and the reserved node's cores stay with the trainer while it updates)."""
    worker_versions: int = 2
    """Weights versions a worker keeps in memory, so alternating between a rollout at v_{i+1} and
    an exploration at v_i switches by a local copy instead of fetching from the store (>= 1)."""
    peer_weights: bool = True
    """A worker loading a weights version copies it from a worker of its node that holds it (the
    node agent names one; shared memory), so a node fetches each version from the store once, not
    once per worker; false: every worker fetches from the store (the baseline)."""
    peer_weights_s: float = 60.0
    """How long a worker waits for a peer to lend it a version (the peer's own load of it included)
    before fetching it from the store; also how long a lender keeps a segment whose borrower never
    said it had copied."""
    queue_lost_s: float = 30.0
    """A node agent whose queue has not answered for this long decides the reserved side is gone
    and leaves."""
    node_lost_s: float = 30.0
    """A node agent silent this long (no heartbeat to the controller: SIGKILLed, frozen, cut off)
    is declared lost: it leaves the registry (and the cost meter) as a preemption, and the leases
    its workers hold go back to the queue at once (not at their expiry, ``lease_s``)."""
    step_commits: bool = True
    """Workers commit a rollout's state after every denoising step, so a preempted request resumes
    from its last step elsewhere; false (the naive_spot baseline): one commit at the end only, and a
    preempted request restarts from scratch."""
    metadata_poll_s: float = 2.0
    """How often a node agent polls its spot-notice metadata URL (when it has one)."""
    service_start_s: float = 60.0
    """Longest the queue, the store and the controller's loop may take to be ready."""
    worker_start_s: float = 120.0
    """Longest a worker process may take to be ready (import torch, build the model)."""
    agent_start_s: float = 300.0
    """Longest a local node agent may take to be ready (its workers start in parallel)."""
    stop_grace_s: float = 10.0
    """Shutdown: how long agents, services and the controller's loop get between the stop
    request (SIGTERM) and SIGKILL."""
    sp_degree: int = 1
    """Sequence-parallel degree: a node agent runs each request on a group of this many of its
    workers (Ulysses attention over a per-group communicator, ``spotlight.actors.node.sp``); 1 is
    one worker per request. Must divide model.heads and the image tokens, and be at most the
    workers of every node."""
    sp_timeout_s: float = 5.0
    """Timeout of one collective inside an SP group: a member stuck on a hung (alive) peer gives up
    after this long, and is killed if it is still stuck ``sp_release_s`` after its group broke."""
    sp_regroup: bool = True
    """A broken SP group (a member lost) re-forms at a new epoch with its surviving processes (same
    weights, nothing reloaded) and the node's idle workers; false (the cold-restart baseline): every
    member told to leave a broken group is restarted (process, model reloaded from storage) before
    it serves again."""
    step_delay_s: float = 0.0
    """Model a slower device (benches, fault tests): a worker waits this long after every denoising
    step it computes, so a notice or a kill lands mid-request (0: no wait)."""
    lend_delay_s: float = 0.0
    """Model a slow lender (benches, fault tests): a worker asked to lend a weights version waits
    this long before it answers (0: no wait)."""
    borrow_delay_s: float = 0.0
    """Model a slow borrower (benches, fault tests): a worker holds a lent weights version this long
    after copying it before it says so (0: no wait)."""

    def __post_init__(self) -> None:
        if self.transport not in ("ipc", "tcp"):
            raise ConfigError(f"runtime.transport must be 'ipc' or 'tcp', got {self.transport!r}")
        for name in ("reserved_workers", "spot_workers"):  # 0 reserved: a train-only reserved node
            if getattr(self, name) < 0:
                raise ConfigError(f"runtime.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ConfigError(f"runtime.max_attempts must be >= 1, got {self.max_attempts}")
        if self.store_max_bytes <= 0:
            raise ConfigError(f"runtime.store_max_bytes must be > 0, got {self.store_max_bytes}")
        if self.store_keep_versions < 1:
            raise ConfigError(f"runtime.store_keep_versions must be >= 1, got {self.store_keep_versions}")
        for name in DELAYS:
            if not getattr(self, name) >= 0:
                raise ConfigError(f"runtime.{name} must be >= 0 seconds, got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and f.name not in DELAYS and not getattr(self, f.name) > 0:
                raise ConfigError(f"runtime.{f.name} must be > 0 seconds, got {getattr(self, f.name)}")
        if not self.heartbeat_s < self.node_lost_s:
            raise ConfigError(f"runtime.heartbeat_s must be < runtime.node_lost_s ({self.node_lost_s}), "
                              f"got {self.heartbeat_s}")
        if self.explore_on not in ("any", "spot"):
            raise ConfigError(f"runtime.explore_on must be 'any' or 'spot', got {self.explore_on!r}")
        if self.worker_versions < 1:
            raise ConfigError(f"runtime.worker_versions must be >= 1, got {self.worker_versions}")
        if not self.heartbeat_s < self.lease_s:
            raise ConfigError(f"runtime.heartbeat_s must be < runtime.lease_s ({self.lease_s}), "
                              f"got {self.heartbeat_s}")
        if self.sp_degree < 1:
            raise ConfigError(f"runtime.sp_degree must be >= 1, got {self.sp_degree}")
        for name in ("reserved_workers", "spot_workers"):  # 0: no such node
            self.check_node_workers(getattr(self, name), f"runtime.{name}")

    def check_node_workers(self, workers: int, what: str) -> None:
        """A node with ``workers`` workers (0: none runs) can form groups of ``sp_degree``."""
        if 0 < workers < self.sp_degree:
            raise ConfigError(f"runtime.sp_degree ({self.sp_degree}) is more than the workers a node "
                              f"has ({what} = {workers})")

    # --- derived values ------------------------------------------------------------------------
    @property
    def worker_stop_s(self) -> float:
        """Leaving: a busy worker's time to finish its step and flush its commit (60% of leave_s)."""
        return 0.6 * self.leave_s

    @property
    def worker_kill_s(self) -> float:
        """Leaving: a worker's time from SIGTERM to SIGKILL (20% of leave_s)."""
        return 0.2 * self.leave_s

    @property
    def sp_release_s(self) -> float:
        """SP groups: how long a member of a broken group may take to come out of its collective
        before the agent kills it (two collective timeouts)."""
        return 2 * self.sp_timeout_s

    @property
    def sp_stall_s(self) -> float:
        """SP groups: a group whose first rank commits no step for this long is broken (a hung
        member the collectives' timeout did not catch): the request timeout, at most a lease."""
        return min(self.request_timeout_s, self.lease_s)

    @property
    def deregister_s(self) -> float:
        """Leaving: the reply timeout of the goodbye to the controller (15% of leave_s; the three
        shares leave 5% of the budget for the process to exit)."""
        return 0.15 * self.leave_s

    @property
    def pull_return_s(self) -> float:
        """Leaving: how long the agent waits for its in-flight long polls to come back (one
        pull_wait_s plus a tenth of a reply timeout)."""
        return self.pull_wait_s + self.rpc_timeout_s / 10

    @property
    def node_sweep_s(self) -> float:
        """How often the controller looks for silent nodes (a quarter of node_lost_s): a node that
        stopped beating is declared lost within 1.25 x node_lost_s."""
        return self.node_lost_s / 4

    @property
    def node_beat_s(self) -> float:
        """How often a node agent beats to the controller: every heartbeat_s, but at least five
        times per node_lost_s, so a live node is declared lost only after five beats in a row went
        missing (a beat or two delayed on a loaded machine never add up to it)."""
        return min(self.heartbeat_s, self.node_lost_s / 5)

    @property
    def metadata_timeout_s(self) -> float:
        """HTTP timeout of one metadata poll (the poll period, at most one second)."""
        return min(1.0, self.metadata_poll_s)

    def queue(self) -> QueueConfig:
        """The request queue's config."""
        return QueueConfig(lease_s=self.lease_s, max_attempts=self.max_attempts)

    def store(self) -> TensorStoreConfig:
        """The tensor store's config."""
        return TensorStoreConfig(max_bytes=self.store_max_bytes, keep_versions=self.store_keep_versions)

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)


DEFAULTS = RuntimeConfig()
"""The defaults, for a client built outside a run (tests, tools); a run passes its own values."""

NODE_FIELDS = ("rpc_timeout_s", "store_timeout_s", "request_timeout_s", "pull_wait_s", "leave_s",
               "queue_lost_s", "metadata_poll_s", "worker_start_s")
"""The ``RuntimeConfig`` fields a node agent may set for itself on its command line; every other
field, and these when not given, come from the run's ``[runtime]`` (sent at registration)."""


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """Where the reserved side serves when spot nodes on other hosts join (``runtime.transport =
    "tcp"``; ``spotlight reserved``)."""

    host: str = "0.0.0.0"
    """Interface the queue, the tensor store and the controller bind (default: all)."""
    port: int = 5555
    """Controller port spot nodes connect to (0: any free port)."""
    advertise: str | None = None
    """Host name or IP spot nodes reach this node by (default: the host, or this machine's address)."""
    keys: str | None = None
    """CURVE folder: controller.key_secret + nodes/*.key; every reserved socket then authenticates."""
    queue_port: int = 0
    """Request-queue port (0: any free port; fix it where a firewall or a Kubernetes Service names it)."""
    store_port: int = 0
    """Tensor-store port (0: any free port; fix it where a firewall or a Kubernetes Service names it)."""

    def __post_init__(self) -> None:
        for name in ("port", "queue_port", "store_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
