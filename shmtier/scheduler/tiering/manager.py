"""TieringOffloadingManager: the CPU primary tier plus secondary tiers (docs/vllm-contract.md §6).

Who calls: vLLM's connector scheduler half (or any driver), in the scheduler
process, holding ``manager.lock`` — a real, non-reentrant ``threading.Lock``
covering the primary and every tier — for every method except ``shutdown``.
Nothing here blocks except ``reset_cache`` (it drains the tiers' jobs).

Data flow::

    lookup ──primary HIT/HIT_PENDING──▶ answer
       │ primary MISS: ask tiers in order (first HIT wins; RETRY = ask again)
       └─tier HIT──▶ room for a primary row? HIT_PENDING (else MISS)
                     ──end of the request's lookup scan──▶ rows reserved, all at once
                     ──on_schedule_end──▶ one promotion job per (tier, request)
                                          ─▶ tier.submit_load
    complete_store(success) ──▶ one cascade job per tier (backpressure permitting):
                                pin rows (prepare_read) ─▶ tier.submit_store
       (past a tier's ``max_pinned_rows`` the keys wait unpinned in its deferred queue,
        submitted oldest first as the cap allows: at the next cascade, after the poll of
        each prepare_store and at on_schedule_end)
       (with an ``admission`` rule other than write-through, only the chunks it admits;
        the CPU-tier hits of a lookup scan may admit more when the scan ends)
    tier.get_finished_jobs ──(polled once per step, and always in prepare_store)──▶
         promotion: rows become ready (or are freed: MISS next time; with the result's
                    deferred_release, held until the tier sets it: deferred_release.py)
         cascade:   rows unpinned, backpressure detector updated

Promotion rows are reserved per lookup *scan* (docs/vllm-contract.md §6.3 reserves per key):
the keys a request's consecutive lookups promote get their rows in one
``primary.reserve_rows`` call when the scan ends -- at the next call that is
not a lookup of the same request. Nothing but that request's own lookups can
observe the state in between, and for LRU the rows, victims and events are the
ones the per-key reservations would give; the room check at lookup keeps the
answers (HIT_PENDING, or MISS when the primary is full) the same. Measured on
the bench's multi-turn trace, per-key reservation was the largest cost of the
slowest steps. Two deliberate differences: chunks the scan already answered
HIT are kept from eviction (per key, a later promotion of the same scan could
evict a chunk the request was just told it can load), and ARC, whose victims
depend on the inserts in between, may choose other victims.

Tier-poll thread (docs/vllm-contract.md §6.10): tiers that set ``tolerates_off_thread_polling``
(peer tiers, whose counterpart the engine does not drive) are also polled every
``tier_poll_interval_s`` from a daemon thread holding the lock: their finished jobs are
processed and they serve external requests between steps. It never flushes
promotions or cascades (per-step batching points) and leaves the once-per-step gate
as it found it. The thread shares the GIL with the scheduler thread; shmtier's storage
tiers do not opt in (measured: the hand-offs inside the steps cost more step time than
they saved).

Step-window thread (``window_poll.py``, shmtier's own): tiers that set
``polls_between_steps`` (the storage tiers) have their finished jobs processed by a
second daemon thread, holding the lock, only while the engine runs its forward pass:
from just after ``on_schedule_end`` to ``tier_poll_window`` of the step period after it,
learnt from the last steps; each round first lets such a tier send what it left queued
(``submit_between_steps``: the storage tiers leave a step's stores to it). Each step's own
polls stay (they find less to do). Like the tier-poll thread it never flushes promotions
or cascades and leaves the gate as it was.

Requests finish in two stages: ``on_request_finished`` tells the primary at
once, but the tiers hear of it only after the request's last pending primary
store has completed (a cascade for it may still follow until then).

Size: one class implementing vLLM's ``TieringOffloadingManager`` interface; its lookup
metrics (``lookup_metrics.py``), poll threads (``poll_thread.py``, ``window_poll.py``) and deferred
releases (``deferred_release.py``) live apart,
and what is left shares the request and scan state, so it stays one module (~780 lines).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from shmtier import metrics
from shmtier.contract import (
    CacheHitSource,
    CPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    tier_filter_allows,
)
from shmtier.scheduler.backpressure import record_backpressure_metrics
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.scheduler.stats_publisher import StatsPublisher
from shmtier.scheduler.tiering.admission import CascadeAdmission
from shmtier.scheduler.tiering.base import (
    JobId,
    JobResult,
    ParentManager,
    TransferJob,
    optional_attribute,
)
from shmtier.scheduler.tiering.deferred_release import DeferredReleases
from shmtier.scheduler.tiering.lookup_metrics import LookupTracker, RequestLookups
from shmtier.scheduler.tiering.poll_thread import POLL_JOIN_TIMEOUT_S, TierPollThread
from shmtier.scheduler.tiering.window_poll import StepRhythm, StepWindowPollThread

logger = logging.getLogger(__name__)

_LOOKUP_TIERS_MEMO_MAX = 64  # distinct (load_tier_filter, excluded tier) pairs remembered
_NO_FILTER = object()  # no lookup has asked the tiers yet

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
PRIMARY_LABEL = "0:primary"


def _same_enum(enum_cls, value):
    return None if value is None else enum_cls[value.name] if hasattr(value, "name") else enum_cls(value)


@dataclass
class _RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    finished: bool = False
    excluded_tier: int | None = None
    request_level_tiers: set[int] = field(default_factory=set)
    parked_cascade_keys: list[OffloadKey] = field(default_factory=list)
    deferred_cascade_keys: int = 0  # keys of this request waiting in a tier's deferred queue


class _TierFacingParent(ParentManager):
    """The manager as seen by tier ``origin`` in ``serve_external_requests``:
    every fan-out skips the origin tier; store jobs it creates are its own."""

    def __init__(self, manager: "TieringOffloadingManager", origin: int):
        self._manager = manager
        self._origin = origin

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._manager.on_new_request(req_context, exclude_tier_idx=self._origin)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._manager.lookup(key, req_context, exclude_tier_idx=self._origin)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob:
        return self._manager._create_store_job(keys, req_context, self._origin)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._manager.on_request_finished(req_context, exclude_tier_idx=self._origin)


#: Every call but a lookup (which starts or continues a scan) ends the current lookup
#: scan first: its promotions get their rows before anything else can see the primary.
#: Each of these methods opens with that check inline (a wrapper cost every call one
#: more Python frame, and these run several times a step: bench/README.md, issue 14 CPU);
#: ``_scan_ends_first`` checks at import that none lacks it.
_ENDS_THE_SCAN = (
    "get_load_source", "prepare_store", "complete_store", "prepare_load", "complete_load",
    "touch", "on_new_request", "on_request_finished", "on_schedule_end", "has_pending_work",
    "take_events", "get_stats", "reset_cache", "on_reset_flushed", "poll_tiers",
    "_create_store_job",
)


def _scan_ends_first(cls: type) -> type:
    """Check that each method of ``_ENDS_THE_SCAN`` ends a running scan (reads
    ``_scan_ctx`` and calls ``_end_scan``) before it does anything else."""
    for name in _ENDS_THE_SCAN:
        code = getattr(cls, name).__code__
        if not {"_scan_ctx", "_end_scan"} <= set(code.co_names):
            raise TypeError(f"{cls.__name__}.{name} must end the lookup scan first "
                            f"(if self._scan_ctx is not None: self._end_scan())")
    return cls


@_scan_ends_first
class TieringOffloadingManager:
    """The primary tier plus ``tiers`` (secondary, in priority order)."""

    def __init__(self, primary: CPUPrimaryTierOffloadingManager, tiers: Sequence[Any],
                 before_primary_shutdown: Sequence[Any] = (), tier_poll_interval_s: float = 0.0,
                 admission: CascadeAdmission | None = None, tier_poll_window: float = 0.0):
        """``before_primary_shutdown``: callables run after the tiers shut down and
        before the primary releases the segment (the spec passes the worker pool's).
        ``tier_poll_interval_s`` > 0 starts the tier-poll thread if a tier opts in, and
        with ``tier_poll_window`` > 0 the step-window thread if a tier opts in to that.
        ``admission``: which stored chunks each tier gets (``admission.py``); None is
        vLLM's write-through (every chunk, when it is stored)."""
        self.admission = admission
        self._lock = threading.Lock()
        self._before_primary_shutdown = list(before_primary_shutdown)
        self.primary = primary
        self._ref_count = primary.ref_count  # per lookup
        self.tiers = list(tiers)
        self.labels = [PRIMARY_LABEL] + [f"{i + 1}:{t.tier_type}" for i, t in enumerate(self.tiers)]
        self._row_bytes = primary.get_kv_memoryview().strides[0] if primary._num_chunks else 0
        self._num_chunks = max(primary._num_chunks, 1)
        self._next_job_id = 0
        self._jobs: dict[JobId, tuple[TransferJob, int]] = {}
        # in-flight [jobs, rows] per tier, kept as jobs come and go (get_stats runs every step)
        self._active = {True: [[0, 0] for _ in tiers], False: [[0, 0] for _ in tiers]}
        self._pending_promotions: list[dict[str, tuple[ReqContext, list, list]]] = [
            {} for _ in self.tiers]
        self._polled_this_step = False
        self._requests: dict[str, _RequestState] = {}
        self._parked: dict[str, _RequestState] = {}  # requests with parked cascade keys
        self._load_sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        self._promotions_held = False
        self.copies_in_flight_at_reset = False  # set by reset_cache
        # the current lookup scan: its request, the promotions awaiting rows (key ->
        # tier index, in lookup order) and the keys it answered HIT (kept from eviction)
        self._scan_ctx: ReqContext | None = None
        self._scan_promotions: dict[OffloadKey, int] = {}
        self._scan_hits: dict[OffloadKey, None] = {}  # (in lookup order)
        self._scan_hits_evictable = 0  # of _scan_hits, those eviction could take
        self._scan_lookups: RequestLookups | None = None  # the scan's lookup metrics record
        self._scan_room: int | None = None  # primary.rows_obtainable() when the scan began promoting
        # request -> keys whose reservation a policy refused after HIT_PENDING: MISS next
        self._refused: dict[str, set[OffloadKey]] = {}
        self._parents = [_TierFacingParent(self, i) for i in range(len(self.tiers))]
        self._tracker = LookupTracker(self.labels)
        self._stats = metrics.OffloadingStats()
        # rows of failed promotions a tier may still write (vLLM 0.34's deferred release)
        self._held = DeferredReleases(primary, self.labels[1:],
                                      [optional_attribute(t, "defers_release") for t in self.tiers])
        # A tier written for vLLM speaks vLLM's enums: map them to ours once, by name.
        self._tier_kind = [
            (_same_enum(Medium, t.medium), _same_enum(Locality, optional_attribute(t, "locality")))
            for t in self.tiers]
        self._max_pinned_rows = [optional_attribute(t, "max_pinned_rows") for t in self.tiers]
        # per tier: cascade keys deferred at the pinned-row cap, oldest first, each with
        # (ctx, its request's state or None) -- see ``_cascade``
        self._deferred: list[OrderedDict[OffloadKey, tuple[ReqContext, _RequestState | None]]] = [
            OrderedDict() for _ in self.tiers]
        self._hit_source = [CacheHitSource(t.cache_hit_source.value) for t in self.tiers]
        # a tier's ``stats_into(stats)`` (shmtier's storage tiers) adds its step series to
        # the manager's payload directly; others' get_stats payloads are merged
        self._tier_stats_into = [getattr(t, "stats_into", None) for t in self.tiers]
        self._lookup_tiers_memo: dict[tuple[Any, int | None], list[tuple[int, Any]]] = {}
        # the memo's last answer, (filter, excluded tier, tiers): found by identity, as
        # consecutive lookups (a request's scan) pass the same filter object
        self._last_lookup_tiers: tuple[Any, int | None, list[tuple[int, Any]]] = (
            _NO_FILTER, None, [])
        self._idle_job_counts = [f for f in (optional_attribute(t, "idle_jobs")
                                             for t in self.tiers) if f is not None]
        self._polled = [i for i, t in enumerate(self.tiers)
                        if optional_attribute(t, "tolerates_off_thread_polling")]
        self._poll_thread: TierPollThread | None = None
        if self._polled and tier_poll_interval_s > 0:
            self._poll_thread = TierPollThread(self._lock, self.poll_tiers, tier_poll_interval_s,
                                               [self.tiers[i] for i in self._polled])
        self._window_polled = [i for i, t in enumerate(self.tiers)
                               if optional_attribute(t, "polls_between_steps")]
        self._window_submits = [s for s in (getattr(self.tiers[i], "submit_between_steps", None)
                                            for i in self._window_polled) if s is not None]
        self._rhythm: StepRhythm | None = None
        self._window_thread: StepWindowPollThread | None = None
        if self._window_polled and tier_poll_interval_s > 0 and tier_poll_window > 0:
            self._rhythm = StepRhythm(tier_poll_window, tier_poll_interval_s)
            self._window_thread = StepWindowPollThread(self._lock, self.poll_between_steps,
                                                       self._rhythm)
        # the step's statistics, into the segment for `shmtier top` (at most every 0.1 s)
        self._publisher = StatsPublisher.for_manager(primary, self.tiers, self.labels,
                                                     self._row_bytes)

    @property
    def window_poll_rounds(self) -> tuple[int, int] | None:
        """The step-window thread's (rounds run, rounds skipped for a held lock), or None
        when it does not run (for benches and tests)."""
        t = self._window_thread
        return None if t is None else (t.rounds, t.missed)

    def report_deferred_releases_of_every_tier(self) -> None:
        """Report the deferred-release gauge of every tier every step, as vLLM 0.34 does
        (for an adapter that declares the series for every tier)."""
        self._held.report_every_tier()

    @property
    def lock(self) -> threading.Lock:
        """Hold across every call (except ``shutdown``); never re-enter it."""
        return self._lock

    # --- jobs ---

    def _new_job(self, keys: Collection[OffloadKey], chunk_ids: Any, is_promotion: bool,
                 ctx: ReqContext, tier_idx: int) -> TransferJob:
        self._next_job_id += 1
        job = TransferJob(JobId(self._next_job_id), list(keys), chunk_ids, is_promotion, ctx)
        self._jobs[job.job_id] = (job, tier_idx)
        active = self._active[is_promotion][tier_idx]
        active[0] += 1
        active[1] += len(job.keys)
        return job

    def _create_store_job(self, keys: Collection[OffloadKey], ctx: ReqContext, tier_idx: int) -> TransferJob:
        """Pin ``keys`` in the primary and register a cascade job owned by ``tier_idx``."""
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        return self._new_job(keys, self.primary.pin_rows(keys), False, ctx, tier_idx)

    def _maybe_process_finished_jobs(self) -> None:
        if not self._polled_this_step:
            self._polled_this_step = True
            self._process_finished_jobs()

    def _process_finished_jobs(self, tier_indices: Iterable[int] | None = None) -> None:
        for tier_idx in range(len(self.tiers)) if tier_indices is None else tier_indices:
            tier = self.tiers[tier_idx]
            for result in tier.get_finished_jobs():
                entry = self._jobs.pop(result.job_id, None)
                if entry is None or entry[1] != tier_idx:
                    raise RuntimeError(
                        f"tier {self.labels[tier_idx + 1]} reported job {result.job_id}, "
                        f"which it does not own"
                    )
                job = entry[0]
                active = self._active[job.is_promotion][tier_idx]
                active[0] -= 1
                active[1] -= len(job.keys)
                if job.is_promotion:
                    self._complete_promotion(job, tier_idx, result)
                else:
                    self._complete_cascade(job, tier_idx, result)
            if self._held.by_tier[tier_idx]:
                self._held.release_ready(tier_idx, self._stats)

    def _complete_promotion(self, job: TransferJob, tier_idx: int, result: JobResult) -> None:
        label = (self.labels[tier_idx + 1],)
        ctx = job.req_context
        if result.success:
            landed, failed = list(job.keys), []
        else:
            ok = set(result.successful_keys or ())
            landed = [k for k in job.keys if k in ok]
            failed = [k for k in job.keys if k not in ok]
        if landed:
            self.primary.complete_write(landed, ctx, True)
            if self.admission is not None:
                self.admission.on_promoted(tier_idx, landed)
        if failed:
            release = getattr(result, "deferred_release", None)  # vLLM < 0.34: none
            if release is None:
                self.primary.complete_write(failed, ctx, False)
            else:  # the tier may still write their rows: held until it sets the event
                self._held.defer(tier_idx, failed, release)
            sources = self._load_sources.get(ctx.req_id)
            if sources:
                mine = self._hit_source[tier_idx]
                for key in failed:
                    if sources.get(key) == mine:
                        del sources[key]
            self._stats.increase_counter(metrics.PROMOTION_JOB_FAILURES, 1, label)
        stats = self._stats
        stats.increase_counter(metrics.READ_BYTES, len(landed) * self._row_bytes, label)
        if result.transfer_time is not None:
            stats.increase_counter(metrics.READ_TIME, result.transfer_time, label)
        stats.observe_histogram(metrics.PROMOTION_LATENCY, time.monotonic() - job.submit_time,
                                (label[0], "success" if result.success else "failure"))

    def _complete_cascade(self, job: TransferJob, tier_idx: int, result: JobResult) -> None:
        label = (self.labels[tier_idx + 1],)
        self.primary.complete_read(job.keys, job.req_context)
        detector = self.tiers[tier_idx].bp_detector
        if result.success:
            nbytes = result.transfer_bytes or len(job.keys) * self._row_bytes
            self._stats.increase_counter(metrics.WRITE_BYTES, len(job.keys) * self._row_bytes, label)
            if result.transfer_time is not None:
                self._stats.increase_counter(metrics.WRITE_TIME, result.transfer_time, label)
            if detector is not None:
                detector.update(job.submit_time, nbytes)
        else:
            self._stats.increase_counter(metrics.CASCADE_JOB_FAILURES, 1, label)
            if detector is not None:
                detector.on_store_failed()

    def _cascade(self, keys: list[OffloadKey], ctx: ReqContext, tier_indices: Iterable[int]) -> None:
        for tier_idx in tier_indices:
            tier = self.tiers[tier_idx]
            detector = tier.bp_detector
            if detector is not None and not detector.should_store(len(keys)):
                continue  # counted by the detector's policy
            # A tier that falls behind must not starve the primary tier: rows pinned by its
            # queued cascades are capped (tiers opt in with ``max_pinned_rows``); one
            # cascade alone always goes, however large. What does not fit waits, unpinned,
            # in the tier's deferred queue behind the keys already there (vLLM has no cap
            # and drops nothing but what its detector rejects: bench/README.md, issue 14).
            cap = self._max_pinned_rows[tier_idx]
            if cap is not None:
                deferred = self._deferred[tier_idx]
                if deferred:
                    self._submit_deferred(tier_idx, cap)  # older keys first
                pinned = self._active[False][tier_idx][1]
                if deferred or (pinned and pinned + len(keys) > cap):
                    fits = 0 if deferred else max(0, cap - pinned)
                    if fits:
                        tier.submit_store(self._create_store_job(keys[:fits], ctx, tier_idx))
                    self._defer(tier_idx, keys[fits:], ctx, cap)
                    continue
            tier.submit_store(self._create_store_job(keys, ctx, tier_idx))

    def _defer(self, tier_idx: int, keys: list[OffloadKey], ctx: ReqContext, cap: int) -> None:
        """Queue ``keys`` (not pinned: the primary may still evict them) for tier
        ``tier_idx``; their request is not finalized while they wait. The queue holds at
        most ``cap`` keys: the oldest beyond are dropped, counted as backpressure drops."""
        deferred = self._deferred[tier_idx]
        state = self._requests.get(ctx.req_id)
        owner = (ctx, state)
        added = 0
        for key in keys:
            if key not in deferred:  # (a key queued twice keeps its first place)
                deferred[key] = owner
                added += 1
        if not added:
            return
        label = (self.labels[tier_idx + 1],)
        self._stats.increase_counter(metrics.CASCADE_DEFERRED_CHUNKS, added, label)
        if state is not None:
            state.deferred_cascade_keys += added
        overflow = len(deferred) - cap
        if overflow > 0:
            released = [deferred.popitem(last=False)[1] for _ in range(overflow)]
            self._stats.increase_counter(metrics.BACKPRESSURE_STORES_DROPPED, 1, label)
            self._stats.increase_counter(metrics.BACKPRESSURE_BLOCKS_DROPPED, overflow, label)
            self._release_deferred(released)

    def _submit_deferred(self, tier_idx: int, cap: int | None) -> None:
        """Submit tier ``tier_idx``'s deferred keys, oldest first, as far as the cap
        ``cap`` has room (None: all of them), in one cascade job per request. Keys the
        primary no longer holds ready (evicted meanwhile) are skipped and counted lost;
        the tier itself skips keys it already has or is storing (docs/vllm-contract.md §7.2)."""
        deferred = self._deferred[tier_idx]
        pinned = self._active[False][tier_idx][1]
        room = len(deferred) if cap is None else cap - pinned if pinned else cap
        if room <= 0:
            return
        lost = 0
        released: list[tuple[ReqContext, _RequestState | None]] = []
        jobs: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}  # per request
        while room > 0 and deferred:
            taken = [deferred.popitem(last=False) for _ in range(min(room, len(deferred)))]
            ready = set(self.primary.ready_keys([key for key, _ in taken]))
            for key, owner in taken:
                released.append(owner)
                if key in ready:
                    job = jobs.get(owner[0].req_id)
                    if job is None:
                        job = jobs[owner[0].req_id] = (owner[0], [])
                    job[1].append(key)
                    room -= 1
                else:
                    lost += 1
        for ctx, keys in jobs.values():
            self.tiers[tier_idx].submit_store(self._create_store_job(keys, ctx, tier_idx))
        if lost:
            self._stats.increase_counter(metrics.CASCADE_DEFERRED_LOST_CHUNKS, lost,
                                         (self.labels[tier_idx + 1],))
        if released:
            self._release_deferred(released)

    def _release_deferred(self, owners: list[tuple[ReqContext, _RequestState | None]]) -> None:
        """One deferred key of each of ``owners`` left its queue: finalize the requests
        that only waited for them."""
        waiting = []
        for _, state in owners:
            if state is not None:
                state.deferred_cascade_keys -= 1
                if not state.deferred_cascade_keys:
                    waiting.append(state)
        for state in waiting:
            self._maybe_finalize(state)

    def _has_deferred(self) -> bool:
        return any(self._deferred)

    def _flush_deferred_cascades(self, capped: bool = True) -> None:
        """Submit each tier's deferred keys as its cap allows (``capped``) or all of them."""
        for tier_idx, deferred in enumerate(self._deferred):
            if deferred:
                self._submit_deferred(tier_idx, self._max_pinned_rows[tier_idx] if capped else None)

    # --- lookups and promotions ---

    def lookup(self, key: OffloadKey, req_context: ReqContext,
               exclude_tier_idx: int | None = None) -> LookupResult:
        scan = self._scan_ctx
        if scan is None or scan.req_id != req_context.req_id:
            self._end_scan()
            self._scan_ctx = req_context
            self._scan_lookups = self._tracker.request(req_context.req_id)
        if not self._polled_this_step:  # _maybe_process_finished_jobs, inlined
            self._polled_this_step = True
            self._process_finished_jobs()
        record = self._scan_lookups
        # The primary's answer is timed and recorded the first time it resolves this key
        # for the request; a rescan's lookups of resolved keys (the record would ignore
        # them) skip the clocks.
        if record is not None and key not in record.resolved[0]:
            started = perf_counter()
            count = self._ref_count(key)  # the primary's lookup and is_evictable in one
            if count is not None and count < 0:
                return HIT_PENDING  # (not recorded: the lookup record ignores HIT_PENDING)
            result = MISS if count is None else HIT
            now = perf_counter()
            record.record(0, key, result, now - started, now)
        else:
            count = self._ref_count(key)
            if count is not None and count < 0:
                return HIT_PENDING
            result = MISS if count is None else HIT
        if result is HIT:
            if key not in self._scan_hits:
                self._scan_hits[key] = None
                self._scan_hits_evictable += count == 0
            return result
        if result is not MISS or self._promotions_held or not self.tiers:
            return result
        if key in self._scan_promotions:
            return HIT_PENDING
        refused = self._refused.get(req_context.req_id) if self._refused else None
        if refused and key in refused:
            refused.discard(key)
            return MISS
        retry = False
        allowed = req_context.load_tier_filter
        last = self._last_lookup_tiers
        tiers = (last[2] if last[0] is allowed and last[1] == exclude_tier_idx
                 else self._lookup_tiers(allowed, exclude_tier_idx))
        for tier_idx, tier in tiers:
            started = perf_counter()
            answer = tier.lookup(key, req_context)
            now = perf_counter()
            if answer.__class__ is not LookupResult:
                answer = LookupResult[answer.name]
            if record is not None:
                record.record(tier_idx + 1, key, answer, now - started, now)
            if answer is HIT:
                return HIT_PENDING if self._initiate_promotion(tier_idx, key, req_context) else MISS
            if answer is RETRY:
                retry = True
        return RETRY if retry else MISS

    def _lookup_tiers(self, allowed: Any, exclude_tier_idx: int | None) -> list[tuple[int, Any]]:
        """(index, tier) of the tiers a lookup asks, in order: those ``allowed`` (a
        request's ``load_tier_filter``) lets serve loads, less ``exclude_tier_idx``.
        Memoised per (filter, excluded tier): a lookup runs per key. A hashable filter
        is taken as immutable (as vLLM's frozen ``TierFilter``); the last answer is kept
        for ``lookup`` to find by identity."""
        try:
            tiers = self._lookup_tiers_memo[allowed, exclude_tier_idx]
        except KeyError:
            if len(self._lookup_tiers_memo) >= _LOOKUP_TIERS_MEMO_MAX:
                self._lookup_tiers_memo.clear()
            tiers = self._lookup_tiers_memo[allowed, exclude_tier_idx] = self._eval_lookup_tiers(
                allowed, exclude_tier_idx)
        except TypeError:  # an unhashable filter: evaluate it every time
            return self._eval_lookup_tiers(allowed, exclude_tier_idx)
        self._last_lookup_tiers = (allowed, exclude_tier_idx, tiers)
        return tiers

    def _eval_lookup_tiers(self, allowed: Any, exclude_tier_idx: int | None) -> list[tuple[int, Any]]:
        return [(i, tier) for i, tier in enumerate(self.tiers)
                if i != exclude_tier_idx and tier_filter_allows(allowed, *self._tier_kind[i])]

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, ctx: ReqContext) -> bool:
        """Promote ``key`` from tier ``tier_idx`` if a primary row can be had; the row
        is reserved when the scan ends (``_end_scan``)."""
        room = self._scan_room
        if room is None:  # the primary does not change during a scan until a reservation
            room = self._scan_room = self.primary.rows_obtainable()
        if room - self._scan_hits_evictable > len(self._scan_promotions):
            self._scan_promotions[key] = tier_idx
            return True
        # No room: reserve what the scan holds, then try this key alone, as a per-key
        # reservation would (it fails, and records the attempt the same way).
        self._scan_room = None
        self._reserve_scan_promotions()
        return self._reserve({key: tier_idx}, ctx, answered=False)

    def _end_scan(self) -> None:
        """Reserve the current scan's promotions and forget the scan. Called by a
        lookup of another request, and first by every call of ``_ENDS_THE_SCAN``."""
        self._reserve_scan_promotions()
        ctx = self._scan_ctx
        self._scan_ctx = self._scan_lookups = self._scan_room = None
        if self._scan_hits:
            hits = self._scan_hits
            self._scan_hits = {}
            self._scan_hits_evictable = 0
            if self.admission is not None:  # a re-read in the CPU tier: a touch
                for tier_idx, admitted in self.admission.on_hits(hits):
                    self._cascade(admitted, ctx, (tier_idx,))

    def _reserve_scan_promotions(self) -> None:
        if self._scan_promotions:
            promotions, self._scan_promotions = self._scan_promotions, {}
            self._reserve(promotions, self._scan_ctx, answered=True)

    def _reserve(self, promotions: dict[OffloadKey, int], ctx: ReqContext, answered: bool) -> bool:
        """Reserve rows for ``promotions`` (key -> tier index) in one primary call and
        queue them for ``on_schedule_end``; True if every key got a row. A key that got
        none was already answered HIT_PENDING if ``answered``: its next lookup by the
        same request says MISS."""
        keys = list(promotions)
        rows = self.primary.reserve_rows(keys, ctx, self._scan_hits)
        granted = len(keys) - rows.count(None)  # the keys without a row are a suffix
        if granted < len(keys):
            failed = keys[granted:]
            self._stats.increase_counter(metrics.PROMOTION_ALLOCATION_FAILURES, len(failed))
            if answered:  # a policy refused to evict although the room check passed
                self._refused.setdefault(ctx.req_id, set()).update(failed)
            keys, rows = keys[:granted], rows[:granted]
        if not keys:
            return False
        sources = self._load_sources.setdefault(ctx.req_id, {})
        by_tier: dict[int, tuple[list, list]] = {}
        if len(self.tiers) == 1:  # every promotion is from tier 0
            by_tier[0] = (keys, rows)
        else:
            for key, row in zip(keys, rows):
                tier_keys, tier_rows = by_tier.setdefault(promotions[key], ([], []))
                tier_keys.append(key)
                tier_rows.append(row)
        for tier_idx, (tier_keys, tier_rows) in by_tier.items():
            sources.update(dict.fromkeys(tier_keys, self._hit_source[tier_idx]))
            pending = self._pending_promotions[tier_idx].get(ctx.req_id)
            if pending is None:
                pending = self._pending_promotions[tier_idx][ctx.req_id] = (ctx, [], [])
            pending[1].extend(tier_keys)
            pending[2].extend(tier_rows)
        return granted == len(promotions)

    def _flush_pending_promotions(self) -> None:
        for tier_idx, per_request in enumerate(self._pending_promotions):
            if not per_request:
                continue
            self._pending_promotions[tier_idx] = {}
            for ctx, keys, rows in per_request.values():
                self.tiers[tier_idx].submit_load(self._new_job(keys, rows, True, ctx, tier_idx))

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        sources = self._load_sources.get(req_context.req_id)
        if sources:
            source = sources.get(key)
            if source is not None:
                return source
        return CacheHitSource.HOST

    # --- stores and cascades ---

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        # Always poll first: eviction must see the freshest unpins and promotions. Deferred
        # cascade keys take the rows the finished cascades unpinned before this store's
        # eviction can take them (they are the least recently used).
        self._polled_this_step = True
        self._process_finished_jobs()
        if self._has_deferred():
            self._flush_deferred_cascades()
        state = self._state(req_context)
        keys = list(keys)
        out = self.primary.prepare_store(keys, req_context)
        if out is None:
            return None
        if out.keys_to_store:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            new = set(out.keys_to_store)
            self._cascade_present(state, [k for k in keys if k not in new])
        return out

    def _cascade_present(self, state: _RequestState, keys: list[OffloadKey]) -> None:
        """Request-level tiers also get chunks already in the primary; pending ones wait."""
        ready = []
        for key in keys:
            result = self.primary.lookup(key, state.ctx)
            if result is HIT:
                ready.append(key)
            elif result is HIT_PENDING:
                state.parked_cascade_keys.append(key)
                self._parked[state.ctx.req_id] = state
        if ready:
            self._cascade(ready, state.ctx, sorted(state.request_level_tiers))

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self.primary.complete_store(keys, req_context, success)
        if success and self.tiers:
            stored = self.primary.ready_keys(keys)
            if stored:
                if self.admission is None:  # write-through
                    self._cascade(stored, req_context, range(len(self.tiers)))
                else:
                    state = self._requests.get(req_context.req_id)
                    exempt = state.request_level_tiers if state is not None else ()
                    for tier_idx, admitted in self.admission.on_store(stored, exempt):
                        self._cascade(admitted, req_context, (tier_idx,))
        state = self._requests.get(req_context.req_id)
        if state is not None:
            state.pending_primary_stores = max(0, state.pending_primary_stores - 1)
            self._maybe_finalize(state)

    def _flush_parked_cascades(self) -> None:
        if not self._parked:
            return
        parked, self._parked = self._parked, {}
        for state in parked.values():
            keys, state.parked_cascade_keys = state.parked_cascade_keys, []
            self._cascade_present(state, keys)  # parks the still-pending ones again
            self._maybe_finalize(state)

    # --- pass-through to the primary ---

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        return self.primary.prepare_load(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self.primary.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self.primary.touch(keys, req_context)
        for tier in self.tiers:
            tier.touch(keys, req_context)

    # --- request lifecycle ---

    def _state(self, ctx: ReqContext) -> _RequestState:
        state = self._requests.get(ctx.req_id)
        if state is None:
            self.on_new_request(ctx)
            state = self._requests[ctx.req_id]
        return state

    def on_new_request(self, req_context: ReqContext,
                       exclude_tier_idx: int | None = None) -> RequestOffloadingContext:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        state = _RequestState(req_context, excluded_tier=exclude_tier_idx)
        self._requests[req_context.req_id] = state
        self.primary.on_new_request(req_context)
        for tier_idx, tier in enumerate(self.tiers):
            if tier_idx == exclude_tier_idx:
                continue
            answer = tier.on_new_request(req_context)
            if getattr(answer, "policy", None) is not None and answer.policy.value == "request_level":
                state.request_level_tiers.add(tier_idx)
        policy = OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.CHUNK_LEVEL
        return RequestOffloadingContext(policy)

    def on_request_finished(self, req_context: ReqContext,
                            exclude_tier_idx: int | None = None) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        state = self._state(req_context)
        self.primary.on_request_finished(req_context)
        state.finished = True
        self._maybe_finalize(state)

    def _maybe_finalize(self, state: _RequestState) -> None:
        if (not state.finished or state.pending_primary_stores or state.parked_cascade_keys
                or state.deferred_cascade_keys):
            return
        req_id = state.ctx.req_id
        if self._requests.get(req_id) is not state:
            return
        del self._requests[req_id]
        for tier_idx, tier in enumerate(self.tiers):
            if tier_idx != state.excluded_tier:
                tier.on_request_finished(state.ctx)
        self._tracker.forget(req_id)
        self._load_sources.pop(req_id, None)
        self._refused.pop(req_id, None)

    # --- per step ---

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self._maybe_process_finished_jobs()
        for tier_idx, tier in enumerate(self.tiers):
            tier.serve_external_requests(self._parents[tier_idx])
        self._polled_this_step = False
        self._flush_pending_promotions()
        self._flush_parked_cascades()
        self._flush_deferred_cascades()
        for tier in self.tiers:
            tier.on_schedule_end(context)
        self._tracker.stop(context.new_req_ids)
        if self._rhythm is not None:
            self._rhythm.step_ended(time.monotonic())

    def has_pending_work(self) -> bool:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        jobs = len(self._jobs)
        if jobs and self._idle_job_counts:
            jobs -= sum(count() for count in self._idle_job_counts)
        return (jobs > 0 or bool(self._parked) or self._has_deferred() or bool(self._held)
                or any(tier.has_pending_work() for tier in self.tiers))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        events = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def get_stats(self) -> metrics.OffloadingStats:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        stats, self._stats = self._stats, metrics.OffloadingStats()
        self.primary.stats_into(stats)
        self._tracker.take_into(stats)
        for tier_idx, tier in enumerate(self.tiers):
            label = (self.labels[tier_idx + 1],)
            promotions, promo_rows = self._active[True][tier_idx]
            cascades, cascade_rows = self._active[False][tier_idx]
            stats.set_gauge(metrics.ACTIVE_PROMOTION_JOBS, promotions, label)
            stats.set_gauge(metrics.ACTIVE_CASCADE_JOBS, cascades, label)
            stats.set_gauge(metrics.PRIMARY_WRITE_USAGE_PERC, promo_rows / self._num_chunks, label)
            stats.set_gauge(metrics.PRIMARY_READ_USAGE_PERC, cascade_rows / self._num_chunks, label)
            detector = tier.bp_detector
            if detector is not None:
                record_backpressure_metrics(stats, detector, label[0])
            stats_into = self._tier_stats_into[tier_idx]
            if stats_into is not None:
                stats_into(stats)
            else:
                metrics.merge_stats(stats, tier.get_stats())
        self._held.gauges_into(stats)
        if self._publisher is not None:  # while rounds come, they publish
            rounds = self._rhythm is not None and self._rhythm.rounds_came
            self._publisher.observe(stats, publish=not rounds)
        return stats

    def config_info(self) -> list[dict[str, Any]]:
        info = [{**(self.primary.config_info()[0] or {}), "tier": PRIMARY_LABEL}]
        for tier_idx, tier in enumerate(self.tiers):
            own = tier.config_info() if hasattr(tier, "config_info") else {}  # 0.32's tiers lack it
            info.append({**own, "tier": self.labels[tier_idx + 1]})
        return info

    # --- reset and shutdown ---

    def reset_cache(self) -> None:
        """Drain every tier, drop all primary state (tiers keep their data) and
        hold promotions until ``on_reset_flushed``."""
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self._flush_deferred_cascades(capped=False)  # the tiers keep them (drained below)
        for tier in self.tiers:
            tier.drain_jobs()
        self._process_finished_jobs()
        if self._jobs:
            owners = sorted({self.labels[t + 1] for _, t in self._jobs.values()})
            raise RuntimeError(f"reset_cache: tiers {owners} still hold jobs after drain_jobs()")
        if self._held:  # (the primary refuses to reset too)
            raise RuntimeError(f"reset_cache: tiers {self._held.holding_tiers()} did not set the "
                               f"deferred_release events of their failed promotions in "
                               f"drain_jobs(); their primary rows may still be written")
        self._pending_promotions = [{} for _ in self.tiers]
        self._load_sources.clear()
        self._parked.clear()
        for state in list(self._requests.values()):
            state.pending_primary_stores = 0
            state.parked_cascade_keys.clear()
            self._maybe_finalize(state)
        # what a caller that must fence copies itself (vLLM 0.32's adapter) needs to know
        self.copies_in_flight_at_reset = self.primary.copies_may_be_in_flight()
        self.primary.reset_cache()
        self._polled_this_step = False
        for tier in self.tiers:
            detector = tier.bp_detector
            if detector is not None:
                detector.reset()
        self._refused.clear()
        self._promotions_held = bool(self.tiers)

    def on_reset_flushed(self) -> None:
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        self._promotions_held = False

    # --- the tier-poll thread ---

    def poll_tiers(self) -> None:
        """Process the finished jobs of the tiers that opted in and let them serve
        external requests. Caller holds the lock (the tier-poll thread). Promotions and
        cascades are not flushed; the once-per-step gate is left as it was."""
        if self._scan_ctx is not None:  # _ENDS_THE_SCAN
            self._end_scan()
        gate = self._polled_this_step
        self._polled_this_step = True  # a lookup from serving must not poll every tier
        try:
            self._process_finished_jobs(self._polled)
            for tier_idx in self._polled:
                self.tiers[tier_idx].serve_external_requests(self._parents[tier_idx])
        finally:
            self._polled_this_step = gate

    def poll_between_steps(self) -> None:
        """Process the finished jobs of the tiers that set ``polls_between_steps``.
        Caller holds the lock (the step-window thread, between steps). Each such tier's
        ``submit_between_steps()`` (if it has one) goes first; the stats publisher
        publishes here, if due, instead of in ``get_stats``. Nothing while a lookup
        scan is open (a connector releasing the lock inside one): the scan's state stays
        as the engine left it. Promotions and cascades are not flushed; the once-per-step
        gate is left as it was."""
        if self._scan_ctx is not None:
            return
        gate = self._polled_this_step
        self._polled_this_step = True
        try:
            for submit in self._window_submits:
                submit()
            self._process_finished_jobs(self._window_polled)
        finally:
            self._polled_this_step = gate
        if self._rhythm is not None:
            self._rhythm.round_ran()
        if self._publisher is not None:
            self._publisher.publish_if_due()

    def shutdown(self) -> None:
        """Stop the poll threads, shut every tier down, then the primary (not if a
        tier failed: it may still use the primary's rows). Called without the lock."""
        threads = {"step-window poll": self._window_thread, "tier-poll": self._poll_thread}
        stuck = [name for name, t in threads.items() if t is not None and not t.stop()]
        if not stuck:
            self._shutdown_tiers()
            return
        # a round outlived the join: the tiers go down once it is over, under the lock
        if not self._lock.acquire(timeout=POLL_JOIN_TIMEOUT_S):
            raise RuntimeError(f"shutdown: the {' and '.join(stuck)} thread holds the manager lock")
        try:
            self._shutdown_tiers()
        finally:
            self._lock.release()

    def _shutdown_tiers(self) -> None:
        errors = []
        for tier in reversed(self.tiers):
            try:
                tier.shutdown()
            except Exception as e:  # keep shutting the others down
                errors.append((tier, e))
        if errors:
            tier, error = errors[0]
            raise RuntimeError(f"tier {tier.tier_type} failed to shut down: {error}") from error
        for stop in self._before_primary_shutdown:
            stop()
        self.primary.shutdown()
