"""The tier worker process: take jobs from its ring, run them, answer results.

Runs in: one tier worker process (spawned by the pool, or started by
``shmtier workers``). Imports neither torch nor vLLM.

::

    join segment (geometry from its header) ─▶ set its priority by its lane (below)
      ─▶ attach rings of worker i ─▶ claim slot i
    loop: owner generation still mine? else exit (see below)
          jobs.get_many(≤ 128): non-blocking takes while jobs came in the last 0.25 s,
          0.5 ms after a job and then backing off to 2 ms (2 -> 8 ms in a background
          worker of a pool with a promotion lane), else a sleep in the semaphore
          (heartbeat timeout)
          beat(); owner generation still mine? else exit
          decode all (malformed → error result, keep running) into the queue, loads first
          for each queued job:
                        backend[tier].handler(op): its method for the op (the backend's
                        HANDLERS table), run in slices (8 keys; stores also at most 2 MiB);
                        before each slice of a store: take new jobs from the ring, run
                        their loads at once (a request waits on each), queue the rest;
                        tell the backend it is behind while the queued store work
                        exceeds _HURRY_BYTES (codec mode "auto": an input of
                        compression by cost, shared/codec_choice.py)
                        results.try_put(encoded result): a store or delete after
                        each slice (more=True but the last), other ops at the end
          every few seconds: owner (scheduler) alive? else exit
    meanwhile, while the job thread is inside a backend call (it may wait on the medium
    for as long as the backend's timeouts allow): the busy-beat thread beats every
    heartbeat interval (``workers/busy_beat.py``), so a slow medium is busy, not hung

Lane (``shared/lanes.py``), from the worker's index and the pool config in the segment,
so spawned and external workers alike: a background worker adds ``tier_worker_niceness``
to the niceness it inherited and runs under ``tier_worker_policy`` (SCHED_BATCH by
default); a promotion worker (the last ``promotion_workers`` slots) keeps the niceness it
inherited and runs under SCHED_OTHER. The pool sends the promotion lane loads and probes; a worker
runs whatever jobs it is sent all the same (a store bound to it by a key's ordering).

Owner generation (``Segment.owner_generation``: a header word the owner bumps when it
claims the segment, at creation and at each warm re-attach): a worker serves the owner
incarnation that started it: the pool passes its generation on the command line
(``job_loop ENGINE_ID INDEX GENERATION``); one started without it (``shmtier workers``)
takes the word as it reads it once it has attached the rings, which only a live owner
makes. The worker compares the word (one 8-byte load) after joining, after claiming its
slot, at every wake-up of its loop, before every job and slice of a job, and before
putting a result. Once it differs, the scheduler that started it died and a new one
re-attached (``warm_restart``), whose pool serves the slots itself: the worker exits at
once (code 3), leaving the job in hand unfinished and unanswered and touching no further
row or ring. The new pool waits for such workers to be gone before it re-creates the
rings (``shmtier/scheduler/pool/old_holders.py``).

Each result is added to the slot's counters in the segment just before it is answered
(``WorkerRings.tally``: job parts, logical bytes, codec ns, failed keys; read by
``shmtier top`` and the external pool's metrics endpoint); with each job's last answer
(also just before it), what the job's backend counted that no result shows (``TierBackend.worker_counts``: symbolic
links refused, corrupt chunks it could not remove, listing errors) is added to the
slot's counters of that tier (``WorkerRings.tally_tier``; the tier's scheduler half
exports them as metrics, ``shmtier top`` shows them).
After each job the backend's ``take_flags()`` (``jobs.ResultFlag`` bits it raised,
e.g. that its namespace was reset) go with the job's result.
A job for a tier that has no worker half, or for an op its backend does not
handle, is answered with an error result (every key ERROR, the reason in the
result's error text). A result is the backend's per-key outcomes, logical and
stored bytes and seconds (``BatchResult.to_result``), split into several when it
does not fit a ring slot. Stores and deletes are answered slice by slice, so a worker
killed mid-job takes only its unanswered keys' outcomes with it (the pool fails those,
and the scheduler half probes for the files of a failed store). The loop never raises
for a job; it exits on ``stop``, when the owner dies, or on SIGTERM (after finishing
the job in hand). A worker whose tier backends cannot be built exits with
``EXIT_BACKENDS_FAILED`` (4): the pool counts that as a failure to start.

A worker and its backends start no process (tested: tests/test_pool.py,
test_a_tier_worker_starts_no_process_of_its_own). A child runs with the worker's
priority, so on a busy host it gets as little CPU, and until it has exec'd its parent
waits in the kernel (vfork) unable to beat: the pool kills it as hung.

Size (over 600 lines): one process's loop, whose owner-generation, slice and answer rules
above must be read together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator

import numpy as np

from shmtier.shared import jobs
from shmtier.shared.lanes import BACKGROUND, worker_lane
from shmtier.shared.log_setup import configure_logging
from shmtier.shared.pool_config import EXIT_BACKENDS_FAILED, PoolConfig
from shmtier.shared.ring import RingSet
from shmtier.shared.segment import join_existing
from shmtier.tiers import registry
from shmtier.tiers.backend import BatchResult, UnsupportedOp, WorkerContext
from shmtier.workers.busy_beat import BusyBeat

# by its module's name also when run as ``python -m shmtier.workers.job_loop`` (__main__):
# log_setup configures the ``shmtier`` loggers only
logger = logging.getLogger("shmtier.workers.job_loop")

_OWNER_CHECK_S = 1.0
_KEYS_PER_BEAT = 8
# A store runs in slices of at most this many chunk bytes (and _KEYS_PER_BEAT keys), or
# as many chunks as the backend writes in parallel (its ``writes_in_flight``, e.g. the
# fs tier's O_DIRECT ``write_depth``: such a slice takes about one write's time): the
# ring is checked for loads before each, so a promotion waits behind at most one slice
# of a cascade (at 1.4 MiB chunks, one chunk, or one round of parallel writes).
_STORE_SLICE_BYTES = 2 << 20
# Ops that change the medium answer each slice as soon as it is done: a worker that dies
# mid-job leaves the outcomes of the keys it finished (the pool fails only the rest), so
# the scheduler half knows which files exist.
_ANSWERED_PER_SLICE = frozenset(("store", "delete"))
# ...but at most once per this many seconds: each answer costs the scheduler thread a
# decode and a merge (answering every slice took tiering_steps' step p50 from 0.52x to
# 0.59x of vLLM's; bench/README.md), while a job that ends sooner needs no partial answer.
_ANSWER_EVERY_S = 0.05
_BATCH = 128  # jobs taken per wake-up: the whole ring, so a load can overtake the backlog
# Waiting for jobs: a worker that had a job in the last _POLL_WINDOW_S polls its ring
# instead of sleeping in sem_wait, so the scheduler's post wakes nobody (wake-ups were the
# largest part of the slowest steps; bench/README.md, "Tier worker wake-ups"). Idle longer,
# it sleeps in the semaphore. The polls back off: the first comes _POLL_S after the last
# job, each later one waits twice as long as the one before, up to _POLL_MAX_S. Every poll's
# sleep costs ~20 µs of CPU on this VM, so polling every 0.5 ms for as long as jobs keep
# coming cost a promotion worker 3.4% of a core, ~4.4 s of CPU over issue 29's long run
# (bench/README.md, "Cost per byte over a long run"); jobs come in bursts (a request's
# promotions, a step's cascades), so the next one after a burst rarely needs a fast poll.
_POLL_S = 0.0005
_POLL_MAX_S = 0.002
_POLL_WINDOW_S = 0.25
# ...a background worker whose pool has a promotion lane polls from _BACKGROUND_POLL_S up
# to _BACKGROUND_POLL_MAX_S: it takes only stores and deletes, which nobody waits on.
_BACKGROUND_POLL_S = 0.002
_BACKGROUND_POLL_MAX_S = 0.008
# A worker this far behind on stores (chunk bytes of the store jobs it holds, the one in
# hand included) is behind: in codec mode "auto" it then stores whichever of raw and
# compressed frames costs it less time per byte (shared/codec_choice.py): a waiting cascade
# keeps its CPU row pinned, and promotions need rows (bench/README.md, "Tier workers behind").
_HURRY_BYTES = 16 << 20


def make_backends(config: PoolConfig, namespace: str, *, replacement: bool = False,
                  engine_id: str = "") -> list:
    """One backend per tier of ``config`` (None where a tier has no worker half), each
    built from its tier's frozen config by its tier type's backend class from the
    registry. ``replacement``: this worker's slot had a worker before
    (``WorkerContext.replacement``); ``engine_id``: the engine it serves."""
    context = WorkerContext(namespace, config.chunk_bytes, config.element_size, config.codec,
                            replacement=replacement, engine_id=engine_id)
    backends = []
    for entry in config.tiers:
        tier = registry.registered(entry.type) if entry is not None else None
        if entry is not None and (tier is None or not tier.worker_backed):
            raise ValueError(f"tier type {entry.type!r} has no worker backend here")
        backends.append(tier.backend_class().open(entry.options, context) if tier else None)
    return backends


class _Stop(Exception):
    pass


class _Stale(BaseException):
    """The segment's owner generation is no longer this worker's (its scheduler died and
    another re-attached): leave at once, answering nothing. A BaseException, so the job
    runner's guard against backend bugs (``except Exception``) does not answer it."""


