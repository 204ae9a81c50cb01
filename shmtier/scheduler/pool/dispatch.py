"""Pool jobs and their parts: which worker runs which keys, and merging results back.

Runs in: the scheduler process, called by :class:`~.supervisor.WorkerPool` on the
scheduler thread (``submit``, ``poll``, the health check). Bookkeeping only: no
ring, no process, nothing here blocks.

::

    WorkerPool.submit(op, tier, keys, rows)
      plan()     keys bound to a worker (a job for them is outstanding) → that worker;
                 the rest → the least-loaded running workers of the op's lane (spread
                 over all of them from 16 unbound keys on, else one);
                 each worker's part → one msgpack payload, or jobs.split_job parts
                 that each fit a ring slot
      ── the supervisor puts every payload in its worker's job ring, or none ──
      commit()   parts registered with a deadline (now + job_timeout_s); keys bound
    WorkerPool.poll: each result from a result ring → complete(): a pool job's whole
                 answer in one result → its PoolResult (the result's lists, uncopied);
                 else the part's per-key outcomes, logical and stored bytes and seconds
                 go into its pool job's merge, key by key, and its last part's result
                 → the PoolResult; → done[tier] (``take``)
    health check: overdue(now) → workers holding a part past its deadline;
                 fail_loads(w) → the load parts of worker w (just SIGKILLed, maybe still
                 writing their rows) complete as failed now, their pool jobs holding a
                 RowRelease until the supervisor sees the process gone;
                 fail_worker(w) → every other part worker w held completes as failed,
                 exactly once (only after its process is gone: a store may still read
                 its pinned rows until then)

Ordering: all jobs for one key go to one worker while any job for that key is
outstanding, so a worker sees a key's store, load and delete in submit order.

Lanes (``shared/lanes.py``): only unbound keys choose a lane, by the job's op: loads and
probes go to the promotion lane (the last ``promotion_workers`` workers, at the
engine's priority), every other op to the background lane. A lane with no running
worker lends the other lane's running workers (a job never fails for want of a lane);
with no worker running at all, a job waits in the rings of its own lane (of all
workers when that lane is empty). The supervisor refreshes the running workers with
``set_running`` at each health check, so ``plan`` only looks its op's list up.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, NewType

from shmtier.scheduler.pool.row_release import RowRelease
from shmtier.shared import jobs
from shmtier.shared.jobs import Outcome, WireJobId
from shmtier.shared.lanes import PROMOTION_OPS, first_promotion_worker

logger = logging.getLogger(__name__)

_SPREAD_MIN_KEYS = 8
_ERROR = Outcome.ERROR  # (an enum member lookup costs ~0.1 µs)
# A pool job's error text gathers its results' distinct texts up to about this length (a
# store answered slice by slice sends one per slice, often the same).
_ERROR_TEXT_MAX = 1000

#: The id of one pool job: what ``WorkerPool.submit`` returns (its parts travel as
#: ``jobs.WireJobId``; it may carry several tier jobs, ``tiering.base.JobId``).
PoolJobId = NewType("PoolJobId", int)


class PoolResult(NamedTuple):
    """One finished pool job: the ``jobs.Result`` of each of its parts merged into one, in
    submit order (the same fields, meaning and order, ``more`` aside), then what only the
    pool knows. Why not the wire record itself: a pool job goes out as several parts (one
    per worker, each split to fit ring slots) and each may be answered in pieces; this is
    their merge, per key where the key was submitted (a pool job answered by one result
    passes that result's lists on, uncopied).

    Per key, in submit order: its outcome, logical and stored bytes and seconds; a key
    whose part failed is ERROR with zeros. A ``scan`` lists the keys it found in
    ``listed``, their stored sizes after the answered keys' in ``stored_bytes`` (as on the
    wire: ``listed_bytes``). ``flags``: the ``jobs.ResultFlag`` bits of all its parts'
    results, ORed. ``keys``: the keys submitted. ``release`` (loads only): set when a
    part failed because its worker was killed, whose process may still write the rows of
    that part's keys: its ``event`` is set once every such process is gone (hold those rows
    until then); None when nothing may write them. Immutable, like the wire record."""

    job_id: PoolJobId
    outcomes: list[Outcome]
    logical_bytes: list[int]
    stored_bytes: list[int]
    seconds: list[float]
    codec_s: float
    error: str
    listed: list[bytes]
    flags: int
    op: str
    tier: int
    keys: list[bytes]
    release: RowRelease | None

    @property
    def listed_bytes(self) -> list[int]:
        """The stored size of each ``listed`` key."""
        return self.stored_bytes[len(self.outcomes):]


class _Parent:
    """A pool job in flight: what ``commit`` registered and, once a result is not its whole
    answer, its parts' results merged so far (``merge``: per-key lists, every key ERROR
    with zeros until answered, and the sums)."""

    __slots__ = ("op", "tier", "keys", "remaining", "pieces", "release", "outcomes",
                 "logical_bytes", "stored_bytes", "seconds", "codec_s", "error", "listed",
                 "listed_bytes", "flags")

    def __init__(self, op: str, tier: int, keys: list[bytes], remaining: int):
        self.op, self.tier, self.keys, self.remaining = op, tier, keys, remaining
        self.pieces = 0  # results merged so far (the merge's fields are set from the first)
        self.release: RowRelease | None = None  # held by killed workers that may write its rows

    def merge(self) -> None:
        """Start merging: every key ERROR with zeros, nothing listed, no sums yet."""
        n = len(self.keys)
        self.outcomes = [_ERROR] * n
        self.logical_bytes = [0] * n
        self.stored_bytes = [0] * n
        self.seconds = [0.0] * n
        self.codec_s = 0.0
        self.error = ""
        self.listed = []
        self.listed_bytes = []
        self.flags = 0


@dataclass(slots=True)
class Part:
    """One ring job: the keys ``positions`` of pool job ``parent``, run by ``worker``.
    ``answered``: how many of them results have answered for so far (a result split
    by ``jobs.split_result`` answers for the next run); ``first``: where the positions
    start when they are consecutive (a ``range``: merged by slices), else -1."""

    parent: PoolJobId
    worker: int
    positions: Sequence[int]
    deadline: float  # monotonic seconds; past it, ``worker`` is judged hung
    first: int = -1
    answered: int = 0


# (worker, part job id, payload, part keys, positions in the pool job: a range when
# consecutive, as they are unless some keys were bound to a worker)
Planned = tuple[int, WireJobId, bytes, list[bytes], Sequence[int]]


class Dispatch:
    """Outstanding pool jobs, their parts and the key -> worker bindings.
    ``promotion_workers``: the last that many workers form the promotion lane."""

    def __init__(self, num_workers: int, max_payload: int, job_timeout_s: float,
                 promotion_workers: int = 0):
        self.n = num_workers
        first = first_promotion_worker(num_workers, promotion_workers)
        self._lanes = (list(range(first)), list(range(first, num_workers)))  # background, promotion
        # op -> the workers that take its unbound keys (``set_running``)
        self._takers: dict[str, list[int]] = {}
        self._all = list(range(num_workers))
        self.max_payload = max_payload
        self.job_timeout_s = job_timeout_s
        self._ids = itertools.count(1)  # pool job ids and part ids: never the same number
        self.parents: dict[PoolJobId, _Parent] = {}
        # part job id -> Part, in submit order (so in deadline order: see ``overdue``)
        self.parts: dict[WireJobId, Part] = {}
        self.load = [0] * num_workers  # outstanding parts per worker
        self._bound: dict[bytes, list[int]] = {}  # key -> [worker, outstanding parts]
        self.done: dict[int, list[PoolResult]] = {}
        # parts failed while their worker's process may still run (``fail_loads``) -> that
        # worker: a result it still sends for one is dropped (until it is gone)
        self._failed_early: dict[WireJobId, int] = {}
        self.set_running(self._all)

    def set_running(self, running: list[int]) -> None:
        """The workers running now (ascending): they take unbound keys, each op's lane's
        own, else the other lane's (see the module docstring)."""
        background, promotion = ([w for w in running if w in lane] for lane in self._lanes)
        to_background = background or promotion or self._lanes[0] or self._all
        to_promotion = promotion or background or self._lanes[1] or self._all
        self._takers = {op: to_promotion if op in PROMOTION_OPS else to_background
                        for op in jobs.OPS}

    def takers(self, op: str) -> list[int]:
        """The workers that take ``op``'s unbound keys now."""
        return self._takers.get(op) or self._all

    def plan(self, op: str, tier: int, keys: list[bytes], rows: list[int] | None,
             args: dict | None) -> tuple[PoolJobId, list[Planned]]:
        """Assign ``keys`` to workers and encode the parts; returns (pool job id, parts).
        Registers nothing: :meth:`commit` does, once every part is in a ring."""
        live = self.takers(op)
        groups: dict[int, Sequence[int]] = {}
        unbound: Sequence[int] = []
        bound = self._bound
        for pos, key in enumerate(keys):
            binding = bound.get(key)
            if binding is not None:
                groups.setdefault(binding[0], []).append(pos)  # type: ignore[union-attr]
            else:
                unbound.append(pos)  # type: ignore[union-attr]
        if unbound or not keys:
            if not groups:  # no key is bound: each worker gets a range of positions
                unbound = range(len(keys))
            load = self.load
            if len(unbound) < _SPREAD_MIN_KEYS * 2:  # one worker: the least loaded (the
                # first of them in ``live`` order), without sorting or a Python key call
                w = (None if not live
                     else min(live, key=lambda w: load[w] + len(groups.get(w, ()))) if groups
                     else min(live, key=load.__getitem__))
                if w is not None:
                    if w in groups:
                        groups[w].extend(unbound)  # type: ignore[union-attr]
                    else:
                        groups[w] = unbound
            else:
                by_load = sorted(live, key=lambda w: load[w] + len(groups.get(w, ())))
                step = -(-len(unbound) // len(by_load))
                for i, w in enumerate(by_load):
                    chunk = unbound[i * step:(i + 1) * step]
                    if chunk:
                        if w in groups:
                            groups[w].extend(chunk)  # type: ignore[union-attr]
                        else:
                            groups[w] = chunk
        parent_id = PoolJobId(next(self._ids))
        planned: list[Planned] = []
        for w, positions in groups.items():
            if (type(positions) is range and len(positions) == len(keys)
                    and (not rows or len(rows) == len(keys))):  # the whole job, as given
                part_keys, part_rows = keys, rows or []
            else:
                part_keys = [keys[p] for p in positions]
                part_rows = [rows[p] for p in positions] if rows else []
            job_id = WireJobId(next(self._ids))
            payload = jobs.pack_job(job_id, op, tier, part_keys, part_rows, args)
            if len(payload) <= self.max_payload:  # the common case: encoded once
                planned.append((w, job_id, payload, part_keys, positions))
                continue
            job = jobs.Job(job_id, op, tier, part_keys, part_rows, dict(args or {}))
            offset = 0
            for part in jobs.split_job(job, self.max_payload, self._ids.__next__):
                planned.append((w, part.job_id, jobs.encode_job(part), part.keys,
                                positions[offset:offset + len(part.keys)]))
                offset += len(part.keys)
        return parent_id, planned

    def commit(self, parent_id: PoolJobId, op: str, tier: int, keys: list[bytes],
               planned: list[Planned], now: float) -> None:
        """Register pool job ``parent_id`` whose ``planned`` parts are in the rings."""
        deadline = now + self.job_timeout_s
        parts, load, bound = self.parts, self.load, self._bound
        for w, part_id, _, part_keys, positions in planned:
            parts[part_id] = Part(parent_id, w, positions, deadline,
                                  positions.start if type(positions) is range else -1)
            load[w] += 1
            for key in part_keys:
                binding = bound.get(key)
                if binding is None:
                    bound[key] = [w, 1]
                else:
                    binding[1] += 1
        self.parents[parent_id] = _Parent(op, tier, list(keys), len(planned))

    def complete(self, result: jobs.Result) -> None:
        """Merge one worker result (or a failed one made here) into its pool job."""
        part = self.parts.get(result.job_id)
        if part is None:
            if result.job_id in self._failed_early:
                logger.debug("result for job %d, failed already, ignored", result.job_id)
            else:
                logger.error("result for unknown job %d ignored", result.job_id)
            return
        parent = self.parents[part.parent]
        n = len(result.outcomes)
        if (not parent.pieces and parent.remaining == 1 and not result.more
                and part.first == 0 and n == len(parent.keys)):
            # the whole answer of a pool job sent as one part, in one result: passed on
            self._part_done(result.job_id, part, parent)
            self._done(part.parent, parent, result.outcomes, result.logical_bytes,
                       result.stored_bytes, result.seconds, result.codec_s, result.error,
                       result.listed, result.flags)
            return
        if not parent.pieces:
            parent.merge()
        parent.pieces += 1
        if result.listed:
            parent.listed.extend(result.listed)
            parent.listed_bytes.extend(result.stored_bytes[n:])
        parent.codec_s += result.codec_s
        parent.flags |= result.flags
        error = result.error
        if error and len(parent.error) < _ERROR_TEXT_MAX and error not in parent.error:
            parent.error = f"{parent.error}; {error}" if parent.error else error
        if n:
            self._merge_keys(part, parent, result, n)
        if result.more:
            return  # more results for this part follow
        if part.answered != len(part.positions):
            why = (f"tier worker {part.worker} answered {part.answered} of the "
                   f"{len(part.positions)} keys of job {result.job_id}")
            logger.error("%s; the rest fail", why)
            parent.error = f"{parent.error}; {why}" if parent.error else why
        self._part_done(result.job_id, part, parent)
        if parent.remaining == 0:
            stored = parent.stored_bytes
            self._done(part.parent, parent, parent.outcomes, parent.logical_bytes,
                       stored + parent.listed_bytes if parent.listed_bytes else stored,
                       parent.seconds, parent.codec_s, parent.error, parent.listed,
                       parent.flags)

    def _part_done(self, part_id: WireJobId, part: Part, parent: _Parent) -> None:
        """``part`` has its last result: its keys are no longer bound to its worker."""
        del self.parts[part_id]
        self.load[part.worker] -= 1
        keys, bound = parent.keys, self._bound
        for pos in part.positions:
            key = keys[pos]
            binding = bound.get(key)
            if binding is not None:
                binding[1] -= 1
                if binding[1] <= 0:
                    del bound[key]
        parent.remaining -= 1

    def _done(self, job_id: PoolJobId, parent: _Parent, *merged) -> None:
        """Pool job ``job_id``'s last part is answered: its result (``merged``: the wire
        record's fields, from ``job_id`` to ``flags``) goes to ``done``."""
        del self.parents[job_id]
        release = parent.release.seal() if parent.release is not None else None
        self.done.setdefault(parent.tier, []).append(tuple.__new__(
            PoolResult, (job_id, *merged, parent.op, parent.tier, parent.keys, release)))

    @staticmethod
    def _merge_keys(part: Part, parent: _Parent, result: jobs.Result, n: int) -> None:
        """Put the per-key figures of the ``n`` keys ``result`` answers for (the part's
        next ones) at their positions in ``parent``'s merge."""
        start = part.answered
        if start + n > len(part.positions):
            logger.error("tier worker %d answered %d keys of job %d, which has %d; the "
                         "surplus is ignored", part.worker, start + n, result.job_id,
                         len(part.positions))
            n = len(part.positions) - start
        part.answered = start + n
        stored = result.stored_bytes
        if part.first >= 0:  # consecutive positions: slices
            lo = part.first + start
            hi = lo + n
            parent.outcomes[lo:hi] = result.outcomes[:n]
            parent.logical_bytes[lo:hi] = result.logical_bytes[:n]
            parent.stored_bytes[lo:hi] = stored[:n]
            parent.seconds[lo:hi] = result.seconds[:n]
            return
        outcomes, logical, seconds = result.outcomes, result.logical_bytes, result.seconds
        out_o, out_l, out_st, out_s = (parent.outcomes, parent.logical_bytes,
                                       parent.stored_bytes, parent.seconds)
        for i, pos in enumerate(part.positions[start:start + n]):
            out_o[pos] = outcomes[i]
            out_l[pos] = logical[i]
            out_st[pos] = stored[i]
            out_s[pos] = seconds[i]

    def fail_worker(self, w: int, why: str) -> int:
        """Complete every part worker ``w`` holds as failed (``why``); returns how many.
        Only once its process is gone."""
        mine = [(part_id, part) for part_id, part in self.parts.items() if part.worker == w]
        for part_id, part in mine:
            self.complete(jobs.Result.failed(part_id, why, len(part.positions) - part.answered))
        return len(mine)

    def fail_loads(self, w: int, why: str) -> list[RowRelease]:
        """Complete now, as failed (``why``), the load parts worker ``w`` holds: its
        process was just SIGKILLed and may still write their rows. Each one's pool job
        gets a release held once per part; returns those releases, for the caller to let
        go when the process is gone. A result the process still sends for one is dropped."""
        parents, released = self.parents, []
        mine = [(part_id, part) for part_id, part in self.parts.items()
                if part.worker == w and parents[part.parent].op == "load"]
        for part_id, part in mine:
            parent = parents[part.parent]
            if parent.release is None:
                parent.release = RowRelease()
            parent.release.hold()
            released.append(parent.release)
            self._failed_early[part_id] = w
            self.complete(jobs.Result.failed(part_id, why, len(part.positions) - part.answered))
        return released

    def forget_failed_early(self, w: int) -> None:
        """Worker ``w``'s process is gone: no result of it can come any more."""
        if self._failed_early:
            self._failed_early = {p: x for p, x in self._failed_early.items() if x != w}

    def fail_all(self, why: str) -> int:
        """Complete every outstanding part as failed (shutdown, after the workers stopped)."""
        n = len(self.parts)
        for part_id, part in list(self.parts.items()):
            self.complete(jobs.Result.failed(part_id, why, len(part.positions) - part.answered))
        return n

    def overdue(self, now: float) -> dict[int, float]:
        """Workers holding a part past its deadline -> how long the oldest is outstanding.

        Parts are registered in submit order with one timeout, so the overdue ones are
        a prefix of ``parts``: the scan stops at the first part still in time."""
        late: dict[int, float] = {}
        for part in self.parts.values():
            if part.deadline > now:
                break
            late.setdefault(part.worker, now - part.deadline + self.job_timeout_s)
        return late

    def take(self, tier: int) -> list[PoolResult]:
        return self.done.pop(tier, [])
