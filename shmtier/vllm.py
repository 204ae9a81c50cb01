"""vLLM adapter: shmtier as an out-of-tree offloading spec of vLLM's OffloadingConnector.

Use it from vLLM's ``--kv-transfer-config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "ShmTierOffloadingSpec",
                                   "spec_module_path": "shmtier.vllm",
                                   "cpu_bytes_to_use": 8589934592, ...}}

vLLM's ``OffloadingSpecFactory`` imports this module and constructs
:class:`ShmTierOffloadingSpec` from its ``OffloadingConfig`` in every process
role. Who calls what:

* API-server process: the classmethods ``build_metric_definitions`` and
  ``config_info_keys`` (no instance), to pre-create the Prometheus metrics.
* Scheduler process (EngineCore): ``get_manager()`` once; vLLM's connector
  scheduler half then drives :class:`ShmTierOffloadingManager` every step,
  holding ``manager.lock`` (shmtier's real, non-reentrant lock) for every call
  except ``shutdown``.
* GPU worker processes: ``get_worker(kv_caches)`` once at KV-cache
  registration; the connector worker half drives :class:`ShmTierOffloadingWorker`.

The adapter is thin: shmtier's core (``shmtier.spec.TieringOffloadingSpec``) is
vLLM-free and speaks its own plain types; at this boundary they become vLLM's
where vLLM looks at them. Conversions cost nothing per key: enums map through
dicts built once, chunk id arrays are wrapped (not copied) into vLLM's
``CPULoadStoreSpec``, key lists are handed over as they are, and the stats
payload dict (already in vLLM's shape) is wrapped, not rebuilt. vLLM's
``ReqContext`` objects go to the core as they are (the same object on every
call); the core evaluates their ``load_tier_filter`` by enum value.

Importing ``shmtier`` never imports vLLM; importing ``shmtier.vllm`` checks the
installed vLLM (:data:`SUPPORTED_VLLM`) and every interface used here, and
fails with one ``ImportError`` that names what is missing.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

#: vLLM versions this adapter is written and tested against.
SUPPORTED_VLLM = ">=0.33,<0.34"
_SUPPORTED_MIN = (0, 33)
_SUPPORTED_END = (0, 34)  # exclusive
#: Set to ``0`` to skip the version comparison (the interface check still runs),
#: e.g. for a source build of vLLM whose version reads ``dev``.
VERSION_CHECK_ENV = "SHMTIER_VLLM_VERSION_CHECK"


class VLLMCompatibilityError(ImportError):
    """The installed vLLM is missing, outside :data:`SUPPORTED_VLLM`, or lacks an
    interface the adapter uses."""


def vllm_version_supported(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``) lies in :data:`SUPPORTED_VLLM`.

    Only the leading ``major.minor`` counts, so ``0.33.2``, ``0.33.0rc1`` and
    ``0.33.1.dev4+gabc`` are supported; ``dev`` (no number) is not.
    """
    match = re.match(r"v?(\d+)\.(\d+)", str(version))
    if match is None:
        return False
    return _SUPPORTED_MIN <= (int(match.group(1)), int(match.group(2))) < _SUPPORTED_END


