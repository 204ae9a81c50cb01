"""Keys and plain contract types: layout of keys, picklability, declared metrics."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from shmtier import metrics
from shmtier.contract import (
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    TierFilter,
    TierMatcher,
    Locality,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from shmtier.scheduler.primary import CPUOffloadingManager
from shmtier.shared.chunk_table import ChunkTable


def test_key_is_hash_then_big_endian_group():
    key = make_offload_key(b"\xab" * 32, 258)
    assert key == b"\xab" * 32 + b"\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab" * 32
    assert get_offload_group_idx(key) == 258


def test_types_pickle_round_trip():
    ctx = ReqContext("r1", {"kv_load_tiers": []})
    ctx.set_offload_key_position(b"k" * 36, 64)
    values = [ctx, LookupResult.HIT_PENDING, CPULoadStoreSpec([3, 1]),
              GPULoadStoreSpec([5, 6, 7], [2, 1], [0, 4]),
              OffloadingEvent([b"k" * 36], Medium.CPU, removed=True), TierFilter.ALL]
    for value in values:
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
    assert pickle.loads(pickle.dumps(ctx)).get_offload_key_position(b"k" * 36) == 64
    spec = pickle.loads(pickle.dumps(GPULoadStoreSpec([5, 6, 7], [2, 1], [0, 4])))
    assert spec.block_ids.tolist() == [5, 6, 7] and spec.group_sizes == (2, 1)


def test_the_primary_s_specs_build_their_array_where_it_is_read():
    """The CPU tier hands out specs over its row lists; the int32 array is built on the
    first read of ``block_ids`` (by the GPU worker's copy), also after a pickle trip."""
    m = CPUOffloadingManager(ChunkTable.private(4, 40), "lru")
    ctx = ReqContext("r")
    out = m.prepare_store([b"a" * 36, b"b" * 36], ctx)
    spec = out.store_spec
    assert isinstance(spec, CPULoadStoreSpec) and spec._array is None  # not built yet
    sent = pickle.loads(pickle.dumps(spec))
    assert sent.block_ids.dtype == np.int32 and sent.block_ids.tolist() == [0, 1]
    assert spec.chunk_ids is spec.block_ids and spec.block_ids.tolist() == [0, 1]
    assert spec.ids == [0, 1] and CPULoadStoreSpec([4, 2]).ids == [4, 2]
    m.complete_store(out.keys_to_store, ctx)
    load = m.prepare_load([b"b" * 36], ctx)
    assert load.chunk_ids.dtype == np.int32 and load.chunk_ids.tolist() == [1]


def test_gpu_spec_checks_group_sizes():
    with pytest.raises(ValueError, match=r"sum to 3, but there are 2 block ids"):
        GPULoadStoreSpec([1, 2], [3], [0])
    with pytest.raises(ValueError, match="need one per group"):
        GPULoadStoreSpec([1, 2], [2], [0, 0])


def test_tier_filter_wildcards_on_both_sides():
    storage_local = TierFilter((TierMatcher(Medium.STORAGE, Locality.LOCAL),))
    assert storage_local.allows(Medium.STORAGE, None)
    assert not storage_local.allows(Medium.STORAGE, Locality.REMOTE)
    assert not TierFilter(()).allows(Medium.STORAGE, None)
    assert TierFilter.ALL.allows(Medium.CPU, Locality.REMOTE)


@pytest.mark.parametrize("threshold", [0, 2])
def test_every_emitted_metric_is_declared(threshold):
    m = CPUOffloadingManager(ChunkTable.private(4, 40), store_threshold=threshold)
    ctx = ReqContext("r")
    m.prepare_store([b"a" * 36], ctx)
    data = m.get_stats().data
    declared = metrics.cpu_metric_definitions(threshold)
    assert set(data["types"]) <= set(declared)
    for name, kind in data["types"].items():
        expected = {metrics.CounterMetadata: "counter", metrics.GaugeMetadata: "gauge",
                    metrics.HistogramMetadata: "histogram"}[type(declared[name])]
        assert kind == expected


def test_config_info_series():
    info = metrics.CPUTierInfo(cpu_num_chunks=8, cpu_blocks_per_chunk=4,
                               cpu_kv_cache_size_bytes=8 * 4096, cpu_kv_cache_size_tokens=None)
    m = CPUOffloadingManager(ChunkTable.private(8, 40), info=info)
    assert m.config_info() == [{"cpu_num_chunks": 8, "cpu_blocks_per_chunk": 4,
                                "cpu_kv_cache_size_bytes": 32768, "cpu_kv_cache_size_tokens": "None"}]
    assert metrics.CPUTierInfo.config_info_keys() == (
        "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "cpu_kv_cache_size_tokens")


def test_tier_filters_match_by_value_across_enum_classes():
    """A filter built with another library's enums of the same values (vLLM's) is
    evaluated the same way as shmtier's own."""
    import enum

    from shmtier.contract import tier_filter_allows

    class OtherMedium(enum.Enum):
        CPU = "CPU"
        STORAGE = "STORAGE"

    class OtherFilter:
        def __init__(self, matchers):
            self.matchers = matchers

    OtherFilter.ALL = OtherFilter(())
    storage = OtherFilter((TierMatcher(OtherMedium.STORAGE, None),))
    assert tier_filter_allows(storage, Medium.STORAGE, Locality.LOCAL)
    assert not tier_filter_allows(storage, Medium.CPU, None)
    assert tier_filter_allows(OtherFilter.ALL, Medium.CPU, None)
    assert not tier_filter_allows(OtherFilter(()), Medium.CPU, None)


def test_a_stats_payload_keeps_each_series_with_its_type():
    """Counters add per label set, gauges keep the last value, histograms gather samples
    (a list handed to ``observe_many`` is adopted); each name's type is recorded once."""
    s = metrics.OffloadingStats()
    s.set_gauge("g", 1.0, ("a",))
    s.set_gauge("g", 2.0, ("b",))
    s.set_gauge("g", 3.0, ("a",))
    s.increase_counter("c", 2, ("a",))
    s.increase_counter("c", 3, ("a",))
    s.increase_counter("c", 1.5)
    samples = [0.1]
    s.observe_many("h", samples, ("a",))
    s.observe_many("h", [0.2], ("a",))
    s.observe_histogram("h", 0.3, ("b",))
    s.observe_histogram("h1", 0.4)
    assert s.data == {
        "types": {"g": metrics.GAUGE, "c": metrics.COUNTER, "h": metrics.HISTOGRAM,
                  "h1": metrics.HISTOGRAM},
        "data": {"g": {("a",): 3.0, ("b",): 2.0}, "c": {("a",): 5, (): 1.5},
                 "h": {("a",): [0.1, 0.2], ("b",): [0.3]}, "h1": {(): [0.4]}},
        "info": None}
    assert s.data["data"]["h"][("a",)] is samples
    assert not s.is_empty() and metrics.OffloadingStats().is_empty()


def test_merge_stats_adds_counters_replaces_gauges_and_extends_histograms():
    into, other = metrics.OffloadingStats(), metrics.OffloadingStats()
    into.increase_counter("c", 2, ("t",))
    into.set_gauge("g", 1.0)
    into.observe_histogram("h", 0.5, ("t",))
    other.increase_counter("c", 3, ("t",))
    other.increase_counter("c", 1, ("u",))
    other.set_gauge("g", 7.0)
    other.observe_histogram("h", 0.25, ("t",))
    other.observe_histogram("new", 1.0)
    metrics.merge_stats(into, other)
    assert into.data["data"] == {"c": {("t",): 5, ("u",): 1}, "g": {(): 7.0},
                                 "h": {("t",): [0.5, 0.25]}, "new": {(): [1.0]}}
    assert into.data["types"]["new"] == metrics.HISTOGRAM
    into.observe_histogram("new", 2.0)  # a copied series is not shared with the source
    assert other.data["data"]["new"] == {(): [1.0]}
    metrics.merge_stats(into, metrics.OffloadingStats())  # empty: no change
    metrics.merge_stats(into, None)
    assert into.data["data"]["c"] == {("t",): 5, ("u",): 1}
