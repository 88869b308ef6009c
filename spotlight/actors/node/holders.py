"""Which of a node's workers hold which weights versions, so a worker that lacks one copies it from
a neighbour instead of the tensor store (each node fetches a version across the network once).

The node agent hands every lease, so it knows without asking: a worker handed a lease at version v
holds v from then on (or is loading it: a borrower waits for that load), and keeps the versions
``WorkerCore.load_weights`` keeps — the current one plus the ``runtime.worker_versions`` newest it
held before (when that is > 1). ``WeightsHolders`` mirrors that rule. The mirror can still be
wrong (a load failed, a worker was killed and its death not yet seen): a hint is a hint, and the
worker falls back to the store when the peer does not lend.

Peers are offered in the order they were handed the version: the first is the one that fetched it
from the store (or the oldest copy), so borrowers fan out from the root instead of waiting on
each other in a chain, and two workers can never be each other's hint for a version both are
loading for the first time.

Pure bookkeeping, no I/O: the agent (``spotlight.actors.node.core``) and its SP groups
(``spotlight.actors.node.sp``) call it; ``tests/unit/test_weights_holders.py`` tests it alone.
"""

from __future__ import annotations


class WeightsHolders:
    """Per worker: the version it holds now and the older ones it keeps."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._current: dict[str, int] = {}  # worker -> the version it was last handed
        self._kept: dict[str, set[int]] = {}  # worker -> older versions it keeps a copy of
        self._since: dict[tuple[str, int], int] = {}  # (worker, version) -> when it got it
        self._clock = 0

    def holds(self, worker: str) -> set[int]:
        cur = self._current.get(worker)
        return (set() if cur is None else {cur}) | self._kept.get(worker, set())

    def peers(self, version: int, *, exclude: str) -> list[str]:
        """Workers holding (or loading) ``version``, other than ``exclude``, oldest holder first."""
        found = [w for w in self._current if w != exclude and version in self.holds(w)]
        return sorted(found, key=lambda w: self._since[(w, version)])

    def handed(self, worker: str, version: int) -> None:
        """``worker`` was handed a lease at ``version``: it holds it from now on. Its previous
        version joins its kept copies, of which the ``keep`` newest stay (WorkerCore's rule)."""
        cur = self._current.get(worker)
        if cur == version:
            return
        kept = set(self._kept.get(worker, set()))
        if self.keep > 1 and cur is not None:
            kept.add(cur)
        kept = set(sorted(kept)[-self.keep:]) if self.keep > 1 else set()
        self._current[worker], self._kept[worker] = version, kept
        self._clock += 1
        held = kept | {version}
        self._since = {k: t for k, t in self._since.items() if k[0] != worker or k[1] in held}
        self._since.setdefault((worker, version), self._clock)

    def forget(self, worker: str) -> None:
        """``worker`` died or restarted: it holds nothing."""
        self._current.pop(worker, None)
        self._kept.pop(worker, None)
        self._since = {k: t for k, t in self._since.items() if k[0] != worker}
