"""A worker-backed tier's jobs until each of their keys has its outcome, and how queued
jobs are combined into pool jobs (scheduler process): the storage tiers' and the node
tier's (``shmtier/tiers/node/scheduler.py``).

A tier job (one ``TransferJob`` of the tiering manager) may reach the workers in several
pool jobs: a cascade's keys as room appears under ``max_bytes`` and again after a refusal
for space, a promotion's keys split over the workers. :class:`Cascade` and
:class:`Promotion` sum their keys' figures and report the tier job once, when its last
key is final, as a ``JobResult``: vLLM's contract type, one per tier job, so not the pool's
``PoolResult`` (one per pool job) it is summed from.

:func:`load_parts` splits a step's promotions over the workers, :func:`load_outcomes`
hands each promotion its keys' part of a load result, :class:`TierJobs` settles them.

Who calls: :class:`~shmtier.storage.scheduler.StorageTierManager` and
:class:`~shmtier.tiers.node.scheduler.NodeTierManager`, under the tiering manager's lock.
Pure bookkeeping; never blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shmtier.contract import OffloadKey
from shmtier.scheduler.pool.row_release import RowRelease
from shmtier.scheduler.tiering.base import JobResult, TransferJob
from shmtier.shared.jobs import Outcome

# At most this many keys per pool job when queued jobs are combined (a job needs
# one ring slot per ~200 keys; the rings hold 128 slots per worker).
MAX_COMBINED_KEYS = 1024
# A step's loads go to every worker when each gets at least this many keys.
LOAD_SPLIT_KEYS = 8


class Cascade:
    """One tier cascade job until each of its keys has its final outcome."""

    __slots__ = ("job", "pending", "ok", "seconds", "nbytes", "tries")

    def __init__(self, job: TransferJob, pending: int):
        self.job = job
        self.pending = pending  # keys without a final outcome
        self.ok = True  # every key final so far was stored (or found there)
        self.seconds = 0.0
        self.nbytes = 0
        self.tries = 0  # times its keys were refused for space and sent again

    def settle(self, final: int, all_ok: bool) -> JobResult | None:
        """``final`` more keys have their final outcome (``all_ok``: each was stored);
        the tier job's result once every key has one, else None."""
        if not final:
            return None
        self.ok = self.ok and all_ok
        self.pending -= final
        if self.pending > 0:
            return None
        return JobResult(self.job.job_id, self.ok, transfer_time=self.seconds,
                         transfer_bytes=self.nbytes)


class Promotion:
    """One tier promotion (load) job until each of its keys has its outcome: its keys
    may be read by several workers at once (a large step's loads are split)."""

    __slots__ = ("job", "pending", "ok", "seconds", "nbytes", "release")

    def __init__(self, job: TransferJob, pending: int):
        self.job = job
        self.pending = pending
        self.ok: list[OffloadKey] = []
        self.seconds = 0.0
        self.nbytes = 0
        # the rows of its failed keys a killed worker may still write: held until the
        # pool's releases of them are set (its JobResult's deferred_release)
        self.release: RowRelease | None = None

    def hold_until(self, pool_release: RowRelease) -> None:
        if self.release is None:
            self.release = RowRelease()
        self.release.hold()
        pool_release.then(self.release.let_go)

    def settle(self, final: int) -> JobResult | None:
        """``final`` more keys have their outcome; the tier job's result once every key
        has one (success only if every key loaded), else None."""
        self.pending -= final
        if self.pending > 0:
            return None
        job = self.job
        release = self.release.seal() if self.release is not None else None
        return JobResult(job.job_id, len(self.ok) == len(job.keys), successful_keys=self.ok,
                         transfer_time=self.seconds, transfer_bytes=self.nbytes,
                         deferred_release=None if release is None else release.event)


def combined(queued: list) -> Iterator[list]:
    """``queued`` [(job, keys, rows)] in batches of at most MAX_COMBINED_KEYS keys (one
    item alone may have more)."""
    batch: list = []
    size = 0
    for item in queued:
        if batch and size + len(item[1]) > MAX_COMBINED_KEYS:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item[1])
    if batch:
        yield batch


