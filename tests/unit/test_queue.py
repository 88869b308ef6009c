"""RequestQueueCore with a fake clock: leases, expiry + resume, heartbeats, release, fencing,
dead letters, priorities, iterations; and the in-process QueueClient over the same handlers."""

from __future__ import annotations

import asyncio

import pytest
from fake_clock import FakeClock

from spotlight.actors.queue.client import QueueClient
from spotlight.actors.queue.core import QueueConfig, RequestQueueCore
from spotlight.actors.queue.service import QueueService
from spotlight.comm import messages as m
from spotlight.errors import ActorTimeout, NotFound, ProtocolError, StaleAttempt

pytestmark = pytest.mark.timeout(10)


def req(rid: str, kind: str = "rollout", batch: str = "b0", seed: int = 1) -> m.WorkRequest:
    work = (m.RolloutWork if kind == "rollout" else m.ExploreWork)(prompt="p", seeds=[seed], version=0)
    return m.WorkRequest(request_id=rid, batch=batch, work=work)


def res(reward: float) -> m.RolloutResult:
    """A rollout's result (the queue keeps it opaque)."""
    return m.RolloutResult(key=f"traj/{reward}", nbytes=8, rewards=[reward])


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def core(clock: FakeClock) -> RequestQueueCore:
    return RequestQueueCore(QueueConfig(lease_s=10.0, max_attempts=3), clock=clock)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="lease_s"):
        QueueConfig(lease_s=0)
    with pytest.raises(ValueError, match="max_attempts"):
        QueueConfig(max_attempts=0)


def test_rollout_outranks_explore_then_fifo(core: RequestQueueCore) -> None:
    core.submit([req("e1", "explore"), req("r1"), req("e2", "explore"), req("r2")])
    order = [core.pull("w").request_id for _ in range(4)]
    assert order == ["r1", "r2", "e1", "e2"]
    assert core.pull("w") is None
    core.submit([req("e3", "explore"), req("r3")])
    assert core.pull("w", ["explore"]).request_id == "e3"  # kinds filter respected


def test_submit_is_validated_and_atomic(core: RequestQueueCore) -> None:
    core.submit([req("a")])
    with pytest.raises(ProtocolError, match="'a'"):
        core.submit([req("b"), req("a")])
    with pytest.raises(ProtocolError, match="WorkRequest"):
        core.submit([req("c"), {"request_id": "d", "kind": "train"}])
    with pytest.raises(ProtocolError, match="batch"):
        core.submit([m.WorkRequest(request_id="e", batch="", work=req("x").work)])
    assert core.stats()["submitted"] == 1 and core.pull("w").request_id == "a"
    assert core.pull("w") is None  # "b" was not half-submitted


def test_lease_expiry_requeues_with_resume_ref(core: RequestQueueCore, clock: FakeClock) -> None:
    core.submit([req("r1", seed=7)])
    lease = core.pull("w1")
    assert (lease.attempt, lease.deadline, lease.resume_step) == (1, 1010.0, None)
    core.heartbeat("r1", 1, "w1", committed_step=4)
    assert core.next_deadline() == 1010.0
    clock.t = 1010.0
    assert core.expire_leases() == ["r1"]
    again = core.pull("w2")
    assert again.attempt == 2 and again.work == m.RolloutWork(prompt="p", seeds=[7], version=0)
    assert again.resume_step == 4 and again.batch == "b0" and again.kind == "rollout"
    assert core.stats()["expired"] == 1


def test_heartbeat_extends_lease(core: RequestQueueCore, clock: FakeClock) -> None:
    core.submit([req("r1")])
    core.pull("w1")
    clock.t += 8
    ext = core.heartbeat("r1", 1, "w1")
    assert ext.deadline == 1018.0 and ext.lease_s == 10.0
    clock.t = 1015.0
    assert core.expire_leases() == []  # the old deadline (1010) is superseded
    assert core.next_deadline() == 1018.0
    clock.t = 1018.0
    assert core.expire_leases() == ["r1"]


