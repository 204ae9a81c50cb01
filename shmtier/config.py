"""Parsing and validating ``kv_connector_extra_config`` (docs/vllm-contract.md §12, docs/design.md §6).

Who calls: the spec, in every process role, before anything is created; a
:class:`ConfigError` therefore leaves nothing half-built. Every error names the
key, the value it got and what is accepted.

The result is plain, frozen data (``PrimaryTierConfig``, ``TieringConfig`` with one
``SecondaryTierConfig`` per tier): nothing is built here. Each tier's own options
are checked by its type's config class, found in the tier registry
(``shmtier/tiers/registry.py``); backpressure settings by
``shmtier.scheduler.backpressure.settings``. Value checks are ``shmtier.options``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shmtier.options import (
    Check,
    ConfigError,
    boolean,
    integer,
    invalid,
    number,
    one_of,
    reject_unknown,
    text,
)
from shmtier.scheduler.tiering.admission import DEFAULT_RULE, RULES
from shmtier.scheduler.backpressure.settings import BackpressureSettings
from shmtier.scheduler.policies.factory import CachePolicyFactory
from shmtier.shared.codec import CompressionConfig
from shmtier.shared.lanes import default_promotion_workers
from shmtier.shared.layout import DEFAULT_KEY_WIDTH, ArenaGeometry
from shmtier.shared.pool_config import (
    DEFAULT_WORKER_NICENESS,
    DEFAULT_WORKER_POLICY,
    WORKER_POLICIES,
)
from shmtier.tiers import registry
from shmtier.tiers.config import TierConfig, TierContext
from shmtier.tiers.registry import TierType

__all__ = ["ConfigError", "KVLayout", "PrimaryTierConfig", "SecondaryTierConfig", "TieringConfig"]

#: Keys that vLLM's factory or connector read from the same mapping (docs/vllm-contract.md
#: §12.1), with what each accepts: vLLM reads them with ``bool()`` / ``int()``, so
#: ``"false"`` would be True to it and ``"lots"`` fail only once the scheduler starts.
#: Checked here, when the spec is built; passed to vLLM unchanged.
CONNECTOR_KEYS: dict[str, Check] = {
    "spec_name": text(),
    "spec_module_path": text(),
    "offload_prompt_only": boolean(),
    "self_describing_kv_events": boolean(),
    "sync_load_budget_bytes": integer(0),
    "canonical_layout": one_of(
        False, accepted="false (shmtier stores vLLM's direct per-rank layout only)"),
}
PASSTHROUGH_KEYS = frozenset(CONNECTOR_KEYS)
PRIMARY_KEYS = frozenset({
    "cpu_bytes_to_use", "block_size", "blocks_per_chunk", "eviction_policy",
    "cache_policy_module_path", "store_threshold", "max_tracker_size", "key_width",
    "warm_restart",
})
TIERING_KEYS = frozenset({
    "secondary_tiers", "tier_poll_interval_s", "tier_poll_window", "backpressure", "num_tier_workers", "workers",
    "compression", "tier_job_timeout_s", "admission", "admission_window",
    "tier_worker_niceness", "tier_worker_policy", "tier_promotion_workers",
})
KNOWN_KEYS = PASSTHROUGH_KEYS | PRIMARY_KEYS | TIERING_KEYS
WORKER_MODES = ("spawn", "external")
#: Storage tiers are polled off the engine thread for this share of the step period after
#: ``on_schedule_end`` (scheduler/tiering/window_poll.py); a window reaching the next step
#: would poll inside it.
DEFAULT_TIER_POLL_WINDOW = 0.85
MAX_TIER_POLL_WINDOW = 0.95
#: Memory a tier worker is budgeted (private RSS stays under 100 MiB, docs/design.md §9).
WORKER_MEMORY_BYTES = 128 << 20
#: Tier workers per core at most: more only queue for the same cores.
WORKERS_PER_CORE = 4


def _key(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _get(extra: Mapping[str, Any], key: str, default: Any, check) -> Any:
    """``extra[key]`` checked (None counts as absent), else ``default``."""
    value = extra.get(key)
    return default if value is None else check(_key(key), value)


def _required_int(extra: Mapping[str, Any], key: str, minimum: int) -> int:
    if extra.get(key) is None:
        raise ConfigError(f"{_key(key)} is required (an integer >= {minimum})")
    return _get(extra, key, None, integer(minimum))


@dataclass(frozen=True)
class KVLayout:
    """What the engine's KV cache looks like to one GPU worker (from vLLM's
    OffloadingConfig): identical in every process of one engine."""

    model: str
    dtype: str
    gpu_block_size: int  # tokens per GPU block
    worker_kv_bytes_per_block: int
    world_size: int = 1
    replicated_layout: bool = False


@dataclass(frozen=True)
class PrimaryTierConfig:
    """The validated primary-tier part of ``kv_connector_extra_config``."""

    cpu_bytes_to_use: int
    blocks_per_chunk: int
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    key_width: int = DEFAULT_KEY_WIDTH
    warm_restart: bool = False

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], layout: KVLayout, *,
                          tiering: bool = True) -> "PrimaryTierConfig":
        """Validate ``extra`` for ``layout``; ``tiering`` forbids store_threshold >= 2."""
        if not isinstance(extra, Mapping):
            raise invalid("kv_connector_extra_config", extra, "a mapping")
        reject_unknown(extra, KNOWN_KEYS, "kv_connector_extra_config")
        for key, check in CONNECTOR_KEYS.items():
            _get(extra, key, None, check)
        cpu_bytes = _required_int(extra, "cpu_bytes_to_use", 1)
        blocks_per_chunk = _blocks_per_chunk(extra, layout.gpu_block_size)
        policy = extra.get("eviction_policy", "lru")
        if not isinstance(policy, str) or not policy:
            raise invalid(_key("eviction_policy"), policy,
                          f"one of {CachePolicyFactory.supported()} or an out-of-tree class name")
        module_path = _get(extra, "cache_policy_module_path", None, text())
        try:
            CachePolicyFactory.get_cache_policy_cls(policy, module_path)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        store_threshold = _get(extra, "store_threshold", 0, integer(0))
        if tiering and store_threshold >= 2:
            raise ConfigError(
                f"kv_connector_extra_config['store_threshold'] = {store_threshold} is not "
                f"supported by the tiering spec: use 0 or 1 (as vLLM's TieringOffloadingSpec)"
            )
        config = cls(
            cpu_bytes_to_use=cpu_bytes,
            blocks_per_chunk=blocks_per_chunk,
            eviction_policy=policy,
            cache_policy_module_path=module_path,
            store_threshold=store_threshold,
            max_tracker_size=_get(extra, "max_tracker_size", 64_000, integer(1)),
            key_width=_get(extra, "key_width", DEFAULT_KEY_WIDTH, integer(5, 255)),
            warm_restart=_get(extra, "warm_restart", False, boolean()),
        )
        geometry = config.geometry(layout)
        if geometry.num_chunks == 0 and layout.worker_kv_bytes_per_block > 0:
            raise ConfigError(
                f"kv_connector_extra_config['cpu_bytes_to_use'] = {cpu_bytes} is smaller than "
                f"one chunk row of {geometry.row_stride} bytes: raise it"
            )
        return config

    def geometry(self, layout: KVLayout) -> ArenaGeometry:
        return ArenaGeometry.for_kv(
            cpu_bytes_to_use=self.cpu_bytes_to_use,
            worker_kv_bytes_per_block=layout.worker_kv_bytes_per_block,
            blocks_per_chunk=self.blocks_per_chunk,
            world_size=layout.world_size,
            replicated_layout=layout.replicated_layout,
            key_width=self.key_width,
        )

    def fingerprint(self, layout: KVLayout) -> str:
        """Identifies KV bytes that are interchangeable: same model, dtype and geometry."""
        return (
            f"model={layout.model} dtype={layout.dtype} block={layout.gpu_block_size}"
            f"x{self.blocks_per_chunk} bytes_per_block={layout.worker_kv_bytes_per_block}"
            f" world={layout.world_size} replicated={int(layout.replicated_layout)}"
        )


def _blocks_per_chunk(extra: Mapping[str, Any], gpu_block_size: int) -> int:
    has_bpc = extra.get("blocks_per_chunk") is not None
    has_bs = extra.get("block_size") is not None
    if has_bpc and has_bs:
        raise ConfigError(
            f"kv_connector_extra_config sets both 'block_size' = {extra['block_size']!r} and "
            f"'blocks_per_chunk' = {extra['blocks_per_chunk']!r}: set only one"
        )
    if has_bs:
        block_size = _get(extra, "block_size", None, integer(1))
        if block_size % gpu_block_size:
            raise ConfigError(
                f"kv_connector_extra_config['block_size'] = {block_size} is invalid: expected "
                f"a multiple of the GPU block size {gpu_block_size}"
            )
        return block_size // gpu_block_size
    return _get(extra, "blocks_per_chunk", 1, integer(1))


def resolve_tier_type(entry: Any, where: str) -> TierType:
    """The tier type a tier dict names with ``type`` (and ``module_path``), from the
    registry; ConfigError (vLLM's wording first) when the dict names none."""
    if not isinstance(entry, Mapping):
        raise invalid(where, entry, "a dict with a 'type' key")
    tier_type = entry.get("type")
    if not isinstance(tier_type, str) or not tier_type:
        raise ConfigError(
            f"Secondary tier configuration must include 'type': {where}.type = "
            f"{tier_type!r} is invalid: expected one of {registry.names()} or an "
            f"out-of-tree class name with module_path")
    module_path = entry.get("module_path")
    if module_path is not None:
        text()(f"{where}.module_path", module_path)
    return registry.resolve(tier_type, module_path, where=where)


@dataclass(frozen=True)
class SecondaryTierConfig:
    """One checked entry of ``secondary_tiers``: its tier type (from the registry), its
    options and its backpressure settings (data: the detector is built in the scheduler)."""

    where: str  # e.g. "secondary_tiers[0]": names the tier in errors
    tier: TierType
    options: TierConfig
    backpressure: BackpressureSettings | None = None
    admission: str | None = None  # this tier's cascade admission rule; None: the top-level one

    @property
    def type(self) -> str:
        return self.tier.name

    @classmethod
    def from_dict(cls, entry: Any, top_backpressure: Any = None, *, where: str,
                  context: TierContext = TierContext()) -> "SecondaryTierConfig":
        """Check one tier dict (``type``, ``module_path``, ``backpressure`` and the tier's
        own options) under the top-level ``backpressure`` block."""
        try:
            tier = resolve_tier_type(entry, where)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        tier_type = tier.name
        options = {k: v for k, v in entry.items()
                   if k not in ("type", "module_path", "backpressure", "admission")}
        try:
            backpressure = BackpressureSettings.from_config(
                tier_type, entry.get("locality"), top_backpressure, entry.get("backpressure"),
                where=f"{where}.backpressure")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        admission = entry.get("admission")
        if admission is not None:
            admission = one_of(*RULES)(f"{where}.admission", admission)
        return cls(where, tier, tier.config_class().from_options(options, where=where,
                                                                 context=context), backpressure,
                   admission)


@dataclass(frozen=True)
class TieringConfig:
    """The validated secondary-tier part of ``kv_connector_extra_config``: plain data,
    so every process may build it (nothing here starts, opens or builds anything)."""

    secondary_tiers: tuple[SecondaryTierConfig, ...] = ()
    tier_poll_interval_s: float = 0.001
    # share of the step period after on_schedule_end in which the storage tiers are polled
    # off the engine thread (scheduler/tiering/window_poll.py); 0: off
    tier_poll_window: float = DEFAULT_TIER_POLL_WINDOW
    num_tier_workers: int = 2
    workers: str = "spawn"
    compression: CompressionConfig = CompressionConfig()
    tier_job_timeout_s: float = 60.0
    admission: str = DEFAULT_RULE  # cascade admission (scheduler/tiering/admission.py)
    admission_window: int | None = None  # second_touch's keys remembered; None: 4 x CPU rows
    # added to the niceness each tier worker inherits (PoolConfig.worker_niceness)
    tier_worker_niceness: int = DEFAULT_WORKER_NICENESS
    # the tier workers' scheduling policy (PoolConfig.worker_policy)
    tier_worker_policy: str = DEFAULT_WORKER_POLICY
    # the last this many tier workers run at the engine's priority and take loads and
    # probes (PoolConfig.promotion_workers; default: default_promotion_workers)
    tier_promotion_workers: int = 1

    @property
    def worker_backed(self) -> bool:
        """Whether any configured tier needs tier worker processes."""
        return any(t.tier.worker_backed for t in self.secondary_tiers)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any],
                          context: TierContext = TierContext()) -> "TieringConfig":
        """``context``: the engine's chunk geometry, for checks such as a tier's
        ``max_bytes`` against one chunk (the spec passes it)."""
        tiers = extra.get("secondary_tiers", [])
        if tiers is None:
            tiers = []
        if not isinstance(tiers, (list, tuple)):
            raise ConfigError(
                f"secondary_tiers must be a list of tier configurations: {_key('secondary_tiers')}"
                f" = {tiers!r} is invalid: expected a list of dicts, each with a 'type'")
        top = extra.get("backpressure")
        secondary = tuple(
            SecondaryTierConfig.from_dict(tier, top, where=f"secondary_tiers[{i}]", context=context)
            for i, tier in enumerate(tiers))
        # checks across one engine's tiers, by the tier configs that declare one
        for options_cls in dict.fromkeys(type(t.options) for t in secondary):
            check_together = getattr(options_cls, "check_engine_tiers", None)
            if check_together is not None:
                check_together(secondary)
        try:
            compression = CompressionConfig.from_config(extra.get("compression", "auto"))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        num_tier_workers = _num_tier_workers(extra)
        return cls(
            secondary_tiers=secondary,
            tier_poll_interval_s=float(_get(extra, "tier_poll_interval_s", 0.001, number(
                accepted="a number of seconds (<= 0 disables polling between steps)"))),
            tier_poll_window=float(_get(extra, "tier_poll_window", DEFAULT_TIER_POLL_WINDOW, number(
                0, MAX_TIER_POLL_WINDOW,
                accepted=f"a share of the engine's step period, 0 (off) to {MAX_TIER_POLL_WINDOW:g}"))),
            num_tier_workers=num_tier_workers,
            workers=_get(extra, "workers", "spawn", one_of(*WORKER_MODES)),
            compression=compression,
            tier_job_timeout_s=float(_get(extra, "tier_job_timeout_s", 60.0,
                                          number(0, min_open=True))),
            admission=_get(extra, "admission", DEFAULT_RULE, one_of(*RULES)),
            admission_window=_get(extra, "admission_window", None, integer(1)),
            tier_worker_niceness=_get(extra, "tier_worker_niceness", DEFAULT_WORKER_NICENESS,
                                      integer(0, 19)),
            tier_worker_policy=_get(extra, "tier_worker_policy", DEFAULT_WORKER_POLICY,
                                    one_of(*WORKER_POLICIES)),
            tier_promotion_workers=_tier_promotion_workers(extra, num_tier_workers),
        )

    def admission_rules(self) -> tuple[str, ...]:
        """Each secondary tier's cascade admission rule: its own, else the top-level one."""
        return tuple(t.admission or self.admission for t in self.secondary_tiers)


