"""``fs``: the scheduler half of the filesystem tier (the worker half is
``shmtier.tiers.fs.backend``).

Who calls: the tiering manager, in the scheduler process, under its lock.
Nothing here touches a file: every byte moves in tier worker processes, via
the shared :class:`~shmtier.scheduler.pool.WorkerPool`. Never blocks except
``drain_jobs``.

What the scheduler half keeps: an index ``key -> stored bytes`` in recency
order (the tier's own LRU; each chunk's size as the worker reported it: the
file it wrote or found, or the one a scan listed), the bytes in use (their
sum), and which keys have a store or load in flight. A tier job's
``transfer_time`` and ``transfer_bytes`` are the sums of the seconds and
logical bytes the workers reported for its own keys. At start it asks a
worker to ``scan`` the root (warm restart); until that listing arrives a key
it does not know answers RETRY, afterwards lookups answer HIT or MISS at once
(no probe round trip per miss, docs/design.md §10).

Capacity: ``max_bytes`` (None = unbounded; the workers also keep a free-space
floor). Before a store the LRU keys not being loaded are evicted, and one
``delete`` job removes their files.

Submission: ``submit_store``/``submit_load`` only queue. The queue goes to the
pool as one job per operation (loads first) at ``on_schedule_end`` and at the
next ``get_finished_jobs`` -- so a step's promotions of many requests, or the
cascades of all the stores that completed together, cost one ring put and one
wake-up per worker instead of one per request (measured: this was the largest
part of the slowest steps). A full job ring fails the queued jobs at once and
tells the backpressure detector.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
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
from shmtier.scheduler.pool import PoolJobId, PoolResult
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager, TransferJob
from shmtier.shared.jobs import SUCCESS, Outcome
from shmtier.tiers.fs.config import FsTierConfig

logger = logging.getLogger(__name__)

_STORED = SUCCESS["store"]  # written, or found there already

# At most this many keys per pool job when queued jobs are combined (a job needs
# one ring slot per ~200 keys; the rings hold 128 slots per worker).
MAX_COMBINED_KEYS = 1024

BYTES_ON_DISK = "vllm:kv_offload_shmtier_fs_bytes_on_disk"
CORRUPT_CHUNKS = "vllm:kv_offload_shmtier_checksum_failures"
STORED_RATIO = "vllm:kv_offload_shmtier_codec_stored_bytes"
CODEC_SECONDS = "vllm:kv_offload_shmtier_codec_seconds"
WORKER_RESTARTS = "vllm:kv_offload_shmtier_worker_restarts"
EVICTED_CHUNKS = "vllm:kv_offload_shmtier_fs_evicted_chunks"
RING_DEPTH = "vllm:kv_offload_shmtier_ring_depth"
POOL_BROKEN = "vllm:kv_offload_shmtier_worker_pool_broken"


class FsTierManager(SecondaryTierManager):
    """The scheduler half of ``fs``; its options are a validated :class:`FsTierConfig`
    (``shmtier/tiers/fs/config.py`` documents each). Built by the tier factory while
    the spec builds the manager: it finds the worker pool and its own tier index on the
    spec (``worker_pool``, ``tier_index_being_built``)."""

    medium = Medium.STORAGE
    # Not polled from the manager's tier-poll thread (as vLLM's fs tier is not): the
    # thread's GIL hand-offs cost more step time than they saved (bench/README.md).
    tolerates_off_thread_polling = False

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, config: FsTierConfig):
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
        self._max_bytes = config.max_bytes
        self._events_on = config.enable_kv_events and getattr(offloading_spec, "enable_events", False)
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._bytes_in_use = 0
        self._storing: set[OffloadKey] = set()
        self._loading: dict[OffloadKey, int] = {}
        # pool job id -> the tier jobs it carries, in submit order: [(job, keys)]
        # (a delete carries [(None, victims)])
        self._jobs: dict[PoolJobId, list[tuple[TransferJob | None, list[OffloadKey]]]] = {}
        # op -> tier jobs queued since the last _submit_queued: [(job, keys, rows)]
        self._queued: dict[str, list[tuple[TransferJob, list[OffloadKey], list[int]]]] = {
            "load": [], "store": []}
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats = metrics.OffloadingStats()
        self._restarts_seen = self._pool.restarts_total
        self._scan_id: PoolJobId | None = self._pool.submit("scan", self._tier, [])
        self._index_complete = False
        self._broken = False  # the pool is broken: MISS, and fail jobs at once

    # --- lookups ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._broken:  # nothing can be loaded: a MISS, never a wait
            return LookupResult.MISS
        if key in self._index:
            self._index.move_to_end(key)
            return LookupResult.HIT
        if key in self._storing or self._index_complete:
            return LookupResult.MISS
        return LookupResult.RETRY  # still listing the root (warm restart)

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
        for key, row in zip(job.keys, job.rows):
            if key not in self._index and key not in self._storing:
                keys.append(key)
                rows.append(row)
        if not keys:
            self._finished.append(JobResult(job.job_id, True, transfer_time=0.0, transfer_bytes=0))
            return
        self._make_room(len(keys) * self._chunk_bytes)
        self._storing.update(keys)
        self._queued["store"].append((job, keys, rows))

    def submit_load(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False, successful_keys=[]))
            return
        keys = list(job.keys)
        for key in keys:
            self._loading[key] = self._loading.get(key, 0) + 1
        self._queued["load"].append((job, keys, job.rows))

    def _submit_queued(self) -> None:
        """Hand every queued job to the pool, combined: one pool job per operation
        (up to MAX_COMBINED_KEYS keys each), loads first."""
        for op in ("load", "store"):
            queued = self._queued[op]
            if not queued:
                continue
            self._queued[op] = []
            batch: list = []
            size = 0
            for item in queued:
                if batch and size + len(item[1]) > MAX_COMBINED_KEYS:
                    self._submit_combined(op, batch)
                    batch, size = [], 0
                batch.append(item)
                size += len(item[1])
            self._submit_combined(op, batch)

    def _submit_combined(self, op: str, batch: list) -> None:
        keys = [key for _, job_keys, _ in batch for key in job_keys]
        rows = [row for _, _, job_rows in batch for row in job_rows]
        # stores carry the tier's byte count: the workers refuse what would pass max_bytes
        args = {"bytes_in_use": self._bytes_in_use} if op == "store" and self._max_bytes else None
        pool_id = self._pool.submit(op, self._tier, keys, rows, args)
        if pool_id is not None:
            self._jobs[pool_id] = [(job, job_keys) for job, job_keys, _ in batch]
            return
        # the rings are full (or the pool is broken): every job of the batch fails now
        if op == "store":
            self._storing.difference_update(keys)
            if self._bp_detector is not None and self._pool.broken is None:
                self._bp_detector.note_ring_full()
            self._finished.extend(JobResult(job.job_id, False) for job, _, _ in batch)
        else:
            self._unmark_loading(keys)
            self._finished.extend(JobResult(job.job_id, False, successful_keys=[])
                                  for job, _, _ in batch)

    def _unmark_loading(self, keys: Iterable[OffloadKey]) -> None:
        loading = self._loading
        for key in keys:
            count = loading.get(key, 0) - 1
            if count > 0:
                loading[key] = count
            else:
                loading.pop(key, None)

    def _make_room(self, need: int) -> None:
        """Evict LRU chunks (not being loaded) until ``need`` more bytes fit."""
        if self._max_bytes is None or self._bytes_in_use + need <= self._max_bytes:
            return
        victims = []
        for key in self._index:
            if self._bytes_in_use + need <= self._max_bytes:
                break
            if key in self._loading:
                continue
            victims.append(key)
            self._bytes_in_use -= self._index[key]
        for key in victims:
            del self._index[key]
        if victims:
            self._stats.increase_counter(EVICTED_CHUNKS, len(victims), (self._label,))
            if self._events_on:
                self._events.append(OffloadingEvent(victims, Medium.STORAGE, removed=True,
                                                    locality=self.locality, ownership=self._label))
            pool_id = self._pool.submit("delete", self._tier, victims)
            if pool_id is not None:
                self._jobs[pool_id] = [(None, victims)]
            else:
                logger.warning("fs tier %s: job ring full, %d evicted files stay on disk until "
                               "the next scan", self._label, len(victims))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._submit_queued()
        self._pool.poll()
        for res in self._pool.take(self._tier):
            if res.job_id == self._scan_id:
                if res.error:  # the worker died or failed mid-listing: list again
                    self._scan_id = None
                    logger.warning("fs tier %s: listing the root failed (%s); listing again",
                                   self._label, res.error)
                else:
                    self._adopt_scan(res)
                continue
            carried = self._jobs.pop(res.job_id, None)
            if carried is None or res.op not in ("store", "load"):
                continue
            if res.op == "store":
                self._account_stores(res)
            start = 0
            for job, keys in carried:  # each tier job: its own keys' outcomes and figures
                end = start + len(keys)
                outcomes = res.outcomes[start:end]
                seconds = sum(res.seconds[start:end])
                nbytes = sum(res.logical_bytes[start:end])
                if res.op == "store":
                    self._finish_store(job, keys, outcomes, res.stored_bytes[start:end],
                                       seconds, nbytes)
                else:
                    self._finish_load(job, keys, outcomes, seconds, nbytes)
                start = end
        self._note_pool_health()
        finished, self._finished = self._finished, []
        return finished

    def _account_stores(self, res: PoolResult) -> None:
        """Count a store pool job's written bytes and codec time; warn about what failed."""
        label = (self._label,)
        written = sum(size for code, size in zip(res.outcomes, res.stored_bytes)
                      if code == Outcome.OK)
        self._stats.increase_counter(STORED_RATIO, written, label)
        self._stats.increase_counter(CODEC_SECONDS, res.codec_s, label)
        failed = sum(1 for code in res.outcomes if code not in _STORED)
        if failed:
            logger.warning("fs tier %s: %d of %d chunks not stored: %s", self._label,
                           failed, len(res.keys), res.error)

    def _finish_store(self, job: TransferJob, keys: list[OffloadKey], outcomes: list[Outcome],
                      sizes: list[int], seconds: float, nbytes: int) -> None:
        """Index the keys stored (written, or found there already) with their sizes."""
        self._storing.difference_update(keys)
        index = self._index
        ok = []
        added = 0
        for key, code, size in zip(keys, outcomes, sizes):
            if code in _STORED:
                ok.append(key)
                old = index.get(key)
                index[key] = size
                added += size
                if old is not None:  # listed by the scan meanwhile: stored just now
                    added -= old
                    index.move_to_end(key)
        self._bytes_in_use += added
        if ok and self._events_on:
            self._events.append(OffloadingEvent(ok, Medium.STORAGE, removed=False,
                                                locality=self.locality, ownership=self._label))
        self._finished.append(JobResult(job.job_id, len(ok) == len(keys),
                                        transfer_time=seconds, transfer_bytes=nbytes))

    def _finish_load(self, job: TransferJob, keys: list[OffloadKey], outcomes: list[Outcome],
                     seconds: float, nbytes: int) -> None:
        ok = []
        self._unmark_loading(keys)
        for key, code in zip(keys, outcomes):
            if code == Outcome.OK:
                ok.append(key)
                continue
            # missing, corrupt (removed by the worker) or unreadable: never a HIT again
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes_in_use -= size
            if code == Outcome.CORRUPT:
                self._stats.increase_counter(CORRUPT_CHUNKS, 1, (self._label,))
        self._finished.append(JobResult(job.job_id, len(ok) == len(keys), successful_keys=ok,
                                        transfer_time=seconds, transfer_bytes=nbytes))

    def _adopt_scan(self, res: PoolResult) -> None:
        """Index what the listing found (each chunk with its file's size), as older than
        anything stored since the tier started."""
        index = self._index
        added = 0
        for key, size in zip(res.scan_keys, res.scan_stored_bytes):
            if key not in index:
                index[key] = size
                index.move_to_end(key, last=False)  # older than anything stored since
                added += size
        self._bytes_in_use += added
        self._index_complete = True
        logger.info("fs tier %s: %d chunks found on disk (%d bytes)", self._label,
                    len(res.scan_keys), sum(res.scan_stored_bytes))

    def _note_pool_health(self) -> None:
        if self._pool.broken is not None and not self._broken:
            # the pool logged why, once, and fails what it held; from now on lookups MISS
            # and new jobs fail at once
            self._broken = True
        restarts = self._pool.restarts_total
        if restarts != self._restarts_seen:
            self._stats.increase_counter(WORKER_RESTARTS, restarts - self._restarts_seen, (self._label,))
            self._restarts_seen = restarts
        if self._scan_id is None and not self._index_complete and not self._broken:
            self._scan_id = self._pool.submit("scan", self._tier, [])  # ring full, or failed

    def drain_jobs(self) -> None:
        self._submit_queued()
        self._pool.drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def has_pending_work(self) -> bool:
        return (bool(self._jobs) or bool(self._queued["load"]) or bool(self._queued["store"])
                or not (self._index_complete or self._broken))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._submit_queued()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def get_stats(self) -> metrics.OffloadingStats:
        stats, self._stats = self._stats, metrics.OffloadingStats()
        stats.set_gauge(BYTES_ON_DISK, self._bytes_in_use, (self._label,))
        stats.set_gauge(RING_DEPTH, self._pool.queued_jobs(), (self._label,))
        stats.set_gauge(POOL_BROKEN, int(self._broken), (self._label,))
        return stats

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        t = (metrics.TIER,)
        return {
            BYTES_ON_DISK: metrics.GaugeMetadata("Bytes the fs tier holds on disk (frames).", t),
            CORRUPT_CHUNKS: metrics.CounterMetadata(
                "Chunk files that failed verification on read (removed, served as a miss).", t),
            STORED_RATIO: metrics.CounterMetadata("Bytes written to the tier after compression.", t),
            CODEC_SECONDS: metrics.CounterMetadata("Seconds tier workers spent compressing.", t),
            WORKER_RESTARTS: metrics.CounterMetadata("Tier worker processes restarted.", t),
            EVICTED_CHUNKS: metrics.CounterMetadata("Chunks evicted from the tier for capacity.", t),
            POOL_BROKEN: metrics.GaugeMetadata(
                "1 once the tier workers failed to start repeatedly (the tier then answers "
                "MISS and fails its jobs at once; the log says why), else 0.", t),
            RING_DEPTH: metrics.GaugeMetadata(
                "Jobs waiting in the tier workers' job rings (all tiers share the pool).", t),
        }

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("fs_max_bytes",)

    def config_info(self) -> dict[str, Any]:
        return {"fs_max_bytes": self._max_bytes if self._max_bytes is not None else "None"}
