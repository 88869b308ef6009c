"""The node agent's SP group scheduler: which workers form which group, and what happens when a
member dies. A plain class with an injectable clock, driven by events and answering commands, so
it is tested with fake workers (tests/unit/test_group_scheduler.py); ``spotlight.actors.node.sp``
runs it with the node's worker processes.

Model. Workers join the pool idle. Whenever `degree` workers are idle and a request is pending,
they form a group at a fresh **epoch** (a global counter: the communicator of epoch e is never
reused) and run the request from its last commit. Rank 0 of the group commits after every step;
a commit counts only from the group's current epoch (fencing: a late event of a broken epoch is
dropped). When a member dies, reports a failed collective, or the group makes no progress for
`stall_s`, the group is broken: its request goes back to the front of the queue with its last
commit, the live members are told to leave the epoch, and each returns to the pool once it
reports its compute free again. A member that does not come free within `release_s` (stuck in a
collective on a live but hung peer) is killed, which closes its sockets and frees the others.
Nothing here restarts a worker or reloads a model: a regroup is "new epoch, same processes".

This module knows members, epochs, requests and commits; nothing of processes, sockets or torch.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from spotlight.errors import ConfigError


# --- commands to the shell -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Form:
    """Members (rank order) open the communicator of `epoch` and run `request_id`, resuming from
    the commit of `resume_step` (0 = from the start)."""

    epoch: int
    members: tuple[str, ...]
    request_id: str
    resume_step: int


@dataclass(frozen=True, slots=True)
class Leave:
    """Tell `member` its group of `epoch` is broken: stop at the next step boundary."""

    member: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Kill:
    """`member` did not come free in time (stuck on a hung peer): end its process."""

    member: str
    reason: str


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    epoch: int


Command = Form | Leave | Kill | Finished


# --- state -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Group:
    epoch: int
    members: tuple[str, ...]
    request_id: str
    last_progress: float


@dataclass(slots=True)
class Member:
    id: str
    state: str = "idle"  # idle | busy | releasing
    epoch: int | None = None
    releasing_since: float = 0.0


@dataclass(slots=True)
class Request:
    id: str
    committed_step: int = 0
    attempts: int = 0
    epochs: list[int] = field(default_factory=list)


class GroupScheduler:
    """Forms SP groups of `degree` members, regroups them when one dies (see module docstring)."""

    def __init__(
        self,
        degree: int,
        *,
        stall_s: float = 30.0,
        release_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if degree < 1:
            raise ConfigError(f"runtime.sp_degree must be >= 1, got {degree}")
        if stall_s <= 0 or release_s <= 0:
            raise ConfigError(f"group stall_s and release_s must be > 0, got {stall_s}, {release_s}")
        self.degree, self.stall_s, self.release_s, self.clock = degree, stall_s, release_s, clock
        self.members: dict[str, Member] = {}  # insertion order = join order = rank preference
        self.groups: dict[int, Group] = {}
        self.requests: dict[str, Request] = {}
        self.pending: deque[str] = deque()
        self.finished: list[str] = []
        self._epoch = 0

    # --- events --------------------------------------------------------------------------------------
    def join(self, member: str) -> list[Command]:
        """A worker with the current weights is ready to be grouped."""
        if member in self.members:
            raise ValueError(f"member {member!r} joined twice")
        self.members[member] = Member(member)
        return self._schedule()

    def submit(self, request_id: str) -> list[Command]:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} submitted twice")
        self.requests[request_id] = Request(request_id)
        self.pending.append(request_id)
        return self._schedule()

    def died(self, member: str, reason: str = "exited") -> list[Command]:
        """A member's process is gone (SIGKILL, crash, spot notice served)."""
        m = self.members.pop(member, None)
        if m is None:
            return []
        cmds = self._break(m.epoch, now=self.clock()) if m.state == "busy" else []
        return cmds + self._schedule()

    def committed(self, member: str, epoch: int, step: int) -> list[Command]:
        """Rank 0 of `epoch` committed the state after `step` steps. Stale epochs are fenced off."""
        g = self.groups.get(epoch)
        if g is None or g.members[0] != member:
            return []
        req = self.requests[g.request_id]
        req.committed_step = max(req.committed_step, step)
        g.last_progress = self.clock()
        return []

    def done(self, member: str, epoch: int) -> list[Command]:
        """A member of `epoch` finished its part; rank 0's done means the request's final commit is
        written. Another rank is free at once (its compute is over, whatever rank 0 does next)."""
        g = self.groups.get(epoch)
        if g is None:  # the group broke as this member finished: it is free all the same
            m = self.members.get(member)
            if m is not None and m.epoch == epoch:
                m.state, m.epoch = "idle", None
            return self._schedule()
        if g.members[0] != member:
            m = self.members.get(member)
            if m is not None and m.epoch == epoch:
                m.state, m.epoch = "idle", None
            return self._schedule()
        del self.groups[epoch]
        self.finished.append(g.request_id)
        for mid in g.members:
            if (m := self.members.get(mid)) is not None and m.epoch == epoch:
                m.state, m.epoch = "idle", None
        return [Finished(g.request_id, epoch), *self._schedule()]

    def released(self, member: str, epoch: int) -> list[Command]:
        """`member`'s compute for `epoch` has stopped (its collective failed, or it left at a step
        boundary). A member of a group that is still running means the group is broken."""
        m = self.members.get(member)
        if m is None or m.epoch != epoch:
            return []
        m.state, m.epoch = "idle", None
        cmds = self._break(epoch, now=self.clock()) if epoch in self.groups else []
        return cmds + self._schedule()

    def cancel(self, request_id: str) -> list[Command]:
        """Drop a request (its lease went to another attempt, or the node leaves): a pending one
        is forgotten, a running group is broken without putting the request back."""
        if request_id not in self.requests:
            return []
        del self.requests[request_id]
        with contextlib.suppress(ValueError):
            self.pending.remove(request_id)
        epoch = next((e for e, g in self.groups.items() if g.request_id == request_id), None)
        cmds = self._break(epoch, now=self.clock(), requeue=False)
        return cmds + self._schedule()

    def idle(self) -> int:
        """Members free to form a group now."""
        return sum(m.state == "idle" for m in self.members.values())

    def shortfall(self) -> int:
        """Members the pending requests lack, counting those leaving a broken group as about to be
        free (a dead member's replacement is needed now only when this is > 0)."""
        free = sum(m.state in ("idle", "releasing") for m in self.members.values())
        return max(0, self.degree * len(self.pending) - free)

    def tick(self) -> list[Command]:
        """Stalled groups break; members stuck past `release_s` are killed."""
        now, cmds = self.clock(), []
        for epoch, g in list(self.groups.items()):
            if now - g.last_progress > self.stall_s:
                cmds += self._break(epoch, now)
        for m in self.members.values():
            if m.state == "releasing" and now - m.releasing_since > self.release_s:
                cmds.append(Kill(m.id, f"still in epoch {m.epoch}'s collective after {self.release_s} s"))
                m.releasing_since = float("inf")  # one kill; its death event removes it
        return cmds + self._schedule()

    # --- internals -------------------------------------------------------------------------------------
    def _break(self, epoch: int | None, now: float, requeue: bool = True) -> list[Command]:
        g = self.groups.pop(epoch, None) if epoch is not None else None
        if g is None:
            return []
        if requeue:
            self.pending.appendleft(g.request_id)  # resumes first, from its last commit
        cmds: list[Command] = []
        for mid in g.members:
            m = self.members.get(mid)
            if m is not None and m.epoch == epoch and m.state == "busy":
                m.state, m.releasing_since = "releasing", now
                cmds.append(Leave(mid, epoch))
        return cmds

    def _schedule(self) -> list[Command]:
        cmds: list[Command] = []
        while self.pending:
            idle = [m for m in self.members.values() if m.state == "idle"]
            if len(idle) < self.degree:
                break
            chosen = idle[: self.degree]
            self._epoch += 1
            req = self.requests[self.pending.popleft()]
            req.attempts += 1
            req.epochs.append(self._epoch)
            for m in chosen:
                m.state, m.epoch = "busy", self._epoch
            g = Group(self._epoch, tuple(m.id for m in chosen), req.id, self.clock())
            self.groups[self._epoch] = g
            cmds.append(Form(g.epoch, g.members, req.id, req.committed_step))
        return cmds

    def status(self) -> dict:
        return {
            "members": {m.id: (m.state, m.epoch) for m in self.members.values()},
            "groups": {e: (g.members, g.request_id) for e, g in self.groups.items()},
            "pending": list(self.pending),
            "finished": list(self.finished),
        }
