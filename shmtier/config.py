"""Parsing and validating ``kv_connector_extra_config`` (docs/vllm-contract.md §12, docs/design.md §6).

Who calls: the spec, in every process role, before anything is created; a
:class:`ConfigError` therefore leaves nothing half-built. Every error names the
key, the value it got and what is accepted.

The result is plain, frozen data (``PrimaryTierConfig``; ``TieringConfig`` with one
``SecondaryTierConfig`` per tier, its ``CompressionConfig`` and ``WorkerPoolOptions``):
nothing is built here. Each section declares its keys in the option style of
``shmtier.options`` (default, check and description, each stated once), from which
docs/configuration.md is generated (``python -m shmtier.options_doc``).
``kv_connector_extra_config`` is one flat mapping: each section reads its own keys
from it (None counts as absent), and a key no section declares is refused once, against
them all. Each tier's own options are checked by its type's config class, found in the
tier registry (``shmtier/tiers/registry.py``); backpressure settings by
``shmtier.scheduler.backpressure.settings``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shmtier.options import (
    REQUIRED,
    Check,
    ConfigError,
    KeyedCheck,
    Options,
    boolean,
    integer,
    invalid,
    number,
    one_of,
    option,
    reject_unknown,
    text,
)
from shmtier.scheduler.backpressure.settings import BackpressureSettings
from shmtier.scheduler.policies.factory import CachePolicyFactory
from shmtier.scheduler.tiering.admission import DEFAULT_RULE, RULES
from shmtier.shared.codec import CompressionConfig
from shmtier.shared.layout import DEFAULT_KEY_WIDTH, ArenaGeometry
from shmtier.shared.pool_config import WorkerPoolOptions
from shmtier.tiers import registry
from shmtier.tiers.config import TierConfig, TierContext
from shmtier.tiers.registry import TierType

__all__ = ["ConfigError", "ConnectorKeys", "KVLayout", "PrimaryTierConfig",
           "SecondaryTierConfig", "TierEntryKeys", "TieringConfig"]

WHERE = "kv_connector_extra_config"
#: Storage tiers are polled off the engine thread for a share of the step period after
#: ``on_schedule_end`` (scheduler/tiering/window_poll.py) at most this large: a window
#: reaching the next step would poll inside it.
MAX_TIER_POLL_WINDOW = 0.95
#: Memory a tier worker is budgeted (private RSS stays under 100 MiB, docs/design.md §9).
WORKER_MEMORY_BYTES = 128 << 20
#: Tier workers per core at most: more only queue for the same cores.
WORKERS_PER_CORE = 4


def _key(key: str) -> str:
    return f"{WHERE}[{key!r}]"


def _section(cls: type, extra: Mapping[str, Any], **derived: Any) -> Any:
    """The section ``cls``'s keys of the flat ``extra``, checked (None counts as absent;
    unknown keys are refused against every section's by ``PrimaryTierConfig``)."""
    return cls.from_mapping(extra, where=WHERE, key=_key, strict=False, null_is_absent=True,
                            **derived)


@dataclass(frozen=True, kw_only=True)
class ConnectorKeys(Options):
    """Keys that vLLM's factory or connector read from the same mapping
    (docs/vllm-contract.md §12.1): vLLM reads them with ``bool()`` / ``int()``, so
    ``"false"`` would be True to it and ``"lots"`` fail only once the scheduler starts.
    Checked here, when the spec is built; passed to vLLM unchanged."""

    spec_name: str | None = option(
        None, text(), doc='"ShmTierOffloadingSpec": selects shmtier', default_doc="— (vLLM "
                                                                               "requires it)")
    spec_module_path: str | None = option(
        None, text(), doc='"shmtier.vllm": the module vLLM imports the spec from',
        default_doc="— (vLLM requires it)")
    offload_prompt_only: bool | None = option(
        None, boolean(), doc="vLLM's connector: offload prompt blocks only, not decode blocks",
        default_doc="vLLM's (true)")
    self_describing_kv_events: bool | None = option(
        None, boolean(), doc="vLLM's connector: full BlockStored payloads (needs KV events "
                             "enabled)", default_doc="vLLM's (false)")
    sync_load_budget_bytes: int | None = option(
        None, integer(0),
        doc="vLLM's connector: per-step budget for loads waited on within the step",
        default_doc="vLLM's (0)")
    canonical_layout: bool | None = option(
        None, one_of(False, accepted="false (shmtier stores vLLM's direct per-rank layout "
                                     "only)"),
        doc="vLLM's canonical KV layout: not supported", default_doc="`false`")


