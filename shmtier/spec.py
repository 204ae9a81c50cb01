"""TieringOffloadingSpec (vLLM-free core): config in, manager and copy worker out.

Who calls: every process role of one engine builds a spec from the same
``kv_connector_extra_config`` and KV layout. The scheduler process calls
``get_manager()`` (it owns the segment: creates or claims it, and unlinks it
at shutdown); each GPU worker process calls ``get_worker(kv_caches, rank)``
(it joins the segment as a member). The vLLM adapter wraps this class.

Construction order of ``get_manager`` (reverse order on failure, so nothing
is left half-built): segment (with its guardian unless ``warm_restart``: it
removes the segment if this process dies unclosed) -> primary tier -> tier worker
pool (only when a built-in worker-backed tier is configured) -> secondary tiers ->
manager.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from shmtier import metrics
from shmtier.config import ConfigError, KVLayout, PrimaryTierConfig, TieringConfig
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.scheduler.tiering.factory import SecondaryTierFactory
from shmtier.scheduler.tiering.admission import DEFAULT_WINDOW_PER_ROW, CascadeAdmission
from shmtier.shared.pool_config import PoolConfig, PoolTier
from shmtier.scheduler.tiering.manager import TieringOffloadingManager
from shmtier.tiers.config import TierContext
from shmtier.shared.layout import PAGE_SIZE, SegmentLayout
from shmtier.shared.segment import Segment, SegmentSpaceError, human_bytes, open_segment


class TieringOffloadingSpec:
    """``extra_config`` is ``kv_connector_extra_config``; ``layout`` the engine's
    KV layout; ``engine_id`` names the segment (one per engine / DP replica);
    ``data_parallel_index``: the engine's data-parallel rank (vLLM's
    ``OffloadingConfig.parallel.data_parallel_index``; a tier that listens on a port,
    ``p2p``, adds it to its configured port, as vLLM does)."""

    def __init__(self, extra_config: Mapping[str, Any], layout: KVLayout, engine_id: str, *,
                 enable_events: bool = False, max_model_len: int | None = None,
                 data_parallel_index: int = 0):
        if (not isinstance(data_parallel_index, int) or isinstance(data_parallel_index, bool)
                or data_parallel_index < 0):
            raise ConfigError(f"data_parallel_index must be an int >= 0, got "
                              f"{data_parallel_index!r}")
        self.extra_config = dict(extra_config)
        self.layout = layout
        self.engine_id = engine_id
        self.data_parallel_index = data_parallel_index
        self.enable_events = enable_events
        self.max_model_len = max_model_len
        self.primary_config = PrimaryTierConfig.from_extra_config(extra_config, layout)
        self.geometry = self.primary_config.geometry(layout)
        self.fingerprint = self.primary_config.fingerprint(layout)
        self.blocks_per_chunk = self.primary_config.blocks_per_chunk
        # bytes of a row that hold KV (all ranks' slots, without the page padding)
        self.chunk_payload_bytes = self.geometry.page_size_per_worker * self.geometry.world_size
        self.tiering_config = TieringConfig.from_extra_config(
            extra_config, TierContext(self.chunk_payload_bytes, self.primary_config.key_width,
                                      data_parallel_index, engine_id))
        self.pool_config = self._pool_config()
        # Set while get_manager builds tiers; a worker-backed tier's scheduler half reads
        # them in its constructor: the pool that runs its jobs and its own index.
        self.worker_pool = None
        self.tier_index_being_built: int | None = None
        self._manager: TieringOffloadingManager | None = None

    def _pool_config(self) -> PoolConfig | None:
        """What the tier workers run, or None when no configured tier needs workers."""
        tiering = self.tiering_config
        if not tiering.worker_backed:
            return None
        tiers = tuple(PoolTier(t.type, t.options) if t.tier.worker_backed else None
                      for t in tiering.secondary_tiers)
        return PoolConfig(chunk_bytes=self.chunk_payload_bytes,
                          element_size=_element_size(self.layout.dtype),
                          codec=tiering.compression, tiers=tiers, options=tiering.pool)

    def _open_segment(self, **kwargs) -> Segment:
        """``open_segment`` for this engine; a /dev/shm too small for the CPU tier is a
        :class:`ConfigError` naming ``cpu_bytes_to_use`` (nothing was created)."""
        from shmtier.shared.pool_config import rings_len_for
        from shmtier.shared.ring import SEMAPHORES_PER_WORKER

        pool = self.pool_config
        rings_len = rings_len_for(pool) if pool else 0
        # the ring semaphores live on /dev/shm too (a page each), made after the segment
        reserve = (pool.options.num_tier_workers * SEMAPHORES_PER_WORKER * PAGE_SIZE
                   if pool else 0)
        try:
            return open_segment(self.engine_id, self.geometry, self.fingerprint,
                                rings_len=rings_len, reserve_bytes=reserve, **kwargs)
        except SegmentSpaceError as e:
            raise ConfigError(self._space_message(e, rings_len)) from e

    def _space_message(self, e: SegmentSpaceError, rings_len: int) -> str:
        g, value = self.geometry, self.primary_config.cpu_bytes_to_use

        def fits(rows: int) -> bool:
            layout = SegmentLayout.for_geometry(replace(g, num_chunks=rows), rings_len)
            return layout.total_len + e.reserve <= e.free

        lo, hi = 0, g.num_chunks  # the most rows that fit now (the segment grows with rows)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        advice = (f"lower cpu_bytes_to_use to at most {lo * g.row_stride} (what fits now)"
                  if lo and fits(lo) else
                  f"{e.shm_dir} cannot hold even one {g.row_stride}-byte chunk row")
        plus = f" plus {e.reserve} bytes for ring semaphores" if e.reserve else ""
        return (
            f"kv_connector_extra_config['cpu_bytes_to_use'] = {value} does not fit in "
            f"{e.shm_dir}: the CPU tier's shared-memory segment {e.name} needs {e.size} bytes "
            f"({human_bytes(e.size)}){plus}, {e.shm_dir} has {e.free} bytes "
            f"({human_bytes(e.free)}) free; {advice}, or give {e.shm_dir} more room "
            f"(Docker: --shm-size; Kubernetes: an emptyDir with medium Memory). "
            f"Nothing was created."
        )

    # --- front end (no instance needed) ---

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, metrics.MetricMetadata]:
        definitions = {**metrics.cpu_metric_definitions(), **metrics.tiering_metric_definitions()}
        for i, tier in enumerate(extra_config.get("secondary_tiers") or []):
            tier_cls = SecondaryTierFactory.get_tier_class(dict(tier), f"secondary_tiers[{i}]")
            definitions.update(tier_cls.build_metric_definitions(dict(tier)))
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        keys = list(metrics.CPUTierInfo.config_info_keys()) + ["tier"]
        for i, tier in enumerate(extra_config.get("secondary_tiers") or []):
            tier_cls = SecondaryTierFactory.get_tier_class(dict(tier), f"secondary_tiers[{i}]")
            for key in tier_cls.config_info_keys(dict(tier)):
                if key == "tier":
                    raise ValueError(f"secondary_tiers[{i}] ({tier['type']}) declares the "
                                     f"reserved info key 'tier'")
                if key not in keys:
                    keys.append(key)
        return tuple(keys)

    # --- scheduler process ---

    def _tier_info(self) -> metrics.CPUTierInfo:
        g = self.geometry
        tokens = None
        if self.max_model_len:
            chunk_tokens = self.layout.gpu_block_size * self.blocks_per_chunk
            chunks_per_request = -(-self.max_model_len // chunk_tokens)
            tokens = g.num_chunks * self.max_model_len // chunks_per_request
        return metrics.CPUTierInfo(g.num_chunks, self.blocks_per_chunk,
                                   g.num_chunks * g.row_stride, tokens)

    def get_manager(self) -> TieringOffloadingManager:
        """Build (once) and return the tiering manager; scheduler process only."""
        if self._manager is not None:
            return self._manager
        cleanup: list = []
        try:
            from shmtier.scheduler.pool import WorkerPool

            segment = self._open_segment(owner=True,
                                         warm_restart=self.primary_config.warm_restart)
            cleanup.append(segment.close)
            if not self.primary_config.warm_restart:
                segment.remove_when_owner_dies()  # a crash leaves nothing in /dev/shm
            primary = CPUPrimaryTierOffloadingManager(
                segment, self.primary_config.eviction_policy,
                self.primary_config.cache_policy_module_path, self.enable_events,
                info=self._tier_info(), attach=not segment.is_creator)
            stop_pool = []
            if self.pool_config is not None:
                self.worker_pool = WorkerPool(self.engine_id, segment, self.pool_config,
                                              mode=self.tiering_config.pool.workers)
                cleanup.append(self.worker_pool.shutdown)
                stop_pool.append(self.worker_pool.shutdown)
            view = primary.get_kv_memoryview()
            tiers = []
            for i, tier_config in enumerate(self.tiering_config.secondary_tiers):
                self.tier_index_being_built = i
                tier = SecondaryTierFactory.create_secondary_tier(tier_config, view, self)
                tiers.append(tier)
                cleanup.append(tier.shutdown)
            self.tier_index_being_built = None
            del view
            self._manager = TieringOffloadingManager(
                primary, tiers, stop_pool, self.tiering_config.tier_poll_interval_s,
                tier_poll_window=self.tiering_config.tier_poll_window,
                window_on_engine_cpu=self.tiering_config.tier_poll_window_cpu == "engine",
                admission=CascadeAdmission.build(
                    self.tiering_config.admission_rules(),
                    self.tiering_config.admission_window
                    or DEFAULT_WINDOW_PER_ROW * self.geometry.num_chunks))
            return self._manager
        except BaseException:
            for undo in reversed(cleanup):
                try:
                    undo()
                except Exception:  # keep undoing the rest
                    pass
            raise

    # --- GPU worker processes ---

    def get_worker(self, kv_caches: Any, rank: int = 0):
        """Join the segment as GPU rank ``rank`` and return its block copy worker."""
        from shmtier.gpu.copy_worker import BlockCopyWorker

        segment = self._open_segment(owner=False,
                                     rank=0 if self.layout.replicated_layout else rank,
                                     warm_restart=self.primary_config.warm_restart)
        try:
            return BlockCopyWorker(kv_caches, segment, self.blocks_per_chunk,
                                   0 if self.layout.replicated_layout else rank,
                                   close_segment=True)
        except BaseException:
            segment.close()
            raise


def _element_size(dtype: str) -> int:
    """Bytes per KV element of ``dtype`` (the codec splits 2-byte elements)."""
    name = dtype.replace("torch.", "").lower()
    if "8" in name and ("fp8" in name or "float8" in name or name in ("int8", "uint8")):
        return 1
    if name in ("float32", "fp32", "float"):
        return 4
    return 2
