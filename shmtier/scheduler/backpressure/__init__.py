"""Backpressure for cascades to secondary tiers (docs/vllm-contract.md §8, docs/design.md §4, §6, §8).

A *detector* watches one secondary tier: it is fed the outcome of every cascade (store)
job sent to that tier and decides whether the tier is *under pressure*. A *policy* turns
the detector's state into a yes/no for the next cascade and counts what it drops. The
manager asks ``detector.should_store(num_blocks)`` once per cascade job and tier; a "no"
drops the whole job for that tier (the primary copy stays). Promotions and
ParentManager store jobs never consult it.

Data flow::

    kv_connector_extra_config ──▶ BackpressureSettings.from_config   (settings.py)
      (any process that parses       validates and merges; frozen plain data,
       the configuration)            builds nothing, imports no detector
                                            │
    scheduler process only ──────▶ build_detector(settings, clock=None)   (here)
                                     imports detector.py / policy.py, builds both
                                            │
    scheduler thread, per cascade ─▶ detector.update / should_store / ...  (detector.py,
                                     per step: record_backpressure_metrics  policy.py,
                                                                           metrics.py)

Nothing here blocks. Importing this package imports only :mod:`.settings` and
:mod:`.validation`; the detector, policy and metrics names below are loaded on first use,
so configuration parsing stays light (``from shmtier.scheduler.backpressure import
EMABackpressureDetector`` still works).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shmtier.scheduler.backpressure.settings import (
    DEFAULT_DETECTOR_CLS,
    DETECTOR_CLASSES,
    POLICY_CLASSES,
    RESERVED_KEYS,
    BackpressureConfigError,
    BackpressureSettings,
    merge_backpressure_config,
)
from shmtier.scheduler.backpressure.validation import (
    builder_arguments,
    class_name,
    constructor_signature,
)

if TYPE_CHECKING:
    from shmtier.scheduler.backpressure.detector import (
        BackpressureDetector,
        Clock,
        EMABackpressureDetector,
    )
    from shmtier.scheduler.backpressure.metrics import (
        BACKPRESSURE_BLOCKS_DROPPED,
        BACKPRESSURE_STORE_LATENCY_EMA,
        BACKPRESSURE_STORES_DROPPED,
        TIER_LABEL,
        backpressure_metric_definitions,
        record_backpressure_metrics,
    )
    from shmtier.scheduler.backpressure.policy import (
        BackpressurePolicy,
        DropAccountingPolicy,
        DropStorePolicy,
        ThrottledDropPolicy,
    )

_LAZY = {
    "detector": ("BackpressureDetector", "EMABackpressureDetector", "Clock"),
    "policy": ("BackpressurePolicy", "DropAccountingPolicy", "DropStorePolicy",
               "ThrottledDropPolicy"),
    "metrics": ("backpressure_metric_definitions", "record_backpressure_metrics",
                "BACKPRESSURE_STORE_LATENCY_EMA", "BACKPRESSURE_STORES_DROPPED",
                "BACKPRESSURE_BLOCKS_DROPPED", "TIER_LABEL"),
}
_LAZY_MODULE = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "BackpressureSettings", "BackpressureConfigError", "build_detector",
    "build_detector_from_config", "merge_backpressure_config", "DETECTOR_CLASSES",
    "POLICY_CLASSES", "DEFAULT_DETECTOR_CLS", "RESERVED_KEYS", *_LAZY_MODULE,
]


def __getattr__(name: str) -> Any:
    module = _LAZY_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULE))


def _load_class(ref: str | type) -> type:
    if isinstance(ref, type):
        return ref
    module, _, name = ref.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_detector(settings: BackpressureSettings, *,
                   clock: Clock | None = None) -> BackpressureDetector:
    """The detector (and its policy) for one tier's settings. Scheduler process only.

    ``clock``: passed to the detector when given (tests); otherwise the detector reads
    ``time.monotonic()`` at each call. A custom class whose constructor rejects its
    settings raises :class:`BackpressureConfigError` (the built-in classes cannot: the
    settings were checked against their rules).
    """
    from shmtier.scheduler.backpressure.detector import BackpressureDetector

    detector_cls = _load_class(settings.detector_cls)
    policy = None
    if settings.policy_cls is not None:
        policy_cls = _load_class(settings.policy_cls)
        policy_kwargs = dict(settings.policy_kwargs)
        try:
            policy = policy_cls(**policy_kwargs)
        except (TypeError, ValueError) as e:
            raise BackpressureConfigError(
                f"policy_kwargs = {policy_kwargs!r} is invalid for {class_name(policy_cls)}: {e}"
            ) from e
    signature = constructor_signature(detector_cls)
    kwargs = settings.detector_kwargs()
    for arg in builder_arguments(signature, issubclass(detector_cls, BackpressureDetector)):
        if arg == "policy":
            kwargs["policy"] = policy
        elif clock is not None or arg in signature.required:
            kwargs["clock"] = clock
    try:
        return detector_cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise BackpressureConfigError(
            f"{class_name(detector_cls)} rejected its settings "
            f"{dict(sorted(settings.detector_kwargs().items()))!r}: {e}"
        ) from e


def build_detector_from_config(tier_type: str, locality: str | None, top: Any, tier: Any, *,
                               where: str = "backpressure",
                               top_level_where: str = "backpressure",
                               clock: Clock | None = None) -> BackpressureDetector | None:
    """:meth:`BackpressureSettings.from_config`, then :func:`build_detector`; None where
    the settings are None. Errors name ``where``."""
    settings = BackpressureSettings.from_config(tier_type, locality, top, tier, where=where,
                                                top_level_where=top_level_where)
    if settings is None:
        return None
    try:
        return build_detector(settings, clock=clock)
    except BackpressureConfigError as e:
        raise BackpressureConfigError(f"{where}: {e}") from e
