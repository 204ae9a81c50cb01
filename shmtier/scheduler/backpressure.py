"""Backpressure for cascades to secondary tiers (contract §8, DESIGN §4, §6, §8).

Runs in the scheduler process. Nothing here blocks, sleeps, logs or does I/O:
every method is a few float operations, cheap enough to call per cascade job.

A *detector* watches one secondary tier: it is fed the outcome of every cascade
(store) job sent to that tier and decides whether the tier is *under pressure*.
A *policy* turns the detector's state into a yes/no for the next cascade and
counts what it drops. The manager asks ``detector.should_store(num_blocks)``
once per cascade job and tier; a "no" drops the whole job for that tier (the
primary copy stays). Promotions and ParentManager store jobs never consult it.

Behaviour matches vLLM 0.33's ``EMABackpressureDetector``, ``DropStorePolicy``
and ``ThrottledDropPolicy`` decision for decision (``tests/test_backpressure.py``
runs both side by side). Differences, all additive:

* **Injectable clock.** Detectors take ``clock=time.monotonic``; the clock is the
  only time source (``update`` subtracts the job's ``submit_time`` from it, so
  submit times must come from the same clock). A negative elapsed time (a
  ``submit_time`` from the future) counts as 0 instead of pulling the EMA below
  zero, and ``on_store_completed`` ignores ``nbytes <= 0`` instead of dividing
  by zero.
* **Full job ring.** shmtier's producers never block: when a cascade finds its
  worker's job ring full, the scheduler calls ``detector.note_ring_full()``.
  That arms a one-shot signal: the *next* ``should_store`` answers ``False`` and
  counts the drop exactly like any other (``stores_dropped += 1``,
  ``blocks_dropped += num_blocks``), even on the healthy fast path. Several
  notes before one decision still drop one decision. The signal leaves the
  latency state (EMA, pressure flag, cooldown, healthy streak) untouched, so
  ``is_under_pressure()`` keeps describing the tier's latency health. Pass
  ``note_ring_full(dropped_blocks=n)`` when the job that found the ring full
  is itself dropped, to count it as a dropped store of ``n`` blocks too.
* **Configuration** (:func:`build_detector`) fixes vLLM's quirks: a bare
  ``{}`` works (``backpressure_cls`` defaults to the EMA detector), policies
  take arguments, and every invalid value is a ``ValueError`` naming the key,
  the value and what is accepted. A top-level ``backpressure`` mapping, even
  ``{}``, gives every tier a detector (in vLLM a top-level ``{}`` alone does
  nothing); ``p2p`` tiers are not special-cased here (vLLM refuses any detector
  on them), a tier-level ``false`` opts one tier out.

Configuration keys (one ``backpressure`` mapping at the top level of
``kv_connector_extra_config`` applies to every tier; a tier's own
``backpressure`` mapping overrides it field by field):

=====================  ==================================================================
``backpressure_cls``   detector class; default ``"EMABackpressureDetector"``. A name
                       without a dot is looked up in this module; ``"pkg.mod.Class"``
                       imports ``pkg.mod`` and takes ``Class``.
``policy_cls``         policy class, same lookup (``"DropStorePolicy"``,
                       ``"ThrottledDropPolicy"``); default: the detector's own
                       default (``ThrottledDropPolicy()``).
``policy_kwargs``      mapping of keyword arguments for the policy's constructor, e.g.
                       ``{"ramp_factor": 3.0}``; default ``{}``. Like every other key it
                       is replaced whole by a tier-level value, not merged key by key.
                       Without ``policy_cls`` it configures ``ThrottledDropPolicy``.
``high_water_s``       s/MiB; EMA above it puts the tier under pressure (> 0).
``low_water_s``        s/MiB; EMA below it clears pressure (> 0, <= high_water_s).
``alpha``              EMA smoothing factor in (0, 1]; default 0.15.
``warmup_completions`` completions averaged to seed the EMA (int >= 0); default 10.
``decay_half_life_s``  idle decay half-life while under pressure (>= 0; 0 = never
                       decay, so pressure that stops all stores may never clear);
                       default 2.0.
``cooldown_s``         after pressure clears, every second store is dropped for this
                       long (>= 0); default 1.0.
``failure_threshold``  consecutive failed stores that trip pressure (int >= 1, or
                       ``None`` to ignore failures).
=====================  ==================================================================

Per-tier defaults (set only where the key is absent, so user keys win):
``obj`` tiers and any tier with ``locality: "REMOTE"`` get ``high_water_s=0.050``
and ``low_water_s=0.010``; every other tier gets ``0.010`` / ``0.002``; ``fs``
and ``obj`` also get ``failure_threshold=3``. A tier-level ``backpressure: false``
turns backpressure off for that tier even when a top-level block exists.
Keys of a custom ``backpressure_cls`` other than the ones above are passed to its
constructor and checked against its signature.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from shmtier.metrics import (
    BACKPRESSURE_BLOCKS_DROPPED,
    BACKPRESSURE_STORE_LATENCY_EMA,
    BACKPRESSURE_STORES_DROPPED,
)
from shmtier.metrics import TIER as TIER_LABEL

__all__ = [
    "BackpressurePolicy",
    "DropAccountingPolicy",
    "DropStorePolicy",
    "ThrottledDropPolicy",
    "BackpressureDetector",
    "EMABackpressureDetector",
    "build_detector",
    "merge_backpressure_config",
    "backpressure_metric_definitions",
    "record_backpressure_metrics",
    "BACKPRESSURE_STORE_LATENCY_EMA",
    "BACKPRESSURE_STORES_DROPPED",
    "BACKPRESSURE_BLOCKS_DROPPED",
    "TIER_LABEL",
]

Clock = Callable[[], float]

# --- metrics: names, types and labels are defined once, in shmtier.metrics ---


# ============================================================================ policies


class BackpressurePolicy(ABC):
    """Turns a detector's state into a store decision and counts what it drops."""

    @abstractmethod
    def should_store(self, detector: BackpressureDetector) -> bool:
        """True to let the store through."""

    @abstractmethod
    def on_store_skipped(self, num_blocks: int) -> None:
        """Count one dropped store of ``num_blocks`` blocks."""

    @abstractmethod
    def pop_stores_dropped(self) -> tuple[int, int]:
        """``(stores_dropped, blocks_dropped)`` since the last call; resets both."""

    @abstractmethod
    def reset(self) -> None:
        """Forget all state, counters included."""