#: Keys passed to vLLM unchanged (checked here first).
PASSTHROUGH_KEYS = ConnectorKeys.keys()


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


def _policy_names() -> str:
    return f"one of {CachePolicyFactory.supported()} or an out-of-tree class name"


@dataclass(frozen=True, kw_only=True)
class PrimaryTierConfig(Options):
    """The validated primary-tier (CPU tier) part of ``kv_connector_extra_config``."""

    cpu_bytes_to_use: int = option(
        REQUIRED, integer(1),
        doc="bytes of the CPU tier, total over all GPU ranks of the engine: rows of KV bytes "
            "per GPU block x ranks x blocks per chunk, rounded up to 4 KiB (as vLLM's CPU "
            "spec); it must fit in /dev/shm with the chunk table and rings (Docker's default "
            "is 64 MiB: --shm-size), else the process that creates the segment fails naming "
            "the free space and the most that fits")
    block_size: int | None = option(
        None, integer(1),
        doc="tokens per offloaded chunk, a multiple of the GPU block size (vLLM turns it into "
            "blocks_per_chunk); set this or blocks_per_chunk, not both",
        default_doc="the GPU block size")
    blocks_per_chunk: int = option(
        1, integer(1), doc="GPU blocks per chunk; set this or block_size, not both")
    eviction_policy: str = option(
        "lru", Check(_policy_names, lambda v: v if isinstance(v, str) and v else _bad()),
        doc='the CPU tier\'s policy: "lru", "arc", a registered name, or a class name with '
            "cache_policy_module_path")
    cache_policy_module_path: str | None = option(
        None, text(), doc="the module of an out-of-tree cache policy")
    store_threshold: int = option(
        0, integer(0), doc="0 or 1 only: as vLLM's tiering spec, 2 or more is rejected")
    max_tracker_size: int = option(
        64_000, integer(1),
        doc="accepted for vLLM compatibility; matters only with store_threshold >= 2")
    key_width: int = option(
        DEFAULT_KEY_WIDTH, integer(5, 255),
        doc="bytes reserved per offload key in the shared chunk table (keys are a 32-byte "
            "block hash + a 4-byte group index)")
    warm_restart: bool = option(
        False, boolean(),
        doc="a restarted scheduler re-attaches to the segment its dead predecessor left "
            "(same engine_id, model, dtype and geometry) and keeps what it stored, instead "
            "of replacing it; the dead scheduler's tier workers leave when they see the new "
            "owner, and the new pool waits up to 2 s for their slots")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], layout: KVLayout, *,
                          tiering: bool = True) -> "PrimaryTierConfig":
        """Validate ``extra`` for ``layout``; ``tiering`` forbids store_threshold >= 2."""
        if not isinstance(extra, Mapping):
            raise invalid(WHERE, extra, "a mapping")
        reject_unknown(extra, KNOWN_KEYS, WHERE)
        _section(ConnectorKeys, extra)
        config = _section(cls, extra)
        if config.block_size is not None:
            if extra.get("blocks_per_chunk") is not None:
                raise ConfigError(
                    f"{WHERE} sets both 'block_size' = {extra['block_size']!r} and "
                    f"'blocks_per_chunk' = {extra['blocks_per_chunk']!r}: set only one")
            if config.block_size % layout.gpu_block_size:
                raise ConfigError(
                    f"{_key('block_size')} = {config.block_size} is invalid: expected a "
                    f"multiple of the GPU block size {layout.gpu_block_size}")
            config = replace(config,
                             blocks_per_chunk=config.block_size // layout.gpu_block_size)
        try:
            CachePolicyFactory.get_cache_policy_cls(config.eviction_policy,
                                                    config.cache_policy_module_path)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if tiering and config.store_threshold >= 2:
            raise ConfigError(
                f"{_key('store_threshold')} = {config.store_threshold} is not supported by the "
                f"tiering spec: use 0 or 1 (as vLLM's TieringOffloadingSpec)")
        geometry = config.geometry(layout)
        if geometry.num_chunks == 0 and layout.worker_kv_bytes_per_block > 0:
            raise ConfigError(
                f"{_key('cpu_bytes_to_use')} = {config.cpu_bytes_to_use} is smaller than "
                f"one chunk row of {geometry.row_stride} bytes: raise it")
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


def _bad() -> Any:
    raise ValueError("")


#: A ``backpressure`` block, top level or a tier's (``false``: none; its keys are checked,
#: merged, by ``BackpressureSettings.from_config``).
_BACKPRESSURE = Check("a mapping of backpressure settings, or false (none)",
                      lambda v: v if v is False or isinstance(v, Mapping) else _bad())


@dataclass(frozen=True, kw_only=True)
class TierEntryKeys(Options):
    """The keys of a ``secondary_tiers`` entry that are not its tier type's options
    (declared here for their checks and the reference; ``SecondaryTierConfig`` holds
    what they give)."""

    type: str = option(
        REQUIRED, text(),
        doc='"fs", "obj", "p2p", "node", "example" (their keys below), a registered type, or the '
            "class name of an out-of-tree tier with module_path (every other key goes to its "
            "constructor)")
    module_path: str | None = option(
        None, text(), doc="the module an out-of-tree tier's class is imported from")
    backpressure: Mapping[str, Any] | bool | None = option(
        None, _BACKPRESSURE,
        doc="this tier's backpressure settings, over the top-level ones key by key; false: "
            "none for this tier; {}: the defaults", default_doc="the top-level one's")
    admission: str | None = option(
        None, one_of(*RULES),
        doc="this tier's cascade admission rule, e.g. a slow remote tier admitting only "
            "re-read chunks under a local one taking all; a request-level tier (the p2p "
            "hand-off) always gets every chunk of the requests that ask for it",
        default_doc="the top-level admission")


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
        TierEntryKeys.check_value("module_path", module_path, f"{where}.module_path")
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
        """Check one tier dict (``TierEntryKeys`` and the tier's own options) under the
        top-level ``backpressure`` block."""
        try:
            tier = resolve_tier_type(entry, where)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        options = {k: v for k, v in entry.items() if k not in TierEntryKeys.keys()}
        block = entry.get("backpressure")
        if block is not None:
            TierEntryKeys.check_value("backpressure", block, f"{where}.backpressure")
        try:
            backpressure = BackpressureSettings.from_config(
                tier.name, entry.get("locality"), top_backpressure, block,
                where=f"{where}.backpressure", top_level_where="backpressure")
        except ValueError as e:
            raise ConfigError(str(e)) from e
        admission = entry.get("admission")
        if admission is not None:
            admission = TierEntryKeys.check_value("admission", admission, f"{where}.admission")
        return cls(where, tier, tier.config_class().from_options(options, where=where,
                                                                 context=context), backpressure,
                   admission)


def _tier_list(key: str, value: Any) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"secondary_tiers must be a list of tier configurations: {key} = {value!r} is "
            f"invalid: expected a list of dicts, each with a 'type'")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class TieringConfig(Options):
    """The validated secondary-tier part of ``kv_connector_extra_config``: plain data,
    so every process may build it (nothing here starts, opens or builds anything).
    ``pool``: the tier worker pool's keys (``WorkerPoolOptions``)."""

    secondary_tiers: tuple[SecondaryTierConfig, ...] = option(
        (), KeyedCheck("a list of tier dicts, each with a 'type'", _tier_list),
        doc="the secondary tiers, highest priority first: dicts of the keys of a tier entry "
            "and of its tier type (below)")
    backpressure: Mapping[str, Any] | bool | None = option(
        None, _BACKPRESSURE,
        doc="default backpressure settings of every tier, merged key by key under each "
            "tier's own (Backpressure below)", default_doc="none (off)")
    tier_poll_interval_s: float = option(
        0.001, number(accepted="a number of seconds (<= 0 disables polling between "
                               "steps)").then(float),
        doc="longest pause of the tier-poll thread, which polls the tiers that opt in (p2p; "
            "one with news wakes it sooner), and the shortest interval between the "
            "step-window thread's rounds; <= 0 turns both threads off")
    tier_poll_window: float = option(
        0.85, number(0, MAX_TIER_POLL_WINDOW,
                     accepted=f"a share of the engine's step period, 0 (off) to "
                              f"{MAX_TIER_POLL_WINDOW:g}").then(float),
        doc="the storage tiers' finished jobs are collected by a thread while the engine "
            "runs its forward pass, from just after on_schedule_end until this share of the "
            "step period has passed, while work is in flight (a step then sends only its "
            "loads and polls only for them; the round after it cascades what the step "
            "stored and sends the rest); 0: every poll and send inside the steps")
    tier_poll_window_cpu: str = option(
        "any", one_of("any", "engine"),
        doc='where the step-window thread runs its rounds: "any" (the CPU the kernel picks) '
            'or "engine" (the CPU the engine thread ended its last step on, where the '
            "forward pass leaves it idle: the next step then finds what a round touched in "
            "its own caches, not on another core; see bench/README.md, \"Per-step fixed "
            'costs\")')
    compression: CompressionConfig = option(
        CompressionConfig(), CompressionConfig.check(),
        doc="how tier workers compress chunks: a mode, or a mapping (Compression below)",
        default_doc='`"auto"`')
    admission: str = option(
        DEFAULT_RULE, one_of(*RULES),
        doc='which chunks the CPU tier writes through to the secondary tiers: "all" '
            '(vLLM\'s behaviour) or "second_touch" (a chunk only once it was used twice; '
            "a tier entry's admission overrides it)")
    admission_window: int | None = option(
        None, integer(1),
        doc="keys second_touch remembers (least recently touched forgotten first), about 175 "
            "bytes each",
        default_doc="4 x the CPU tier's rows")
    pool: WorkerPoolOptions = field(default_factory=WorkerPoolOptions)

    @property
    def worker_backed(self) -> bool:
        """Whether any configured tier needs tier worker processes."""
        return any(t.tier.worker_backed for t in self.secondary_tiers)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any],
                          context: TierContext = TierContext()) -> "TieringConfig":
        """``context``: the engine's chunk geometry, for checks such as a tier's
        ``max_bytes`` against one chunk (the spec passes it)."""
        pool = _checked_pool(_section(WorkerPoolOptions, extra))
        config = _section(cls, extra, pool=pool)
        secondary = tuple(
            SecondaryTierConfig.from_dict(tier, config.backpressure,
                                          where=f"secondary_tiers[{i}]", context=context)
            for i, tier in enumerate(config.secondary_tiers))
        # checks across one engine's tiers, by the tier configs that declare one
        for options_cls in dict.fromkeys(type(t.options) for t in secondary):
            check_together = getattr(options_cls, "check_engine_tiers", None)
            if check_together is not None:
                check_together(secondary)
        return replace(config, secondary_tiers=secondary)

    def admission_rules(self) -> tuple[str, ...]:
        """Each secondary tier's cascade admission rule: its own, else the top-level one."""
        return tuple(t.admission or self.admission for t in self.secondary_tiers)


#: Every key of ``kv_connector_extra_config``.
KNOWN_KEYS = (PASSTHROUGH_KEYS | PrimaryTierConfig.keys() | TieringConfig.keys()
              | WorkerPoolOptions.keys())


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


def _check_tier_workers(value: int) -> None:
    limit, why = max_tier_workers()
    if value > limit:
        raise invalid(_key("num_tier_workers"), value,
                      f"an integer in 1..{limit} on this host ({why})")


def _checked_pool(pool: WorkerPoolOptions) -> WorkerPoolOptions:
    """``pool`` checked across its keys (``num_tier_workers`` against this host, then
    ``tier_promotion_workers`` against ``num_tier_workers``: at least one worker stays in
    the background lane), with the promotion lane's size filled in where it was not given."""
    _check_tier_workers(pool.num_tier_workers)
    n, given = pool.num_tier_workers, pool.tier_promotion_workers
    if given is not None and given >= n:
        raise invalid(_key("tier_promotion_workers"), given,
                      f"an integer in 0..{n - 1} (fewer than num_tier_workers = {n}: at least "
                      f"one tier worker stays in the background lane for stores and deletes)")
    return replace(pool, tier_promotion_workers=pool.promotion_workers)
