"""The scheduler half of a storage tier: chunks kept on a medium that tier workers
reach (``fs``: files under a root; ``obj``: objects in a bucket), which other engines
may share. Each tier type subclasses :class:`StorageTierManager` with its names and
metrics (``shmtier/tiers/fs/scheduler.py``, ``shmtier/tiers/obj/scheduler.py``); its
worker half is the tier's backend (``TierBackend``: store, load, delete, probe, scan).

Who calls: the tiering manager, in the scheduler process, under its lock.
Nothing here touches the medium: every byte moves in tier worker processes, via
the shared :class:`~shmtier.scheduler.pool.WorkerPool`. Never blocks except
``drain_jobs``.

What the scheduler half keeps: an index ``key -> stored bytes`` in recency
order (the tier's own LRU; each chunk's size as the worker reported it: the
file or object it wrote or found, or the one a scan listed), and for each key not
(yet) in it what is in flight: a store (the bytes reserved for it), a delete (the
evicted chunk's size, until the worker confirms it gone) or a probe (a store or
delete whose worker died: is the chunk there?). Each key is in one of these at
most, so no chunk is counted twice; ``bytes_on_disk`` (the tier's bytes gauge) is
the indexed and the deleting bytes, exactly the chunks' bytes on the medium once the
tier settles. A tier job's ``transfer_time`` and ``transfer_bytes`` are the sums of
the seconds and logical bytes the workers reported for its own keys. At start it asks
a worker to ``scan`` the medium (warm restart). A key the listing finds with a job in
flight is left to that job.

Sharing (``probe_unknown``, default on): the index is a cache of what is on the
medium, not the truth. A key it does not know is probed by a worker (one ``probe``
job per step for every key asked in it: one ``stat`` or ``HEAD`` per key, in the
workers): RETRY until the answer lands, then HIT (the chunk joins the index at its
recent end, its size counted against ``max_bytes``) or MISS, remembered for
``probe_ttl_s`` after the last lookup that asked; a probe unanswered after
``probe_timeout_s`` answers MISS (``lookup_probes.py``). Keys the index knows answer at once. A chunk another engine
deleted is a MISS at load (dropped, and remembered as a miss); another engine's
delete while a worker reads gives the old bytes or a MISS, never wrong bytes (the
workers verify every chunk). With ``probe_unknown`` false (a medium this engine has
to itself) an unknown key is a MISS at once once the listing has landed (RETRY
before).

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
(a WARNING), and an INFO once stores succeed again; never once per result. A load that fails with ERROR
keeps its key (only MISS and CORRUPT drop it). A load whose worker was killed (at its
deadline, or hung) fails at once, but that process may still write its rows until it is
gone: the promotion's ``JobResult.deferred_release`` is set only then (the pool's
``PoolResult.release``), and the manager holds those rows out of the free pool meanwhile.

Submission: ``submit_store``/``submit_load`` only queue. The queue goes to the
pool as one job per operation (loads first; a step's loads of many keys as one job
per worker, LOAD_SPLIT_KEYS keys at least, so every worker reads) at
``on_schedule_end`` and at the next ``get_finished_jobs`` -- so a step's promotions of many requests, or the
cascades of all the stores that completed together, cost one ring put and one
wake-up per worker instead of one per request (measured: this was the largest
part of the slowest steps). A full job ring fails the queued jobs at once and
tells the backpressure detector (deletes and probes are sent again next step).
Per step the work is in proportion to what changed: no walk over the index
but the eviction's, from its LRU end.

Size (~850 lines): one class whose every method moves keys between the same states
(indexed, storing with a reservation, deleting, probing) and keeps the byte counts of
each; split by method it would scatter one invariant (chunks + reservations <=
max_bytes, index = medium) over several modules. The lookup probes, which hold no
bytes, live apart (``lookup_probes.py``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
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
from shmtier.scheduler.pool import PoolJobId, PoolResult
from shmtier.scheduler.pool.row_release import RowRelease
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager, TransferJob
from shmtier.shared.codec import frame_header_size
from shmtier.shared.jobs import SUCCESS, Outcome, ResultFlag, free_bytes_in
from shmtier.shared.ring import TIER_COUNTERS
from shmtier.storage.lookup_probes import LookupProbes

logger = logging.getLogger(__name__)

_STORED = SUCCESS["store"]  # written, or found there already

# At most this many keys per pool job when queued jobs are combined (a job needs
# one ring slot per ~200 keys; the rings hold 128 slots per worker).
MAX_COMBINED_KEYS = 1024
# A step's loads go to every worker when each gets at least this many keys.
LOAD_SPLIT_KEYS = 8
# A cascade refused for space is sent again (after evicting) at most this many times.
_SPACE_TRIES = 3
# A probe whose worker died (or whose stat failed) is sent again, this many tries in all.
_PROBE_TRIES = 4
_DRAIN_S = 120.0
# "<n> " before each "; "-separated part of a result's error text (BatchResult.summary)
_LEADING_COUNTS = re.compile(r"(^|; )\d+ ")

CORRUPT_CHUNKS = "vllm:kv_offload_shmtier_checksum_failures"
STORED_RATIO = "vllm:kv_offload_shmtier_codec_stored_bytes"
CODEC_SECONDS = "vllm:kv_offload_shmtier_codec_seconds"
WORKER_RESTARTS = "vllm:kv_offload_shmtier_worker_restarts"
RING_DEPTH = "vllm:kv_offload_shmtier_ring_depth"
POOL_BROKEN = "vllm:kv_offload_shmtier_worker_pool_broken"
WORKERS_LATE_BUT_BUSY = "vllm:kv_offload_shmtier_worker_late_but_busy"
PROBED_KEYS = "vllm:kv_offload_shmtier_lookup_probed_keys"
PROBE_HITS = "vllm:kv_offload_shmtier_lookup_probe_hits"
PROBES_EXPIRED = "vllm:kv_offload_shmtier_lookup_probes_expired"
COMPRESSION_ON = "vllm:kv_offload_shmtier_compression_on"
PAGE_CACHE_BOUNDED = "vllm:kv_offload_shmtier_page_cache_bounded"
#: What the tier workers count that no result shows (``ring.TIER_COUNTERS``, kept in the
#: worker slots' counters in the segment), each exported as a counter of its own name.
WORKER_COUNTER_METRICS = {name: f"vllm:kv_offload_shmtier_{name}" for name in TIER_COUNTERS}
LINKS_REFUSED = WORKER_COUNTER_METRICS["links_refused"]
_WORKER_COUNTER_HELP = {
    "links_refused": "Symbolic links a tier worker met where the tier's layout has a file or "
                     "a directory (a chunk's name, a fan-out or the namespace directory), "
                     "refused and never followed (load and probe: MISS; store: ELOOP).",
    "corrupt_remove_failed": "Chunks a tier worker found corrupt but could not remove from "
                             "the medium (they stay there, served as a miss each time).",
    "scan_errors": "Listings of the medium, or directories in one, that a tier worker could "
                   "not read (the listing is incomplete; the tier lists again).",
}


#: the pool's running totals each tier reports as its own counters (all tiers share the pool)
_POOL_COUNTERS = (
    (WORKER_RESTARTS, lambda pool: pool.restarts_total),
    (WORKERS_LATE_BUT_BUSY, lambda pool: pool.late_beats.spared_total),
)


class _Cascade:
    """One tier cascade job until each of its keys has its final outcome. Its keys may
    reach the workers in several pool jobs: admitted as room appears under
    ``max_bytes``, sent again after a refusal for space."""

    __slots__ = ("job", "pending", "ok", "seconds", "nbytes", "tries")

    def __init__(self, job: TransferJob, pending: int):
        self.job = job
        self.pending = pending  # keys without a final outcome
        self.ok = True  # every key final so far was stored (or found there)
        self.seconds = 0.0
        self.nbytes = 0
        self.tries = 0  # times its keys were refused for space and sent again


class _Promotion:
    """One tier promotion (load) job until each of its keys has its outcome: its keys
    may be read by several workers at once (a large step's loads are split)."""

    __slots__ = ("job", "pending", "ok", "seconds", "nbytes", "release")

    def __init__(self, job: TransferJob, pending: int):
        self.job = job
        self.pending = pending
        self.ok: list[OffloadKey] = []
        self.seconds = 0.0
        self.nbytes = 0
        # the rows of its failed keys a killed worker may still write: held until the
        # pool's releases of them are set (its JobResult's deferred_release)
        self.release: RowRelease | None = None

    def hold_until(self, pool_release: RowRelease) -> None:
        if self.release is None:
            self.release = RowRelease()
        self.release.hold()
        pool_release.then(self.release.let_go)


class StorageTierManager(SecondaryTierManager):
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
        self._chunk_bytes = offloading_spec.chunk_payload_bytes
        # the largest file a key's chunk can take (a frame is never larger than the raw
        # chunk and its header): a store reserves this much per key, plus the key's length
        self._file_bytes = self._chunk_bytes + frame_header_size(0)
        self._max_bytes = config.max_bytes
        self._events_on = config.enable_kv_events and getattr(offloading_spec, "enable_events", False)
        self._probe_unknown = config.probe_unknown
        self._lookups = LookupProbes(config.probe_ttl_s, config.probe_timeout_s)
        self._expired_seen = 0
        # Each key the tier knows of is in at most one of these:
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()  # on disk: its file's size
        self._storing: dict[OffloadKey, int] = {}  # queued (0) or in flight (bytes reserved)
        self._deleting: dict[OffloadKey, int] = {}  # evicted, its file not gone yet: its size
        # a store or delete whose outcome is unknown (its worker died): is the file
        # there? -> [bytes held for it, adopt at the LRU front, probes failed]
        self._probing: dict[OffloadKey, list] = {}
        self._indexed_bytes = self._reserved_bytes = self._deleting_bytes = 0
        self._probing_bytes = 0
        self._loading: dict[OffloadKey, int] = {}
        # pool job id -> (op, what it carries): store [(cascade, keys, rows)], load
        # [(job, keys)], delete / probe keys
        self._jobs: dict[PoolJobId, tuple[str, Any]] = {}
        self._store_queue: deque[list] = deque()  # [cascade, keys, rows] not yet sent
        self._load_queue: list[tuple[_Promotion, list[OffloadKey], list[int]]] = []
        self._to_delete: list[OffloadKey] = []  # evicted; no delete job accepted yet
        self._to_probe: list[OffloadKey] = []
        self._space_wait = False  # stores refused for space wait for the deletes in flight
        self._warned: set[str] = set()
        self._store_failure: str | None = None  # the store failure last logged (reason)
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats = metrics.OffloadingStats()
        self._pool_totals_seen = [total(self._pool) for _, total in _POOL_COUNTERS]
        self._worker_counts_seen = self._worker_counts()
        # chunks known gone (deleted, or a load found them missing or corrupt) since the
        # listing in flight was sent: it may have walked past their files before
        self._gone_since_listing: set[OffloadKey] = set()
        self._scan_id: PoolJobId | None = self._pool.submit("scan", self._tier, [])
        self._index_complete = False
        self._broken = False  # the pool is broken: MISS, and fail jobs at once
        self.namespace_resets = 0  # results flagged NAMESPACE_RESET (each worker's, each change)
        self._compression_on = True  # last store result without COMPRESSION_OFF
        self._page_cache_bounded = False  # last store result with PAGE_CACHE_BOUNDED
        # Between-steps rounds (``submit_between_steps``) since the last on_schedule_end,
        # and whether they came in the last forward pass: while they do, a step sends only
        # its loads and leaves stores, deletes and probes to the next round.
        self._rounds_since_step = 0
        self._rounds_come = False

    # --- byte counts ---

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the chunk files the tier knows are on disk: indexed, or evicted and
        not deleted yet (the ``fs_bytes_on_disk`` gauge)."""
        return self._indexed_bytes + self._deleting_bytes

    @property
    def chunks_on_disk(self) -> int:
        """Chunk files the tier knows are on disk, counted as ``bytes_on_disk`` is."""
        return len(self._index) + len(self._deleting)

    @property
    def bytes_committed(self) -> int:
        """What the tier may hold on disk at most right now: its files, the bytes
        reserved for stores in flight and those held for keys being probed. Kept at or
        below ``max_bytes``."""
        return (self._indexed_bytes + self._deleting_bytes + self._reserved_bytes
                + self._probing_bytes)

    def indexed_chunks(self) -> dict[OffloadKey, int]:
        """A copy of the index, ``key -> file size``, plus the evicted chunks whose
        delete is not confirmed yet (checks: ``shmtier run``'s final comparison with
        the ``*.kv`` files)."""
        return {**self._index, **self._deleting}

    def medium_words(self) -> str:
        """The medium in log lines (e.g. "the filesystem of /data/kv")."""
        return "its medium"

    def _file_max(self, key: OffloadKey) -> int:
        return self._file_bytes + len(key)

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
        if self._index_complete:
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
        keys, rows = [], []
        index, storing, deleting, probing = (self._index, self._storing, self._deleting,
                                             self._probing)
        for key, row in zip(job.keys, job.rows):
            # stored, or a job for it in flight: its file's accounting has one owner
            if key in index or key in storing or key in deleting or key in probing:
                continue
            keys.append(key)
            rows.append(row)
            storing[key] = 0
        if not keys:
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        self._store_queue.append([_Cascade(job, len(keys)), keys, rows])

    def submit_load(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False, successful_keys=[]))
            return
        keys = list(job.keys)
        for key in keys:
            self._loading[key] = self._loading.get(key, 0) + 1
        self._load_queue.append((_Promotion(job, len(keys)), keys, list(job.rows)))

    def submit_between_steps(self) -> None:
        """Hand all queued work to the pool. The manager's step-window thread calls it
        first in each of its rounds (``polls_between_steps``), under the lock."""
        self._rounds_since_step += 1
        self._submit_queued()

    def _submit_queued(self, loads_only: bool = False) -> None:
        """Hand the queued work to the pool, combined: one pool job per operation (up to
        MAX_COMBINED_KEYS keys each), loads first; stores as far as ``max_bytes`` has
        room (evicting for the rest); deletes and probes that found the rings full.
        ``loads_only``: the rest waits (for a between-steps round)."""
        if self._broken:
            self._fail_queued()
            return
        if loads_only:
            if self._load_queue:
                queued, self._load_queue = self._load_queue, []
                for batch in _combined(queued):
                    self._submit_loads(batch)
            return
        if self._to_delete:
            self._submit_deletes()
        if self._to_probe:
            self._submit_probes()
        if self._lookups.has_asked:
            self._submit_lookup_probes()
        if self._load_queue:
            queued, self._load_queue = self._load_queue, []
            for batch in _combined(queued):
                self._submit_loads(batch)
        if self._store_queue:
            admitted = self._admit_stores()
            for batch in _combined(admitted):
                self._submit_stores(batch)

    def _admit_stores(self) -> list:
        """Take queued stores, in order, for as many keys as ``max_bytes`` has room for
        (reserving each key's largest file); returns [(cascade, keys, rows)]. With a
        bound, nothing goes until the listing of the root has landed (the bytes already
        on disk are unknown before), and the keys that do not fit wait for room: the
        least recently used chunks are evicted for them, and their bytes count until
        the workers confirm the files deleted."""
        if self._space_wait:  # refused for space: wait until the evicted files are gone
            if self._deleting or self._to_delete:
                return []
            self._space_wait = False
        limit = self._max_bytes
        if limit is not None and not self._index_complete:
            return []
        queue, storing = self._store_queue, self._storing
        room = None if limit is None else limit - self.bytes_committed
        admitted = []
        while queue:
            item = queue[0]
            cascade, keys, rows = item
            take = 0
            for key in keys:
                need = self._file_max(key)
                if room is not None:
                    if need > room:
                        break
                    room -= need
                storing[key] = need
                self._reserved_bytes += need
                take += 1
            if take == len(keys):
                queue.popleft()
                admitted.append(item)
                continue
            if take:
                admitted.append((cascade, keys[:take], rows[:take]))
                item[1], item[2] = keys[take:], rows[take:]
            # room for the rest of this job (its keys are all of one length) once the
            # deletes in flight and those of the chunks evicted now are confirmed
            want = len(item[1]) * self._file_max(item[1][0])
            self._evict(want - room - self._deleting_bytes)
            break
        return admitted

    def _submit_stores(self, batch: list) -> None:
        keys = [key for _, job_keys, _ in batch for key in job_keys]
        rows = [row for _, _, job_rows in batch for row in job_rows]
        args = None
        if self._max_bytes is not None:
            # the workers refuse what would pass max_bytes: the tier's bytes but those
            # reserved for this job (no file may be larger than its reservation)
            mine = sum(self._storing[key] for key in keys)
            args = {"bytes_in_use": self.bytes_committed - mine}
        pool_id = self._pool.submit("store", self._tier, keys, rows, args)
        if pool_id is not None:
            self._jobs[pool_id] = ("store", batch)
            return
        # the rings are full (or the pool is broken): every key of the batch fails now
        if self._bp_detector is not None and self._pool.broken is None:
            self._bp_detector.note_ring_full()
        for cascade, job_keys, _ in batch:
            self._unreserve(job_keys)
            self._settle(cascade, len(job_keys), False)

    def _submit_loads(self, batch: list) -> None:
        """``batch`` [(promotion, keys, rows)] as pool jobs: one, or with many keys one
        per worker (at least LOAD_SPLIT_KEYS keys each), so that every worker reads (an
        object store's GETs are latency-bound: one worker's io_threads do not fill it)."""
        flat = [(promo, key, row) for promo, keys, rows in batch
                for key, row in zip(keys, rows)]
        if not flat:  # promotions of no keys: done
            for promo, _, _ in batch:
                self._settle_load(promo, 0)
            return
        parts = max(1, min(self._pool.n, len(flat) // LOAD_SPLIT_KEYS))
        size = -(-len(flat) // parts)
        for start in range(0, len(flat), size):
            part = flat[start:start + size]
            keys = [key for _, key, _ in part]
            rows = [row for _, _, row in part]
            carried: list[tuple[_Promotion, list[OffloadKey]]] = []
            for promo, key, _ in part:  # runs of one promotion's keys
                if carried and carried[-1][0] is promo:
                    carried[-1][1].append(key)
                else:
                    carried.append((promo, [key]))
            pool_id = self._pool.submit("load", self._tier, keys, rows)
            if pool_id is not None:
                self._jobs[pool_id] = ("load", carried)
                continue
            for promo, promo_keys in carried:  # the rings are full: these keys fail now
                self._unmark_loading(promo_keys)
                self._settle_load(promo, len(promo_keys))

    def _submit_deletes(self) -> None:
        self._to_delete = self._submit_keys("delete", self._to_delete)

    def _submit_probes(self) -> None:
        self._to_probe = self._submit_keys("probe", self._to_probe)

    def _submit_lookup_probes(self) -> None:
        """The keys lookups asked about this step, as ``probe`` jobs (answered by
        ``_finish_lookup_probes``)."""
        asked = self._lookups.take_asked()
        self._stats.increase_counter(PROBED_KEYS, len(asked), (self._label,))
        unsent = self._submit_keys("probe", asked, carried_as="lookup")
        if unsent:
            self._lookups.not_sent(unsent)

    def _submit_keys(self, op: str, keys: list[OffloadKey], *,
                     carried_as: str | None = None) -> list[OffloadKey]:
        """Send ``keys`` as ``op`` jobs of at most MAX_COMBINED_KEYS keys (recorded as
        ``carried_as``, default ``op``, for their results); returns those the rings had
        no room for (sent again next step; their bytes count until then)."""
        for start in range(0, len(keys), MAX_COMBINED_KEYS):
            part = keys[start:start + MAX_COMBINED_KEYS]
            pool_id = self._pool.submit(op, self._tier, part)
            if pool_id is None:  # (a broken pool: _submit_queued forgets them)
                return keys[start:]
            self._jobs[pool_id] = (carried_as or op, part)
        return []

    def _fail_queued(self) -> None:
        """The pool is broken: fail every job not sent; forget deletes and probes."""
        self._fail_waiting_stores()
        if self._load_queue:
            queued, self._load_queue = self._load_queue, []
            for promo, keys, _ in queued:
                self._unmark_loading(keys)
                self._settle_load(promo, len(keys))
        self._forget_unsent()

    def _forget_unsent(self) -> None:
        """The pool is broken: deletes and probes never go; their bytes no longer count."""
        for key in self._to_delete:
            self._deleting_bytes -= self._deleting.pop(key, 0)
        for key in self._to_probe:
            entry = self._probing.pop(key, None)
            if entry is not None:
                self._probing_bytes -= entry[0]
        self._to_delete, self._to_probe = [], []
        self._lookups.clear()

    def _unreserve(self, keys: Iterable[OffloadKey]) -> None:
        storing = self._storing
        for key in keys:
            self._reserved_bytes -= storing.pop(key, 0)

    def _unmark_loading(self, keys: Iterable[OffloadKey]) -> None:
        loading = self._loading
        for key in keys:
            count = loading.get(key, 0) - 1
            if count > 0:
                loading[key] = count
            else:
                loading.pop(key, None)

    def _evict(self, need: int) -> int:
        """Evict least recently used chunks (not being loaded) worth ``need`` bytes: out
        of the index at once, their bytes counted until one ``delete`` job confirms
        their files gone. Returns the bytes evicted."""
        if need <= 0:
            return 0
        victims = []
        freed = 0
        index, loading = self._index, self._loading
        for key, size in index.items():
            if freed >= need:
                break
            if key in loading:
                continue
            victims.append(key)
            freed += size
        if not victims:
            return 0
        deleting = self._deleting
        for key in victims:
            deleting[key] = index.pop(key)
        self._indexed_bytes -= freed
        self._deleting_bytes += freed
        self._stats.increase_counter(self.EVICTED_METRIC, len(victims), (self._label,))
        if self._events_on:
            self._events.append(OffloadingEvent(victims, Medium.STORAGE, removed=True,
                                                locality=self.locality, ownership=self._label))
        self._to_delete.extend(victims)
        self._submit_deletes()
        return freed

    # --- results ---

    def get_finished_jobs(self) -> Iterable[JobResult]:
        # In a step, while between-steps rounds come, only loads go now: a request waits
        # for them; stores, deletes and probes go at the round ~1 ms after the step, so
        # their encoding and ring writes stay out of the step (bench/README.md, "Polling
        # the storage tiers between steps").
        self._submit_queued(loads_only=self._rounds_come)
        self._process_results()
        finished, self._finished = self._finished, []
        return finished

    def _process_results(self) -> None:
        self._pool.poll()
        results = self._pool.take(self._tier)
        if results:  # a worker adds its tier counts before it answers a job's last piece
            self._note_worker_counts()
        for res in results:
            if res.flags & ResultFlag.NAMESPACE_RESET:  # before this result's outcomes
                # a flagged listing is not adopted either (_scan_id is None now): another
                # worker may have stored into the new namespace after this walk passed the
                # directory and been indexed before this result came; dropping the index
                # for this listing alone would lose those chunks from it (files on disk
                # nobody indexed). The next listing sees them.
                self._namespace_reset()
            if res.job_id == self._scan_id:
                if res.error:  # the worker died or failed mid-listing: list again
                    self._scan_id = None
                    logger.warning("%s tier %s: listing the medium failed (%s); listing again",
                                   self.kind, self._label, res.error)
                else:
                    self._adopt_scan(res)
                continue
            carried = self._jobs.pop(res.job_id, None)
            if carried is None:
                continue
            op, what = carried
            if op == "store":
                # the workers' compression-by-cost choice, as of this answer
                self._compression_on = not res.flags & ResultFlag.COMPRESSION_OFF
                self._page_cache_bounded = bool(res.flags & ResultFlag.PAGE_CACHE_BOUNDED)
                self._finish_stores(res, what)
            elif op == "load":
                start = 0
                for promo, keys in what:  # each tier job: its own keys' outcomes and figures
                    end = start + len(keys)
                    if res.release is not None and any(
                            code != Outcome.OK for code in res.outcomes[start:end]):
                        promo.hold_until(res.release)  # a killed worker may write them
                    self._finish_load(promo, keys, res.outcomes[start:end],
                                      sum(res.seconds[start:end]),
                                      sum(res.logical_bytes[start:end]))
                    start = end
            elif op == "delete":
                self._finish_deletes(res, what)
            elif op == "lookup":
                self._finish_lookup_probes(res, what)
            else:
                self._finish_probes(res, what)
        self._note_pool_health()

    def _finish_stores(self, res: PoolResult, carried: list) -> None:
        """Index the keys stored (written, or found there already) with their sizes;
        probe for the files of keys whose outcome is unknown (ERROR: the worker may have
        died after publishing); send again, after evicting, what was refused for space."""
        label = (self._label,)
        outcomes, sizes = res.outcomes, res.stored_bytes
        written = sum(size for code, size in zip(outcomes, sizes) if code == Outcome.OK)
        self._stats.increase_counter(STORED_RATIO, written, label)
        self._stats.increase_counter(CODEC_SECONDS, res.codec_s, label)
        index, storing = self._index, self._storing
        refused: list[tuple[_Cascade, list, list]] = []
        unknown: list[OffloadKey] = []
        failed = 0
        start = 0
        for cascade, keys, rows in carried:
            end = start + len(keys)
            stored, again, again_rows = [], [], []
            final = 0
            for i, key in enumerate(keys):
                code = outcomes[start + i]
                self._reserved_bytes -= storing.pop(key, 0)
                if code in _STORED:
                    size = sizes[start + i]
                    index[key] = size
                    self._indexed_bytes += size
                    stored.append(key)
                    final += 1
                elif code == Outcome.REJECTED:
                    storing[key] = 0  # queued again, or failed below
                    again.append(key)
                    again_rows.append(rows[i])
                else:
                    final += 1
                    failed += 1
                    if code == Outcome.ERROR:
                        self._hold_for_probe(key, self._file_max(key), front=False)
                        unknown.append(key)
            cascade.seconds += sum(res.seconds[start:end])
            cascade.nbytes += sum(res.logical_bytes[start:end])
            if stored and self._events_on:
                self._events.append(OffloadingEvent(stored, Medium.STORAGE, removed=False,
                                                    locality=self.locality,
                                                    ownership=self._label))
            if again:
                refused.append((cascade, again, again_rows))
            self._settle(cascade, final, final == len(stored))
            start = end
        if failed:
            self._note_store_failure(res, failed, bool(unknown))
        elif written and not refused:
            self._note_stores_work()
        if refused:
            self._on_refused(res, refused)
        if unknown:
            self._submit_probes()

    def _note_store_failure(self, res: PoolResult, failed: int, probing: bool) -> None:
        """``failed`` keys of store result ``res`` failed: one WARNING per change of
        state (the first failure after stores worked, or another reason than the one
        logged: ``res.error`` without its key counts), not one per result."""
        reason = _LEADING_COUNTS.sub(r"\1", res.error or "")
        if reason == self._store_failure:
            return
        self._store_failure = reason
        logger.warning("%s tier %s: %d of %d chunks not stored: %s%s (logged once until stores "
                       "succeed again or the reason changes)", self.kind, self._label, failed,
                       len(res.keys), res.error,
                       "; probing for the chunks of those that failed with ERROR"
                       if probing else "")

    def _note_stores_work(self) -> None:
        """A store result wrote chunks and failed none: after failures (logged once each
        by ``_note_store_failure`` or the space warning), say so once and log the next
        failure again."""
        if self._store_failure is None and "floor" not in self._warned:
            return
        self._store_failure = None
        self._warned.discard("floor")
        logger.info("%s tier %s: stores to %s succeed again", self.kind, self._label,
                    self.medium_words())

    def _settle(self, cascade: _Cascade, final: int, all_ok: bool) -> None:
        """``final`` more keys of ``cascade`` have their final outcome; report the tier
        job once every key has one."""
        if not final:
            return
        cascade.ok = cascade.ok and all_ok
        cascade.pending -= final
        if cascade.pending <= 0:
            self._finished.append(JobResult(cascade.job.job_id, cascade.ok,
                                            transfer_time=cascade.seconds,
                                            transfer_bytes=cascade.nbytes))

    def _on_refused(self, res: PoolResult, refused: list) -> None:
        """Stores refused for space (the free-space floor, the disk full, or
        ``max_bytes``): evict least recently used chunks for them and send them again
        once the evicted files are gone, at most _SPACE_TRIES times per cascade; fail
        them when even freeing all the tier holds would not make room. One WARNING per
        kind, with the numbers."""
        floor = getattr(self.config, "min_free_bytes", None)
        free = free_bytes_in(res.error)
        need = sum(self._file_max(key) for _, keys, _ in refused for key in keys)
        one = self._file_max(refused[0][1][0])
        holds = self.bytes_on_disk
        if free is not None and floor is not None:
            short, short_one = floor + need - free, floor + one - free
            what = (f"{self.medium_words()} has {free} bytes free, less than "
                    f"min_free_bytes ({floor}) and a chunk's file ({one})")
            hint = "; lower min_free_bytes to use it"
        else:
            short, short_one = need, one
            what, hint = f"stores were refused for space ({res.error})", ""
        if short_one > holds:  # freeing all the tier holds would not make room: fail
            self._warn_once("floor", "%s tier %s: %s, and the tier holds only %d bytes on it: "
                            "cascades to this tier fail until space frees up (logged once "
                            "until stores succeed again%s)",
                            self.kind, self._label, what, holds, hint)
            for cascade, keys, _ in refused:
                for key in keys:
                    self._storing.pop(key, None)
                self._settle(cascade, len(keys), False)
            return
        self._warn_once("evict", "%s tier %s: %s; the tier holds %d bytes on it: evicting its "
                        "least recently used chunks to make room (logged once)",
                        self.kind, self._label, what, holds)
        self._evict(short - self._deleting_bytes)
        self._space_wait = True
        for cascade, keys, rows in reversed(refused):
            cascade.tries += 1
            if cascade.tries > _SPACE_TRIES:
                for key in keys:
                    self._storing.pop(key, None)
                self._settle(cascade, len(keys), False)
            else:
                self._store_queue.appendleft([cascade, keys, rows])

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    def _hold_for_probe(self, key: OffloadKey, nbytes: int, front: bool) -> None:
        self._probing[key] = [nbytes, front, 0]
        self._probing_bytes += nbytes
        self._to_probe.append(key)

    def _finish_deletes(self, res: PoolResult, keys: list[OffloadKey]) -> None:
        """Evicted files gone (deleted, or not there): their bytes no longer count. A
        delete whose outcome is unknown (its worker died, the unlink failed): probe."""
        deleting = self._deleting
        gone = 0
        listing = self._scan_id is not None
        for key, code in zip(keys, res.outcomes):
            size = deleting.pop(key, 0)
            if code == Outcome.OK or code == Outcome.MISS:
                gone += size
                if listing:
                    self._gone_since_listing.add(key)
            else:
                self._deleting_bytes -= size
                self._hold_for_probe(key, size, front=True)
        self._deleting_bytes -= gone
        if self._to_probe:
            self._submit_probes()

    def _finish_probes(self, res: PoolResult, keys: list[OffloadKey]) -> None:
        """A file found is indexed with its size (a store's at the recent end, an evicted
        one's at the LRU end, to be evicted again); a file absent is forgotten; a probe
        that failed is sent again, up to _PROBE_TRIES times."""
        probing, index = self._probing, self._index
        adopted, front = [], []
        unknown = 0
        for key, code, size in zip(keys, res.outcomes, res.stored_bytes):
            entry = probing.get(key)
            if entry is None:
                continue
            if code == Outcome.ERROR and entry[2] + 1 < _PROBE_TRIES:
                entry[2] += 1
                self._to_probe.append(key)
                continue
            del probing[key]
            self._probing_bytes -= entry[0]
            if code == Outcome.OK:
                index[key] = size
                self._indexed_bytes += size
                adopted.append(key)
                if entry[1]:
                    front.append(key)
            elif code == Outcome.ERROR:
                unknown += 1
        if unknown:
            logger.warning("%s tier %s: could not learn whether %d chunks exist (%s); "
                           "they stay unknown until a lookup asks or the next start",
                           self.kind, self._label, unknown, res.error)
        for key in reversed(front):
            index.move_to_end(key, last=False)
        if adopted and self._events_on:
            self._events.append(OffloadingEvent(adopted, Medium.STORAGE, removed=False,
                                                locality=self.locality, ownership=self._label))
        if self._max_bytes is not None and self.bytes_committed > self._max_bytes:
            self._evict(self.bytes_committed - self._max_bytes - self._deleting_bytes)

    def _finish_lookup_probes(self, res: PoolResult, keys: list[OffloadKey]) -> None:
        """Lookups' probes answered: a chunk found joins the index at its recent end (a
        request is about to load it) unless the key has a job of this tier's meanwhile;
        absent is a MISS remembered (``LookupProbes``), not learnt (ERROR) too, for
        ``probe_timeout_s``."""
        lookups, index = self._lookups, self._index
        adopted = []
        failed = 0
        for key, code, size in zip(keys, res.outcomes, res.stored_bytes):
            found = code == Outcome.OK
            lookups.answered(key, found, failed=code == Outcome.ERROR)
            if not found:
                failed += code == Outcome.ERROR
                continue
            if (key in index or key in self._storing or key in self._deleting
                    or key in self._probing):
                continue
            index[key] = size
            self._indexed_bytes += size
            adopted.append(key)
        if failed:
            self._warn_once("lookup-probe", "%s tier %s: could not learn whether %d chunks "
                            "are on the medium (%s); answered MISS (logged once)", self.kind,
                            self._label, failed, res.error or "probe failed")
        if adopted:
            self._stats.increase_counter(PROBE_HITS, len(adopted), (self._label,))
            if self._events_on:
                self._events.append(OffloadingEvent(adopted, Medium.STORAGE, removed=False,
                                                    locality=self.locality,
                                                    ownership=self._label))
            if self._max_bytes is not None and self.bytes_committed > self._max_bytes:
                self._evict(self.bytes_committed - self._max_bytes - self._deleting_bytes)

    def _finish_load(self, promo: _Promotion, keys: list[OffloadKey],
                     outcomes: list[Outcome], seconds: float, nbytes: int) -> None:
        ok = promo.ok
        promo.seconds += seconds
        promo.nbytes += nbytes
        self._unmark_loading(keys)
        for key, code in zip(keys, outcomes):
            if code == Outcome.OK:
                ok.append(key)
                continue
            if code == Outcome.ERROR:  # no promote-fail loop: a MISS for a while
                self._lookups.load_failed(key)
            if code == Outcome.MISS or code == Outcome.CORRUPT:
                # gone, or corrupt (removed by the worker): never a HIT again. An ERROR
                # (the worker died, the read failed) says nothing about the chunk: kept.
                size = self._index.pop(key, None)
                if size is not None:
                    self._indexed_bytes -= size
                if self._scan_id is not None:
                    self._gone_since_listing.add(key)
                self._lookups.remember_miss(key)  # unknown now: not probed again at once
                if code == Outcome.CORRUPT:
                    self._stats.increase_counter(CORRUPT_CHUNKS, 1, (self._label,))
        self._settle_load(promo, len(keys))

    def _settle_load(self, promo: _Promotion, final: int) -> None:
        """``final`` more keys of ``promo`` have their outcome; report the tier job once
        every key has one (success only if every key loaded)."""
        promo.pending -= final
        if promo.pending <= 0:
            job = promo.job
            release = promo.release.seal() if promo.release is not None else None
            self._finished.append(JobResult(job.job_id, len(promo.ok) == len(job.keys),
                                            successful_keys=promo.ok,
                                            transfer_time=promo.seconds,
                                            transfer_bytes=promo.nbytes,
                                            deferred_release=None if release is None
                                            else release.event))

    def _namespace_reset(self) -> None:
        """A worker found the tier's namespace gone or made anew: the chunks indexed are
        not on disk any more. Drop them (lookups MISS, not HIT then a failed load) and
        list the medium again (a listing in flight may predate the reset, and one that
        reports the reset itself may miss what other workers stored while it walked).
        Jobs in flight keep their bookkeeping: their results describe the namespace as
        it is now."""
        self.namespace_resets += 1
        dropped = list(self._index)
        if dropped and self._events_on:
            self._events.append(OffloadingEvent(dropped, Medium.STORAGE, removed=True,
                                                locality=self.locality, ownership=self._label))
        self._index.clear()
        self._indexed_bytes = 0
        if dropped:  # the first flag of a reset (workers repeat it; a new root has none)
            logger.warning("%s tier %s: the tier's namespace on %s was removed or made "
                           "anew; %d chunks forgotten, listing it again", self.kind,
                           self._label, self.medium_words(), len(dropped))
        self._index_complete = False
        self._scan_id = None

    def _adopt_scan(self, res: PoolResult) -> None:
        """Index what the listing found (each chunk with its file's size), as older than
        anything stored since the tier started. A key with a store, delete or probe in
        flight is left to that job's outcome (counting it here too would count it
        twice), and so is one known gone since the listing was sent (deleted, or found
        missing or corrupt by a load: the walk may have passed its file before). With more
        than ``max_bytes`` on disk (a lower bound than last time) the least recently used
        chunks are evicted at once."""
        index, storing, deleting, probing = (self._index, self._storing, self._deleting,
                                             self._probing)
        gone = self._gone_since_listing
        added = 0
        for key, size in zip(res.scan_keys, res.scan_stored_bytes):
            if (key in index or key in storing or key in deleting or key in probing
                    or key in gone):
                continue
            index[key] = size
            index.move_to_end(key, last=False)  # older than anything stored since
            added += size
        self._indexed_bytes += added
        self._index_complete = True
        gone.clear()
        logger.info("%s tier %s: %d chunks found on %s (%d bytes)", self.kind, self._label,
                    len(res.scan_keys), self.medium_words(), sum(res.scan_stored_bytes))
        if self._max_bytes is not None and self.bytes_committed > self._max_bytes:
            self._evict(self.bytes_committed - self._max_bytes - self._deleting_bytes)

    def _worker_counts(self) -> list[int]:
        """This tier's ``TIER_COUNTERS`` summed over the worker slots (the segment's
        control words: monotonic over each slot's holders). A few word reads per slot."""
        sums = [0] * len(TIER_COUNTERS)
        rings = self._pool.rings
        for w in range(self._pool.n):
            for i, n in enumerate(rings.worker(w).tier_counters(self._tier)):
                sums[i] += n
        return sums

    def _note_worker_counts(self) -> None:
        """Count what the workers counted for this tier since the last look (its
        ``WORKER_COUNTER_METRICS``)."""
        seen, now = self._worker_counts_seen, self._worker_counts()
        for i, name in enumerate(TIER_COUNTERS):
            if now[i] > seen[i]:
                self._stats.increase_counter(WORKER_COUNTER_METRICS[name], now[i] - seen[i],
                                             (self._label,))
        self._worker_counts_seen = now

    def _note_pool_health(self) -> None:
        if self._pool.broken is not None and not self._broken:
            # the pool logged why, once, and fails what it held; from now on lookups MISS
            # and new jobs fail at once
            self._broken = True
        seen = self._pool_totals_seen
        for i, (name, total) in enumerate(_POOL_COUNTERS):
            now = total(self._pool)
            if now != seen[i]:
                self._stats.increase_counter(name, now - seen[i], (self._label,))
                seen[i] = now
        if self._scan_id is None and not self._index_complete and not self._broken:
            self._gone_since_listing.clear()
            self._scan_id = self._pool.submit("scan", self._tier, [])  # ring full, or failed

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
                      or not (self._index_complete or self._broken))
            if self._store_queue and (not moving or time.monotonic() >= deadline):
                self._fail_waiting_stores()
            if not (self._jobs or self._store_queue or self._pool.rows_held()):
                return
            left = deadline - time.monotonic()
            self._pool.drain(left if left > 0 else 1.0)
            self._process_results()

    def _fail_waiting_stores(self) -> None:
        while self._store_queue:
            cascade, keys, _ = self._store_queue.popleft()
            for key in keys:
                self._storing.pop(key, None)
            self._settle(cascade, len(keys), False)
        self._space_wait = False

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return (bool(self._jobs or self._store_queue or self._load_queue or self._to_delete
                     or self._to_probe) or self._lookups.has_asked
                or not (self._index_complete or self._broken))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # a forward pass without a round (the engine's rhythm changed, the thread is off
        # or behind) and this step sends everything itself
        self._rounds_come, self._rounds_since_step = self._rounds_since_step > 0, 0
        self._submit_queued(loads_only=self._rounds_come)
        self._lookups.purge()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> metrics.OffloadingStats:
        stats, self._stats = self._stats, metrics.OffloadingStats()
        self._gauges_into(stats)
        return stats

    def stats_into(self, stats: metrics.OffloadingStats) -> None:
        """Add the series ``get_stats`` reports (and resets) to ``stats``: the tiering
        manager's step payload, without a payload of the tier's own to merge (most steps
        count nothing but the gauges). Scheduler thread, under the manager's lock."""
        if self._stats.data["data"]:
            own, self._stats = self._stats, metrics.OffloadingStats()
            metrics.merge_stats(stats, own)
        self._gauges_into(stats)

    def _gauges_into(self, stats: metrics.OffloadingStats) -> None:
        stats.set_gauge(self.BYTES_METRIC, self.bytes_on_disk, (self._label,))
        expired = self._lookups.expired
        if expired != self._expired_seen:
            stats.increase_counter(PROBES_EXPIRED, expired - self._expired_seen, (self._label,))
            self._expired_seen = expired
        stats.set_gauge(RING_DEPTH, self._pool.queued_jobs(), (self._label,))
        stats.set_gauge(POOL_BROKEN, int(self._broken), (self._label,))
        stats.set_gauge(COMPRESSION_ON, int(self._compression_on), (self._label,))
        stats.set_gauge(PAGE_CACHE_BOUNDED, int(self._page_cache_bounded), (self._label,))

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        t = (metrics.TIER,)
        return {
            cls.BYTES_METRIC: metrics.GaugeMetadata(cls.BYTES_HELP, t),
            CORRUPT_CHUNKS: metrics.CounterMetadata(
                "Chunk files that failed verification on read (removed, served as a miss).", t),
            STORED_RATIO: metrics.CounterMetadata("Bytes written to the tier after compression.", t),
            CODEC_SECONDS: metrics.CounterMetadata("Seconds tier workers spent compressing.", t),
            WORKER_RESTARTS: metrics.CounterMetadata("Tier worker processes restarted.", t),
            WORKERS_LATE_BUT_BUSY: metrics.CounterMetadata(
                "Times a tier worker's heartbeat was past the timeout while its threads were "
                "running or waiting for a CPU (a busy host): judged slow, not hung, and not "
                "restarted (one per half timeout; the worker's first is logged).", t),
            cls.EVICTED_METRIC: metrics.CounterMetadata(
                "Chunks evicted from the tier for capacity.", t),
            PROBED_KEYS: metrics.CounterMetadata(
                "Keys the tier's index did not know that lookups had the workers look for "
                "on the medium (chunks other engines may have stored).", t),
            PROBE_HITS: metrics.CounterMetadata(
                "Chunks such lookups found on the medium (indexed from then on).", t),
            PROBES_EXPIRED: metrics.CounterMetadata(
                "Lookup probes not answered within probe_timeout_s (answered MISS).", t),
            **metrics.cascade_deferral_metric_definitions(),
            **metrics.deferred_release_metric_definitions(),
            POOL_BROKEN: metrics.GaugeMetadata(
                "1 once the tier workers failed to start repeatedly (the tier then answers "
                "MISS and fails its jobs at once; the log says why), else 0.", t),
            COMPRESSION_ON: metrics.GaugeMetadata(
                "1 while the tier workers compress what they store, 0 while compression by "
                "cost (compression \"auto\") has them store raw frames (as of the last "
                "store answered; each change and its measured inputs are logged by the "
                "worker at INFO).", t),
            PAGE_CACHE_BOUNDED: metrics.GaugeMetadata(
                "1 while the tier workers keep the page cache of their stores bounded (fs "
                "page_cache_bytes: a fixed bound, or \"auto\" once buffered writes showed new "
                "page cache to be expensive; the worker logs the bound at INFO), else 0 (as "
                "of the last store answered).", t),
            RING_DEPTH: metrics.GaugeMetadata(
                "Jobs waiting in the tier workers' job rings (all tiers share the pool).", t),
            **{WORKER_COUNTER_METRICS[name]: metrics.CounterMetadata(_WORKER_COUNTER_HELP[name], t)
               for name in TIER_COUNTERS},
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return (cls.MAX_BYTES_INFO,)

    def config_info(self) -> dict[str, Any]:
        return {self.MAX_BYTES_INFO: self._max_bytes if self._max_bytes is not None else "None"}


def _combined(queued: list) -> Iterator[list]:
    """``queued`` [(job, keys, rows)] in batches of at most MAX_COMBINED_KEYS keys (one
    item alone may have more)."""
    batch: list = []
    size = 0
    for item in queued:
        if batch and size + len(item[1]) > MAX_COMBINED_KEYS:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item[1])
    if batch:
        yield batch
