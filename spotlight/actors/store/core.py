"""The tensor store's logic: keyed tensors, per-request commits and weights versions.

Run the service: ``python -m spotlight.actors.store --bind tcp://0.0.0.0:5560``.

``TensorStoreCore`` is a plain, single-threaded class with no sockets, no event loop and no
knowledge of the wire; the process shell and the client live in ``service.py`` and
``client.py``. It holds
three namespaces:

* **keys** — ``put``/``get``/``delete``/``keys``: arbitrary named tensor bundles (trajectories…).
* **commits** — ``commit``/``get_commit``/``drop_commit``/``seal_commit``: the newest rollout
  state of a request, kept under the key ``f"commit/{request_id}"`` so it also shows in
  ``keys("commit/")``. Commits may arrive out of order (two attempts of a request, retries), so an
  older step never replaces a newer one. A commit is either *full* (the whole state) or an
  *append* onto the held commit at step ``base`` (only the new rows of each tensor, concatenated
  along axis 0 on read), so a K-step rollout sends O(K) bytes, not O(K²). ``seal_commit`` turns
  the final commit into a keyed entry (the trajectory) without sending it again.
* **weights** — ``publish_weights``/``get_weights``/``latest_version``: immutable, strictly
  increasing versions; only the newest ``keep_versions`` plus pinned ones are held.

Every byte of tensor data held is accounted against ``max_bytes``; an operation that would cross
the cap raises ``CapacityError`` and changes nothing (metadata dicts are small and not counted).

Ownership: the core keeps the arrays it is given (no copy) and hands out read-only views of
them, so a reader can never corrupt a stored tensor. A caller that wants to keep mutating its own
arrays must pass copies (the in-process client does this for you).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from spotlight.errors import CapacityError, NotFound

COMMIT_PREFIX = "commit/"

Tensors = dict[str, np.ndarray]


@dataclass(kw_only=True, slots=True)
class TensorStoreConfig:
    """Limits of one tensor store."""

    max_bytes: int = 8 << 30
    """Cap on tensor bytes held across keys, commits and weights (> 0)."""
    keep_versions: int = 2
    """How many of the newest weights versions stay held besides pinned ones (>= 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be an int > 0, got {self.max_bytes!r}")
        if (
            not isinstance(self.keep_versions, int)
            or isinstance(self.keep_versions, bool)
            or self.keep_versions < 1
        ):
            raise ValueError(f"keep_versions must be an int >= 1, got {self.keep_versions!r}")


def _frozen(tensors: Mapping[str, np.ndarray]) -> Tensors:
    """Validate a tensor bundle and return read-only views of its arrays."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of name -> np.ndarray, got {type(tensors).__name__}")
    out: Tensors = {}
    for name, arr in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"tensor {name!r} must be np.ndarray, got {type(arr).__name__}")
        if arr.dtype.hasobject:
            # Object arrays hold pointers, not data: they cannot be accounted or sent.
            raise TypeError(f"tensor {name!r} has dtype object, which the store refuses")
        view = arr.view()
        view.flags.writeable = False
        out[name] = view
    return out


def _nbytes(tensors: Mapping[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in tensors.values())


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty str, got {key!r}")
    return key


@dataclass(slots=True)
class _Entry:
    tensors: Tensors
    meta: dict
    nbytes: int
    step: int | None = None  # set for commits only
    rows: dict[str, list[np.ndarray]] | None = None  # a commit's appended row blocks, not yet joined

    def joined(self) -> Tensors:
        """The tensors with appended rows concatenated (done once, on read)."""
        if self.rows:
            self.tensors = {name: _readonly(np.concatenate([self.tensors[name], *self.rows[name]]))
                            for name in self.tensors}
            self.rows = None
        return self.tensors


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class TensorStoreCore:
    """In-memory tensor store with a byte cap. Not thread-safe; one owner drives it."""

    def __init__(self, config: TensorStoreConfig | None = None) -> None:
        self.config = config or TensorStoreConfig()
        self._entries: dict[str, _Entry] = {}
        self._weights: dict[int, tuple[Tensors, int]] = {}  # version -> (tensors, nbytes)
        self._latest: int | None = None  # newest version ever published, even once freed
        self._pinned: set[int] = set()
        self._bytes = 0

    # --- accounting ----------------------------------------------------------------------------
    @property
    def bytes_held(self) -> int:
        return self._bytes

    def _reserve(self, what: str, requested: int, released: int = 0) -> None:
        """Raise CapacityError if holding ``requested`` more bytes (minus ``released``) crosses the cap."""
        after = self._bytes - released + requested
        if after > self.config.max_bytes:
            raise CapacityError(
                f"tensor store full: {what} needs {requested} B "
                f"(current {self._bytes} B, freeing {released} B, cap {self.config.max_bytes} B)"
            )

    def stats(self) -> dict[str, Any]:
        return {
            "bytes_held": self._bytes,
            "max_bytes": self.config.max_bytes,
            "keys": len(self._entries),
            "versions": sorted(self._weights),
            "pinned": sorted(self._pinned),
        }

    # --- keys --------------------------------------------------------------------------------
    def put(self, key: str, tensors: Mapping[str, np.ndarray], meta: dict | None = None) -> None:
        """Store (or replace) a bundle under ``key``. Keys under ``commit/`` are reserved."""
        _check_key(key)
        if key.startswith(COMMIT_PREFIX):
            # Commit entries carry a step that put() would bypass; keep one way in.
            raise ValueError(f"key {key!r} is reserved for commits; use commit()")
        frozen = _frozen(tensors)
        size = _nbytes(frozen)
        old = self._entries.get(key)
        self._reserve(f"put {key!r}", size, old.nbytes if old else 0)
        self._replace(key, _Entry(frozen, dict(meta or {}), size))

    def get(self, key: str) -> tuple[Tensors, dict]:
        """Return ``(tensors, meta)``; the arrays are read-only views of the stored data."""
        entry = self._entries.get(_check_key(key))
        if entry is None:
            raise NotFound(f"no tensors under key {key!r}")
        return dict(entry.joined()), dict(entry.meta)

    def delete(self, key: str) -> bool:
        """Free ``key``; returns False if it did not exist (deleting is idempotent)."""
        entry = self._entries.pop(_check_key(key), None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(k for k in self._entries if k.startswith(prefix))

    def _replace(self, key: str, entry: _Entry) -> None:
        old = self._entries.get(key)
        self._bytes += entry.nbytes - (old.nbytes if old else 0)
        self._entries[key] = entry

    # --- commits -------------------------------------------------------------------------------
    @staticmethod
    def commit_key(request_id: str) -> str:
        return COMMIT_PREFIX + _check_key(request_id)

    def commit(
        self, request_id: str, step: int, tensors: Mapping[str, np.ndarray], meta: dict | None = None,
        *, base: int | None = None,
    ) -> bool:
        """Keep this commit if ``step`` is newer than the held one; returns whether it was kept.

        Full commit (``base`` None): the whole state; one at the same step as the held one
        replaces it (a retried write is idempotent). Append (``base`` = the step it builds on):
        each tensor's rows are added after the held commit's, which must be at step ``base``
        and hold the same tensor names. A commit at a step not newer than the held one is a
        late arrival (another attempt got there first; attempts compute the same states) and is
        ignored without touching the cap. An append with nothing to build on raises NotFound.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        key = self.commit_key(request_id)
        old = self._entries.get(key)
        if base is None:
            if old is not None and old.step is not None and step < old.step:
                return False
            frozen = _frozen(tensors)
            size = _nbytes(frozen)
            self._reserve(f"commit {request_id!r} step {step}", size, old.nbytes if old else 0)
            self._replace(key, _Entry(frozen, dict(meta or {}), size, step))
            return True
        if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < step:
            raise ValueError(f"append base must be an int in [0, step={step}), got {base!r}")
        if old is not None and old.step is not None and step <= old.step:
            return False
        if old is None or old.step != base:
            held = "none" if old is None else f"step {old.step}"
            raise NotFound(f"append to commit {request_id!r} at step {base}, but the store holds {held}")
        frozen = _frozen(tensors)
        if frozen.keys() != old.tensors.keys():
            raise ValueError(f"append to commit {request_id!r}: tensors {sorted(frozen)} do not match "
                             f"the held {sorted(old.tensors)}")
        for name, arr in frozen.items():
            held_arr = old.tensors[name]
            if arr.dtype != held_arr.dtype or arr.shape[1:] != held_arr.shape[1:] or arr.ndim == 0:
                raise ValueError(
                    f"append to commit {request_id!r}: {name!r} rows {arr.dtype}{list(arr.shape)} "
                    f"do not extend {held_arr.dtype}{list(held_arr.shape)}"
                )
        size = _nbytes(frozen)
        self._reserve(f"commit {request_id!r} step {step}", size)
        rows = old.rows if old.rows is not None else {name: [] for name in old.tensors}
        for name, arr in frozen.items():
            rows[name].append(arr)
        self._replace(key, _Entry(old.tensors, dict(meta or {}), old.nbytes + size, step, rows))
        return True

    def get_commit(self, request_id: str) -> tuple[int, Tensors, dict] | None:
        """Return ``(step, tensors, meta)`` of the newest commit, or None if there is none."""
        entry = self._entries.get(self.commit_key(request_id))
        if entry is None:
            return None
        assert entry.step is not None
        return entry.step, dict(entry.joined()), dict(entry.meta)

    def seal_commit(
        self,
        request_id: str,
        step: int,
        key: str,
        tensors: Mapping[str, np.ndarray] | None = None,
        meta: dict | None = None,
    ) -> None:
        """Move a request's commit at ``step`` to ``key`` (its final result, e.g. the
        trajectory), adding ``tensors`` (e.g. rewards) and replacing its meta by ``meta``.
        Nothing is copied but the joining of appended rows. A commit at any other step (one
        was refused, or another attempt's is newer) raises NotFound and changes nothing."""
        entry = self._entries.get(self.commit_key(request_id))
        if entry is None or entry.step != step:
            held = "none" if entry is None else f"step {entry.step}"
            raise NotFound(f"no commit of {request_id!r} at step {step} to seal (the store holds {held})")
        extra = _frozen(tensors or {})
        clash = extra.keys() & entry.tensors.keys()
        if clash:
            raise ValueError(f"seal of {request_id!r}: tensors {sorted(clash)} are already in the commit")
        _check_key(key)
        if key.startswith(COMMIT_PREFIX):
            raise ValueError(f"seal of {request_id!r}: key {key!r} is in the commit namespace")
        size = _nbytes(extra)
        old = self._entries.get(key)
        self._reserve(f"seal {request_id!r} as {key!r}", size, old.nbytes if old else 0)
        joined = {**entry.joined(), **extra}
        del self._entries[self.commit_key(request_id)]
        self._bytes -= entry.nbytes
        self._replace(key, _Entry(joined, dict(meta or {}), entry.nbytes + size))

    def drop_commit(self, request_id: str) -> bool:
        """Free a request's commit (its result was accepted). Returns False if none was held."""
        return self.delete(self.commit_key(request_id))

    # --- weights ------------------------------------------------------------------------------
    def publish_weights(self, version: int, tensors: Mapping[str, np.ndarray]) -> list[int]:
        """Publish ``version`` (> every earlier one); returns the versions freed by retention."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if self._latest is not None and version <= self._latest:
            if version in self._weights or version == self._latest:
                raise ValueError(f"weights version {version} is already published and immutable")
            raise ValueError(
                f"weights version {version} is older than the latest published {self._latest}; "
                "versions must increase"
            )
        frozen = _frozen(tensors)
        size = _nbytes(frozen)
        # The publish frees old versions in the same step, so count them as released.
        doomed = self._retention_victims(version)
        released = sum(self._weights[v][1] for v in doomed)
        self._reserve(f"publish weights v{version}", size, released)
        self._weights[version] = (frozen, size)
        self._bytes += size
        self._latest = version
        for v in doomed:
            self._bytes -= self._weights.pop(v)[1]
        return doomed

    def _retention_victims(self, new_version: int) -> list[int]:
        """Versions that retention frees once ``new_version`` is held."""
        held = sorted([*self._weights, new_version], reverse=True)
        keep = set(held[: self.config.keep_versions]) | self._pinned
        return sorted(v for v in self._weights if v not in keep)

    def get_weights(self, version: int) -> Tensors:
        held = self._weights.get(version)
        if held is None:
            if self._latest is not None and version < self._latest:
                raise NotFound(f"weights version {version} was freed (latest is {self._latest})")
            raise NotFound(f"weights version {version} is unknown (latest is {self._latest})")
        return dict(held[0])

    def latest_version(self) -> int | None:
        return self._latest

    def versions(self) -> list[int]:
        return sorted(self._weights)

    def pin_version(self, version: int) -> None:
        """Keep ``version`` held past retention (e.g. while exploration still samples with it)."""
        if version not in self._weights:
            raise NotFound(f"cannot pin weights version {version}: not held")
        self._pinned.add(version)

    def unpin_version(self, version: int) -> list[int]:
        """Release a pin; returns versions freed because retention no longer keeps them."""
        self._pinned.discard(version)
        if self._latest is None:
            return []
        newest = sorted(self._weights, reverse=True)[: self.config.keep_versions]
        keep = set(newest) | self._pinned
        freed = sorted(v for v in self._weights if v not in keep)
        for v in freed:
            self._bytes -= self._weights.pop(v)[1]
        return freed
