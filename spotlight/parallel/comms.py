"""Communicators per membership epoch: one persistent rendezvous store, a fresh process group per
(epoch, membership), every collective under an explicit timeout.

The node agent (persistent, outlives its workers) hosts one `TCPStore`. A group of workers that
forms at epoch e meets under the key prefix "sp/e/" of that store and builds a process group
object directly (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on GPU), never the global default
group: rebuilding a group after a member died is then "drop the old object, build a new one",
with no `destroy_process_group` on a group whose peer is gone, and no process restart.

Why explicit timeouts: a gloo collective whose peer was SIGKILLed usually fails at once
("Connection closed by peer"), but a peer that is alive and stuck (SIGSTOP, a hung kernel) would
hold the survivors for torch's default 30 minutes. Here every collective gives up after
`timeout_s`.

This module knows torch.distributed stores and process groups; nothing of models or schedulers.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from spotlight.errors import ConfigError


def host_store(port: int = 0, timeout_s: float = 10.0) -> dist.TCPStore:
    """The node agent's rendezvous store (port 0 = any free port; read `.port`)."""
    return dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class Communicators:
    """A worker's side: one connection to the agent's store, a new group per epoch."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 5.0, backend: str = "gloo") -> None:
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"sp backend must be 'gloo' or 'nccl', got {backend!r}")
        if timeout_s <= 0:
            raise ConfigError(f"runtime.sp_timeout_s must be > 0, got {timeout_s}")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend
        self.store = dist.TCPStore(host, port, None, False, self.timeout)
        self.group: dist.ProcessGroup | None = None
        self.epoch: int | None = None

    def open(self, epoch: int, rank: int, size: int) -> dist.ProcessGroup:
        """The group of membership epoch `epoch`; the previous one is dropped (not destroyed: its
        peers may be dead, and dropping the object closes its connections)."""
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} outside a group of {size}")
        self.group = None
        store = dist.PrefixStore(f"sp/{epoch}/", self.store)
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            # torch 2.13 has no public setter for a directly built NCCL group's timeout: Options
            # exposes it only as `_timeout` (torch's own new_group sets it the same way), and the
            # public `new_group(timeout=)` needs the global default group an elastic group avoids.
            opts._timeout = self.timeout
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        self.group, self.epoch = group, epoch
        return group

    def close(self) -> None:
        self.group = None
