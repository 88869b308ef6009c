"""The node agent's record of which worker holds which weights version (``WeightsHolders``): it
mirrors ``WorkerCore.load_weights``'s keep rule, offers the oldest holder first, never the asker,
and forgets a dead worker."""

from __future__ import annotations

from spotlight.actors.node.holders import WeightsHolders


def test_oldest_holder_first_never_the_asker():
    h = WeightsHolders(keep=2)
    assert h.peers(3, exclude="w0") == []
    h.handed("w0", 3)  # fetches v3 from the store
    h.handed("w1", 3)  # copies it from w0
    h.handed("w2", 3)
    assert h.peers(3, exclude="w2") == ["w0", "w1"]
    assert h.peers(3, exclude="w0") == ["w1", "w2"]
    h.handed("w0", 3)  # handed again: still the oldest holder
    assert h.peers(3, exclude="w9") == ["w0", "w1", "w2"]


def test_mirrors_the_workers_keep_rule():
    h = WeightsHolders(keep=2)
    for v in (0, 1, 2):
        h.handed("w0", v)
    assert h.holds("w0") == {2, 1, 0}  # current + the 2 newest it held before
    h.handed("w0", 3)
    assert h.holds("w0") == {3, 2, 1}  # v0 dropped, as WorkerCore drops it
    h.handed("w0", 1)  # a switch back to a kept copy (exploration at a stale version)
    assert h.holds("w0") == {1, 2, 3}
    one = WeightsHolders(keep=1)
    one.handed("w0", 0)
    one.handed("w0", 1)
    assert one.holds("w0") == {1} and one.peers(0, exclude="w1") == []


def test_a_dead_worker_holds_nothing():
    h = WeightsHolders(keep=2)
    h.handed("w0", 5)
    h.handed("w1", 5)
    h.forget("w0")
    assert h.peers(5, exclude="w2") == ["w1"] and h.holds("w0") == set()
    h.handed("w0", 5)  # restarted, handed v5 again: now the newest holder
    assert h.peers(5, exclude="w2") == ["w1", "w0"]