def max_tier_workers() -> tuple[int, str]:
    """How many tier workers this host can run, and why: ``WORKERS_PER_CORE`` per core,
    and ``WORKER_MEMORY_BYTES`` each of the memory available now."""
    cores = os.cpu_count() or 1
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 1 << 40
    by_cores = WORKERS_PER_CORE * cores
    by_memory = max(1, available // WORKER_MEMORY_BYTES)
    why = (f"{WORKERS_PER_CORE} per core x {cores} cores = {by_cores}; "
           f"{available >> 20} MiB of memory available / {WORKER_MEMORY_BYTES >> 20} MiB "
           f"per worker = {by_memory}")
    return min(by_cores, by_memory), why


def _num_tier_workers(extra: Mapping[str, Any]) -> int:
    value = _get(extra, "num_tier_workers", 2, integer(1))
    limit, why = max_tier_workers()
    if value > limit:
        raise invalid(_key("num_tier_workers"), value, f"an integer in 1..{limit} on this host ({why})")
    return value


def _tier_promotion_workers(extra: Mapping[str, Any], num_workers: int) -> int:
    check = integer(0, num_workers - 1)
    check.accepted += (f" (fewer than num_tier_workers = {num_workers}: at least one tier "
                       "worker stays in the background lane for stores and deletes)")
    return _get(extra, "tier_promotion_workers", default_promotion_workers(num_workers), check)
