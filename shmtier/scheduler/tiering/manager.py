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
       (while the step-window rounds come, the cascades to the tiers they poll are left
        to the next round: nothing is pinned or sent for them in the step)
       (with an ``admission`` rule other than write-through, only the chunks it admits;
        the CPU-tier hits of a lookup scan may admit more when the scan ends)
    tier.get_finished_jobs ──(polled once per step, and always in prepare_store)──▶
         promotion: rows become ready (or are freed: MISS next time; with the result's
                    deferred_release, held until the tier sets it: deferred_release.py)
         cascade:   rows unpinned, backpressure detector updated

Promotion rows are reserved per lookup *scan* (``scan.py``): the keys a request's
consecutive lookups promote get their rows in one call when the scan ends, at the next
call that is not a lookup of the same request; every call but ``lookup`` ends the open
scan before it does anything else.

Two daemon threads may poll tiers besides the steps' own polls, each holding the lock:
the tier-poll thread (``poll_thread.py``, docs/vllm-contract.md §6.10: tiers that set
``tolerates_off_thread_polling``, every ``tier_poll_interval_s``; they also serve external
requests) and the step-window thread (``window_poll.py``: tiers that set
``polls_between_steps``, only during the forward pass; each round first cascades what
the last step left to it, then lets the tiers send what they left queued). Neither
flushes promotions, deferred or parked cascades (per-step batching points) and both
leave the once-per-step gate as they found it.

Requests finish in two stages: ``on_request_finished`` tells the primary at
once, but the tiers hear of it only after the request's last pending primary
store has completed (a cascade for it may still follow until then).

