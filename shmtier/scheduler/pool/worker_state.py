"""One tier worker slot as the pool supervisor sees it: a small record and its state machine.

Runs in: the scheduler process, called only by :class:`~.supervisor.WorkerPool`'s
health check (from ``poll``, at most every 50 ms, on the scheduler thread). The
record is bookkeeping only: it never blocks, sends a signal or touches the
segment. The supervisor acts (spawns, kills, recovers rings, fails jobs) and
reports each event here; every transition goes through :meth:`WorkerRecord._to`,
which checks it against ``_ALLOWED`` and logs it once.

::

                  spawned (spawn mode) / a holder claimed the slot (external mode)
      RESTARTING ─────────────────────────▶ STARTING ──own heartbeat advances──▶ HEALTHY
          ▲                                 │  │  │                             │    │
          │      a job past its deadline,   │  │  └─ pool broken, no process    │    │
          │      or its beat too old while  ▼  │     (external: no holder)      ▼    │
          │      it holds jobs: SIGKILLed ─▶ HUNG ◀──── (same; or pool broken) ──┘    │
          │                                 │  │ process gone                          │
          │  backoff (spawn mode)           ▼  ▼                                      │
          └──────────────────────────────── DEAD ◀──────── process gone ──────────────┘
                                            │   its parts failed (exactly once), rings recovered
                  external mode: wait for ──┤
                  the next holder: STARTING └──▶ BROKEN  (pool broken: N start failures of
                                                          one slot within the window)

States:

* STARTING: spawned (or, external mode, waiting for or seeing a new holder) and its
  heartbeat has not advanced yet. A worker beats once when it claims its slot,
  before it builds its tier backends, and then at least every heartbeat interval
  from its job loop (inside a backend call, from its busy-beat thread:
  ``workers/busy_beat.py``): a beat *after* the first one shows the job loop runs.
* HEALTHY: its own heartbeat advanced. Clears the slot's start failures.
* HUNG: judged hung by the supervisor (a job part past its deadline, or its own
  heartbeat older than the timeout while it holds jobs), or stopped because the
  pool broke, and SIGKILLed; waiting for the process to be gone.
* DEAD: the process is gone; the supervisor has failed every part it held and
  recovered its rings. In spawn mode it stays DEAD until its stderr is read to
  the end (the last line names why it exited), at most ``_LAST_WORDS_S``.
* RESTARTING: spawn mode, waiting out the restart backoff (0.1 s doubling to 5 s;
  back to 0.1 s after 10 s healthy).
* BROKEN: the pool is broken; nothing is restarted any more. Terminal.

Start failures: a death before HEALTHY (or with exit code ``EXIT_BACKENDS_FAILED``)
is a *start failure*; HEALTHY clears the list. ``max_start_failures`` of them
within ``window_s`` (no HEALTHY in between) break the pool: all workers run the
same backends, so one slot that cannot start means none can (concurrent.futures
marks a process pool broken the same way).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_HEALTHY_RESET_S = 10.0  # healthy this long: the next failure backs off from the start
_LAST_WORDS_S = 0.5  # at most this long DEAD, reading the dead worker's stderr


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    HUNG = "hung"
    DEAD = "dead"
    RESTARTING = "restarting"
    BROKEN = "broken"

    def __str__(self) -> str:
        return self.value


S = WorkerState
_ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    S.STARTING: frozenset({S.HEALTHY, S.HUNG, S.DEAD, S.BROKEN}),
    S.HEALTHY: frozenset({S.HUNG, S.DEAD}),
    S.HUNG: frozenset({S.DEAD}),
    S.DEAD: frozenset({S.RESTARTING, S.STARTING, S.BROKEN}),
    S.RESTARTING: frozenset({S.STARTING, S.BROKEN}),
    S.BROKEN: frozenset(),
}
_LEVEL = {S.STARTING: logging.INFO, S.HEALTHY: logging.INFO, S.HUNG: logging.WARNING,
          S.DEAD: logging.WARNING, S.RESTARTING: logging.INFO, S.BROKEN: logging.WARNING}
# the running states: a process exists (or, external mode, may appear) and takes jobs
RUNNING = frozenset({S.STARTING, S.HEALTHY})


class TransitionError(RuntimeError):
    """A transition the state machine does not allow (a supervisor bug)."""


@dataclass(slots=True)
class WorkerRecord:
    """Worker slot ``index``: its state, its current process and its failure history."""

    index: int
    state: WorkerState = S.STARTING
    pid: int = 0  # the current process (0: none, or external mode: no holder seen yet)
    start_time: int = 0  # its start time in clock ticks (external mode: from the claim)
    started: float = 0.0  # monotonic seconds when it was spawned / first seen
    first_beat_ns: int = 0  # its first heartbeat seen (0: none yet)
    was_healthy: bool = False  # the current process reached HEALTHY
    healthy_since: float = 0.0
    dead_since: float = 0.0
    restart_at: float = 0.0
    restarts: int = 0  # consecutive restarts (sets the backoff)
    start_failures: list[float] = field(default_factory=list)  # monotonic times
    kill_reason: str = ""  # why the supervisor killed the current process (HUNG)
    last_exit: str = ""  # why the last process ended (exit code, last stderr line)

    # --- events (each is one transition, logged once) ---

    def spawned(self, pid: int, now: float) -> None:
        """Spawn mode: a process was started for this slot (the first one, or after
        the backoff)."""
        first = self.state is S.STARTING and not self.pid
        self.pid, self.start_time, self.started, self.first_beat_ns = pid, 0, now, 0
        self.kill_reason, self.was_healthy = "", False
        if first:  # a new record starts in STARTING
            logger.info("tier worker %d started (pid %d)", self.index, pid)
        else:
            self._to(S.STARTING, "tier worker %d restarted (pid %d)", self.index, pid)

    def holder_seen(self, pid: int, start_time: int, now: float) -> None:
        """External mode: a new process claimed the slot (no state change: STARTING)."""
        if self.state is not S.STARTING:
            raise TransitionError(f"tier worker {self.index}: a holder appeared in state {self.state}")
        self.pid, self.start_time, self.started, self.first_beat_ns = pid, start_time, now, 0
        self.kill_reason, self.was_healthy = "", False
        logger.info("tier worker %d: pid %d claimed the slot", self.index, pid)

    def beat_seen(self, beat_ns: int, now: float) -> None:
        """The current process's heartbeat reads ``beat_ns``: the first one is noted,
        a later one makes a STARTING worker HEALTHY."""
        if not self.first_beat_ns:
            self.first_beat_ns = beat_ns
        elif beat_ns != self.first_beat_ns and self.state is S.STARTING:
            self.start_failures.clear()
            self.was_healthy, self.healthy_since = True, now
            self._to(S.HEALTHY, "tier worker %d (pid %d) is healthy", self.index, self.pid)
        if (self.state is S.HEALTHY and self.restarts
                and now - self.healthy_since > _HEALTHY_RESET_S):
            self.restarts = 0

    def unseen_start_failures(self, count: int, now: float) -> None:
        """External mode: ``count`` processes claimed the slot and were gone before the
        supervisor saw them (between two health checks): start failures."""
        self.start_failures.extend([now] * count)
        self.last_exit = f"{count} worker process(es) claimed the slot and exited at once"
        logger.warning("tier worker %d: %s", self.index, self.last_exit)

    def killed(self, why: str) -> None:
        """The supervisor SIGKILLed the process (hung, past a deadline, or the pool broke)."""
        self.kill_reason = why
        self._to(S.HUNG, "tier worker %d (pid %d) %s; killed it", self.index, self.pid, why)

    def gone(self, how: str, now: float, start_failure: bool, failed_parts: int) -> None:
        """The process is gone (``how``: e.g. "exited with code 4"); the supervisor
        has failed its ``failed_parts`` parts. A ``start_failure`` is counted."""
        if start_failure:
            self.start_failures.append(now)
        self.last_exit = how
        self.dead_since = now
        self._to(S.DEAD, "tier worker %d (pid %d) %s; %d job part(s) failed", self.index,
                 self.pid, how, failed_parts)

    def last_words(self, line: str) -> None:
        """The dead process's last stderr line (spawn mode), added to ``last_exit``."""
        if line:
            self.last_exit = f"{self.last_exit}: {line}"

    def restart_after_backoff(self, now: float) -> float:
        """Spawn mode: wait out the backoff; returns the delay."""
        delay = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * (2 ** self.restarts))
        self.restarts += 1
        self.restart_at = now + delay
        self.pid = 0
        self._to(S.RESTARTING, "tier worker %d restarts in %.1f s", self.index, delay)
        return delay

    def await_holder(self) -> None:
        """External mode: ``shmtier workers`` starts the replacement; wait for its claim."""
        self.pid = self.start_time = self.first_beat_ns = 0
        self.was_healthy = False
        self._to(S.STARTING, "tier worker %d: waiting for `shmtier workers` to start a "
                 "replacement", self.index)

    def broke(self) -> None:
        """The pool is broken: this slot is not restarted any more."""
        self.pid = 0
        self._to(S.BROKEN, "tier worker %d stopped for good: the pool is broken", self.index)

    # --- queries ---

    def failures_within(self, window_s: float, now: float) -> int:
        """Start failures in the last ``window_s`` seconds (older ones are dropped)."""
        cutoff = now - window_s
        while self.start_failures and self.start_failures[0] < cutoff:
            self.start_failures.pop(0)
        return len(self.start_failures)

    def last_words_due(self, now: float) -> bool:
        """DEAD long enough that its stderr need not be waited for any more."""
        return now - self.dead_since >= _LAST_WORDS_S

    # --- the one place a state changes ---

    def _to(self, new: WorkerState, msg: str, *args) -> None:
        if new not in _ALLOWED[self.state]:
            raise TransitionError(f"tier worker {self.index}: {self.state} -> {new} is not a "
                                  f"transition of the worker state machine")
        self.state = new
        logger.log(_LEVEL[new], msg, *args)
