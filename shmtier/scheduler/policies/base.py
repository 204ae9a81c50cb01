"""The cache-policy interface, signature-compatible with vLLM 0.33's ``CachePolicy``.

Who calls: the primary-tier manager, in the scheduler process, with the
manager's lock held; nothing here blocks.

A policy decides *which* resident chunk to evict; the manager owns slots, ref
counts and events. The manager hands every inserted chunk over as a
:class:`ChunkStatus` whose ``ref_cnt`` reads and writes the chunk table in the
segment, so an out-of-tree policy written for vLLM (which keeps its own
``key -> ChunkStatus`` dict) always sees live reference counts.

Built-in policies are :class:`SegmentBackedPolicy` subclasses: they keep their
state (LRU ranks, ARC lists and target) in the chunk table and hold only
rebuildable accelerators in process memory. The manager calls ``bind`` right
after construction, and ``rebuild`` after attaching to a segment that already
holds chunks (warm restart).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

from shmtier.contract import OffloadKey, ReqContext
from shmtier.shared.chunk_table import ChunkTable


class ChunkStatus:
    """Reference count and slot of one resident chunk.

    ``ref_cnt``: -1 write pending (not readable, not evictable), 0 ready and
    evictable, n > 0 pinned by n readers. ``chunk_id`` is the arena row.
    Backed by the chunk table when the manager creates it; a standalone
    ``ChunkStatus(chunk_id)`` (as vLLM's constructor) keeps a private count.
    """

    __slots__ = ("chunk_id", "_refs", "_index")

    def __init__(self, chunk_id: int, refcnt=None):
        self.chunk_id = chunk_id
        if refcnt is None:
            self._refs, self._index = [-1], 0
        else:
            self._refs, self._index = refcnt, chunk_id

    @property
    def ref_cnt(self) -> int:
        return self._refs[self._index]

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        self._refs[self._index] = value

    @property
    def is_ready(self) -> bool:
        return self._refs[self._index] >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


def positions_of(req_context: ReqContext) -> dict[OffloadKey, int] | Callable[[OffloadKey], int | None]:
    """Where ``req_context`` keeps its keys' end positions: its own dict when it has one
    (shmtier's and vLLM's contexts do; read without a Python call per key), else its
    ``get_offload_key_position``."""
    positions = getattr(req_context, "_offload_key_positions", None)
    return positions if isinstance(positions, dict) else req_context.get_offload_key_position


def sort_by_position(keys: list[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """Sort ``keys`` in place head-to-tail by recorded end position, if every
    key has one (otherwise keep the given order); returns ``keys``."""
    positions = getattr(req_context, "_offload_key_positions", None)
    if positions is None:  # a foreign context type: use the public accessor
        positions = {}
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is not None:
                positions[key] = position
    if all(map(positions.__contains__, keys)):
        keys.sort(key=positions.__getitem__)
    return keys


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext
) -> list[OffloadKey]:
    """Flatten ``key_groups`` head-to-tail; sort by recorded positions if all are known."""
    return sort_by_position([key for group in key_groups for key in group], req_context)


class CachePolicy(ABC):
    """Chunk organisation and replacement decisions (vLLM 0.33 interface).

    ``observes_store_misses`` (shmtier's, optional): False when ``on_store_miss`` does
    nothing, so the manager need not call it."""

    observes_store_misses: bool = True

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The chunk of ``key``, or None if not resident."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """Add a newly allocated chunk (ARC: also drops ``key`` from the ghost lists)."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a chunk whose store failed."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used (the first key becomes the most recent)."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys about to be stored, seen before ``insert`` (default: ``touch``)."""
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """First accesses of a request to ``keys`` (may not be resident)."""
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """One request-scoped access in head-to-tail order (default: touch per group)."""
        del insertion_only_keys, reused_keys
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` ready, unpinned, unprotected chunks, or none (None)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything, adaptive state included."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref count went to 0."""
        return

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref count left 0."""
        return


class SegmentBackedPolicy(CachePolicy):
    """A built-in policy whose state lives in the segment's chunk table.

    ``rows`` is the manager's ``key -> row`` dict (shared, not copied): the
    manager adds a key before ``insert`` and drops it after ``remove`` or
    ``evict``.
    """

    table: ChunkTable
    rows: dict[OffloadKey, int]

    def bind(self, table: ChunkTable, rows: dict[OffloadKey, int]) -> None:
        self.table = table
        self.rows = rows
        self._refcnt = table.refcnt

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        row = self.rows.get(key)
        return None if row is None else ChunkStatus(row, self._refcnt)

    @abstractmethod
    def rebuild(self) -> None:
        """Recreate process-local accelerators from the table (after attach)."""

    def close(self) -> None:
        """Release anything that holds the table's memory (the manager's shutdown, before
        the segment is unmapped); idempotent. Default: nothing to release."""
