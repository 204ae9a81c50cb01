"""The scheduler's statistics, published into its segment for ``shmtier top``.

Who calls: the tiering manager, in the scheduler process, under its lock: built once
(``for_manager``), then ``observe(stats)`` with every stats payload its ``get_stats``
returns (vLLM's scheduler asks for one every step). Never blocks: ``observe`` adds the
payload's counters to running totals (a few dict look-ups), and at most every
``interval_s`` writes them into the segment's stats area (``shmtier/shared/stats_area.py``,
a seqlock: one writer, readers never stop it).

One source of truth: the values are the Prometheus series the payload carries
(``shmtier/metrics.py``: chunk queries and hits, read and write bytes, job failures,
backpressure drops; a storage tier's bytes gauge and evictions counter), summed since
the publisher started, never a count of their own. Per tier (label ``"0:primary"``,
``"1:fs"``, ... as the metrics'): ``chunks`` is the tier's ``chunks_on_disk`` (counted as
its bytes gauge), and ``promotions`` / ``cascades`` are the read / write bytes over the
CPU tier's row bytes (the manager counts those bytes per chunk). A field a tier has no
series for is published as not counted (-1). The CPU tier's chunks and bytes are the
chunk table's (``shmtier top`` reads the table itself).

Publishing happens at a ``get_stats`` call at least ``interval_s`` after the last one, or,
while the manager's step-window thread runs rounds between steps, at such a round (a
publish costs ~70 µs cold: out of the step): an engine that stops stepping keeps its last
publish (``top`` shows its age).
``SHMTIER_STATS_INTERVAL_S`` sets the interval (default 0.1 s; 0 turns publishing off).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from shmtier import metrics
from shmtier.options import ConfigError
from shmtier.shared.stats_area import FIELDS, MAX_RECORDS, NOT_COUNTED, StatsWriter

ENV_INTERVAL = "SHMTIER_STATS_INTERVAL_S"
DEFAULT_INTERVAL_S = 0.1
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.01, 60.0

_F = {name: i for i, name in enumerate(FIELDS)}
#: counter series -> field (labelled by tier; summed since start)
_COUNTERS = {
    metrics.CHUNK_QUERIES: _F["lookups"],
    metrics.CHUNK_HITS: _F["hits"],
    metrics.READ_BYTES: _F["promoted_bytes"],
    metrics.WRITE_BYTES: _F["cascaded_bytes"],
    metrics.PROMOTION_JOB_FAILURES: _F["promotion_failures"],
    metrics.CASCADE_JOB_FAILURES: _F["cascade_failures"],
    metrics.BACKPRESSURE_STORES_DROPPED: _F["bp_dropped_jobs"],
    metrics.BACKPRESSURE_BLOCKS_DROPPED: _F["bp_dropped_chunks"],
}
_SECONDARY_ONLY = ("promotions", "promoted_bytes", "cascades", "cascaded_bytes",
                   "promotion_failures", "cascade_failures")


def interval_from_env(environ=os.environ) -> float:
    """``SHMTIER_STATS_INTERVAL_S`` as seconds (0: off); ConfigError naming it, its value
    and what is accepted when it is not a number in range."""
    raw = environ.get(ENV_INTERVAL)
    if raw is None or raw.strip() == "":
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not (value == 0 or MIN_INTERVAL_S <= value <= MAX_INTERVAL_S):
        raise ConfigError(f"environment variable {ENV_INTERVAL} = {raw!r} is invalid: expected "
                          f"0 (no statistics for shmtier top) or seconds between "
                          f"{MIN_INTERVAL_S} and {MAX_INTERVAL_S}")
    return value


class StatsPublisher:
    """Running totals of the manager's stats payloads, published into ``segment``."""

    def __init__(self, segment: Any, labels: Sequence[str], tiers: Sequence[Any],
                 row_bytes: int, interval_s: float):
        self._segment = segment
        self._interval_ns = int(interval_s * 1e9)
        n = min(len(labels), MAX_RECORDS)
        self._writer = StatsWriter(segment.stats, list(labels), interval_s=interval_s,
                                   row_bytes=row_bytes)
        self._index = {(label,): i for i, label in enumerate(labels[:n])}
        self._row_bytes = row_bytes
        self._totals = [[0] * len(FIELDS) for _ in range(n)]
        # series name -> (field, is a gauge): what ``observe`` folds (a name two tiers
        # share, e.g. two fs tiers' evictions, once: its series carry both labels)
        self._fields: dict[str, tuple[int, bool]] = {
            name: (f, False) for name, f in _COUNTERS.items()}
        self._chunks: list[tuple[int, Any]] = []  # (record, tier with chunks_on_disk)
        counted = [set(_COUNTERS.values()) | {_F["misses"]} for _ in range(n)]
        counted[0] -= {_F[f] for f in _SECONDARY_ONLY}
        counted[0] -= {_F["bp_dropped_jobs"], _F["bp_dropped_chunks"]}
        for i, tier in enumerate(tiers[:n - 1], start=1):
            evicted = getattr(tier, "EVICTED_METRIC", None)
            if isinstance(evicted, str):
                self._fields[evicted] = (_F["evictions"], False)
                counted[i].add(_F["evictions"])
            stored = getattr(tier, "BYTES_METRIC", None)
            if isinstance(stored, str):
                self._fields[stored] = (_F["bytes"], True)
                counted[i].add(_F["bytes"])
            if hasattr(tier, "chunks_on_disk"):
                self._chunks.append((i, tier))
                counted[i].add(_F["chunks"])
            if getattr(tier, "bp_detector", None) is None:
                counted[i] -= {_F["bp_dropped_jobs"], _F["bp_dropped_chunks"]}
        self._field_list = [(name, f, gauge) for name, (f, gauge) in self._fields.items()]
        if row_bytes:
            for i in range(1, n):
                counted[i] |= {_F["promotions"], _F["cascades"]}
        self._not_counted = [[f for f in range(1, len(FIELDS)) if f not in c] for c in counted]
        self.publish()  # zeros: `top` tells a publishing engine from one that never did
        self._due = time.monotonic_ns() + self._interval_ns

    @classmethod
    def for_manager(cls, primary: Any, tiers: Sequence[Any], labels: Sequence[str],
                    row_bytes: int) -> "StatsPublisher | None":
        """The publisher of a tiering manager whose ``primary`` owns a segment; None
        without one (a private table) or with publishing off (``SHMTIER_STATS_INTERVAL_S``
        = 0). ConfigError for a bad ``SHMTIER_STATS_INTERVAL_S``."""
        interval_s = interval_from_env()
        segment = getattr(primary, "segment", None)
        if not interval_s or segment is None or not getattr(segment, "is_owner", False):
            return None
        return cls(segment, labels, tiers, row_bytes, interval_s)

    def observe(self, stats: metrics.OffloadingStats, publish: bool = True) -> None:
        """Add one ``get_stats`` payload (counters are deltas) to the totals; publish when
        ``interval_s`` has passed since the last publish, unless ``publish`` is False
        (the manager's step-window thread then does, between steps: ``publish_if_due``)."""
        index, totals, data = self._index, self._totals, stats.data["data"]
        # the publisher's few series looked up in the payload, not every series of the
        # payload looked up here: a tier's payload carries many the publisher ignores
        for name, f, gauge in self._field_list:
            series = data.get(name)
            if series is None:
                continue
            for labels, value in series.items():
                i = index.get(labels)
                if i is None:
                    continue
                if gauge:
                    totals[i][f] = value
                else:
                    totals[i][f] += value
        if publish:
            self.publish_if_due()

    def publish_if_due(self) -> None:
        """Publish if ``interval_s`` has passed since the last publish."""
        now = time.monotonic_ns()
        if now >= self._due:
            self._due = now + self._interval_ns
            self.publish()

    def publish(self) -> None:
        """Write the totals now (the manager's lock held; not after the segment closed)."""
        if self._segment.closed:
            return
        for i, tier in self._chunks:
            self._totals[i][_F["chunks"]] = tier.chunks_on_disk
        records = []
        rb = self._row_bytes
        for rec, off in zip(self._totals, self._not_counted):
            out = [int(v) for v in rec]
            out[_F["misses"]] = out[_F["lookups"]] - out[_F["hits"]]
            if rb:
                out[_F["promotions"]] = out[_F["promoted_bytes"]] // rb
                out[_F["cascades"]] = out[_F["cascaded_bytes"]] // rb
            for f in off:
                out[f] = NOT_COUNTED
            records.append(out)
        self._writer.publish(records)

    @property
    def publishes(self) -> int:
        return self._writer.publishes
