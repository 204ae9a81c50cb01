"""What a storage tier does with the tier workers' answers (scheduler process): the
results half of :class:`~shmtier.storage.scheduler.StorageTierManager`.

Each pool result is matched to what its job carried (``_jobs``) and handed to the ledger
(``ledger.py``), so that every key of a tier job gets exactly one final outcome: stores
answered are indexed, refused for space are sent again after an eviction (at most
_SPACE_TRIES times) or fail, unknown (ERROR) are probed; loads that found a chunk missing
or corrupt drop it, and those that failed (ERROR) have it probed; deletes confirmed
release their bytes; probes and lookups' probes adopt what they found. A result flagged
NAMESPACE_RESET drops the index and lists the medium again; the first listing's answer
completes the index (and has what was indexed before it but not listed probed). Failures
are logged once per change of state, never once per result.

Who calls: ``get_finished_jobs`` and ``drain_jobs``, in the scheduler process, under the
tiering manager's lock (the scheduler thread, or the step-window thread between steps).
Reads the result rings and the pool's counters; never blocks.

A mixin of :class:`~shmtier.storage.scheduler.StorageTierManager`: it uses the state that
class's ``__init__`` sets up. It logs under the scheduler half's logger name
(``shmtier.storage.scheduler``), one name for the tier's log lines.
"""

from __future__ import annotations

import logging
from typing import Any

from shmtier.contract import Medium, OffloadingEvent, OffloadKey
from shmtier.scheduler.pool import PoolResult
from shmtier.shared.jobs import SUCCESS, Outcome, ResultFlag, failure_reason, free_bytes_in
from shmtier.storage.tier_metrics import CODEC_SECONDS, CORRUPT_CHUNKS, PROBE_HITS, STORED_RATIO
from shmtier.storage.transfers import Cascade, Promotion, load_outcomes

logger = logging.getLogger("shmtier.storage.scheduler")

# A cascade refused for space is sent again (after evicting) at most this many times.
_SPACE_TRIES = 3


