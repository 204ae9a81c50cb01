"""A release of primary rows that killed tier workers may still write.

Who uses it: the pool supervisor (``supervisor.py``), which fails a killed worker's load
parts at once and holds one :class:`RowRelease` per pool job for every such process until
it is gone (reaped), and the scheduler halves of worker-backed tiers, which hand its
``event`` to the manager as ``JobResult.deferred_release`` (``tiering/deferred_release.py``)
or hold their own release until the pool's let go (:meth:`RowRelease.then`). Scheduler
process, on the thread that polls the pool (under the manager's lock); never blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class RowRelease:
    """``event`` is set once the release is sealed (no more holders can come) and every
    holder let go; then each callback given to ``then`` runs, once."""

    __slots__ = ("event", "_holders", "_sealed", "_then")

    def __init__(self) -> None:
        self.event = threading.Event()
        self._holders = 0
        self._sealed = False
        self._then: list[Callable[[], None]] = []

    def hold(self) -> None:
        if self._sealed:
            raise RuntimeError("RowRelease.hold after seal: the release may have been set")
        self._holders += 1

    def let_go(self) -> None:
        if self._holders <= 0:
            raise RuntimeError("RowRelease.let_go without a holder")
        self._holders -= 1
        self._maybe_set()

    def seal(self) -> RowRelease | None:
        """No holder comes any more: self while some still hold, None once it is set."""
        self._sealed = True
        self._maybe_set()
        return None if self.event.is_set() else self

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the event is set (now, if it is)."""
        if self.event.is_set():
            callback()
        else:
            self._then.append(callback)

    def _maybe_set(self) -> None:
        if self._sealed and not self._holders and not self.event.is_set():
            self.event.set()
            callbacks, self._then = self._then, []
            for callback in callbacks:
                callback()
