"""The tier-poll thread (docs/vllm-contract.md §6.10): polls the tiers that opt in between steps.

Who calls: the tiering manager starts one (when a tier sets
``tolerates_off_thread_polling`` and ``tier_poll_interval_s`` > 0) and stops it at
shutdown. The thread runs ``poll`` every ``interval_s`` holding the manager's lock; a
round never waits for the lock longer than ``POLL_LOCK_TIMEOUT_S`` and pauses after
releasing it (the lock is not fair: this bounds the scheduler thread's wait to one
round). Failures are logged (at most once a second) and, after
``POLL_GIVE_UP_AFTER_S`` of failed rounds, end the thread: per-step polling still
serves every tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_LOCK_TIMEOUT_S = 1.0
POLL_STALL_WARN_S = 30.0
POLL_GIVE_UP_AFTER_S = 30.0
POLL_ERROR_LOG_EVERY_S = 1.0
POLL_JOIN_TIMEOUT_S = 5.0


class TierPollThread:
    """A daemon thread running ``poll()`` under ``lock`` every ``interval_s`` (started now)."""

    def __init__(self, lock: threading.Lock, poll: Callable[[], None], interval_s: float):
        self._lock = lock
        self._poll = poll
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmtier_tier_poll", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> bool:
        """Stop and join the thread; False if it did not exit within POLL_JOIN_TIMEOUT_S."""
        self._stop.set()
        self._thread.join(POLL_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("tier-poll thread did not exit within %.1f s", POLL_JOIN_TIMEOUT_S)
            return False
        return True

    def _run(self) -> None:
        stalled_since = failing_since = None
        last_error_log = 0.0
        while not self._stop.is_set():
            if not self._lock.acquire(timeout=POLL_LOCK_TIMEOUT_S):
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since > POLL_STALL_WARN_S:
                    logger.warning("tier-poll thread could not take the manager lock for "
                                   "%.0f s; tiers are polled at step boundaries only",
                                   now - stalled_since)
                    stalled_since = None
                continue
            stalled_since = None
            try:
                self._poll()
                failing_since = None
            except Exception:  # never silently: per-step polling still serves the tiers
                now = time.monotonic()
                failing_since = failing_since or now
                if now - last_error_log >= POLL_ERROR_LOG_EVERY_S:
                    last_error_log = now
                    logger.exception("tier-poll round failed")
            finally:
                self._lock.release()
            if failing_since is not None and time.monotonic() - failing_since >= POLL_GIVE_UP_AFTER_S:
                logger.error("tier-poll thread stops after %.0f s of failed rounds; tiers are "
                             "polled at step boundaries only", POLL_GIVE_UP_AFTER_S)
                return
            self._stop.wait(self._interval_s)