def decode_all(batch: list[bytes]) -> list:
    """Decode raw job payloads; malformed ones come back as ``MalformedJob`` in place."""
    decoded = []
    for raw in batch:
        try:
            decoded.append(jobs.decode_job(raw))
        except jobs.MalformedJob as e:
            decoded.append(e)
    return decoded


_URGENT = ("load", "probe")  # ops a request waits on: they overtake stores and deletes
_FAILED = frozenset((jobs.Outcome.ERROR, jobs.Outcome.CORRUPT, jobs.Outcome.INVALID))


def loads_first(decoded: list, mutated: set | None = None) -> tuple[list, list]:
    """Split decoded jobs into ``(loads, rest)``: a request is waiting on each
    promotion and on each probe (a lookup of a key the tier's index does not know
    answers RETRY until its probe is answered), while a cascade only keeps a CPU row
    pinned a little longer. So loads and probes run before stores and deletes.

    Per-key order survives: a load of a key that an earlier job (of the batch, or in
    ``mutated``: keys of jobs already held) stores or deletes stays behind that job,
    in ``rest``. (The fs tier never has a load and a mutation of one key outstanding
    together, but the worker does not rely on it.)
    """
    first, rest, mutated = [], [], set(mutated or ())
    for job in decoded:
        if (isinstance(job, jobs.Job) and job.op in _URGENT
                and mutated.isdisjoint(job.keys)):
            first.append(job)
            continue
        rest.append(job)
        if isinstance(job, jobs.Job) and job.op in ("store", "delete"):
            mutated.update(job.keys)
    return first, rest


