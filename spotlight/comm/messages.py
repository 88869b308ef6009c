"""Every message that crosses a process boundary in Spotlight, declared as a typed class.

One ``@dataclass(kw_only=True, slots=True)`` class per message, registered under a short type tag
in ``MESSAGES`` (the tag is what travels on the wire, see ``spotlight.comm.codec``). Field
annotations are the wire contract: the decoder checks every received field against them.

Allowed field types: ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``None``, ``Any``
(any msgpack-able value, tensors included), ``list[T]``, ``dict[str, T]``, ``T | None``,
``Literal[...]``, ``Tensor`` (a numpy array; torch CPU tensors are accepted when encoding) and
another registered message class (sent as its field map). Tensors may also sit anywhere inside
``dict``/``list``/``Any`` values: the codec moves them out of band wherever they are.

To add a message: append a class at the end of the right section with ``@register("tag")`` above
``@dataclass(kw_only=True, slots=True)``; tags must be unique (registration fails loudly).

This module knows the shapes of messages only; it knows nothing of sockets, framing or actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

Tensor = np.ndarray
"""A tensor field: travels as one raw out-of-band frame, arrives as a zero-copy numpy view."""

RequestKind = Literal["rollout", "explore"]


class Message:
    """Base class of every wire message; ``TAG`` is set by ``register``."""

    __slots__ = ()
    TAG: ClassVar[str] = ""


MESSAGES: dict[str, type[Message]] = {}
"""Type tag -> message class; the decoder accepts only tags found here."""


def register(tag: str):
    """Class decorator: give a message class its wire tag and add it to ``MESSAGES``."""

    def add(cls: type[Message]) -> type[Message]:
        if not (isinstance(tag, str) and 0 < len(tag) <= 32):
            raise ValueError(f"message tag must be a 1..32 char str, got {tag!r}")
        if tag in MESSAGES:
            raise ValueError(f"message tag {tag!r} already used by {MESSAGES[tag].__name__}")
        if not issubclass(cls, Message):
            raise TypeError(f"{cls.__name__} must derive from Message")
        cls.TAG = tag
        MESSAGES[tag] = cls
        return cls

    return add


# --- generic replies ------------------------------------------------------------------------------
@register("ok")
@dataclass(kw_only=True, slots=True)
class Ok(Message):
    """The request was applied; nothing to return."""


@register("err")
@dataclass(kw_only=True, slots=True)
class ErrorReply(Message):
    """The request failed. ``code`` names a class of ``spotlight.errors`` (e.g. "StaleAttempt")
    so the client can raise the same class; "RemoteError" for anything else."""

    code: str
    message: str


# --- request queue --------------------------------------------------------------------------------
# --- work: what a request asks a worker to do, and what it gives back -------------------------------
# The queue moves these as opaque values (it reads only ``KIND`` for priority); the worker and the
# in-process executor run them through ``spotlight.work``. Every job names its weights version.
@register("work.explore")
@dataclass(kw_only=True, slots=True)
class ExploreWork(Message):
    """Score candidate seeds of one prompt (one batch, never split): sample with the policy SDE at
    weights ``version`` and reward each sample. ``cache``: the step cache that makes it cheaper, a
    ``spotlight.policy.caching.StepCache`` label ("fbc:0.2"; None = full steps). ``init_seed``: the
    group's shared x_1 (sampler.shared_init), else None."""

    KIND: ClassVar[str] = "explore"
    prompt: str
    seeds: list[int]
    version: int
    cache: str | None = None
    init_seed: int | None = None


@register("work.rollout")
@dataclass(kw_only=True, slots=True)
class RolloutWork(Message):
    """Roll out one prompt's group (one batch) with the policy SDE at weights ``version``,
    committing every step; the trajectory (latents, log-probs, rewards) goes to the store."""

    KIND: ClassVar[str] = "rollout"
    prompt: str
    seeds: list[int]
    version: int
    init_seed: int | None = None


@register("work.explored")
@dataclass(kw_only=True, slots=True)
class ExploreResult(Message):
    """One reward per seed, in seed order; ``model_calls`` the DiT calls that ran every block;
    ``worker_s`` the time inside the worker, ``compute_s`` the part of it spent computing (the
    rest is the runtime's overhead)."""

    rewards: list[float]
    model_calls: int = 0
    worker_s: float = 0.0
    compute_s: float = 0.0