# (module, attribute, members the adapter relies on). Members are enum members,
# dataclass fields, methods or attributes. Everything the adapter, the copy
# worker (duck typing of CanonicalKVCaches / GPULoadStoreSpec) and the tiers
# (vLLM-written tiers loaded through module_path) touch on vLLM's side.
_BASE = "vllm.v1.kv_offload.base"
_CONFIG = "vllm.v1.kv_offload.config"
REQUIRED_INTERFACES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (_BASE, "OffloadingSpec", ("build_metric_definitions", "config_info_keys", "get_manager",
                               "get_worker", "__init__")),
    (_BASE, "OffloadingManager", (
        "lock", "lookup", "get_load_source", "prepare_load", "touch", "complete_load",
        "prepare_store", "complete_store", "on_new_request", "on_request_finished",
        "take_events", "on_schedule_end", "has_pending_work", "reset_cache",
        "on_reset_flushed", "get_stats", "config_info", "shutdown")),
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
                                "removal_expected", "metadata_only")),
    (_BASE, "TransferResult", ("job_id", "success", "transfer_size", "transfer_time")),
    (_BASE, "GPULoadStoreSpec", ("__init__",)),
    (_BASE, "CanonicalKVCaches", ("tensors", "group_data_refs")),
    (_BASE, "CanonicalKVCacheTensor", ("tensor", "page_size_bytes")),
    (_BASE, "CanonicalKVCacheRef", ("tensor_idx", "page_size_bytes", "mapping")),
    (_BASE, "OffloadingMetricMetadata", ("documentation", "labelnames")),
    (_BASE, "OffloadingCounterMetadata", ()),
    (_BASE, "OffloadingGaugeMetadata", ("multiprocess_mode",)),
    (_BASE, "OffloadingHistogramMetadata", ("buckets",)),
    (_CONFIG, "OffloadingConfig", ("groups", "worker_kv_bytes_per_block",
                                   "enable_kv_cache_events", "extra_config", "engine_id",
                                   "model", "cache", "parallel", "replicated_layout",
                                   "canonical_layout")),
    (_CONFIG, "OffloadingGroupConfig", ("tokens_per_block",)),
    (_CONFIG, "OffloadingModelConfig", ("name", "dtype", "max_model_len")),
    (_CONFIG, "OffloadingCacheConfig", ("tokens_per_hash", "blocks_per_chunk")),
    (_CONFIG, "OffloadingParallelConfig", ("rank", "world_size", "data_parallel_index")),
    ("vllm.v1.kv_offload.cpu.common", "CPULoadStoreSpec", ("chunk_ids",)),
    ("vllm.v1.kv_offload.factory", "OffloadingSpecFactory", ("get_spec_cls", "create_spec")),
    ("vllm.v1.metrics.cache_hit_source", "CacheHitSource", (
        "DEVICE", "HOST", "P2P", "DISK", "EXTERNAL_UNSPECIFIED")),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
     "OffloadingConnectorStats", ("data", "is_empty", "aggregate")),
)


def _member_names(obj: Any) -> set[str]:
    names = set(dir(obj))
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        names |= set(obj.__members__)
    if dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    names |= set(getattr(obj, "_fields", ()))  # NamedTuple
    return names


def missing_vllm_interfaces(
        import_module: Callable[[str], Any] = importlib.import_module) -> list[str]:
    """Every module, class or member of :data:`REQUIRED_INTERFACES` the installed
    vLLM lacks, as dotted names (empty: all present)."""
    missing: list[str] = []
    modules: dict[str, Any] = {}
    for module_name, name, members in REQUIRED_INTERFACES:
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


def check_vllm(vllm_module: Any = None,
               import_module: Callable[[str], Any] = importlib.import_module) -> None:
    """Raise :class:`VLLMCompatibilityError` unless the installed vLLM fits.

    Checks ``vllm.__version__`` against :data:`SUPPORTED_VLLM` (skipped when the
    environment sets ``SHMTIER_VLLM_VERSION_CHECK=0``) and the presence of every
    interface in :data:`REQUIRED_INTERFACES`; the message names each problem.
    """
    if vllm_module is None:
        try:
            vllm_module = import_module("vllm")
        except ImportError as e:
            raise VLLMCompatibilityError(
                f"shmtier.vllm (the vLLM integration) needs vLLM {SUPPORTED_VLLM}, which "
                f"cannot be imported ({type(e).__name__}: {e}). Install it, e.g. "
                f"pip install 'vllm{SUPPORTED_VLLM}' (or shmtier[vllm]); shmtier itself "
                f"works without vLLM."
            ) from e
    problems = []
    version = getattr(vllm_module, "__version__", "unknown")
    if os.environ.get(VERSION_CHECK_ENV, "1") != "0" and not vllm_version_supported(version):
        problems.append(
            f"vLLM {version} is installed, shmtier supports vLLM {SUPPORTED_VLLM} "
            f"(set {VERSION_CHECK_ENV}=0 to try it anyway; interfaces are still checked)")
    missing = missing_vllm_interfaces(import_module)
    if missing:
        problems.append(f"vLLM {version} lacks interfaces the adapter uses: "
                        + ", ".join(missing))
    if problems:
        raise VLLMCompatibilityError("shmtier.vllm cannot load: " + "; ".join(problems))