class JobRunner:
    """Runs decoded jobs against the backends; one per worker process.

    ``queue`` holds decoded jobs not yet run (``admit`` fills it, ``run_queue`` empties
    it). ``take_new`` (non-blocking: raw payloads from the job ring, maybe none) is
    called between slices of a store job; the loads it brings run at once and their
    results go to ``answer``; the rest are queued behind. ``check_owner`` is called before
    each job and each slice of one; it raises (a ``BaseException``) to abandon the work
    unanswered (the worker's owner generation went stale). ``busy_beat`` (a
    :class:`~shmtier.workers.busy_beat.BusyBeat`, or None) is told of each backend call
    that does a job's I/O, so the worker beats while it waits on its medium."""

    def __init__(self, backends: list, arena: np.ndarray, chunk_bytes: int, slot_size: int,
                 beat=lambda: None, take_new=lambda: [], answer=lambda result: None,
                 stop_requested=lambda: False, tally=None, check_owner=lambda: None,
                 tally_tier=None, busy_beat: BusyBeat | None = None):
        self.backends = backends
        self.arena = arena
        self.chunk_bytes = chunk_bytes
        self.max_result = slot_size - 8
        self.beat = beat
        self.take_new = take_new
        self.answer = answer
        self.stop_requested = stop_requested
        self.check_owner = check_owner
        self.busy_beat = busy_beat
        # tally(jobs, bytes, codec_ns, failed_keys): the slot's counters in the segment
        # (WorkerRings.tally), added to for each result answered
        self.tally = tally
        # tally_tier(tier, counts): the slot's counters of that tier (WorkerRings.tally_tier),
        # added to after each job with what its backend counted since (worker_counts)
        self.tally_tier = tally_tier
        self._tier_counts: dict[int, tuple] = {}  # tier -> worker_counts() at the last job
        self.queue: deque = deque()
        self._store_keys_queued = 0  # keys of the store jobs in ``queue``

    def admit(self, decoded: list, in_hand: list | None = None) -> list:
        """Queue ``decoded`` jobs behind those held; returns the loads that may run
        before everything queued (none of their keys is stored or deleted by a held job,
        ``in_hand`` being the keys of the job running now)."""
        held = set(in_hand or ())
        for job in self.queue:
            if isinstance(job, jobs.Job) and job.op in ("store", "delete"):
                held.update(job.keys)
        loads, rest = loads_first(decoded, held)
        for job in rest:
            self.queue.append(job)
            if isinstance(job, jobs.Job) and job.op == "store":
                self._store_keys_queued += len(job.keys)
        return loads

    def run_queue(self) -> None:
        """Run the queued jobs in order, answering each, until the queue is empty or a
        stop is requested (SIGTERM: the job in hand finishes, the rest stay queued)."""
        while self.queue and not self.stop_requested():
            job = self.queue.popleft()
            if isinstance(job, jobs.Job) and job.op == "store":
                self._store_keys_queued -= len(job.keys)
            self.run_and_answer(job)

    def run_and_answer(self, job) -> None:
        self.check_owner()
        counted = self.tally_tier is None or not isinstance(job, jobs.Job)
        for result in self.results(job):
            # Counted before it is answered: whoever takes a result (the scheduler half,
            # a test, ``shmtier top`` after it) finds it in the counters; the ring's post
            # publishes these stores with it. (Counted after, a worker descheduled in
            # between left a job out for a while: a test read 47 jobs for 48 answered.)
            if not counted and not result.more:
                counted = True
                self._count_tier(job.tier)
            if self.tally is not None:
                self._count(result)
            self.answer(result)
        self.beat()

    def _count_tier(self, tier: int) -> None:
        """Add what tier ``tier``'s backend counted since the last job
        (``worker_counts``) to the slot's counters of that tier."""
        backend = self.backends[tier] if 0 <= tier < len(self.backends) else None
        if backend is None:
            return
        try:
            now = tuple(backend.worker_counts())
        except Exception:  # a backend bug must not take the worker down
            logger.exception("tier worker: tier %d: worker_counts failed", tier)
            return
        before = self._tier_counts.get(tier, (0,) * len(now))
        self._tier_counts[tier] = now
        if now != before:
            self.tally_tier(tier, [max(0, a - b) for a, b in zip(now, before)])

    def _count(self, result: jobs.Result) -> None:
        """Add a result about to be answered to the slot's counters: a job when it is its
        last piece, its keys' logical bytes, codec time and failed keys (a few list sums
        and four 8-byte stores per result: nothing next to the I/O behind it)."""
        failed = 0
        for o in result.outcomes:
            if o in _FAILED:
                failed += 1
        self.tally(0 if result.more else 1, sum(result.logical_bytes),
                   int(result.codec_s * 1e9), failed)

    def run(self, job: "jobs.Job | jobs.MalformedJob") -> list[jobs.Result]:
        """All of :meth:`results` for ``job`` (tests, and callers that answer later)."""
        return list(self.results(job))

    def results(self, job: "jobs.Job | jobs.MalformedJob") -> Iterator[jobs.Result]:
        """Run one decoded job (or answer a malformed one), yielding its result in pieces
        that each fit a ring slot; never raises but ``_Stop``. A store or delete yields
        each slice's piece as soon as the slice is done (``more=True`` but the last), so
        a consumer that answers each at once leaves the outcomes of the keys done behind
        if the worker dies mid-job; other ops yield once, at the end."""
        if isinstance(job, jobs.MalformedJob):
            yield from self._fit(jobs.Result.failed(job.job_id, f"malformed job: {job}"), job)
            return
        if job.op == "stop":
            raise _Stop()
        backend = self.backends[job.tier] if 0 <= job.tier < len(self.backends) else None
        if backend is None:
            yield from self._fit(jobs.Result.failed(
                job.job_id, f"tier {job.tier} has no worker backend", len(job.keys)), job)
            return
        yield from self._run_backend(job, backend)

    def _fit(self, result: jobs.Result, job) -> list[jobs.Result]:
        """``result`` split into pieces that each fit a ring slot; per-key figures the wire
        cannot carry (a backend bug) fail those keys instead."""
        try:
            return jobs.split_result(result, self.max_result)
        except ValueError as e:
            logger.error("tier worker: job %d (%s): %s", job.job_id,
                         getattr(job, "op", "?"), e)
            failed = jobs.Result.failed(job.job_id, str(e)[:500], len(result.outcomes))
            return jobs.split_result(failed._replace(more=result.more), self.max_result)

    def _run_backend(self, job: jobs.Job, backend) -> Iterator[jobs.Result]:
        try:
            handler = backend.handler(job.op)
        except UnsupportedOp as e:
            yield from self._fit(jobs.Result.failed(job.job_id, f"tier {job.tier}: {e}",
                                                    len(job.keys)), job)
            return
        n = len(job.keys)
        per_slice = job.op in _ANSWERED_PER_SLICE
        answered = 0  # keys the pieces yielded so far answer for
        pieces: list[jobs.Result] = []
        whole = BatchResult(job.op, [], [], [], [], [])
        try:
            beating = self.busy_beat  # beats while the backend waits on its medium
            if job.op == "scan":
                with beating.busy() if beating else contextlib.nullcontext():
                    listing = self._scan(job, handler)  # the backend runs as it is iterated
                pieces = self._fit(listing, job)
            else:
                if beating is not None:
                    handler = beating.wrap(handler)
                last_answer = time.monotonic()
                for start, keys, part in self._in_slices(handler, job, backend):
                    if len(part.outcomes) != len(keys):
                        raise RuntimeError(f"the backend answered {len(part.outcomes)} "
                                           f"outcomes for {len(keys)} keys")
                    whole.extend(part)
                    done = start + len(keys)
                    if not per_slice or done == n:
                        continue
                    now = time.monotonic()
                    if now - last_answer < _ANSWER_EVERY_S:
                        continue
                    # a long job answers what it has done so far (more=True): a death
                    # later loses none of these keys' outcomes
                    yield from self._flagged(self._fit(whole.to_result(job.job_id)._replace(
                        more=True), job), backend, job)
                    whole = BatchResult(job.op, [], [], [], [], [])
                    answered, last_answer = done, now
                pieces = self._fit(whole.to_result(job.job_id), job)
        except Exception as e:  # a backend bug must not take the worker down
            logger.exception("tier worker: job %d (%s) failed", job.job_id, job.op)
            done = len(whole.outcomes) if job.op != "scan" else 0  # slices not answered yet
            pieces = self._fit(whole.to_result(job.job_id)._replace(more=True), job) if done else []
            pieces += self._fit(jobs.Result.failed(job.job_id, f"{type(e).__name__}: {e}"[:500],
                                                   n - answered - done), job)
        yield from self._flagged(pieces, backend, job)

    @staticmethod
    def _flagged(pieces: list[jobs.Result], backend, job) -> list[jobs.Result]:
        """``pieces`` with the ``ResultFlag`` bits the backend raised meanwhile
        (``take_flags()``) on the first one."""
        try:
            flags = int(backend.take_flags())
        except Exception:  # a backend bug must not take the worker down
            logger.exception("tier worker: tier %d: take_flags failed", job.tier)
            flags = 0
        if flags and pieces:
            pieces[0] = pieces[0]._replace(flags=pieces[0].flags | flags)
        return pieces

    def _in_slices(self, handler, job: jobs.Job, backend) -> Iterator[tuple]:
        """Run ``handler`` (the backend's method for the job's op) over the job's keys in
        slices, beating between them, so a long job on a slow medium is not mistaken for
        a hung worker; yields ``(first key's index, keys, BatchResult)`` per slice. Before
        each slice of a store, loads that reached the ring meanwhile run first, and the
        backend is told it is behind (``hurry``: in codec mode "auto" compression by cost
        then picks the faster of raw and compressed) while the store work held exceeds
        _HURRY_BYTES. A store slice refused for the free-space floor gets the free bytes
        the worker sees in its detail (``jobs.min_free_detail``)."""
        n = len(job.keys)
        step = _KEYS_PER_BEAT
        if job.op == "store":
            step = max(1, min(step, _STORE_SLICE_BYTES // max(self.chunk_bytes, 1)),
                       backend.writes_in_flight)
        in_use = job.args.get("bytes_in_use")  # the scheduler's count of the tier's bytes
        stored = 0  # bytes this job's slices reported stored so far
        for start in range(0, max(n, 1), step):
            keys = job.keys[start:start + step]
            self.check_owner()  # no row or file touched for a stale owner
            if job.op == "store":
                self._serve_new_loads(job.keys)
                behind = (n - start + self._store_keys_queued) * self.chunk_bytes
                part = handler(keys, job.rows[start:start + step], self.arena,
                               self.chunk_bytes, hurry=behind > _HURRY_BYTES,
                               bytes_in_use=None if in_use is None else in_use + stored)
                stored += part.total_stored
                if jobs.MIN_FREE in part.details:
                    _note_free_bytes(part, backend)
            elif job.op == "load":
                part = handler(keys, job.rows[start:start + step], self.arena, self.chunk_bytes)
            else:
                part = handler(keys)
            self.beat()
            yield start, keys, part

    def _serve_new_loads(self, in_hand: list) -> None:
        batch = self.take_new()
        if batch:
            for load in self.admit(decode_all(batch), in_hand):
                self.run_and_answer(load)

    @staticmethod
    def _scan(job: jobs.Job, scan) -> jobs.Result:
        """The listing of ``scan()``: every chunk's key and stored size."""
        keys, stored = [], []
        for entry in scan():
            keys.append(entry.key)
            stored.append(entry.stored_bytes)
        return jobs.Result(job.job_id, stored_bytes=stored, listed=keys)


def _note_free_bytes(part: BatchResult, backend) -> None:
    """Complete the ``"min_free"`` details of a store slice with the free bytes on the
    backend's medium now (``jobs.min_free_detail``): the scheduler half evicts by that
    figure and names it in its warning. Known for a backend with ``free_bytes()``, or
    one that stores under a directory (``namespace_dir``: fs); else left as it is."""
    free = None
    try:
        query = getattr(backend, "free_bytes", None)
        if query is not None:
            free = query()
        else:
            where = getattr(backend, "namespace_dir", None)
            if where is not None:
                v = os.statvfs(where)
                free = v.f_bavail * v.f_frsize
    except OSError:
        return
    if free is None:
        return
    detail = jobs.min_free_detail(free)
    part.details = [detail if d == jobs.MIN_FREE else d for d in part.details]


def _set_policy(policy: str) -> None:
    """Run the calling thread (and the threads it starts later) under ``policy``
    (``WorkerPoolOptions.tier_worker_policy``: "batch" or "other"), keeping its niceness.
    Set even when it is "other": a worker the pool restarts from the step-window poll
    thread inherits that thread's SCHED_BATCH. A kernel that refuses is logged once; the worker
    runs on under the policy it inherited."""
    want = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
    try:
        if os.sched_getscheduler(0) != want:
            os.sched_setscheduler(0, want, os.sched_param(0))
    except (OSError, AttributeError) as e:
        logger.warning("tier worker: scheduling policy %r refused (%s); keeping the inherited "
                       "one", policy, e)


def _set_priority(config: PoolConfig, index: int) -> str:
    """Set this worker's priority by its lane (``shared/lanes.py``); returns the lane.
    Background: niceness + ``tier_worker_niceness`` and ``tier_worker_policy``; promotion:
    the niceness it inherited (the engine's, or ``shmtier workers``' in external mode) and
    SCHED_OTHER. Both change only the calling thread on Linux: call it before the worker
    starts any thread (its threads inherit them)."""
    pool = config.options
    lane = worker_lane(index, pool.num_tier_workers, pool.promotion_workers)
    if lane == BACKGROUND:
        os.nice(pool.tier_worker_niceness)
        _set_policy(pool.tier_worker_policy)
    else:
        _set_policy("other")
    return lane


def run_worker(engine_id: str, index: int, generation: int | None = None) -> int:
    """Serve worker slot ``index`` of ``engine_id`` until stopped; returns an exit code.

    ``generation``: the owner generation of the scheduler that started this worker (the
    pool passes it); None (``shmtier workers``): the one current once the rings are
    attached. The worker exits with 3 as soon as the segment's word differs (see the
    module docstring)."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    segment = join_existing(engine_id)
    rings = runner = busy_beat = None
    mine = [generation]

    def check_owner() -> None:
        if segment.owner_generation() != mine[0]:
            raise _Stale()

    try:
        if generation is not None:
            check_owner()  # started by a scheduler that is gone already
        config = PoolConfig.read(segment.rings)
        # Background work: a smaller CPU share than the scheduler thread that posts the jobs
        # (``tier_worker_niceness``, default 10), and with SCHED_BATCH (``tier_worker_policy``,
        # default "batch") a woken worker does not preempt it at all: it runs at the next
        # tick or on an idle core. The promotion lane keeps the engine's priority: a waiting
        # request needs its loads and probes, and other work on a busy host must not starve
        # them (docs/architecture.md, "Tier worker lanes").
        lane = _set_priority(config, index)
        first_poll_s, max_poll_s = (
            (_BACKGROUND_POLL_S, _BACKGROUND_POLL_MAX_S)
            if lane == BACKGROUND and config.options.promotion_workers
            else (_POLL_S, _POLL_MAX_S))
        poll_s = first_poll_s
        rings = RingSet.attach(segment.name, segment.rings, worker=index)
        if generation is None:
            mine[0] = segment.owner_generation()
        check_owner()
        me = rings.worker(index)
        me.claim()
        check_owner()  # a new owner re-attached while we claimed: the slot is its pool's
        g = segment.geometry
        arena = np.frombuffer(segment.arena, dtype=np.uint8).reshape(g.num_chunks, g.row_stride)
        try:
            backends = make_backends(config, segment.header().fingerprint,
                                     replacement=me.last_beat().claims > 1,
                                     engine_id=engine_id)
        except Exception as e:  # a start failure: the pool counts it (and may mark itself broken)
            logger.error("tier worker %d cannot build its tier backends: %s: %s",
                         index, type(e).__name__, e)
            return EXIT_BACKENDS_FAILED
        # started after nice and the policy were set (it inherits them), not while the
        # backends are built: a worker that hangs there is a start failure, as before
        busy_beat = BusyBeat(me.beat, config.heartbeat_interval_s)
        runner = JobRunner(backends, arena, config.chunk_bytes, config.slot_size, me.beat,
                           take_new=lambda: me.jobs.get_many(_BATCH, timeout_s=0),
                           answer=lambda result: _answer(me, result, segment, check_owner),
                           stop_requested=lambda: bool(stopping), tally=me.tally,
                           check_owner=check_owner, tally_tier=me.tally_tier,
                           busy_beat=busy_beat)
        next_owner_check = time.monotonic() + _OWNER_CHECK_S
        last_job = 0.0
        while not stopping:
            batch = me.jobs.get_many(_BATCH, timeout_s=0)
            if not batch:
                if time.monotonic() - last_job < _POLL_WINDOW_S:
                    time.sleep(poll_s)
                    poll_s = min(2 * poll_s, max_poll_s)
                else:
                    batch = me.jobs.get_many(_BATCH, timeout_s=config.heartbeat_interval_s)
            check_owner()  # jobs taken for a stale owner are left unrun
            me.beat()
            if batch:
                for load in runner.admit(decode_all(batch)):
                    runner.run_and_answer(load)
                runner.run_queue()
                last_job = time.monotonic()  # busy until now: keep polling a while
                poll_s = first_poll_s
            if time.monotonic() >= next_owner_check:
                next_owner_check = time.monotonic() + _OWNER_CHECK_S
                if not segment.header().owner_alive():
                    logger.warning("tier worker %d: scheduler is gone; exiting", index)
                    return 3
        return 0
    except _Stop:
        return 0
    except _Stale:
        logger.warning("tier worker %d: the scheduler that started it (owner generation %s) "
                       "was replaced (generation %d, a warm restart); exiting", index,
                       mine[0], segment.owner_generation())
        return 3
    finally:
        if busy_beat is not None:
            busy_beat.stop()  # no beat for a slot this process leaves
        if rings is not None:
            try:
                rings.worker(index).unclaim()  # a no-op unless this process holds the slot
            except Exception:
                pass
            rings.close()
        arena = runner = None
        segment.close()


def _answer(me, result: jobs.Result, segment, check_owner) -> None:
    """Put ``result``; a full result ring means the scheduler lags: wait, but not forever.
    Nothing is put for a stale owner generation (``check_owner`` raises)."""
    payload = jobs.encode_result(result)
    check_owner()
    while not me.results.try_put(payload):
        me.beat()
        if not segment.header().owner_alive():
            raise _Stop()
        check_owner()
        time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a spawned worker: ``main([engine_id, index])``, or with the owner
    generation of the scheduler that starts it: ``main([engine_id, index, generation])``."""
    argv = sys.argv[1:] if argv is None else argv
    # shmtier's loggers at SHMTIER_LOG, third-party ones only by name, secrets redacted
    # (shmtier/shared/log_setup.py); the root logger stays as it is
    configure_logging(f"tier-worker {argv[1] if len(argv) > 1 else '?'}")
    return run_worker(argv[0], int(argv[1]), int(argv[2]) if len(argv) > 2 else None)


if __name__ == "__main__":
    sys.exit(main())