@register("work.rolled_out")
@dataclass(kw_only=True, slots=True)
class RolloutResult(Message):
    """The trajectory is in the tensor store under ``key`` (``nbytes`` bytes; the queue treats
    both as opaque); ``rewards`` per seed; ``resumed_from`` the step this attempt started at."""

    key: str
    nbytes: int
    rewards: list[float]
    resumed_from: int = 0
    worker_s: float = 0.0
    compute_s: float = 0.0


Work = ExploreWork | RolloutWork
WorkResult = ExploreResult | RolloutResult


@register("q.request")
@dataclass(kw_only=True, slots=True)
class WorkRequest(Message):
    """One request: ``batch`` is the submitter's id for a set of requests it waits for together
    (the driver owns it, e.g. "it12/rollout")."""

    request_id: str
    batch: str
    work: Work


@register("q.submit")
@dataclass(kw_only=True, slots=True)
class Submit(Message):
    """Enqueue requests (all or none). Replied with Ok."""

    requests: list[WorkRequest]


@register("q.pull")
@dataclass(kw_only=True, slots=True)
class Pull(Message):
    """Ask for one request of the given kinds, waiting up to ``max_wait_s`` for one to appear.
    Replied with LeaseGrant or NoWork."""

    worker_id: str
    kinds: list[RequestKind]
    max_wait_s: float = 0.0


@register("q.lease")
@dataclass(kw_only=True, slots=True)
class LeaseGrant(Message):
    """A time-limited claim on one request. ``deadline`` is in the queue's clock; ``lease_s`` is
    the lease length, which is what a remote worker should schedule heartbeats by (no shared
    clock). ``resume_step``: the last step an earlier attempt reported committed (None: none)."""

    request_id: str
    attempt: int
    deadline: float
    lease_s: float
    batch: str
    work: Work
    resume_step: int | None = None

    @property
    def kind(self) -> str:
        return self.work.KIND


@register("q.nowork")
@dataclass(kw_only=True, slots=True)
class NoWork(Message):
    """Pull found nothing within its wait."""


@register("q.hb")
@dataclass(kw_only=True, slots=True)
class Heartbeat(Message):
    """Extend a lease; ``committed_step`` is the last step committed to the tensor store (or
    None). Replied with LeaseExtended, or ErrorReply(StaleAttempt) if the attempt was fenced."""

    request_id: str
    attempt: int
    worker_id: str
    committed_step: int | None = None


@register("q.extended")
@dataclass(kw_only=True, slots=True)
class LeaseExtended(Message):
    """The lease now runs until ``deadline`` (queue clock), i.e. ``lease_s`` from now."""

    request_id: str
    attempt: int
    deadline: float
    lease_s: float


@register("q.release")
@dataclass(kw_only=True, slots=True)
class Release(Message):
    """Give a lease back at once (spot notice); not counted toward the retry cap."""

    request_id: str
    attempt: int
    worker_id: str


@register("q.complete")
@dataclass(kw_only=True, slots=True)
class Complete(Message):
    """The attempt finished; accepted only from the current attempt (fencing)."""

    request_id: str
    attempt: int
    worker_id: str
    result: WorkResult


@register("q.fail")
@dataclass(kw_only=True, slots=True)
class Fail(Message):
    """The attempt failed; the request is re-queued, or dead-lettered after max_attempts."""

    request_id: str
    attempt: int
    worker_id: str
    error: str


@register("q.wait_batch")
@dataclass(kw_only=True, slots=True)
class WaitBatch(Message):
    """Wait until every request of ``batch`` is completed or dead-lettered. ``forget``: the
    queue drops the batch's records once it answers (the caller owns the results now; a late
    message about one of its requests gets NotFound)."""

    batch: str
    timeout_s: float
    forget: bool


@register("q.batch_done")
@dataclass(kw_only=True, slots=True)
class BatchDone(Message):
    """Results in submit order (None where dead-lettered or cancelled); ``dead`` and
    ``cancelled`` list those request ids."""

    batch: str
    results: list[WorkResult | None]
    dead: list[str]
    cancelled: list[str]


