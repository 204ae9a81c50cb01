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
