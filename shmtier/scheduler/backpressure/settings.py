"""Backpressure settings: one tier's ``backpressure`` configuration, validated, as plain data.

Who calls: :meth:`BackpressureSettings.from_config`, wherever ``kv_connector_extra_config``
is parsed (``shmtier.config``: API server, scheduler and GPU worker processes alike), once
per secondary tier at startup. Only the scheduler process turns the result into a detector
(:func:`shmtier.scheduler.backpressure.build_detector`).

May it block: no. It does no I/O and builds no detector or policy. The one exception is a
dotted ``backpressure_cls`` / ``policy_cls`` path, whose module is imported to check that
the class exists and to read its constructor's signature (validation). The built-in
classes are known by name (:mod:`.validation`), so the default configuration imports
neither torch, vLLM, ``shmtier.config`` nor the detector and policy modules.

What a :class:`BackpressureSettings` stores is plain data: a class as its import path (a
short name is stored as the built-in class's full path), or as the class object itself
where the configuration gave a class rather than a name; numbers; and keyword arguments
as sorted tuples of ``(key, value)`` pairs.

Configuration keys (one ``backpressure`` mapping at the top level of
``kv_connector_extra_config`` applies to every tier; a tier's own ``backpressure``
mapping overrides it field by field; a tier-level ``false`` opts the tier out, ``{}``
gives the defaults): declared, with their defaults and checks, by
:class:`~.validation.BackpressureOptions` (and ``ThrottledDropOptions`` for
``policy_kwargs``); docs/configuration.md lists them. A short name (no dot) for
``backpressure_cls`` / ``policy_cls`` is a built-in class; ``"pkg.mod.Class"`` imports
``pkg.mod`` and takes ``Class``; a class object is taken as is.

Per-tier defaults (set only where the key is absent, so user keys win): ``obj`` tiers
and any tier with ``locality: "REMOTE"`` get ``high_water_s=0.050`` and
``low_water_s=0.010``; every other tier gets ``0.010`` / ``0.002``; ``fs`` and ``obj``
also get ``failure_threshold=3``. Keys of a custom ``backpressure_cls`` other than the
ones above are checked against its constructor's signature and kept in ``extra_kwargs``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shmtier.scheduler.backpressure.validation import (
    DEFAULT_DETECTOR_CLS,
    DETECTOR_CLASSES,
    EMA_DEFAULTS,
    EMA_FIELDS,
    POLICY_CLASSES,
    BackpressureConfigError,
    BackpressureOptions,
    ClassRef,
    builder_arguments,
    check_field,
    check_water_marks,
    unknown_key,
)

__all__ = ["BackpressureSettings", "BackpressureConfigError", "merge_backpressure_config",
           "DETECTOR_CLASSES", "POLICY_CLASSES", "DEFAULT_DETECTOR_CLS", "RESERVED_KEYS"]

#: Keys consumed by the settings themselves; the rest go to the detector's constructor.
RESERVED_KEYS = ("backpressure_cls", "policy_cls", "policy_kwargs")


def merge_backpressure_config(
    top_level: Mapping[str, Any] | None, tier_level: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """Field-by-field merge (tier wins); None when neither mapping is given.

    Returns the merged mapping and, per key, ``"tier"`` or ``"top"`` for where it
    came from. No defaults are applied and nothing is validated here.
    """
    if top_level is None and tier_level is None:
        return None
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, layer in (("top", top_level), ("tier", tier_level)):
        for key, value in (layer or {}).items():
            merged[key] = value
            source[key] = name
    return merged, source


def _check_layers(layers: tuple[tuple[str, Any], ...]) -> None:
    for name, layer in layers:
        if layer is not None and not isinstance(layer, Mapping):
            raise BackpressureConfigError(
                f"{name} = {layer!r} is invalid: expected a mapping of backpressure "
                f"settings (or false to disable)"
            )
        for key in layer or {}:
            if not isinstance(key, str):
                raise BackpressureConfigError(
                    f"{name} has a key {key!r} that is not a string; accepted keys are "
                    f"names such as {list(RESERVED_KEYS) + list(EMA_FIELDS)}"
                )


def _policy_settings(policy_cls: Any, policy_kwargs: Any, name_of: Callable[..., str],
                     ) -> tuple[ClassRef | None, dict[str, Any]]:
    policy_kwargs = BackpressureOptions.check_value("policy_kwargs", policy_kwargs,
                                                    name_of("policy_kwargs"))
    if policy_cls is None:
        if not policy_kwargs:
            return None, {}  # the detector's own default policy
        policy_cls = "ThrottledDropPolicy"
    policy = BackpressureOptions.check_value("policy_cls", policy_cls, name_of("policy_cls"))
    signature = policy.signature()
    if signature.names is not None and not signature.takes_any:
        for key, value in policy_kwargs.items():
            if not isinstance(key, str) or key not in signature.names:
                raise unknown_key(name_of("policy_kwargs", str(key)), value, key,
                                  policy.display, sorted(signature.names))
    if policy.is_throttled and "ramp_factor" in policy_kwargs:
        policy_kwargs["ramp_factor"] = check_field(
            "ramp_factor", policy_kwargs["ramp_factor"], name_of("policy_kwargs", "ramp_factor"))
    return policy, policy_kwargs


@dataclass(frozen=True)
class BackpressureSettings:
    """One tier's validated backpressure settings (plain data; see the module docstring).

    ``detector_cls`` / ``policy_cls``: an import path, or the class object the
    configuration gave; ``policy_cls`` None means the detector's default policy.
    The seven numeric fields are the EMA detector's constructor arguments, every one
    set (user value, else the tier-type/locality default, else the constructor's
    default); they are all None for a detector class that does not take them, whose
    keys are then all in ``extra_kwargs``, as are a custom detector's own keys.
    """

    detector_cls: str | type = DETECTOR_CLASSES[DEFAULT_DETECTOR_CLS]
    policy_cls: str | type | None = None
    policy_kwargs: tuple[tuple[str, Any], ...] = ()
    high_water_s: float | None = None
    low_water_s: float | None = None
    alpha: float | None = None
    warmup_completions: int | None = None
    decay_half_life_s: float | None = None
    cooldown_s: float | None = None
    failure_threshold: int | None = None
    extra_kwargs: tuple[tuple[str, Any], ...] = ()

    def detector_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the detector's constructor, less ``policy`` and ``clock``."""
        kwargs = dict(self.extra_kwargs)
        if self.high_water_s is not None:
            kwargs.update((key, getattr(self, key)) for key in EMA_FIELDS)
        return kwargs

    @classmethod
    def from_config(
        cls,
        tier_type: str,
        locality: str | None,
        top: Mapping[str, Any] | None | bool,
        tier: Mapping[str, Any] | None | bool,
        *,
        where: str = "backpressure",
        top_level_where: str = "backpressure",
    ) -> BackpressureSettings | None:
        """The settings for one secondary tier, or None when it has no backpressure.

        ``top``: ``kv_connector_extra_config.get("backpressure")``; ``tier``: the tier's
        ``.get("backpressure")``. ``where`` names the tier's mapping in error messages
        (e.g. ``"secondary_tiers[1].backpressure"``), ``top_level_where`` the top-level
        one; a key inherited from the top level is reported under that name. None when
        neither mapping is given or the tier says ``false``. Every invalid value raises
        :class:`BackpressureConfigError` (a ``ValueError``). Inputs are not modified.
        """
        if top is False:
            top = None
        if tier is False:
            return None
        _check_layers(((top_level_where, top), (where, tier)))
        merged_and_source = merge_backpressure_config(top, tier)
        if merged_and_source is None:
            return None
        if locality is not None and (not isinstance(locality, str)
                                     or locality.upper() not in ("LOCAL", "REMOTE")):
            raise BackpressureConfigError(
                f"{where}: the tier's locality = {locality!r} is invalid: expected "
                f"'LOCAL' or 'REMOTE' (any case) or no locality"
            )
        config, source = merged_and_source

        def name_of(key: str, subkey: str = "") -> str:
            full = f"{key}.{subkey}" if subkey else key
            if source.get(key) == "top":
                return f"{top_level_where}.{full} (inherited by {where})"
            if source.get(key) == "default":
                return f"{where}.{full} (default for tier type {tier_type!r})"
            return f"{where}.{full}"

        detector = BackpressureOptions.check_value(
            "backpressure_cls", config.pop("backpressure_cls", DEFAULT_DETECTOR_CLS),
            name_of("backpressure_cls"))
        policy_key = "policy_cls" if "policy_cls" in config else "policy_kwargs"
        policy, policy_kwargs = _policy_settings(config.pop("policy_cls", None),
                                                 config.pop("policy_kwargs", None), name_of)
        is_ema = detector.is_ema
        if policy is not None and policy.is_throttled and detector.is_detector and not is_ema:
            raise BackpressureConfigError(
                f"{name_of(policy_key)}: ThrottledDropPolicy needs backpressure_cls "
                f"EMABackpressureDetector (or a subclass), not {detector.display}; "
                f"use policy_cls 'DropStorePolicy' or a policy of your own"
            )
        default_config = detector.default_config()
        defaults = default_config(tier_type, locality=locality) if default_config else None
        for key, value in (defaults or {}).items():
            if key not in config:
                config[key] = value
                source[key] = "default"

        signature = detector.signature()
        supplied = builder_arguments(signature, detector.is_detector)
        accepted = sorted((signature.names or set()) - {"policy", "clock"} | set(RESERVED_KEYS))
        if signature.names is not None:
            for key, value in config.items():
                if key in ("policy", "clock") or not signature.takes(key):
                    raise unknown_key(name_of(key), value, key, detector.display, accepted)
            if policy is not None and "policy" not in supplied:
                raise BackpressureConfigError(
                    f"{name_of('policy_cls')} = {policy.display!r} is invalid: "
                    f"{detector.display} takes no policy argument"
                )
        if is_ema:
            for key, value in config.items():
                if key in EMA_FIELDS:
                    config[key] = check_field(key, value, name_of(key))
            if "high_water_s" in config and "low_water_s" in config:
                check_water_marks(config["high_water_s"], config["low_water_s"],
                                  name_of("high_water_s"), name_of("low_water_s"))
        missing = [n for n in signature.required if n not in config and n not in supplied]
        if missing:
            raise BackpressureConfigError(
                f"{where}: {detector.display} needs {', '.join(repr(m) for m in missing)}; "
                f"accepted keys: {accepted}"
            )
        fields: dict[str, Any] = {}
        if (is_ema and all(signature.takes(key) for key in EMA_FIELDS)
                and {"high_water_s", "low_water_s"} <= config.keys()):
            for key in EMA_FIELDS:
                fields[key] = (config.pop(key) if key in config
                               else signature.defaults.get(key, EMA_DEFAULTS[key]))
        return cls(
            detector_cls=detector.ref,
            policy_cls=policy.ref if policy is not None else None,
            policy_kwargs=tuple(sorted(policy_kwargs.items())),
            extra_kwargs=tuple(sorted(config.items())),
            **fields,
        )