@register("q.cancel_batch")
@dataclass(kw_only=True, slots=True)
class CancelBatch(Message):
    """Cancel every request of ``batch`` not done yet: queued ones are never leased, leased ones are
    fenced (their heartbeats and results are refused, so a worker drops the work at its next
    heartbeat). The batch is finished at once; a ``WaitBatch`` on it returns. Replied with
    ``BatchDone`` (the results that did arrive). ``forget`` as in ``WaitBatch``."""

    batch: str
    forget: bool


@register("q.wait_revoked")
@dataclass(kw_only=True, slots=True)
class WaitRevoked(Message):
    """Wait up to ``max_wait_s`` for lease ``attempt`` of ``request_id`` to stop being current
    (its batch cancelled, the lease expired or released). Replied with LeaseRevoked: a node agent
    stops a running job whose lease was revoked instead of computing it to the end."""

    request_id: str
    attempt: int
    max_wait_s: float = 0.0


@register("q.revoked")
@dataclass(kw_only=True, slots=True)
class LeaseRevoked(Message):
    revoked: bool


@register("q.stats")
@dataclass(kw_only=True, slots=True)
class QueueStats(Message):
    """Ask for the queue's counters; replied with QueueStatsReply."""


@register("q.stats_reply")
@dataclass(kw_only=True, slots=True)
class QueueStatsReply(Message):
    stats: dict[str, Any]
    dead_letters: list[dict[str, Any]]


# Batched forms: one round trip for many operations. They exist for throughput (the control-plane
# goal is >= 20k lease+complete/s, about 8x what one-at-a-time round trips reach in Python).
@register("q.pull_many")
@dataclass(kw_only=True, slots=True)
class PullMany(Message):
    """Up to ``max_n`` leases at once; waits up to ``max_wait_s`` only if none is available."""

    worker_id: str
    kinds: list[RequestKind]
    max_n: int
    max_wait_s: float = 0.0


@register("q.leases")
@dataclass(kw_only=True, slots=True)
class LeaseBatch(Message):
    leases: list[LeaseGrant]


@register("q.complete_many")
@dataclass(kw_only=True, slots=True)
class CompleteMany(Message):
    completes: list[Complete]


@register("q.batch_result")
@dataclass(kw_only=True, slots=True)
class BatchResult(Message):
    """``accepted`` count; ``rejected`` entries are {index, code, message} (e.g. StaleAttempt)."""

    accepted: int
    rejected: list[dict[str, Any]]


@register("q.release_node")
@dataclass(kw_only=True, slots=True)
class ReleaseNode(Message):
    """The controller declared node ``node_id`` lost (no heartbeat for ``runtime.node_lost_s``):
    re-queue every lease its workers hold now (uncounted; their attempts fenced), instead of at
    each lease's expiry. Replied with Requeued."""

    node_id: str


@register("q.requeued")
@dataclass(kw_only=True, slots=True)
class Requeued(Message):
    request_ids: list[str]


# --- tensor store ---------------------------------------------------------------------------------
@register("s.put")
@dataclass(kw_only=True, slots=True)
class Put(Message):
    """Store tensors + metadata under ``key`` (replaces). Replied with Ok."""

    key: str
    tensors: dict[str, Tensor]
    meta: dict[str, Any]


@register("s.get")
@dataclass(kw_only=True, slots=True)
class Get(Message):
    """Fetch ``key``; replied with Tensors or ErrorReply(NotFound)."""

    key: str


@register("s.tensors")
@dataclass(kw_only=True, slots=True)
class Tensors(Message):
    key: str
    tensors: dict[str, Tensor]
    meta: dict[str, Any]


@register("s.delete")
@dataclass(kw_only=True, slots=True)
class Delete(Message):
    key: str


@register("s.commit")
@dataclass(kw_only=True, slots=True)
class Commit(Message):
    """A request's resumable state after denoising step ``step`` (stored at commit/<request_id>);
    a commit with an older step than the stored one is ignored. ``base`` None: the whole state;
    an int: only the rows added since the held commit at step ``base`` (appended on axis 0)."""

    request_id: str
    attempt: int
    step: int
    tensors: dict[str, Tensor]
    meta: dict[str, Any]
    base: int | None


