"""The CPU primary tier: chunk slots in the segment arena, ref counts, eviction.

Who calls: the scheduler process only (vLLM's connector scheduler half, or the
tiering manager), holding the manager's lock as the offloading contract
requires (docs/vllm-contract.md §1.4). No method blocks or does I/O.

Semantics are vLLM 0.33's ``CPUOffloadingManager`` (docs/vllm-contract.md §3.2): ref counts
-1 (write pending) / 0 (ready, evictable) / n (pinned by n readers); fresh
slots before reused ones (LIFO free list); ``prepare_store`` returns None when
eviction cannot free enough and never evicts a key of the current offer;
events for stores and evictions (metadata-only on a failed store, none on
reset).

State: the chunk table in the segment (key, ref count, policy state per row,
the high-water mark of allocated rows) is the source of truth. In process
memory live only accelerators, rebuilt from the table by ``attach=True``: the
``key -> row`` dict, the free list, counters, and the policy's heaps/lists. The
per-key work on the dict and the table (classify an offer, claim rows, pin,
unpin, release) is ``_rows.RowIndex``, in C: it runs every step, cold.

Size (over 600 lines): the chunk table, the ref counts and the eviction policy change
together in every call and must agree on each row's state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np

from shmtier import metrics
from shmtier.contract import (
    CacheHitSource,
    CPULoadStoreSpec,
    GROUP_SUFFIX_LEN,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from shmtier.scheduler._rows import RowIndex, first_accesses
from shmtier.scheduler.policies.base import ChunkStatus, SegmentBackedPolicy, sort_by_position
from shmtier.scheduler.policies.factory import CachePolicyFactory
from shmtier.shared.chunk_table import NUM_ALLOCATED, ChunkTable, KeyTooLongError
from shmtier.shared.segment import Segment


@dataclass(slots=True)
class _RequestCacheAccess:
    """Keys one request touched in this cache generation, for the policy's
    end-of-request hook. A key this request inserted and later re-read (a
    cascade or promotion) is not a reuse."""

    owner: object
    cache_generation: int
    # KV-cache group index (get_offload_group_idx) -> keys of that group, first access first
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen_keys: set[OffloadKey] = field(default_factory=set)
    inserted_keys: set[OffloadKey] = field(default_factory=set)
    reused_keys: set[OffloadKey] = field(default_factory=set)
    store_miss_keys: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class CPUOffloadingManager:
    """CPU tier manager over a chunk table (in a segment, or private).

    ``cache_policy`` names a registered policy (``lru``, ``arc``) or, with
    ``cache_policy_module_path``, an out-of-tree class. ``store_threshold`` >= 2
    stores a chunk only after that many offers (tracked for up to
    ``max_tracker_size`` keys). ``attach=True`` adopts what the table already
    holds instead of clearing it (see ``_adopt_table``).
    """

    medium = Medium.CPU

    def __init__(
        self,
        table: ChunkTable,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: metrics.ConfigInfo | None = None,
        *,
        attach: bool = False,
    ):
        policy_cls = CachePolicyFactory.get_cache_policy_cls(cache_policy, cache_policy_module_path)
        self._table = table
        self._num_chunks = table.num_chunks
        self._key_width = table.key_width
        self._refcnt = table.refcnt
        self._counters = table.counters
        self._rows: dict[OffloadKey, int] = {}
        # the per-key work on _rows and the table (claim, pin, release ...), in C
        self._index = RowIndex(self._rows, table.keys, table.key_len, table.refcnt, table.tiers,
                               table.key_width)
        self._free_list: list[int] = []
        self._config_info = info.as_config_info() if info is not None else {}
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._policy = policy_cls(cache_capacity=self._num_chunks)
        # a policy that ignores store misses (LRU) saves the per-request bookkeeping
        self._observes_store_misses = getattr(self._policy, "observes_store_misses", True)
        if isinstance(self._policy, SegmentBackedPolicy):
            self._policy.bind(table, self._rows)
        self._mark_evictable = self._policy_hook("mark_evictable")
        self._mark_non_evictable = self._policy_hook("mark_non_evictable")
        self._num_evictable = 0
        self._num_write_pending = 0
        self._cache_generation = 0
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []
        self.counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        if attach:
            self._adopt_table()
        else:
            table.clear()

    @property
    def lock(self):
        """No-op: a plain CPU manager is driven from one thread (docs/vllm-contract.md §1.4)."""
        return nullcontext()

    # --- rows ---

    def _adopt_table(self) -> None:
        """Rebuild the accelerators from a table written by an earlier owner.

        Writes that were pending when that owner died will never complete, so
        their rows are freed; pins held by its jobs are dropped.
        """
        table, refcnt = self._table, self._refcnt
        key_len = table.numpy("key_len")
        for row in np.flatnonzero(key_len).tolist():
            if refcnt[row] < 0:
                key_len[row] = 0
                continue
            refcnt[row] = 0
            self._rows[table.read_key(row)] = row
        del key_len
        allocated = self._counters[NUM_ALLOCATED]
        used = set(self._rows.values())
        self._free_list = [row for row in range(allocated) if row not in used]
        self._num_evictable = len(self._rows)
        policy = self._policy
        if isinstance(policy, SegmentBackedPolicy):
            policy.rebuild()
        else:
            adopt_ctx = ReqContext(req_id="shmtier-attach")
            for key, row in sorted(self._rows.items(), key=lambda kr: kr[1]):
                policy.insert(key, ChunkStatus(row, refcnt), adopt_ctx)

    def _allocate(self, keys: list[OffloadKey], req_context: ReqContext) -> list[int]:
        """Give each key a row (fresh rows first, then the free list) and insert it pending."""
        counters, num_chunks = self._counters, self._num_chunks
        allocated = counters[NUM_ALLOCATED]
        fresh = min(len(keys), num_chunks - allocated)
        rows = list(range(allocated, allocated + fresh))
        counters[NUM_ALLOCATED] = allocated + fresh
        reused = len(keys) - fresh
        if reused:  # from the end of the free list, last first (as pop() would)
            free_list = self._free_list
            rows += free_list[:-reused - 1:-1]
            del free_list[-reused:]
        refcnt, policy = self._refcnt, self._policy
        self._index.claim(keys, rows)
        insert_pending = getattr(policy, "insert_pending", None)
        if insert_pending is not None:
            insert_pending(keys, rows, req_context)
        else:
            for key, row in zip(keys, rows):
                policy.insert(key, ChunkStatus(row, refcnt), req_context)
        return rows

    def _policy_hook(self, hook: str) -> Callable[[list[OffloadKey]], None]:
        """The policy's ``<hook>_many(keys)`` where it has one (LRU), else a call of
        ``<hook>(key)`` per key (ARC, a policy written for vLLM); resolved once, at
        construction: evictability changes are told several times per step."""
        many = getattr(self._policy, hook + "_many", None)
        if many is not None:
            return many
        one = getattr(self._policy, hook)

        def per_key(keys: list[OffloadKey]) -> None:
            for key in keys:
                one(key)
        return per_key

    def _evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, int]] | None:
        """The policy's ``evict`` as (key, row) pairs: its ``evict_rows`` where it has one
        (LRU: no ``ChunkStatus`` per victim), else from ``evict``."""
        evict_rows = getattr(self._policy, "evict_rows", None)
        if evict_rows is not None:
            return evict_rows(n, protected)
        victims = self._policy.evict(n, protected)
        return None if victims is None else [(key, chunk.chunk_id) for key, chunk in victims]

    def _release(self, victims: list[tuple[OffloadKey, int]]) -> None:
        """Forget each (key, row); the rows go to the end of the free list."""
        self._index.release(victims, self._free_list)

    # --- request access record ---

    def _request_access(self, req_context: ReqContext) -> _RequestCacheAccess:
        state = req_context.get_state(_RequestCacheAccess)
        if state is None or state.owner is not self or state.cache_generation != self._cache_generation:
            state = _RequestCacheAccess(owner=self, cache_generation=self._cache_generation)
            req_context.set_state(state)
        return state

    def _record_access(self, keys: Iterable[OffloadKey], req_context: ReqContext,
                       reused_keys: Iterable[OffloadKey] = (),
                       state: _RequestCacheAccess | None = None) -> None:
        """Record the request's first accesses to ``keys`` (``state``: its record, when the
        caller has it already)."""
        if state is None:
            state = self._request_access(req_context)
        if state.finished:
            keys = list(keys)
            if any(key not in state.seen_keys for key in keys):
                raise RuntimeError(
                    f"request {req_context.req_id!r} offered new keys after on_request_finished"
                )
        new_keys = first_accesses(keys, state.seen_keys, state.key_groups, GROUP_SUFFIX_LEN)
        if new_keys:
            self._policy.on_request_access(new_keys, req_context)
        if reused_keys:
            inserted = state.inserted_keys
            state.reused_keys.update(key for key in reused_keys if key not in inserted)

    def _record_offer(self, keys: list[OffloadKey]) -> None:
        """store_threshold: count this offer without aging out its own tracked keys."""
        counts = self.counts
        assert counts is not None
        protected = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                protected.add(key)
        unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    # --- OffloadingManager interface ---

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_access(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        row = self._rows.get(key)
        if row is None:
            return LookupResult.MISS
        return LookupResult.HIT if self._refcnt[row] >= 0 else LookupResult.HIT_PENDING

    def ref_count(self, key: OffloadKey) -> int | None:
        """``key``'s reference count: None if not resident, -1 while its write is
        pending (``lookup``: HIT_PENDING), 0 ready and evictable (HIT), n > 0 ready and
        pinned by n readers (HIT). One answer for ``lookup`` and ``is_evictable``."""
        row = self._rows.get(key)
        return None if row is None else self._refcnt[row]

    def ready_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys ``lookup`` would answer HIT (resident and readable), in order."""
        return self._index.ready_keys(keys)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        """Pin ``keys`` (all must be HIT) until ``complete_load``; rows in key order."""
        spec = CPULoadStoreSpec.of_ids(self._pin(keys))
        self._record_access(keys, req_context, reused_keys=keys)
        return spec

    def _pin(self, keys: Collection[OffloadKey]) -> list[int]:
        """Pin every key or, if one is not readable, none (KeyError naming it); their rows."""
        ids, pinned = self._index.pin(keys)
        if pinned:
            self._num_evictable -= len(pinned)
            self._mark_non_evictable(pinned)
        return ids

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin every key or, if one is not pinned, none (KeyError naming it)."""
        unpinned = self._index.unpin(keys)
        if unpinned:
            self._num_evictable += len(unpinned)
            self._mark_evictable(unpinned)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        if self.counts is not None:
            self._record_offer(keys)
        to_store, ready_existing = self._index.classify(keys)
        self._check_key_width(to_store)
        if self.counts is not None:
            candidates = len(to_store)
            to_store = [key for key in to_store if self.counts.get(key, 0) >= self.store_threshold]
            self.stores_skipped_in_current_batch += candidates - len(to_store)

        state = self._request_access(req_context)
        self._note_store_misses(state, to_store, req_context)
        recorded = set(to_store)
        recorded.update(ready_existing)
        self._record_access((key for key in keys if key in recorded), req_context,
                            reused_keys=ready_existing, state=state)
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec.of_ids([]), [])

        self.allocation_sizes_in_current_batch.append(len(to_store))
        need = len(to_store) - (len(self._free_list) + self._num_chunks - self._counters[NUM_ALLOCATED])
        evicted: list[OffloadKey] = []
        if need > 0:
            if need > self._num_evictable:
                return None
            victims = self._evict(need, set(keys))
            if victims is None:
                return None
            self._num_evictable -= len(victims)
            self._release(victims)
            evicted = [key for key, _ in victims]
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        new_rows = self._allocate(to_store, req_context)
        self._num_write_pending += len(to_store)
        state.inserted_keys.update(to_store)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec.of_ids(new_rows), evicted)

    def _check_key_width(self, keys: list[OffloadKey]) -> None:
        if keys and max(map(len, keys)) > self._key_width:
            longest = max(keys, key=len)
            raise KeyTooLongError(
                f"offload key of {len(longest)} bytes does not fit the CPU tier's key width "
                f"of {self._key_width} bytes (set key_width to at least {len(longest)})"
            )

    def _note_store_misses(self, state: _RequestCacheAccess, keys: list[OffloadKey],
                           req_context: ReqContext) -> None:
        if not self._observes_store_misses:
            return
        missed = state.store_miss_keys
        new_misses = [key for key in keys if key not in missed]
        if new_misses:
            # ARC learns from its ghost lists before insert() drops the ghost entry.
            self._policy.on_store_miss(new_misses, req_context)
            missed.update(new_misses)

    def rows_obtainable(self, held: int = 0) -> int:
        """Rows a reservation could get now: free and fresh rows plus evictable chunks,
        less ``held`` evictable chunks the caller keeps from eviction (see
        ``is_evictable``)."""
        return (len(self._free_list) + self._num_chunks - self._counters[NUM_ALLOCATED]
                + self._num_evictable - held)

    def copies_may_be_in_flight(self) -> bool:
        """Whether a resident row is pinned or write-pending: a copy (a GPU worker's, a
        tier worker's) may still read or write it. Scheduler thread, O(1)."""
        return len(self._rows) != self._num_evictable

    def is_evictable(self, key: OffloadKey) -> bool:
        """Resident, stored and not pinned: a chunk eviction could take now."""
        return self.ref_count(key) == 0

    def reserve_rows(self, keys: list[OffloadKey], req_context: ReqContext,
                     protected: Collection[OffloadKey] = ()) -> list[int | None]:
        """Pending rows for ``keys`` (none of them resident), as one ``prepare_store([key])``
        per key in order would give them -- the same rows, victims, eviction events
        (one per victim) and allocation-size samples (one per key) -- but in one pass,
        with ``protected`` (e.g. chunks the same request was just told are HITs) kept
        from eviction too. Returns each key's row, or None for the keys (a suffix) that
        found no room. Scheduler process, under the manager's lock; never blocks.

        Exact for recency policies (LRU); a policy whose victim choice depends on the
        pending inserts in between (ARC's list sizes) may pick other victims than the
        per-key sequence would."""
        if not keys:
            return []
        self._check_key_width(keys)
        state = self._request_access(req_context)
        self._note_store_misses(state, keys, req_context)
        self._record_access(keys, req_context, state=state)
        self.allocation_sizes_in_current_batch.extend([1] * len(keys))
        free_list = self._free_list
        spare = len(free_list) + self._num_chunks - self._counters[NUM_ALLOCATED]
        need = len(keys) - spare
        victims = []
        if need > 0:
            need = min(need, self._num_evictable - sum(map(self.is_evictable, protected)))
            victims = self._evict(need, set(keys).union(protected)) if need else []
            if victims is None:
                victims = []
            self._num_evictable -= len(victims)
            self._release(victims)
            if victims:
                # per key, a victim's row goes to the key that evicted it: fresh rows
                # first, then the old free rows (from the end), then victims in order
                released = free_list[-len(victims):]
                del free_list[-len(victims):]
                free_list[:0] = released[::-1]
            if self.events is not None:
                self.events.extend(OffloadingEvent(keys=[key], medium=self.medium, removed=True)
                                   for key, _ in victims)
        granted = keys[:spare + len(victims)]
        rows: list[int | None] = list(self._allocate(granted, req_context))
        self._num_write_pending += len(granted)
        state.inserted_keys.update(granted)
        return rows + [None] * (len(keys) - len(granted))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        """Pending keys become ready (success) or are dropped (failure); others are ignored."""
        if success:
            done = self._index.mark_stored(keys)
        else:
            rows, refcnt = self._rows, self._refcnt
            failed = list({key: row for key in keys  # once each, in order
                           if (row := rows.get(key)) is not None and refcnt[row] < 0}.items())
            for key, _ in failed:
                self._policy.remove(key)
            self._release(failed)
            done = [key for key, _ in failed]
        self._num_write_pending -= len(done)
        if success and done:
            self._num_evictable += len(done)
            self._mark_evictable(done)
        if done and self.events is not None:
            self.events.append(OffloadingEvent(
                keys=done, medium=self.medium, removed=not success, metadata_only=not success,
                req_context=req_context,
            ))

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestCacheAccess)
        if (state is None or state.owner is not self
                or state.cache_generation != self._cache_generation or state.finished):
            return
        state.finished = True
        key_groups = []
        for group_idx in sorted(state.key_groups):
            key_groups.append(tuple(sort_by_position(list(state.key_groups[group_idx]), req_context)))
        self._policy.on_request_finished(
            tuple(key_groups), state.inserted_keys - state.reused_keys, state.reused_keys, req_context
        )

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        return

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        """Forget every chunk (no removal events); the caller fences in-flight jobs."""
        self._policy.clear()
        self._table.clear()
        self._rows.clear()
        self._free_list.clear()
        self._cache_generation += 1
        self._num_evictable = 0
        self._num_write_pending = 0

    def on_reset_flushed(self) -> None:
        return

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.events is None:
            return
        # Detach first so a partly consumed drain cannot replay stale clean-up.
        events, self.events = self.events, []
        for event in events:
            if event.metadata_only:
                keys = [key for key in event.keys if key not in self._rows]
                if not keys:
                    continue  # a retry already re-allocated them
                event = replace(event, keys=keys)
            yield event

    def config_info(self) -> Sequence[dict]:
        return [self._config_info]

    def get_stats(self) -> metrics.OffloadingStats:
        stats = metrics.OffloadingStats()
        self.stats_into(stats)
        return stats

    def stats_into(self, stats: metrics.OffloadingStats) -> None:
        """Add the series ``get_stats`` reports (and resets) to ``stats``: the tiering
        manager's step payload, without a payload of the primary's own to merge."""
        n = self._num_chunks
        used = self._counters[NUM_ALLOCATED] - len(self._free_list) - self._num_evictable
        usage = used / n if n else 0.0
        write_usage = self._num_write_pending / n if n else 0.0
        stats.set_gauge(metrics.CPU_CACHE_USAGE_PERC, usage)
        if self.allocation_sizes_in_current_batch:
            stats.observe_many(metrics.CPU_ALLOCATION_SIZE, self.allocation_sizes_in_current_batch)
            self.allocation_sizes_in_current_batch = []
        stats.set_gauge(metrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(metrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write_usage, 0.0))
        if self.store_threshold >= 2:
            stats.increase_counter(metrics.STORES_SKIPPED, self.stores_skipped_in_current_batch)
            self.stores_skipped_in_current_batch = 0

    def shutdown(self) -> None:
        """Let the policy release what it holds of the table (LRU: the C core's buffers)."""
        if isinstance(self._policy, SegmentBackedPolicy):
            self._policy.close()
        self._index.close()

    # --- introspection (tests, bench, demo) ---

    def resident_keys(self) -> dict[OffloadKey, int]:
        """A copy of ``key -> row`` for every resident chunk."""
        return dict(self._rows)


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU tier as the primary of a tiering manager, over the engine's segment.

    Adds the secondary tiers' view: ``prepare_read`` pins like ``prepare_load``
    without recording a request access (cascades do not change recency);
    ``prepare_write``/``complete_write``/``complete_read`` alias the store/load
    calls; ``get_kv_memoryview()`` is the zero-copy ``(num_chunks, row_stride)``
    view of the arena (row c = chunk slot c). ``shutdown`` closes the segment
    (the owner unlinks it). ``store_threshold`` is not supported.
    """

    def __init__(self, segment: Segment, cache_policy: str = "lru",
                 cache_policy_module_path: str | None = None, enable_events: bool = False,
                 info: metrics.ConfigInfo | None = None, *, attach: bool = False):
        super().__init__(segment.table, cache_policy, cache_policy_module_path, enable_events,
                         store_threshold=0, info=info, attach=attach)
        self.segment = segment
        # rows of failed promotions a tier may still write: out of the free pool (and
        # counted write-pending) until release_deferred_write
        self._deferred_rows: set[int] = set()

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        return CPULoadStoreSpec.of_ids(self._pin(keys))

    def pin_rows(self, keys: Collection[OffloadKey]) -> list[int]:
        """``prepare_read`` answered as the rows (no spec): the tiering manager's cascade
        path, whose job builds its own chunk-id array."""
        return self._pin(keys)

    def complete_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.complete_load(keys, req_context)

    def prepare_write(self, keys: Collection[OffloadKey], req_context: ReqContext):
        return self.prepare_store(keys, req_context)

    def complete_write(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        self.complete_store(keys, req_context, success)

    def defer_write_release(self, keys: Collection[OffloadKey]) -> list[int]:
        """Fail the pending writes of ``keys`` as ``complete_write(False)`` does (the
        keys leave the cache: lookups MISS, a later store gets a fresh row; a
        metadata-only removal event), but keep their rows out of the free pool, still
        counted write-pending: a tier may still be writing them. Returns those rows, for
        ``release_deferred_write`` once it cannot any more. Keys not pending are skipped
        (as ``complete_store`` skips them). Scheduler process, under the manager's lock."""
        rows, refcnt = self._rows, self._refcnt
        failed = list({key: row for key in keys  # once each, in order
                       if (row := rows.get(key)) is not None and refcnt[row] < 0}.items())
        for key, _ in failed:
            self._policy.remove(key)
        held: list[int] = []
        self._index.release(failed, held)  # unmapped, the table's key cleared
        self._deferred_rows.update(held)
        if failed and self.events is not None:
            self.events.append(OffloadingEvent(keys=[key for key, _ in failed],
                                               medium=self.medium, removed=True,
                                               metadata_only=True))
        return held

    def release_deferred_write(self, rows: Iterable[int]) -> None:
        """Return rows that ``defer_write_release`` held to the free pool (their writer
        can no longer touch them). A row it does not hold raises KeyError, nothing changed."""
        rows = list(rows)
        unknown = [row for row in rows if row not in self._deferred_rows]
        if unknown or len(set(rows)) != len(rows):
            raise KeyError(f"release_deferred_write: rows {unknown or rows} are not held "
                           f"(or repeated) by a deferred release")
        self._deferred_rows.difference_update(rows)
        self._num_write_pending -= len(rows)
        self._free_list.extend(rows)

    @property
    def num_deferred_release_chunks(self) -> int:
        """Rows held by deferred releases (out of the free pool)."""
        return len(self._deferred_rows)

    def reset_cache(self) -> None:
        """As the CPU tier's, refused (RuntimeError) while a deferred release holds rows:
        a tier may still write them, so they cannot become free rows."""
        if self._deferred_rows:
            raise RuntimeError(
                f"reset_cache with {len(self._deferred_rows)} primary rows of failed "
                f"promotions still held (a tier may still write them): drain the tiers "
                f"until every deferred release is set first")
        super().reset_cache()

    def get_kv_memoryview(self) -> memoryview:
        return self.segment.arena_rows()

    def shutdown(self) -> None:
        super().shutdown()
        self.segment.close()
