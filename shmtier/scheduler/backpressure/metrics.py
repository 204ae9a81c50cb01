"""Backpressure's Prometheus series: one tier's EMA gauge and drop counters.

Who calls: the tiering manager, in the scheduler process, once per step while it fills
its stats payload. May it block: never (reads the detector, pops the policy's counters).
Names, types and labels are defined once, in :mod:`shmtier.metrics`.
"""

from __future__ import annotations

from typing import Any

from shmtier.metrics import (
    BACKPRESSURE_BLOCKS_DROPPED,
    BACKPRESSURE_STORE_LATENCY_EMA,
    BACKPRESSURE_STORES_DROPPED,
)
from shmtier.metrics import TIER as TIER_LABEL

__all__ = ["backpressure_metric_definitions", "record_backpressure_metrics",
           "BACKPRESSURE_STORE_LATENCY_EMA", "BACKPRESSURE_STORES_DROPPED",
           "BACKPRESSURE_BLOCKS_DROPPED", "TIER_LABEL"]

_NAMES = (BACKPRESSURE_STORE_LATENCY_EMA, BACKPRESSURE_STORES_DROPPED, BACKPRESSURE_BLOCKS_DROPPED)


def backpressure_metric_definitions() -> dict[str, Any]:
    """Declarations of the three backpressure series (labelled by ``tier``)."""
    from shmtier.metrics import tiering_metric_definitions

    return {name: meta for name, meta in tiering_metric_definitions().items() if name in _NAMES}


def record_backpressure_metrics(stats: Any, detector: Any, tier_label: str) -> None:
    """Put one tier's backpressure series into a stats payload (once per step).

    ``stats`` is a :class:`shmtier.metrics.OffloadingStats`, ``detector`` a
    :class:`~shmtier.scheduler.backpressure.BackpressureDetector`. The EMA gauge is set
    when the detector reports one; the drop counters are popped (so each drop is
    reported once) and added only when non-zero.
    """
    labelvalues = (tier_label,)
    ema = detector.stats.get("store_latency_ema")
    if ema is not None:
        stats.set_gauge(BACKPRESSURE_STORE_LATENCY_EMA, ema, labelvalues)
    stores, blocks = detector.policy.pop_stores_dropped()
    if stores > 0:
        stats.increase_counter(BACKPRESSURE_STORES_DROPPED, stores, labelvalues)
    if blocks > 0:
        stats.increase_counter(BACKPRESSURE_BLOCKS_DROPPED, blocks, labelvalues)
