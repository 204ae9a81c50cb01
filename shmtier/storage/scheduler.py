"""The scheduler half of a storage tier: chunks kept on a medium that tier workers
reach (``fs``: files under a root; ``obj``: objects in a bucket), which other engines
may share. Each tier type subclasses :class:`StorageTierManager` with its names and
metrics (``shmtier/tiers/fs/scheduler.py``, ``shmtier/tiers/obj/scheduler.py``); its
worker half is the tier's backend (``TierBackend``: store, load, delete, probe, scan).

Who calls: the tiering manager, in the scheduler process, under its lock.
Nothing here touches the medium: every byte moves in tier worker processes, via
the shared :class:`~shmtier.scheduler.pool.WorkerPool`. Never blocks except
``drain_jobs``.

What the scheduler half keeps is its ledger (``ledger.py``: the invariants): an index
``key -> stored bytes`` in recency order (the tier's own LRU; each chunk's size as the
worker reported it: the file or object it wrote or found, or the one a scan listed), and
for each key not (yet) in it what is in flight: a store (the bytes reserved for it), a
delete (the evicted chunk's size, until the worker confirms it gone) or a probe (a store
or delete whose worker died: is the chunk there?). Each key is in one of these at most,
so no chunk is counted twice; ``bytes_on_disk`` (the tier's bytes gauge) is the indexed
and the deleting bytes, exactly the chunks' bytes on the medium once the tier settles.
A tier job's ``transfer_time`` and ``transfer_bytes`` are the sums of the seconds and
logical bytes the workers reported for its own keys (``transfers.py``). At start it asks
a worker to ``scan`` the medium (warm restart). A key the listing finds with a job in
flight is left to that job.

Sharing (``probe_unknown``, default on): the index is a cache of what is on the
medium, not the truth. A key it does not know is probed by a worker (one ``probe``
job per step for every key asked in it: one ``stat`` or ``HEAD`` per key, in the
workers): RETRY until the answer lands, then HIT (the chunk joins the index at its
recent end, its size counted against ``max_bytes``) or MISS, remembered for
``probe_ttl_s`` after the last lookup that asked; a probe unanswered after
``probe_timeout_s`` answers MISS (``lookup_probes.py``). Keys the index knows answer at
once. A chunk another engine deleted is a MISS at load (dropped, and remembered as a
miss); another engine's delete while a worker reads gives the old bytes or a MISS, never
wrong bytes (the workers verify every chunk). With ``probe_unknown`` false (a medium
this engine has to itself) an unknown key is a MISS at once once the listing has landed
(RETRY before).

Capacity: ``max_bytes`` (None = unbounded) bounds ``bytes_committed``: the chunks,
the stores in flight at their largest possible size each, the deletes not yet
confirmed and the probes. A store goes only when it fits: until then the least
recently used chunks (not being loaded) are evicted, and it waits for their
delete; with a bound nothing is stored before the listing has landed. The
workers also refuse a key that would pass the bound (a check that never fires
while chunks fit their reservations). A free-space floor (fs's
``min_free_bytes``) is the workers' to check (the scheduler process does no I/O):
a store they refuse for it (or for a full medium) makes the tier evict by the free
bytes they report and send it again once the evicted chunks are gone (one WARNING
with the numbers); when even all the tier holds would not make room, it fails (one
WARNING). A store that failed with ERROR (its worker died mid-job: the keys it
answered before keep their outcomes) or a delete that did is probed: a chunk
there is indexed with its size, none is forgotten. Failed stores are logged once
per change of state: the first failure after stores worked, or one of another reason
(a WARNING), and an INFO once stores succeed again; never once per result. A load that
fails with ERROR keeps its key (only MISS and CORRUPT drop it). A load whose worker was
killed (at its deadline, or hung) fails at once, but that process may still write its
rows until it is gone: the promotion's ``JobResult.deferred_release`` is set only then
(the pool's ``PoolResult.release``), and the manager holds those rows out of the free
pool meanwhile.

Submission (``dispatch.py``): ``submit_store``/``submit_load`` only queue; the queues go
to the pool combined, one job per operation, at ``on_schedule_end`` and at the next
``get_finished_jobs`` (or the step-window thread's round), so a step's promotions of many
requests, or the cascades of all the stores that completed together, cost one ring put
and one wake-up per worker instead of one per request (measured: this was the largest
part of the slowest steps). Results (``results.py``) go back into the ledger. Per step
the work is in proportion to what changed: no walk over the index but the eviction's,
from its LRU end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from shmtier import metrics
from shmtier.contract import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from shmtier.scheduler.pool import PoolJobId
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager, TransferJob
from shmtier.shared.codec import frame_header_size
from shmtier.storage.dispatch import StorageDispatch
from shmtier.storage.ledger import StorageLedger
from shmtier.storage.lookup_probes import LookupProbes
from shmtier.storage.results import StorageResults
from shmtier.storage.tier_metrics import (
    COMPRESSION_ON,
    DIRECT_STORES,
    PAGE_CACHE_BOUNDED,
    POOL_BROKEN,
    PROBES_EXPIRED,
    RING_DEPTH,
    PoolCounts,
    TierSeries,
    metric_definitions,
)
from shmtier.storage.transfers import Cascade, Promotion

_DRAIN_S = 120.0


class StorageTierManager(StorageDispatch, StorageResults, TierSeries, SecondaryTierManager):
    """The scheduler half of a storage tier; its options are the tier's validated
    config (``max_bytes``, ``probe_unknown``, ``probe_ttl_s``, ``probe_timeout_s``,
    ``locality``, ``enable_kv_events``, ``max_pinned_fraction``, and optionally
    ``min_free_bytes``). Built by the tier factory while the spec builds the manager:
    it finds the worker pool and its own tier index on the spec (``worker_pool``,
    ``tier_index_being_built``).

    A subclass names its medium: ``kind`` (log lines), ``BYTES_METRIC`` and
    ``EVICTED_METRIC`` (its gauge of bytes held and its counter of evictions),
    ``MAX_BYTES_INFO`` (its config-info label) and ``medium_words()``."""

    medium = Medium.STORAGE
    kind = "storage"
    BYTES_METRIC = "vllm:kv_offload_shmtier_storage_bytes"
    BYTES_HELP = "Bytes the tier holds on its medium (frames)."
    EVICTED_METRIC = "vllm:kv_offload_shmtier_storage_evicted_chunks"
    MAX_BYTES_INFO = "storage_max_bytes"
    # Not polled from the manager's periodic tier-poll thread (as vLLM's fs tier is not):
    # its GIL hand-offs inside the steps cost more step time than they saved. Polled from
    # the step-window thread instead, between steps only (bench/README.md, "Polling the
    # storage tiers between steps").
    tolerates_off_thread_polling = False
    polls_between_steps = True
    # a worker killed while it loads may still write the rows: its failed promotions
    # carry deferred_release (set once the pool sees the process gone)
    defers_release = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, config: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config
        if config.locality is not None:
            self.locality = Locality[config.locality]
        num_rows = primary_kv_view.shape[0] if primary_kv_view.ndim == 2 else 0
        self.max_pinned_rows = max(1, int(num_rows * config.max_pinned_fraction))
        self._pool = offloading_spec.worker_pool
        self._tier = offloading_spec.tier_index_being_built
        self._label = f"{self._tier + 1}:{tier_type}"
        self._labels = (self._label,)  # its series' label values
        # A store reserves its key's largest frame: the raw chunk (a frame is never
        # larger) and the frame header, with the MAC tag where frames carry one.
        mac = config.mac_secret is not None
        self._ledger = ledger = StorageLedger(
            config.max_bytes, offloading_spec.chunk_payload_bytes + frame_header_size(0, mac=mac))
        # the ledger's states, read directly on the hot paths (lookup, touch); every
        # change of state or size goes through the ledger
        self._index, self._storing = ledger.index, ledger.storing
        self._deleting, self._probing = ledger.deleting, ledger.probing
        self._max_bytes = config.max_bytes
        self._events_on = config.enable_kv_events and getattr(offloading_spec, "enable_events", False)
        self._probe_unknown = config.probe_unknown
        self._lookups = LookupProbes(config.probe_ttl_s, config.probe_timeout_s)
        self._expired_seen = 0
        # pool job id -> (op, what it carries): store [(cascade, keys, rows)], load
        # [(promotion, keys)], delete / probe / lookup keys
        self._jobs: dict[PoolJobId, tuple[str, Any]] = {}
        self._store_queue: deque[list] = deque()  # [cascade, keys, rows] not yet sent
        self._load_queue: list[tuple[Promotion, list[OffloadKey], list[int]]] = []
        self._to_delete: list[OffloadKey] = []  # evicted; no delete job accepted yet
        self._to_probe: list[OffloadKey] = []
        self._space_wait = False  # stores refused for space wait for the deletes in flight
        self._warned: set[str] = set()
        self._store_failure: str | None = None  # the store failure last logged (reason)
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats = metrics.OffloadingStats()
        self._pool_counts = PoolCounts(self._pool, self._tier, self._label)
        self._scan_id: PoolJobId | None = None
        self._broken = False  # the pool is broken: MISS, and fail jobs at once
        self._list_medium()
        self.namespace_resets = 0  # results flagged NAMESPACE_RESET (each worker's, each change)
        # store and probe jobs in flight when a reset was seen: what they found or wrote
        # may have gone with the old namespace, so it is probed again, not indexed
        # (results.py, ``_namespace_reset``)
        self._across_reset: set[PoolJobId] = set()
        self._compression_on = True  # last store result without COMPRESSION_OFF
        self._page_cache_bounded = False  # last store result with PAGE_CACHE_BOUNDED
        self._direct_stores = False  # last store result with DIRECT_STORES

    # --- byte counts ---

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the chunk files the tier knows are on disk: indexed, or evicted and
        not deleted yet (the ``fs_bytes_on_disk`` gauge)."""
        return self._ledger.on_medium

    @property
    def chunks_on_disk(self) -> int:
        """Chunk files the tier knows are on disk, counted as ``bytes_on_disk`` is."""
        return len(self._index) + len(self._deleting)

    @property
    def bytes_committed(self) -> int:
        """What the tier may hold on disk at most right now: its files, the bytes
        reserved for stores in flight and those held for keys being probed
        (``ledger.py``: at most ``max_bytes`` but for chunks found there, being evicted)."""
        return self._ledger.committed

    @property
    def _index_complete(self) -> bool:
        """Whether a listing of the medium has landed."""
        return self._ledger.listed

    def indexed_chunks(self) -> dict[OffloadKey, int]:
        """A copy of the index, ``key -> file size``, plus the evicted chunks whose
        delete is not confirmed yet (checks: ``shmtier run``'s final comparison with
        the ``*.kv`` files)."""
        return {**self._index, **self._deleting}

    def medium_words(self) -> str:
        """The medium in log lines (e.g. "the filesystem of /data/kv")."""
        return "its medium"

    # --- lookups ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._broken:  # nothing can be loaded: a MISS, never a wait
            return LookupResult.MISS
        if key in self._index:
            if self._lookups.has_failed and self._lookups.failed_now(key):
                return LookupResult.MISS  # its load just failed: not promoted again at once
            self._index.move_to_end(key)
            return LookupResult.HIT
        if key in self._storing or key in self._deleting or key in self._probing:
            return LookupResult.MISS  # not loadable before its job's outcome
        if self._probe_unknown:
            return self._lookups.answer(key)  # RETRY until a worker looked, then HIT/MISS
        if self._ledger.listed:
            return LookupResult.MISS
        return LookupResult.RETRY  # still listing the medium (warm restart)

    def touch(self, keys, req_context: ReqContext) -> None:
        index = self._index
        for key in keys:
            if key in index:
                index.move_to_end(key)

    # --- jobs ---

    def submit_store(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False))
            return
        # stored, or a job for it in flight: its file's accounting has one owner
        keys, rows = self._ledger.claim(job.keys, job.rows)
        if not keys:
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        self._store_queue.append([Cascade(job, len(keys)), keys, rows])

    def submit_load(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False, successful_keys=[]))
            return
        keys = list(job.keys)
        self._ledger.loads_sent(keys)
        self._load_queue.append((Promotion(job, len(keys)), keys, list(job.rows)))

    def submit_between_steps(self) -> None:
        """The shared round (``TierJobs``: hand all queued work to the pool), then the
        misses past their time forgotten: while rounds come they purge, not the step."""
        super().submit_between_steps()
        self._lookups.purge()

    # --- results ---

    def drain_jobs(self) -> None:
        """Block until every tier job is reported: stores that wait for room go once the
        deletes they wait for are drained; what can never go (nothing in flight would
        make room) fails. Returns only once every worker killed with a load part is gone
        (each ``deferred_release`` handed out is set); raises TimeoutError past
        ``_DRAIN_S`` otherwise."""
        deadline = time.monotonic() + _DRAIN_S
        while True:
            self._submit_queued()
            moving = (self._jobs or self._to_delete or self._to_probe
                      or not (self._ledger.listed or self._broken))
            if self._store_queue and (not moving or time.monotonic() >= deadline):
                self._fail_waiting_stores()
            if not (self._jobs or self._store_queue or self._pool.rows_held()):
                return
            left = deadline - time.monotonic()
            self._pool.drain(left if left > 0 else 1.0)
            self._process_results()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return (bool(self._jobs or self._store_queue or self._load_queue or self._to_delete
                     or self._to_probe) or self._lookups.has_asked
                or not (self._ledger.listed or self._broken))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # a step without a round before it sends everything itself, and purges (a lookup
        # checks a remembered miss's time itself: purging only bounds the memory)
        self._submit_at_step_end()
        if not self._rounds_come:
            self._lookups.purge()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def _gauges_into(self, stats: metrics.OffloadingStats) -> None:
        labels, set_gauge = self._labels, stats.set_gauge
        set_gauge(self.BYTES_METRIC, self._ledger.on_medium, labels)
        expired = self._lookups.expired
        if expired != self._expired_seen:
            stats.increase_counter(PROBES_EXPIRED, expired - self._expired_seen, labels)
            self._expired_seen = expired
        set_gauge(RING_DEPTH, self._pool.queued_jobs(), labels)
        set_gauge(POOL_BROKEN, int(self._broken), labels)
        set_gauge(COMPRESSION_ON, int(self._compression_on), labels)
        set_gauge(PAGE_CACHE_BOUNDED, int(self._page_cache_bounded), labels)
        set_gauge(DIRECT_STORES, int(self._direct_stores), labels)

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions(cls.BYTES_METRIC, cls.BYTES_HELP, cls.EVICTED_METRIC)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return (cls.MAX_BYTES_INFO,)

    def config_info(self) -> dict[str, Any]:
        return {self.MAX_BYTES_INFO: self._max_bytes if self._max_bytes is not None else "None"}
