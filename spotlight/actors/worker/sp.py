"""A worker's side of a sequence-parallel group: the one thing that changes when a worker runs a
rollout as rank r of a group of d instead of alone.

``SpRank`` is held by ``WorkerCore``. For a request handed with an ``SpGroup`` (epoch, rank, size,
the agent's rendezvous port) ``async with rank.joined(group)`` opens the epoch's communicator
(``spotlight.parallel.comms``: a fresh gloo/NCCL group on the agent's store, every collective
under ``runtime.sp_timeout_s``) and plugs Ulysses attention into the worker's DiT
(``spotlight.parallel.ulysses``); leaving the block restores the plain DiT and drops the
communicator. Nothing is reloaded: the next group, after a regroup, is a new epoch on the same
process and the same weights.

Inside a group every denoising step runs on one persistent compute thread (``rank.compute``), so
the worker's event loop still answers status, stop and leave while a step waits in a collective
on a dead or hung peer; the collective fails when the peer's sockets close (a SIGKILL) or after
the timeout (a hung peer), and the step raises ``GroupBroken`` (``WorkerCore``). A worker running
a rollout alone computes on the loop's thread.

The agent breaks a group with ``WorkerLeave(epoch)``, and a spot notice stops a worker
(``WorkerStop``); either reaches the ranks of a group at slightly different times, so before
every step the ranks agree (``rank.agree``: one one-integer all-reduce) whether any of them must
stop, and all stop at the same step boundary instead of leaving one rank waiting in the next
step's collective.

Knows communicators and the DiT's processor; nothing of queues, leases or the store.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from spotlight.comm import messages as m
from spotlight.errors import GroupBroken

T = TypeVar("T")


class SpRank:
    """``warm``: this worker will run in groups (``runtime.sp_degree`` > 1), so the compute thread
    and the SP modules are made ready now, at start-up, not in a regroup's critical path (a spare's
    first group once spent ~0.1 s importing them)."""

    def __init__(self, model, timeout_s: float, warm: bool = False) -> None:
        self.model, self.timeout_s = model, timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._comms = None  # spotlight.parallel.comms.Communicators, per rendezvous port
        self._group = None  # the open epoch's process group
        self._left: set[int] = set()
        if warm:
            import diffusers.models.attention_dispatch  # noqa: F401 - the processor's lazy imports
            import diffusers.models.transformers.transformer_qwenimage  # noqa: F401

            import spotlight.parallel.comms  # noqa: F401
            import spotlight.parallel.ulysses  # noqa: F401

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sp-compute")
            self._pool.submit(self._init_thread).result()

    def leave(self, epoch: int) -> None:
        self._left.add(epoch)

    def left(self, group: m.SpGroup | None) -> bool:
        return group is not None and group.epoch in self._left

    async def agree(self, stop: bool) -> bool:
        """Whether any rank of the open group wants to stop before the next step."""
        return await self.compute(lambda: self._any(stop))

    def _any(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._group.allreduce([t], opts).wait()
        return bool(t.item())

    async def compute(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the compute thread (a step that may wait in a collective)."""
        assert self._pool is not None, "compute outside a group"
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    @contextlib.asynccontextmanager
    async def joined(self, group: m.SpGroup) -> AsyncIterator[None]:
        """The DiT parallelized over the communicator of ``group.epoch`` for the block's length."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sp-compute")
            await self.compute(self._init_thread)
        try:
            sp = await self.compute(lambda: self._open(group))
        except Exception as e:  # a peer that died before joining: the rendezvous times out
            raise GroupBroken(f"opening SP group epoch {group.epoch}: {type(e).__name__}: {e}") from e
        try:
            yield
        finally:
            sp.undo()  # the plain DiT again (explore jobs, a solo request)
            self._group = None
            if self._comms is not None:
                self._comms.close()
            self._left.discard(group.epoch)

    def _init_thread(self) -> None:
        device = next(self.model.parameters()).device
        if device.type == "cuda":  # the current device is per thread; NCCL uses it
            torch.cuda.set_device(device)

    def _open(self, group: m.SpGroup):
        from spotlight.parallel.comms import Communicators
        from spotlight.parallel.ulysses import parallelize

        if self._comms is None or self._comms.store.port != group.port:  # a new agent session
            backend = "nccl" if next(self.model.parameters()).device.type == "cuda" else "gloo"
            self._comms = Communicators("127.0.0.1", group.port, timeout_s=self.timeout_s, backend=backend)
        self._group = self._comms.open(group.epoch, group.rank, group.size)
        return parallelize(self.model.dit, self._group)

    def close(self) -> None:
        if self._pool is not None:  # a thread stuck in a collective is not waited for
            self._pool.shutdown(wait=False, cancel_futures=True)
