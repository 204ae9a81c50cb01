"""The tier worker pool's supervisor, as the scheduler process drives it.

Who calls: the scheduler halves of worker-backed tiers (e.g. ``fs``), in the
scheduler process, on the scheduler thread (under the tiering manager's lock).
``submit``, ``poll``, ``take`` and the queries never block (no wait, no sleep, no
syscall that waits for another process); ``drain`` and ``shutdown`` do (bounded).
The only other threads are one stderr reader per spawned worker (``_StderrTail``):
each copies its worker's stderr to ours and keeps the last line.

::

    scheduler thread                                 tier worker process i
    submit(op, tier, keys, rows) ─ dispatch.plan ─▶ job ring i ──▶ workers/job_loop.py:
      → pool job id, or None: not accepted                         take, run the tier
        (rings full: backpressure; or ``broken``)                  backend, answer
    poll() ◀───────────────────────────────────── result ring i ◀─┘
      dispatch.complete → done[tier] → take(tier)
      every 50 ms, the health check: one WorkerRecord per slot (worker_state.py)
        gone?  spawn mode: Popen.poll(); external mode: the slot's holder changed or died
        own heartbeat advanced → HEALTHY
        a part older than job_timeout_s, or own heartbeat older than
          heartbeat_timeout_s while it holds parts and its threads neither ran nor
          waited for a CPU meanwhile (late_beats.py: a starved worker is slow, not
          hung; one waiting on its medium inside a backend call beats meanwhile,
          workers/busy_beat.py: busy, not hung) → SIGKILL → HUNG; spawn mode: its load parts fail at once, their
          rows held (PoolResult.release) until the process is gone
        gone → rings recovered, its other parts failed exactly once, the rows
          of its failed loads released → DEAD
          → RESTARTING (backoff; spawn mode) or STARTING (external: the next holder)
          → BROKEN: one slot failed to start max_start_failures times within
            start_failure_window_s (never HEALTHY in between)

Broken (like concurrent.futures' BrokenProcessPool): all workers run the same
tier backends, so a worker that cannot start means the pool cannot serve. The
pool then logs one ERROR naming the reason, sets ``broken`` (the reason; None
while the pool is fine), restarts nothing more, kills its running workers and
fails every outstanding job as soon as their processes are gone, and ``submit``
returns None at once without side effects. A caller tells the two kinds of None
apart by ``broken``: None means the rings are full (try later), a string means
never (a worker-backed tier answers MISS instead of queueing).

Ordering: all jobs for one key go to one worker while any job for that key is
outstanding (``dispatch.py``). A full job ring makes ``submit`` return None
without side effects: that is the backpressure signal.

Lanes: the last ``config.options.promotion_workers`` workers run at the priority they
inherit (the engine's) and take the unbound keys of loads and probes; the others run in the
background (``tier_worker_niceness``, ``tier_worker_policy``) and take stores and
deletes (``shared/lanes.py``; each worker sets its own priority from its index and the
config, spawned or external). The health check tells ``dispatch`` which workers run, so
a lane whose workers are all down or restarting lends the other lane's.

Modes: ``spawn`` starts the workers as fresh interpreters (``python -m
shmtier.workers.job_loop``: never a fork of the scheduler, which may hold CUDA
state, and no re-import of the caller's main module); ``external`` expects
``shmtier workers --engine-id ID`` (``workers/external.py``) to run them and
judges them by their slot claims and heartbeats. The mode is written into the
segment's ``PoolConfig`` (``shmtier workers`` refuses a spawn-mode engine).

Warm restart (a scheduler re-attached to a dead one's segment): the pool is built after
the segment was claimed, which bumped its owner generation. Before the pool writes its
config and re-creates the rings, it waits for slots still held by the dead scheduler's
workers to be freed (they leave on seeing the new generation) and SIGKILLs those that do
not leave within 2 s (``old_holders.py``; each one is logged and kept in
``old_holders``), so no slot ever has two workers. Every worker it spawns gets the owner
generation on its command line and serves only that one (``workers/job_loop.py``).

A part's deadline: a worker that holds a part ``job_timeout_s`` after it was
submitted is judged hung and killed (spawn mode: its process; external mode:
SIGKILL to the slot's holder, verified by pid and start time) *before* its parts
are failed. In spawn mode its load parts fail right after the kill (the request need
not wait for the process to be gone: a SIGKILLed process in uninterruptible I/O may take
long), with a ``PoolResult.release`` whose event is set once it is reaped, so a load
never writes a CPU row after the row was reused: the tier hands the event to the manager
as the promotion's ``deferred_release``, which keeps the rows out of the free pool until
then. Its other parts (a store still reading pinned rows) fail once it is gone, and so do
all parts in external mode: there the next holder may claim the slot before the pool
recovers it and run the parts still queued (``_fail_slot``), so a load part failed
early could still be written by it after its rows were released. ``drain`` waits for
both.

Size (over 600 lines): spawn, health check, restart and result collection share the
workers' table and its states; the pieces that stand alone are its sibling modules.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from shmtier.scheduler.pool.dispatch import Dispatch, PoolJobId, PoolResult
from shmtier.scheduler.pool.late_beats import LateBeats
from shmtier.scheduler.pool.old_holders import OldHolder, retire_old_holders
from shmtier.scheduler.pool.row_release import RowRelease
from shmtier.scheduler.pool.worker_state import RUNNING, WorkerRecord, WorkerState
from shmtier.shared import jobs
from shmtier.shared.pool_config import EXIT_BACKENDS_FAILED, WORKER_MODES, PoolConfig
from shmtier.shared.ring import RingBusyError, RingSet

logger = logging.getLogger(__name__)

_HEALTH_EVERY_S = 0.05
_DRAIN_BATCH = 256  # results taken per ring call
MODES = WORKER_MODES

__all__ = ["MODES", "PoolJobId", "PoolResult", "WorkerPool", "WorkerState"]


class _StderrTail:
    """Copies a spawned worker's stderr to the scheduler's (fd 2, where the worker's
    own stderr went before) and keeps its last non-empty line: the reason a worker
    that failed to start names in its last words."""

    def __init__(self, pipe: Any, label: str):
        self.last = ""
        self._pipe = pipe
        self._thread = threading.Thread(target=self._run, name=f"shmtier-{label}-stderr",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                view = memoryview(line)
                while view:
                    try:
                        view = view[os.write(2, view):]
                    except OSError:
                        break
                text = line.decode(errors="replace").strip()
                if text:
                    self.last = text[-300:]
        except (OSError, ValueError):
            pass
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass

    @property
    def done(self) -> bool:
        """The pipe reached its end (the worker is gone): ``last`` is final."""
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class WorkerPool:
    """The tier workers of one engine (see the module docstring).

    ``heartbeat_timeout_s``: a worker holding parts whose own heartbeat is older is
    hung, unless it ran or waited for a CPU meanwhile (``late_beats.py``). It does not
    bound one request to a tier's medium: a worker beats while it waits inside a
    backend call (``workers/busy_beat.py``); the part deadline bounds that.
    ``max_start_failures`` start failures of one slot within ``start_failure_window_s``
    break the pool. The part deadline is
    ``config.options.tier_job_timeout_s``. Construction blocks while a previous scheduler's workers
    still hold slots (a warm restart; at most a few seconds, see the module docstring).
    """

    def __init__(self, engine_id: str, segment: Any, config: PoolConfig, *, mode: str = "spawn",
                 heartbeat_timeout_s: float = 2.0, max_start_failures: int = 3,
                 start_failure_window_s: float = 30.0):
        if mode not in MODES:
            raise ValueError(f"tier worker pool mode {mode!r}: must be one of {MODES}")
        if max_start_failures < 1:
            raise ValueError(f"max_start_failures={max_start_failures}: must be at least 1")
        config = dataclasses.replace(
            config, options=dataclasses.replace(config.options, workers=mode))
        self.engine_id = engine_id
        self.config = config
        self.mode = mode
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_start_failures = max_start_failures
        self.start_failure_window_s = start_failure_window_s
        self.n = config.options.num_tier_workers
        #: the owner incarnation this pool serves; its workers exit once it changes
        self.generation = segment.owner_generation()
        #: the previous scheduler's workers found holding slots (warm restart)
        self.old_holders: list[OldHolder] = retire_old_holders(segment.rings)
        for old in self.old_holders:
            logger.warning("tier worker slot %d was still held by pid %d, a worker of the "
                           "previous scheduler of this segment: %s after %.2f s", old.slot,
                           old.pid, "killed" if old.killed else "it left", old.gone_after_s)
        config.write(segment.rings)
        self.rings = RingSet.create(segment.name, segment.rings, self.n,
                                    config.slots, config.slot_size)
        self._job_rings = [self.rings.worker(w).jobs for w in range(self.n)]
        self._result_rings = [self.rings.worker(w).results for w in range(self.n)]
        self._dispatch = Dispatch(self.n, config.slot_size - 8, config.options.tier_job_timeout_s,
                                  config.options.promotion_workers)
        self._workers = [WorkerRecord(w) for w in range(self.n)]
        self._procs: list[subprocess.Popen | None] = [None] * self.n  # spawn mode
        self._tails: list[_StderrTail | None] = [None] * self.n  # spawn mode
        self._claims_seen = [0] * self.n  # external mode: slot claims accounted for
        # per slot: releases of the rows its killed process's failed loads may still
        # write, let go once that process is gone (``_bury``)
        self._reaping: dict[int, list[RowRelease]] = {}
        self._next_health = 0.0
        self._closed = False
        #: None while the pool works; once broken, the reason (for good).
        self.broken: str | None = None
        # counters (for metrics)
        self.restarts_total = 0  # replacements scheduled (spawn mode)
        self.failed_parts_total = 0  # parts failed because their worker was gone
        self.start_failures_total = 0  # workers that died before becoming healthy
        self.hung_total = 0  # workers killed as hung (heartbeat or deadline)
        self.timed_out_total = 0  # of those, killed for a part past its deadline
        #: the judge of late heartbeats (its ``spared_total``: late but busy, not killed)
        self.late_beats = LateBeats()
        if mode == "spawn":
            try:
                now = time.monotonic()
                for w in range(self.n):
                    self._spawn(w, now)
            except BaseException:
                self.shutdown()
                raise

    # --- queries ---

    def worker_states(self) -> list[WorkerState]:
        """Each worker slot's state, by index."""
        return [rec.state for rec in self._workers]

    def healthy_workers(self) -> list[tuple[int, int]]:
        """``(index, pid)`` of each worker process that is running and has beaten
        (``shmtier run``'s chaos options kill these)."""
        return [(rec.index, rec.pid) for rec in self._workers
                if rec.state is WorkerState.HEALTHY and rec.pid]

    def outstanding(self) -> int:
        """Pool jobs submitted and not yet finished or failed."""
        return len(self._dispatch.parents)

    def rows_held(self) -> bool:
        """Whether a killed worker that may still write rows of failed loads is not gone
        yet (their releases are not set)."""
        return bool(self._reaping)

    def queued_jobs(self) -> int:
        """Jobs put in the job rings and not yet taken by a worker. With no job outstanding
        that is 0 without reading the rings (a job is put in a ring only by ``submit``,
        which counts it outstanding until it is answered or failed, and a failed worker's
        queued jobs are discarded with its slot): the rings' counters are the workers'
        cache lines, so an idle step does not fetch them."""
        if not self._dispatch.parents:
            return 0
        return sum([ring.depth() for ring in self._job_rings])

    # --- submit ---

    def submit(self, op: str, tier: int, keys: list[bytes], rows: list[int] | None = None,
               args: dict | None = None) -> PoolJobId | None:
        """Queue one job; returns its pool job id, or None when it was not accepted:
        the rings are full (``broken`` is None: try again later) or the pool is broken
        (``broken`` says why: it never accepts a job again). Never blocks.

        Raises ValueError for an unknown op or a job that can never fit the rings."""
        if self.broken is not None:
            return None
        dispatch = self._dispatch
        parent_id, planned = dispatch.plan(op, tier, keys, rows, args)
        if len(planned) == 1:  # the common case: one slot, so try_put alone decides
            w, _, payload, _, _ = planned[0]
            if not self._job_rings[w].try_put(payload):
                return None
        else:  # every part fits, or none is put
            need = [0] * self.n
            for w, *_ in planned:
                need[w] += 1
            for w in range(self.n):
                ring = self._job_rings[w]
                if need[w] > ring.slots:
                    raise ValueError(
                        f"{op} job of {len(keys)} keys needs {need[w]} ring slots on worker {w}, "
                        f"more than its ring holds ({ring.slots}): submit fewer keys per job"
                    )
                if need[w] and ring.free_slots() < need[w]:
                    return None
            for w, _, payload, _, _ in planned:
                if not self._job_rings[w].try_put(payload):
                    raise RuntimeError(f"job ring of worker {w} refused a job after a capacity check")
        dispatch.commit(parent_id, op, tier, keys, planned, time.monotonic())
        return parent_id

    # --- results ---

    def poll(self) -> None:
        """Collect results and check worker health (never blocks)."""
        for w, ring in enumerate(self._result_rings):
            if ring.depth():  # two loads from the segment; no semaphore syscall on an empty ring
                self._drain_results(w, ring)
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + _HEALTH_EVERY_S
            self._check_health(now)

    def take(self, tier: int) -> list[PoolResult]:
        """Finished jobs of ``tier`` since the last call (call ``poll`` first)."""
        return self._dispatch.take(tier)

    def _drain_results(self, w: int, ring: Any) -> None:
        complete = self._dispatch.complete
        while True:
            batch = ring.get_many(_DRAIN_BATCH, timeout_s=0)
            for raw in batch:
                try:
                    result = jobs.decode_result(raw)
                except jobs.MalformedResult as e:
                    logger.error("tier worker %d sent a malformed result: %s", w, e)
                    continue
                complete(result)
            if len(batch) < _DRAIN_BATCH:
                return  # the ring is empty (a full batch may have left more)

    # --- health ---

    def _check_health(self, now: float) -> None:
        overdue = self._dispatch.overdue(now) if self._dispatch.parts else {}
        for rec in self._workers:
            self._check_worker(rec, now, overdue.get(rec.index))
        self._dispatch.set_running([rec.index for rec in self._workers if rec.state in RUNNING])

    def _check_worker(self, rec: WorkerRecord, now: float, late_s: float | None) -> None:
        state, w = rec.state, rec.index
        if state is WorkerState.BROKEN:
            return
        if state is WorkerState.RESTARTING:
            if late_s is not None:
                self._fail_unserved(rec, late_s)
            if now >= rec.restart_at:
                self._spawn(w, now)
            return
        if state is WorkerState.DEAD:
            self._after_death(rec, now)
            return
        if self.mode == "external" and not rec.pid:
            self._look_for_holder(rec, now)
            if rec.state is WorkerState.BROKEN:
                return
            if not rec.pid:
                if late_s is not None:
                    self._fail_unserved(rec, late_s)
                return
        how = self._gone(rec)
        if how is not None:
            self._bury(rec, how, now)
            return
        if state is WorkerState.HUNG:
            return  # killed; gone at a later check
        beat = self.rings.worker(w).last_beat()
        own = beat.pid == rec.pid and beat.beat_ns
        if own:
            rec.beat_seen(beat.beat_ns, now)
        # a part past its deadline: the worker is hung, unless the part was queued
        # before this process started and it has not had job_timeout_s of its own yet
        # (parts queued while the slot was restarting)
        if late_s is not None and now - rec.started >= self.config.options.tier_job_timeout_s:
            self.timed_out_total += 1
            self._kill(rec, f"hung (a job outstanding for {late_s:.1f} s, past its "
                            f"{self.config.options.tier_job_timeout_s:g} s deadline)")
        elif own and self._dispatch.load[w] > 0:
            age = beat.age_s()
            if self.late_beats.hung(w, rec.pid, beat.beat_ns, age, now, self.heartbeat_timeout_s):
                self.late_beats.forget(w)
                self._kill(rec, "hung (no heartbeat for %.1f s)" % age)
        else:
            self.late_beats.forget(w)

    def _gone(self, rec: WorkerRecord) -> str | None:
        """How the slot's current process ended, or None while it runs."""
        if self.mode == "spawn":
            proc = self._procs[rec.index]
            code = None if proc is None else proc.poll()
            if proc is not None and code is None:
                return None
            return f"died (exit code {code})"
        beat = self.rings.worker(rec.index).last_beat()
        if beat.pid != rec.pid or beat.start_time != rec.start_time:
            return "died (left its slot; its output is in `shmtier workers`' stderr)"
        if not self.rings.worker(rec.index).holder_alive():
            return "died"
        return None

    def _look_for_holder(self, rec: WorkerRecord, now: float) -> None:
        """External mode, no holder known: take note of a new one, and count the
        holders that claimed the slot and were gone between two checks. The slot of
        such a holder still names it: it is recovered (its rings resynced, the parts
        it held failed), or ``shmtier workers``, which starts the next process only
        into a free slot, would wait for it for ever."""
        slot = self.rings.worker(rec.index)
        beat = slot.last_beat()
        alive = bool(beat.pid) and slot.holder_alive()
        unseen = beat.claims - self._claims_seen[rec.index] - (1 if alive else 0)
        self._claims_seen[rec.index] = beat.claims
        if unseen > 0:
            rec.unseen_start_failures(unseen, now)
            self.start_failures_total += unseen
            self._break_if_failing(rec, now)
        if beat.pid and not alive:
            self._fail_slot(rec.index, f"tier worker {rec.index} (pid {beat.pid}) died "
                                       f"before the pool saw it")
        elif alive and self.broken is None:
            rec.holder_seen(beat.pid, beat.start_time, now)

    def _kill(self, rec: WorkerRecord, why: str) -> None:
        """SIGKILL the slot's current process (HUNG); spawn mode: its load parts fail
        now, their rows held until it is reaped; its other parts fail once it is gone."""
        w = rec.index
        killed = False
        if self.mode == "spawn":
            proc = self._procs[w]
            if proc is not None and proc.poll() is None:
                proc.kill()
                killed = True
        else:
            slot = self.rings.worker(w)
            beat = slot.last_beat()
            # the recorded holder only (pid and start time), and only while it runs:
            # a dead holder's pid may have been reused
            if (beat.pid == rec.pid and beat.start_time == rec.start_time
                    and slot.holder_alive()):
                try:
                    os.kill(rec.pid, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    pass
        if why.startswith("hung"):
            self.hung_total += 1
        rec.killed(why)
        if killed and self.mode == "spawn":  # (external: see the module docstring)
            self._fail_loads_now(rec, why)

    def _fail_loads_now(self, rec: WorkerRecord, why: str) -> None:
        """Fail the load parts of worker ``rec``, SIGKILLed just now and perhaps still
        writing their rows: their pool jobs carry a release, let go when it is gone."""
        w = rec.index
        self._drain_results(w, self._result_rings[w])  # what it finished is valid
        held = self._dispatch.fail_loads(w, f"tier worker {w} (pid {rec.pid}) {why}")
        if held:
            self._reaping.setdefault(w, []).extend(held)
            self.failed_parts_total += len(held)
            logger.warning("tier worker %d (pid %d): %d load part(s) failed now; their rows "
                           "stay held until the process is gone", w, rec.pid, len(held))

    def _let_go_rows(self, w: int) -> None:
        """Worker ``w``'s killed process is gone: the rows of its failed loads are free."""
        self._dispatch.forget_failed_early(w)
        for release in self._reaping.pop(w, ()):
            release.let_go()

    def _bury(self, rec: WorkerRecord, how: str, now: float) -> None:
        """The slot's process is gone: recover its rings, fail its parts, count a
        start failure, and decide (after its last words) what comes next."""
        w = rec.index
        code = None
        if self.mode == "spawn":
            proc = self._procs[w]
            code = proc.returncode if proc is not None else None
            self._procs[w] = None
        why = rec.kill_reason if rec.state is WorkerState.HUNG else how
        # never healthy, or its backends could not be built (it may have beaten once)
        start_failure = self.broken is None and (not rec.was_healthy
                                                 or code == EXIT_BACKENDS_FAILED)
        failed = self._fail_slot(w, f"tier worker {w} (pid {rec.pid}) {why}")
        failed += len(self._reaping.get(w, ()))  # (failed at the kill)
        self._let_go_rows(w)
        if start_failure:
            self.start_failures_total += 1
        rec.gone(why if why == how else f"{why}, {how}", now, start_failure, failed)
        if self.mode == "external":
            self._claims_seen[w] = self.rings.worker(w).last_beat().claims
        if (self.broken is None and self.mode == "spawn"
                and rec.failures_within(self.start_failure_window_s, now) < self.max_start_failures):
            self.restarts_total += 1  # decided now; started after its last words and the backoff
        self._after_death(rec, now)

    def _after_death(self, rec: WorkerRecord, now: float) -> None:
        """DEAD: once its last stderr line is in (spawn mode), restart it, wait for the
        next holder (external mode), or break the pool."""
        w = rec.index
        tail = self._tails[w]
        if tail is not None:
            if not tail.done and not rec.last_words_due(now):
                return  # its stderr is still being read: the next check
            rec.last_words(tail.last)
            self._tails[w] = None
        self._break_if_failing(rec, now)
        if self.broken is not None:
            rec.broke()
        elif self.mode == "spawn":
            rec.restart_after_backoff(now)
        else:
            rec.await_holder()

    def _break_if_failing(self, rec: WorkerRecord, now: float) -> None:
        if self.broken is None and (rec.failures_within(self.start_failure_window_s, now)
                                    >= self.max_start_failures):
            self._break(f"tier worker {rec.index} failed to start {self.max_start_failures} "
                        f"times within {self.start_failure_window_s:g} s without becoming "
                        f"healthy (last: {rec.last_exit})")

    def _break(self, reason: str) -> None:
        """Mark the pool broken (once): stop every worker and fail every job."""
        self.broken = reason
        logger.error("tier worker pool of engine %s is broken: %s. Its %d outstanding jobs "
                     "fail and it accepts no new ones.", self.engine_id, reason,
                     len(self._dispatch.parents))
        for rec in self._workers:
            if rec.state in RUNNING:
                if rec.pid:
                    self._kill(rec, "stopped (the pool is broken)")
                    continue
                self._fail_slot(rec.index, f"tier worker {rec.index}: the pool is broken")
                rec.broke()
            elif rec.state is WorkerState.RESTARTING:
                self._fail_slot(rec.index, f"tier worker {rec.index}: the pool is broken")
                rec.broke()
        self._dispatch.set_running([])

    def _fail_slot(self, w: int, why: str) -> int:
        """Recover worker ``w``'s rings (its process is gone) and fail every part it
        held or had queued; returns how many."""
        slot = self.rings.worker(w)
        try:
            slot.recover(discard_jobs=True)
        except RingBusyError:
            # external mode: a new holder claimed the slot already (the last one left
            # its slot cleanly) and may run the queued parts; a part it never answers
            # fails at its deadline
            logger.warning("tier worker %d: a new holder runs already; its queued jobs "
                           "stay with it", w)
            return 0
        self._drain_results(w, slot.results)  # what it finished is valid
        failed = self._dispatch.fail_worker(w, why)
        self.failed_parts_total += failed
        return failed

    def _fail_unserved(self, rec: WorkerRecord, late_s: float) -> None:
        """Parts past their deadline in the job ring of a slot with no process (spawn
        mode: restarting; external mode: no holder): nothing can run them, fail them."""
        self.timed_out_total += 1
        hint = ("it is restarting" if self.mode == "spawn" else
                f"is `shmtier workers --engine-id {self.engine_id}` running?")
        why = (f"tier worker {rec.index}: its jobs waited {late_s:.1f} s for a worker "
               f"process ({hint})")
        logger.warning("%s; failing them", why)
        self._fail_slot(rec.index, why)

    def _spawn(self, w: int, now: float) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shmtier.workers.job_loop", self.engine_id, str(w),
             str(self.generation)],
            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._procs[w] = proc
        self._tails[w] = _StderrTail(proc.stderr, f"worker{w}")
        self._workers[w].spawned(proc.pid, now)

    # --- drain and shutdown ---

    def drain(self, timeout_s: float = 60.0) -> None:
        """Block until every submitted job is finished or failed (results stay in ``take``)
        and every release of rows a killed worker may write is set (it is gone)."""
        deadline = time.monotonic() + timeout_s
        parents = self._dispatch.parents
        while parents or self._reaping:
            self.poll()
            if not (parents or self._reaping):
                break
            if time.monotonic() > deadline:
                if parents:
                    raise TimeoutError(f"{len(parents)} tier worker jobs still outstanding "
                                       f"after {timeout_s:g} s")
                raise TimeoutError(
                    f"tier workers {sorted(self._reaping)} were killed but are not gone "
                    f"after {timeout_s:g} s; the rows of their failed loads stay held")
            time.sleep(0.001)

    def _running(self, w: int) -> bool:
        if self.mode == "spawn":
            proc = self._procs[w]
            return proc is not None and proc.poll() is None
        return self.rings.worker(w).holder_alive()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Let queued jobs finish (up to ``timeout_s``), stop the workers (spawn mode),
        fail what is left, remove the rings. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if (self._dispatch.parents and self.broken is None
                    and any(self._running(w) for w in range(self.n))):
                try:
                    self.drain(timeout_s)
                except TimeoutError:
                    logger.warning("tier worker pool: %d jobs unfinished at shutdown",
                                   len(self._dispatch.parents))
            stop = jobs.encode_job(jobs.Job(jobs.WireJobId(0), "stop", 0))
            for w in range(self.n):
                proc = self._procs[w]
                if proc is not None and proc.poll() is None and not self._job_rings[w].try_put(stop):
                    proc.terminate()  # ring full: SIGTERM makes it exit after its current batch
            deadline = time.monotonic() + timeout_s
            for w, proc in enumerate(self._procs):
                if proc is None:
                    continue
                try:
                    proc.wait(max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
                self._procs[w] = None
            self._dispatch.fail_all("tier worker pool shut down")
            # spawn mode: every process was waited for above; external mode: the engine
            # is shutting down, nothing reuses a row any more
            for w in list(self._reaping):
                self._let_go_rows(w)
            for w, tail in enumerate(self._tails):
                if tail is not None:
                    tail.join(1.0)
                    self._tails[w] = None
        finally:
            self.rings.close()
