"""LRU with logical recency independent of pinning (vLLM 0.33 ``lru`` behaviour).

Every resident chunk has a rank ``(major, minor)``; the smallest rank is
evicted first, equal ranks by key bytes. A request gets one *request rank*
(major) the first time the policy needs it; its keys with a known end position
rank ``(request_rank, -position)``, so within a request tail chunks are older
than head chunks (positions of 2**48 tokens and more order as equal). Finishing
a request gives all its keys fresh ranks tail -> head (the head becomes the
most recent). ``touch`` gives fresh ranks in reverse order.

State in the segment: ``rank_major``/``rank_minor`` per row and the ``NEXT_RANK``
counter. In process: the ranks, the evictable rows and a lazy min-heap over
them, kept by the C core ``_lru.LRUCore`` (see ``_lru.c``), which writes the
table's ranks through. This class is the ``CachePolicy`` face of that core: it
resolves request ranks and positions and hands the core whole key lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shmtier.contract import OffloadKey, ReqContext
from shmtier.scheduler.policies._lru import LRUCore
from shmtier.scheduler.policies.base import (
    ChunkStatus,
    SegmentBackedPolicy,
    order_request_keys,
    positions_of,
)
from shmtier.shared.chunk_table import NEXT_RANK


@dataclass(slots=True)
class _RequestRank:
    owner: object
    cache_generation: int
    rank: int


class LRUCachePolicy(SegmentBackedPolicy):
    observes_store_misses = False  # on_store_miss is a no-op (see there)

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._core: LRUCore | None = None
        self._cache_generation = 0

    def bind(self, table, rows) -> None:
        super().bind(table, rows)
        self._counters = table.counters
        self._core = LRUCore(rows, table.rank_major, table.rank_minor, table.counters, NEXT_RANK)

    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.cache_generation != self._cache_generation:
            self._counters[NEXT_RANK] += 1
            state = _RequestRank(self, self._cache_generation, self._counters[NEXT_RANK])
            req_context.set_state(state)
        return state.rank

    # --- CachePolicy ---

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.insert_pending([key], [chunk.chunk_id], req_context)
        if chunk.ref_cnt == 0:
            self._core.mark_evictable([key])

    def insert_pending(self, keys: list[OffloadKey], rows: list[int],
                       req_context: ReqContext) -> None:
        """``insert`` of each (key, row) in order, for chunks whose store is pending
        (ref count -1: not evictable yet) -- the primary's allocation path, in one call."""
        self._core.insert_pending(keys, rows, positions_of(req_context),
                                  lambda: self._request_rank(req_context))

    def remove(self, key: OffloadKey) -> None:
        self._core.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._core.update_recency(list(keys), True)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing to do: the manager reports only keys that are not resident, and the
        default (``touch``) re-ranks resident keys only."""

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Raise resident keys to ``(request_rank, -position)`` if that is newer."""
        request_rank = self._request_rank(req_context)  # assigned now, even if nothing is resident
        if not isinstance(keys, list):
            keys = list(keys)
        self._core.raise_to_request(keys, positions_of(req_context), request_rank)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context) -> None:
        self._core.update_recency(order_request_keys(key_groups, req_context), True)

    def clear(self) -> None:
        self._core.clear()
        self._counters[NEXT_RANK] = 0
        self._cache_generation += 1

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        victims = self.evict_rows(n, protected)
        if victims is None:
            return None
        refcnt = self._refcnt
        return [(key, ChunkStatus(row, refcnt)) for key, row in victims]

    def evict_rows(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """``evict`` as (key, row) pairs (no ``ChunkStatus`` per victim)."""
        return self._core.evict(n, protected)

    def mark_evictable(self, key: OffloadKey) -> None:
        self._core.mark_evictable([key])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._core.mark_non_evictable([key])

    def mark_evictable_many(self, keys: list[OffloadKey]) -> None:
        self._core.mark_evictable(keys)

    def mark_non_evictable_many(self, keys: list[OffloadKey]) -> None:
        self._core.mark_non_evictable(keys)

    def rebuild(self) -> None:
        self._core.rebuild(self._refcnt)

    def close(self) -> None:
        """Release the table's buffers (before the segment is unmapped); idempotent."""
        if self._core is not None:
            self._core.close()
