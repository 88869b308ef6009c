"""The SP group scheduler with fake workers and a fake clock: groups form when enough members are
idle, a death breaks only its group, the request resumes from its last commit at a new epoch,
stale events are fenced off, stalled groups break, stuck members are killed."""

from __future__ import annotations

import pytest

from spotlight.actors.node.groups import Finished, Form, GroupScheduler, Kill, Leave
from spotlight.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(degree=2, **kw):
    clock = Clock()
    return GroupScheduler(degree, clock=clock, **kw), clock


def test_a_group_forms_when_degree_members_are_idle_and_a_request_waits():
    s, _ = make(2)
    assert s.submit("r1") == []
    assert s.join("a") == []
    assert s.join("b") == [Form(1, ("a", "b"), "r1", 0)]
    assert s.join("c") == []  # a later worker waits in the pool
    assert s.submit("r2") == []  # one idle member is not a group
    assert s.join("d") == [Form(2, ("c", "d"), "r2", 0)]


def test_death_regroups_survivor_with_a_spare_resuming_from_the_last_commit():
    s, clock = make(2)
    s.submit("r1")
    s.join("a"), s.join("b"), s.join("spare")
    s.committed("a", 1, 1)
    s.committed("a", 1, 2)
    s.committed("b", 1, 3)  # only rank 0 commits
    cmds = s.died("b")
    assert cmds == [Leave("a", 1)]  # the spare alone is no group; a is still in its collective
    assert s.status()["pending"] == ["r1"]
    clock.t = 0.05
    assert s.released("a", 1) == [Form(2, ("a", "spare"), "r1", 2)]
    assert s.committed("a", 1, 3) == [] and s.requests["r1"].committed_step == 2  # stale epoch fenced
    s.committed("a", 2, 3)
    assert s.done("a", 1) == []  # stale
    assert s.done("spare", 2) == []  # another rank finished its part: free, the request is not done
    assert s.status()["members"]["spare"] == ("idle", None) and 2 in s.groups
    assert s.done("a", 2) == [Finished("r1", 2)]
    assert s.status()["members"] == {"a": ("idle", None), "spare": ("idle", None)}
    assert s.requests["r1"].epochs == [1, 2]


def test_shortfall_counts_members_leaving_a_broken_group_as_about_to_be_free():
    # The agent restarts a dead member at once only when the pending requests lack members.
    s, _ = make(2)
    s.submit("r1")
    s.join("a"), s.join("b"), s.join("spare")
    assert s.shortfall() == 0
    s.died("b")  # a is still in its collective (releasing), the spare idle: enough for r1
    assert s.status()["pending"] == ["r1"] and s.shortfall() == 0
    s.released("a", 1)  # re-formed with the spare
    assert s.shortfall() == 0 and s.status()["pending"] == []
    s.died("spare")  # no spare left: r1 waits for the replacement
    assert s.status()["pending"] == ["r1"] and s.shortfall() == 1
    s.submit("r2")
    assert s.shortfall() == 3


def test_a_survivor_reporting_the_failed_collective_before_the_death_is_seen():
    s, _ = make(2)
    s.submit("r1")
    s.join("a"), s.join("b"), s.join("c")
    s.committed("a", 1, 4)
    # the group is broken; b (dead, not yet seen) is told to leave; a regroups with c at once
    assert s.released("a", 1) == [Leave("b", 1), Form(2, ("a", "c"), "r1", 4)]
    assert s.died("b") == []


def test_death_of_an_idle_member_or_an_unknown_one_changes_no_group():
    s, _ = make(2)
    s.submit("r1")
    s.join("a"), s.join("b"), s.join("c")
    assert s.died("c") == [] and s.died("nobody") == []
    assert 1 in s.groups


def test_a_stalled_group_breaks_and_a_stuck_member_is_killed():
    s, clock = make(2, stall_s=10, release_s=2)
    s.submit("r1")
    s.join("a"), s.join("b")
    clock.t = 5
    s.committed("a", 1, 1)
    clock.t = 14
    assert s.tick() == []  # progress at t=5
    clock.t = 15.5
    assert s.tick() == [Leave("a", 1), Leave("b", 1)]
    s.released("a", 1)  # a comes free; b is stuck on a hung peer
    clock.t = 17
    assert s.tick() == []
    clock.t = 18
    [kill] = s.tick()
    assert isinstance(kill, Kill) and kill.member == "b"
    assert s.tick() == []  # killed once
    assert s.join("c") == [Form(2, ("a", "c"), "r1", 1)]
    assert s.died("b") == []


def test_degree_one_and_bad_config():
    s, _ = make(1)
    s.submit("r1"), s.submit("r2")
    assert s.join("a") == [Form(1, ("a",), "r1", 0)]
    assert s.done("a", 1) == [Finished("r1", 1), Form(2, ("a",), "r2", 0)]
    with pytest.raises(ConfigError, match="runtime.sp_degree"):
        GroupScheduler(0)
    with pytest.raises(ValueError, match="twice"):
        s.join("a")


def test_cancel_drops_a_pending_request_and_breaks_a_running_group_without_requeue():
    s, _ = make(2)
    s.submit("r1"), s.submit("r2")
    s.join("a"), s.join("b")
    assert s.cancel("r2") == [] and s.status()["pending"] == []  # pending: forgotten
    assert s.cancel("r1") == [Leave("a", 1), Leave("b", 1)]  # running: broken, not put back
    assert s.status()["pending"] == [] and s.groups == {} and s.idle() == 0
    assert s.released("a", 1) == [] and s.idle() == 1
    assert s.cancel("r1") == []  # unknown now: nothing


def test_a_member_finishing_as_its_group_breaks_is_free_again():
    s, _ = make(2)
    s.submit("r1")
    s.join("a"), s.join("b")
    s.died("c")  # unknown member: nothing
    assert s.cancel("r1") == [Leave("a", 1), Leave("b", 1)]
    assert s.done("b", 1) == [] and s.status()["members"]["b"] == ("idle", None)
    assert s.status()["members"]["a"] == ("releasing", 1)