@register("s.get_commit")
@dataclass(kw_only=True, slots=True)
class GetCommit(Message):
    """Fetch the last commit of a request; replied with Tensors or ErrorReply(NotFound)."""

    request_id: str


@register("s.pin")
@dataclass(kw_only=True, slots=True)
class PinWeights(Message):
    """Keep weights ``version`` held past retention (``pinned``) or release that pin; replied Ok.
    The trainer pins a version while requests that name it are in flight."""

    version: int
    pinned: bool


@register("s.publish")
@dataclass(kw_only=True, slots=True)
class PublishWeights(Message):
    """Publish immutable weights ``version``; publishing an existing version is refused."""

    version: int
    tensors: dict[str, Tensor]
    meta: dict[str, Any]


@register("s.get_weights")
@dataclass(kw_only=True, slots=True)
class GetWeights(Message):
    """Fetch weights ``version``; replied with Tensors or ErrorReply(NotFound)."""

    version: int


# --- tensor store: replies, listing and the shared-memory path (spotlight.actors.store.service) --
@register("s.commit_state")
@dataclass(kw_only=True, slots=True)
class CommitState(Message):
    """Reply to GetCommit: the newest commit, or ``step`` None when the request has none."""

    request_id: str
    step: int | None
    tensors: dict[str, Tensor]
    meta: dict[str, Any]


@register("s.drop_commit")
@dataclass(kw_only=True, slots=True)
class DropCommit(Message):
    """Free a request's commit once its result is accepted. Replied with Ok."""

    request_id: str


@register("s.seal_commit")
@dataclass(kw_only=True, slots=True)
class SealCommit(Message):
    """Move a request's commit at ``step`` to ``key`` as its result, with ``tensors`` added and
    ``meta`` as its meta (the trajectory, without sending it again). Replied with Ok; NotFound
    if no commit at exactly ``step`` is held."""

    request_id: str
    step: int
    key: str
    tensors: dict[str, Tensor]
    meta: dict[str, Any]


@register("s.latest")
@dataclass(kw_only=True, slots=True)
class LatestVersion(Message):
    """Ask for the newest published weights version; replied with VersionReply."""


@register("s.version")
@dataclass(kw_only=True, slots=True)
class VersionReply(Message):
    version: int | None


@register("s.keys")
@dataclass(kw_only=True, slots=True)
class ListKeys(Message):
    """Keys starting with ``prefix``; replied with KeyList."""

    prefix: str


@register("s.key_list")
@dataclass(kw_only=True, slots=True)
class KeyList(Message):
    keys: list[str]


@register("s.shm_hello")
@dataclass(kw_only=True, slots=True)
class ShmHello(Message):
    """Does the store share this machine's /dev/shm? Replied with ShmInfo."""


@register("s.shm_info")
@dataclass(kw_only=True, slots=True)
class ShmInfo(Message):
    """``host_id`` (boot id + hostname) and a ``probe`` segment the client may attach to prove
    it sees the same /dev/shm; ``min_bytes``: tensors below it go inline over ZeroMQ."""

    host_id: str
    probe: str
    min_bytes: int


@register("s.shm_lend")
@dataclass(kw_only=True, slots=True)
class ShmLend(Message):
    """Lend segments with room for each of ``nbytes``; replied with ShmGrant."""

    nbytes: list[int]


@register("s.shm_grant")
@dataclass(kw_only=True, slots=True)
class ShmGrant(Message):
    """One {name, gen} per requested size, in order."""

    segments: list[dict[str, Any]]


@register("s.shm_put")
@dataclass(kw_only=True, slots=True)
class ShmPut(Message):
    """Put whose big tensors sit in lent segments: ``refs`` name -> {name, gen, dtype, shape};
    small ones travel inline in ``tensors``. Replied with Ok."""

    key: str
    tensors: dict[str, Tensor]
    refs: dict[str, dict[str, Any]]
    meta: dict[str, Any]


