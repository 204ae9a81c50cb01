"""``node``: the scheduler half of the node-wide KV pool (the worker half is
``shmtier.tiers.node.backend``; the pool itself ``shmtier.tiers.node.pool``).

Who calls: the tiering manager, in the scheduler process, under its lock. Never
blocks (``drain_jobs`` aside) and never waits for another process: a lookup reads the
pool's index without its lock (``NodePool.lookup``: a seqlock read, a few probes),
and every byte moves in this engine's tier workers, which take the pool's lock.

- Lookups answer at once from the pool's shared index, which every engine of the
  pool writes: HIT (the chunk is READY in the pool now, whoever stored it) or MISS,
  never RETRY. A HIT evicted before its load makes the load MISS: the promotion fails
  for that key (the manager frees its row; the next lookup says MISS).
- Cascades (``submit_store``): queued; when the queue is sent, keys the pool holds
  already (stored by another engine, or by this one before) succeed (counted), and the
  rest go to the workers as ``store`` pool jobs, one per operation, combined as the
  storage tiers combine theirs (``shmtier/storage/transfers.py``). A worker answers OK
  (stored), EXISTS (another engine stored it meanwhile), REJECTED (every row of the pool
  is pinned by loads) or ERROR.
- Promotions (``submit_load``): queued, sent as ``load`` pool jobs (split over the
  workers as the storage tiers split theirs); OK, or MISS (evicted), CORRUPT (failed
  its CRC: the pool dropped it) or ERROR (the worker died: if it was killed, the
  promotion's ``deferred_release`` holds the rows until it is gone).
- Loads go out at ``on_schedule_end`` (a request waits for them); the rest at the
  step-window thread's rounds (``polls_between_steps``), or in the step while no rounds
  come (the thread is off, or the engine's rhythm changed). A step polls the workers'
  results only while a load is in flight (``step_needs_poll``): the rounds collect the
  cascades'.

Capacity and eviction are the pool's (one bound for the whole node, one LRU); this
half keeps no index of its own, only the jobs in flight. Per-engine lookup and hit
counts go into the pool's engine table once per step (``NodePool.count_lookup``, for
``shmtier top``); metrics carry the tier label. ``shutdown`` detaches this engine from
the pool: the last engine out removes it unless ``keep``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shmtier import metrics
from shmtier.contract import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from shmtier.scheduler.pool import PoolJobId, PoolResult
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager, TransferJob
from shmtier.options import ConfigError
from shmtier.shared.jobs import Outcome, failure_reason
from shmtier.shared.segment import SegmentSpaceError, human_bytes
from shmtier.storage.tier_metrics import (
    CORRUPT_CHUNKS,
    POOL_BROKEN,
    RING_DEPTH,
    WORKER_RESTARTS,
    WORKERS_LATE_BUT_BUSY,
    PoolCounts,
    TierSeries,
)
from shmtier.storage.transfers import Cascade, Promotion, TierJobs, combined, load_outcomes
from shmtier.tiers.node.config import NodeTierConfig

logger = logging.getLogger(__name__)

HIT, MISS = LookupResult.HIT, LookupResult.MISS

NODE_BYTES = "vllm:kv_offload_shmtier_node_bytes"
NODE_FOUND = "vllm:kv_offload_shmtier_node_stores_found"
NODE_REJECTED = "vllm:kv_offload_shmtier_node_stores_rejected"
NODE_LOAD_MISSES = "vllm:kv_offload_shmtier_node_load_misses"

_DRAIN_S = 120.0
# at most this share of the CPU tier's rows wait pinned for the tier's cascades
_MAX_PINNED_FRACTION = 0.5


def metric_definitions() -> dict[str, Any]:
    """Every series of the node tier (each labelled with the tier, e.g. "1:node")."""
    t = (metrics.TIER,)
    return {
        NODE_BYTES: metrics.GaugeMetadata(
            "Bytes of chunks the node pool holds, for every engine that shares it (its "
            "rows in use times the row size).", t),
        NODE_FOUND: metrics.CounterMetadata(
            "Chunks this engine cascaded that the node pool held already (stored by "
            "another engine, or earlier by this one): nothing copied.", t),
        NODE_REJECTED: metrics.CounterMetadata(
            "Chunks not stored because every row of the node pool was pinned by loads.", t),
        NODE_LOAD_MISSES: metrics.CounterMetadata(
            "Promoted chunks the node pool had evicted between the lookup and the load "
            "(the promotion fails for them; recomputed).", t),
        CORRUPT_CHUNKS: metrics.CounterMetadata(
            "Chunks that failed verification on read (removed, served as a miss).", t),
        WORKER_RESTARTS: metrics.CounterMetadata("Tier worker processes restarted.", t),
        WORKERS_LATE_BUT_BUSY: metrics.CounterMetadata(
            "Times a tier worker's heartbeat was past the timeout while its threads were "
            "running or waiting for a CPU: judged slow, not hung, and not restarted.", t),
        RING_DEPTH: metrics.GaugeMetadata(
            "Jobs waiting in the tier workers' job rings (all tiers share the pool).", t),
        POOL_BROKEN: metrics.GaugeMetadata(
            "1 once the tier workers failed to start repeatedly (the tier then answers "
            "MISS and fails its jobs at once; the log says why), else 0.", t),
        **metrics.cascade_deferral_metric_definitions(),
        **metrics.deferred_release_metric_definitions(),
    }


class NodeTierManager(TierJobs, TierSeries, SecondaryTierManager):
    """The scheduler half of ``node``; its options are a validated ``NodeTierConfig``.
    Built by the tier factory while the spec builds the manager: it attaches to the
    pool (creating it if this engine is the first; ``ConfigError`` if the pool was made
    for another layout or size) and finds the worker pool and its own tier index on the
    spec (``worker_pool``, ``tier_index_being_built``)."""

    medium = Medium.CPU
    # the pool's bytes gauge: what ``shmtier top`` shows as the tier's bytes (and, with
    # ``chunks_on_disk``, its chunks): the whole pool's, every engine's
    BYTES_METRIC = NODE_BYTES
    tolerates_off_thread_polling = False
    polls_between_steps = True
    # a worker killed while it loads may still write the rows: its failed promotions
    # carry deferred_release (set once the pool sees the process gone)
    defers_release = True

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, config: NodeTierConfig):
        from shmtier.tiers.node.pool import NodePool

        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config
        num_rows = primary_kv_view.shape[0] if primary_kv_view.ndim == 2 else 0
        self.max_pinned_rows = max(1, int(num_rows * _MAX_PINNED_FRACTION))
        self._pool = offloading_spec.worker_pool
        self._tier = offloading_spec.tier_index_being_built
        self._label = f"{self._tier + 1}:{tier_type}"
        self.pool_name = config.pool_for(offloading_spec.engine_id)
        try:
            self.node = NodePool.attach(
                self.pool_name, row_bytes=offloading_spec.chunk_payload_bytes,
                size_bytes=config.size_bytes, fingerprint=offloading_spec.fingerprint,
                engine_id=offloading_spec.engine_id, keep=config.keep, register=True)
        except SegmentSpaceError as e:
            raise ConfigError(
                f"secondary_tiers[{self._tier}].size_bytes = {config.size_bytes} does not fit "
                f"in {e.shm_dir}: the node pool {self.pool_name!r} needs {e.size} bytes "
                f"({human_bytes(e.size)}), {e.shm_dir} has {e.free} bytes free; lower "
                f"size_bytes or give {e.shm_dir} more room. Nothing was created.") from e
        self._lookup = self.node.lookup
        # pool job id -> (op, what it carries): store [(cascade, keys, rows)], load
        # [(promotion, keys)]
        self._jobs: dict[PoolJobId, tuple[str, list]] = {}
        self._store_queue: list[tuple[Cascade, list[OffloadKey], list[int]]] = []
        self._load_queue: list[tuple[Promotion, list[OffloadKey], list[int]]] = []
        self._finished: list[JobResult] = []
        self._stats = metrics.OffloadingStats()
        self._pool_counts = PoolCounts(self._pool, self._tier, self._label)
        self._broken = False  # the worker pool is broken: MISS, and fail jobs at once
        self._lookups = self._hits = 0  # since the last step's count into the pool
        self._pool_chunks = self._pool_bytes = 0
        self._detached = False
        self._store_failure: str | None = None  # the store failure last logged

    # --- lookups ---

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._broken:  # nothing can be loaded: a MISS, never a wait
            return MISS
        self._lookups += 1
        if self._lookup(key):
            self._hits += 1
            return HIT
        return MISS

    # --- jobs ---

    def submit_store(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False))
            return
        keys = list(job.keys)
        self._store_queue.append((Cascade(job, len(keys)), keys, list(job.rows)))

    def submit_load(self, job: TransferJob) -> None:
        if self._broken:
            self._finished.append(JobResult(job.job_id, False, successful_keys=[]))
            return
        keys = list(job.keys)
        self._load_queue.append((Promotion(job, len(keys)), keys, list(job.rows)))

    def _submit_queued(self, loads_only: bool = False) -> None:
        """Hand the queues to the worker pool, loads first (``loads_only``: stores wait
        for a between-steps round). A job the rings have no room for fails now (the
        backpressure detector is told); with the pool broken every queued job fails."""
        if self._broken:
            self._fail_queued()
            return
        if self._load_queue:
            queued, self._load_queue = self._load_queue, []
            for batch in combined(queued):
                self._submit_loads(batch)
        if self._store_queue and not loads_only:
            queued, self._store_queue = self._store_queue, []
            for batch in combined(self._not_in_pool(queued)):
                self._submit_stores(batch)

    def _not_in_pool(self, queued: list) -> list:
        """``queued`` [(cascade, keys, rows)] less the keys the pool holds READY (stored
        by another engine, or by this one before: nothing to copy; counted, settled as
        stored), by one read of the pool's index for all of them. Done when the queue is
        sent (a between-steps round while rounds come), not in ``submit_store``: the
        index read stays out of the step."""
        ready = iter(self.node.lookup_many([key for _, keys, _ in queued for key in keys]))
        left, found = [], 0
        for cascade, keys, rows in queued:
            kept = [(key, row) for key, row in zip(keys, rows) if not next(ready)]
            if len(kept) < len(keys):
                found += len(keys) - len(kept)
                self._settle(cascade, len(keys) - len(kept), True)
            if kept:
                left.append((cascade, [key for key, _ in kept], [row for _, row in kept]))
        if found:
            self._stats.increase_counter(NODE_FOUND, found, (self._label,))
        return left

    def _submit_stores(self, batch: list) -> None:
        keys = [key for _, job_keys, _ in batch for key in job_keys]
        rows = [row for _, _, job_rows in batch for row in job_rows]
        pool_id = self._pool.submit("store", self._tier, keys, rows)
        if pool_id is not None:
            self._jobs[pool_id] = ("store", batch)
            return
        if self._bp_detector is not None and self._pool.broken is None:
            self._bp_detector.note_ring_full()
        for cascade, job_keys, _ in batch:  # the rings are full: every key fails now
            self._settle(cascade, len(job_keys), False)

    def _fail_queued(self) -> None:
        queued, self._store_queue = self._store_queue, []
        for cascade, keys, _ in queued:
            self._settle(cascade, len(keys), False)
        loads, self._load_queue = self._load_queue, []
        for promo, keys, _ in loads:
            self._settle_load(promo, len(keys))

    # --- results ---

    def _process_results(self) -> None:
        self._pool.poll()
        for res in self._pool.take(self._tier):
            carried = self._jobs.pop(res.job_id, None)
            if carried is None:
                continue
            op, what = carried
            if op == "store":
                self._finish_stores(res, what)
            else:
                for promo, keys, outcomes, seconds, nbytes in load_outcomes(res, what):
                    self._finish_load(promo, keys, outcomes, seconds, nbytes)
        if self._pool.broken is not None and not self._broken:
            # the pool logged why, once, and fails what it held; from now on lookups MISS
            # and new jobs fail at once
            self._broken = True
        self._pool_counts.note_totals(self._stats)

    def _finish_stores(self, res: PoolResult, carried: list) -> None:
        """Each cascade's keys final: stored (OK, or EXISTS: another engine stored it) or
        failed (REJECTED: every pool row pinned; ERROR; INVALID). Failures are logged once
        per reason until stores succeed again, never once per result."""
        label = (self._label,)
        start = failed = 0
        for cascade, keys, _ in carried:
            end = start + len(keys)
            outcomes = res.outcomes[start:end]
            found = outcomes.count(Outcome.EXISTS)
            stored = outcomes.count(Outcome.OK) + found
            rejected = outcomes.count(Outcome.REJECTED)
            if found:
                self._stats.increase_counter(NODE_FOUND, found, label)
            if rejected:
                self._stats.increase_counter(NODE_REJECTED, rejected, label)
            failed += len(keys) - stored
            cascade.seconds += sum(res.seconds[start:end])
            cascade.nbytes += sum(res.logical_bytes[start:end])
            self._settle(cascade, len(keys), stored == len(keys))
            start = end
        reason = failure_reason(res.error) if failed else None
        if failed and reason != self._store_failure:
            self._store_failure = reason
            logger.warning("node tier %s: %d of %d chunks not stored in pool %s: %s (logged "
                           "once until stores succeed again or the reason changes)",
                           self._label, failed, len(res.keys), self.pool_name, res.error)
        elif not failed and self._store_failure is not None:
            self._store_failure = None
            logger.info("node tier %s: stores to pool %s succeed again", self._label,
                        self.pool_name)

    def _finish_load(self, promo: Promotion, keys: list[OffloadKey], outcomes: list[Outcome],
                     seconds: float, nbytes: int) -> None:
        promo.seconds += seconds
        promo.nbytes += nbytes
        label = (self._label,)
        for key, code in zip(keys, outcomes):
            if code == Outcome.OK:
                promo.ok.append(key)
            elif code == Outcome.MISS:
                self._stats.increase_counter(NODE_LOAD_MISSES, 1, label)
            elif code == Outcome.CORRUPT:
                self._stats.increase_counter(CORRUPT_CHUNKS, 1, label)
        self._settle_load(promo, len(keys))

    def drain_jobs(self) -> None:
        """Block until every tier job is reported and every worker killed with a load
        part is gone (each ``deferred_release`` handed out is set); TimeoutError past
        ``_DRAIN_S``."""
        deadline = time.monotonic() + _DRAIN_S
        while True:
            self._submit_queued()
            self._process_results()
            if not (self._jobs or self._pool.rows_held()):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node tier {self._label}: {len(self._jobs)} jobs still "
                                   f"outstanding after {_DRAIN_S:g} s")
            self._pool.drain(left)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._store_queue or self._load_queue)

    def step_needs_poll(self) -> bool:
        """A load is in flight, or a result waits (a step's requests wait for loads
        only; cascades' results are left to the step-window thread's rounds)."""
        return bool(self._finished) or any(op == "load" for op, _ in self._jobs.values())

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._submit_at_step_end()
        if self._lookups:
            self.node.count_lookup(self._hits, self._lookups)
            self._lookups = self._hits = 0

    # --- metrics ---

    @property
    def chunks_on_disk(self) -> int:
        """Chunks the pool holds (every engine's), as of the last stats read (``shmtier
        top``'s CHUNKS of the tier)."""
        return self._pool_chunks

    def _gauges_into(self, stats: metrics.OffloadingStats) -> None:
        label = (self._label,)
        if not self._detached:  # one header read (``NodePool.stats`` would walk the rows)
            self._pool_chunks = self.node.used_rows()
            self._pool_bytes = self._pool_chunks * self.node.layout.row_bytes
        stats.set_gauge(NODE_BYTES, self._pool_bytes, label)
        stats.set_gauge(RING_DEPTH, self._pool.queued_jobs(), label)
        stats.set_gauge(POOL_BROKEN, int(self._broken), label)

    @classmethod
    def build_metric_definitions(cls, tier_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("node_pool", "node_size_bytes")

    def config_info(self) -> dict[str, Any]:
        return {"node_pool": self.pool_name, "node_size_bytes": self.config.size_bytes}

    # --- shutdown ---

    def shutdown(self) -> None:
        """Leave the pool (this engine's entry in its engine table goes; the last engine
        out removes it unless ``keep``). Jobs still in flight were drained by the
        manager; a worker still mapping the pool keeps its mapping until it exits.
        Idempotent."""
        if self._detached:
            return
        self._detached = True
        self.node.detach()
