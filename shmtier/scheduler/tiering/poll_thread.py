"""The tier-poll thread (docs/vllm-contract.md §6.10): polls the tiers that opt in between steps.

Who calls: the tiering manager starts one (when a tier sets
``tolerates_off_thread_polling`` and ``tier_poll_interval_s`` > 0) and stops it at
shutdown. The thread runs ``poll`` holding the manager's lock, at least every
``interval_s``; a round never waits for the lock longer than ``POLL_LOCK_TIMEOUT_S`` and
pauses after releasing it (the lock is not fair: this bounds the scheduler thread's wait
to one round). Failures are logged (at most once a second) and, after
``POLL_GIVE_UP_AFTER_S`` of failed rounds, end the thread: per-step polling still
serves every tier.

Waking early: a polled tier may declare ``poll_fds()`` (``SecondaryTierManager``). After
each round, still under the lock, the thread asks every such tier for its fds and then,
without the lock, waits until one of them is readable or ``interval_s`` passed (with no
fds it sleeps ``interval_s``, as before). It only waits on the fds (``poll(2)``): it
never touches a tier's objects without the lock. A round woken by an fd starts at once,
except when an fd is readable already as the wait after a woken round begins (that
round did not clear it, or news came during it): then the next round starts
``interval_s`` after the woken one (an fd no round clears costs one round per interval,
never a spin).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from shmtier.scheduler.tiering.base import optional_attribute

logger = logging.getLogger(__name__)

POLL_LOCK_TIMEOUT_S = 1.0
POLL_STALL_WARN_S = 30.0
POLL_GIVE_UP_AFTER_S = 30.0
POLL_ERROR_LOG_EVERY_S = 1.0
POLL_JOIN_TIMEOUT_S = 5.0
_READABLE = select.POLLIN | select.POLLPRI


class FailedRounds:
    """A poll thread's failing rounds (this one's and ``window_poll.py``'s): a failure is
    logged, with its traceback, at most once every POLL_ERROR_LOG_EVERY_S; ``give_up`` is
    True (and logs why) once rounds have failed for POLL_GIVE_UP_AFTER_S with none
    succeeding. The thread's own state: no lock."""

    def __init__(self, thread: str):
        self._thread = thread
        self.since: float | None = None  # when the current run of failures began
        self._last_log = 0.0

    def succeeded(self) -> None:
        self.since = None

    def failed(self) -> None:
        """Call from the ``except`` block of a failed round."""
        now = time.monotonic()
        self.since = self.since or now
        if now - self._last_log >= POLL_ERROR_LOG_EVERY_S:
            self._last_log = now
            logger.exception("%s round failed", self._thread)

    def give_up(self) -> bool:
        if self.since is None or time.monotonic() - self.since < POLL_GIVE_UP_AFTER_S:
            return False
        logger.error("%s thread stops after %.0f s of failed rounds; tiers are polled at step "
                     "boundaries only", self._thread, POLL_GIVE_UP_AFTER_S)
        return True


class TierPollThread:
    """A daemon thread running ``poll()`` under ``lock`` at least every ``interval_s``,
    sooner when an fd of one of ``tiers`` (their optional ``poll_fds``) is readable
    (started now)."""

    def __init__(self, lock: threading.Lock, poll: Callable[[], None], interval_s: float,
                 tiers: Sequence[Any] = ()):
        self._lock = lock
        self._poll = poll
        self._interval_s = interval_s
        self._fd_sources = [f for f in (optional_attribute(t, "poll_fds") for t in tiers)
                            if f is not None]
        self._stop = threading.Event()
        # stop() writes here: a wait on fds ends at once, whatever interval_s is
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller: Any = None
        self._sleeper: Any = None
        self._polled_fds: tuple[int, ...] = ()
        self._woken_at = float("-inf")  # when the last round an fd woke began
        self._after_wake = False  # the last round was one an fd woke
        self.woken_rounds = 0  # rounds started by a readable fd (for benches and tests)
        self._thread = threading.Thread(target=self._run, name="shmtier_tier_poll", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> bool:
        """Stop and join the thread; False if it did not exit within POLL_JOIN_TIMEOUT_S."""
        self._stop.set()
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass  # the pipe is full or closed: the thread sees the event within interval_s
        self._thread.join(POLL_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("tier-poll thread did not exit within %.1f s", POLL_JOIN_TIMEOUT_S)
            return False
        if self._stop_w >= 0:
            os.close(self._stop_r)
            os.close(self._stop_w)
            self._stop_r = self._stop_w = -1
        return True

    def _run(self) -> None:
        stalled_since = None
        failures = FailedRounds("tier-poll")
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
            fds: list[int] = []
            try:
                self._poll()
                failures.succeeded()
                for source in self._fd_sources:  # under the lock, like every tier call
                    fds.extend(source())
            except Exception:  # never silently: per-step polling still serves the tiers
                failures.failed()
            finally:
                self._lock.release()
            if failures.give_up():
                return
            self._wait(tuple(fds) if failures.since is None else ())

    def _wait(self, fds: tuple[int, ...]) -> None:
        """Until one of ``fds`` is readable or interval_s passed (at once if stopped;
        after a woken round whose fd is readable at once, until interval_s after it);
        without the lock (the fds are only waited on). ``poll(2)`` with the stop pipe,
        also with no fds: no costlier per round than ``Event.wait`` (bench/README.md,
        tier_poll_round.py)."""
        if self._poller is None or fds != self._polled_fds:
            self._poller = select.poll()
            self._poller.register(self._stop_r, _READABLE)
            for fd in fds:
                self._poller.register(fd, _READABLE)
            self._polled_fds = fds
        after_wake, self._after_wake = self._after_wake, False
        if after_wake and fds:
            events = self._poller.poll(0)
            if events and not self._stop.is_set():
                if not self._invalid(events):
                    # readable already: not cleared by the woken round, or news during it
                    self._sleep(self._woken_at + self._interval_s - time.monotonic())
                    self._woke()
                return
        events = self._poller.poll(self._interval_s * 1e3)
        if not events or self._stop.is_set() or self._invalid(events):
            return  # the interval passed
        self._woke()

    def _invalid(self, events: list) -> bool:
        """True (after the interval) if a tier closed an fd since the round (an endpoint
        restarting): the next round asks for its fds again."""
        if not any(ev & select.POLLNVAL for _, ev in events):
            return False
        self._poller = None
        self._sleep(self._interval_s)
        return True

    def _woke(self) -> None:
        self._woken_at = time.monotonic()
        self._after_wake = True
        self.woken_rounds += 1

    def _sleep(self, seconds: float) -> None:
        """``seconds``, or until stopped."""
        if seconds <= 0:
            return
        if self._sleeper is None:
            self._sleeper = select.poll()
            self._sleeper.register(self._stop_r, _READABLE)
        self._sleeper.poll(seconds * 1e3)
