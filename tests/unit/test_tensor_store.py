"""Unit tests of TensorStoreCore: keys, commits, weights versions, the byte cap, the config."""

from __future__ import annotations

import numpy as np
import pytest

from spotlight.actors.store.core import TensorStoreConfig, TensorStoreCore
from spotlight.errors import CapacityError, NotFound


def arr(n: int, fill: float = 1.0) -> np.ndarray:
    return np.full(n, fill, dtype=np.float32)  # n * 4 bytes


def snapshot(core: TensorStoreCore) -> tuple:
    return core.bytes_held, core.keys(), core.versions(), core.latest_version()


# --- keys ----------------------------------------------------------------------------------------
def test_put_get_delete_roundtrip():
    core = TensorStoreCore()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    core.put("traj/a", {"x": x, "lp": np.ones(2, np.float64)}, {"reward": 0.5})
    tensors, meta = core.get("traj/a")
    np.testing.assert_array_equal(tensors["x"], x)
    assert tensors["lp"].dtype == np.float64
    assert meta == {"reward": 0.5}
    assert core.bytes_held == x.nbytes + 16
    assert core.keys() == ["traj/a"] and core.keys("traj/") == ["traj/a"] and core.keys("z") == []
    assert core.delete("traj/a") is True
    assert core.delete("traj/a") is False
    assert core.bytes_held == 0
    with pytest.raises(NotFound, match="traj/a"):
        core.get("traj/a")


def test_stored_tensors_are_read_only_and_replace_accounts_bytes():
    core = TensorStoreCore()
    core.put("k", {"x": arr(10)})
    got, _ = core.get("k")
    with pytest.raises(ValueError):
        got["x"][0] = 5.0
    core.put("k", {"x": arr(3)})
    assert core.bytes_held == 12


def test_put_rejects_bad_input():
    core = TensorStoreCore()
    with pytest.raises(ValueError, match="reserved"):
        core.put("commit/r1", {"x": arr(1)})
    with pytest.raises(ValueError, match="key"):
        core.put("", {"x": arr(1)})
    with pytest.raises(TypeError, match="np.ndarray"):
        core.put("k", {"x": [1, 2]})
    with pytest.raises(TypeError, match="object"):
        core.put("k", {"x": np.array([object()])})
    assert core.keys() == [] and core.bytes_held == 0


# --- commits -------------------------------------------------------------------------------------
def test_commit_newest_wins_even_out_of_order():
    core = TensorStoreCore()
    assert core.get_commit("r1") is None
    assert core.commit("r1", 3, {"x_t": arr(4, 3.0)}, {"attempt": 1}) is True
    assert core.commit("r1", 1, {"x_t": arr(4, 1.0)}) is False  # late, older step: ignored
    assert core.commit("r1", 5, {"x_t": arr(4, 5.0)}, {"attempt": 1}) is True
    assert core.commit("r1", 4, {"x_t": arr(8, 4.0)}) is False
    step, tensors, meta = core.get_commit("r1")
    assert step == 5 and meta == {"attempt": 1}
    np.testing.assert_array_equal(tensors["x_t"], arr(4, 5.0))
    assert core.bytes_held == 16
    assert core.keys("commit/") == ["commit/r1"]
    assert core.get("commit/r1")[1] == {"attempt": 1}


def test_commit_same_step_replaces_and_drop_frees():
    core = TensorStoreCore()
    core.commit("r", 2, {"x": arr(4, 1.0)})
    assert core.commit("r", 2, {"x": arr(2, 2.0)}) is True
    assert core.get_commit("r")[1]["x"].tolist() == [2.0, 2.0]
    assert core.bytes_held == 8
    assert core.drop_commit("r") is True and core.drop_commit("r") is False
    assert core.get_commit("r") is None and core.bytes_held == 0
    with pytest.raises(ValueError, match="step"):
        core.commit("r", -1, {})


