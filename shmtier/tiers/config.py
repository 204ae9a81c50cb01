"""A secondary tier's options as a frozen, validated config (any process).

Who calls: ``shmtier.config.TieringConfig`` when the spec is built (every process
role of an engine builds one: scheduler, GPU workers), and the tier factory when a
tier is built from a dict directly (vLLM's ``create_secondary_tier`` style). Never
blocks beyond the few system calls of a filesystem check.

A built-in tier declares its options as fields of a frozen dataclass subclass, in the
option style of ``shmtier.options``::

    @dataclass(frozen=True)
    class FsTierConfig(TierConfig):
        root_dir: str = option(REQUIRED, writable_dir(), doc="...")
        fsync: bool = option(False, boolean(), doc="...")

``from_options`` checks every key (unknown keys, missing required ones, each value,
then ``check_together`` for rules across keys), so every invalid value fails with
the key, the value and what is accepted before any process or file is made. The
scheduler half receives the config object (``constructor_kwargs``); the tier
workers receive the same frozen config (``to_dict`` into the segment's pool config,
``from_dict`` there: ``shmtier/shared/pool_config.py``), and their backends are built
from it, so no option is parsed twice, defaulted twice or lost on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shmtier.options import REQUIRED, Options, option, require_string_keys

__all__ = ["REQUIRED", "PassThroughTierConfig", "TierConfig", "TierContext", "option"]


@dataclass(frozen=True)
class TierContext:
    """What an engine's tier options are checked against, known when the spec is built
    (None where a tier is built without a spec)."""

    chunk_bytes: int | None = None  # KV bytes of one chunk (one primary row's payload)
    key_bytes: int | None = None  # bytes of an offload key
    data_parallel_index: int = 0  # the engine's data-parallel rank (p2p: port = port + it)
    engine_id: str | None = None  # the engine's id (node: its default pool name)


@dataclass(frozen=True)
class TierConfig(Options):
    """Base of a tier type's validated options. Subclasses add ``option`` fields."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str,
                     context: TierContext = TierContext()) -> "TierConfig":
        """Check ``options`` (the tier dict without ``type``, ``module_path`` and
        ``backpressure``); ``where`` names the tier in errors (``secondary_tiers[0]``)."""
        config = cls.from_mapping(options, where=where)
        config.check_together(where, context)
        return config

    def check_together(self, where: str, context: TierContext) -> None:
        """Rules across options, or against the engine (``context``); raise ConfigError."""

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments the tier's scheduler half is built with."""
        return {"config": self}


@dataclass(frozen=True)
class PassThroughTierConfig(TierConfig):
    """Options of a tier without a config class (out of tree, or registered with
    vLLM's ``register_tier``): given to its constructor unchanged, as vLLM does, and
    checked there (the spec builds such a tier only in the scheduler)."""

    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str,
                     context: TierContext = TierContext()) -> "PassThroughTierConfig":
        require_string_keys(options, where)  # they become keyword arguments
        return cls(dict(options))

    def constructor_kwargs(self) -> dict[str, Any]:
        return dict(self.options)
