"""Checks shared by backpressure settings and the classes they describe.

Who calls: :mod:`.settings` at configuration time (any process that parses
``kv_connector_extra_config``), and the constructors of :mod:`.detector` / :mod:`.policy`
and :func:`shmtier.scheduler.backpressure.build_detector` in the scheduler process, so a
value is judged by one piece of code wherever it arrives. May it block: no; resolving a
dotted class path imports that module, nothing else does I/O. Imports nothing of shmtier
beyond the standard library and ``shmtier.options`` (the keys are declared in its option
style: ``BackpressureOptions``, ``ThrottledDropOptions``; and, when asked for a tier type's
defaults, the tier registry, which says how a type's stores behave): the built-in classes
are described here by import path, constructor signature and base classes (tests check
these against the real classes).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from shmtier.options import ConfigError, KeyedCheck, Options, integer, number, option


class BackpressureConfigError(ConfigError):
    """An invalid backpressure setting; the message names the key, the value and what is
    accepted."""


_PACKAGE = "shmtier.scheduler.backpressure"
_DETECTOR_BASE = f"{_PACKAGE}.detector.BackpressureDetector"
_EMA = f"{_PACKAGE}.detector.EMABackpressureDetector"
_POLICY_BASE = f"{_PACKAGE}.policy.BackpressurePolicy"
_THROTTLED = f"{_PACKAGE}.policy.ThrottledDropPolicy"
_DROP_STORE = f"{_PACKAGE}.policy.DropStorePolicy"

#: Short names (no dot) accepted for ``backpressure_cls`` / ``policy_cls``: their import paths.
DETECTOR_CLASSES: dict[str, str] = {"EMABackpressureDetector": _EMA}
POLICY_CLASSES: dict[str, str] = {"DropStorePolicy": _DROP_STORE,
                                  "ThrottledDropPolicy": _THROTTLED}
DEFAULT_DETECTOR_CLS = "EMABackpressureDetector"

_DETECTOR_METHODS = ("should_store", "update", "on_store_failed", "is_under_pressure", "reset")
_POLICY_METHODS = ("should_store", "on_store_skipped", "pop_stores_dropped", "reset")

# --- the EMA detector's defaults (EMABackpressureDetector reads them from here) ---------

DEFAULT_ALPHA = 0.15
DEFAULT_WARMUP_COMPLETIONS = 10
DEFAULT_DECAY_HALF_LIFE_S = 2.0
DEFAULT_COOLDOWN_S = 1.0
DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_RAMP_FACTOR = 2.0
LOCAL_HIGH_WATER_S = 0.010
LOCAL_LOW_WATER_S = 0.002
NETWORK_HIGH_WATER_S = 0.050
NETWORK_LOW_WATER_S = 0.010

#: The EMA detector's numeric constructor parameters, in order.
EMA_FIELDS = ("high_water_s", "low_water_s", "alpha", "warmup_completions",
              "decay_half_life_s", "cooldown_s", "failure_threshold")


def _water(local: float, network: float) -> str:
    """A water mark's default in words (it depends on the tier: ``ema_default_config``)."""
    return f"{local:.3f} s/MiB ({network:.3f} for an obj or REMOTE tier)"


