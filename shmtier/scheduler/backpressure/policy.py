"""Backpressure policies: turn a detector's state into a yes/no for the next cascade.

Who calls: a detector (:mod:`shmtier.scheduler.backpressure.detector`), in the scheduler
process, on the scheduler thread: ``should_store`` when the detector itself does not
decide, ``on_store_skipped`` for every drop; the tiering manager pops the drop counters
once per step (:func:`shmtier.scheduler.backpressure.record_backpressure_metrics`).

May it block: never; every method is a few integer or float operations.

Decisions match vLLM 0.33's ``DropStorePolicy`` and ``ThrottledDropPolicy``.

Imports no detector: the detectors import this module (a detector's default policy is
:class:`ThrottledDropPolicy`), so what a policy reads from its detector is stated here:
``is_under_pressure()`` (:class:`PressureReading`), and for :class:`ThrottledDropPolicy`
the latency EMA and its high water mark of a :class:`LatencyEMAReading`, which
``EMABackpressureDetector`` is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from shmtier.scheduler.backpressure.validation import DEFAULT_RAMP_FACTOR, check_field

__all__ = ["BackpressurePolicy", "DropAccountingPolicy", "DropStorePolicy", "LatencyEMAReading",
           "PressureReading", "ThrottledDropPolicy"]


class PressureReading(Protocol):
    """What every policy reads from its detector (a ``BackpressureDetector`` is one)."""

    def is_under_pressure(self) -> bool: ...


class LatencyEMAReading(ABC):
    """A :class:`PressureReading` that keeps an EMA of store latency per MiB against a high
    water mark: what :class:`ThrottledDropPolicy` needs. ``EMABackpressureDetector``
    subclasses it."""

    high_water_s: float
    store_latency_ema: float


class BackpressurePolicy(ABC):
    """Turns a detector's state into a store decision and counts what it drops."""

    @abstractmethod
    def should_store(self, detector: PressureReading) -> bool:
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

    def should_store(self, detector: PressureReading) -> bool:
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

    def __init__(self, ramp_factor: float = DEFAULT_RAMP_FACTOR) -> None:
        super().__init__()
        self._ramp_factor = float(check_field("ramp_factor", ramp_factor))
        self._drop_accumulator = 0.0

    @property
    def ramp_factor(self) -> float:
        return self._ramp_factor

    def should_store(self, detector: PressureReading) -> bool:
        if not isinstance(detector, LatencyEMAReading):
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