What lives apart: the lookup scan (``scan.py``), promotion bookkeeping
(``promotions.py``), cascades and their deferred queues (``cascades.py``), lookup metrics
(``lookup_metrics.py``), poll threads (``poll_thread.py``, ``window_poll.py``) and deferred
releases (``deferred_release.py``); this module keeps the request state and the calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from shmtier import metrics
from shmtier.contract import (
    CacheHitSource,
    CPULoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.scheduler.stats_publisher import StatsPublisher
from shmtier.scheduler.tiering.admission import CascadeAdmission
from shmtier.scheduler.tiering.base import (
    JobId,
    SecondaryTierManager,
    TransferJob,
    optional_attribute,
)
from shmtier.scheduler.tiering.cascades import Cascades
from shmtier.scheduler.tiering.deferred_release import DeferredReleases
from shmtier.scheduler.tiering.lookup_metrics import LookupTracker
from shmtier.scheduler.tiering.lookup_tiers import LookupTiers
from shmtier.scheduler.tiering.parent import TierFacingParent
from shmtier.scheduler.tiering.poll_thread import POLL_JOIN_TIMEOUT_S, TierPollThread
from shmtier.scheduler.tiering.promotions import Promotions
from shmtier.scheduler.tiering.scan import LookupScan
from shmtier.scheduler.tiering.step_stats import StepStats
from shmtier.scheduler.tiering.window_poll import (StepRhythm, StepWindowPollThread,
                                                   cpu_reader, no_cpu)

logger = logging.getLogger(__name__)

_NO_FILTER = object()  # no lookup has asked the tiers yet

HIT, MISS, RETRY, HIT_PENDING = (LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY,
                                 LookupResult.HIT_PENDING)
PRIMARY_LABEL = "0:primary"


@dataclass
class _RequestState:
    ctx: ReqContext
    pending_primary_stores: int = 0
    finished: bool = False
    excluded_tier: int | None = None
    request_level_tiers: set[int] = field(default_factory=set)
    parked_cascade_keys: list[OffloadKey] = field(default_factory=list)
    deferred_cascade_keys: int = 0  # keys of this request waiting in a tier's deferred queue
    later_cascades: int = 0  # its stores whose cascades wait for a round (cascades.py)


class TieringOffloadingManager:
    """The primary tier plus ``tiers`` (secondary, in priority order)."""

    def __init__(self, primary: CPUPrimaryTierOffloadingManager, tiers: Sequence[Any],
                 before_primary_shutdown: Sequence[Any] = (), tier_poll_interval_s: float = 0.0,
                 admission: CascadeAdmission | None = None, tier_poll_window: float = 0.0,
                 window_on_engine_cpu: bool = False):
        """``before_primary_shutdown``: callables run after the tiers shut down and
        before the primary releases the segment (the spec passes the worker pool's).
        ``tier_poll_interval_s`` > 0 starts the tier-poll thread if a tier opts in, and
        with ``tier_poll_window`` > 0 the step-window thread if a tier opts in to that
        (``window_on_engine_cpu``: its rounds on the CPU the engine thread ended its last
        step on).
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
        self._polled_this_step = False
        self._requests: dict[str, _RequestState] = {}
        self._promotions_held = False
        self.copies_in_flight_at_reset = False  # set by reset_cache
        # the lookup scan: open (``_scan`` is ``_lookup_scan``) from its begin to its end
        self._scan: LookupScan | None = None
        self._lookup_scan = LookupScan(self)
        self._promotions = Promotions(self)
        # (its dicts, never rebound: read on the per-key paths)
        self._load_sources, self._refused = self._promotions.load_sources, self._promotions.refused
        self._cascades = Cascades(self)
        # (bound once: called per step and per store, as the manager's own methods were)
        self._complete_promotion, self._flush_pending_promotions = (
            self._promotions.complete, self._promotions.flush)
        self._cascade, self._complete_cascade = self._cascades.cascade, self._cascades.complete
        self._has_deferred, self._flush_deferred_cascades = (
            self._cascades.any_deferred, self._cascades.flush)
        self._flush_parked_cascades = self._cascades.flush_parked
        self._later, self._flush_later = self._cascades.later, self._cascades.flush_later
        self._parked = self._cascades.parked  # request id -> state with parked keys
        self._parents = [TierFacingParent(self, i) for i in range(len(self.tiers))]
        # the tiers whose serve_external_requests is not the base class's (which does
        # nothing), as built: on_schedule_end calls only theirs
        self._serving = [i for i, t in enumerate(self.tiers)
                         if getattr(getattr(t, "serve_external_requests", None), "__func__", None)
                         is not SecondaryTierManager.serve_external_requests]
        self._tracker = LookupTracker(self.labels)
        self._stats = metrics.OffloadingStats()
        # rows of failed promotions a tier may still write (vLLM 0.34's deferred release)
        self._held = DeferredReleases(primary, self.labels[1:],
                                      [optional_attribute(t, "defers_release") for t in self.tiers])
        self._hit_source = [CacheHitSource(t.cache_hit_source.value) for t in self.tiers]
        self._tier_choice = LookupTiers(self.tiers)
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
        self._unwindowed = [i for i in range(len(self.tiers)) if i not in self._window_polled]
        # (index, its step_needs_poll or None) of each window-polled tier
        self._step_hints = [(i, optional_attribute(self.tiers[i], "step_needs_poll"))
                            for i in self._window_polled]
        self._window_submits = [s for s in (getattr(self.tiers[i], "submit_between_steps", None)
                                            for i in self._window_polled) if s is not None]
        self._rhythm: StepRhythm | None = None
        self._window_thread: StepWindowPollThread | None = None
        # the engine thread's CPU at each step end, for rounds that follow it (~0.1 µs)
        self._getcpu = cpu_reader() if window_on_engine_cpu else no_cpu
        if self._window_polled and tier_poll_interval_s > 0 and tier_poll_window > 0:
            self._rhythm = StepRhythm(tier_poll_window, tier_poll_interval_s)
            self._window_thread = StepWindowPollThread(self._lock, self.poll_between_steps,
                                                       self._rhythm,
                                                       on_engine_cpu=window_on_engine_cpu)
        # the step's statistics, into the segment for `shmtier top` (at most every 0.1 s)
        self._publisher = StatsPublisher.for_manager(primary, self.tiers, self.labels,
                                                     self._row_bytes)
        self._step_stats = StepStats(self)

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
        if self._scan is not None:
            self._scan.end()
        return self._new_job(keys, self.primary.pin_rows(keys), False, ctx, tier_idx)

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

    def _poll_in_step(self) -> None:
        """A step's poll of the tiers' finished jobs (its first call's, and each
        ``prepare_store``'s). After a forward pass with rounds (``StepRhythm.came``) a
        step sends the window-polled tiers nothing before its end (the rounds take
        everything but the loads ``on_schedule_end`` sends), so it polls them only for
        what it waits for: none once a round left them nothing in flight
        (``StepRhythm.quiet``), else each whose ``step_needs_poll`` says so (or that has
        none), and each holding deferred releases. What a skipped poll would have found
        waits in its ring for a round; a step after a forward pass without rounds polls
        every tier."""
        self._polled_this_step = True
        rhythm = self._rhythm
        if rhythm is None or not rhythm.came:
            self._process_finished_jobs()
        elif rhythm.quiet:
            self._process_finished_jobs(self._unwindowed)
        else:
            held = self._held.by_tier
            self._process_finished_jobs(self._unwindowed + [
                i for i, needs in self._step_hints if needs is None or needs() or held[i]])

    # --- lookups and promotions ---

    def lookup(self, key: OffloadKey, req_context: ReqContext,
               exclude_tier_idx: int | None = None) -> LookupResult:
        scan = self._scan
        if scan is None or scan.req_id != req_context.req_id:
            if scan is not None:
                scan.end()
            scan = self._lookup_scan.begin(req_context)
        if not self._polled_this_step:  # the step's poll, if no call polled yet
            self._poll_in_step()
        record = scan.record
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
            hits = scan.hits
            if key not in hits:
                hits[key] = None
                scan.hits_evictable += count == 0
            return result
        if result is not MISS or self._promotions_held or not self.tiers:
            return result
        if key in scan.promotions:
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
                return HIT_PENDING if scan.promote(tier_idx, key) else MISS
            if answer is RETRY:
                retry = True
        return RETRY if retry else MISS

    def _lookup_tiers(self, allowed: Any, exclude_tier_idx: int | None) -> list[tuple[int, Any]]:
        """(index, tier) of the tiers a lookup asks (``lookup_tiers.py``); a hashable
        filter's answer is kept for ``lookup`` to find by identity."""
        tiers = self._tier_choice.memoised(allowed, exclude_tier_idx)
        if tiers is None:  # an unhashable filter: evaluated every time
            return self._tier_choice.evaluate(allowed, exclude_tier_idx)
        self._last_lookup_tiers = (allowed, exclude_tier_idx, tiers)
        return tiers

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        if self._scan is not None:
            self._scan.end()
        sources = self._load_sources.get(req_context.req_id)
        if sources:
            source = sources.get(key)
            if source is not None:
                return source
        return CacheHitSource.HOST

    # --- stores and cascades ---

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self._scan is not None:
            self._scan.end()
        # Always poll first: eviction must see the freshest unpins and promotions. Deferred
        # cascade keys take the rows the finished cascades unpinned before this store's
        # eviction can take them (they are the least recently used).
        self._poll_in_step()
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
            self._cascades.present(state, [k for k in keys if k not in new])
        return out

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        if self._scan is not None:
            self._scan.end()
        self.primary.complete_store(keys, req_context, success)
        if success and self.tiers:
            stored = self.primary.ready_keys(keys)
            if stored:
                rhythm = self._rhythm
                if self.admission is None and rhythm is not None and rhythm.came:
                    # write-through, while rounds come: the rounds' tiers at the next one
                    if self._unwindowed:
                        self._cascade(stored, req_context, self._unwindowed)
                    self._cascades.leave_to_round(stored, req_context,
                                                  self._requests.get(req_context.req_id))
                elif self.admission is None:  # write-through
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

    # --- pass-through to the primary ---

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> CPULoadStoreSpec:
        if self._scan is not None:
            self._scan.end()
        return self.primary.prepare_load(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scan is not None:
            self._scan.end()
        self.primary.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scan is not None:
            self._scan.end()
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
        if self._scan is not None:
            self._scan.end()
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
        if self._scan is not None:
            self._scan.end()
        state = self._state(req_context)
        self.primary.on_request_finished(req_context)
        state.finished = True
        self._maybe_finalize(state)

    def _maybe_finalize(self, state: _RequestState) -> None:
        if (not state.finished or state.pending_primary_stores or state.parked_cascade_keys
                or state.deferred_cascade_keys or state.later_cascades):
            return
        req_id = state.ctx.req_id
        if self._requests.get(req_id) is not state:
            return
        del self._requests[req_id]
        for tier_idx, tier in enumerate(self.tiers):
            if tier_idx != state.excluded_tier:
                tier.on_request_finished(state.ctx)
        self._tracker.forget(req_id)
        self._promotions.forget(req_id)

    # --- per step ---

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._scan is not None:
            self._scan.end()
        if not self._polled_this_step:  # the step's poll, if no call polled yet
            self._poll_in_step()
        for tier_idx in self._serving:
            self.tiers[tier_idx].serve_external_requests(self._parents[tier_idx])
        self._polled_this_step = False
        self._flush_pending_promotions()
        if self._later and not self._rhythm.came:  # no round since the step that left them
            self._flush_later()
        if self._parked:
            self._flush_parked_cascades()
        self._flush_deferred_cascades()
        for tier in self.tiers:
            tier.on_schedule_end(context)
        if context.new_req_ids:
            self._tracker.stop(context.new_req_ids)
        if self._rhythm is not None:
            self._rhythm.step_ended(time.monotonic(), self._getcpu())

    def has_pending_work(self) -> bool:
        if self._scan is not None:
            self._scan.end()
        jobs = len(self._jobs)
        if jobs and self._idle_job_counts:
            jobs -= sum(count() for count in self._idle_job_counts)
        return (jobs > 0 or bool(self._parked) or bool(self._later) or self._has_deferred()
                or bool(self._held) or any(tier.has_pending_work() for tier in self.tiers))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._scan is not None:
            self._scan.end()
        events = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def get_stats(self) -> metrics.OffloadingStats:
        if self._scan is not None:
            self._scan.end()
        stats, self._stats = self._stats, metrics.OffloadingStats()
        return self._step_stats.fill(stats)

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
        if self._scan is not None:
            self._scan.end()
        self._flush_later()
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
        self._promotions.reset()
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
        self._promotions_held = bool(self.tiers)

    def on_reset_flushed(self) -> None:
        if self._scan is not None:
            self._scan.end()
        self._promotions_held = False

    # --- the tier-poll thread ---

    def poll_tiers(self) -> None:
        """Process the finished jobs of the tiers that opted in and let them serve
        external requests. Caller holds the lock (the tier-poll thread). Promotions and
        cascades are not flushed; the once-per-step gate is left as it was."""
        if self._scan is not None:
            self._scan.end()
        gate = self._polled_this_step
        self._polled_this_step = True  # a lookup from serving must not poll every tier
        try:
            self._process_finished_jobs(self._polled)
            for tier_idx in self._polled:
                self.tiers[tier_idx].serve_external_requests(self._parents[tier_idx])
        finally:
            self._polled_this_step = gate

    def poll_between_steps(self) -> bool:
        """Process the finished jobs of the tiers that set ``polls_between_steps``.
        Caller holds the lock (the step-window thread, between steps). Each such tier's
        ``submit_between_steps()`` (if it has one) goes first, after the cascades the
        last step left to the round (``Cascades.flush_later``); the stats publisher
        publishes here, if due, instead of in ``get_stats``. Nothing while a lookup
        scan is open (a connector releasing the lock inside one): the scan's state stays
        as the engine left it. Promotions, deferred and parked cascades are not flushed
        (per-step batching points); the once-per-step gate is left as it was. Returns
        False when none of those tiers has work pending (nothing a later round could
        collect until the engine calls again)."""
        if self._scan is not None:
            return True
        gate = self._polled_this_step
        self._polled_this_step = True
        try:
            if self._later:
                self._flush_later()
            for submit in self._window_submits:
                submit()
            self._process_finished_jobs(self._window_polled)
        finally:
            self._polled_this_step = gate
        if self._publisher is not None:
            self._publisher.publish_if_due()
        return bool(self._held) or any(self.tiers[i].has_pending_work()
                                       for i in self._window_polled)

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