@register("s.shm_commit")
@dataclass(kw_only=True, slots=True)
class ShmCommit(Message):
    """Commit with big tensors in lent segments (see ShmPut). Replied with Ok."""

    request_id: str
    attempt: int
    step: int
    tensors: dict[str, Tensor]
    refs: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    base: int | None


@register("s.shm_publish")
@dataclass(kw_only=True, slots=True)
class ShmPublish(Message):
    """PublishWeights with big tensors in lent segments (see ShmPut). Replied with Ok."""

    version: int
    tensors: dict[str, Tensor]
    refs: dict[str, dict[str, Any]]
    meta: dict[str, Any]


@register("s.shm_fetch")
@dataclass(kw_only=True, slots=True)
class ShmFetch(Message):
    """Get (``what`` = "key"), get_commit ("commit", ``name`` = request id) or get_weights
    ("weights", ``version``), with tensors held in segments answered as refs. Replied with
    ShmTensors."""

    what: Literal["key", "commit", "weights"]
    name: str = ""
    version: int = -1


@register("s.shm_tensors")
@dataclass(kw_only=True, slots=True)
class ShmTensors(Message):
    """``step`` is set for commits (None: no commit held); ``refs`` as in ShmPut; the reader
    copies out and checks each segment's generation."""

    step: int | None
    tensors: dict[str, Tensor]
    refs: dict[str, dict[str, Any]]
    meta: dict[str, Any]


# --- controller and node agents (spotlight.actors.controller, spotlight.actors.node) --------
@register("c.register")
@dataclass(kw_only=True, slots=True)
class Register(Message):
    """A node agent announces itself; replied with Registered. ``kind``: "reserved" | "spot"."""

    node_id: str
    kind: Literal["reserved", "spot"]
    workers: int


@register("c.registered")
@dataclass(kw_only=True, slots=True)
class Registered(Message):
    """Everything a node needs besides the controller address: where the queue and the tensor
    store are, the lease length to heartbeat by, and the run's recipe (``Recipe.to_dict()``).
    ``epoch``: the reserved side's run epoch (new each time it starts, e.g. after ``--resume``); a
    node that finds a new epoch behind the same address joins the restarted run."""

    node_id: str
    queue: str
    store: str
    lease_s: float
    recipe: dict[str, Any]
    epoch: int = 0


@register("c.deregister")
@dataclass(kw_only=True, slots=True)
class Deregister(Message):
    """A node agent is leaving (spot notice or shutdown). Replied with Ok."""

    node_id: str
    reason: str


@register("c.node_beat")
@dataclass(kw_only=True, slots=True)
class NodeBeat(Message):
    """A node agent's liveness heartbeat (every ``runtime.node_beat_s``). Replied with Ok; a
    ``NotFound`` error means the controller declared the node lost (silent longer than
    ``runtime.node_lost_s``) and the agent registers again."""

    node_id: str


@register("c.status")
@dataclass(kw_only=True, slots=True)
class FleetStatus(Message):
    """Ask the controller for the fleet's state (``spotlight status``); replied with FleetStatusReply."""


@register("c.status_reply")
@dataclass(kw_only=True, slots=True)
class FleetStatusReply(Message):
    """The reserved side as an operator sees it. ``nodes``: one map per registered node (node_id,
    kind, workers, sp_groups, up_s, beat_s: seconds since its last heartbeat); ``left``: nodes
    gone so far (left or lost); ``queue``: the request queue's counters (``now_queued``,
    ``now_leased``, ...), empty when the queue did not answer; ``progress``: iteration, phase and
    weights version of the trainer; ``cost``: GPU-seconds, dollars, preemptions so far."""

    run: str
    epoch: int
    sp_degree: int
    nodes: list[dict[str, Any]]
    left: int
    queue: dict[str, Any]
    progress: dict[str, Any]
    cost: dict[str, Any]


# --- node agent <-> its GPU workers (ipc on one node) ------------------------------------------------
@register("w.run")
@dataclass(kw_only=True, slots=True)
class WorkerRun(Message):
    """Run one leased request to the end; replied with WorkerResult, or ErrorReply("Preempted")
    when a WorkerStop interrupted it at a step boundary (its commits flushed). ``group``: run it
    as one rank of a sequence-parallel group (None: alone). ``peer``: a worker of this node that
    holds (or is loading) the lease's weights version, to copy it from instead of the store."""

    lease: LeaseGrant
    group: SpGroup | None = None
    peer: WeightsPeer | None = None


