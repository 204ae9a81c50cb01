"""The tier worker pool, as the scheduler process drives it.

Who calls: the scheduler halves of worker-backed tiers (e.g. ``fs``), in the
scheduler process, under the tiering manager's lock. ``submit``/``poll`` never
block; ``drain`` and ``shutdown`` do (bounded).

::

    submit(op, tier, keys, rows) ── pool job id ──────────────────────────────┐
      keys bound to a worker (a job for them is outstanding) go to that worker │
      the rest are spread over the least-loaded live workers                   │
      each worker's part → jobs.split_job (fits a slot) → job ring of worker   │
    poll(): result rings → merge parts into their pool job → done[tier] ◀──────┘
            health: worker process gone, or heartbeat older than the timeout
                    (then SIGKILLed) → its rings are resynced, every part it
                    still held is failed exactly once, a replacement starts
                    after a backoff (0.1 s doubling to 5 s)

Ordering: all jobs for one key go to one worker while any job for that key is
outstanding, so a worker sees a key's store, load and delete in submit order.
A full job ring makes ``submit`` return None without side effects: that is the
backpressure signal.

Modes: ``spawn`` starts the workers as fresh interpreters (``python -m
shmtier.workers.job_loop``: never a fork of the scheduler, which may hold CUDA
state, and no re-import of the caller's main module); ``external`` expects ``shmtier
workers --engine-id ID`` to run them and only watches their heartbeats.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from shmtier.shared import jobs
from shmtier.shared.pool_config import PoolConfig
from shmtier.shared.ring import RingSet

logger = logging.getLogger(__name__)

_HEALTH_EVERY_S = 0.05
_HEALTHY_RESET_S = 10.0
_SPREAD_MIN_KEYS = 8
_DRAIN_BATCH = 256  # results taken per ring call


@dataclass(slots=True)
class PoolResult:
    """One finished pool job: per-key outcome codes (``jobs.OK`` ...) in submit order."""

    job_id: int
    op: str
    tier: int
    keys: list[bytes]
    outcomes: list[int]
    logical_bytes: int = 0
    stored_bytes: int = 0
    io_s: float = 0.0
    codec_s: float = 0.0
    error: str = ""
    scan_keys: list[bytes] = field(default_factory=list)
    submit_time: float = 0.0


@dataclass(slots=True)
class _Parent:
    result: PoolResult
    remaining: int


@dataclass(slots=True)
class _Part:
    parent: int
    worker: int
    positions: list[int]


class WorkerPool:
    def __init__(self, engine_id: str, segment: Any, config: PoolConfig, *, mode: str = "spawn",
                 heartbeat_timeout_s: float = 2.0):
        self.engine_id = engine_id
        self.config = config
        self.mode = mode
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.n = config.num_workers
        config.write(segment.rings)
        self.rings = RingSet.create(segment.name, segment.rings, config.num_workers,
                                    config.slots, config.slot_size)
        self._max_payload = config.slot_size - 8
        self._job_rings = [self.rings.worker(w).jobs for w in range(self.n)]
        self._result_rings = [self.rings.worker(w).results for w in range(self.n)]
        self._ids = itertools.count(1)
        self._parents: dict[int, _Parent] = {}
        self._parts: dict[int, _Part] = {}
        self._load = [0] * self.n  # outstanding parts per worker
        self._bound: dict[bytes, list[int]] = {}  # key -> [worker, outstanding parts]
        self._done: dict[int, list[PoolResult]] = {}
        self._procs: list[Any] = [None] * self.n
        self._restart_at: list[float | None] = [None] * self.n
        self._restarts = [0] * self.n
        self._started_ns = [0] * self.n
        self._live: list[int] = []  # refreshed by the health check (submit must not poll pids)
        self._next_health = 0.0
        self.restarts_total = 0
        self.failed_parts_total = 0
        if mode == "spawn":
            try:
                for w in range(self.n):
                    self._start(w)
                self._live = list(range(self.n))
            except BaseException:
                self.shutdown()
                raise

    # --- processes ---

    def _start(self, w: int) -> None:
        self._procs[w] = subprocess.Popen(
            [sys.executable, "-m", "shmtier.workers.job_loop", self.engine_id, str(w)],
            stdin=subprocess.DEVNULL)
        self._started_ns[w] = time.monotonic_ns()
        self._restart_at[w] = None

    def _alive(self, w: int) -> bool:
        if self.mode == "spawn":
            proc = self._procs[w]
            return proc is not None and proc.poll() is None
        return self.rings.worker(w).holder_alive() or not self.rings.worker(w).last_beat().pid

    # --- submit ---

    def submit(self, op: str, tier: int, keys: list[bytes], rows: list[int] | None = None,
               args: dict | None = None) -> int | None:
        """Queue one job; returns its pool job id, or None if the rings are full."""
        live = self._live or list(range(self.n))
        groups: dict[int, list[int]] = {}
        unbound: list[int] = []
        for pos, key in enumerate(keys):
            binding = self._bound.get(key)
            if binding is not None:
                groups.setdefault(binding[0], []).append(pos)
            else:
                unbound.append(pos)
        if unbound or not keys:
            by_load = sorted(live, key=lambda w: self._load[w] + len(groups.get(w, ())))
            share = len(by_load) if len(unbound) >= _SPREAD_MIN_KEYS * 2 else 1
            step = -(-len(unbound) // share) if unbound else 0
            for i, w in enumerate(by_load[:share]):
                chunk = unbound[i * step:(i + 1) * step]
                if chunk or not keys:
                    groups.setdefault(w, []).extend(chunk)
        parent_id = next(self._ids)
        planned: list[tuple[int, int, bytes, list[bytes], list[int]]] = []
        for w, positions in groups.items():
            part_keys = [keys[p] for p in positions]
            part_rows = [rows[p] for p in positions] if rows else []
            job_id = next(self._ids)
            payload = jobs.pack_job(job_id, op, tier, part_keys, part_rows, args)
            if len(payload) <= self._max_payload:  # the common case: encoded once
                planned.append((w, job_id, payload, part_keys, positions))
                continue
            job = jobs.Job(job_id, op, tier, part_keys, part_rows, dict(args or {}))
            offset = 0
            for part in jobs.split_job(job, self._max_payload, self._ids.__next__):
                planned.append((w, part.job_id, jobs.encode_job(part), part.keys,
                                positions[offset:offset + len(part.keys)]))
                offset += len(part.keys)
        if len(planned) == 1:  # the common case: one slot, so try_put alone decides
            w, _, payload, _, _ = planned[0]
            if not self._job_rings[w].try_put(payload):
                return None
        else:  # every part fits, or none is put
            need = [0] * self.n
            for w, *_ in planned:
                need[w] += 1
            for w in range(self.n):
                ring = self._job_rings[w]
                if need[w] > ring.slots:
                    raise ValueError(
                        f"{op} job of {len(keys)} keys needs {need[w]} ring slots on worker {w}, "
                        f"more than its ring holds ({ring.slots}): submit fewer keys per job"
                    )
                if need[w] and ring.free_slots() < need[w]:
                    return None
            for w, _, payload, _, _ in planned:
                if not self._job_rings[w].try_put(payload):
                    raise RuntimeError(f"job ring of worker {w} refused a job after a capacity check")
        for w, part_id, _, part_keys, positions in planned:
            self._parts[part_id] = _Part(parent_id, w, positions)
            self._load[w] += 1
            for key in part_keys:
                binding = self._bound.get(key)
                if binding is None:
                    self._bound[key] = [w, 1]
                else:
                    binding[1] += 1
        self._parents[parent_id] = _Parent(
            PoolResult(parent_id, op, tier, list(keys), [jobs.ERROR] * len(keys),
                       submit_time=time.monotonic()),
            len(planned))
        return parent_id

    # --- results ---

    def poll(self) -> None:
        """Collect results and check worker health (non-blocking)."""
        for w, ring in enumerate(self._result_rings):
            if ring.depth():  # two loads from the segment; no semaphore syscall on an empty ring
                self._drain_results(w, ring)
        now = time.monotonic()
        if now >= self._next_health:
            self._next_health = now + _HEALTH_EVERY_S
            self._check_health(now)

    def take(self, tier: int) -> list[PoolResult]:
        """Finished jobs of ``tier`` since the last call (call ``poll`` first)."""
        return self._done.pop(tier, [])

    def outstanding(self) -> int:
        return len(self._parents)

    def queued_jobs(self) -> int:
        """Jobs put in the job rings and not yet taken by a worker."""
        return sum([ring.depth() for ring in self._job_rings])

    def _drain_results(self, w: int, ring: Any) -> None:
        while True:
            batch = ring.get_many(_DRAIN_BATCH, timeout_s=0)
            for raw in batch:
                try:
                    result = jobs.decode_result(raw)
                except jobs.MalformedResult as e:
                    logger.error("tier worker %d sent a malformed result: %s", w, e)
                    continue
                self._complete_part(result)
            if len(batch) < _DRAIN_BATCH:
                return  # the ring is empty (a full batch may have left more)

    def _complete_part(self, result: jobs.Result) -> None:
        part = self._parts.get(result.job_id)
        if part is None:
            logger.error("result for unknown job %d ignored", result.job_id)
            return
        parent = self._parents[part.parent]
        out = parent.result
        out.scan_keys.extend(result.keys)
        out.logical_bytes += result.logical_bytes
        out.stored_bytes += result.stored_bytes
        out.io_s += result.io_s
        out.codec_s += result.codec_s
        if result.error:
            out.error = f"{out.error}; {result.error}" if out.error else result.error
        if result.more:
            return  # a scan listing continues in later results
        for pos, code in zip(part.positions, result.outcomes):
            out.outcomes[pos] = code
        del self._parts[result.job_id]
        self._load[part.worker] -= 1
        for pos in part.positions:
            key = out.keys[pos]
            binding = self._bound.get(key)
            if binding is not None:
                binding[1] -= 1
                if binding[1] <= 0:
                    del self._bound[key]
        parent.remaining -= 1
        if parent.remaining == 0:
            del self._parents[out.job_id]
            self._done.setdefault(out.tier, []).append(out)

    # --- failure handling ---

    def _check_health(self, now: float) -> None:
        alive = [self._alive(w) for w in range(self.n)]
        self._live = [w for w in range(self.n) if alive[w]]
        for w in range(self.n):
            if self._restart_at[w] is not None:
                if now >= self._restart_at[w]:
                    self._start(w)
                continue
            if self.mode == "spawn" and self._procs[w] is None:
                continue
            dead = not alive[w]
            beat = self.rings.worker(w).last_beat()
            # Judge a worker by its own beats only: a replacement that has not beaten yet
            # (still starting) is not hung, whatever its predecessor last wrote.
            own_beat = beat.beat_ns and beat.beat_ns >= self._started_ns[w]
            hung = (not dead and self._load[w] > 0 and own_beat
                    and beat.age_s() > self.heartbeat_timeout_s)
            if (not dead and not hung and self._restarts[w] and own_beat
                    and now - self._started_ns[w] / 1e9 > _HEALTHY_RESET_S):
                self._restarts[w] = 0  # healthy for a while: the next failure backs off anew
            if dead or hung:
                self._bury(w, "hung (no heartbeat for %.1f s)" % beat.age_s() if hung else "died",
                           kill=bool(hung))

    def _bury(self, w: int, why: str, kill: bool = False) -> None:
        """Fail worker ``w``'s jobs and schedule its replacement; ``kill`` a hung one first
        (an external worker is killed only when hung: a dead one's pid may be reused)."""
        proc = self._procs[w]
        pid = proc.pid if proc is not None else self.rings.worker(w).last_beat().pid
        logger.warning("tier worker %d (pid %s) %s; failing its jobs and restarting it", w, pid, why)
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
        elif pid and kill and self.mode == "external":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rings = self.rings.worker(w)
        rings.recover(discard_jobs=True)
        self._drain_results(w, rings.results)  # what it finished is valid
        for part_id in [p for p, part in self._parts.items() if part.worker == w]:
            part = self._parts[part_id]
            self.failed_parts_total += 1
            self._complete_part(jobs.Result.failed(
                part_id, f"tier worker {w} (pid {pid}) {why}", len(part.positions)))
        if self.mode == "spawn":
            self._procs[w] = None
            delay = min(5.0, 0.1 * (2 ** self._restarts[w]))
            self._restarts[w] += 1
            self.restarts_total += 1
            self._restart_at[w] = time.monotonic() + delay

    # --- drain and shutdown ---

    def drain(self, timeout_s: float = 60.0) -> None:
        """Block until every submitted job is finished or failed (results stay in ``take``)."""
        deadline = time.monotonic() + timeout_s
        while self._parents:
            self.poll()
            if not self._parents:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._parents)} tier worker jobs still outstanding "
                                   f"after {timeout_s:g} s")
            time.sleep(0.001)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Let queued jobs finish (up to ``timeout_s``), stop the workers (spawn mode),
        fail what is left, remove the rings."""
        if self._parents and any(self._alive(w) for w in range(self.n)):
            try:
                self.drain(timeout_s)
            except TimeoutError:
                logger.warning("tier worker pool: %d jobs unfinished at shutdown", len(self._parents))
        stop = jobs.encode_job(jobs.Job(0, "stop", 0))
        for w in range(self.n):
            proc = self._procs[w]
            if proc is not None and not self._job_rings[w].try_put(stop):
                proc.terminate()  # ring full: SIGTERM makes it exit after its current batch
        deadline = time.monotonic() + timeout_s
        for w, proc in enumerate(self._procs):
            if proc is None:
                continue
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            self._procs[w] = None
        for part_id in list(self._parts):
            self._complete_part(jobs.Result.failed(part_id, "tier worker pool shut down",
                                                   len(self._parts[part_id].positions)))
        self.rings.close()