def test_release_requeues_at_once_without_counting(core: RequestQueueCore) -> None:
    core.submit([req("r1")])
    for attempt in range(1, 6):  # more releases than max_attempts: never dead-lettered
        lease = core.pull(f"w{attempt}")
        assert lease.attempt == attempt
        core.heartbeat("r1", attempt, f"w{attempt}", committed_step=attempt)
        core.release("r1", attempt, f"w{attempt}")
    assert core.pull("w9").resume_step == 5
    assert core.dead_letters == [] and core.stats()["released"] == 5


def test_fencing_drops_late_result(core: RequestQueueCore, clock: FakeClock) -> None:
    core.submit([req("r1")])
    core.pull("slow")
    clock.t += 11
    core.expire_leases()
    core.pull("fast")
    with pytest.raises(StaleAttempt):
        core.heartbeat("r1", 1, "slow")
    with pytest.raises(StaleAttempt):
        core.complete("r1", 1, "slow", res(0.0))
    with pytest.raises(ProtocolError, match="returns RolloutResult"):
        core.complete("r1", 2, "fast", m.ExploreResult(rewards=[1.0]))  # not what a rollout returns
    assert core.complete("r1", 2, "fast", res(1.0)) is True
    assert core.complete("r1", 2, "fast", res(1.0)) is False  # resend: exactly once
    with pytest.raises(StaleAttempt):
        core.complete("r1", 1, "slow", res(0.0))
    stats = core.stats()
    assert stats["late_results_dropped"] == 2 and stats["completed"] == 1
    assert stats["duplicate_completions"] == 1
    with pytest.raises(NotFound):
        core.complete("nope", 1, "fast", res(0.0))


def test_lost_node_leases_requeued_at_once_and_fenced(core: RequestQueueCore, clock: FakeClock) -> None:
    """A node declared lost: its workers' leases (ids ``<node>/...``) go back to the queue now,
    with their last commit, uncounted; other nodes' leases (a node named with the same prefix
    included) stay; the lost attempts' late heartbeats, releases and results are refused."""
    core.submit([req("a"), req("b"), req("c"), req("d")])
    core.pull("n1/w0")
    core.heartbeat("a", 1, "n1/w0", committed_step=3)
    core.pull("n1/w1")
    core.pull("n10/w0")  # "n1" is a prefix of its name, not its node
    core.pull("n2/sp")
    assert core.release_node("n1") == ["a", "b"]
    assert core.release_node("n1") == []  # nothing held any more
    assert core.next_deadline() == 1010.0  # c's and d's leases live on
    again = core.pull("n2/w0")
    assert (again.request_id, again.attempt, again.resume_step) == ("a", 2, 3)  # at once, from its commit
    for op in (lambda: core.heartbeat("a", 1, "n1/w0"), lambda: core.release("b", 1, "n1/w1"),
               lambda: core.complete("a", 1, "n1/w0", res(0.0))):
        with pytest.raises(StaleAttempt):
            op()  # the node came back (it was frozen): its attempts are fenced off
    assert core.complete("a", 2, "n2/w0", res(1.0)) is True
    for _ in range(5):  # never counted toward the retry cap
        lease = core.pull("n3/w0")
        assert lease.request_id == "b"
        core.release_node("n3")
    clock.t += 11
    assert sorted(core.expire_leases()) == ["c", "d"]  # a and b are not expired twice
    stats = core.stats()
    assert (stats["node_lost_requeued"], stats["expired"], stats["dead"]) == (7, 2, 0)
    assert stats["late_results_dropped"] == 1 and stats["completed"] == 1
    with pytest.raises(ProtocolError, match="node_id"):
        core.release_node("n1/w0")


async def test_release_node_through_the_client() -> None:
    core = RequestQueueCore(QueueConfig(lease_s=5.0))
    client = QueueClient.local(core)
    await client.submit([req("a"), req("b")])
    await client.pull("spot.1/w0")
    await client.pull("spot.2/w0")
    assert await client.release_node("spot.1") == ["a"]
    assert core.stats()["now_queued"] == 1


