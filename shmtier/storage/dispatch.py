"""How a storage tier's queued work reaches the tier workers (scheduler process): the
submission half of :class:`~shmtier.storage.scheduler.StorageTierManager`.

``submit_store``/``submit_load`` only queue; :meth:`StorageDispatch._submit_queued` hands
the queues to the shared worker pool, combined: one pool job per operation (at most
MAX_COMBINED_KEYS keys each), loads first (a step's loads of many keys as one job per
worker, LOAD_SPLIT_KEYS keys at least, so that every worker reads), then deletes and
probes, then stores as far as the ledger has room under ``max_bytes`` (evicting for the
rest, which waits). Every queued key ends one way: sent (its pool job recorded in
``_jobs`` for the results), waiting for room, or failed at once (the job rings are full:
the backpressure detector is told; or the pool is broken) with its ledger state released;
deletes and probes that find the rings full are sent again next step.

Who calls: the tier's own methods, in the scheduler process, under the tiering manager's
lock (the scheduler thread, or the step-window thread's ``submit_between_steps``). A pool
submit writes a ring slot and posts a semaphore; never blocks.

A mixin of :class:`~shmtier.storage.scheduler.StorageTierManager`: it uses the state that
class's ``__init__`` sets up (the ledger, the queues, ``_jobs``, ``_finished``, the pool).
"""

from __future__ import annotations

from shmtier.contract import Medium, OffloadingEvent, OffloadKey
from shmtier.storage.tier_metrics import PROBED_KEYS
from shmtier.storage.transfers import MAX_COMBINED_KEYS, TierJobs, combined


class StorageDispatch(TierJobs):
    """Queued work to pool jobs, and the tier jobs' results once their keys are final."""

    def _submit_queued(self, loads_only: bool = False) -> None:
        """Hand the queued work to the pool, combined: one pool job per operation (up to
        MAX_COMBINED_KEYS keys each), loads first; stores as far as ``max_bytes`` has
        room (evicting for the rest); deletes and probes that found the rings full.
        ``loads_only``: the rest waits (for a between-steps round)."""
        if self._broken:
            self._fail_queued()
            return
        if loads_only:
            if self._load_queue:
                queued, self._load_queue = self._load_queue, []
                for batch in combined(queued):
                    self._submit_loads(batch)
            return
        if self._to_delete:
            self._submit_deletes()
        if self._to_probe:
            self._submit_probes()
        if self._lookups.has_asked:
            self._submit_lookup_probes()
        if self._load_queue:
            queued, self._load_queue = self._load_queue, []
            for batch in combined(queued):
                self._submit_loads(batch)
        if self._store_queue:
            admitted = self._admit_stores()
            for batch in combined(admitted):
                self._submit_stores(batch)

    def _admit_stores(self) -> list:
        """Take queued stores, in order, for as many keys as ``max_bytes`` has room for
        (the ledger reserves each key's largest file); returns [(cascade, keys, rows)].
        With a bound, nothing goes until the listing of the root has landed (the bytes
        already on disk are unknown before), and the keys that do not fit wait for room:
        the least recently used chunks are evicted for them, and their bytes count until
        the workers confirm the files deleted."""
        if self._space_wait:  # refused for space: wait until the evicted files are gone
            if self._deleting or self._to_delete:
                return []
            self._space_wait = False
        ledger = self._ledger
        if not ledger.can_reserve:
            return []
        queue = self._store_queue
        admitted = []
        while queue:
            item = queue[0]
            cascade, keys, rows = item
            take = ledger.reserve(keys)
            if take == len(keys):
                queue.popleft()
                admitted.append(item)
                continue
            if take:
                admitted.append((cascade, keys[:take], rows[:take]))
                item[1], item[2] = keys[take:], rows[take:]
            # room for the rest of this job (its keys are all of one length) once the
            # deletes in flight and those of the chunks evicted now are confirmed
            self._evicted(ledger.make_room(len(item[1]) * ledger.reservation(item[1][0])))
            break
        return admitted

    def _submit_stores(self, batch: list) -> None:
        keys = [key for _, job_keys, _ in batch for key in job_keys]
        rows = [row for _, _, job_rows in batch for row in job_rows]
        args = None
        if self._max_bytes is not None:
            # the workers refuse what would pass max_bytes: the tier's bytes but those
            # reserved for this job (no file may be larger than its reservation)
            args = {"bytes_in_use": self._ledger.bytes_besides(keys)}
        pool_id = self._pool.submit("store", self._tier, keys, rows, args)
        if pool_id is not None:
            self._jobs[pool_id] = ("store", batch)
            return
        # the rings are full (or the pool is broken): every key of the batch fails now
        if self._bp_detector is not None and self._pool.broken is None:
            self._bp_detector.note_ring_full()
        for cascade, job_keys, _ in batch:
            self._ledger.release(job_keys)
            self._settle(cascade, len(job_keys), False)

    def _loads_unsent(self, keys: list[OffloadKey]) -> None:
        self._ledger.loads_done(keys)

    def _submit_deletes(self) -> None:
        self._to_delete = self._submit_keys("delete", self._to_delete)

    def _submit_probes(self) -> None:
        self._to_probe = self._submit_keys("probe", self._to_probe)

    def _submit_lookup_probes(self) -> None:
        """The keys lookups asked about this step, as ``probe`` jobs (answered by
        ``_finish_lookup_probes``)."""
        asked = self._lookups.take_asked()
        self._stats.increase_counter(PROBED_KEYS, len(asked), (self._label,))
        unsent = self._submit_keys("probe", asked, carried_as="lookup")
        if unsent:
            self._lookups.not_sent(unsent)

    def _submit_keys(self, op: str, keys: list[OffloadKey], *,
                     carried_as: str | None = None) -> list[OffloadKey]:
        """Send ``keys`` as ``op`` jobs of at most MAX_COMBINED_KEYS keys (recorded as
        ``carried_as``, default ``op``, for their results); returns those the rings had
        no room for (sent again next step; their bytes count until then)."""
        for start in range(0, len(keys), MAX_COMBINED_KEYS):
            part = keys[start:start + MAX_COMBINED_KEYS]
            pool_id = self._pool.submit(op, self._tier, part)
            if pool_id is None:  # (a broken pool: _submit_queued forgets them)
                return keys[start:]
            self._jobs[pool_id] = (carried_as or op, part)
        return []

    def _fail_queued(self) -> None:
        """The pool is broken: fail every job not sent; forget deletes and probes (their
        bytes no longer count)."""
        self._fail_waiting_stores()
        if self._load_queue:
            queued, self._load_queue = self._load_queue, []
            for promo, keys, _ in queued:
                self._ledger.loads_done(keys)
                self._settle_load(promo, len(keys))
        self._ledger.forget(self._to_delete, self._to_probe)
        self._to_delete, self._to_probe = [], []
        self._lookups.clear()

    def _fail_waiting_stores(self) -> None:
        while self._store_queue:
            cascade, keys, _ = self._store_queue.popleft()
            self._ledger.release(keys)
            self._settle(cascade, len(keys), False)
        self._space_wait = False

    def _evicted(self, victims: list[OffloadKey]) -> None:
        """The ledger evicted ``victims`` (out of the index, their bytes counted until
        one ``delete`` job confirms their files gone): count them, tell the engine, and
        send their deletes."""
        if not victims:
            return
        self._stats.increase_counter(self.EVICTED_METRIC, len(victims), (self._label,))
        if self._events_on:
            self._events.append(OffloadingEvent(victims, Medium.STORAGE, removed=True,
                                                locality=self.locality, ownership=self._label))
        self._to_delete.extend(victims)
        self._submit_deletes()
