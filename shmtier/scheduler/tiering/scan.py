"""A request's lookup scan: its consecutive lookups, whose promotions get their primary
rows together when the scan ends (scheduler process).

Promotion rows are reserved per scan (docs/vllm-contract.md §6.3 reserves per key): the
keys a request's consecutive lookups promote get their rows in one
``primary.reserve_rows`` call when the scan ends -- at the next call that is not a lookup
of the same request. Nothing but that request's own lookups can observe the state in
between, and for LRU the rows, victims and events are the ones the per-key reservations
would give; the room check at lookup keeps the answers (HIT_PENDING, or MISS when the
primary is full) the same. Measured on the bench's multi-turn trace, per-key reservation
was the largest cost of the slowest steps. Two deliberate differences: chunks the scan
already answered HIT are kept from eviction (per key, a later promotion of the same scan
could evict a chunk the request was just told it can load), and ARC, whose victims depend
on the inserts in between, may choose other victims.

One place ends a scan: :meth:`LookupScan.end`, which is also the only code that clears
the manager's ``_scan`` (and :meth:`LookupScan.begin` the only code that sets it). The
manager's ``lookup`` begins one (ending another request's first); every other call of the
manager ends the open scan before it does anything else (``if self._scan is not None:
self._scan.end()``, inline: a wrapper would cost every call a frame;
tests/test_tiering_manager.py traces each public method to check that it is its first
call).

Who calls: :class:`~shmtier.scheduler.tiering.manager.TieringOffloadingManager`, in the
scheduler process, under its lock. Never blocks.
"""

from __future__ import annotations

from typing import Any

from shmtier.contract import OffloadKey, ReqContext
from shmtier.scheduler.tiering.lookup_metrics import RequestLookups


class LookupScan:
    """The manager's one scan object, open (the manager's ``_scan``) from its
    :meth:`begin` to its :meth:`end`. ``promotions``: key -> tier index, in lookup order,
    awaiting rows; ``hits``: the keys the scan answered HIT (kept from eviction), of which
    ``hits_evictable`` eviction could take; ``record``: the request's lookup metrics;
    ``room``: ``primary.rows_obtainable()`` once the scan began promoting."""

    __slots__ = ("_manager", "ctx", "req_id", "record", "promotions", "hits",
                 "hits_evictable", "room")

    def __init__(self, manager: Any):
        self._manager = manager
        self.ctx: ReqContext | None = None
        self.req_id: str | None = None
        self.record: RequestLookups | None = None
        self.promotions: dict[OffloadKey, int] = {}
        self.hits: dict[OffloadKey, None] = {}  # (in lookup order)
        self.hits_evictable = 0
        self.room: int | None = None

    def begin(self, ctx: ReqContext) -> "LookupScan":
        """Open the scan of ``ctx``'s lookups (none is open)."""
        manager = self._manager
        self.ctx = ctx
        self.req_id = ctx.req_id
        self.record = manager._tracker.request(ctx.req_id)
        manager._scan = self
        return self

    def promote(self, tier_idx: int, key: OffloadKey) -> bool:
        """Promote ``key`` from tier ``tier_idx`` if a primary row can be had (the row is
        reserved when the scan ends); False: no row, a MISS."""
        room = self.room
        if room is None:  # the primary does not change during a scan until a reservation
            room = self.room = self._manager.primary.rows_obtainable()
        if room - self.hits_evictable > len(self.promotions):
            self.promotions[key] = tier_idx
            return True
        # No room: reserve what the scan holds, then try this key alone, as a per-key
        # reservation would (it fails, and records the attempt the same way).
        self.room = None
        self._reserve_held()
        return self._manager._promotions.reserve({key: tier_idx}, self.ctx, self.hits,
                                                 answered=False)

    def end(self) -> None:
        """End the open scan: reserve its promotions' rows in one call, then let the
        cascade admission see its CPU-tier hits (a re-read: a touch)."""
        manager = self._manager
        manager._scan = None  # (before the cascades below: they end no scan)
        self._reserve_held()
        ctx = self.ctx
        self.ctx = self.req_id = self.record = self.room = None
        if self.hits:
            hits = self.hits
            self.hits = {}
            self.hits_evictable = 0
            if manager.admission is not None:
                for tier_idx, admitted in manager.admission.on_hits(hits):
                    manager._cascade(admitted, ctx, (tier_idx,))

    def _reserve_held(self) -> None:
        if self.promotions:
            promotions, self.promotions = self.promotions, {}
            self._manager._promotions.reserve(promotions, self.ctx, self.hits, answered=True)