def _policy_kwargs(key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BackpressureConfigError(
            f"{key} = {value!r} is invalid: expected a mapping of keyword arguments for the "
            f"policy, e.g. {{'ramp_factor': 3.0}}")
    return dict(value)


@dataclass(frozen=True, kw_only=True)
class BackpressureOptions(Options):
    """The keys of a ``backpressure`` mapping: the classes, and the EMA detector's
    settings (its constructor's arguments: a custom detector class takes its own keys,
    checked against its constructor's signature by :mod:`.settings`)."""

    backpressure_cls: Any = option(
        DEFAULT_DETECTOR_CLS,
        KeyedCheck(lambda: _CLASS_ACCEPTED.format(sorted(DETECTOR_CLASSES), "detector"),
                   lambda key, v: resolve_detector(v, key)),
        doc="the detector class: a built-in name, \"pkg.mod.Class\" (pkg.mod imported), or "
            "the class itself")
    policy_cls: Any = option(
        None, KeyedCheck(lambda: _CLASS_ACCEPTED.format(sorted(POLICY_CLASSES), "policy"),
                         lambda key, v: resolve_policy(v, key)),
        doc="the policy class, looked up the same way", default_doc="the detector's own "
                                                                    "(ThrottledDropPolicy)")
    policy_kwargs: Any = option(
        None, KeyedCheck("a mapping of keyword arguments for the policy, e.g. "
                         "{'ramp_factor': 3.0}", _policy_kwargs),
        doc="the policy's constructor arguments, replaced whole by a tier's (not merged key "
            "by key); without policy_cls they configure ThrottledDropPolicy",
        default_doc="`{}`")
    high_water_s: float | None = option(
        None, number(0, min_open=True, finite=True),
        doc="an EMA of store latency per MiB above it puts the tier under pressure",
        default_doc=_water(LOCAL_HIGH_WATER_S, NETWORK_HIGH_WATER_S))
    low_water_s: float | None = option(
        None, number(0, min_open=True, finite=True),
        doc="an EMA below it clears pressure (<= high_water_s)", default_doc=_water(LOCAL_LOW_WATER_S, NETWORK_LOW_WATER_S))
    alpha: float = option(
        DEFAULT_ALPHA, number(0, 1, min_open=True, accepted="a number in (0, 1]"),
        doc="the EMA's smoothing factor")
    warmup_completions: int = option(
        DEFAULT_WARMUP_COMPLETIONS, integer(0), doc="completions averaged to seed the EMA")
    decay_half_life_s: float = option(
        DEFAULT_DECAY_HALF_LIFE_S, number(0, finite=True),
        doc="while under pressure, the EMA decays with this half-life when no stores "
            "complete (0: never, so pressure that stops all stores may never clear)")
    cooldown_s: float = option(
        DEFAULT_COOLDOWN_S, number(0, finite=True),
        doc="after pressure clears, every second store is dropped for this long")
    failure_threshold: int | None = option(
        None, integer(1).or_none("null to ignore failures"),
        doc="consecutive failed stores that put the tier under pressure",
        default_doc=f"{DEFAULT_FAILURE_THRESHOLD} for a storage tier (fs, obj), else null")


@dataclass(frozen=True, kw_only=True)
class ThrottledDropOptions(Options):
    """``policy_kwargs`` of ``ThrottledDropPolicy``."""

    ramp_factor: float = option(
        DEFAULT_RAMP_FACTOR, number(0, min_open=True, finite=True),
        doc="how steeply the share of dropped stores rises with the EMA above high water")


EMA_DEFAULTS: dict[str, Any] = {key: BackpressureOptions.default(key) for key in EMA_FIELDS[2:]}


def ema_default_config(tier_type: str, locality: str | None = None) -> dict[str, Any]:
    """The EMA detector's per-tier defaults: the network water marks for a ``REMOTE``
    locality or a tier type whose registry entry says its stores cross a network, else
    the local ones; a ``failure_threshold`` when the type counts failed stores as
    pressure (its ``BackpressureProfile`` in ``shmtier/tiers/registry.py``)."""
    from shmtier.tiers.registry import backpressure_profile

    profile = backpressure_profile(tier_type)
    remote = isinstance(locality, str) and locality.upper() == "REMOTE"
    if remote or profile.network:
        config: dict[str, Any] = {"high_water_s": NETWORK_HIGH_WATER_S,
                                  "low_water_s": NETWORK_LOW_WATER_S}
    else:
        config = {"high_water_s": LOCAL_HIGH_WATER_S, "low_water_s": LOCAL_LOW_WATER_S}
    if profile.failures_are_pressure:
        config["failure_threshold"] = DEFAULT_FAILURE_THRESHOLD
    return config


def check_field(key: str, value: Any, name: str | None = None) -> Any:
    """``value`` for the numeric setting ``key`` (an EMA field or ``ramp_factor``; an
    integral float becomes an int for the integer settings), checked by its declaration,
    or :class:`BackpressureConfigError` naming ``name`` (default ``key``)."""
    options = ThrottledDropOptions if key == "ramp_factor" else BackpressureOptions
    try:
        return options.check_value(key, value, name or key)
    except BackpressureConfigError:
        raise
    except ConfigError as e:
        raise BackpressureConfigError(*e.args) from None


def check_water_marks(high: Any, low: Any, high_name: str = "high_water_s",
                      low_name: str = "low_water_s") -> None:
    if low > high:
        raise BackpressureConfigError(
            f"{low_name} = {low!r} is invalid: must be <= {high_name} = {high!r} (low water "
            f"clears pressure, high water sets it)"
        )


class ConstructorSignature(NamedTuple):
    """What a constructor accepts by keyword. ``names`` None: it cannot be inspected."""

    names: frozenset[str] | None
    required: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = {}
    takes_any: bool = False  # **kwargs

    def takes(self, key: str) -> bool:
        return self.names is None or self.takes_any or key in self.names


def constructor_signature(cls: type) -> ConstructorSignature:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return ConstructorSignature(None)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ConstructorSignature(
        frozenset(p.name for p in named),
        tuple(p.name for p in named if p.default is p.empty),
        {p.name: p.default for p in named if p.default is not p.empty},
        any(p.kind is p.VAR_KEYWORD for p in params))


def builder_arguments(signature: ConstructorSignature, is_detector: bool) -> tuple[str, ...]:
    """The constructor arguments :func:`build_detector` supplies itself (not settings)."""
    return tuple(arg for arg, applies in (("policy", True), ("clock", is_detector))
                 if applies and signature.takes(arg))


# The built-in classes, described without importing them (tests check these against them).
BUILTIN_SIGNATURES: dict[str, ConstructorSignature] = {
    _EMA: ConstructorSignature(frozenset(EMA_FIELDS) | {"policy", "clock"},
                               ("high_water_s", "low_water_s"),
                               {**EMA_DEFAULTS, "policy": None, "clock": None}),
    _THROTTLED: ConstructorSignature(frozenset({"ramp_factor"}), (),
                                     {"ramp_factor": DEFAULT_RAMP_FACTOR}),
    _DROP_STORE: ConstructorSignature(frozenset()),
}
BUILTIN_BASES: dict[str, frozenset[str]] = {
    _EMA: frozenset({_EMA, _DETECTOR_BASE}),
    _THROTTLED: frozenset({_THROTTLED, _POLICY_BASE}),
    _DROP_STORE: frozenset({_DROP_STORE, _POLICY_BASE}),
}


def _loaded_class(path: str) -> type | None:
    """The class at ``path`` if its module is already imported (no import here)."""
    module, _, name = path.rpartition(".")
    return getattr(sys.modules.get(module), name, None)


class ClassRef(NamedTuple):
    """A configured class: what settings store, and what validation needs to know."""

    ref: str | type  # what settings store
    cls: type | None  # None: a built-in named by its short name, not imported
    display: str

    def is_a(self, base: str) -> bool:
        if self.cls is None:
            return base in BUILTIN_BASES[self.ref]
        base_cls = _loaded_class(base)  # a subclass implies its base's module is loaded
        return base_cls is not None and issubclass(self.cls, base_cls)

    @property
    def is_detector(self) -> bool:
        return self.is_a(_DETECTOR_BASE)

    @property
    def is_ema(self) -> bool:
        return self.is_a(_EMA)

    @property
    def is_throttled(self) -> bool:
        return self.is_a(_THROTTLED)

    def signature(self) -> ConstructorSignature:
        return BUILTIN_SIGNATURES[self.ref] if self.cls is None else constructor_signature(self.cls)

    def default_config(self) -> Any:
        """The detector class's ``default_config`` classmethod, or None."""
        if self.cls is None:
            return ema_default_config
        return getattr(self.cls, "default_config", None)


def class_name(cls: type) -> str:
    """A class as error messages name it: built-in classes by their short name."""
    module = getattr(cls, "__module__", "")
    builtin = module == _PACKAGE or module.startswith(_PACKAGE + ".")
    return cls.__name__ if builtin else f"{module}.{cls.__qualname__}"


def resolve_detector(value: Any, name: str) -> ClassRef:
    """The class a ``backpressure_cls`` value names; ``name`` names it in errors."""
    return _resolve_class(value, DETECTOR_CLASSES, _DETECTOR_BASE, _DETECTOR_METHODS, name,
                          "detector")


def resolve_policy(value: Any, name: str) -> ClassRef:
    """The class a ``policy_cls`` value names; ``name`` names it in errors."""
    return _resolve_class(value, POLICY_CLASSES, _POLICY_BASE, _POLICY_METHODS, name, "policy")


_CLASS_ACCEPTED = "one of {}, a dotted 'module.Class' path to a {} class, or the class itself"


def _resolve_class(value: Any, short_names: dict[str, str], base: str,
                   methods: tuple[str, ...], name: str, what: str) -> ClassRef:
    accepted = _CLASS_ACCEPTED.format(sorted(short_names), what)
    if isinstance(value, str) and value and "." not in value:
        if value in short_names:
            return ClassRef(short_names[value], None, value)
        close = difflib.get_close_matches(value, short_names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise BackpressureConfigError(f"{name} = {value!r} is invalid{hint}: expected {accepted}")
    if isinstance(value, type):
        cls = value
    elif isinstance(value, str) and value:
        module_path, _, attr = value.rpartition(".")
        try:
            module = importlib.import_module(module_path)
        except Exception as e:  # noqa: BLE001 - any import failure is a config error
            raise BackpressureConfigError(
                f"{name} = {value!r} is invalid: module {module_path!r} cannot be imported "
                f"({type(e).__name__}: {e}); expected {accepted}"
            ) from e
        cls = getattr(module, attr, None)
        if cls is None:
            raise BackpressureConfigError(
                f"{name} = {value!r} is invalid: module {module_path!r} has no attribute "
                f"{attr!r}; expected {accepted}"
            )
    else:
        raise BackpressureConfigError(f"{name} = {value!r} is invalid: expected {accepted}")
    found = ClassRef(value, cls, class_name(cls) if isinstance(cls, type) else repr(cls))
    if not isinstance(cls, type) or not (
            found.is_a(base) or all(callable(getattr(cls, m, None)) for m in methods)):
        raise BackpressureConfigError(
            f"{name} = {value!r} is invalid: {cls!r} is not a {what} class (a subclass of "
            f"{base.rpartition('.')[2]} or a class with {', '.join(methods)}); expected {accepted}"
        )
    if inspect.isabstract(cls):
        raise BackpressureConfigError(
            f"{name} = {value!r} is invalid: {cls.__name__} is abstract; expected {accepted}")
    return found


def unknown_key(name: str, value: Any, key: Any, owner: str,
                accepted: list[str]) -> BackpressureConfigError:
    close = difflib.get_close_matches(key, accepted, n=1) if isinstance(key, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return BackpressureConfigError(
        f"{name} = {value!r} is invalid: unknown key for {owner}{hint}; accepted keys: {accepted}")