class DropAccountingPolicy(BackpressurePolicy):
    """Shared drop counters; subclasses implement ``should_store`` (and, when they keep
    state of their own, extend ``reset`` calling ``super().reset()``)."""

    def __init__(self) -> None:
        self._stores_dropped = 0
        self._blocks_dropped = 0

    def on_store_skipped(self, num_blocks: int) -> None:
        self._stores_dropped += 1
        self._blocks_dropped += num_blocks

    def pop_stores_dropped(self) -> tuple[int, int]:
        popped = (self._stores_dropped, self._blocks_dropped)
        self._stores_dropped = self._blocks_dropped = 0
        return popped

    def reset(self) -> None:
        self._stores_dropped = self._blocks_dropped = 0


class DropStorePolicy(DropAccountingPolicy):
    """Drop every store while the detector reports pressure."""

    def should_store(self, detector: BackpressureDetector) -> bool:
        return not detector.is_under_pressure()


class ThrottledDropPolicy(DropAccountingPolicy):
    """Drop a fraction of stores that grows with how far the EMA is above high water.

    ``drop_rate = min(1, max(0, ema - high) / high / ramp_factor)``: with the default
    ``ramp_factor=2.0`` nothing is dropped at ``high``, half at ``2 x high`` and all
    at ``3 x high``. Fractional rates are spread evenly: the rate is added to an
    accumulator per decision and a store is dropped (accumulator -= 1) whenever it
    reaches 1. Under pressure with the EMA still between low and high water (the
    hysteresis band), nothing is dropped. Needs an :class:`EMABackpressureDetector`.
    """

    def __init__(self, ramp_factor: float = 2.0) -> None:
        super().__init__()
        if (isinstance(ramp_factor, bool) or not isinstance(ramp_factor, (int, float))
                or not math.isfinite(ramp_factor) or ramp_factor <= 0):
            raise ValueError(
                f"ramp_factor = {ramp_factor!r} is invalid: expected a finite number > 0"
            )
        self._ramp_factor = float(ramp_factor)
        self._drop_accumulator = 0.0

    @property
    def ramp_factor(self) -> float:
        return self._ramp_factor

    def should_store(self, detector: BackpressureDetector) -> bool:
        if not isinstance(detector, EMABackpressureDetector):
            raise TypeError(
                f"ThrottledDropPolicy needs an EMABackpressureDetector, got "
                f"{type(detector).__name__}"
            )
        if not detector.is_under_pressure():
            return True
        high = detector.high_water_s
        if high <= 0:
            return False
        drop_rate = min(1.0, max(0.0, detector.store_latency_ema - high) / high
                        / self._ramp_factor)
        if drop_rate <= 0.0:
            return True
        if drop_rate >= 1.0:
            return False
        self._drop_accumulator += drop_rate
        if self._drop_accumulator >= 1.0:
            self._drop_accumulator -= 1.0
            return False
        return True

    def reset(self) -> None:
        super().reset()
        self._drop_accumulator = 0.0