def load_parts(batch: list, workers: int) -> list[tuple[list, list, list]]:
    """``batch`` [(promotion, keys, rows)] as the pool jobs to send: one, or with many
    keys one per worker (at least LOAD_SPLIT_KEYS keys each), so that every worker reads
    (an object store's GETs are latency-bound: one worker's io_threads do not fill it).
    Each part is ``(keys, rows, carried)``, ``carried`` [(promotion, its keys in the
    part)] in key order (what :func:`load_outcomes` takes back); [] when no promotion has
    a key."""
    flat = [(promo, key, row) for promo, keys, rows in batch
            for key, row in zip(keys, rows)]
    if not flat:
        return []
    n = max(1, min(workers, len(flat) // LOAD_SPLIT_KEYS))
    size = -(-len(flat) // n)
    parts = []
    for start in range(0, len(flat), size):
        part = flat[start:start + size]
        carried: list[tuple[Promotion, list[OffloadKey]]] = []
        for promo, key, _ in part:  # runs of one promotion's keys
            if carried and carried[-1][0] is promo:
                carried[-1][1].append(key)
            else:
                carried.append((promo, [key]))
        parts.append(([key for _, key, _ in part], [row for _, _, row in part], carried))
    return parts


def load_outcomes(res: Any, carried: list) -> Iterator[tuple]:
    """Each promotion's share of load result ``res`` (a ``PoolResult`` of a part made by
    :func:`load_parts`, ``carried`` its promotions): ``(promotion, keys, outcomes,
    seconds, logical bytes)``. A promotion with a key not loaded whose worker was killed
    (``res.release``) holds its rows until that process is gone (``hold_until``)."""
    start = 0
    for promo, keys in carried:
        end = start + len(keys)
        outcomes = res.outcomes[start:end]
        if res.release is not None and any(code != Outcome.OK for code in outcomes):
            promo.hold_until(res.release)  # a killed worker may write them
        yield (promo, keys, outcomes, sum(res.seconds[start:end]),
               sum(res.logical_bytes[start:end]))
        start = end


class TierJobs:
    """A worker-backed tier's jobs in its scheduler half: when queued work goes to the
    worker pool (loads in the step, the rest at the step-window thread's rounds while they
    come), promotions sent (split over the workers), results collected and tier jobs
    settled into ``JobResult``s. A mixin: the tier's ``__init__`` sets ``_pool`` (the
    ``WorkerPool``), ``_tier`` (its index), ``_jobs`` (pool job id -> (op, what it
    carries)) and ``_finished`` (the results ``get_finished_jobs`` hands out); the tier
    defines ``_submit_queued(loads_only)`` (its queues to the pool) and
    ``_process_results()`` (the pool's results into its bookkeeping)."""

    _pool: Any
    _tier: int
    _jobs: dict
    _finished: list[JobResult]
    # Between-steps rounds (``submit_between_steps``) since the last on_schedule_end, and
    # whether they came in the last forward pass: while they do, a step sends only its
    # loads and leaves the rest to the next round.
    _rounds_since_step = 0
    _rounds_come = False

    def submit_between_steps(self) -> None:
        """Hand all queued work to the pool. The manager's step-window thread calls it
        first in each of its rounds (``polls_between_steps``), under the lock."""
        self._rounds_since_step += 1
        self._submit_queued()

    def _submit_at_step_end(self) -> None:
        """``on_schedule_end``'s sending: a forward pass without a round (the engine's
        rhythm changed, the thread is off or behind) and this step sends everything."""
        self._rounds_come, self._rounds_since_step = self._rounds_since_step > 0, 0
        self._submit_queued(loads_only=self._rounds_come)

    def get_finished_jobs(self) -> list[JobResult]:
        # In a step, while between-steps rounds come, only loads go now: a request waits
        # for them; the rest goes at the round ~1 ms after the step, so its encoding and
        # ring writes stay out of the step (bench/README.md, "Polling the storage tiers
        # between steps").
        self._submit_queued(loads_only=self._rounds_come)
        self._process_results()
        finished, self._finished = self._finished, []
        return finished

    def _submit_loads(self, batch: list) -> None:
        """``batch`` [(promotion, keys, rows)] as ``load`` pool jobs (:func:`load_parts`:
        split over the workers when it has many keys), each recorded in ``_jobs`` as
        ``("load", carried)``; the keys of a job the rings have no room for fail now
        (``_loads_unsent`` first)."""
        parts = load_parts(batch, self._pool.n)
        if not parts:  # promotions of no keys: done
            for promo, _, _ in batch:
                self._settle_load(promo, 0)
            return
        for keys, rows, carried in parts:
            pool_id = self._pool.submit("load", self._tier, keys, rows)
            if pool_id is not None:
                self._jobs[pool_id] = ("load", carried)
                continue
            for promo, promo_keys in carried:  # the rings are full: these keys fail now
                self._loads_unsent(promo_keys)
                self._settle_load(promo, len(promo_keys))

    def _loads_unsent(self, keys: list[OffloadKey]) -> None:
        """``keys`` of a promotion were not sent (the rings are full): their bookkeeping
        (a storage tier's ledger) lets go of them. Default: nothing."""

    def _settle(self, cascade: Cascade, final: int, all_ok: bool) -> None:
        done = cascade.settle(final, all_ok)
        if done is not None:
            self._finished.append(done)

    def _settle_load(self, promo: Promotion, final: int) -> None:
        done = promo.settle(final)
        if done is not None:
            self._finished.append(done)
