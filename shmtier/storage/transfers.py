"""A storage tier's jobs until each of their keys has its outcome, and how queued jobs
are combined into pool jobs (scheduler process).

A tier job (one ``TransferJob`` of the tiering manager) may reach the workers in several
pool jobs: a cascade's keys as room appears under ``max_bytes`` and again after a refusal
for space, a promotion's keys split over the workers. :class:`Cascade` and
:class:`Promotion` sum their keys' figures and report the tier job once, when its last
key is final, as a ``JobResult``: vLLM's contract type, one per tier job, so not the pool's
``PoolResult`` (one per pool job) it is summed from.

Who calls: :class:`~shmtier.storage.scheduler.StorageTierManager`, under the tiering
manager's lock. Pure bookkeeping; never blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

from shmtier.contract import OffloadKey
from shmtier.scheduler.pool.row_release import RowRelease
from shmtier.scheduler.tiering.base import JobResult, TransferJob

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