class StorageResults:
    """Pool results into ledger transitions, tier job results, events and counters."""

    def _process_results(self) -> None:
        self._pool.poll()
        results = self._pool.take(self._tier)
        if results:  # a worker adds its tier counts before it answers a job's last piece
            self._pool_counts.note_workers(self._stats)
        for res in results:
            if res.flags & ResultFlag.NAMESPACE_RESET:  # before this result's outcomes
                # a flagged listing is not adopted either (_scan_id is None now): another
                # worker may have stored into the new namespace after this walk passed the
                # directory and been indexed before this result came; dropping the index
                # for this listing alone would lose those chunks from it (files on disk
                # nobody indexed). The next listing sees them.
                self._namespace_reset()
                # this job's own outcomes describe the namespace it found: the new one
                self._across_reset.discard(res.job_id)
            if res.job_id == self._scan_id:
                if res.error:  # the worker died or failed mid-listing: list again
                    self._scan_id = None
                    self._ledger.listing_failed()
                    logger.warning("%s tier %s: listing the medium failed (%s); listing again",
                                   self.kind, self._label, res.error)
                else:
                    self._adopt_scan(res)
                continue
            carried = self._jobs.pop(res.job_id, None)
            if carried is None:
                continue
            op, what = carried
            across = False
            if self._across_reset:
                across = res.job_id in self._across_reset
                self._across_reset.discard(res.job_id)
            if op == "store":
                # the workers' compression-by-cost choice, as of this answer
                self._compression_on = not res.flags & ResultFlag.COMPRESSION_OFF
                self._page_cache_bounded = bool(res.flags & ResultFlag.PAGE_CACHE_BOUNDED)
                self._direct_stores = bool(res.flags & ResultFlag.DIRECT_STORES)
                self._finish_stores(res, what, across_reset=across)
            elif op == "load":
                for share in load_outcomes(res, what):  # each tier job: its own keys' part
                    self._finish_load(*share)
            elif op == "delete":
                self._finish_deletes(res, what)
            elif op == "lookup":
                self._finish_lookup_probes(res, what, across_reset=across)
            else:
                self._finish_probes(res, what, across_reset=across)
        self._note_pool_health()

    def _finish_stores(self, res: PoolResult, carried: list, across_reset: bool = False) -> None:
        """Index the keys stored (written, or found there already) with their sizes;
        probe for the files of keys whose outcome is unknown (ERROR: the worker may have
        died after publishing); send again, after evicting, what was refused for space.
        ``across_reset``: the job was in flight when a namespace reset was seen (another
        worker's flag): a file it published before the old namespace was removed is gone
        with it, and indexing it would leave an indexed chunk without a file (a listing
        adds keys, never removes them); so its stored keys are probed like ERROR ones
        (a file that is there is indexed by its probe). The cascade itself was written:
        it succeeds, and its keys do not count as failures."""
        label = (self._label,)
        outcomes, sizes = res.outcomes, res.stored_bytes
        written = sum(size for code, size in zip(outcomes, sizes) if code == Outcome.OK)
        was_stored = SUCCESS["store"]
        if across_reset:
            outcomes = [Outcome.ERROR if code in was_stored else code for code in outcomes]
        self._stats.increase_counter(STORED_RATIO, written, label)
        self._stats.increase_counter(CODEC_SECONDS, res.codec_s, label)
        answered = self._ledger.stores_answered
        refused: list[tuple[Cascade, list, list]] = []
        unknown: list[OffloadKey] = []
        failed = 0
        start = 0
        for cascade, keys, rows in carried:
            end = start + len(keys)
            stored, again, unsure = answered(keys, outcomes, sizes, start)
            final = len(keys) - len(again)
            done = (sum(1 for code in res.outcomes[start:end] if code in was_stored)
                    if across_reset else len(stored))
            failed += final - done
            if unsure:
                unknown.extend(unsure)
            cascade.seconds += sum(res.seconds[start:end])
            cascade.nbytes += sum(res.logical_bytes[start:end])
            if stored and self._events_on:
                self._events.append(OffloadingEvent(stored, Medium.STORAGE, removed=False,
                                                    locality=self.locality,
                                                    ownership=self._label))
            if again:
                refused.append((cascade, [keys[i] for i in again], [rows[i] for i in again]))
            self._settle(cascade, final, final == done)
            start = end
        if failed:
            self._note_store_failure(res, failed, bool(unknown))
        elif written and not refused:
            self._note_stores_work()
        if refused:
            self._on_refused(res, refused)
        if unknown:
            self._to_probe.extend(unknown)
            self._submit_probes()

    def _note_store_failure(self, res: PoolResult, failed: int, probing: bool) -> None:
        """``failed`` keys of store result ``res`` failed: one WARNING per change of
        state (the first failure after stores worked, or another reason than the one
        logged: ``res.error`` without its key counts), not one per result."""
        reason = failure_reason(res.error)
        if reason == self._store_failure:
            return
        self._store_failure = reason
        logger.warning("%s tier %s: %d of %d chunks not stored: %s%s (logged once until stores "
                       "succeed again or the reason changes)", self.kind, self._label, failed,
                       len(res.keys), res.error,
                       "; probing for the chunks of those that failed with ERROR"
                       if probing else "")

    def _note_stores_work(self) -> None:
        """A store result wrote chunks and failed none: after failures (logged once each
        by ``_note_store_failure`` or the space warning), say so once and log the next
        failure again."""
        if self._store_failure is None and "floor" not in self._warned:
            return
        self._store_failure = None
        self._warned.discard("floor")
        logger.info("%s tier %s: stores to %s succeed again", self.kind, self._label,
                    self.medium_words())

    def _on_refused(self, res: PoolResult, refused: list) -> None:
        """Stores refused for space (the free-space floor, the disk full, or
        ``max_bytes``): evict least recently used chunks for them and send them again
        once the evicted files are gone, at most _SPACE_TRIES times per cascade; fail
        them when even freeing all the tier holds would not make room. One WARNING per
        kind, with the numbers."""
        ledger = self._ledger
        floor = getattr(self.config, "min_free_bytes", None)
        free = free_bytes_in(res.error)
        need = sum(ledger.reservation(key) for _, keys, _ in refused for key in keys)
        one = ledger.reservation(refused[0][1][0])
        holds = self.bytes_on_disk
        if free is not None and floor is not None:
            short, short_one = floor + need - free, floor + one - free
            what = (f"{self.medium_words()} has {free} bytes free, less than "
                    f"min_free_bytes ({floor}) and a chunk's file ({one})")
            hint = "; lower min_free_bytes to use it"
        else:
            short, short_one = need, one
            what, hint = f"stores were refused for space ({res.error})", ""
        if short_one > holds:  # freeing all the tier holds would not make room: fail
            self._warn_once("floor", "%s tier %s: %s, and the tier holds only %d bytes on it: "
                            "cascades to this tier fail until space frees up (logged once "
                            "until stores succeed again%s)",
                            self.kind, self._label, what, holds, hint)
            for cascade, keys, _ in refused:
                ledger.release(keys)
                self._settle(cascade, len(keys), False)
            return
        self._warn_once("evict", "%s tier %s: %s; the tier holds %d bytes on it: evicting its "
                        "least recently used chunks to make room (logged once)",
                        self.kind, self._label, what, holds)
        self._evicted(ledger.evict(short - ledger.deleting_bytes))
        self._space_wait = True
        for cascade, keys, rows in reversed(refused):
            cascade.tries += 1
            if cascade.tries > _SPACE_TRIES:
                ledger.release(keys)
                self._settle(cascade, len(keys), False)
            else:
                self._store_queue.appendleft([cascade, keys, rows])

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(msg, *args)

    def _finish_deletes(self, res: PoolResult, keys: list[OffloadKey]) -> None:
        """Evicted files gone (deleted, or not there): their bytes no longer count. A
        delete whose outcome is unknown (its worker died, the unlink failed): probe."""
        unsure = self._ledger.deletes_answered(keys, res.outcomes)
        if unsure:
            self._to_probe.extend(unsure)
        if self._to_probe:
            self._submit_probes()

    def _finish_probes(self, res: PoolResult, keys: list[OffloadKey],
                       across_reset: bool = False) -> None:
        """A file found is indexed with its size (a store's at the recent end, an evicted
        one's at the LRU end, to be evicted again); a file absent is forgotten; a probe
        that failed is sent again, up to ``ledger.PROBE_TRIES`` times. ``across_reset``:
        the probe was in flight when a namespace reset was seen, so a file it found may
        have gone with the old namespace: found counts as failed (sent again), never
        indexed."""
        outcomes = res.outcomes
        if across_reset:
            outcomes = [Outcome.ERROR if code == Outcome.OK else code for code in outcomes]
        adopted, again, unknown, evicted = self._ledger.probes_answered(
            keys, outcomes, res.stored_bytes)
        if again:
            self._to_probe.extend(again)
        if unknown:
            logger.warning("%s tier %s: could not learn whether %d chunks exist (%s); "
                           "they stay unknown until a lookup asks or the next start",
                           self.kind, self._label, unknown, res.error)
        if adopted and self._events_on:
            self._events.append(OffloadingEvent(adopted, Medium.STORAGE, removed=False,
                                                locality=self.locality, ownership=self._label))
        self._evicted(evicted)

    def _finish_lookup_probes(self, res: PoolResult, keys: list[OffloadKey],
                              across_reset: bool = False) -> None:
        """Lookups' probes answered: a chunk found joins the index at its recent end (a
        request is about to load it) unless the key has a job of this tier's meanwhile;
        absent is a MISS remembered (``LookupProbes``), not learnt (ERROR) too, for
        ``probe_timeout_s``. ``across_reset``: the probe was in flight when a namespace
        reset was seen: a chunk it found is not adopted (it may have gone with the old
        namespace); its key is neither waiting nor a remembered miss, so the next lookup
        probes it again."""
        lookups = self._lookups
        found, found_sizes = [], []
        failed = 0
        for key, code, size in zip(keys, res.outcomes, res.stored_bytes):
            there = code == Outcome.OK
            lookups.answered(key, there, failed=code == Outcome.ERROR)
            if there and not across_reset:
                found.append(key)
                found_sizes.append(size)
            else:
                failed += code == Outcome.ERROR
        adopted, evicted = self._ledger.adopt(found, found_sizes) if found else ([], [])
        if failed:
            self._warn_once("lookup-probe", "%s tier %s: could not learn whether %d chunks "
                            "are on the medium (%s); answered MISS (logged once)", self.kind,
                            self._label, failed, res.error or "probe failed")
        if adopted:
            self._stats.increase_counter(PROBE_HITS, len(adopted), (self._label,))
            if self._events_on:
                self._events.append(OffloadingEvent(adopted, Medium.STORAGE, removed=False,
                                                    locality=self.locality,
                                                    ownership=self._label))
        self._evicted(evicted)

    def _finish_load(self, promo: Promotion, keys: list[OffloadKey],
                     outcomes: list[Outcome], seconds: float, nbytes: int) -> None:
        ok = promo.ok
        promo.seconds += seconds
        promo.nbytes += nbytes
        ledger = self._ledger
        ledger.loads_done(keys)
        unsure = []
        for key, code in zip(keys, outcomes):
            if code == Outcome.OK:
                ok.append(key)
                continue
            if code == Outcome.ERROR:  # no promote-fail loop: a MISS for a while
                self._lookups.load_failed(key)
                unsure.append(key)
            if code == Outcome.MISS or code == Outcome.CORRUPT:
                # gone, or corrupt (removed by the worker): never a HIT again
                ledger.lost(key)
                self._lookups.remember_miss(key)  # unknown now: not probed again at once
                if code == Outcome.CORRUPT:
                    self._stats.increase_counter(CORRUPT_CHUNKS, 1, (self._label,))
        if unsure:
            # An ERROR (the worker died, the read failed) says nothing about the chunk,
            # but a worker that found it corrupt removed its file and may have died
            # before it answered: probed (a MISS meanwhile), indexed again if there.
            self._probe_unsure(ledger.unsure(unsure))
        self._settle_load(promo, len(keys))

    def _namespace_reset(self) -> None:
        """A worker found the tier's namespace gone or made anew: the chunks indexed are
        not on disk any more. Drop them (lookups MISS, not HIT then a failed load) and
        list the medium again (a listing in flight may predate the reset, and one that
        reports the reset itself may miss what other workers stored while it walked).
        Jobs in flight keep their bookkeeping; their results describe the namespace as
        it is now, except what a store published, or a probe found, before the removal:
        the store and probe jobs in flight now (a lookup's probes too) have what they
        report found probed again instead of indexed (``across_reset``)."""
        self.namespace_resets += 1
        self._across_reset.update(job_id for job_id, (op, _what) in self._jobs.items()
                                  if op != "load" and op != "delete")
        dropped = self._ledger.clear_index()
        if dropped and self._events_on:
            self._events.append(OffloadingEvent(dropped, Medium.STORAGE, removed=True,
                                                locality=self.locality, ownership=self._label))
        if dropped:  # the first flag of a reset (workers repeat it; a new root has none)
            logger.warning("%s tier %s: the tier's namespace on %s was removed or made "
                           "anew; %d chunks forgotten, listing it again", self.kind,
                           self._label, self.medium_words(), len(dropped))
        self._scan_id = None

    def _adopt_scan(self, res: PoolResult) -> None:
        """Index what the listing found (each chunk with its file's size), as older than
        anything stored since the tier started; the ledger leaves a key with a job in
        flight, or known gone since the listing was sent, to what it knows. With more
        than ``max_bytes`` on disk (a lower bound than last time) the least recently
        used chunks are evicted at once."""
        sizes = res.listed_bytes
        evicted, unsure = self._ledger.adopt_listing(res.listed, sizes)
        if unsure:
            logger.warning("%s tier %s: %d chunks indexed before the listing were not in it "
                           "(their files were removed meanwhile, or were foreign files the "
                           "listing removed): probing for them", self.kind, self._label,
                           len(unsure))
            self._probe_unsure(unsure)
        logger.info("%s tier %s: %d chunks found on %s (%d bytes)", self.kind, self._label,
                    len(res.listed), self.medium_words(), sum(sizes))
        self._evicted(evicted)

    def _list_medium(self) -> None:
        """Ask a worker to list the medium (None: the rings are full, or the pool is
        broken: asked again after the next results)."""
        self._scan_id = self._pool.submit("scan", self._tier, [])
        if self._scan_id is not None:
            self._ledger.listing_sent()

    def _probe_unsure(self, keys: list[OffloadKey]) -> None:
        """Probe ``keys``, which the ledger moved from the index to ``probing``
        (``unsure``): indexed again if found, forgotten if not."""
        if keys:
            self._to_probe.extend(keys)
            self._submit_probes()

    def _note_pool_health(self) -> None:
        if self._pool.broken is not None and not self._broken:
            # the pool logged why, once, and fails what it held; from now on lookups MISS
            # and new jobs fail at once
            self._broken = True
        self._pool_counts.note_totals(self._stats)
        if self._scan_id is None and not self._ledger.listed and not self._broken:
            self._list_medium()