# =========================================================================== detectors


class BackpressureDetector(ABC):
    """Watches one tier's cascade results; decides whether it is under pressure.

    ``policy`` defaults to :class:`ThrottledDropPolicy` (as in vLLM). ``clock`` is the
    time source for everything time-based, ``time.monotonic`` unless a test injects
    a fake one.
    """

    def __init__(self, policy: BackpressurePolicy | None = None, *,
                 clock: Clock = time.monotonic) -> None:
        self._policy = policy if policy is not None else ThrottledDropPolicy()
        self._clock = clock
        self._ring_full = False

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    @property
    def clock(self) -> Clock:
        return self._clock

    # --- signals -----------------------------------------------------------------

    @abstractmethod
    def on_store_completed(self, elapsed_s: float, nbytes: int) -> None:
        """A cascade job of ``nbytes`` bytes succeeded ``elapsed_s`` after submission."""

    def on_store_failed(self) -> None:
        """A cascade job failed. Ignored unless a detector treats failures as pressure."""

    def update(self, submit_time: float, nbytes: int) -> None:
        """A cascade job submitted at ``submit_time`` (this detector's clock) succeeded.

        The elapsed time is measured up to now, so it includes queueing and the lag
        until the scheduler noticed the result (as in vLLM). ``nbytes <= 0`` is
        ignored.
        """
        if nbytes <= 0:
            return
        self.on_store_completed(max(0.0, self._clock() - submit_time), nbytes)

    def note_ring_full(self, dropped_blocks: int | None = None) -> None:
        """The tier's job ring was full: the next ``should_store`` answers False.

        ``dropped_blocks``: when the job that met the full ring is dropped as well,
        its block count, so it is counted as a dropped store right away.
        """
        self._ring_full = True
        if dropped_blocks is not None:
            self._policy.on_store_skipped(dropped_blocks)

    @property
    def ring_full_pending(self) -> bool:
        """A full ring was noted and no decision has consumed it yet."""
        return self._ring_full

    # --- decisions ---------------------------------------------------------------

    @abstractmethod
    def is_under_pressure(self) -> bool: ...

    def should_store(self, num_blocks: int) -> bool:
        """Decide one cascade job of ``num_blocks`` blocks; a drop is counted."""
        if self._consume_ring_full(num_blocks):
            return False
        return self._ask_policy(num_blocks)

    def _consume_ring_full(self, num_blocks: int) -> bool:
        if not self._ring_full:
            return False
        self._ring_full = False
        self._policy.on_store_skipped(num_blocks)
        return True

    def _ask_policy(self, num_blocks: int) -> bool:
        if self._policy.should_store(self):
            return True
        self._policy.on_store_skipped(num_blocks)
        return False

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (manager ``reset_cache``), the policy included."""

    @classmethod
    def default_config(cls, tier_type: str, locality: str | None = None) -> dict | None:
        """Constructor kwargs this detector wants by default for a tier, or None."""
        return None

    @property
    def stats(self) -> dict[str, float]:
        return {}


class EMABackpressureDetector(BackpressureDetector):
    """Pressure from an exponential moving average of store latency per MiB.

    Each successful store contributes ``x = elapsed_s / (nbytes / 2**20)`` (s/MiB).

    * Warmup: the first ``warmup_completions`` samples are only collected; at exactly
      that many the EMA is seeded with their mean. No latency decision before that.
    * Afterwards ``ema = alpha * x + (1 - alpha) * ema``. ``ema > high`` → under
      pressure (any running cooldown is cancelled); ``ema < low`` → not under
      pressure (a cooldown starts if it was), failure trip cleared, healthy streak
      + 1; in between (hysteresis band) the state is kept and the streak resets.
    * Failures: after ``failure_threshold`` consecutive failed stores (even during
      warmup) the EMA is raised to at least ``4 x high`` and the tier is under
      pressure; any success resets the failure count.
    * Idle decay: while under pressure, each check first decays the EMA by
      ``0.5 ** (dt / decay_half_life_s)`` since the last update, so a tier that no
      longer gets stores recovers; falling below ``low`` clears pressure.
    * Cooldown: for ``cooldown_s`` after pressure clears every second decision is a
      drop (50 % throttle).
    * Healthy fast path: after 10 consecutive completions below ``low`` with no
      pressure, stores pass without consulting the policy.
    """

    _MIB = 1 << 20

    DEFAULT_ALPHA = 0.15
    DEFAULT_WARMUP_COMPLETIONS = 10
    DEFAULT_DECAY_HALF_LIFE_S = 2.0
    DEFAULT_COOLDOWN_S = 1.0
    DEFAULT_FAILURE_THRESHOLD = 3
    _HEALTHY_THRESHOLD = 10
    _FAILURE_EMA_FACTOR = 4.0

    LOCAL_HIGH_WATER_S = 0.010
    LOCAL_LOW_WATER_S = 0.002
    NETWORK_HIGH_WATER_S = 0.050
    NETWORK_LOW_WATER_S = 0.010

    _NETWORK_TIER_TYPES = frozenset({"obj"})
    _STORAGE_TIER_TYPES = frozenset({"fs", "obj"})

    @classmethod
    def default_config(cls, tier_type: str, locality: str | None = None) -> dict:
        remote = isinstance(locality, str) and locality.upper() == "REMOTE"
        if remote or tier_type in cls._NETWORK_TIER_TYPES:
            config: dict[str, Any] = {"high_water_s": cls.NETWORK_HIGH_WATER_S,
                                      "low_water_s": cls.NETWORK_LOW_WATER_S}
        else:
            config = {"high_water_s": cls.LOCAL_HIGH_WATER_S,
                      "low_water_s": cls.LOCAL_LOW_WATER_S}
        if tier_type in cls._STORAGE_TIER_TYPES:
            config["failure_threshold"] = cls.DEFAULT_FAILURE_THRESHOLD
        return config

    def __init__(
        self,
        high_water_s: float,
        low_water_s: float,
        alpha: float = DEFAULT_ALPHA,
        warmup_completions: int = DEFAULT_WARMUP_COMPLETIONS,
        decay_half_life_s: float = DEFAULT_DECAY_HALF_LIFE_S,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        failure_threshold: int | None = None,
        policy: BackpressurePolicy | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(policy, clock=clock)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha = {alpha!r} is invalid: expected 0 < alpha <= 1")
        if low_water_s > high_water_s:
            raise ValueError(
                f"low_water_s = {low_water_s!r} is invalid: expected <= high_water_s "
                f"({high_water_s!r})"
            )
        if failure_threshold is not None and failure_threshold < 1:
            raise ValueError(
                f"failure_threshold = {failure_threshold!r} is invalid: expected an "
                f"integer >= 1 or None"
            )
        self._alpha = alpha
        self._high = high_water_s
        self._low = low_water_s
        self._warmup_completions = warmup_completions
        self._decay_half_life_s = decay_half_life_s
        self._cooldown_s = cooldown_s
        self._failure_threshold = failure_threshold
        self._init_state()

    def _init_state(self) -> None:
        self._ema = 0.0
        self._under_pressure = False
        self._completions = 0
        self._warmup_samples: list[float] = []
        self._last_update = 0.0  # clock time the EMA was last set or decayed
        self._healthy_streak = 0
        self._pressure_cleared_at: float | None = None  # start of the running cooldown
        self._cooldown_count = 0
        self._consecutive_failures = 0
        self._failure_tripped = False  # pressure from failures (may predate warmup's end)
        self._ring_full = False

    # --- parameters --------------------------------------------------------------

    @property
    def high_water_s(self) -> float:
        return self._high

    @property
    def low_water_s(self) -> float:
        return self._low

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def warmup_completions(self) -> int:
        return self._warmup_completions

    @property
    def decay_half_life_s(self) -> float:
        return self._decay_half_life_s

    @property
    def cooldown_s(self) -> float:
        return self._cooldown_s

    @property
    def failure_threshold(self) -> int | None:
        return self._failure_threshold

    # --- state -------------------------------------------------------------------

    @property
    def store_latency_ema(self) -> float:
        return self._ema

    @store_latency_ema.setter
    def store_latency_ema(self, value: float) -> None:
        self._ema = value

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    @property
    def warmed_up(self) -> bool:
        return self._completions >= self._warmup_completions

    @property
    def in_cooldown(self) -> bool:
        return (not self._under_pressure and self._pressure_cleared_at is not None
                and self._clock() - self._pressure_cleared_at < self._cooldown_s)

    # --- signals -----------------------------------------------------------------

    def on_store_completed(self, elapsed_s: float, nbytes: int) -> None:
        if nbytes <= 0:
            return
        now = self._clock()
        sample = elapsed_s / (nbytes / self._MIB)
        self._consecutive_failures = 0
        self._completions += 1
        if self._completions <= self._warmup_completions:
            self._warmup_samples.append(sample)
            if self._completions == self._warmup_completions:
                self._ema = sum(self._warmup_samples) / len(self._warmup_samples)
                self._last_update = now
            return
        self._ema = self._alpha * sample + (1.0 - self._alpha) * self._ema
        self._last_update = now
        if self._ema > self._high:
            self._under_pressure = True
            self._pressure_cleared_at = None
            self._healthy_streak = 0
        elif self._ema < self._low:
            if self._under_pressure:
                self._start_cooldown(now)
            self._under_pressure = False
            self._failure_tripped = False
            self._healthy_streak += 1
        else:
            self._healthy_streak = 0

    def on_store_failed(self) -> None:
        if self._failure_threshold is None:
            return
        self._consecutive_failures += 1
        self._healthy_streak = 0
        if self._consecutive_failures < self._failure_threshold:
            return
        self._ema = max(self._ema, self._high * self._FAILURE_EMA_FACTOR)
        self._last_update = self._clock()
        self._under_pressure = True
        self._failure_tripped = True
        self._pressure_cleared_at = None

    def _start_cooldown(self, now: float) -> None:
        self._pressure_cleared_at = now
        self._cooldown_count = 0

    def _apply_idle_decay(self) -> None:
        now = self._clock()
        dt = now - self._last_update
        if dt <= 0 or self._decay_half_life_s <= 0:
            return
        self._ema *= 0.5 ** (dt / self._decay_half_life_s)
        self._last_update = now

    # --- decisions ---------------------------------------------------------------

    def is_under_pressure(self) -> bool:
        if self._under_pressure and (
            self._completions >= self._warmup_completions or self._failure_tripped
        ):
            self._apply_idle_decay()
            if self._ema < self._low:
                self._under_pressure = False
                self._failure_tripped = False
                self._start_cooldown(self._clock())
        return self._under_pressure

    def is_healthy(self) -> bool:
        """No pressure and the last 10+ completions all left the EMA below low water."""
        return not self._under_pressure and self._healthy_streak >= self._HEALTHY_THRESHOLD

    def should_store(self, num_blocks: int) -> bool:
        under_pressure = self.is_under_pressure()  # decays, may clear pressure
        if self._consume_ring_full(num_blocks):
            return False
        if self.is_healthy():
            return True
        if (not under_pressure and self._pressure_cleared_at is not None
                and self._clock() - self._pressure_cleared_at < self._cooldown_s):
            self._cooldown_count += 1
            if self._cooldown_count % 2 == 0:
                self._policy.on_store_skipped(num_blocks)
                return False
        return self._ask_policy(num_blocks)

    def reset(self) -> None:
        self._init_state()
        self._policy.reset()

    @property
    def stats(self) -> dict[str, float]:
        return {
            "store_latency_ema": self._ema,
            "consecutive_store_failures": self._consecutive_failures,
        }


# ======================================================================= configuration

#: Short names (no dot) accepted for ``backpressure_cls`` / ``policy_cls``.
DETECTOR_CLASSES: dict[str, type] = {"EMABackpressureDetector": EMABackpressureDetector}
POLICY_CLASSES: dict[str, type] = {"DropStorePolicy": DropStorePolicy,
                                   "ThrottledDropPolicy": ThrottledDropPolicy}
DEFAULT_DETECTOR_CLS = "EMABackpressureDetector"

#: Keys consumed by :func:`build_detector` itself; the rest go to the detector.
RESERVED_KEYS = ("backpressure_cls", "policy_cls", "policy_kwargs")

_DETECTOR_METHODS = ("should_store", "update", "on_store_failed", "is_under_pressure",
                     "reset")
_POLICY_METHODS = ("should_store", "on_store_skipped", "pop_stores_dropped", "reset")

# (kind, minimum, minimum_inclusive) for the EMA detector's keys
_EMA_SCHEMA: dict[str, tuple[str, float, bool]] = {
    "high_water_s": ("number", 0.0, False),
    "low_water_s": ("number", 0.0, False),
    "alpha": ("number", 0.0, False),  # upper bound 1 checked separately
    "warmup_completions": ("int", 0, True),
    "decay_half_life_s": ("number", 0.0, True),
    "cooldown_s": ("number", 0.0, True),
    "failure_threshold": ("int_or_none", 1, True),
}
_POLICY_SCHEMA: dict[type, dict[str, tuple[str, float, bool]]] = {
    ThrottledDropPolicy: {"ramp_factor": ("number", 0.0, False)},
    DropStorePolicy: {},
}


def _config_error(message: str) -> ValueError:
    # Lazy: shmtier.config may import this module.
    try:
        from shmtier.config import ConfigError
    except ImportError:  # pragma: no cover - config is part of the package
        return ValueError(message)
    return ConfigError(message)


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


def build_detector(
    tier_type: str,
    locality: str | None,
    top_level: Mapping[str, Any] | None | bool,
    tier_level: Mapping[str, Any] | None | bool,
    *,
    where: str = "backpressure",
    top_level_where: str = "backpressure",
    clock: Clock = time.monotonic,
) -> BackpressureDetector | None:
    """The detector for one secondary tier, or None when it has no backpressure.

    ``top_level``: ``kv_connector_extra_config.get("backpressure")``; ``tier_level``:
    the tier's ``.get("backpressure")``. ``where`` names the tier's mapping in error
    messages (e.g. ``"secondary_tiers[1].backpressure"``), ``top_level_where`` the
    top-level one; a key inherited from the top level is reported under that name.
    No detector when neither mapping is given or the tier says ``false``. See the
    module docstring for the keys; every invalid value raises ``ValueError``
    (:class:`shmtier.config.ConfigError`).
    """
    if top_level is False:
        top_level = None
    if tier_level is False:
        return None
    for name, layer in ((top_level_where, top_level), (where, tier_level)):
        if layer is not None and not isinstance(layer, Mapping):
            raise _config_error(
                f"{name} = {layer!r} is invalid: expected a mapping of backpressure "
                f"settings (or false to disable)"
            )
        for key in layer or {}:
            if not isinstance(key, str):
                raise _config_error(
                    f"{name} has a key {key!r} that is not a string; accepted keys are "
                    f"names such as {list(RESERVED_KEYS) + list(_EMA_SCHEMA)}"
                )
    merged_and_source = merge_backpressure_config(top_level, tier_level)
    if merged_and_source is None:
        return None
    if locality is not None and (not isinstance(locality, str)
                                 or locality.upper() not in ("LOCAL", "REMOTE")):
        raise _config_error(
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

    detector_cls = _resolve_class(
        config.pop("backpressure_cls", DEFAULT_DETECTOR_CLS), DETECTOR_CLASSES,
        BackpressureDetector, _DETECTOR_METHODS, name_of("backpressure_cls"), "detector")
    policy_cls_given = "policy_cls" in config
    policy = _build_policy(config.pop("policy_cls", None),
                           config.pop("policy_kwargs", None), name_of)
    is_ema = issubclass(detector_cls, EMABackpressureDetector)
    if (isinstance(policy, ThrottledDropPolicy) and issubclass(detector_cls, BackpressureDetector)
            and not is_ema):
        key = "policy_cls" if policy_cls_given else "policy_kwargs"
        raise _config_error(
            f"{name_of(key)}: ThrottledDropPolicy needs backpressure_cls "
            f"EMABackpressureDetector (or a subclass), not {_class_name(detector_cls)}; "
            f"use policy_cls 'DropStorePolicy' or a policy of your own"
        )

    default_config = getattr(detector_cls, "default_config", None)
    defaults = default_config(tier_type, locality=locality) if default_config else None
    for key, value in (defaults or {}).items():
        if key not in config:
            config[key] = value
            source[key] = "default"

    params = _constructor_params(detector_cls)
    internal = ("policy", "clock")
    takes_any = params is not None and any(p.kind is p.VAR_KEYWORD for p in params.values())
    if params is not None:
        accepted = sorted(
            {n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in internal}
            | set(RESERVED_KEYS))
        for key, value in config.items():
            if key in internal or (key not in params and not takes_any):
                raise _unknown_key(name_of(key), value, key, detector_cls, accepted)
        if policy is not None and "policy" not in params and not takes_any:
            raise _config_error(
                f"{name_of('policy_cls')} = {_class_name(type(policy))!r} is invalid: "
                f"{_class_name(detector_cls)} takes no policy argument"
            )
    if is_ema:
        for key, value in config.items():
            if key in _EMA_SCHEMA:
                config[key] = _check_value(value, _EMA_SCHEMA[key], name_of(key), key)
        high, low = config["high_water_s"], config["low_water_s"]
        if low > high:
            raise _config_error(
                f"{name_of('low_water_s')} = {low!r} is invalid: must be <= "
                f"{name_of('high_water_s')} = {high!r} (low water clears pressure, high "
                f"water sets it)"
            )
    kwargs = dict(config)
    if params is None or "policy" in params or takes_any:
        kwargs["policy"] = policy
    if issubclass(detector_cls, BackpressureDetector) and (
            params is None or "clock" in params or takes_any):
        kwargs["clock"] = clock
    if params is not None:
        missing = [n for n, p in params.items()
                   if p.default is p.empty and n not in kwargs
                   and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing:
            raise _config_error(
                f"{where}: {_class_name(detector_cls)} needs "
                f"{', '.join(repr(m) for m in missing)}; accepted keys: {accepted}"
            )
    try:
        return detector_cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise _config_error(
            f"{where}: {_class_name(detector_cls)} rejected its settings "
            f"{_describe(config)}: {e}"
        ) from e


def _build_policy(policy_cls: Any, policy_kwargs: Any,
                  name_of: Callable[..., str]) -> BackpressurePolicy | None:
    if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
        raise _config_error(
            f"{name_of('policy_kwargs')} = {policy_kwargs!r} is invalid: expected a mapping "
            f"of keyword arguments for the policy, e.g. {{'ramp_factor': 3.0}}"
        )
    policy_kwargs = dict(policy_kwargs or {})
    if policy_cls is None:
        if not policy_kwargs:
            return None  # the detector's own default policy
        policy_cls = "ThrottledDropPolicy"
    cls = _resolve_class(policy_cls, POLICY_CLASSES, BackpressurePolicy, _POLICY_METHODS,
                         name_of("policy_cls"), "policy")
    kw_name = name_of("policy_kwargs")
    params = _constructor_params(cls)
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = sorted(n for n, p in params.items()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        for key, value in policy_kwargs.items():
            if not isinstance(key, str) or key not in params:
                raise _unknown_key(name_of("policy_kwargs", str(key)), value, key, cls,
                                   accepted)
    schema = next((sch for base, sch in _POLICY_SCHEMA.items() if issubclass(cls, base)), {})
    for key, value in policy_kwargs.items():
        if key in schema:
            policy_kwargs[key] = _check_value(value, schema[key],
                                              name_of("policy_kwargs", key), key)
    try:
        return cls(**policy_kwargs)
    except (TypeError, ValueError) as e:
        raise _config_error(
            f"{kw_name} = {policy_kwargs!r} is invalid for {_class_name(cls)}: {e}"
        ) from e


def _resolve_class(value: Any, short_names: dict[str, type], base: type,
                   methods: tuple[str, ...], name: str, what: str) -> type:
    accepted = (f"one of {sorted(short_names)}, a dotted 'module.Class' path to a "
                f"{what} class, or the class itself")
    if isinstance(value, type):
        cls = value
    elif isinstance(value, str) and value:
        if "." not in value:
            cls = short_names.get(value)
            if cls is None:
                close = difflib.get_close_matches(value, short_names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise _config_error(
                    f"{name} = {value!r} is invalid{hint}: expected {accepted}"
                )
        else:
            module_path, _, class_name = value.rpartition(".")
            try:
                module = importlib.import_module(module_path)
            except Exception as e:  # noqa: BLE001 - any import failure is a config error
                raise _config_error(
                    f"{name} = {value!r} is invalid: module {module_path!r} cannot be "
                    f"imported ({type(e).__name__}: {e}); expected {accepted}"
                ) from e
            cls = getattr(module, class_name, None)
            if cls is None:
                raise _config_error(
                    f"{name} = {value!r} is invalid: module {module_path!r} has no "
                    f"attribute {class_name!r}; expected {accepted}"
                )
    else:
        raise _config_error(f"{name} = {value!r} is invalid: expected {accepted}")
    if not isinstance(cls, type) or not (
        issubclass(cls, base) or all(callable(getattr(cls, m, None)) for m in methods)
    ):
        raise _config_error(
            f"{name} = {value!r} is invalid: {cls!r} is not a {what} class (a subclass "
            f"of {base.__name__} or a class with {', '.join(methods)}); expected {accepted}"
        )
    if inspect.isabstract(cls):
        raise _config_error(
            f"{name} = {value!r} is invalid: {cls.__name__} is abstract; expected {accepted}"
        )
    return cls


def _check_value(value: Any, spec: tuple[str, float, bool], name: str, key: str) -> Any:
    kind, minimum, inclusive = spec
    op = ">=" if inclusive else ">"
    maximum = 1.0 if key == "alpha" else math.inf
    if kind == "int_or_none":
        if value is None:
            return None
        kind, expected = "int", f"an integer {op} {minimum}, or null to ignore failures"
    elif kind == "int":
        expected = f"an integer {op} {minimum}"
    elif key == "alpha":
        expected = "a number in (0, 1]"
    else:
        expected = f"a finite number {op} {minimum}"
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    if ok:
        ok = (value >= minimum if inclusive else value > minimum) and value <= maximum
    if not ok:
        raise _config_error(f"{name} = {value!r} is invalid: expected {expected}")
    return value


def _constructor_params(cls: type) -> Mapping[str, inspect.Parameter] | None:
    """``cls``'s constructor parameters, or None when they cannot be inspected."""
    try:
        return inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None


