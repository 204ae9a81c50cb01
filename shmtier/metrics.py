"""Metric declarations and the per-step stats payload.

The payload (:class:`OffloadingStats`) has the same self-describing dict shape
as vLLM 0.33's ``OffloadingConnectorStats`` (``{"types", "data", "info"}``), so
the vLLM adapter can hand its ``data`` over unchanged. Managers return a fresh
payload from ``get_stats()`` each step: counters and histograms are deltas since
the previous call, gauges are re-sent every time.

Metric metadata classes describe what a spec declares to the Prometheus front
end (``build_metric_definitions``); every name a payload carries must be
declared there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

ConfigInfoMapping = Mapping[str, Any]

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class MetricMetadata:
    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class CounterMetadata(MetricMetadata):
    pass


@dataclass(frozen=True)
class GaugeMetadata(MetricMetadata):
    multiprocess_mode: str = "mostrecent"


@dataclass(frozen=True)
class HistogramMetadata(MetricMetadata):
    buckets: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ConfigInfo:
    """Static facts exported as one info series; field names are label names."""

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_config_info(self) -> dict[str, Any]:
        return {
            f.name: ("None" if getattr(self, f.name) is None else getattr(self, f.name))
            for f in fields(self)
        }


class OffloadingStats:
    """Per-step metric deltas: ``data = {"types": {name: type}, "data": {name:
    {labelvalues: value}}, "info": [mapping, ...] | None}``."""

    def __init__(self, data: dict[str, Any] | None = None):
        self.data: dict[str, Any] = data if data is not None else {
            "types": {},
            "data": {},
            "info": None,
        }

    def increase_counter(self, name: str, value: float = 1, labelvalues: tuple = ()) -> None:
        self.data["types"].setdefault(name, COUNTER)
        values = self.data["data"].setdefault(name, {})
        values[labelvalues] = values.get(labelvalues, 0) + value

    def set_gauge(self, name: str, value: float, labelvalues: tuple = ()) -> None:
        self.data["types"].setdefault(name, GAUGE)
        self.data["data"].setdefault(name, {})[labelvalues] = value

    def observe_histogram(self, name: str, value: float, labelvalues: tuple = ()) -> None:
        self.data["types"].setdefault(name, HISTOGRAM)
        self.data["data"].setdefault(name, {}).setdefault(labelvalues, []).append(value)

    def observe_many(self, name: str, values: list, labelvalues: tuple = ()) -> None:
        """Add the samples ``values`` to a histogram series; the list is adopted (the
        caller hands it over and keeps no reference)."""
        self.data["types"].setdefault(name, HISTOGRAM)
        series = self.data["data"].setdefault(name, {})
        have = series.get(labelvalues)
        if have is None:
            series[labelvalues] = values
        else:
            have.extend(values)

    def set_info(self, info: Sequence[ConfigInfoMapping]) -> None:
        self.data["info"] = [dict(series) for series in info]

    def is_empty(self) -> bool:
        return not self.data["data"] and self.data["info"] is None


# --- CPU primary tier (names exactly as vLLM's CPU and tiering specs emit them) ---

CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"

CPU_ALLOCATION_SIZE_BUCKETS = tuple(float(4**i) for i in range(10))  # 1 .. 262144


def cpu_metric_definitions(store_threshold: int = 0) -> dict[str, MetricMetadata]:
    """What the CPU primary tier may put in a stats payload."""
    definitions: dict[str, MetricMetadata] = {
        CPU_CACHE_USAGE_PERC: GaugeMetadata(
            "Fraction of CPU chunk slots pinned by reads or pending writes."
        ),
        CPU_CACHE_WRITE_USAGE_PERC: GaugeMetadata(
            "Fraction of CPU chunk slots with a pending write."
        ),
        CPU_CACHE_READ_USAGE_PERC: GaugeMetadata(
            "Fraction of CPU chunk slots pinned by reads (usage minus write usage)."
        ),
        CPU_ALLOCATION_SIZE: HistogramMetadata(
            "Chunks requested per prepare_store call.",
            buckets=CPU_ALLOCATION_SIZE_BUCKETS,
        ),
    }
    if store_threshold >= 2:
        definitions[STORES_SKIPPED] = CounterMetadata(
            "Store candidates skipped because they were offered fewer than "
            "store_threshold times."
        )
    return definitions


@dataclass(frozen=True)
class CPUTierInfo(ConfigInfo):
    """Static facts about the CPU primary tier (the ``config_info`` series)."""

    cpu_num_chunks: int
    cpu_blocks_per_chunk: int
    cpu_kv_cache_size_bytes: int
    cpu_kv_cache_size_tokens: int | None


# --- tiering (docs/vllm-contract.md §11.3; label "tier" = "0:primary" or "{i+1}:{type}") ---

TIER = "tier"
LOOKUP_SYNC_DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"
LOOKUP_ASYNC_DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"
CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
READ_TIME = "vllm:kv_offload_tiering_read_time"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
WRITE_TIME = "vllm:kv_offload_tiering_write_time"
PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
PRIMARY_WRITE_USAGE_PERC = "vllm:kv_offload_tiering_primary_write_usage_perc"
PRIMARY_READ_USAGE_PERC = "vllm:kv_offload_tiering_primary_read_usage_perc"
ACTIVE_PROMOTION_JOBS = "vllm:kv_offload_tiering_active_promotion_jobs"
ACTIVE_CASCADE_JOBS = "vllm:kv_offload_tiering_active_cascade_jobs"
PROMOTION_LATENCY = "vllm:kv_offload_tiering_promotion_latency_seconds"
BACKPRESSURE_STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
BACKPRESSURE_STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
BACKPRESSURE_BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
# shmtier's own (vLLM has no pinned-row cap): cascade chunks that waited, unpinned, because
# the tier's queued cascades pinned ``max_pinned_rows`` rows, and those of them the CPU tier
# evicted before they could go (lost, as a drop would have lost them)
CASCADE_DEFERRED_CHUNKS = "vllm:kv_offload_shmtier_cascade_deferred_chunks"
CASCADE_DEFERRED_LOST_CHUNKS = "vllm:kv_offload_shmtier_cascade_deferred_lost_chunks"
# vLLM 0.34's deferred release of failed promotions (scheduler/tiering/deferred_release.py)
DEFERRED_RELEASE_CHUNKS = "vllm:kv_offload_tiering_deferred_release_chunks"
DEFERRED_RELEASE_HOLD = "vllm:kv_offload_tiering_deferred_release_hold_seconds"

LOOKUP_SYNC_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)
LOOKUP_ASYNC_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, 10.0)
PROMOTION_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFERRED_RELEASE_HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


def tiering_metric_definitions() -> dict[str, MetricMetadata]:
    """Every series the tiering manager emits, with its meaning."""
    t = (TIER,)
    return {
        LOOKUP_SYNC_DELAY: HistogramMetadata(
            "Blocking time of a per-chunk tier lookup that resolved to HIT or MISS.", t,
            LOOKUP_SYNC_BUCKETS),
        LOOKUP_ASYNC_DELAY: HistogramMetadata(
            "Time from a chunk's first RETRY to its HIT/MISS resolution, per request.", t,
            LOOKUP_ASYNC_BUCKETS),
        CHUNK_QUERIES: CounterMetadata("Resolved chunk lookups per tier (once per request and key).", t),
        CHUNK_HITS: CounterMetadata("HITs among the resolved chunk lookups per tier.", t),
        READ_BYTES: CounterMetadata("Bytes promoted from the tier into the primary tier.", t),
        READ_TIME: CounterMetadata("Seconds the tier reported for promotions.", t),
        WRITE_BYTES: CounterMetadata("Bytes cascaded from the primary tier into the tier.", t),
        WRITE_TIME: CounterMetadata("Seconds the tier reported for cascades.", t),
        PROMOTION_JOB_FAILURES: CounterMetadata("Promotion jobs that failed (partly or wholly).", t),
        CASCADE_JOB_FAILURES: CounterMetadata("Cascade jobs that failed.", t),
        PROMOTION_ALLOCATION_FAILURES: CounterMetadata(
            "Promotions not started because the primary tier had no free row."),
        PRIMARY_WRITE_USAGE_PERC: GaugeMetadata(
            "Fraction of primary rows reserved by in-flight promotions from the tier.", t),
        PRIMARY_READ_USAGE_PERC: GaugeMetadata(
            "Fraction of primary rows pinned by in-flight cascades to the tier.", t),
        ACTIVE_PROMOTION_JOBS: GaugeMetadata("In-flight promotion jobs.", t),
        ACTIVE_CASCADE_JOBS: GaugeMetadata("In-flight cascade jobs.", t),
        PROMOTION_LATENCY: HistogramMetadata(
            "Promotion job creation to observed completion (includes queueing).", (TIER, "result"),
            PROMOTION_LATENCY_BUCKETS),
        BACKPRESSURE_STORE_LATENCY_EMA: GaugeMetadata("Backpressure EMA of store latency (s/MiB).", t),
        BACKPRESSURE_STORES_DROPPED: CounterMetadata("Cascade jobs dropped by backpressure.", t),
        BACKPRESSURE_BLOCKS_DROPPED: CounterMetadata("Chunks of cascade jobs dropped by backpressure.", t),
    }


def cascade_deferral_metric_definitions() -> dict[str, MetricMetadata]:
    """The deferral series the tiering manager emits for a tier with ``max_pinned_rows``;
    declared by those tiers (vLLM's spec declares none of them, and shmtier's spec-level
    series stay exactly vLLM's)."""
    t = (TIER,)
    return {
        CASCADE_DEFERRED_CHUNKS: CounterMetadata(
            "Cascade chunks deferred (not pinned) because the tier's queued cascades pinned "
            "its max_pinned_rows primary rows.", t),
        CASCADE_DEFERRED_LOST_CHUNKS: CounterMetadata(
            "Deferred cascade chunks the primary tier evicted before they could be cascaded.", t),
    }


def deferred_release_metric_definitions() -> dict[str, MetricMetadata]:
    """The deferred-release series (vLLM 0.34's names, types, labels and buckets) the
    tiering manager emits for a tier whose failed promotions may hold primary rows.
    Declared by the tiers that can defer (``SecondaryTierManager.defers_release``), so
    the spec-level series stay those of the vLLM in use; a spec for vLLM >= 0.34 declares
    them for every tier, as vLLM's does."""
    t = (TIER,)
    return {
        DEFERRED_RELEASE_CHUNKS: GaugeMetadata(
            "Primary rows of failed promotions held out of the free pool until the tier "
            "confirms its I/O can no longer write them.", t),
        DEFERRED_RELEASE_HOLD: HistogramMetadata(
            "Seconds a failed promotion's primary rows were held before their deferred "
            "release, observed at release.", t, DEFERRED_RELEASE_HOLD_BUCKETS),
    }


def merge_stats(into: OffloadingStats, other: Any) -> None:
    """Add ``other``'s payload (an OffloadingStats or vLLM's stats object) into ``into``."""
    data = getattr(other, "data", None)
    if not data or not data.get("data"):
        return
    types, into_types, into_data = data["types"], into.data["types"], into.data["data"]
    for name, series in data["data"].items():
        kind = types[name]
        kind = COUNTER if kind == COUNTER else GAUGE if kind == GAUGE else HISTOGRAM
        into_types.setdefault(name, kind)
        target = into_data.get(name)
        if target is None:  # a series ``into`` lacks: copied whole (once per step)
            into_data[name] = {labels: list(value) if kind == HISTOGRAM else value
                               for labels, value in series.items()}
            continue
        for labels, value in series.items():
            if kind == COUNTER:
                target[labels] = target.get(labels, 0) + value
            elif kind == GAUGE:
                target[labels] = value
            else:
                target.setdefault(labels, []).extend(value)
