"""Lookup metrics: per (request, tier, key), queries and hits counted once, and the
synchronous and asynchronous lookup delays (docs/vllm-contract.md §11).

Who calls: the tiering manager, in the scheduler process, under its lock; every
lookup records into a request's record, and ``get_stats`` takes the series once per
step. Never blocks; nothing grows with the requests served once they finish.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shmtier import metrics
from shmtier.contract import LookupResult, OffloadKey

HIT, RETRY, HIT_PENDING = LookupResult.HIT, LookupResult.RETRY, LookupResult.HIT_PENDING


class RequestLookups:
    """One request's lookup record: the keys resolved (HIT or MISS) per tier, and
    when each key's first RETRY came. Held by the scan while it runs. ``record`` ignores
    a key already in ``resolved[tier]`` (the manager skips timing the primary's answer
    for those: a waiting request rescans its prefix every step)."""

    __slots__ = ("tracker", "resolved", "retry_since")

    def __init__(self, tracker: "LookupTracker"):
        self.tracker = tracker
        self.resolved: list[set[OffloadKey]] = [set() for _ in tracker.labels]
        self.retry_since: dict[tuple[int, OffloadKey], float] = {}

    def record(self, tier: int, key: OffloadKey, result: LookupResult, sync_s: float,
               now: float) -> None:
        if result is HIT_PENDING:
            return
        if result is RETRY:
            self.retry_since.setdefault((tier, key), now)
            return
        resolved = self.resolved[tier]
        if key in resolved:
            return
        resolved.add(key)
        tracker = self.tracker
        tracker.queries[tier] += 1
        if result is HIT:
            tracker.hits[tier] += 1
        tracker.sync_s[tier].append(sync_s)
        if self.retry_since:
            started = self.retry_since.pop((tier, key), None)
            if started is not None:
                tracker.async_s[tier].append(now - started)


class LookupTracker:
    """Per (request, tier, key): queries/hits counted once, sync and async delays.

    A request stops contributing once it is scheduled (``new_req_ids``) and is
    forgotten when it finishes, so nothing grows with requests served."""

    def __init__(self, labels: Sequence[str]):
        self.labels = labels
        self._requests: dict[str, RequestLookups] = {}
        self._stopped: set[str] = set()
        # per tier index, since the last take_into(): plain counters and samples (a lookup
        # records into these; take_into() adds them to the step's stats payload)
        self.queries = [0] * len(labels)
        self.hits = [0] * len(labels)
        self.sync_s: list[list[float]] = [[] for _ in labels]
        self.async_s: list[list[float]] = [[] for _ in labels]

    def request(self, req_id: str) -> RequestLookups | None:
        """The record a lookup of ``req_id`` goes into; None once the request stopped
        contributing."""
        if req_id in self._stopped:
            return None
        record = self._requests.get(req_id)
        if record is None:
            record = self._requests[req_id] = RequestLookups(self)
        return record

    def stop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._stopped.add(req_id)
            self._requests.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self._stopped.discard(req_id)
        self._requests.pop(req_id, None)

    def take_into(self, stats: metrics.OffloadingStats) -> None:
        """Add the series since the last call to ``stats`` and start afresh."""
        for tier, label in enumerate(self.labels):
            if not self.queries[tier]:
                continue
            labels = (label,)
            stats.increase_counter(metrics.CHUNK_QUERIES, self.queries[tier], labels)
            if self.hits[tier]:
                stats.increase_counter(metrics.CHUNK_HITS, self.hits[tier], labels)
            stats.observe_many(metrics.LOOKUP_SYNC_DELAY, self.sync_s[tier], labels)
            if self.async_s[tier]:
                stats.observe_many(metrics.LOOKUP_ASYNC_DELAY, self.async_s[tier], labels)
            self.queries[tier] = self.hits[tier] = 0
            self.sync_s[tier], self.async_s[tier] = [], []
