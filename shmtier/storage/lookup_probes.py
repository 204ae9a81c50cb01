"""Presence checks for keys a storage tier's index does not know (scheduler process).

A storage medium may be shared by many engines (one fs root, one bucket): a chunk
another engine stored is on the medium but not in this engine's index. So a key the
index does not know is not a final MISS: the tier asks its workers whether the
medium has it (one ``probe`` op per step for all keys asked during the step), and
answers RETRY until the answer lands, then HIT (the tier indexes the chunk) or MISS.
The vLLM tiers' async lookup front end behaves the same way (docs/vllm-contract.md,
"Async lookup")::

    lookup(k) ──► answer(k): unknown ──► asked (RETRY) ──on_schedule_end──► probe job
                                                                             │ worker:
    lookup(k) ──► answer(k): RETRY until the deadline, then MISS             │ stat / HEAD
                                                                             ▼
    tier: answered(k, found) ──► found: indexed (HIT) │ absent: MISS remembered ttl_s

A MISS is remembered until nobody has asked for the key for ``ttl_s`` (the tier's
``probe_ttl_s``; each lookup that gets it keeps it that long), so a request that waits
(on other keys' promotions, say) does not make the tier probe the key again and again;
vLLM keeps a verdict while any request references the key, which this approximates
without per-request state. A HIT is the index's from then on. A probe unanswered ``timeout_s`` after it was asked (``probe_timeout_s``: a hung
medium) answers MISS from then on (counted once per key in ``expired``) until its
answer lands, so no request waits on the medium for longer.

Who calls: the tier's scheduler half, under the tiering manager's lock. No I/O, never
blocks; per lookup a few dict operations and one clock read.
"""

from __future__ import annotations

import time

from shmtier.contract import LookupResult, OffloadKey

_EXPIRED = -1.0  # an asked key's deadline once it has passed (counted)


class LookupProbes:
    """The keys asked, in flight and recently missed, for one tier."""

    __slots__ = ("ttl_s", "timeout_s", "expired", "_asked", "_waiting", "_missed", "_failed")

    def __init__(self, ttl_s: float, timeout_s: float):
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.expired = 0  # keys whose probe passed its deadline (answered MISS since)
        self._asked: list[OffloadKey] = []  # asked, no probe job accepted yet
        self._waiting: dict[OffloadKey, float] = {}  # asked or in flight -> deadline
        self._missed: dict[OffloadKey, float] = {}  # answered absent -> until (in order)
        self._failed: dict[OffloadKey, float] = {}  # indexed, its load failed -> until

    def answer(self, key: OffloadKey) -> LookupResult:
        """The lookup answer for ``key``, which the tier's index does not know: MISS while
        a miss is remembered or past the probe's deadline, else RETRY (asking the medium
        if nobody has yet)."""
        now = time.monotonic()
        missed = self._missed
        until = missed.get(key)
        if until is not None:
            del missed[key]
            if now < until:  # asked again: kept ttl_s from now (at the end: time order)
                missed[key] = max(until, now + self.ttl_s)
                return LookupResult.MISS
        deadline = self._waiting.get(key)
        if deadline is None:
            self._waiting[key] = now + self.timeout_s
            self._asked.append(key)
            return LookupResult.RETRY
        if deadline == _EXPIRED:
            return LookupResult.MISS
        if now < deadline:
            return LookupResult.RETRY
        self._waiting[key] = _EXPIRED
        self.expired += 1
        return LookupResult.MISS

    @property
    def has_asked(self) -> bool:
        """Whether keys wait for a probe job to be sent."""
        return bool(self._asked)

    def take_asked(self) -> list[OffloadKey]:
        """The keys to send in probe jobs now (they stay in flight until ``answered``)."""
        asked, self._asked = self._asked, []
        return asked

    def not_sent(self, keys: list[OffloadKey]) -> None:
        """``keys`` of ``take_asked`` found no room in the job rings: sent next time."""
        self._asked[:0] = keys

    def answered(self, key: OffloadKey, found: bool, *, failed: bool = False) -> None:
        """The medium's answer for ``key``; ``failed``: the probe itself failed (the tier
        cannot load what it cannot see: a MISS, for ``timeout_s``)."""
        self._waiting.pop(key, None)
        if not found:
            self.remember_miss(key, failed=failed)

    def remember_miss(self, key: OffloadKey, *, failed: bool = False) -> None:
        """Answer MISS for ``key`` (not in the index) for ``ttl_s`` from now, or for
        ``timeout_s`` when the medium ``failed`` to answer (a probe that ended in ERROR: a
        store that is down is not asked again every step)."""
        self._missed.pop(key, None)  # re-inserted at the end: the dict stays in time order
        self._missed[key] = time.monotonic() + (self.timeout_s if failed else self.ttl_s)

    def load_failed(self, key: OffloadKey) -> None:
        """The load of ``key``, which stays indexed, failed (ERROR: says nothing about the
        chunk): ``failed_now`` is true for ``timeout_s``, so the tier answers MISS instead
        of promoting it again at once (no promote-fail loop against a medium that is
        down)."""
        self._failed.pop(key, None)
        self._failed[key] = time.monotonic() + self.timeout_s

    def failed_now(self, key: OffloadKey) -> bool:
        """Whether ``key``'s load failed less than ``timeout_s`` ago (``load_failed``)."""
        until = self._failed.get(key)
        return until is not None and time.monotonic() < until

    @property
    def has_failed(self) -> bool:
        """Whether any failed load is remembered (the index's HIT path checks only then)."""
        return bool(self._failed)

    def purge(self) -> None:
        """Forget the misses remembered past their time (at each between-steps round, or
        at a step's end when no round came): oldest first, up to the first not yet due (a
        failure's longer miss may keep a few shorter ones after it a little longer)."""
        if not (self._missed or self._failed):
            return
        now = time.monotonic()
        for remembered in (self._missed, self._failed):
            while remembered:
                key = next(iter(remembered))
                if remembered[key] > now:
                    break
                del remembered[key]

    def clear(self) -> None:
        """Forget every probe (the worker pool is broken: nothing will answer)."""
        self._asked, self._waiting, self._missed, self._failed = [], {}, {}, {}

    def __repr__(self) -> str:
        return (f"LookupProbes(asked={len(self._asked)}, waiting={len(self._waiting)}, "
                f"missed={len(self._missed)}, failed={len(self._failed)}, "
                f"expired={self.expired})")