def test_dead_letter_after_capped_retries(core: RequestQueueCore, clock: FakeClock) -> None:
    core.submit([req("r1", batch="it3"), req("r2", batch="it3")])
    assert core.pull("w").request_id == "r1"  # attempt 1
    clock.t += 10
    core.expire_leases()  # failure 1; r1 keeps its place ahead of r2
    lease = core.pull("w")
    assert (lease.request_id, lease.attempt) == ("r1", 2)
    core.fail("r1", 2, "w", "cuda oom")  # failure 2
    lease = core.pull("w")
    assert (lease.request_id, lease.attempt) == ("r1", 3)
    core.fail("r1", 3, "w", "cuda oom")  # failure 3 == max_attempts: dead
    assert [d["request_id"] for d in core.dead_letters] == ["r1"]
    assert "cuda oom" in core.dead_letters[0]["reason"] and core.dead_letters[0]["attempts"] == 3
    last = core.pull("w")
    assert last.request_id == "r2" and core.pull("w") is None


async def test_wait_batch_returns_results_in_request_order(core: RequestQueueCore) -> None:
    core.submit([req(f"r{i}", batch="one") for i in range(3)] + [req("x", batch="two")])
    waiter = asyncio.ensure_future(core.wait_batch("one", timeout_s=5))
    leases = [core.pull("w") for _ in range(3)]
    for lease in reversed(leases):  # finish out of order
        await asyncio.sleep(0)
        assert not waiter.done()
        core.complete(lease.request_id, lease.attempt, "w", res(float(lease.request_id[1])))
    done = await waiter
    assert done.results == [res(0.0), res(1.0), res(2.0)] and done.dead == []
    with pytest.raises(ActorTimeout, match="batch two"):
        await core.wait_batch("two", timeout_s=0.05)
    core.forget_batch("one")
    assert core.stats()["now_done"] == 0


async def test_cancel_batch_drops_queued_and_fences_leased(core: RequestQueueCore, clock: FakeClock) -> None:
    """Exploration's deadline: what finished is kept, queued work is never leased, a leased
    attempt is fenced (heartbeat, result and release refused), the waiting caller returns."""
    core.submit([req(f"e{i}", "explore", batch="x") for i in range(3)] + [req("r", batch="y")])
    waiter = asyncio.ensure_future(core.wait_batch("x", timeout_s=5))
    r, e0, e1 = core.pull("w1"), core.pull("w2"), core.pull("w3")
    assert (r.request_id, e0.request_id, e1.request_id) == ("r", "e0", "e1")
    done_result = m.ExploreResult(rewards=[0.5], model_calls=1)
    core.complete("e0", e0.attempt, "w2", done_result)
    done = core.cancel_batch("x")
    assert done.results == [done_result, None, None] and done.cancelled == ["e1", "e2"] and done.dead == []
    assert (await waiter) == done
    with pytest.raises(StaleAttempt):
        core.heartbeat("e1", e1.attempt, "w3")
    with pytest.raises(StaleAttempt):
        core.complete("e1", e1.attempt, "w3", done_result)
    with pytest.raises(StaleAttempt):
        core.release("e1", e1.attempt, "w3")
    assert core.pull("w3") is None  # e2 was queued: never leased
    assert core.next_deadline() == r.deadline  # e1's lease is not live any more
    clock.t += 100.0
    assert core.expire_leases() == ["r"]  # only the other batch's lease expires
    stats = core.stats()
    assert stats["cancelled"] == 2 and stats["now_cancelled"] == 2
    core.forget_batch("x")
    with pytest.raises(NotFound, match="unknown batch"):
        core.cancel_batch("x")


async def test_cancel_through_the_client() -> None:
    core = RequestQueueCore(QueueConfig(lease_s=5.0))
    client = QueueClient.local(core)
    await client.submit([req("a", "explore", batch="x"), req("b", "explore", batch="x")])
    lease = await client.pull("w")
    await client.complete(lease.request_id, lease.attempt, "w", m.ExploreResult(rewards=[1.0], model_calls=2))
    done = await client.cancel_batch("x", forget=True)
    assert done.cancelled == ["b"] and done.results[0].rewards == [1.0]
    assert core.stats()["now_cancelled"] == 0  # forgotten