check_vllm()

# --- only past the check: vLLM's classes -------------------------------------------------

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as _vb  # noqa: E402
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as _VllmCPULoadStoreSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource as _VllmCacheHitSource  # noqa: E402

from shmtier import contract as _c  # noqa: E402
from shmtier import metrics as _m  # noqa: E402
from shmtier.config import ConfigError, KVLayout  # noqa: E402
from shmtier.spec import TieringOffloadingSpec as CoreSpec  # noqa: E402

__all__ = [
    "SUPPORTED_VLLM",
    "ShmTierOffloadingSpec",
    "ShmTierOffloadingManager",
    "ShmTierOffloadingWorker",
    "VLLMCompatibilityError",
    "check_vllm",
    "missing_vllm_interfaces",
    "vllm_version_supported",
    "kv_layout_from_offloading_config",
    "core_extra_config",
    "to_vllm_metric_metadata",
]


def _enum_map(source: type[enum.Enum], target: type[enum.Enum]) -> dict[Any, Any]:
    """``source`` and ``target`` members (both) -> the ``target`` member of that name."""
    out: dict[Any, Any] = {m: target[m.name] for m in source}
    out.update({m: m for m in target})
    return out


# Built once; every conversion below is one dict lookup.
_LOOKUP = _enum_map(_c.LookupResult, _vb.LookupResult)
_POLICY = _enum_map(_c.OffloadPolicy, _vb.OffloadPolicy)
_MEDIUM = _enum_map(_c.Medium, _vb.Medium)
_LOCALITY = {None: None, **_enum_map(_c.Locality, _vb.Locality)}
_HIT_SOURCE = _enum_map(_c.CacheHitSource, _VllmCacheHitSource)

_VllmEvent = _vb.OffloadingEvent
_VllmPrepareStoreOutput = _vb.PrepareStoreOutput
_VllmROC = _vb.RequestOffloadingContext
_VllmTransferResult = _vb.TransferResult


class _CPULoadStoreSpecView(_VllmCPULoadStoreSpec):
    """vLLM's ``CPULoadStoreSpec`` over one of shmtier's: ``block_ids`` is shmtier's (the
    same array, built on first read -- by the GPU worker's copy, not the scheduler)."""

    def __init__(self, spec: Any):  # vLLM's __init__ would build the array now
        self._spec = spec

    @property
    def block_ids(self) -> Any:
        return self._spec.block_ids


def _wrap_cpu_spec(spec: Any) -> _VllmCPULoadStoreSpec:
    """vLLM's ``CPULoadStoreSpec`` for a spec of shmtier's primary (a vLLM one as it is)."""
    if isinstance(spec, _VllmCPULoadStoreSpec):
        return spec
    return _CPULoadStoreSpecView(spec)


def _to_vllm_event(event: Any) -> Any:
    if event.__class__ is _VllmEvent:
        return event  # a vLLM-written tier's own event
    return _VllmEvent(keys=event.keys, medium=_MEDIUM[event.medium], removed=event.removed,
                      locality=_LOCALITY[event.locality], ownership=event.ownership,
                      removal_expected=event.removal_expected,
                      metadata_only=event.metadata_only)


