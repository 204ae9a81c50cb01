"""The stress run's continuous invariants, checked while the load runs.

Who calls: the stress run's scheduler thread (``shmtier/stress/run.py``), between manager
calls; the rows check takes the manager lock (the manager's step-window thread collects
finished jobs between steps, so without it the check could see a job reported and its
rows not yet released). Nothing here blocks but on that lock (a snapshot of the segment is
a read-only mapping, ``shmtier/shared/snapshot.py``).

* **jobs** (``JobLedger``): every job the manager gives the fs tier (``submit_store``,
  ``submit_load``) is reported by ``get_finished_jobs`` exactly once, and every job the
  tier gives the worker pool (``submit``) comes out of ``take`` exactly once. The ledger
  wraps those methods on the live objects (the calls go through unchanged) and records a
  violation at once for a job reported twice or never submitted; jobs still in flight
  once the tiers settle are lost.
* **rows**: the segment's rows by state (read from the chunk table, as ``shmtier top``
  does) against what is in flight: rows pinned == keys of cascades in flight, rows pending
  == keys of promotions in flight (a step's GPU stores and loads are complete when it is
  checked). More is a leaked pin or row; fewer, a row freed under a job.
* **latency** (``CallTimer``, the connector driver's meter): every manager call on the
  scheduler thread (a lookup scan counts as one) takes less than ``bound_s``; its p99 and
  max are reported.
* **bytes**: every loaded chunk is compared byte for byte where the run loads it.
"""

from __future__ import annotations

import time

import numpy as np

from shmtier.connector_driver import LOCK_WAIT, Meter
from shmtier.shared.snapshot import snapshot
from shmtier.stress.verdict import StressResult


class Clock:
    """Where the run is: its engine step and request index (for violations)."""

    def __init__(self) -> None:
        self.step = 0
        self.request = 0


class CallTimer(Meter):
    """Times each manager call (a region of shmtier/connector_driver.py; the waits for the
    lock are not calls); sums a step's calls (``step_us``); a call over ``bound_s`` is a
    violation named after the call."""

    def __init__(self, result: StressResult, clock: Clock, bound_s: float):
        self.result, self.clock, self.bound_s = result, clock, bound_s
        self.call_s: list[float] = []
        self.step_us: list[float] = []
        self.spent = 0.0
        self.windows: list[list[float]] = []  # open fault windows collect their calls' times

    def end(self, token, kind, calls, keys, wall_ns, cpu_ns) -> None:
        if kind == LOCK_WAIT:
            return
        took = wall_ns / 1e9
        self.spent += took
        self.call_s.append(took)
        for window in self.windows:
            window.append(took)
        if took > self.bound_s:
            self.result.violate(self.clock.step, self.clock.request, "call latency",
                                f"{kind} took {took * 1e3:.0f} ms "
                                f"(bound {self.bound_s * 1e3:.0f} ms)")

    def close_step(self) -> None:
        self.clock.step += 1
        self.step_us.append(self.spent * 1e6)
        self.spent = 0.0

    def figures(self) -> dict:
        calls = np.array(self.call_s) if self.call_s else np.zeros(1)
        return {"calls": len(self.call_s), "bound_ms": self.bound_s * 1e3,
                "p50_us": float(np.percentile(calls, 50) * 1e6),
                "p99_us": float(np.percentile(calls, 99) * 1e6),
                "max_us": float(calls.max() * 1e6)}


class JobLedger:
    """Counts the fs tier's jobs and the worker pool's jobs in and out (module docstring)."""

    def __init__(self, tier, pool, result: StressResult, clock: Clock):
        self.result, self.clock = result, clock
        self.tier_flight: dict = {}  # job id -> (is_promotion, keys)
        self.tier_done: set = set()
        self.tier_submitted = 0
        self.pool_flight: set = set()
        self.pool_done: set = set()
        self.pool_submitted = 0
        # jobs the pool held before the ledger was attached (the tier's start-up listing)
        self.pool_before = pool.outstanding() if pool is not None else 0
        self.pool_before_seen = 0
        self._wrap_tier(tier)
        if pool is not None:
            self._wrap_pool(pool)

    def _wrap_tier(self, tier) -> None:
        submit_store, submit_load, finished = (tier.submit_store, tier.submit_load,
                                               tier.get_finished_jobs)

        def store(job):
            self._submitted(job)
            return submit_store(job)

        def load(job):
            self._submitted(job)
            return submit_load(job)

        def get_finished_jobs():
            out = list(finished())
            for res in out:
                if self.tier_flight.pop(res.job_id, None) is not None:
                    self.tier_done.add(res.job_id)
                else:
                    self._bad("tier jobs", res.job_id, self.tier_done)
            return out

        tier.submit_store, tier.submit_load, tier.get_finished_jobs = store, load, get_finished_jobs

    def _submitted(self, job) -> None:
        self.tier_submitted += 1
        self.tier_flight[job.job_id] = (job.is_promotion, len(job.keys))

    def _wrap_pool(self, pool) -> None:
        submit, take = pool.submit, pool.take

        def pool_submit(*args, **kwargs):
            job_id = submit(*args, **kwargs)
            if job_id is not None:
                self.pool_submitted += 1
                self.pool_flight.add(job_id)
            return job_id

        def pool_take(tier):
            out = take(tier)
            for res in out:
                if res.job_id in self.pool_flight:
                    self.pool_flight.discard(res.job_id)
                    self.pool_done.add(res.job_id)
                elif (res.job_id not in self.pool_done
                      and self.pool_before_seen < self.pool_before):
                    self.pool_before_seen += 1
                    self.pool_done.add(res.job_id)
                else:
                    self._bad("pool jobs", res.job_id, self.pool_done)
            return out

        pool.submit, pool.take = pool_submit, pool_take

    def _bad(self, what: str, job_id, done: set) -> None:
        how = "reported a second time" if job_id in done else "reported, never submitted"
        self.result.violate(self.clock.step, self.clock.request, "jobs exactly once",
                            f"{what}: job {job_id} {how}")

    def in_flight_keys(self) -> tuple[int, int]:
        """Keys of (cascades, promotions) the fs tier holds."""
        cascades = promotions = 0
        for is_promotion, n in self.tier_flight.values():
            if is_promotion:
                promotions += n
            else:
                cascades += n
        return cascades, promotions

    def counts(self) -> dict:
        return {"tier_submitted": self.tier_submitted, "tier_completed": len(self.tier_done),
                "tier_in_flight": len(self.tier_flight), "pool_submitted": self.pool_submitted,
                "pool_completed": len(self.pool_done) - self.pool_before_seen,
                "pool_in_flight": len(self.pool_flight)}


def check_rows(engine_id: str, ledger: JobLedger, result: StressResult, clock: Clock,
               lock) -> tuple:
    """One rows check (module docstring) holding ``lock`` (the manager's); returns
    (pinned, pending) as the segment says."""
    with lock:
        rows = snapshot(engine_id).rows
        cascades, promotions = ledger.in_flight_keys()
    if rows.pinned != cascades:
        result.violate(clock.step, clock.request, "rows and pins",
                       f"{rows.pinned} rows pinned, {cascades} keys of cascades in flight")
    if rows.pending != promotions:
        result.violate(clock.step, clock.request, "rows and pins",
                       f"{rows.pending} rows pending, {promotions} keys of promotions in flight")
    return rows.pinned, rows.pending