async def test_wait_revoked_wakes_when_the_batch_is_cancelled_not_before(core: RequestQueueCore) -> None:
    """The revocation a node agent long-polls while an exploration runs: it returns True at the
    batch's cancel (not at a heartbeat), False after its wait while the lease stands, and True at
    once for a lease that is already gone."""
    client = QueueClient.local(core)
    await client.submit([req("e", "explore", batch="x"), req("r", batch="y")])
    r, e = await client.pull("w1"), await client.pull("w2")
    assert await client.wait_revoked("e", e.attempt, 0.01) is False  # still its lease
    watch = asyncio.ensure_future(client.wait_revoked("e", e.attempt, 5.0))
    other = asyncio.ensure_future(client.wait_revoked("r", r.attempt, 0.2))
    await asyncio.sleep(0)
    await client.heartbeat("e", e.attempt, "w2")  # renewing is not revoking
    await asyncio.sleep(0)
    assert not watch.done()
    await client.cancel_batch("x")
    assert await asyncio.wait_for(watch, 1.0) is True
    assert await other is False  # another batch's lease stands
    assert await client.wait_revoked("e", e.attempt, 5.0) is True  # answered at once


def test_forgotten_requests_leave_no_live_deadline(core: RequestQueueCore, clock: FakeClock) -> None:
    """Lease-heap entries outlive the requests they name; once an iteration is forgotten, its
    stale entries must be skipped when their old deadline passes (they once crashed the queue)."""
    core.submit([req("a", batch="one"), req("b", batch="one"), req("c", batch="two")])
    a, b, c = core.pull("w1"), core.pull("w2"), core.pull("w3")
    clock.t += 1.0
    core.heartbeat("a", a.attempt, "w1")  # a renewed lease: two heap entries for "a"
    core.complete("a", a.attempt, "w1", res(1.0))
    core.complete("b", b.attempt, "w2", res(1.0))
    core.forget_batch("one")
    assert core.next_deadline() == c.deadline  # only the live lease of the unforgotten iteration
    clock.t += 100.0  # past every deadline in the heap, the forgotten ones included
    assert core.expire_leases() == ["c"]
    assert core.next_deadline() is None and core.stats()["now_queued"] == 1  # c waits for attempt 2


async def test_long_poll_pull_wakes_on_submit(core: RequestQueueCore) -> None:
    async with asyncio.TaskGroup() as tg:
        waiting = tg.create_task(core.wait_pull("w", ["rollout"], 1, max_wait_s=5))
        await asyncio.sleep(0)
        core.submit([req("e", "explore")])  # wrong kind: stays asleep
        await asyncio.sleep(0)
        assert not waiting.done()
        core.submit([req("r")])
    assert [g.request_id for g in waiting.result()] == ["r"]
    assert await core.wait_pull("w", ["rollout"], 1, max_wait_s=0.01) == []


async def test_local_client_and_expiry_timer() -> None:
    core = RequestQueueCore(QueueConfig(lease_s=0.05, max_attempts=2))
    async with QueueService(core):  # bind=None: only the expiry timer, in-process
        client = QueueClient.local(core)
        await client.submit([req("r1")])
        lease = await client.pull("w1")
        await client.heartbeat(lease.request_id, lease.attempt, "w1", committed_step=2)
        # The timer (armed on the nearest deadline, no polling) re-queues it; the long poll sees it.
        again = await client.pull("w2", max_wait_s=2)
        assert again.attempt == 2 and again.resume_step == 2
        await client.complete("r1", 2, "w2", res(1.0))
        with pytest.raises(StaleAttempt):
            await client.complete("r1", 1, "w1", res(0.0))
        done = await client.wait_batch("b0", timeout_s=1)
        assert done.results == [res(1.0)]
        stats = await client.stats()
        assert stats.stats["expired"] == 1 and stats.stats["late_results_dropped"] == 1
