"""Parsing and validating ``kv_connector_extra_config`` (contract §12, DESIGN §6).

Who calls: the spec, in every process role, before anything is created; a
:class:`ConfigError` therefore leaves nothing half-built. Every error names the
key, the value it got and what is accepted.

Keys handled here are the primary tier's and the connector-level keys the
spec only passes through. The tiering issue adds the secondary-tier keys.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shmtier.scheduler.policies.factory import CachePolicyFactory
from shmtier.shared.layout import DEFAULT_KEY_WIDTH, ArenaGeometry


class ConfigError(ValueError):
    """Invalid configuration: names the key, the value and what is accepted."""


# Keys that vLLM's connector or factory read from the same mapping; accepted as is.
PASSTHROUGH_KEYS = frozenset({
    "spec_name", "spec_module_path", "offload_prompt_only", "self_describing_kv_events",
    "sync_load_budget_bytes", "canonical_layout",
})
PRIMARY_KEYS = frozenset({
    "cpu_bytes_to_use", "block_size", "blocks_per_chunk", "eviction_policy",
    "cache_policy_module_path", "store_threshold", "max_tracker_size", "key_width",
    "warm_restart",
})
TIERING_KEYS = frozenset({
    "secondary_tiers", "tier_poll_interval_s", "backpressure", "num_tier_workers", "workers",
    "compression",
})
KNOWN_KEYS = PASSTHROUGH_KEYS | PRIMARY_KEYS | TIERING_KEYS
WORKER_MODES = ("spawn", "external")


def _int(extra: Mapping[str, Any], key: str, default: int | None, *, minimum: int,
         required: bool = False) -> int | None:
    if key not in extra or extra[key] is None:
        if required:
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}] is required (an integer >= {minimum})"
            )
        return default
    value = extra[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] = {extra[key]!r} is invalid: "
            f"expected an integer >= {minimum}"
        )
    return value


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] = {value!r} is invalid: expected true or false"
        )
    return value


def _optional_str(extra: Mapping[str, Any], key: str, default: str | None) -> str | None:
    value = extra.get(key, default)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] = {value!r} is invalid: expected a non-empty string"
        )
    return value


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
            raise ConfigError(
                f"kv_connector_extra_config = {extra!r} is invalid: expected a mapping"
            )
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"kv_connector_extra_config has unknown key(s) {', '.join(hints)}; "
                f"accepted keys: {sorted(KNOWN_KEYS)}"
            )
        cpu_bytes = _int(extra, "cpu_bytes_to_use", None, minimum=1, required=True)
        blocks_per_chunk = _blocks_per_chunk(extra, layout.gpu_block_size)
        policy = extra.get("eviction_policy", "lru")
        if not isinstance(policy, str) or not policy:
            raise ConfigError(
                f"kv_connector_extra_config['eviction_policy'] = {policy!r} is invalid: "
                f"expected one of {CachePolicyFactory.supported()} or an out-of-tree class name"
            )
        module_path = _optional_str(extra, "cache_policy_module_path", None)
        try:
            CachePolicyFactory.get_cache_policy_cls(policy, module_path)
        except ValueError as e:
            raise ConfigError(f"kv_connector_extra_config: {e}") from e
        store_threshold = _int(extra, "store_threshold", 0, minimum=0)
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
            max_tracker_size=_int(extra, "max_tracker_size", 64_000, minimum=1),
            key_width=_int(extra, "key_width", DEFAULT_KEY_WIDTH, minimum=5),
            warm_restart=_bool(extra, "warm_restart", False),
        )
        if config.key_width > 255:
            raise ConfigError(
                f"kv_connector_extra_config['key_width'] = {config.key_width} is invalid: "
                f"expected an integer in 5..255"
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
        block_size = _int(extra, "block_size", None, minimum=1)
        if block_size % gpu_block_size:
            raise ConfigError(
                f"kv_connector_extra_config['block_size'] = {block_size} is invalid: expected "
                f"a multiple of the GPU block size {gpu_block_size}"
            )
        return block_size // gpu_block_size
    return _int(extra, "blocks_per_chunk", 1, minimum=1)


@dataclass(frozen=True)
class TieringConfig:
    """The validated secondary-tier part of ``kv_connector_extra_config``.

    ``secondary_tiers`` keeps each tier dict as given (the factory validates
    ``type``/``module_path`` and the tier's own options at construction);
    ``detectors`` holds each tier's backpressure detector (or None), built
    from the top-level ``backpressure`` merged field by field under the tier's.
    """

    secondary_tiers: tuple[dict, ...] = ()
    detectors: tuple[Any, ...] = ()
    tier_poll_interval_s: float = 0.001
    num_tier_workers: int = 2
    workers: str = "spawn"
    compression: Any = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "TieringConfig":
        from shmtier.scheduler.backpressure import build_detector_from_config
        from shmtier.shared.codec import CompressionConfig

        tiers = extra.get("secondary_tiers", [])
        if tiers is None:
            tiers = []
        if not isinstance(tiers, (list, tuple)) or not all(isinstance(t, Mapping) for t in tiers):
            raise ConfigError(
                f"kv_connector_extra_config['secondary_tiers'] = {tiers!r} is invalid: "
                f"expected a list of dicts, each with a 'type'"
            )
        top = extra.get("backpressure")
        detectors = []
        for i, tier in enumerate(tiers):
            tier_type = tier.get("type")
            if not isinstance(tier_type, str) or not tier_type:
                raise ConfigError(
                    f"secondary_tiers[{i}].type = {tier_type!r} is invalid: expected a tier "
                    f"type name (e.g. 'fs', 'example') or an out-of-tree class name"
                )
            try:
                detectors.append(build_detector_from_config(
                    tier_type, tier.get("locality"), top, tier.get("backpressure"),
                    where=f"secondary_tiers[{i}].backpressure"))
            except ValueError as e:
                raise ConfigError(str(e)) from e
        interval = extra.get("tier_poll_interval_s", 0.001)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ConfigError(
                f"kv_connector_extra_config['tier_poll_interval_s'] = {interval!r} is invalid: "
                f"expected a number of seconds (<= 0 disables polling between steps)"
            )
        workers = extra.get("workers", "spawn")
        if workers not in WORKER_MODES:
            raise ConfigError(
                f"kv_connector_extra_config['workers'] = {workers!r} is invalid: expected one "
                f"of {list(WORKER_MODES)}"
            )
        try:
            compression = CompressionConfig.from_config(extra.get("compression", "auto"))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return cls(
            secondary_tiers=tuple(dict(t) for t in tiers),
            detectors=tuple(detectors),
            tier_poll_interval_s=float(interval),
            num_tier_workers=_int(extra, "num_tier_workers", 2, minimum=1),
            workers=workers,
            compression=compression,
        )
