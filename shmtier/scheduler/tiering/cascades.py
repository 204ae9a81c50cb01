"""The tiering manager's cascades (scheduler process): stored chunks fanned out to the
secondary tiers, as backpressure allows and as far as each tier's pinned-row cap has
room; the rest wait, unpinned, in the tier's deferred queue.

A tier that falls behind must not starve the primary tier: rows pinned by its queued
cascades are capped (tiers opt in with ``max_pinned_rows``); one cascade alone always
goes, however large. What does not fit waits, unpinned (the primary may still evict it:
counted lost), in the tier's deferred queue behind the keys already there, at most
``max_pinned_rows`` keys (the oldest beyond are dropped, counted as backpressure drops),
and goes oldest first as pinned rows complete: at the next cascade, after the poll of
each ``prepare_store`` and at ``on_schedule_end`` (vLLM has no cap and drops nothing but
what its detector rejects: bench/README.md, issue 14). A request is not finalized while
keys of its wait.

Request-level tiers also get the chunks a request's ``prepare_store`` found already in
the primary (``present``); those still being written are parked with their request until
they are ready (``flush_parked``, at ``on_schedule_end``).

While the step-window thread's rounds come, a step's write-through cascades to the tiers
it polls wait for the next round (``leave_to_round``, ``flush_later``): their pins, jobs
and the tiers' bookkeeping run between steps, not in the step. Meanwhile the keys are not
pinned (the primary may evict them: counted lost, as deferred keys are). A step after a
forward pass without rounds sends what still waits (``on_schedule_end``).

Who calls: the manager (and its scan's admission of CPU-tier hits), in the scheduler
process, under the manager's lock. Never blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from shmtier import metrics
from shmtier.contract import LookupResult, OffloadKey, ReqContext
from shmtier.scheduler.tiering.base import JobResult, TransferJob, optional_attribute

_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING


class Cascades:
    """Cascade jobs of manager ``manager`` and each tier's deferred keys, oldest first,
    each with (ctx, its request's state or None)."""

    __slots__ = ("_manager", "deferred", "max_pinned_rows", "parked", "later")

    def __init__(self, manager: Any):
        self._manager = manager
        self.max_pinned_rows = [optional_attribute(t, "max_pinned_rows") for t in manager.tiers]
        self.deferred: list[OrderedDict[OffloadKey, tuple[ReqContext, Any]]] = [
            OrderedDict() for _ in manager.tiers]
        self.parked: dict[str, Any] = {}  # request id -> its state, with parked keys
        # stored keys left to the next round: (keys, ctx, its request's state or None)
        self.later: list[tuple[list[OffloadKey], ReqContext, Any]] = []

    def cascade(self, keys: list[OffloadKey], ctx: ReqContext,
                tier_indices: Iterable[int]) -> None:
        """Send ``keys`` (ready in the primary) to each tier of ``tier_indices``."""
        manager = self._manager
        for tier_idx in tier_indices:
            tier = manager.tiers[tier_idx]
            detector = tier.bp_detector
            if detector is not None and not detector.should_store(len(keys)):
                continue  # counted by the detector's policy
            cap = self.max_pinned_rows[tier_idx]
            if cap is not None:
                deferred = self.deferred[tier_idx]
                if deferred:
                    self._submit_deferred(tier_idx, cap)  # older keys first
                pinned = manager._active[False][tier_idx][1]
                if deferred or (pinned and pinned + len(keys) > cap):
                    fits = 0 if deferred else max(0, cap - pinned)
                    if fits:
                        tier.submit_store(manager._create_store_job(keys[:fits], ctx, tier_idx))
                    self._defer(tier_idx, keys[fits:], ctx, cap)
                    continue
            tier.submit_store(manager._create_store_job(keys, ctx, tier_idx))

    def leave_to_round(self, keys: list[OffloadKey], ctx: ReqContext, state: Any) -> None:
        """``keys`` (ready in the primary, stored by request ``ctx``, whose ``state`` it
        is or None) go to the window-polled tiers at the next ``flush_later``; their
        request is not finalized meanwhile."""
        self.later.append((keys, ctx, state))
        if state is not None:
            state.later_cascades += 1

    def flush_later(self) -> None:
        """Cascade what ``leave_to_round`` left to the window-polled tiers: the keys the
        primary still holds ready (the others are counted lost for each of them)."""
        if not self.later:
            return
        later = list(self.later)
        self.later.clear()  # (in place: the manager reads it per step)
        manager = self._manager
        tiers, ready_keys = manager._window_polled, manager.primary.ready_keys
        lost = 0
        waiting = []
        for keys, ctx, state in later:
            ready = ready_keys(keys)
            lost += len(keys) - len(ready)
            if ready:
                self.cascade(ready, ctx, tiers)
            if state is not None:
                state.later_cascades -= 1
                waiting.append(state)
        if lost:
            for tier_idx in tiers:
                manager._stats.increase_counter(metrics.CASCADE_DEFERRED_LOST_CHUNKS, lost,
                                                (manager.labels[tier_idx + 1],))
        for state in waiting:
            manager._maybe_finalize(state)

    def present(self, state: Any, keys: list[OffloadKey]) -> None:
        """Request-level tiers also get chunks already in the primary; pending ones wait
        (parked with the request's ``state``)."""
        primary = self._manager.primary
        ready = []
        for key in keys:
            result = primary.lookup(key, state.ctx)
            if result is _HIT:
                ready.append(key)
            elif result is _HIT_PENDING:
                state.parked_cascade_keys.append(key)
                self.parked[state.ctx.req_id] = state
        if ready:
            self.cascade(ready, state.ctx, sorted(state.request_level_tiers))

    def flush_parked(self) -> None:
        """Cascade the parked keys now ready; the others stay parked."""
        if not self.parked:
            return
        parked = list(self.parked.values())
        self.parked.clear()  # (in place: the manager reads it per step)
        for state in parked:
            keys, state.parked_cascade_keys = state.parked_cascade_keys, []
            self.present(state, keys)  # parks the still-pending ones again
            self._manager._maybe_finalize(state)

    def _defer(self, tier_idx: int, keys: list[OffloadKey], ctx: ReqContext, cap: int) -> None:
        """Queue ``keys`` (not pinned: the primary may still evict them) for tier
        ``tier_idx``; their request is not finalized while they wait. The queue holds at
        most ``cap`` keys: the oldest beyond are dropped, counted as backpressure drops."""
        manager = self._manager
        deferred = self.deferred[tier_idx]
        state = manager._requests.get(ctx.req_id)
        owner = (ctx, state)
        added = 0
        for key in keys:
            if key not in deferred:  # (a key queued twice keeps its first place)
                deferred[key] = owner
                added += 1
        if not added:
            return
        label = (manager.labels[tier_idx + 1],)
        manager._stats.increase_counter(metrics.CASCADE_DEFERRED_CHUNKS, added, label)
        if state is not None:
            state.deferred_cascade_keys += added
        overflow = len(deferred) - cap
        if overflow > 0:
            released = [deferred.popitem(last=False)[1] for _ in range(overflow)]
            manager._stats.increase_counter(metrics.BACKPRESSURE_STORES_DROPPED, 1, label)
            manager._stats.increase_counter(metrics.BACKPRESSURE_BLOCKS_DROPPED, overflow, label)
            self._release(released)

    def _submit_deferred(self, tier_idx: int, cap: int | None) -> None:
        """Submit tier ``tier_idx``'s deferred keys, oldest first, as far as the cap
        ``cap`` has room (None: all of them), in one cascade job per request. Keys the
        primary no longer holds ready (evicted meanwhile) are skipped and counted lost;
        the tier itself skips keys it already has or is storing (docs/vllm-contract.md §7.2)."""
        manager = self._manager
        deferred = self.deferred[tier_idx]
        pinned = manager._active[False][tier_idx][1]
        room = len(deferred) if cap is None else cap - pinned if pinned else cap
        if room <= 0:
            return
        lost = 0
        released: list[tuple[ReqContext, Any]] = []
        jobs: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}  # per request
        while room > 0 and deferred:
            taken = [deferred.popitem(last=False) for _ in range(min(room, len(deferred)))]
            ready = set(manager.primary.ready_keys([key for key, _ in taken]))
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
            manager.tiers[tier_idx].submit_store(manager._create_store_job(keys, ctx, tier_idx))
        if lost:
            manager._stats.increase_counter(metrics.CASCADE_DEFERRED_LOST_CHUNKS, lost,
                                            (manager.labels[tier_idx + 1],))
        if released:
            self._release(released)

    def _release(self, owners: list[tuple[ReqContext, Any]]) -> None:
        """One deferred key of each of ``owners`` left its queue: finalize the requests
        that only waited for them."""
        waiting = []
        for _, state in owners:
            if state is not None:
                state.deferred_cascade_keys -= 1
                if not state.deferred_cascade_keys:
                    waiting.append(state)
        for state in waiting:
            self._manager._maybe_finalize(state)

    def any_deferred(self) -> bool:
        return any(self.deferred)

    def flush(self, capped: bool = True) -> None:
        """Submit each tier's deferred keys as its cap allows (``capped``) or all of them."""
        for tier_idx, deferred in enumerate(self.deferred):
            if deferred:
                self._submit_deferred(tier_idx, self.max_pinned_rows[tier_idx] if capped else None)

    def complete(self, job: TransferJob, tier_idx: int, result: JobResult) -> None:
        """Cascade ``job`` of tier ``tier_idx`` finished: its rows are unpinned, the
        tier's backpressure detector learns how it went."""
        manager = self._manager
        label = (manager.labels[tier_idx + 1],)
        manager.primary.complete_read(job.keys, job.req_context)
        detector = manager.tiers[tier_idx].bp_detector
        stats = manager._stats
        if result.success:
            nbytes = result.transfer_bytes or len(job.keys) * manager._row_bytes
            stats.increase_counter(metrics.WRITE_BYTES, len(job.keys) * manager._row_bytes, label)
            if result.transfer_time is not None:
                stats.increase_counter(metrics.WRITE_TIME, result.transfer_time, label)
            if detector is not None:
                detector.update(job.submit_time, nbytes)
        else:
            stats.increase_counter(metrics.CASCADE_JOB_FAILURES, 1, label)
            if detector is not None:
                detector.on_store_failed()
