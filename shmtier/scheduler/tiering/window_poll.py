"""The step-window poll thread: collects the storage tiers' finished jobs while the engine
runs its forward pass, so the next step finds them done.

Who calls: the tiering manager starts one (``manager.py``) when a tier sets
``polls_between_steps`` (the fs and obj tiers) and ``tier_poll_window`` > 0, tells its
``StepRhythm`` when each step's scheduling ends (``on_schedule_end``, one clock read and
a deque append: no syscall, no wake-up) and stops the thread at shutdown. Data flow::

    engine thread (holds the manager lock per call)       step-window thread (SCHED_BATCH)
    ... lookups, prepare_store, ... on_schedule_end ──▶ rhythm.step_ended(t)
    forward pass (no manager call) ·························· rounds: lock.acquire(blocking=False)
                                                              -> manager.poll_between_steps()
                                                              every max(interval, period / 8)
                                                              until t + window x period, while
                                                              the last one left work in flight
    update_connector_output, next step's lookups ...         asleep until t + period + interval

Each round first calls the tier's ``submit_between_steps`` (the storage tiers: they leave
a step's stores, deletes and probes to it while rounds come, and send only loads in the
step), then collects finished jobs.

Why rounds stop once nothing is in flight: the engine makes no call during the forward
pass, so after a round that left nothing in flight no later round of that step could
collect anything, and each wake-up costs more than its round (on the 2-vCPU VM ~35 µs of
CPU for the wake-up against ~18 for the round: bench/README.md, "Fewer step-window
rounds"). While work is in flight rounds keep their interval: fewer, bigger rounds late in
the window cost a busy host's steps their tail (the same section).

Why a window and not a periodic thread (``poll_thread.py``): a round in the middle of a
step costs the engine thread more than the round saves. Its wake-up and the GIL hand-offs
put the engine thread off its CPU, where a tier worker may take the rest of the slice
(bench/README.md, "Polling the storage tiers between steps"). So the thread never wakes
on the engine thread's behalf (nothing signals it) and plans its rounds from the period
between the last step ends (median of up to 8 gaps). It runs ``SCHED_BATCH``, so its own
timer wake-ups never preempt a running thread. A round only tries the lock: if the engine
holds it (a step came early), the round is skipped and counted in ``missed``. Without a
rhythm (fewer than 3 step ends, or a step later than its period) it sleeps, up to
``IDLE_SLEEP_MAX_S`` at a time; once no step has ended for ``IDLE_AFTER_PERIODS`` periods
it runs a round at each such wake, so what an engine's last step left to the rounds
(queued stores, a due stats publish) does not wait for a step that may not come.

Where the rounds run: on any CPU (``tier_poll_window_cpu: "any"``, the default), or on
the one the engine thread ended its last step on (``"engine"``: ``step_ended`` carries the
engine thread's CPU, the thread pins itself there when it changes), where the forward pass
leaves it idle, so the next step finds what the rounds touched in its own core's caches
(bench/README.md, "A step with nothing to do").

A round is ``poll()`` under the lock; a failing one is logged at most once a second and,
after 30 s of failures, ends the thread (``poll_thread.FailedRounds``): the per-step polls
still serve every tier, as they do with the window off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from shmtier.scheduler.tiering.poll_thread import FailedRounds

logger = logging.getLogger(__name__)

#: step ends needed before the rhythm plans a round (two gaps)
MIN_STEP_ENDS = 3
#: step ends remembered; the period is the median of their gaps
STEP_ENDS_KEPT = 9
#: rounds come at least this share of the period apart, and the first this long after a
#: step's end (one round interval with short steps): 8 rounds a window at most
ROUND_SPACING_SHARE = 1 / 8
#: longest sleep without a rhythm (engine idle, or a step later than its period)
IDLE_SLEEP_MAX_S = 0.05
#: no step end for this many periods: the engine idles, and a round now and then (the
#: lock permitting) sends what its last step left queued and publishes its stats
IDLE_AFTER_PERIODS = 3
JOIN_TIMEOUT_S = 5.0


def no_cpu() -> int:
    """The CPU reader of a manager that does not follow the engine thread: unknown."""
    return -1


def cpu_reader() -> Callable[[], int]:
    """The calling thread's current CPU: libc's ``sched_getcpu`` (a vDSO call, ~0.1 µs
    through ctypes), or ``no_cpu`` where it is missing."""
    try:
        import ctypes

        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
        getcpu.restype, getcpu.argtypes = ctypes.c_int, []
        getcpu()
        return getcpu
    except (OSError, AttributeError):
        return no_cpu


class StepRhythm:
    """When the engine is between steps, learnt from when its steps' scheduling ended.

    ``step_ended`` is called by the engine thread and ``round_ran`` by the thread after
    a round (both under the manager lock), ``plan`` by the step-window thread; a deque's
    append and indexing are atomic under the GIL.
    Pure arithmetic on the times it is given: tests pass their own clock."""

    def __init__(self, window: float, interval_s: float):
        if not 0.0 < window < 1.0:
            raise ValueError(f"window must be in (0, 1), got {window!r}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.window = window
        self.interval_s = interval_s
        self._ends: deque[float] = deque(maxlen=STEP_ENDS_KEPT)
        self._rounds = 0  # rounds run since the last step end
        self._round_at, self._left_work = 0.0, True  # the last round: begun at, left work
        self.engine_cpu = -1  # the CPU the engine thread ended its last step on
        #: whether a round ran between the last two step ends: while rounds come, work a
        #: step leaves to them is done within a forward pass
        self.rounds_came = False
        self._period, self._period_at = 0.0, float("nan")  # period() and the end it is of

    def step_ended(self, now: float, cpu: int = -1) -> None:
        """A step's scheduling ended at ``now`` on CPU ``cpu`` (-1: unknown)."""
        self._ends.append(now)
        self.engine_cpu = cpu
        self.rounds_came, self._rounds = self._rounds > 0, 0

    def round_ran(self, at: float, left_work: bool = True) -> None:
        """A round ran, begun at ``at`` (the thread, under the manager lock);
        ``left_work``: something was still in flight after it, for a later round to
        collect."""
        self._rounds += 1
        self._round_at, self._left_work = at, left_work

    @property
    def came(self) -> bool:
        """A round ran since the last step end (the step now under way follows a forward
        pass with rounds)."""
        return self._rounds > 0

    @property
    def quiet(self) -> bool:
        """A round ran since the last step end and left nothing in flight: until the
        engine sends something, the polled tiers have nothing to collect."""
        return self._rounds > 0 and not self._left_work

    def period(self) -> float | None:
        """Median gap between the remembered step ends; None before ``MIN_STEP_ENDS``.
        Worked out once per step end (``plan`` asks at every wake-up)."""
        if len(self._ends) < MIN_STEP_ENDS:
            return None
        last = self._ends[-1]
        if last != self._period_at:
            ends = list(self._ends)  # the engine thread may append meanwhile
            gaps = sorted(b - a for a, b in zip(ends, ends[1:]))
            self._period, self._period_at = gaps[len(gaps) // 2], last
        return self._period

    def plan(self, now: float) -> tuple[bool, float]:
        """``(poll now, then sleep seconds)``. Rounds from ``first`` (one round interval,
        or ``ROUND_SPACING_SHARE`` of the period if longer) after the last step's end,
        ``first`` apart, until ``window`` x period after it, while the last round left
        work in flight; once a round leaves nothing in flight, none until the next step
        (the engine makes no call in between, so nothing new can start). Then sleep past
        the next step's expected end. A wake-up ``first`` / 4 early counts as on time (a
        timer's slack, a step that ended a little late), so it does not cost a wake-up
        of its own. With no step end for ``IDLE_AFTER_PERIODS`` periods, poll at each
        backed-off wake. The thread plans again after a round, for its sleep
        (``round_ran`` has told what the round left)."""
        period = self.period()
        if period is None:
            return False, IDLE_SLEEP_MAX_S
        end = self._ends[-1]
        first = max(self.interval_s, period * ROUND_SPACING_SHARE)
        early = first / 4
        opens, closes = end + first, end + self.window * period
        next_opens = end + period + first
        if now < opens - early:
            return False, opens - now
        if now < closes:
            if self._rounds and not self._left_work:  # nothing in flight: done till the step
                return False, next_opens - now
            due = self._round_at + first if self._rounds else now
            if now < due - early:  # a wake-up between rounds (a capped sleep)
                return False, due - now
            nxt = now + first
            return True, (nxt if nxt < closes else next_opens) - now
        if now < next_opens - early:
            return False, next_opens - now
        # the next step is late (a long step, or the engine idles): back off, and poll
        # once it looks idle (a woken thread may have missed the last step's window)
        return (now >= end + IDLE_AFTER_PERIODS * period,
                min(max(first, (now - end) / 4), IDLE_SLEEP_MAX_S))


class StepWindowPollThread:
    """A daemon thread running ``poll()`` under ``lock`` inside the windows ``rhythm``
    plans (started now). ``poll`` returns False when nothing is left in flight that a
    later round could collect (the window's collecting round is then skipped), anything
    else otherwise. ``rounds`` and ``missed`` count rounds run and rounds skipped
    because the lock was held (for benches and tests)."""

    def __init__(self, lock: threading.Lock, poll: Callable[[], bool | None],
                 rhythm: StepRhythm, on_engine_cpu: bool = False):
        """``on_engine_cpu``: run each round on the CPU the engine thread ended its last
        step on (``rhythm.engine_cpu``; the thread's affinity changes only when that
        CPU does, one syscall), where the forward pass leaves it idle: what the round
        touches is then in that core's caches when the next step comes, not written from
        another core (bench/README.md, "Per-step fixed costs")."""
        self._lock = lock
        self._on_engine_cpu = on_engine_cpu
        self._poll = poll
        self.rhythm = rhythm
        self._stop = threading.Event()
        self.rounds = 0
        self.missed = 0
        self._thread = threading.Thread(target=self._run, name="shmtier_step_window_poll",
                                        daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        return self._thread.native_id

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> bool:
        """Stop and join the thread; False if it did not exit within JOIN_TIMEOUT_S."""
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("step-window poll thread did not exit within %.1f s", JOIN_TIMEOUT_S)
            return False
        return True

    def _run(self) -> None:
        try:  # this thread only (pid 0): a timer wake-up never preempts a running thread
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except (OSError, AttributeError) as e:
            logger.info("step-window poll thread keeps its scheduling policy: %s", e)
        failures = FailedRounds("step-window poll")
        plan, stopped, sleep = self.rhythm.plan, self._stop, time.sleep
        follow = self._on_engine_cpu
        allowed = os.sched_getaffinity(0) if follow else set()
        pinned = -1
        while not stopped.is_set():
            now = time.monotonic()
            poll_now, sleep_s = plan(now)
            if poll_now:
                cpu = self.rhythm.engine_cpu
                if follow and cpu != pinned and cpu in allowed:
                    try:
                        os.sched_setaffinity(0, (cpu,))
                        pinned = cpu
                    except OSError:  # the CPU left the process's set meanwhile
                        follow = False
                if self._lock.acquire(blocking=False):
                    try:
                        left_work = self._poll() is not False
                        self.rhythm.round_ran(now, left_work)
                        self.rounds += 1
                        failures.succeeded()
                    except Exception:  # never silently: the per-step polls still serve
                        failures.failed()
                    finally:
                        self._lock.release()
                    if failures.give_up():
                        return
                    sleep_s = plan(time.monotonic())[1]  # after the round, what it left
                else:
                    self.missed += 1
            # time.sleep, not stopped.wait: ~20 µs of CPU per wake-up here against ~35
            # for Event.wait (a lock made and acquired with a timeout), at ~4 wake-ups a
            # step (bench/README.md, "Cost per byte over a long run"); capped so that
            # stop() is answered within IDLE_SLEEP_MAX_S
            sleep(min(sleep_s, IDLE_SLEEP_MAX_S))