@register("w.result")
@dataclass(kw_only=True, slots=True)
class WorkerResult(Message):
    """``result`` is what the agent passes to the queue's Complete."""

    request_id: str
    attempt: int
    result: WorkResult


@register("w.status")
@dataclass(kw_only=True, slots=True)
class WorkerStatus(Message):
    """What is the worker doing? Replied with WorkerProgress."""


@register("w.progress")
@dataclass(kw_only=True, slots=True)
class WorkerProgress(Message):
    """``request_id`` None when idle; ``committed_step`` the last step handed to the store."""

    request_id: str | None
    attempt: int
    committed_step: int | None
    version: int | None
    weights_fetches: int = 0
    """Weights versions loaded from the tensor store (across the network on a spot node)."""
    weights_peer_copies: int = 0
    """Versions copied from a worker of the same node, and their bytes and seconds."""
    peer_bytes: int = 0
    peer_s: float = 0.0


@register("w.stop")
@dataclass(kw_only=True, slots=True)
class WorkerStop(Message):
    """Spot notice: finish the current step, flush commits, stop. Replied with WorkerProgress
    once the running request (if any) has stopped and its commits reached the store."""


@register("w.cancel")
@dataclass(kw_only=True, slots=True)
class WorkerCancel(Message):
    """The lease of the worker's running request ``request_id`` (attempt ``attempt``) was revoked:
    stop it after the step in flight; its WorkerRun is answered ErrorReply("Cancelled"). Replied
    with Ok at once (also when that request is no longer running)."""

    request_id: str
    attempt: int


@register("w.sp")
@dataclass(kw_only=True, slots=True)
class SpGroup(Message):
    """A worker's place in a sequence-parallel group: rank ``rank`` of ``size`` in membership
    ``epoch``, whose communicator meets at the node agent's rendezvous store on ``port``
    (127.0.0.1); ``members`` the group's worker ids in rank order (recorded with rank 0's
    commits). Rank 0 commits every step, seals the trajectory and scores it; the others only
    compute their share of each step."""

    epoch: int
    rank: int
    size: int
    port: int
    members: list[str]


@register("w.leave")
@dataclass(kw_only=True, slots=True)
class WorkerLeave(Message):
    """The SP group of ``epoch`` is broken: stop its request at the next step boundary (its
    WorkerRun is then answered ErrorReply("Preempted")). Replied with Ok at once."""

    epoch: int


@register("w.peer")
@dataclass(kw_only=True, slots=True)
class WeightsPeer(Message):
    """A worker of the same node to copy a weights version from: its ipc ``endpoint`` (where it
    answers LendWeights) and ``pid`` (its death ends the wait at once)."""

    worker: str
    endpoint: str
    pid: int


@register("w.lend")
@dataclass(kw_only=True, slots=True)
class LendWeights(Message):
    """Worker to worker on one node: lend me weights ``version`` (waits for the lender's own load
    of it when it is loading it). Replied with WeightsLent, or ErrorReply("NotFound") when the
    worker neither holds nor is loading that version."""

    version: int


@register("w.lent")
@dataclass(kw_only=True, slots=True)
class WeightsLent(Message):
    """Weights ``version`` in the lender's live buffer: shared-memory segment ``segment`` (CPU;
    its header word must still read ``generation`` after the copy) or the CUDA IPC handle ``cuda``
    (GPU; ``segment`` is empty); ``nbytes`` from the data's start; ``layout``: parameter name ->
    [dtype, shape, byte offset]. The lender keeps the version there (pinned) until the borrower
    sends WeightsReturned(``token``), or ``runtime.peer_weights_s`` at the latest."""

    version: int
    token: str
    segment: str
    nbytes: int
    layout: dict[str, Any]
    generation: int = 0
    cuda: dict[str, Any] | None = None


@register("w.returned")
@dataclass(kw_only=True, slots=True)
class WeightsReturned(Message):
    """The borrower is done with the segment lent under ``token``; replied with Ok."""

    token: str
