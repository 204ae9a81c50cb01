"""The tiering manager's promotion bookkeeping (scheduler process): rows reserved for a
scan's promotions, queued per (tier, request) until ``on_schedule_end`` sends one
promotion job each, and what each finished job leaves behind.

State: ``pending`` (per tier: request id -> (ctx, keys, rows) queued), ``load_sources``
(request id -> key -> the ``CacheHitSource`` of the tier promoting it, for
``get_load_source``) and ``refused`` (request id -> keys answered HIT_PENDING whose
reservation a policy then refused: their next lookup is a MISS). A key is in a request's
``load_sources`` from its reservation until its promotion fails or the request is
finalized.

Who calls: the manager and its :class:`~shmtier.scheduler.tiering.scan.LookupScan`, in
the scheduler process, under the manager's lock. Never blocks.
"""

from __future__ import annotations

import time
from typing import Any

from shmtier import metrics
from shmtier.contract import CacheHitSource, OffloadKey, ReqContext
from shmtier.scheduler.tiering.base import JobResult, TransferJob


class Promotions:
    """Reservations and promotion jobs of manager ``manager``."""

    __slots__ = ("_manager", "pending", "load_sources", "refused")

    def __init__(self, manager: Any):
        self._manager = manager
        self.pending: list[dict[str, tuple[ReqContext, list, list]]] = [
            {} for _ in manager.tiers]
        self.load_sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        self.refused: dict[str, set[OffloadKey]] = {}

    def reserve(self, promotions: dict[OffloadKey, int], ctx: ReqContext,
                kept: dict[OffloadKey, None], answered: bool) -> bool:
        """Reserve rows for ``promotions`` (key -> tier index) in one primary call,
        keeping ``kept`` from eviction, and queue them for ``on_schedule_end``; True if
        every key got a row. A key that got none was already answered HIT_PENDING if
        ``answered``: its next lookup by the same request says MISS."""
        manager = self._manager
        keys = list(promotions)
        rows = manager.primary.reserve_rows(keys, ctx, kept)
        granted = len(keys) - rows.count(None)  # the keys without a row are a suffix
        if granted < len(keys):
            failed = keys[granted:]
            manager._stats.increase_counter(metrics.PROMOTION_ALLOCATION_FAILURES, len(failed))
            if answered:  # a policy refused to evict although the room check passed
                self.refused.setdefault(ctx.req_id, set()).update(failed)
            keys, rows = keys[:granted], rows[:granted]
        if not keys:
            return False
        sources = self.load_sources.setdefault(ctx.req_id, {})
        by_tier: dict[int, tuple[list, list]] = {}
        if len(self.pending) == 1:  # every promotion is from tier 0
            by_tier[0] = (keys, rows)
        else:
            for key, row in zip(keys, rows):
                tier_keys, tier_rows = by_tier.setdefault(promotions[key], ([], []))
                tier_keys.append(key)
                tier_rows.append(row)
        hit_source = manager._hit_source
        for tier_idx, (tier_keys, tier_rows) in by_tier.items():
            sources.update(dict.fromkeys(tier_keys, hit_source[tier_idx]))
            pending = self.pending[tier_idx].get(ctx.req_id)
            if pending is None:
                pending = self.pending[tier_idx][ctx.req_id] = (ctx, [], [])
            pending[1].extend(tier_keys)
            pending[2].extend(tier_rows)
        return granted == len(promotions)

    def flush(self) -> None:
        """Send the queued promotions: one job per (tier, request)."""
        manager = self._manager
        for tier_idx, per_request in enumerate(self.pending):
            if not per_request:
                continue
            self.pending[tier_idx] = {}
            for ctx, keys, rows in per_request.values():
                manager.tiers[tier_idx].submit_load(manager._new_job(keys, rows, True, ctx,
                                                                     tier_idx))

    def complete(self, job: TransferJob, tier_idx: int, result: JobResult) -> None:
        """Promotion ``job`` of tier ``tier_idx`` finished: its landed rows become ready,
        its failed ones are freed (or held while the tier may still write them:
        ``deferred_release``) and no longer a load source."""
        manager = self._manager
        label = (manager.labels[tier_idx + 1],)
        ctx = job.req_context
        if result.success:
            landed, failed = list(job.keys), []
        else:
            ok = set(result.successful_keys or ())
            landed = [k for k in job.keys if k in ok]
            failed = [k for k in job.keys if k not in ok]
        if landed:
            manager.primary.complete_write(landed, ctx, True)
            if manager.admission is not None:
                manager.admission.on_promoted(tier_idx, landed)
        stats = manager._stats
        if failed:
            release = getattr(result, "deferred_release", None)  # vLLM < 0.34: none
            if release is None:
                manager.primary.complete_write(failed, ctx, False)
            else:  # the tier may still write their rows: held until it sets the event
                manager._held.defer(tier_idx, failed, release)
            sources = self.load_sources.get(ctx.req_id)
            if sources:
                mine = manager._hit_source[tier_idx]
                for key in failed:
                    if sources.get(key) == mine:
                        del sources[key]
            stats.increase_counter(metrics.PROMOTION_JOB_FAILURES, 1, label)
        stats.increase_counter(metrics.READ_BYTES, len(landed) * manager._row_bytes, label)
        if result.transfer_time is not None:
            stats.increase_counter(metrics.READ_TIME, result.transfer_time, label)
        stats.observe_histogram(metrics.PROMOTION_LATENCY, time.monotonic() - job.submit_time,
                                (label[0], "success" if result.success else "failure"))

    def forget(self, req_id: str) -> None:
        """Request ``req_id`` is finalized."""
        self.load_sources.pop(req_id, None)
        self.refused.pop(req_id, None)

    def reset(self) -> None:
        """``reset_cache``: nothing queued, no load source, nothing refused."""
        self.pending = [{} for _ in self.pending]
        self.load_sources.clear()
        self.refused.clear()