def to_vllm_metric_metadata(metadata: Any) -> _vb.OffloadingMetricMetadata:
    """vLLM's metric metadata class for shmtier's (vLLM's own pass through)."""
    if isinstance(metadata, _vb.OffloadingMetricMetadata):
        return metadata
    labels = tuple(metadata.labelnames)
    if isinstance(metadata, _m.GaugeMetadata):
        return _vb.OffloadingGaugeMetadata(metadata.documentation, labels,
                                           multiprocess_mode=metadata.multiprocess_mode)
    if isinstance(metadata, _m.HistogramMetadata):
        buckets = tuple(metadata.buckets) if metadata.buckets is not None else None
        return _vb.OffloadingHistogramMetadata(metadata.documentation, labels, buckets=buckets)
    if isinstance(metadata, _m.CounterMetadata):
        return _vb.OffloadingCounterMetadata(metadata.documentation, labels)
    raise TypeError(f"unknown metric metadata {metadata!r}: expected a counter, gauge or "
                    f"histogram declaration")


# ----------------------------------------------------------------------------- config


def core_extra_config(config: OffloadingConfig) -> dict[str, Any]:
    """``kv_connector_extra_config`` for shmtier's core, with the chunk size vLLM
    already resolved: ``block_size`` (tokens per chunk) is replaced by the
    ``blocks_per_chunk`` vLLM derived from it, so both sides agree by construction."""
    extra = dict(config.extra_config)
    extra.pop("block_size", None)
    extra["blocks_per_chunk"] = int(config.cache.blocks_per_chunk)
    return extra


def kv_layout_from_offloading_config(config: OffloadingConfig) -> KVLayout:
    """shmtier's KV layout for vLLM's normalized config.

    ``gpu_block_size`` is the first offloaded group's ``tokens_per_block``.
    With ``replicated_layout`` (one copy of the KV for all TP ranks) the arena
    row has one slot, so the layout's ``world_size`` is 1: every rank maps that
    slot and only rank 0 writes (vLLM's connector decides who writes).
    """
    if not config.groups:
        raise ConfigError("vLLM's OffloadingConfig has no offloaded KV-cache group")
    replicated = bool(config.replicated_layout)
    return KVLayout(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        gpu_block_size=int(config.groups[0].tokens_per_block),
        worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        world_size=1 if replicated else int(config.parallel.world_size),
        replicated_layout=replicated,
    )


# ----------------------------------------------------------------------------- manager


class ShmTierOffloadingManager(_vb.OffloadingManager):
    """vLLM's ``OffloadingManager`` over shmtier's tiering manager (scheduler process).

    Every method is called by vLLM's connector scheduler half with ``lock``
    held (except ``shutdown``) and forwards to the core; results become vLLM's
    types. ``core`` is shmtier's ``TieringOffloadingManager``.
    """

    def __init__(self, core: Any):
        self.core = core
        self._lookup = core.lookup
        self._lock = core.lock

    @property
    def lock(self):
        return self._lock

    # --- hot path: one core call plus one dict lookup ---

    def lookup(self, key, req_context):
        return _LOOKUP[self._lookup(key, req_context)]

    def get_load_source(self, key, req_context):
        return _HIT_SOURCE[self.core.get_load_source(key, req_context)]

    def prepare_load(self, keys: Collection[bytes], req_context):
        return _wrap_cpu_spec(self.core.prepare_load(keys, req_context))

    def touch(self, keys, req_context) -> None:
        self.core.touch(keys, req_context)

    def complete_load(self, keys, req_context) -> None:
        self.core.complete_load(keys, req_context)

    def prepare_store(self, keys, req_context):
        out = self.core.prepare_store(keys, req_context)
        if out is None:
            return None
        return _VllmPrepareStoreOutput(out.keys_to_store, _wrap_cpu_spec(out.store_spec),
                                       out.evicted_keys)

    def complete_store(self, keys, req_context, success: bool = True) -> None:
        self.core.complete_store(keys, req_context, success)

    # --- request lifecycle ---

    def on_new_request(self, req_context):
        out = self.core.on_new_request(req_context)
        return _VllmROC(_POLICY[out.policy])

    def on_request_finished(self, req_context) -> None:
        self.core.on_request_finished(req_context)

    # --- per step ---

    def on_schedule_end(self, context) -> None:
        self.core.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work()

    def take_events(self) -> Iterable[Any]:
        return [_to_vllm_event(event) for event in self.core.take_events()]

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self.core.get_stats()
        if stats is None or stats.is_empty():
            return None
        return OffloadingConnectorStats(data=stats.data)

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return self.core.config_info()

    # --- reset and shutdown ---

    def reset_cache(self) -> None:
        self.core.reset_cache()

    def on_reset_flushed(self) -> None:
        self.core.on_reset_flushed()

    def shutdown(self) -> None:
        self.core.shutdown()


