"""Deferred release: primary rows of failed promotions that a tier may still write.

vLLM 0.34's contract (``JobResult.deferred_release``), kept by shmtier on every vLLM
version: a tier that fails a promotion while its I/O may still write the primary rows of
the failed keys (shmtier's own: a p2p endpoint or a tier worker killed but not yet gone)
reports the result with a ``threading.Event``. The manager fails those keys at once --
lookups MISS, a later store gets a fresh row (``primary.defer_write_release``) -- and
keeps their rows out of the free pool until the tier sets the event, from any thread;
:meth:`DeferredReleases.release_ready`, run after each poll of that tier, then returns
them (``primary.release_deferred_write``). ``drain_jobs`` returns only with every event
set, so ``reset_cache`` never frees a row a tier may still write.

Who calls: the tiering manager, in the scheduler process, under its lock (the events
are the only thing other threads touch). Nothing here blocks.

Metrics (vLLM 0.34's): the gauge ``DEFERRED_RELEASE_CHUNKS`` (rows held, per tier) every
step for the tiers that declare ``defers_release`` -- and for any tier from its first
deferred release on, or for every tier after :meth:`report_every_tier` (as vLLM 0.34
reports it) -- and the histogram ``DEFERRED_RELEASE_HOLD`` (seconds held, per tier) at
each release.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from typing import NamedTuple

from shmtier import metrics
from shmtier.contract import OffloadKey


class _Held(NamedTuple):
    event: threading.Event
    rows: list[int]
    since: float  # monotonic seconds


class DeferredReleases:
    """The rows the manager holds for failed promotions, per tier (``labels[i]``: tier
    ``i``'s label; ``reported[i]``: report its gauge every step)."""

    def __init__(self, primary, labels: Sequence[str], reported: Sequence[bool]):
        self._primary = primary
        self._labels = [(label,) for label in labels]
        self._reported = [bool(r) for r in reported]
        #: per tier: its holds, oldest first (``release_ready`` looks at them)
        self.by_tier: list[list[_Held]] = [[] for _ in labels]
        self._rows = [0] * len(labels)  # rows held, per tier (the gauge)

    def __bool__(self) -> bool:
        """Whether any rows are held (``has_pending_work``)."""
        return any(self.by_tier)

    def rows_held(self, tier_idx: int) -> int:
        return self._rows[tier_idx]

    def report_every_tier(self) -> None:
        """Report the gauge of every tier every step, as vLLM 0.34's manager does (for a
        spec that declares the series for every tier)."""
        self._reported = [True] * len(self._reported)

    def defer(self, tier_idx: int, keys: Collection[OffloadKey], event: threading.Event) -> None:
        """Fail the pending promotion writes of ``keys`` of tier ``tier_idx`` now and hold
        their rows until ``event`` is set."""
        rows = self._primary.defer_write_release(keys)
        self._reported[tier_idx] = True
        if rows:
            self.by_tier[tier_idx].append(_Held(event, rows, time.monotonic()))
            self._rows[tier_idx] += len(rows)

    def release_ready(self, tier_idx: int, stats: metrics.OffloadingStats) -> None:
        """Return the rows of tier ``tier_idx`` whose event is set to the free pool,
        observing how long each hold lasted into ``stats``."""
        keep: list[_Held] = []
        done: list[_Held] = []
        for h in self.by_tier[tier_idx]:
            (done if h.event.is_set() else keep).append(h)
        if not done:
            return
        self.by_tier[tier_idx] = keep
        now = time.monotonic()
        label = self._labels[tier_idx]
        for h in done:
            self._primary.release_deferred_write(h.rows)
            self._rows[tier_idx] -= len(h.rows)
            stats.observe_histogram(metrics.DEFERRED_RELEASE_HOLD, now - h.since, label)

    def gauges_into(self, stats: metrics.OffloadingStats) -> None:
        for tier_idx, reported in enumerate(self._reported):
            if reported:
                stats.set_gauge(metrics.DEFERRED_RELEASE_CHUNKS, self._rows[tier_idx],
                                self._labels[tier_idx])

    def holding_tiers(self) -> list[str]:
        """The labels of the tiers whose rows are still held."""
        return [label for (label,), held in zip(self._labels, self.by_tier) if held]
