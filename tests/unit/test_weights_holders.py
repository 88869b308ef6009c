"""The node agent's record of which worker holds which weights version (``WeightsHolders``): it
mirrors ``WorkerCore.load_weights``'s keep rule, offers the oldest holder first, never the asker,
and forgets a dead worker; and a peer's segment that does not match is refused before any byte of
the borrower's weights is written."""

from __future__ import annotations

import numpy as np
import pytest

from spotlight.actors.node.holders import WeightsHolders
from spotlight.errors import ProtocolError
from spotlight.parallel.peer import copy_into, share_arrays


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


def test_copy_into_fills_the_arrays_and_refuses_a_mismatch_untouched():
    src = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.float32)}
    seg, layout, nbytes = share_arrays(src)
    try:
        dst = {k: np.zeros_like(v) for k, v in src.items()}
        assert copy_into(dst, seg.name, layout) == sum(v.nbytes for v in src.values()) <= nbytes
        assert all(np.array_equal(dst[k], src[k]) for k in src)
        wrong = {"a": np.zeros((4, 3), dtype=np.float32), "b": np.zeros(5, dtype=np.float32)}
        with pytest.raises(ProtocolError, match="peer weight a"):
            copy_into(wrong, seg.name, layout)
        assert not wrong["b"].any()  # checked before anything was written
        with pytest.raises(ProtocolError, match="do not match"):
            copy_into({"a": dst["a"]}, seg.name, layout)
    finally:
        seg.close()
    with pytest.raises(ProtocolError, match="gone"):
        copy_into(dst, seg.name, layout)
