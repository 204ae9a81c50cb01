"""The tiering manager's step payload (scheduler process): what ``get_stats`` reports
each step, assembled from the primary, the lookup metrics, each tier (its jobs in flight,
its backpressure, its own series) and the deferred releases, then handed to the stats
publisher for ``shmtier top``.

Who calls: :meth:`TieringOffloadingManager.get_stats`, in the scheduler process, under
its lock, once per step. Never blocks (the publisher writes the segment's stats area at
most every 0.1 s).
"""

from __future__ import annotations

from typing import Any

from shmtier import metrics
from shmtier.scheduler.backpressure import record_backpressure_metrics


class StepStats:
    """Fills a step's payload for manager ``manager`` (built last in its ``__init__``)."""

    __slots__ = ("_manager", "_tiers", "_labels", "_active", "_num_chunks", "_stats_into")

    def __init__(self, manager: Any):
        self._manager = manager
        self._tiers = manager.tiers
        self._labels = [(label,) for label in manager.labels[1:]]
        self._active = manager._active  # in-flight [jobs, rows] per tier (never rebound)
        self._num_chunks = manager._num_chunks
        # a tier's ``stats_into(stats)`` (shmtier's storage tiers) adds its step series to
        # the payload directly; others' get_stats payloads are merged
        self._stats_into = [getattr(t, "stats_into", None) for t in manager.tiers]

    def fill(self, stats: metrics.OffloadingStats) -> metrics.OffloadingStats:
        """Add the step's gauges and every part's series to ``stats`` (the counters the
        manager collected since the last step); returns it."""
        manager = self._manager
        manager.primary.stats_into(stats)
        manager._tracker.take_into(stats)
        num_chunks = self._num_chunks
        promoting, cascading = self._active[True], self._active[False]
        for tier_idx, tier in enumerate(self._tiers):
            label = self._labels[tier_idx]
            promotions, promo_rows = promoting[tier_idx]
            cascades, cascade_rows = cascading[tier_idx]
            stats.set_gauge(metrics.ACTIVE_PROMOTION_JOBS, promotions, label)
            stats.set_gauge(metrics.ACTIVE_CASCADE_JOBS, cascades, label)
            stats.set_gauge(metrics.PRIMARY_WRITE_USAGE_PERC, promo_rows / num_chunks, label)
            stats.set_gauge(metrics.PRIMARY_READ_USAGE_PERC, cascade_rows / num_chunks, label)
            detector = tier.bp_detector
            if detector is not None:
                record_backpressure_metrics(stats, detector, label[0])
            stats_into = self._stats_into[tier_idx]
            if stats_into is not None:
                stats_into(stats)
            else:
                metrics.merge_stats(stats, tier.get_stats())
        manager._held.gauges_into(stats)
        publisher = manager._publisher
        if publisher is not None:  # while rounds come, they publish
            rhythm = manager._rhythm
            publisher.observe(stats, publish=not (rhythm is not None and rhythm.rounds_came))
        return stats