def _unknown_key(name: str, value: Any, key: Any, cls: type, accepted: list[str]) -> ValueError:
    close = difflib.get_close_matches(key, accepted, n=1) if isinstance(key, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return _config_error(
        f"{name} = {value!r} is invalid: unknown key for {_class_name(cls)}{hint}; "
        f"accepted keys: {accepted}"
    )


def _class_name(cls: type) -> str:
    module = getattr(cls, "__module__", "")
    return cls.__name__ if module == __name__ else f"{module}.{cls.__qualname__}"


def _describe(config: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in sorted(config.items())) + "}"


# ============================================================================= metrics


def backpressure_metric_definitions() -> dict[str, Any]:
    """Declarations of the three backpressure series (labelled by ``tier``)."""
    from shmtier.metrics import tiering_metric_definitions

    names = (BACKPRESSURE_STORE_LATENCY_EMA, BACKPRESSURE_STORES_DROPPED, BACKPRESSURE_BLOCKS_DROPPED)
    return {name: meta for name, meta in tiering_metric_definitions().items() if name in names}


def record_backpressure_metrics(stats: Any, detector: BackpressureDetector,
                                tier_label: str) -> None:
    """Put one tier's backpressure series into a stats payload (once per step).

    ``stats`` is a :class:`shmtier.metrics.OffloadingStats`. The EMA gauge is set
    when the detector reports one; the drop counters are popped (so each drop is
    reported once) and added only when non-zero.
    """
    labelvalues = (tier_label,)
    ema = detector.stats.get("store_latency_ema")
    if ema is not None:
        stats.set_gauge(BACKPRESSURE_STORE_LATENCY_EMA, ema, labelvalues)
    stores, blocks = detector.policy.pop_stores_dropped()
    if stores > 0:
        stats.increase_counter(BACKPRESSURE_STORES_DROPPED, stores, labelvalues)
    if blocks > 0:
        stats.increase_counter(BACKPRESSURE_BLOCKS_DROPPED, blocks, labelvalues)
