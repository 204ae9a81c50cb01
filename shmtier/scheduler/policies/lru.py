"""LRU with logical recency independent of pinning (vLLM 0.33 ``lru`` behaviour).

Every resident chunk has a rank ``(major, minor)``; the smallest rank is
evicted first. A request gets one *request rank* (major) the first time the
policy needs it; its keys with a known end position rank ``(request_rank,
-position)``, so within a request tail chunks are older than head chunks.
Finishing a request gives all its keys fresh ranks tail -> head (the head
becomes the most recent). ``touch`` gives fresh ranks in reverse order.

State in the segment: ``rank_major``/``rank_minor`` per row and the ``NEXT_RANK``
counter. In process: the evictable set and a lazy min-heap of (rank, key),
the rank packed into one int (``major * _MINOR_SPAN + minor``: one int
comparison instead of a tuple's per heap step), whose stale entries are skipped at pop time and compacted when the heap grows
past twice the evictable set.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shmtier.contract import OffloadKey, ReqContext
from shmtier.scheduler.policies.base import (
    ChunkStatus,
    SegmentBackedPolicy,
    order_request_keys,
    position_getter,
)
from shmtier.shared.chunk_table import NEXT_RANK

_MIN_REBUILD = 64
# packed rank = major * _MINOR_SPAN + minor orders as (major, minor) for any
# minor = -position with 0 <= position < _MINOR_SPAN; positions are token counts,
# and larger ones (2.8e14 tokens) order as equal, their keys breaking the tie
_MINOR_SPAN = 1 << 48
_MIN_MINOR = 1 - _MINOR_SPAN

_Entry = tuple[int, OffloadKey]


def _packed(major: int, minor: int) -> int:
    return major * _MINOR_SPAN + (minor if minor > _MIN_MINOR else _MIN_MINOR)


@dataclass(slots=True)
class _RequestRank:
    owner: object
    cache_generation: int
    rank: int


class LRUCachePolicy(SegmentBackedPolicy):
    observes_store_misses = False  # on_store_miss is a no-op (see there)

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self._evictable: set[OffloadKey] = set()
        self._heap: list[_Entry] = []
        # The current heap entry of every resident key: rebuilding the heap reuses
        # these tuples, and a popped entry is current iff it *is* the key's entry.
        self._entries: dict[OffloadKey, _Entry] = {}
        self._cache_generation = 0

    def bind(self, table, rows) -> None:
        super().bind(table, rows)
        self._major = table.rank_major
        self._minor = table.rank_minor
        self._counters = table.counters

    # --- ranks: the table holds them, ``_entries`` mirrors them ---

    def _set_rank(self, key: OffloadKey, row: int, major: int, minor: int) -> _Entry:
        self._major[row] = major
        self._minor[row] = minor
        entry = self._entries[key] = (_packed(major, minor), key)
        return entry

    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.cache_generation != self._cache_generation:
            self._counters[NEXT_RANK] += 1
            state = _RequestRank(self, self._cache_generation, self._counters[NEXT_RANK])
            req_context.set_state(state)
        return state.rank

    def _update_recency(self, keys: Iterable[OffloadKey]) -> None:
        """Fresh ranks in iteration order (the last key becomes the most recent)."""
        rows, evictable, entries = self.rows, self._evictable, self._entries
        major, minor = self._major, self._minor
        next_rank = self._counters[NEXT_RANK]
        updated = []
        for key in keys:  # _set_rank(key, row, next_rank, 0), inlined: the hottest loop
            row = rows.get(key)
            if row is None:
                continue
            next_rank += 1
            major[row] = next_rank
            minor[row] = 0
            entry = entries[key] = (next_rank * _MINOR_SPAN, key)
            if key in evictable:
                updated.append(entry)
        self._counters[NEXT_RANK] = next_rank
        self._update_heap(updated)

    def _update_heap(self, updated: Sequence[_Entry]) -> None:
        if not updated:
            return
        # A heapify is linear: cheaper than many pushes for a long prefix.
        if len(updated) >= max(_MIN_REBUILD, len(self._evictable) // 4):
            self._rebuild_heap()
        else:
            for entry in updated:
                heapq.heappush(self._heap, entry)
            self._maybe_compact_heap()

    def _rebuild_heap(self) -> None:
        entries = self._entries
        self._heap = [entries[key] for key in self._evictable]
        heapq.heapify(self._heap)

    def _maybe_compact_heap(self) -> None:
        size = len(self._heap)
        if size >= _MIN_REBUILD and size >= 2 * len(self._evictable):
            self._rebuild_heap()

    # --- CachePolicy ---

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        row = chunk.chunk_id
        position = req_context.get_offload_key_position(key)
        if position is None:
            self._counters[NEXT_RANK] += 1
            entry = self._set_rank(key, row, self._counters[NEXT_RANK], 0)
        else:
            entry = self._set_rank(key, row, self._request_rank(req_context), -position)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            heapq.heappush(self._heap, entry)

    def insert_pending(self, keys: list[OffloadKey], rows: list[int],
                       req_context: ReqContext) -> None:
        """``insert`` of each (key, row) in order, for chunks whose store is pending
        (ref count -1: not evictable yet) -- the primary's allocation path, in one call."""
        request_rank = None
        counters, major, minor, entries = self._counters, self._major, self._minor, self._entries
        position_of = position_getter(req_context)
        for key, row in zip(keys, rows):
            position = position_of(key)
            if position is None:
                counters[NEXT_RANK] += 1
                major[row] = rank = counters[NEXT_RANK]
                minor[row] = 0
                entries[key] = (rank * _MINOR_SPAN, key)
            else:
                if request_rank is None:
                    request_rank = self._request_rank(req_context)
                    packed_request = request_rank * _MINOR_SPAN
                major[row] = request_rank
                minor[row] = -position
                entries[key] = (packed_request - (position if position < _MINOR_SPAN
                                                  else -_MIN_MINOR), key)

    def remove(self, key: OffloadKey) -> None:
        self._evictable.discard(key)
        self._entries.pop(key, None)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._update_recency(reversed(list(keys)))

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing to do: the manager reports only keys that are not resident, and the
        default (``touch``) re-ranks resident keys only."""

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Raise resident keys to ``(request_rank, -position)`` if that is newer."""
        request_rank = self._request_rank(req_context)  # assigned now, even if nothing is resident
        rows = self.rows
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)  # read twice below
        if rows.keys().isdisjoint(keys):  # e.g. a promotion's keys, about to be inserted
            return
        packed_request = request_rank * _MINOR_SPAN
        entries, evictable = self._entries, self._evictable
        major, minor = self._major, self._minor
        position_of = position_getter(req_context)
        updated = []
        for key in keys:
            row = rows.get(key)
            if row is None:
                continue  # not resident (e.g. about to be stored): insert ranks it
            position = position_of(key)
            if position is None:
                continue
            rank = packed_request - (position if position < _MINOR_SPAN else -_MIN_MINOR)
            if entries[key][0] >= rank:
                continue
            major[row] = request_rank  # _set_rank(key, row, request_rank, -position), inlined
            minor[row] = -position
            entry = entries[key] = (rank, key)
            if key in evictable:
                updated.append(entry)
        self._update_heap(updated)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context) -> None:
        self._update_recency(reversed(order_request_keys(key_groups, req_context)))

    def clear(self) -> None:
        self._evictable.clear()
        self._heap.clear()
        self._entries.clear()
        self._counters[NEXT_RANK] = 0
        self._cache_generation += 1

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        victims = self.evict_rows(n, protected)
        if victims is None:
            return None
        refcnt = self._refcnt
        return [(key, ChunkStatus(row, refcnt)) for key, row in victims]

    def evict_rows(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        if n == 0:
            return []
        heap, entries, evictable = self._heap, self._entries, self._evictable
        selected: list[_Entry] = []
        selected_keys: set[OffloadKey] = set()
        deferred = []
        while heap and len(selected) < n:
            entry = heapq.heappop(heap)
            key = entry[1]
            if key not in evictable or entries.get(key) is not entry:
                continue  # stale: pinned since, or re-ranked
            if key in selected_keys:  # a re-pin without rank change leaves a twin entry
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            selected_keys.add(key)
        if len(selected) < n:
            for entry in selected:
                heapq.heappush(heap, entry)
            for entry in deferred:
                heapq.heappush(heap, entry)
            return None
        for entry in deferred:
            heapq.heappush(heap, entry)
        evictable.difference_update(selected_keys)
        rows = self.rows
        victims = []
        for _, key in selected:
            del entries[key]
            victims.append((key, rows[key]))
        self._maybe_compact_heap()
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, self._entries[key])
        self._maybe_compact_heap()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)

    def mark_evictable_many(self, keys: list[OffloadKey]) -> None:
        self._evictable.update(keys)
        heap, entries, push = self._heap, self._entries, heapq.heappush
        for key in keys:
            push(heap, entries[key])
        self._maybe_compact_heap()

    def mark_non_evictable_many(self, keys: list[OffloadKey]) -> None:
        self._evictable.difference_update(keys)

    def rebuild(self) -> None:
        refcnt, major, minor = self._refcnt, self._major, self._minor
        self._entries = {key: (_packed(major[row], minor[row]), key) for key, row in self.rows.items()}
        self._evictable = {key for key, row in self.rows.items() if refcnt[row] == 0}
        self._rebuild_heap()
