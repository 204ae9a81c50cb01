"""A secondary tier's options as a frozen, validated config (any process).

Who calls: ``shmtier.config.TieringConfig`` when the spec is built (every process
role of an engine builds one: scheduler, GPU workers), and the tier factory when a
tier is built from a dict directly (vLLM's ``create_secondary_tier`` style). Never
blocks beyond the few system calls of a filesystem check.

A built-in tier declares its options as fields of a frozen dataclass subclass::

    @dataclass(frozen=True)
    class FsTierConfig(TierConfig):
        root_dir: str = option(REQUIRED, writable_dir(), worker=True)
        fsync: bool = option(False, boolean(), worker=True)

``from_options`` checks every key (unknown keys, missing required ones, each value,
then ``check_together`` for rules across keys), so every invalid value fails with
the key, the value and what is accepted before any process or file is made. The
scheduler half receives the config object (``constructor_kwargs``); the tier
workers receive ``worker_args()`` (the fields marked ``worker=True``, plain data
published in the segment), so no option is parsed twice or lost on the way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from shmtier.options import Check, ConfigError, reject_unknown, require_string_keys

#: The default of an option that must be given.
REQUIRED: Any = MISSING


def option(default: Any, check: Check, *, worker: bool = False) -> Any:
    """A tier option: its default (or ``REQUIRED``), its check, and whether the tier
    workers need it (then it is part of ``worker_args``)."""
    return field(default=default, metadata={"check": check, "worker": worker})


@dataclass(frozen=True)
class TierContext:
    """What an engine's tier options are checked against, known when the spec is built
    (None where a tier is built without a spec)."""

    chunk_bytes: int | None = None  # KV bytes of one chunk (one primary row's payload)
    key_bytes: int | None = None  # bytes of an offload key
    data_parallel_index: int = 0  # the engine's data-parallel rank (p2p: port = port + it)


@dataclass(frozen=True)
class TierConfig:
    """Base of a tier type's validated options. Subclasses add ``option`` fields."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, where: str,
                     context: TierContext = TierContext()) -> "TierConfig":
        """Check ``options`` (the tier dict without ``type``, ``module_path`` and
        ``backpressure``); ``where`` names the tier in errors (``secondary_tiers[0]``)."""
        declared = fields(cls)
        reject_unknown(options, [f.name for f in declared], where)
        values = {}
        for f in declared:
            check = f.metadata["check"]
            key = f"{where}.{f.name}"
            if f.name in options:
                values[f.name] = check(key, options[f.name])
            elif f.default is MISSING:
                raise ConfigError(f"{key} is required ({check.accepted})")
        config = cls(**values)
        config.check_together(where, context)
        return config

    def check_together(self, where: str, context: TierContext) -> None:
        """Rules across options, or against the engine (``context``); raise ConfigError."""

    def constructor_kwargs(self) -> dict[str, Any]:
        """Keyword arguments the tier's scheduler half is built with."""
        return {"config": self}

    def worker_args(self) -> dict[str, Any]:
        """What the tier workers need (msgpack-able): the ``worker=True`` options."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["worker"]}


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

    def worker_args(self) -> dict[str, Any]:
        return {}