def test_append_commits_join_rows_on_read_and_refuse_gaps():
    core = TensorStoreCore(TensorStoreConfig(max_bytes=1000))
    rows = lambda *vals: np.array([[v, v] for v in vals], np.float32)  # noqa: E731  (one row per step)
    assert core.commit("r", 1, {"lat": rows(0, 1), "lp": rows(10)}) is True  # full: steps 0..1
    assert core.commit("r", 2, {"lat": rows(2), "lp": rows(11)}, base=1) is True
    assert core.commit("r", 3, {"lat": rows(3), "lp": rows(12)}, {"attempt": 2}, base=2) is True
    assert core.bytes_held == 8 * 7
    assert core.commit("r", 3, {"lat": rows(9), "lp": rows(9)}, base=2) is False  # late twin: ignored
    with pytest.raises(NotFound, match="holds step 3"):
        core.commit("r", 5, {"lat": rows(5), "lp": rows(14)}, base=4)  # a gap: nothing to build on
    with pytest.raises(NotFound, match="holds none"):
        core.commit("other", 2, {"lat": rows(2)}, base=1)
    with pytest.raises(ValueError, match="do not extend"):
        core.commit("r", 4, {"lat": np.zeros((1, 3), np.float32), "lp": rows(13)}, base=3)
    with pytest.raises(ValueError, match="do not match"):
        core.commit("r", 4, {"lat": rows(4)}, base=3)
    with pytest.raises(ValueError, match="base"):
        core.commit("r", 4, {"lat": rows(4), "lp": rows(13)}, base=4)
    step, tensors, meta = core.get_commit("r")
    assert step == 3 and meta == {"attempt": 2} and core.bytes_held == 8 * 7
    np.testing.assert_array_equal(tensors["lat"], rows(0, 1, 2, 3))
    np.testing.assert_array_equal(tensors["lp"], rows(10, 11, 12))
    assert core.commit("r", 4, {"lat": rows(4), "lp": rows(13)}, base=3) is True  # appends after a read too
    np.testing.assert_array_equal(core.get_commit("r")[1]["lat"], rows(0, 1, 2, 3, 4))
    assert core.commit("r", 4, {"lat": rows(7, 7, 7, 7, 7), "lp": rows(7, 7, 7, 7)}) is True  # full replaces
    assert core.bytes_held == 8 * 9


def test_seal_moves_the_commit_to_a_key_without_copying_twice():
    core = TensorStoreCore(TensorStoreConfig(max_bytes=100))
    core.commit("r", 1, {"lat": arr(4, 1.0)})
    core.commit("r", 2, {"lat": arr(4, 2.0)}, base=1)  # 32 B held
    with pytest.raises(CapacityError):
        core.seal_commit("r", 2, "traj/r", {"rewards": arr(18)})  # 32 + 72 > 100: nothing moves
    with pytest.raises(ValueError, match="already in the commit"):
        core.seal_commit("r", 2, "traj/r", {"lat": arr(1)})
    with pytest.raises(ValueError, match="commit namespace"):
        core.seal_commit("r", 2, "commit/x")
    with pytest.raises(NotFound, match="holds step 2"):  # the final commit never landed: refuse
        core.seal_commit("r", 3, "traj/r")
    core.seal_commit("r", 2, "traj/r", {"rewards": arr(2, 0.5)}, {"worker": "w"})
    tensors, meta = core.get("traj/r")
    assert tensors["lat"].tolist() == [1.0] * 4 + [2.0] * 4 and tensors["rewards"].tolist() == [0.5, 0.5]
    assert meta == {"worker": "w"} and core.get_commit("r") is None and core.bytes_held == 40
    with pytest.raises(NotFound, match="holds none"):
        core.seal_commit("r", 2, "traj/r")
    core.delete("traj/r")
    assert core.bytes_held == 0


# --- weights -------------------------------------------------------------------------------------
def test_weights_immutable_and_increasing():
    core = TensorStoreCore()
    assert core.latest_version() is None
    core.publish_weights(1, {"w": arr(4, 1.0)})
    with pytest.raises(ValueError, match="immutable"):
        core.publish_weights(1, {"w": arr(4, 9.0)})
    core.publish_weights(3, {"w": arr(4, 3.0)})
    with pytest.raises(ValueError, match="increase"):
        core.publish_weights(2, {"w": arr(4, 2.0)})
    assert core.latest_version() == 3
    assert core.get_weights(1)["w"][0] == 1.0  # unchanged by the refused re-publish
    with pytest.raises(ValueError):
        core.get_weights(3)["w"][0] = 0.0  # handed-out views are read-only


