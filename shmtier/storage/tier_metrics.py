"""The series a storage tier's scheduler half reports: their names and help, and what
it reads of the worker pool's counters (scheduler process).

Who calls: :class:`~shmtier.storage.scheduler.StorageTierManager` (its
``build_metric_definitions``, and :class:`PoolCounts` under the tiering manager's lock
once per batch of results), the node tier's scheduler half (the pool's series it shares,
:class:`PoolCounts` and :class:`TierSeries`); the tier types re-export the names their
tests and dashboards use. No I/O: the counters are words of the shared segment (a few reads per
worker slot).
"""

from __future__ import annotations

from typing import Any

from shmtier import metrics
from shmtier.shared.ring import TIER_COUNTERS

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
DIRECT_STORES = "vllm:kv_offload_shmtier_direct_stores"
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


class PoolCounts:
    """What the worker pool counted for tier ``tier`` (labelled ``label``) since the last
    look, as counter increments: its running totals (restarts, late but busy workers)
    and the tier's worker counters (``WORKER_COUNTER_METRICS``)."""

    __slots__ = ("_pool", "_tier", "_label", "_totals_seen", "_workers_seen")

    def __init__(self, pool: Any, tier: int, label: str):
        self._pool = pool
        self._tier = tier
        self._label = (label,)
        self._totals_seen = [total(pool) for _, total in _POOL_COUNTERS]
        self._workers_seen = self._worker_counts()

    def _worker_counts(self) -> list[int]:
        """This tier's ``TIER_COUNTERS`` summed over the worker slots (the segment's
        control words: monotonic over each slot's holders)."""
        sums = [0] * len(TIER_COUNTERS)
        rings = self._pool.rings
        for w in range(self._pool.n):
            for i, n in enumerate(rings.worker(w).tier_counters(self._tier)):
                sums[i] += n
        return sums

    def note_workers(self, stats: metrics.OffloadingStats) -> None:
        """Count what the workers counted for this tier since the last look."""
        seen, now = self._workers_seen, self._worker_counts()
        for i, name in enumerate(TIER_COUNTERS):
            if now[i] > seen[i]:
                stats.increase_counter(WORKER_COUNTER_METRICS[name], now[i] - seen[i],
                                       self._label)
        self._workers_seen = now

    def note_totals(self, stats: metrics.OffloadingStats) -> None:
        """Count the pool's running totals' growth since the last look."""
        seen = self._totals_seen
        for i, (name, total) in enumerate(_POOL_COUNTERS):
            now = total(self._pool)
            if now != seen[i]:
                stats.increase_counter(name, now - seen[i], self._label)
                seen[i] = now


class TierSeries:
    """``get_stats`` and ``stats_into`` of a worker-backed tier's scheduler half (a mixin,
    ahead of ``SecondaryTierManager``): the counters it added to ``_stats`` (an
    ``OffloadingStats`` its ``__init__`` sets) since the last call, and its gauges
    (``_gauges_into(stats)``, the tier's). Scheduler thread, under the manager's lock."""

    _stats: metrics.OffloadingStats

    def get_stats(self) -> metrics.OffloadingStats:
        stats, self._stats = self._stats, metrics.OffloadingStats()
        self._gauges_into(stats)
        return stats

    def stats_into(self, stats: metrics.OffloadingStats) -> None:
        """Add the series ``get_stats`` reports (and resets) to ``stats``: the tiering
        manager's step payload, without a payload of the tier's own to merge (most steps
        count nothing but the gauges)."""
        if self._stats.data["data"]:
            own, self._stats = self._stats, metrics.OffloadingStats()
            metrics.merge_stats(stats, own)
        self._gauges_into(stats)


def metric_definitions(bytes_metric: str, bytes_help: str,
                       evicted_metric: str) -> dict[str, Any]:
    """Every series of a storage tier whose bytes gauge is ``bytes_metric`` and whose
    evictions counter is ``evicted_metric``."""
    t = (metrics.TIER,)
    return {
        bytes_metric: metrics.GaugeMetadata(bytes_help, t),
        CORRUPT_CHUNKS: metrics.CounterMetadata(
            "Chunk files that failed verification on read (removed, served as a miss).", t),
        STORED_RATIO: metrics.CounterMetadata("Bytes written to the tier after compression.", t),
        CODEC_SECONDS: metrics.CounterMetadata("Seconds tier workers spent compressing.", t),
        WORKER_RESTARTS: metrics.CounterMetadata("Tier worker processes restarted.", t),
        WORKERS_LATE_BUT_BUSY: metrics.CounterMetadata(
            "Times a tier worker's heartbeat was past the timeout while its threads were "
            "running or waiting for a CPU (a busy host): judged slow, not hung, and not "
            "restarted (one per half timeout; the worker's first is logged).", t),
        evicted_metric: metrics.CounterMetadata(
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
        DIRECT_STORES: metrics.GaugeMetadata(
            "1 while the tier workers store with O_DIRECT (fs direct_io true, \"auto\" or "
            "\"writes\", or \"adaptive\" once buffered writes showed new page cache to be "
            "expensive: the worker logs the switch at INFO), else 0 (as of the last store "
            "answered).", t),
        RING_DEPTH: metrics.GaugeMetadata(
            "Jobs waiting in the tier workers' job rings (all tiers share the pool).", t),
        **{WORKER_COUNTER_METRICS[name]: metrics.CounterMetadata(_WORKER_COUNTER_HELP[name], t)
           for name in TIER_COUNTERS},
    }