# ----------------------------------------------------------------------------- worker


class ShmTierOffloadingWorker(_vb.OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over shmtier's block copy worker (GPU worker process).

    vLLM's ``GPULoadStoreSpec`` and the ``CPULoadStoreSpec`` the manager handed
    out go to the copy worker as they are (it reads ``block_ids``,
    ``group_sizes`` and ``block_indices``); results become vLLM's
    ``TransferResult``. ``core`` is shmtier's ``BlockCopyWorker``.
    """

    def __init__(self, core: Any):
        self.core = core

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        return self.core.submit_store(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec, dst_spec, expedited: bool = False) -> bool:
        return self.core.submit_load(job_id, src_spec, dst_spec, expedited)

    def get_finished(self) -> list:
        return [_VllmTransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
                for r in self.core.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


# ----------------------------------------------------------------------------- spec


class ShmTierOffloadingSpec(_vb.OffloadingSpec):
    """shmtier's tiering spec for vLLM's ``OffloadingSpecFactory``.

    Constructed in every process role from vLLM's ``OffloadingConfig``; builds
    shmtier's core spec (validating the whole config: a ``ConfigError`` names
    the key, the value and what is accepted). ``core`` is that core spec.
    """

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if config.canonical_layout:
            raise ConfigError(
                "kv_connector_extra_config['canonical_layout'] = true is not supported by "
                "ShmTierOffloadingSpec: shmtier stores the direct per-rank layout only; "
                "remove canonical_layout")
        self.replicated_layout = bool(config.replicated_layout)
        self.core = CoreSpec(core_extra_config(config), kv_layout_from_offloading_config(config),
                             config.engine_id, enable_events=config.enable_kv_cache_events,
                             max_model_len=config.model.max_model_len or None,
                             data_parallel_index=int(config.parallel.data_parallel_index or 0))
        # A tier written for vLLM (loaded through module_path) receives the core
        # spec as its `offloading_spec`; give it the attributes vLLM's spec has.
        for name, value in (("config", config), ("kv_events_config", self.kv_events_config),
                            ("offload_prompt_only", self.offload_prompt_only),
                            ("tokens_per_block", self.tokens_per_block),
                            ("tokens_per_hash", self.tokens_per_hash),
                            ("replicated_layout", self.replicated_layout)):
            if not hasattr(self.core, name):
                setattr(self.core, name, value)
        self.geometry = self.core.geometry
        self._manager: ShmTierOffloadingManager | None = None
        self._worker: ShmTierOffloadingWorker | None = None

    # --- front end (no instance) ---

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's metric metadata for every series shmtier's managers and tiers emit."""
        return {name: to_vllm_metric_metadata(md)
                for name, md in CoreSpec.build_metric_definitions(extra_config).items()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CoreSpec.config_info_keys(extra_config)

    # --- scheduler process ---

    def get_manager(self) -> ShmTierOffloadingManager:
        if self._manager is None:
            self._manager = ShmTierOffloadingManager(self.core.get_manager())
        return self._manager

    # --- GPU worker processes ---

    def get_worker(self, kv_caches: Any) -> ShmTierOffloadingWorker:
        if self._worker is None:
            self._worker = ShmTierOffloadingWorker(
                self.core.get_worker(kv_caches, int(self.config.parallel.rank)))
        return self._worker
