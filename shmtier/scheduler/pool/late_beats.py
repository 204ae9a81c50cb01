"""Whether a tier worker whose heartbeat is late is hung, or only slow on a busy host.

Who calls: the pool's health check (``supervisor.py``, every 50 ms), on the scheduler
thread, for each worker that holds job parts: :meth:`LateBeats.hung` with the age of the
worker's own heartbeat. Never blocks; reads ``/proc`` only while a beat is late
(``procinfo.runnable_threads``: one listing and one small read per thread of the worker).

Why: a worker beats between job slices, once before it builds its tier backends and,
while its job thread is inside a backend call (waiting on its medium), every heartbeat
interval from its busy-beat thread (``workers/busy_beat.py``). On a host whose cores
are all busy, a worker (nice 10 and SCHED_BATCH: it yields to the
engine by design) may get a few percent of a core for seconds. A slice, or building the
backends at start (importing boto3), then takes longer than the heartbeat timeout,
though the worker never stopped running or waiting to run. Killing it frees no CPU and
fails its jobs, and three such kills of a starting worker break the pool for good.

The rule, per worker, while its beat is older than half the timeout, at every check::

    sample: is one of its threads running or waiting for a CPU (state R)?
    past the timeout, with samples over at least timeout/2:
        R in >= BUSY_SHARE of the samples   slow, not hung: spared; sampling starts over
        otherwise (blocked, stopped)        hung (the caller kills it)
    its threads cannot be read              hung past the timeout (as without this rule)

A worker SIGSTOPped, or blocked outside a backend call (its job loop stuck on a lock),
is never in state R and does not beat: it is judged hung as before, at the same age. One
blocked inside a backend call (a slow object store) beats from its busy-beat thread, so
its beat is never late here, however long one request takes: the part deadline bounds
that. A worker that computes forever without beating is spared here but still killed by
the part deadline (``job_timeout_s``), which this rule does not touch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shmtier.shared.procinfo import runnable_threads

logger = logging.getLogger(__name__)

#: The share of a late worker's samples in which one of its threads must be running or
#: runnable for it to count as slow rather than hung.
BUSY_SHARE = 0.5
#: Fewest samples a verdict of "slow" needs.
MIN_SAMPLES = 3


@dataclass(slots=True)
class _Window:
    pid: int
    beat_ns: int  # the late beat this window belongs to
    since: float  # monotonic seconds of its first sample
    samples: int = 0
    runnable: int = 0  # samples with a thread in state R
    unreadable: bool = False


class LateBeats:
    """The late-heartbeat judge of one pool. ``spared_total``: windows in which a late
    worker was judged slow, not hung."""

    def __init__(self) -> None:
        self.spared_total = 0
        self._windows: dict[int, _Window] = {}
        self._logged: dict[int, int] = {}  # worker index -> its process last logged slow

    def hung(self, index: int, pid: int, beat_ns: int, age_s: float, now: float,
             timeout_s: float) -> bool:
        """Whether worker ``index`` (process ``pid``, holding parts; its own heartbeat
        ``beat_ns`` is ``age_s`` old) is hung now, by the pool's heartbeat ``timeout_s``."""
        half = timeout_s / 2
        if age_s <= half:
            self._windows.pop(index, None)
            return False
        win = self._windows.get(index)
        if win is None or win.pid != pid or win.beat_ns != beat_ns:
            win = self._windows[index] = _Window(pid, beat_ns, now)
        n = runnable_threads(pid)
        win.samples += 1
        win.runnable += bool(n)
        win.unreadable |= n is None
        if age_s <= timeout_s:
            return False
        if win.unreadable:
            return True
        window = now - win.since
        if window < half or win.samples < MIN_SAMPLES:
            return False  # the window began late (no check for a while): let it fill
        if win.runnable < BUSY_SHARE * win.samples:
            return True
        self.spared_total += 1
        self._windows[index] = _Window(pid, beat_ns, now)
        if self._logged.get(index) != pid:  # once per process
            self._logged[index] = pid
            logger.warning("tier worker %d (pid %d): no heartbeat for %.1f s, but it was running "
                           "or waiting for a CPU at %d of %d checks in the last %.1f s: slow "
                           "(a busy host), not hung; the job deadline still applies", index,
                           pid, age_s, win.runnable, win.samples, window)
        return False

    def forget(self, index: int) -> None:
        """Worker ``index`` holds no parts, beat in time, or is gone: no window."""
        self._windows.pop(index, None)