def test_old_versions_freed_unless_pinned():
    core = TensorStoreCore(TensorStoreConfig(keep_versions=2))
    for v in (1, 2):
        core.publish_weights(v, {"w": arr(10, v)})
    core.pin_version(1)
    assert core.publish_weights(3, {"w": arr(10, 3)}) == []
    assert core.versions() == [1, 2, 3]
    assert core.publish_weights(4, {"w": arr(10, 4)}) == [2]
    assert core.versions() == [1, 3, 4]
    with pytest.raises(NotFound, match="version 2 was freed"):
        core.get_weights(2)
    with pytest.raises(NotFound, match="version 7 is unknown"):
        core.get_weights(7)
    assert core.unpin_version(1) == [1]
    assert core.versions() == [3, 4] and core.bytes_held == 80
    with pytest.raises(NotFound, match="not held"):
        core.pin_version(1)


# --- the cap -------------------------------------------------------------------------------------
def test_capacity_error_leaves_state_unchanged():
    core = TensorStoreCore(TensorStoreConfig(max_bytes=100))
    core.put("a", {"x": arr(10)})  # 40 B
    core.commit("r", 1, {"x": arr(5)})  # 20 B
    before = snapshot(core)
    with pytest.raises(CapacityError, match=r"current 60 B.*cap 100 B") as exc:
        core.put("b", {"x": arr(11)})  # 44 B
    assert "needs 44 B" in str(exc.value)
    with pytest.raises(CapacityError):
        core.commit("r", 2, {"x": arr(16)})  # 60 - 20 + 64 > 100
    with pytest.raises(CapacityError):
        core.publish_weights(1, {"w": arr(11)})
    assert snapshot(core) == before
    assert core.get_commit("r")[0] == 1
    with pytest.raises(NotFound):
        core.get("b")
    core.put("a", {"x": arr(20)})  # replacing frees the old 40 B first: 80 B fits
    assert core.bytes_held == 100


def test_publish_counts_versions_it_frees():
    core = TensorStoreCore(TensorStoreConfig(max_bytes=100, keep_versions=1))
    core.publish_weights(1, {"w": arr(20)})  # 80 B
    core.publish_weights(2, {"w": arr(20)})  # frees v1 in the same step: fits
    assert core.versions() == [2] and core.bytes_held == 80


# --- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_bytes": 0}, "max_bytes"), ({"max_bytes": 1.5}, "max_bytes"),
     ({"keep_versions": 0}, "keep_versions"), ({"keep_versions": True}, "keep_versions")],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TensorStoreConfig(**kwargs)


# --- shared-memory segments (service side + client side, in one process) -------------------------
def test_shm_segments_recycle_and_readers_detect_a_recycle():
    import gc

    from spotlight.comm.shm import ClientMappings, ServiceSegments
    from spotlight.errors import ProtocolError

    segs, maps = ServiceSegments(pool_bytes=16 << 20), ClientMappings()
    core = TensorStoreCore()
    try:
        x = np.arange(1 << 18, dtype=np.float32)
        name, gen = segs.lend(x.nbytes)
        maps.write(name, gen, x)
        core.put("k", {"x": segs.adopt(name, gen, "float32", [x.size])})
        held = core.get("k")[0]["x"]
        assert segs.ref_of(held) == {"name": name, "gen": gen}
        np.testing.assert_array_equal(maps.read(name, gen, "float32", [x.size]), x)
        with pytest.raises(ProtocolError, match="not lent"):
            segs.adopt(name, gen, "float32", [x.size])  # adopted once only
        del held
        core.delete("k")
        gc.collect()
        assert segs.free_bytes > 0  # the last view died: back in the pool
        name2, gen2 = segs.lend(x.nbytes)
        assert (name2, gen2) == (name, gen + 1)  # same warm segment, next generation
        with pytest.raises(ProtocolError, match="recycled"):
            maps.read(name, gen, "float32", [x.size])  # a reader of the old data notices
        with pytest.raises(ProtocolError, match="dtype"):
            segs.adopt(name2, gen2, "object", [1])
    finally:
        maps.close()
        segs.close()
