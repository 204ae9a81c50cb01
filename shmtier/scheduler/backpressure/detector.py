"""Backpressure detectors: is one secondary tier under pressure? (docs/vllm-contract.md §8, docs/design.md §4, §8)

Who calls: the tiering manager, in the scheduler process only, on the scheduler thread:
``update`` / ``on_store_failed`` for every cascade (store) result of its tier,
``note_ring_full`` when a cascade finds its worker's job ring full, ``should_store`` once
per cascade job, ``reset`` from ``reset_cache``. Built once per tier at startup by
:func:`shmtier.scheduler.backpressure.build_detector`.

May it block: never. Nothing here sleeps, logs or does I/O; every method is a few float
operations, cheap enough to call per cascade job.

Behaviour matches vLLM 0.33's ``EMABackpressureDetector`` decision for decision
(``tests/test_backpressure.py`` runs both side by side). Differences, all additive:

* **Clock.** Time is ``time.monotonic()``, looked up at every call (so code that patches
  ``time.monotonic``, as vLLM's tests do, is seen), unless a ``clock`` callable is passed.
  ``update`` subtracts the job's ``submit_time`` from it, so submit times must come from
  the same clock. A negative elapsed time (a ``submit_time`` from the future) counts as 0
  instead of pulling the EMA below zero, and ``on_store_completed`` ignores
  ``nbytes <= 0`` instead of dividing by zero.
* **Full job ring.** shmtier's producers never block: when a cascade finds its worker's
  job ring full, the scheduler calls ``note_ring_full()``. That arms a one-shot signal:
  the *next* ``should_store`` answers ``False`` and counts the drop exactly like any
  other (``stores_dropped += 1``, ``blocks_dropped += num_blocks``), even on the healthy
  fast path. Several notes before one decision still drop one decision. The signal
  leaves the latency state (EMA, pressure flag, cooldown, healthy streak) untouched, so
  ``is_under_pressure()`` keeps describing the tier's latency health. Pass
  ``note_ring_full(dropped_blocks=n)`` when the job that found the ring full is itself
  dropped, to count it as a dropped store of ``n`` blocks too.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from shmtier.scheduler.backpressure import validation as _defaults
from shmtier.scheduler.backpressure.policy import (BackpressurePolicy, LatencyEMAReading,
                                                   ThrottledDropPolicy)
from shmtier.scheduler.backpressure.validation import check_field, check_water_marks

Clock = Callable[[], float]

__all__ = ["Clock", "BackpressureDetector", "EMABackpressureDetector"]


class BackpressureDetector(ABC):
    """Watches one tier's cascade results; decides whether it is under pressure.

    ``policy`` defaults to :class:`ThrottledDropPolicy` (as in vLLM). ``clock``: the time
    source for everything time-based; None (the default) reads ``time.monotonic()`` at
    each call.
    """

    def __init__(self, policy: BackpressurePolicy | None = None, *,
                 clock: Clock | None = None) -> None:
        if policy is None:
            policy = ThrottledDropPolicy()
        self._policy = policy
        self._clock = clock
        self._ring_full = False

    @property
    def policy(self) -> BackpressurePolicy:
        return self._policy

    @property
    def clock(self) -> Clock | None:
        """The injected clock, or None when time is ``time.monotonic()``."""
        return self._clock

    def _now(self) -> float:
        clock = self._clock
        return time.monotonic() if clock is None else clock()

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
        self.on_store_completed(max(0.0, self._now() - submit_time), nbytes)

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


class _Parameter:
    """Read-only attribute for a constructor parameter kept as ``_<name>``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._attr = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self._attr)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self._name} is read-only")


class EMABackpressureDetector(BackpressureDetector, LatencyEMAReading):
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

    DEFAULT_ALPHA = _defaults.DEFAULT_ALPHA
    DEFAULT_WARMUP_COMPLETIONS = _defaults.DEFAULT_WARMUP_COMPLETIONS
    DEFAULT_DECAY_HALF_LIFE_S = _defaults.DEFAULT_DECAY_HALF_LIFE_S
    DEFAULT_COOLDOWN_S = _defaults.DEFAULT_COOLDOWN_S
    DEFAULT_FAILURE_THRESHOLD = _defaults.DEFAULT_FAILURE_THRESHOLD
    LOCAL_HIGH_WATER_S = _defaults.LOCAL_HIGH_WATER_S
    LOCAL_LOW_WATER_S = _defaults.LOCAL_LOW_WATER_S
    NETWORK_HIGH_WATER_S = _defaults.NETWORK_HIGH_WATER_S
    NETWORK_LOW_WATER_S = _defaults.NETWORK_LOW_WATER_S
    _HEALTHY_THRESHOLD = 10
    _FAILURE_EMA_FACTOR = 4.0

    # constructor parameters, read-only
    high_water_s = _Parameter()
    low_water_s = _Parameter()
    alpha = _Parameter()
    warmup_completions = _Parameter()
    decay_half_life_s = _Parameter()
    cooldown_s = _Parameter()
    failure_threshold = _Parameter()

    @classmethod
    def default_config(cls, tier_type: str, locality: str | None = None) -> dict:
        return _defaults.ema_default_config(tier_type, locality)

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
        clock: Clock | None = None,
    ) -> None:
        super().__init__(policy, clock=clock)
        # the same checks as the configuration's, for the values the EMA cannot work with
        self._alpha = check_field("alpha", alpha)
        check_water_marks(high_water_s, low_water_s)
        self._failure_threshold = check_field("failure_threshold", failure_threshold)
        self._high_water_s = high_water_s
        self._low_water_s = low_water_s
        self._warmup_completions = warmup_completions
        self._decay_half_life_s = decay_half_life_s
        self._cooldown_s = cooldown_s
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
        return not self._under_pressure and self._cooling_down()

    def _cooling_down(self) -> bool:
        return (self._pressure_cleared_at is not None
                and self._now() - self._pressure_cleared_at < self._cooldown_s)

    # --- signals -----------------------------------------------------------------

    def on_store_completed(self, elapsed_s: float, nbytes: int) -> None:
        if nbytes <= 0:
            return
        now = self._now()
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
        if self._ema > self._high_water_s:
            self._under_pressure = True
            self._pressure_cleared_at = None
            self._healthy_streak = 0
        elif self._ema < self._low_water_s:
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
        self._ema = max(self._ema, self._high_water_s * self._FAILURE_EMA_FACTOR)
        self._last_update = self._now()
        self._under_pressure = True
        self._failure_tripped = True
        self._pressure_cleared_at = None

    def _start_cooldown(self, now: float) -> None:
        self._pressure_cleared_at = now
        self._cooldown_count = 0

    def _apply_idle_decay(self) -> None:
        now = self._now()
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
            if self._ema < self._low_water_s:
                self._under_pressure = False
                self._failure_tripped = False
                self._start_cooldown(self._now())
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
        if not under_pressure and self._cooling_down():
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
