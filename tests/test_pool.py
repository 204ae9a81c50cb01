"""The tier worker pool end to end: ``shmtier/scheduler/pool/`` driving real ``job_loop`` processes.

Every test runs real worker processes (``python -m shmtier.workers.job_loop``) over a real
POSIX segment, real ring semaphores and a real fs tier under ``tmp_path``; nothing is
mocked. Faults are real signals: SIGKILL (a crash), SIGSTOP (a hang), a SIGKILLed
scheduler (owner death). The ``pools`` fixture always shuts the pool down, kills any
worker still running and closes (unlinks) the segment, also when a test fails; the
suite-wide guard in conftest.py then checks that /dev/shm is as it was.

Tests that touch pool internals (``pool._procs`` for worker pids, ``pool._dispatch.parts`` for
which worker holds a part) do so read-only, to observe, never to steer.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
from shmtier.shared.procinfo import tier_worker_pids as worker_processes

from shmtier.shared import jobs, procinfo
from shmtier.shared.jobs import Outcome
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.pool_config import PoolConfig, PoolTier, WorkerPoolOptions, rings_len_for
from shmtier.shared.ring import RingSet, semaphore_name
from shmtier.shared.ring_tools import (
    clean_stale_ring_semaphores,
    list_ring_semaphores,
    ring_semaphore_segment,
)
from shmtier.shared.segment import open_segment, segment_name
from shmtier.shared.segment_tools import clean_stale_segments, list_segments
from shmtier.scheduler.pool import WorkerPool, WorkerState
from shmtier.scheduler.pool.dispatch import Dispatch
from shmtier.scheduler.pool.worker_state import RUNNING
from shmtier.tiers.fs.config import FsTierConfig
from starve import starved

CTX = mp.get_context("spawn")
SHM_DIR = "/dev/shm"
KEY_BYTES = 36  # a 32-byte block hash + a 4-byte group index, as the scheduler sends
_DIED = re.compile(r"tier worker (\d+) \(pid (\d+)\) died")
_HUNG = re.compile(r"tier worker (\d+) \(pid (\d+)\) hung")


# --- helpers ---------------------------------------------------------------------------


def _key(i: int, tag: bytes = b"k") -> bytes:
    return hashlib.sha256(tag + i.to_bytes(8, "big")).digest() + i.to_bytes(4, "big")


def _bf16_rows(rng: np.random.Generator, n: int, nbytes: int) -> np.ndarray:
    """``n`` rows of ``nbytes`` bf16-like bytes (the high halves of normal float32s)."""
    f = rng.standard_normal(n * nbytes // 2, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, nbytes)


def _fs_tier(root: str, **options) -> PoolTier:
    """The pool config entry of an fs tier at ``root`` with ``options`` (as the spec makes
    it; not checked here, so a test may hand the workers a root that does not exist)."""
    return PoolTier("fs", FsTierConfig(root_dir=root, min_free_bytes=None, **options))


def _kv_files(root: str | Path) -> list[Path]:
    return sorted(Path(root).rglob("*.kv"))


def _our_shm_entries(engine_id: str) -> list[str]:
    base = segment_name(engine_id).lstrip("/")
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e == base or e.startswith(f"sem.{base}."))


def _unlink_ours(engine_id: str) -> None:
    """Last-resort cleanup of one engine's segment and ring semaphores (by exact name)."""
    name = segment_name(engine_id)
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
    base = name.lstrip("/")
    for sem in list_ring_semaphores():
        if ring_semaphore_segment("sem." + sem[1:]) == base:
            try:
                posix_ipc.unlink_semaphore(sem)
            except posix_ipc.ExistentialError:
                pass


class PoolEnv:
    """One segment (owned here) + a WorkerPool with an fs tier, and the arena as rows."""

    def __init__(self, engine_id: str, root: str, *, num_workers: int = 2, slots: int = 64,
                 slot_size: int = 4096, chunk_bytes: int = 4096, num_chunks: int = 64,
                 heartbeat_interval_s: float = 0.25, heartbeat_timeout_s: float = 2.0,
                 extra_tiers: tuple = (), mode: str = "spawn", job_timeout_s: float = 60.0,
                 fs_root: str | None = None, promotion_workers: int = 0,
                 fs_options: dict | None = None):
        assert chunk_bytes % 4096 == 0
        self.engine_id = engine_id
        self.root = root if fs_root is None else fs_root
        self.closed = False
        self.pool = None
        self.cfg = PoolConfig(slots=slots, slot_size=slot_size, chunk_bytes=chunk_bytes,
                              heartbeat_interval_s=heartbeat_interval_s,
                              tiers=(_fs_tier(self.root, **(fs_options or {})), *extra_tiers),
                              options=WorkerPoolOptions(num_tier_workers=num_workers,
                                                        tier_job_timeout_s=job_timeout_s,
                                                        tier_promotion_workers=promotion_workers))
        geometry = ArenaGeometry(num_chunks=num_chunks, row_stride=chunk_bytes,
                                 page_size_per_worker=chunk_bytes, world_size=1)
        self.seg = open_segment(engine_id, geometry, f"fp-{engine_id}", owner=True,
                                rings_len=rings_len_for(self.cfg))
        try:
            self.pool = WorkerPool(engine_id, self.seg, self.cfg, mode=mode,
                                   heartbeat_timeout_s=heartbeat_timeout_s)
        except BaseException:
            self.seg.close()
            self.closed = True
            raise
        self.arena = np.frombuffer(self.seg.arena, dtype=np.uint8).reshape(num_chunks, chunk_bytes)

    def procs(self) -> list:
        return [p for p in self.pool._procs if p is not None]

    def close(self, timeout_s: float = 2.0) -> None:
        if self.closed:
            return
        self.closed = True
        running = self.procs()
        try:
            self.pool.shutdown(timeout_s)
        finally:
            for proc in running + self.procs():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
            if not self.pool.rings.closed:
                self.pool.rings.close()
            self.arena = None
            self.seg.close()


@pytest.fixture
def pools(engine_id, tmp_path):
    """``pools(**kw) -> PoolEnv``; every pool made is shut down and its segment closed."""
    made: list[PoolEnv] = []

    def make(**kw) -> PoolEnv:
        root = tmp_path / f"fs{len(made)}"
        root.mkdir()
        env = PoolEnv(f"{engine_id}-p{len(made)}", str(root), **kw)
        made.append(env)
        return env

    yield make
    errors: list[BaseException] = []
    for env in reversed(made):
        try:
            env.close()
        except Exception as e:  # close every pool even if one fails
            errors.append(e)
        left = _our_shm_entries(env.engine_id)
        if left:  # a leak of the code under test: remove it, then report it
            _unlink_ours(env.engine_id)
            errors.append(AssertionError(f"pool {env.engine_id} left {left} behind"))
    if errors:
        raise errors[0]


def wait_up(env: PoolEnv, timeout_s: float = 20.0) -> list[int]:
    """Wait until every worker process runs and has claimed its slot; return their pids."""
    pool = env.pool
    deadline = time.monotonic() + timeout_s
    while True:
        pool.poll()
        procs = pool._procs
        if all(p is not None and p.poll() is None
               and pool.rings.worker(w).last_beat().pid == p.pid for w, p in enumerate(procs)):
            return [p.pid for p in procs]
        assert time.monotonic() < deadline, "tier workers did not come up"
        time.sleep(0.01)


def submit(pool: WorkerPool, *args, timeout_s: float = 30.0, **kw) -> int:
    """``pool.submit``, retrying (with polls) while the rings are full."""
    deadline = time.monotonic() + timeout_s
    while True:
        jid = pool.submit(*args, **kw)
        if jid is not None:
            return jid
        assert time.monotonic() < deadline, "rings stayed full"
        pool.poll()
        time.sleep(0.001)


def collect(pool: WorkerPool, ids, tier: int = 0, timeout_s: float = 30.0) -> dict:
    """Drain and take; every id in ``ids`` reported exactly once, nothing else."""
    pool.drain(timeout_s)
    got: dict[int, object] = {}
    for r in pool.take(tier):
        assert r.job_id not in got, f"job {r.job_id} reported twice"
        got[r.job_id] = r
    assert set(got) == set(ids), f"missing {set(ids) - set(got)}, unknown {set(got) - set(ids)}"
    return got


def run(pool: WorkerPool, op: str, tier: int, keys, rows=None, timeout_s: float = 30.0):
    jid = submit(pool, op, tier, list(keys), rows)
    return collect(pool, [jid], tier, timeout_s)[jid]


def _alive(pid: int, start: int) -> bool:
    return procinfo.is_alive(pid, start, procinfo.boot_id())


# --- 1. byte-exact round trip ----------------------------------------------------------


def test_round_trip_many_chunks_split_over_slots_and_workers(pools):
    n, chunk = 200, 16 << 10
    env = pools(num_workers=2, slots=64, slot_size=1024, chunk_bytes=chunk, num_chunks=2 * n)
    pool, arena = env.pool, env.arena
    rng = np.random.default_rng(1)
    arena[:n] = _bf16_rows(rng, n, chunk)
    arena[n:] = rng.integers(0, 256, (n, chunk), dtype=np.uint8)  # not the source bytes
    source = arena[:n].copy()
    keys = [_key(i) for i in range(n)]
    wait_up(env)

    heads = [pool.rings.worker(w).jobs.head for w in range(2)]
    jid = submit(pool, "store", 0, keys, list(range(n)))
    puts = [pool.rings.worker(w).jobs.head - heads[w] for w in range(2)]
    # the 7+ KiB descriptor was split into slot-sized parts, and spread over both workers
    assert all(p >= 2 for p in puts), puts
    assert sum(puts) >= 200 * (KEY_BYTES + 2) // 1016
    stored = collect(pool, [jid])[jid]
    assert stored.outcomes == [Outcome.OK] * n, stored.error
    assert stored.error == ""
    assert stored.logical_bytes == [chunk] * n
    assert 0 < sum(stored.stored_bytes) < n * chunk  # bf16 compresses (byte-split + zstd)
    assert all(t > 0 for t in stored.seconds)
    files = _kv_files(env.root)
    assert len(files) == n
    sizes = {f.name: f.stat().st_size for f in files}  # each key's own file, exactly
    assert [sizes[key.hex() + ".kv"] for key in keys] == stored.stored_bytes

    loaded = run(pool, "load", 0, keys, list(range(n, 2 * n)))
    assert loaded.outcomes == [Outcome.OK] * n, loaded.error
    assert loaded.logical_bytes == [chunk] * n and loaded.stored_bytes == stored.stored_bytes
    assert np.array_equal(arena[n:], source), "loaded rows differ from the stored rows"
    assert np.array_equal(arena[:n], source), "a store or load wrote to the source rows"

    scan = run(pool, "scan", 0, [])
    assert scan.error == ""
    assert len(scan.listed) == n  # listed once each, across several result slots
    assert set(scan.listed) == set(keys)
    assert dict(zip(scan.listed, scan.listed_bytes)) == dict(zip(keys,
                                                                         stored.stored_bytes))
    assert run(pool, "probe", 0, keys).outcomes == [Outcome.OK] * n

    deleted = run(pool, "delete", 0, keys)
    assert deleted.outcomes == [Outcome.OK] * n, deleted.error
    assert _kv_files(env.root) == []
    again = run(pool, "load", 0, keys, list(range(n, 2 * n)))
    assert again.outcomes == [Outcome.MISS] * n
    assert run(pool, "scan", 0, []).listed == []
    assert run(pool, "delete", 0, keys).outcomes == [Outcome.MISS] * n
    assert pool.restarts_total == 0 and pool.failed_parts_total == 0


# --- 2. exactly once under random SIGKILLs ---------------------------------------------

STRESS_JOBS = 100_000
STRESS_MAX_S = 15.0  # stop submitting after this long (a fast machine checks more jobs)...
STRESS_MIN_JOBS = 20_000  # ...once at least this many ran and 3 kills landed,
STRESS_HARD_MAX_S = 60.0  # or after this long whatever ran (then the test fails, saying so)
STRESS_STORE_EVERY = 50
STRESS_IN_FLIGHT = 64


def test_exactly_once_under_random_sigkills(pools):
    """10^5 one-key jobs (probes, every 50th a store) with a worker SIGKILLed every
    0.2-0.5 s: each pool job id is reported exactly once, failures name the killed
    worker, and every store that reported OK loads back byte-exactly.

    Kills only hit a pool whose two workers are both healthy: the pool's restart
    backoff doubles per restart (0.1 s ... 5 s), so killing the only live worker would
    leave the pool idle for seconds, and a slot killed three times before it became
    healthy would break the pool (a worker that cannot start). Hang detection is out
    of the way (heartbeat timeout 30 s): only death is tested here.

    At most 64 jobs are in flight against 128-slot rings, so a ring never fills, even
    with the up to 32 space tokens a worker killed inside ``get_many`` takes with it
    (see test_submit_reports_backpressure_while_a_space_is_not_yet_returned for what
    ``submit`` does when the counters and the semaphore disagree).
    """
    chunk = 4096
    n_store = STRESS_JOBS // STRESS_STORE_EVERY
    env = pools(num_workers=2, slots=128, slot_size=1024, chunk_bytes=chunk,
                num_chunks=2 * n_store, heartbeat_timeout_s=30.0)
    pool, arena = env.pool, env.arena
    rng = random.Random(2)
    arena[:n_store] = np.random.default_rng(2).integers(0, 256, (n_store, chunk), dtype=np.uint8)
    wait_up(env)

    submitted: dict[int, tuple[str, int]] = {}
    seen: dict[int, object] = {}
    killed: set[tuple[int, int]] = set()  # (worker index, pid)
    nones = 0

    def take_all() -> None:
        for r in pool.take(0):
            assert r.job_id in submitted, f"unknown pool job id {r.job_id}"
            assert r.job_id not in seen, f"pool job {r.job_id} reported twice"
            seen[r.job_id] = r

    t0 = time.monotonic()
    next_kill = t0 + rng.uniform(0.2, 0.5)
    i = 0
    target = STRESS_JOBS
    while i < target or pool.outstanding():
        now = time.monotonic()
        if now >= next_kill:
            procs = list(pool._procs)
            if all(p is not None and p.poll() is None for p in procs) and all(
                    state == "healthy" for state in pool.worker_states()):
                w = rng.randrange(len(procs))
                procs[w].send_signal(signal.SIGKILL)
                killed.add((w, procs[w].pid))
            next_kill = now + rng.uniform(0.2, 0.5)
        if i < target and now - t0 > STRESS_MAX_S and (
                (i >= STRESS_MIN_JOBS and len(killed) >= 3) or now - t0 > STRESS_HARD_MAX_S):
            target = i
        while i < target and pool.outstanding() < STRESS_IN_FLIGHT:
            if i % STRESS_STORE_EVERY == 0:
                s = i // STRESS_STORE_EVERY
                jid = pool.submit("store", 0, [_key(s, b"s")], [s])
                meta = ("store", s)
            else:
                jid = pool.submit("probe", 0, [_key(i % 4096, b"p")])
                meta = ("probe", -1)
            if jid is None:  # rings full: poll and retry later
                nones += 1
                break
            assert jid not in submitted
            submitted[jid] = meta
            i += 1
        pool.poll()
        take_all()
        if pool.outstanding() >= STRESS_IN_FLIGHT:
            time.sleep(0.0002)
    elapsed = time.monotonic() - t0
    # the last kill is noticed by the next health check
    deadline = time.monotonic() + 5
    while pool.restarts_total < len(killed) and time.monotonic() < deadline:
        pool.poll()
        time.sleep(0.01)
    settle = time.monotonic() + 0.3  # nothing reported late or twice
    while time.monotonic() < settle:
        pool.poll()
        take_all()
        time.sleep(0.01)
    print(f"\nexactly-once stress: {i} jobs in {elapsed:.1f} s = {i / elapsed:.0f} jobs/s, "
          f"{len(killed)} SIGKILLs, {pool.restarts_total} restarts, "
          f"{pool.failed_parts_total} failed parts, {nones} full-ring retries")

    assert i >= STRESS_MIN_JOBS, f"only {i} jobs in {elapsed:.1f} s"
    assert len(killed) >= 3
    assert pool.outstanding() == 0
    assert set(seen) == set(submitted), (
        f"{len(set(submitted) - set(seen))} jobs never reported")
    assert pool.restarts_total == len(killed) > 0

    failed = 0
    ok_stores = []
    for jid, (op, s) in submitted.items():
        r = seen[jid]
        (code,) = r.outcomes
        if code == Outcome.ERROR:
            failed += 1
            m = _DIED.search(r.error)
            assert m, f"job {jid} ({op}) failed without naming a dead worker: {r.error!r}"
            assert (int(m.group(1)), int(m.group(2))) in killed, r.error
        elif op == "probe":
            assert code == Outcome.MISS, (jid, r.outcomes, r.error)
        else:
            assert code == Outcome.OK, (jid, r.outcomes, r.error)
            ok_stores.append(s)
    assert failed == pool.failed_parts_total  # one part per job
    assert failed > 0, "no kill caught a job in flight"
    assert len(ok_stores) > 0.5 * (target // STRESS_STORE_EVERY)

    # stores that reported OK are on disk, intact (no kill left a torn file behind)
    for start in range(0, len(ok_stores), 256):
        batch = ok_stores[start:start + 256]
        r = run(pool, "load", 0, [_key(s, b"s") for s in batch], [n_store + s for s in batch])
        assert r.outcomes == [Outcome.OK] * len(batch), r.error
    ok = np.array(ok_stores)
    assert np.array_equal(arena[n_store + ok], arena[ok])


# --- 3. a hung worker ------------------------------------------------------------------


def test_hung_worker_is_detected_failed_and_replaced(pools):
    timeout = 1.0
    env = pools(num_workers=2, heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout,
                num_chunks=64)
    pool, arena = env.pool, env.arena
    arena[:32] = np.random.default_rng(3).integers(0, 256, (32, 4096), dtype=np.uint8)
    wait_up(env)
    hung = pool._procs[0]
    try:
        hung.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        key = _key(1, b"hung")
        jid = submit(pool, "probe", 0, [key])
        assert pool.rings.worker(0).jobs.depth() == 1, "the job should wait for worker 0"
        r = collect(pool, [jid], timeout_s=timeout + 5)[jid]
        detected = time.monotonic() - t0
        assert r.outcomes == [Outcome.ERROR]
        m = _HUNG.search(r.error)
        assert m and m.group(1) == "0" and int(m.group(2)) == hung.pid, r.error
        # the beat age counts from the last beat (every 0.1 s, later on a busy machine)
        assert timeout - 0.5 <= detected <= timeout + 1.5, detected
        assert hung.poll() == -signal.SIGKILL  # the pool killed (and reaped) it
        assert pool.restarts_total == 1 and pool.failed_parts_total == 1

        new_pids = wait_up(env, timeout_s=10)
        assert new_pids[0] != hung.pid
        keys = [_key(i, b"after") for i in range(32)]
        stored = run(pool, "store", 0, keys, list(range(32)))
        assert stored.outcomes == [Outcome.OK] * 32, stored.error
        loaded = run(pool, "load", 0, keys, list(range(32, 64)))
        assert loaded.outcomes == [Outcome.OK] * 32, loaded.error
        assert np.array_equal(arena[32:64], arena[:32])
        assert run(pool, "probe", 0, [key]).outcomes == [Outcome.MISS]
        assert pool.restarts_total == 1
    finally:
        if hung.poll() is None:
            hung.send_signal(signal.SIGCONT)
            hung.kill()
            hung.wait(5)


def test_replacement_is_not_judged_by_its_predecessors_heartbeat(pools):
    env = pools(num_workers=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)
    pool = env.pool
    wait_up(env)
    hung = pool._procs[0]
    hung.send_signal(signal.SIGSTOP)
    try:
        first = run(pool, "probe", 0, [_key(1, b"x")], timeout_s=5)
        assert first.outcomes == [Outcome.ERROR] and "hung" in first.error
        assert pool.restarts_total == 1
        # The worker is down (restart backoff, 0.1 s): the next job waits in its ring for
        # the replacement, which must be given the time to start and beat.
        second = run(pool, "probe", 0, [_key(2, b"x")], timeout_s=10)
        assert second.outcomes == [Outcome.MISS], second.error
        assert pool.restarts_total == 1
    finally:
        if hung.poll() is None:
            hung.kill()
            hung.wait(5)


def test_a_worker_starved_of_cpu_is_slow_not_hung(pools, caplog):
    """A worker that holds a job but gets next to no CPU (``starve.py``) beats later than
    the heartbeat timeout for as long as it is starved. It runs or waits to run all that
    time: the pool spares it, says why, and the job completes once the CPU frees up,
    byte-exact. (A SIGSTOPped worker neither runs nor waits: it is killed at the same
    age, test_hung_worker_is_detected_failed_and_replaced.)"""
    timeout, chunk, n = 0.6, 1 << 20, 8
    env = pools(num_workers=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=timeout,
                chunk_bytes=chunk, num_chunks=2 * n)
    pool, arena = env.pool, env.arena
    arena[:n] = _bf16_rows(np.random.default_rng(4), n, chunk)
    [pid] = wait_up(env)
    keys = [_key(i, b"starved") for i in range(n)]
    with starved([pid]):
        jid = submit(pool, "store", 0, keys, list(range(n)))
        deadline = time.monotonic() + 20
        while pool.late_beats.spared_total < 2:  # two windows of timeout / 2 spared
            pool.poll()
            assert pool.outstanding(), "the store finished: the worker was not starved"
            assert pool.hung_total == 0, caplog.text
            assert time.monotonic() < deadline, "never judged"
            time.sleep(0.01)
    stored = collect(pool, [jid])[jid]
    assert stored.outcomes == [Outcome.OK] * n, stored.error
    assert pool.hung_total == 0 and pool.restarts_total == 0 and pool.failed_parts_total == 0
    assert f"tier worker 0 (pid {pid}): no heartbeat for" in caplog.text
    assert "slow (a busy host), not hung" in caplog.text
    loaded = run(pool, "load", 0, keys, list(range(n, 2 * n)))
    assert loaded.outcomes == [Outcome.OK] * n, loaded.error
    assert np.array_equal(arena[n:], arena[:n])


def test_a_tier_worker_starts_no_process_of_its_own(pools, worker_hooks, tmp_path_factory):
    """A tier worker's jobs start no child process. On a busy host a child gets as little
    CPU as its worker, and the worker waits in the kernel until the child has exec'd
    (vfork), unable to beat: it was judged hung (the fs tier's writeback module ran
    ``ldconfig`` through ``ctypes.util.find_library`` on import, inside the first job;
    test_a_worker_starved_of_cpu_is_slow_not_hung failed 1 run in ~40 from it). Every
    job kind on the fs tier (buffered; adaptive: O_DIRECT loads), and the worker's start
    and shutdown: its process log holds only its own start line."""
    log = tmp_path_factory.mktemp("processes") / "started.log"
    worker_hooks(process_log=log)
    n, chunk = 8, 64 << 10
    pids = []
    for direct_io in (False, "adaptive"):
        env = pools(num_workers=1, chunk_bytes=chunk, num_chunks=2 * n,
                    fs_options={"direct_io": direct_io})
        pool, arena = env.pool, env.arena
        arena[:n] = _bf16_rows(np.random.default_rng(5), n, chunk)
        pids += wait_up(env)
        keys = [_key(i, b"children") for i in range(n)]
        assert run(pool, "store", 0, keys, list(range(n))).outcomes == [Outcome.OK] * n
        assert run(pool, "probe", 0, keys).outcomes == [Outcome.OK] * n
        assert run(pool, "load", 0, keys, list(range(n, 2 * n))).outcomes == [Outcome.OK] * n
        assert np.array_equal(arena[n:], arena[:n])
        assert run(pool, "delete", 0, keys).outcomes == [Outcome.OK] * n
        env.close()
    lines = log.read_text().splitlines()
    for pid in pids:
        theirs = [line for line in lines if line.split(" ", 1)[0] == str(pid)]
        assert len(theirs) == 1 and "hooked" in theirs[0] and "job_loop" in theirs[0], theirs


def test_a_result_is_counted_before_it_is_answered(pools, worker_hooks):
    """Whoever takes a result finds it in the slot's counters (``shmtier top``, the
    external pool's metrics, tests that compare both): the worker adds it before it puts
    it. Each add waits 0.3 s here; counted after the answer, the counters read once the
    job is collected would miss it (a test read 47 jobs for 48 answered, under load)."""
    worker_hooks(slow_tally_s=0.3)
    env = pools(num_workers=1, chunk_bytes=4096, num_chunks=8)
    pool, arena = env.pool, env.arena
    arena[:4] = np.random.default_rng(6).integers(0, 256, (4, 4096), dtype=np.uint8)
    wait_up(env)
    keys = [_key(i, b"counted") for i in range(4)]
    for n, (op, rows) in enumerate((("store", [0, 1, 2, 3]), ("probe", None),
                                    ("load", [4, 5, 6, 7])), start=1):
        got = run(pool, op, 0, keys, rows)
        assert got.outcomes == [Outcome.OK] * 4, got.error
        counted = pool.rings.worker(0).counters()
        assert counted.jobs == n and counted.failed_keys == 0, (op, counted)
    assert np.array_equal(arena[4:8], arena[:4])


# --- 4. malformed descriptors ----------------------------------------------------------


def test_malformed_descriptors_and_backendless_tiers_get_error_results(pools, caplog):
    # tier 0: fs; tier 1: a tier without a worker half (its scheduler half does its own I/O)
    env = pools(num_workers=1, num_chunks=8, extra_tiers=(None,))
    pool, arena = env.pool, env.arena
    [pid] = wait_up(env)
    arena[:4] = np.random.default_rng(4).integers(0, 256, (4, 4096), dtype=np.uint8)
    garbage = [
        b"\xc1garbage",  # 0xc1 is never valid msgpack
        b"",
        jobs.encode_job(jobs.Job(900_001, "probe", 0, [b"k" * 36]))[:-5],  # truncated
        b"\x98\x07\x00\xce" + (900_002).to_bytes(4, "big") + b"\x04\x00\x90\x90\x80",  # v7
        b"\x98\x01\x00\xce" + (900_003).to_bytes(4, "big") + b"\x63\x00\x90\x90\x80",  # op 99
    ]
    for raw in garbage:
        with pytest.raises(jobs.MalformedJob):
            jobs.decode_job(raw)
    results = pool.rings.worker(0).results
    answered_before = results.head
    with caplog.at_level(logging.ERROR, logger="shmtier.scheduler.pool.supervisor"):
        for raw in garbage:
            assert pool.rings.worker(0).jobs.try_put(raw)
        deadline = time.monotonic() + 10
        while results.head - answered_before < len(garbage):
            assert time.monotonic() < deadline, "the worker did not answer every malformed job"
            time.sleep(0.01)
        pool.poll()
    # one error result each (job id 0 when none could be read); the pool ignores
    # results for ids it never issued
    unknown = [r.getMessage() for r in caplog.records if "unknown job" in r.getMessage()]
    assert len(unknown) == len(garbage), unknown
    assert any("900003" in m for m in unknown) and any("job 0 " in m for m in unknown), unknown
    assert pool.take(0) == [] and pool.outstanding() == 0

    no_backend = run(pool, "probe", 1, [_key(1, b"t1")])
    assert no_backend.outcomes == [Outcome.ERROR]
    assert "tier 1 has no worker backend" in no_backend.error
    no_tier = pool.submit("store", 7, [_key(1, b"t7")], [0])
    got = collect(pool, [no_tier], tier=7)[no_tier]
    assert got.outcomes == [Outcome.ERROR] and "tier 7 has no worker backend" in got.error
    with pytest.raises(ValueError, match="frobnicate"):
        pool.submit("frobnicate", 0, [_key(1, b"op")])
    assert pool.outstanding() == 0

    # the same worker process still serves normal jobs
    assert env.procs()[0].pid == pid and env.procs()[0].poll() is None
    keys = [_key(i, b"m") for i in range(4)]
    assert run(pool, "store", 0, keys, [0, 1, 2, 3]).outcomes == [Outcome.OK] * 4
    assert run(pool, "load", 0, keys, [4, 5, 6, 7]).outcomes == [Outcome.OK] * 4
    assert np.array_equal(arena[4:8], arena[:4])
    assert pool.restarts_total == 0 and pool.failed_parts_total == 0


# --- 5. owner death ----------------------------------------------------------------------


def _owner_child(engine_id: str, root: str, conn) -> None:
    """A scheduler stand-in: own the segment, run a pool, report worker pids, then wait."""
    cfg = PoolConfig(slots=16, slot_size=1024, chunk_bytes=4096, heartbeat_interval_s=0.1,
                     tiers=(_fs_tier(root),), options=WorkerPoolOptions(num_tier_workers=2))
    geometry = ArenaGeometry(num_chunks=8, row_stride=4096, page_size_per_worker=4096,
                             world_size=1)
    seg = open_segment(engine_id, geometry, "fp-owner-death", owner=True,
                       rings_len=rings_len_for(cfg))
    pool = WorkerPool(engine_id, seg, cfg)
    deadline = time.monotonic() + 20
    while not all(pool.rings.worker(w).last_beat().pid == p.pid
                  for w, p in enumerate(pool._procs)):
        if time.monotonic() > deadline:
            break
        pool.poll()
        time.sleep(0.01)
    jid = pool.submit("probe", 0, [b"k" * 36])
    pool.drain(10)
    conn.send({"segment": seg.name, "ok": [r.job_id for r in pool.take(0)] == [jid],
               "workers": [(p.pid, procinfo.start_time(p.pid)) for p in pool._procs]})
    time.sleep(120)  # killed by the test long before


def test_workers_exit_when_the_scheduler_dies_and_clean_removes_the_rest(engine_id, tmp_path):
    eid = f"{engine_id}-owner"
    parent_conn, child_conn = CTX.Pipe()
    child = CTX.Process(target=_owner_child, args=(eid, str(tmp_path), child_conn))
    workers: list[tuple[int, int]] = []
    child.start()
    try:
        assert parent_conn.poll(30), "the scheduler child did not start its pool"
        info = parent_conn.recv()
        workers = info["workers"]
        assert info["ok"] and info["segment"] == segment_name(eid)
        assert len(workers) == 2 and all(_alive(pid, st) for pid, st in workers)

        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        t0 = time.monotonic()
        while any(_alive(pid, st) for pid, st in workers):
            assert time.monotonic() - t0 < 5, "tier workers outlived their scheduler by 5 s"
            time.sleep(0.02)
        print(f"\nworkers exited {time.monotonic() - t0:.2f} s after the scheduler died")

        # What the dead scheduler left: a stale segment and its 8 ring semaphores. /dev/shm
        # is host-wide: a `shmtier clean` or a leak guard of another run on this host may
        # remove them first, so the exact checks apply to what is still there.
        seg_entry = segment_name(eid).lstrip("/")
        ours = {semaphore_name(segment_name(eid), w, kind, which)
                for w in range(2) for kind in ("job", "res") for which in ("items", "spaces")}
        left = set(_our_shm_entries(eid))
        assert left <= {seg_entry} | {"sem." + n[1:] for n in ours}, left
        statuses = [s for s in list_segments() if s.name == segment_name(eid)]
        assert not any(s.alive for s in statuses), "the dead scheduler's segment counts as alive"
        removed = (set(clean_stale_segments({segment_name(eid)}))
                   | set(clean_stale_ring_semaphores({segment_name(eid)})))
        if len(left) == 9:  # the usual case: nobody else removed them first
            assert {segment_name(eid)} | ours <= removed, removed
        assert _our_shm_entries(eid) == []
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
        for pid, st in workers:
            if _alive(pid, st):
                os.kill(pid, signal.SIGKILL)
        _unlink_ours(eid)


# --- 6. per-key ordering -----------------------------------------------------------------


def test_store_load_delete_of_the_same_keys_run_in_submit_order(pools):
    n, chunk = 24, 256 << 10  # big chunks: a store takes long enough to be overtaken
    env = pools(num_workers=2, slots=64, slot_size=1024, chunk_bytes=chunk, num_chunks=4 * n)
    pool, arena = env.pool, env.arena
    rng = np.random.default_rng(6)
    arena[:] = rng.integers(0, 256, arena.shape, dtype=np.uint8)
    src_a, dst_a, src_b, dst_b = (list(range(k * n, (k + 1) * n)) for k in range(4))
    keys = [_key(i, b"order") for i in range(n)]
    wait_up(env)

    plan = [("store", src_a), ("load", dst_a), ("delete", None), ("load", dst_b),
            ("store", src_b), ("load", dst_b), ("probe", None)]
    ids, owner = [], {}
    for op, rows in plan:  # back to back, no poll in between
        before = set(pool._dispatch.parts)
        jid = pool.submit(op, 0, keys, rows)
        assert jid is not None
        ids.append(jid)
        for part_id in set(pool._dispatch.parts) - before:
            part = pool._dispatch.parts[part_id]
            for pos in part.positions:
                owner.setdefault(pos, set()).add(part.worker)
    assert all(len(ws) == 1 for ws in owner.values()), owner  # one worker per key
    assert set().union(*owner.values()) == {0, 1}  # the keys were spread over both
    got = collect(pool, ids, timeout_s=60)
    outcomes = [got[j].outcomes for j in ids]
    expect = [Outcome.OK, Outcome.OK, Outcome.OK, Outcome.MISS, Outcome.OK, Outcome.OK, Outcome.OK]
    for (op, _), want, have, j in zip(plan, expect, outcomes, ids):
        assert have == [want] * n, (op, have, got[j].error)
    assert np.array_equal(arena[dst_b[0]:dst_b[-1] + 1], arena[src_b[0]:src_b[-1] + 1])
    assert not np.array_equal(arena[src_a[0]:src_a[-1] + 1], arena[src_b[0]:src_b[-1] + 1])
    # dst_a was overwritten by nothing after the first load: it holds src_a's bytes
    assert np.array_equal(arena[dst_a[0]:dst_a[-1] + 1], arena[src_a[0]:src_a[-1] + 1])


# --- 7. backpressure -------------------------------------------------------------------


def test_full_rings_make_submit_return_none_without_side_effects(pools):
    chunk = 1 << 20
    env = pools(num_workers=1, slots=2, slot_size=512, chunk_bytes=chunk, num_chunks=16,
                heartbeat_timeout_s=30.0)
    pool, arena = env.pool, env.arena
    arena[:] = np.random.default_rng(7).integers(0, 256, arena.shape, dtype=np.uint8)
    wait_up(env)
    ring = pool.rings.worker(0).jobs

    # a slow stream (two 1 MiB chunks per job) into a two-slot ring
    accepted, rejected, worst = {}, [], 0.0
    i = 0
    deadline = time.monotonic() + 30
    while len(accepted) < 12 or not rejected:
        assert time.monotonic() < deadline, (len(accepted), len(rejected))
        keys = [_key(2 * i, b"bp"), _key(2 * i + 1, b"bp")]
        rows = [(2 * i) % 16, (2 * i + 1) % 16]
        state = (pool.outstanding(), ring.head)
        t = time.perf_counter()
        jid = pool.submit("store", 0, keys, rows)
        worst = max(worst, time.perf_counter() - t)
        if jid is None:
            assert (pool.outstanding(), ring.head) == state
            rejected.append(keys)
        else:
            accepted[jid] = keys
        pool.poll()
        i += 1
        time.sleep(0.001)  # a job takes ~10 ms: offer one every millisecond
    assert worst < 0.05, f"submit took {worst * 1e3:.1f} ms: it must never block"
    got = collect(pool, accepted, timeout_s=30)
    assert all(r.outcomes == [Outcome.OK, Outcome.OK] for r in got.values())
    refused = [k for keys in rejected for k in keys]
    for start in range(0, len(refused), 8):  # 8 keys fit one slot
        batch = refused[start:start + 8]
        assert run(pool, "probe", 0, batch).outcomes == [Outcome.MISS] * len(batch)

    # deterministic: a stopped worker, one slot taken, a two-part job does not fit
    proc = env.procs()[0]
    proc.send_signal(signal.SIGSTOP)
    try:
        one = pool.submit("probe", 0, [_key(1, b"one")])
        assert one is not None and ring.depth() == 1
        big = [_key(i, b"big") for i in range(20)]  # ~800 B: two parts of a 504 B payload
        assert len(jobs.split_job(jobs.Job(1, "store", 0, big, list(range(20))),
                                  ring.max_payload, iter(range(2, 99)).__next__)) == 2
        head, outstanding = ring.head, pool.outstanding()
        assert pool.submit("store", 0, big, [i % 16 for i in range(20)]) is None
        assert (ring.head, ring.depth(), pool.outstanding()) == (head, 1, outstanding)
        two = pool.submit("probe", 0, [_key(2, b"one")])
        assert two is not None and ring.depth() == 2
        assert pool.submit("probe", 0, [_key(3, b"one")]) is None
        assert ring.depth() == 2 and pool.outstanding() == outstanding + 1
    finally:
        proc.send_signal(signal.SIGCONT)
    got = collect(pool, [one, two], timeout_s=30)
    assert [got[one].outcomes, got[two].outcomes] == [[Outcome.MISS], [Outcome.MISS]]
    assert run(pool, "probe", 0, big).outcomes == [Outcome.MISS] * 20  # never stored
    assert pool.restarts_total == 0


def test_submit_reports_backpressure_while_a_space_is_not_yet_returned(pools):
    # external mode: this test is the worker (the job ring's one consumer)
    env = pools(num_workers=1, slots=4, slot_size=512, mode="external", num_chunks=8)
    pool = env.pool
    consumer = RingSet.attach(env.seg.name, env.seg.rings, worker=0)
    spaces = posix_ipc.Semaphore(semaphore_name(env.seg.name, 0, "job", "spaces"))
    try:
        ids = [pool.submit("probe", 0, [_key(i, b"ext")]) for i in range(4)]
        assert None not in ids
        assert pool.submit("probe", 0, [_key(9, b"ext")]) is None  # full
        # The consumer takes one job. Its space token is taken back at once: the state
        # inside Ring.get_many after `tail` is committed and before spaces.release() (and
        # the state a worker SIGKILLed right there leaves until the pool resyncs).
        assert len(consumer.worker(0).jobs.get_many(1, timeout_s=0)) == 1
        spaces.acquire(0)
        outstanding = pool.outstanding()
        assert pool.submit("probe", 0, [_key(10, b"ext")]) is None
        assert pool.outstanding() == outstanding
    finally:
        spaces.close()
        consumer.close()


def test_submit_rejects_a_job_that_can_never_fit_the_rings(pools):
    env = pools(num_workers=1, slots=2, slot_size=512, num_chunks=64)
    keys = [_key(i, b"huge") for i in range(60)]  # ~2.4 KB: five parts of a 504 B payload
    with pytest.raises(ValueError):
        env.pool.submit("store", 0, keys, list(range(60)))


# --- 8. shutdown -------------------------------------------------------------------------


def test_shutdown_with_jobs_in_flight_leaves_no_process_and_no_shm(pools):
    chunk = 256 << 10
    env = pools(num_workers=2, slots=64, slot_size=1024, chunk_bytes=chunk, num_chunks=32)
    pool, arena = env.pool, env.arena
    arena[:] = np.random.default_rng(8).integers(0, 256, arena.shape, dtype=np.uint8)
    pids = wait_up(env)
    starts = [procinfo.start_time(pid) for pid in pids]
    procs = env.procs()
    for j in range(16):
        submit(pool, "store", 0, [_key(4 * j + k, b"sd") for k in range(4)],
               [(4 * j + k) % 32 for k in range(4)])
    assert pool.outstanding() > 0
    t = time.monotonic()
    env.close(timeout_s=10)
    took = time.monotonic() - t
    assert took < 5, took
    # the stop queued behind the jobs: each worker finished its jobs and exited cleanly
    assert [p.returncode for p in procs] == [0, 0]
    assert not any(_alive(pid, st) for pid, st in zip(pids, starts))
    assert _our_shm_entries(env.engine_id) == []
    assert list(Path(env.root).rglob("*.tmp")) == []  # no half-written chunk left behind


def test_shutdown_kills_a_stopped_worker_and_leaves_nothing(pools):
    env = pools(num_workers=2, heartbeat_timeout_s=30.0)
    pool = env.pool
    pids = wait_up(env)
    starts = [procinfo.start_time(pid) for pid in pids]
    procs = env.procs()
    procs[1].send_signal(signal.SIGSTOP)
    for i in range(8):
        submit(pool, "probe", 0, [_key(i, b"stop")])
    t = time.monotonic()
    env.close(timeout_s=1.0)
    assert time.monotonic() - t < 4
    assert procs[1].returncode == -signal.SIGKILL
    assert not any(_alive(pid, st) for pid, st in zip(pids, starts))
    assert _our_shm_entries(env.engine_id) == []


def test_shutdown_with_full_job_rings_stops_workers_cleanly(pools, caplog):
    """Rings too full for the stop job: shutdown drains the backlog first, then the
    worker takes its stop job and exits 0, nothing left unfinished."""
    chunk = 256 << 10
    env = pools(num_workers=1, slots=4, slot_size=512, chunk_bytes=chunk, num_chunks=16)
    pool, arena = env.pool, env.arena
    arena[:] = np.random.default_rng(9).integers(0, 256, arena.shape, dtype=np.uint8)
    wait_up(env)
    proc = env.procs()[0]
    j = 0
    while pool.submit("store", 0, [_key(j, b"full")], [j % 16]) is not None:
        j += 1
        assert j < 1000
    assert j >= 4
    t = time.monotonic()
    env.close(timeout_s=10.0)  # the backlog (4-5 small stores) takes milliseconds when idle
    took = time.monotonic() - t
    assert proc.returncode == 0, f"worker exit code {proc.returncode} after {took:.1f} s"
    assert "unfinished at shutdown" not in caplog.text, f"{took:.1f} s: {caplog.text}"


def test_shutdown_fails_the_jobs_left_in_flight(pools):
    env = pools(num_workers=1, heartbeat_timeout_s=30.0)
    pool = env.pool
    wait_up(env)
    env.procs()[0].send_signal(signal.SIGSTOP)
    ids = [submit(pool, "probe", 0, [_key(i, b"left")]) for i in range(3)]
    pool.shutdown(timeout_s=0.5)
    assert pool.outstanding() == 0
    results = pool.take(0)
    assert sorted(r.job_id for r in results) == sorted(ids)
    assert all(r.outcomes == [Outcome.ERROR] and r.error for r in results)


# --- 9. one pool per engine: ring ownership ---------------------------------------------


def _holders(pool: WorkerPool) -> list[tuple[int, int]]:
    """(pid, start time) of each worker slot's recorded holder."""
    return [(hb.pid, hb.start_time) for hb in
            (pool.rings.worker(w).last_beat() for w in range(pool.n))]


def _start_cli(*args: str) -> subprocess.Popen:
    """``python -m shmtier ARGS`` in its own session (so the test can kill everything it
    starts, its worker processes included, with one killpg)."""
    return subprocess.Popen([sys.executable, "-m", "shmtier", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, str]:
    """Wait for ``proc`` (returncode, stderr); on timeout kill its whole session and
    return (None, stderr)."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, err.decode(errors="replace")
    except subprocess.TimeoutExpired:
        _killpg(proc)
        _, err = proc.communicate()
        return None, err.decode(errors="replace")


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is its group id
    except ProcessLookupError:
        pass
    proc.wait(10)


def _round_trip(env: PoolEnv, tag: bytes, n: int = 8) -> None:
    rng = np.random.default_rng(len(tag))
    env.arena[:n] = rng.integers(0, 256, (n, env.arena.shape[1]), dtype=np.uint8)
    keys = [_key(i, tag) for i in range(n)]
    stored = run(env.pool, "store", 0, keys, list(range(n)))
    assert stored.outcomes == [Outcome.OK] * n, stored.error
    loaded = run(env.pool, "load", 0, keys, list(range(n, 2 * n)))
    assert loaded.outcomes == [Outcome.OK] * n, loaded.error
    assert np.array_equal(env.arena[n:2 * n], env.arena[:n])


def test_shmtier_workers_refuses_a_spawn_mode_engine_and_leaves_its_pool_alone(pools):
    env = pools(num_workers=2, num_chunks=16)
    pool = env.pool
    pids = wait_up(env)
    holders = _holders(pool)
    assert [pid for pid, _ in holders] == pids
    second = _start_cli("workers", "--engine-id", env.engine_id)
    code, err = _finish(second, 30)
    assert code == 2, (code, err)
    assert "spawn" in err and env.engine_id in err, err
    for _ in range(10):  # a few health checks: nothing was disturbed
        pool.poll()
        time.sleep(0.06)
    assert _holders(pool) == holders
    assert [p.pid for p in env.procs()] == pids and all(p.poll() is None for p in env.procs())
    _round_trip(env, b"spawn-owner")
    assert _holders(pool) == holders
    assert pool.restarts_total == 0 and pool.failed_parts_total == 0
    assert pool.broken is None


def test_a_second_external_pool_is_refused_and_the_first_keeps_its_rings(pools):
    env = pools(num_workers=2, num_chunks=16, mode="external")
    pool = env.pool
    first = _start_cli("workers", "--engine-id", env.engine_id)
    second = None
    try:
        deadline = time.monotonic() + 30
        while pool.worker_states() != [WorkerState.HEALTHY] * 2:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, pool.worker_states()
            pool.poll()
            time.sleep(0.02)
        holders = _holders(pool)
        assert all(pid and _alive(pid, st) for pid, st in holders)
        _round_trip(env, b"ext-first")

        second = _start_cli("workers", "--engine-id", env.engine_id)
        code, err = _finish(second, 30)
        assert code == 2, (code, err)
        assert "held by live" in err, err
        for _ in range(10):
            pool.poll()
            time.sleep(0.06)
        assert _holders(pool) == holders
        assert pool.worker_states() == [WorkerState.HEALTHY] * 2
        _round_trip(env, b"ext-after")
        assert _holders(pool) == holders and pool.failed_parts_total == 0
        assert first.poll() is None
    finally:
        if second is not None and second.poll() is None:
            _killpg(second)
        first.terminate()  # stops its workers
        if _finish(first, 15)[0] is None:
            pytest.fail("`shmtier workers` did not stop on SIGTERM")


def test_a_duplicate_worker_exits_without_clearing_the_holders_record(pools):
    env = pools(num_workers=1, num_chunks=16)
    pool = env.pool
    [pid] = wait_up(env)
    holders = _holders(pool)
    claims = pool.rings.worker(0).last_beat().claims
    dup = subprocess.Popen([sys.executable, "-m", "shmtier.workers.job_loop", env.engine_id, "0"],
                           stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    code, err = _finish(dup, 30)
    assert code not in (None, 0), (code, err)
    assert "RingBusyError" in err and f"held by live pid {pid}" in err, err
    assert _holders(pool) == holders and pool.rings.worker(0).holder_alive()
    assert pool.rings.worker(0).last_beat().claims == claims  # its claim never happened
    _round_trip(env, b"dup")
    assert _holders(pool) == holders
    assert pool.restarts_total == 0 and env.procs()[0].pid == pid


# --- 10. job deadline --------------------------------------------------------------------


def test_a_lost_job_fails_by_its_deadline_and_its_worker_is_replaced(pools):
    """A worker that holds a job and never answers (SIGSTOPped; its heartbeat timeout
    is far away): at the part's deadline the worker is killed, then the part fails,
    exactly once, and a replacement serves the next jobs."""
    timeout = 1.0
    env = pools(num_workers=1, num_chunks=16, heartbeat_timeout_s=60.0, job_timeout_s=timeout)
    pool = env.pool
    [pid] = wait_up(env)
    lost = env.procs()[0]
    try:
        lost.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        jid = submit(pool, "probe", 0, [_key(1, b"lost")])
        r = collect(pool, [jid], timeout_s=timeout + 10)[jid]
        took = time.monotonic() - t0
        assert r.outcomes == [Outcome.ERROR]
        m = _HUNG.search(r.error)
        assert m and int(m.group(2)) == pid and "deadline" in r.error, r.error
        assert timeout <= took <= timeout + 2.0, took
        assert lost.returncode == -signal.SIGKILL  # killed before its part failed
        assert pool.failed_parts_total == 1 and pool.timed_out_total == 1
        assert pool.restarts_total == 1
        [new_pid] = wait_up(env, timeout_s=15)
        assert new_pid != pid
        assert run(pool, "probe", 0, [_key(2, b"lost")]).outcomes == [Outcome.MISS]
        settle = time.monotonic() + 0.3
        while time.monotonic() < settle:  # nothing reported late or twice
            pool.poll()
            assert pool.take(0) == []
            time.sleep(0.02)
        assert pool.failed_parts_total == 1 and pool.broken is None
    finally:
        if lost.poll() is None:
            lost.send_signal(signal.SIGCONT)
            lost.kill()
            lost.wait(5)


def test_a_killed_workers_load_fails_at_once_and_its_rows_are_released_once_it_is_gone(pools):
    """A worker SIGSTOPped while it holds a load part is killed at the part's deadline.
    The load fails right then (the part's keys ERROR, the other worker's part served
    byte-exact), with a release that stays unset while the killed process is not reaped
    (it could still write those rows) and is set at the health check that reaps it.
    ``drain`` returns only once every such release is set."""
    timeout = 2.0
    env = pools(num_workers=2, num_chunks=64, heartbeat_timeout_s=60.0, job_timeout_s=timeout)
    pool, arena = env.pool, env.arena
    wait_up(env)
    arena[:16] = np.random.default_rng(11).integers(0, 256, (16, 4096), dtype=np.uint8)
    keys = [_key(i, b"held") for i in range(16)]
    assert run(pool, "store", 0, keys, list(range(16))).outcomes == [Outcome.OK] * 16

    def load_with(stopped):
        """Load ``keys`` into rows 16.. (spread: 8 keys per worker) with ``stopped``
        SIGSTOPped; returns the pool job id and which keys went to ``stopped``."""
        arena[16:32] = 0
        stopped.send_signal(signal.SIGSTOP)
        jid = submit(pool, "load", 0, keys, list(range(16, 32)))
        w = pool._procs.index(stopped)
        mine = sorted(p for part in pool._dispatch.parts.values() if part.worker == w
                      for p in part.positions)
        assert 0 < len(mine) < 16, mine
        return jid, mine

    def check(r, mine, stopped):
        assert [i for i, o in enumerate(r.outcomes) if o != Outcome.OK] == mine, r.outcomes
        m = _HUNG.search(r.error)
        assert m and int(m.group(2)) == stopped.pid and "deadline" in r.error, r.error
        served = [i for i in range(16) if i not in mine]
        assert np.array_equal(arena[[16 + i for i in served]], arena[served])
        assert not arena[[16 + i for i in mine]].any()  # the stopped worker wrote nothing

    # 1. the load fails at once; the rows are held until the process is reaped
    stopped = env.procs()[0]
    try:
        jid, mine = load_with(stopped)
        deadline = time.monotonic() + timeout + 10
        got = []
        while not got:  # poll and take in one go: the kill's poll makes the result
            pool.poll()
            got = pool.take(0)
            assert time.monotonic() < deadline, "the load was not failed"
            time.sleep(0.005)
        [r] = got
        assert r.job_id == jid
        check(r, mine, stopped)
        assert stopped.returncode is None  # killed, not reaped: it may still write
        assert r.release is not None and not r.release.event.is_set()
        assert pool.rows_held() and pool.failed_parts_total == 1
        while not r.release.event.is_set():  # the next health check reaps it
            pool.poll()
            assert time.monotonic() < deadline, "the killed worker was never reaped"
            time.sleep(0.005)
        assert stopped.returncode == -signal.SIGKILL and not pool.rows_held()
        settle = time.monotonic() + 0.3
        while time.monotonic() < settle:  # nothing reported twice (its part failed once)
            pool.poll()
            assert pool.take(0) == []
            time.sleep(0.02)
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait(5)

    # 2. drain returns only once the killed process is gone and the release set
    wait_up(env, timeout_s=15)
    stopped = env.procs()[0]
    try:
        jid, mine = load_with(stopped)
        pool.drain(timeout + 10)
        assert stopped.returncode == -signal.SIGKILL and not pool.rows_held()
        [r] = pool.take(0)
        check(r, mine, stopped)
        assert r.release is None or r.release.event.is_set()
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait(5)
    assert pool.broken is None


# --- 10b. lanes: loads and probes at the engine's priority -----------------------------


def _nice_and_policy(pid: int) -> tuple[int, int]:
    """``pid``'s niceness as /proc/<pid>/stat shows it (field 19) and its scheduling policy."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields 3.. (the name may hold spaces)
    return int(fields[16]), os.sched_getscheduler(pid)


def _submit_where(pool: WorkerPool, op: str, keys: list[bytes], rows=None):
    """``pool.submit`` (the rings have room); returns the pool job id and, per worker that
    got a part of it, the key positions it got."""
    before = set(pool._dispatch.parts)
    jid = pool.submit(op, 0, keys, rows)
    assert jid is not None
    where: dict[int, list[int]] = {}
    for part_id in set(pool._dispatch.parts) - before:
        part = pool._dispatch.parts[part_id]
        where.setdefault(part.worker, []).extend(part.positions)
    return jid, where


def _jobs_run(pool: WorkerPool) -> list[int]:
    """Job parts each worker slot has run and answered (its counters in the segment)."""
    return [pool.rings.worker(w).counters().jobs for w in range(pool.n)]


def test_loads_and_probes_run_in_the_promotion_lane_stores_and_deletes_in_the_background(pools):
    """3 workers, the last one the promotion lane: it runs at the scheduler's niceness
    under SCHED_OTHER, the others at +10 under SCHED_BATCH. Loads and probes of unbound
    keys go to it, stores and deletes to the others (spread over both from 16 keys on);
    a key whose store is outstanding keeps its load on the store's worker (ordering)."""
    env = pools(num_workers=3, num_chunks=96, promotion_workers=1)
    pool, arena = env.pool, env.arena
    pids = wait_up(env)
    mine, _ = _nice_and_policy(os.getpid())
    assert [_nice_and_policy(pid) for pid in pids] == [
        (min(19, mine + 10), os.SCHED_BATCH)] * 2 + [(mine, os.SCHED_OTHER)]

    rng = np.random.default_rng(29)
    arena[:] = rng.integers(0, 256, arena.shape, dtype=np.uint8)
    keys = [_key(i, b"lane") for i in range(32)]
    few, where_few = _submit_where(pool, "store", keys[:8], list(range(8)))
    many, where_many = _submit_where(pool, "store", keys[8:], list(range(8, 32)))
    assert len(where_few) == 1 and set(where_few) <= {0, 1}, where_few
    assert set(where_many) == {0, 1}, where_many
    got = collect(pool, [few, many])
    assert all(r.outcomes == [Outcome.OK] * len(r.keys) for r in got.values())
    ran = _jobs_run(pool)
    assert ran[2] == 0 and ran[0] > 0 and ran[1] > 0, ran

    probe, where = _submit_where(pool, "probe", keys)
    assert set(where) == {2}, where
    load, where = _submit_where(pool, "load", keys, list(range(32, 64)))
    assert set(where) == {2}, where
    got = collect(pool, [probe, load])
    assert got[probe].outcomes == [Outcome.OK] * 32
    assert got[load].outcomes == [Outcome.OK] * 32, got[load].error
    assert np.array_equal(arena[32:64], arena[:32])
    after = _jobs_run(pool)
    assert after[:2] == ran[:2] and after[2] >= 2, (ran, after)  # run by the promotion worker

    # ordering: the load of keys whose store is outstanding follows the store
    fresh = [_key(i, b"bound") for i in range(8)]
    store, where_store = _submit_where(pool, "store", fresh, list(range(64, 72)))
    [w] = where_store
    assert w in (0, 1)
    load, where = _submit_where(pool, "load", fresh + keys[:4], list(range(72, 84)))  # no poll
    assert where == {w: list(range(8)), 2: [8, 9, 10, 11]}, where
    got = collect(pool, [store, load])
    assert got[store].outcomes == [Outcome.OK] * 8
    assert got[load].outcomes == [Outcome.OK] * 12, got[load].error
    assert np.array_equal(arena[72:80], arena[64:72]) and np.array_equal(arena[80:84], arena[:4])

    delete, where = _submit_where(pool, "delete", keys + fresh)
    assert set(where) == {0, 1}, where
    assert collect(pool, [delete])[delete].outcomes == [Outcome.OK] * 40
    assert _kv_files(env.root) == []
    assert pool.restarts_total == 0 and pool.failed_parts_total == 0


def test_while_the_promotion_worker_is_down_loads_go_to_the_background_lane(pools):
    """The promotion worker SIGKILLed: once the pool has seen it gone, loads and probes
    run on the background workers (nothing fails for want of a lane); the pool restarts
    it, at the scheduler's priority again, and loads go back to it."""
    env = pools(num_workers=3, num_chunks=64, promotion_workers=1)
    pool, arena = env.pool, env.arena
    pids = wait_up(env)
    mine, _ = _nice_and_policy(os.getpid())
    arena[:] = np.random.default_rng(30).integers(0, 256, arena.shape, dtype=np.uint8)
    keys = [_key(i, b"down") for i in range(8)]
    assert run(pool, "store", 0, keys, list(range(8))).outcomes == [Outcome.OK] * 8

    victim = pool._procs[2]
    victim.kill()
    deadline = time.monotonic() + 10
    while pool.worker_states()[2] in RUNNING:  # until a health check has seen it gone
        pool.poll()
        assert time.monotonic() < deadline, "the killed promotion worker was not noticed"
        time.sleep(0.005)
    load, where_load = _submit_where(pool, "load", keys, list(range(16, 24)))  # no poll between
    probe, where_probe = _submit_where(pool, "probe", keys)
    assert set(where_load) <= {0, 1} and set(where_probe) <= {0, 1}, (where_load, where_probe)
    got = collect(pool, [load, probe])
    assert got[load].outcomes == [Outcome.OK] * 8, got[load].error
    assert got[probe].outcomes == [Outcome.OK] * 8
    assert np.array_equal(arena[16:24], arena[:8])

    again = wait_up(env)
    assert again[:2] == pids[:2] and again[2] != pids[2] and pool.restarts_total == 1
    assert _nice_and_policy(again[2]) == (mine, os.SCHED_OTHER)
    arena[16:24] = 0
    load, where = _submit_where(pool, "load", keys, list(range(16, 24)))
    assert set(where) == {2}, where
    assert collect(pool, [load])[load].outcomes == [Outcome.OK] * 8
    assert np.array_equal(arena[16:24], arena[:8])
    assert pool.failed_parts_total == 0


def test_a_lane_without_a_running_worker_lends_the_other_lanes_workers():
    """Dispatch alone (bookkeeping, no process): unbound keys choose a lane by op; a
    lane with no running worker falls back to the other's; with none running, each op
    waits in its own lane's rings; without a promotion lane every op goes everywhere."""
    keys = [_key(i, b"fallback") for i in range(4)]

    def workers(d: Dispatch, op: str) -> set[int]:
        rows = list(range(4)) if op in ("store", "load") else None
        _, planned = d.plan(op, 0, keys, rows, None)
        return {w for w, *_ in planned}

    d = Dispatch(3, 8 << 10, 60.0, promotion_workers=1)
    assert workers(d, "load") == workers(d, "probe") == {2}
    assert workers(d, "store") | workers(d, "delete") | workers(d, "scan") <= {0, 1}
    d.set_running([0, 1])  # the promotion worker is down
    assert workers(d, "load") <= {0, 1} and workers(d, "probe") <= {0, 1}
    d.set_running([2])  # both background workers are down
    assert workers(d, "store") == workers(d, "delete") == {2}
    assert workers(d, "load") == {2}
    d.set_running([])  # none runs: each op waits for its own lane
    assert workers(d, "load") == {2} and workers(d, "store") <= {0, 1}
    d0 = Dispatch(2, 8 << 10, 60.0)
    assert d0.takers("load") == d0.takers("store") == [0, 1]


# --- 11. a pool whose workers cannot start ------------------------------------------------


def _not_a_directory(tmp_path) -> str:
    """An fs root no tier worker can start on: a regular file. (A root that is gone, or a
    full disk, is an outage a worker starts through and waits out: test_fs_resume.py.)"""
    path = tmp_path / "a-file"
    path.write_bytes(b"not a directory")
    return str(path)


def test_workers_that_cannot_start_break_the_pool_once(pools, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shmtier.scheduler.pool")
    t0 = time.monotonic()
    env = pools(num_workers=2, num_chunks=16, fs_root=_not_a_directory(tmp_path))
    pool = env.pool
    early = pool.submit("probe", 0, [_key(1, b"early")])
    assert early is not None  # accepted while the pool is not broken yet
    while pool.broken is None:
        assert time.monotonic() - t0 < 10, (pool.worker_states(), pool.start_failures_total)
        pool.poll()
        time.sleep(0.01)
    broke_after = time.monotonic() - t0
    assert "exit code 4" in pool.broken and "root_dir is not a directory" in pool.broken, pool.broken
    assert "failed to start 3 times" in pool.broken

    # every outstanding job fails at once (within a health check or two), exactly once
    got = collect(pool, [early], timeout_s=2)
    assert got[early].outcomes == [Outcome.ERROR]
    deadline = time.monotonic() + 5
    while pool.worker_states() != [WorkerState.BROKEN] * 2:
        assert time.monotonic() < deadline, pool.worker_states()
        pool.poll()
        time.sleep(0.01)
    assert pool.restarts_total <= 2 * (pool.max_start_failures - 1)

    # submit refuses at once, without side effects; submit and poll stay fast
    submit_s, poll_s = [], []
    for i in range(2000):
        t = time.perf_counter()
        assert pool.submit("store", 0, [_key(i, b"late")], [i % 16]) is None
        submit_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.poll()
        poll_s.append(time.perf_counter() - t)
    assert pool.outstanding() == 0 and pool.queued_jobs() == 0 and pool.take(0) == []
    assert np.median(submit_s) < 20e-6, np.median(submit_s)
    assert np.median(poll_s) < 100e-6, np.median(poll_s)
    assert pool.broken is not None and pool.worker_states() == [WorkerState.BROKEN] * 2
    assert worker_processes(env.engine_id) == []  # nothing restarted any more

    errors = [r for r in caplog.records
              if r.name.startswith("shmtier.scheduler.pool") and r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "broken" in errors[0].getMessage() and "root_dir" in errors[0].getMessage()
    print(f"\npool broken after {broke_after:.2f} s; submit median "
          f"{np.median(submit_s) * 1e6:.2f} µs, poll median {np.median(poll_s) * 1e6:.2f} µs")

    env.close()
    assert _our_shm_entries(env.engine_id) == []
    assert worker_processes(env.engine_id) == []


def test_external_jobs_fail_by_their_deadline_when_no_worker_runs(pools):
    env = pools(num_workers=1, num_chunks=16, mode="external", job_timeout_s=0.5)
    pool = env.pool
    t0 = time.monotonic()
    jid = submit(pool, "probe", 0, [_key(1, b"nobody")])
    r = collect(pool, [jid], timeout_s=5)[jid]
    assert 0.5 <= time.monotonic() - t0 <= 2.5
    assert r.outcomes == [Outcome.ERROR] and "shmtier workers" in r.error, r.error
    assert pool.timed_out_total == 1 and pool.broken is None
    assert pool.worker_states() == [WorkerState.STARTING]  # still waiting for a worker


def test_external_workers_that_cannot_start_break_the_pool(pools, tmp_path, caplog):
    """External mode: the pool judges `shmtier workers`' processes by their claims and
    heartbeats; workers that claim the slot and exit before they beat again are start
    failures, and three of them break the pool."""
    caplog.set_level(logging.INFO, logger="shmtier.scheduler.pool")
    env = pools(num_workers=1, num_chunks=16, mode="external",
                fs_root=_not_a_directory(tmp_path))
    pool = env.pool
    ext = _start_cli("workers", "--engine-id", env.engine_id)
    try:
        t0 = time.monotonic()
        while pool.broken is None:
            assert time.monotonic() - t0 < 15, (pool.worker_states(), pool.start_failures_total)
            pool.poll()
            time.sleep(0.01)
        print(f"\nexternal pool broken after {time.monotonic() - t0:.2f} s: {pool.broken}")
        assert "failed to start 3 times" in pool.broken, pool.broken
        assert pool.submit("probe", 0, [_key(1, b"ext-broken")]) is None
        errors = [r for r in caplog.records
                  if r.name.startswith("shmtier.scheduler.pool") and r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
    finally:
        ext.terminate()
        if _finish(ext, 15)[0] is None:
            pytest.fail("`shmtier workers` did not stop on SIGTERM")


def test_the_worker_state_machine_allows_only_its_transitions():
    from shmtier.scheduler.pool.worker_state import TransitionError, WorkerRecord

    rec = WorkerRecord(0)
    rec.spawned(100, now=0.0)
    assert rec.state is WorkerState.STARTING
    with pytest.raises(TransitionError):
        rec.restart_after_backoff(0.0)  # a running worker is not restarted
    rec.beat_seen(1, now=0.1)
    assert rec.state is WorkerState.STARTING  # its claim's beat
    rec.beat_seen(2, now=0.2)
    assert rec.state is WorkerState.HEALTHY
    rec.killed("hung (test)")
    with pytest.raises(TransitionError):
        rec.killed("again")
    rec.gone("died", now=1.0, start_failure=False, failed_parts=0)
    assert rec.state is WorkerState.DEAD and rec.failures_within(30, 1.0) == 0
    # two start failures, then healthy: the count starts over
    for t in (2.0, 3.0):
        rec.restart_after_backoff(t)
        rec.spawned(100 + int(t), now=t)
        rec.gone("died (exit code 4)", now=t + 0.5, start_failure=True, failed_parts=0)
    assert rec.failures_within(30, 4.0) == 2
    rec.restart_after_backoff(4.0)
    rec.spawned(200, now=4.0)
    rec.beat_seen(10, now=4.1)
    rec.beat_seen(11, now=4.2)
    assert rec.failures_within(30, 4.2) == 0
    rec.gone("died", now=5.0, start_failure=False, failed_parts=0)
    rec.broke()
    assert rec.state is WorkerState.BROKEN
    with pytest.raises(TransitionError):
        rec.restart_after_backoff(6.0)
    assert WorkerRecord(1, start_failures=[0.0, 1.0, 40.0]).failures_within(30, 45.0) == 1


def test_loads_overtake_queued_stores_but_not_a_store_of_the_same_key():
    from shmtier.shared import jobs
    from shmtier.workers.job_loop import decode_all, loads_first

    batch = [jobs.pack_job(1, "store", 0, [b"a" * 36], [0]),
             jobs.pack_job(2, "load", 0, [b"b" * 36], [1]),
             b"\xc1garbage",
             jobs.pack_job(3, "load", 0, [b"a" * 36], [2]),
             jobs.pack_job(4, "delete", 0, [b"c" * 36]),
             jobs.pack_job(5, "load", 0, [b"d" * 36], [3])]
    loads, rest = loads_first(decode_all(batch))
    order = [j.job_id if isinstance(j, jobs.Job) else "bad" for j in loads + rest]
    assert order == [2, 5, 1, "bad", 3, 4]
    # keys held by jobs already queued or running keep their loads behind too
    loads, rest = loads_first(decode_all(batch[1:2] + batch[5:]), {b"d" * 36})
    assert [j.job_id for j in loads] == [2] and [j.job_id for j in rest] == [5]


def test_a_store_backlog_lets_new_loads_through_and_goes_raw_while_behind(tmp_path,
                                                                         monkeypatch,
                                                                         idle_host):
    """Between the slices of a long store, loads that reached the ring run first and
    are answered before the store; while the store work held exceeds _HURRY_BYTES,
    codec mode "auto" writes raw frames (read back byte-exact), then compressed again
    (on a host with CPU to spare: ``idle_host`` pins the host's load idle, since on a
    busy host compression by cost may rightly stay off; tests/test_codec_choice.py)."""
    from shmtier.shared import jobs
    from shmtier.shared.codec import parse_frame_header
    from shmtier.workers import job_loop

    monkeypatch.setattr(job_loop, "_ANSWER_EVERY_S", 0.0)  # a long store: every slice
    from shmtier.tiers.fs.backend import FsBackend

    chunk = 1 << 20
    rows = 40
    rng = np.random.default_rng(3)
    arena = (rng.standard_normal((rows, chunk // 2), dtype=np.float32).view(np.uint32) >> 16)
    arena = arena.astype("<u2").view(np.uint8).reshape(rows, chunk)
    backend = FsBackend(str(tmp_path), "hurry-fp", min_free_bytes=0)
    keys = [_key(i, b"hurry") for i in range(rows)]
    ring = [[jobs.pack_job(99, "load", 0, [keys[0]], [rows - 1])]]  # arrives mid-store
    answered = []
    runner = job_loop.JobRunner([backend], arena, chunk, 8 << 10,
                                take_new=lambda: ring.pop() if ring else [],
                                answer=answered.append)
    # key 0 on disk, for the load, by another backend: this one's chooser starts unmeasured
    # (with a first write measured, rule 4 may rightly pick compression while behind where
    # this VM's page-cache writes are slow; tests/test_codec_choice.py covers that rule)
    FsBackend(str(tmp_path), "hurry-fp", min_free_bytes=0).store(keys[:1], [0], arena, chunk)
    store = jobs.decode_job(jobs.pack_job(1, "store", 0, keys[1:rows - 1], list(range(1, rows - 1))))
    assert runner.admit([store]) == []
    runner.run_queue()
    assert answered[0].job_id == 99 and {r.job_id for r in answered[1:]} == {1}
    assert answered[0].outcomes == [Outcome.OK] and np.array_equal(arena[rows - 1], arena[0])
    # the store is answered slice by slice (2 MiB: two keys), the last piece more=False
    assert [r.more for r in answered[1:]] == [True] * ((rows - 2) // 2 - 1) + [False]
    assert [o for r in answered[1:] for o in r.outcomes] == [Outcome.OK] * (rows - 2)
    codecs = []
    for i in range(1, rows - 1):
        path = next(tmp_path.rglob(keys[i].hex() + "*"))
        codecs.append(parse_frame_header(memoryview(path.read_bytes())).codec)
    behind = (rows - 2) * chunk > job_loop._HURRY_BYTES
    assert behind and codecs[0] == "raw" and codecs[-1] == "split_zstd"
    assert backend.counters.stores_raw_hurried == codecs.count("raw")
    out = np.zeros((rows - 2, chunk), dtype=np.uint8)
    assert backend.load(keys[1:rows - 1], list(range(rows - 2)), out, chunk).outcomes == [
        Outcome.OK] * (rows - 2)
    assert np.array_equal(out, arena[1:rows - 1])


def test_a_store_slice_holds_as_many_chunks_as_the_backend_writes_in_parallel(tmp_path,
                                                                              monkeypatch):
    """The job loop hands a backend at least its ``writes_in_flight`` store keys per slice:
    1 MiB chunks are stored two per 2 MiB slice buffered, four per slice with O_DIRECT
    writes 4 in flight; each slice is answered (every answer is let through here) and the
    bytes load back exactly."""
    from shmtier.shared import jobs
    from shmtier.tiers.fs import fileio
    from shmtier.tiers.fs.backend import FsBackend
    from shmtier.workers import job_loop

    if not fileio.probe_direct_io(str(tmp_path)):
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    monkeypatch.setattr(job_loop, "_ANSWER_EVERY_S", 0.0)
    chunk, rows = 1 << 20, 8
    arena = np.random.default_rng(4).integers(0, 256, (rows, chunk), dtype=np.uint8)
    for io, per_slice in ((False, 2), ("writes", 4)):
        root = tmp_path / str(io)
        root.mkdir()
        backend = FsBackend(str(root), "slices", min_free_bytes=0, direct_io=io,
                            write_depth=4, codec_config=None)
        keys = [_key(i, str(io).encode()) for i in range(rows)]
        answered = []
        runner = job_loop.JobRunner([backend], arena, chunk, 8 << 10, take_new=lambda: [],
                                    answer=answered.append)
        store = jobs.decode_job(jobs.pack_job(1, "store", 0, keys, list(range(rows))))
        assert runner.admit([store]) == []
        runner.run_queue()
        assert [len(r.outcomes) for r in answered] == [per_slice] * (rows // per_slice), io
        assert [o for r in answered for o in r.outcomes] == [Outcome.OK] * rows
        out = np.zeros_like(arena)
        assert backend.load(keys, list(range(rows)), out, chunk).all_ok
        assert np.array_equal(out, arena)
        backend.close()


def test_a_stop_request_ends_the_job_queue_after_the_job_in_hand(tmp_path):
    """SIGTERM sets the worker's stop flag: the job in hand finishes and is answered, the
    rest stay queued and unanswered (the pool fails them exactly once, as for a dead
    worker)."""
    from shmtier.shared import jobs
    from shmtier.workers import job_loop
    from shmtier.tiers.fs.backend import FsBackend

    backend = FsBackend(str(tmp_path), "stop-fp", min_free_bytes=0)
    answered, stop = [], []
    runner = job_loop.JobRunner(
        [backend], np.zeros((1, 4096), dtype=np.uint8), 4096, 8 << 10,
        answer=lambda result: (answered.append(result), stop.append(True)),
        stop_requested=lambda: bool(stop))
    queued = [jobs.decode_job(jobs.pack_job(i, "delete", 0, [_key(i)])) for i in range(1, 4)]
    assert runner.admit(queued) == []
    runner.run_queue()
    assert [r.job_id for r in answered] == [1]
    assert [j.job_id for j in runner.queue] == [2, 3]


def _store_fails_at_call(n: int) -> type:
    """An fs backend whose ``n``-th store call (one slice of a job) raises."""
    from shmtier.tiers.fs.backend import FsBackend

    class Fails(FsBackend):
        HANDLERS = {**FsBackend.HANDLERS, "store": "flaky_store"}
        calls = 0

        def flaky_store(self, keys, *args, **kwargs):
            Fails.calls += 1
            if Fails.calls == n:
                raise OSError("medium gone")
            return self.store(keys, *args, **kwargs)

    return Fails


def test_stores_and_deletes_are_answered_slice_by_slice_and_a_failure_fails_only_the_rest(
        tmp_path, monkeypatch):
    """A long store is answered after each slice (more=True but the last; here every
    slice, as if each took longer than the answer interval), so the pool keeps what a
    worker answered if it dies mid-job; a backend that raises in the third slice fails
    only the keys not answered yet. Loads are answered once, at the end."""
    from shmtier.scheduler.pool.dispatch import Dispatch
    from shmtier.workers import job_loop

    monkeypatch.setattr(job_loop, "_ANSWER_EVERY_S", 0.0)


    chunk = 4096
    arena = np.random.default_rng(1).integers(0, 255, (24, chunk), dtype=np.uint8)
    backend = _store_fails_at_call(3)(str(tmp_path), "slices-fp", min_free_bytes=0)
    keys = [_key(i, b"slices") for i in range(24)]
    answered = []
    runner = job_loop.JobRunner([backend], arena, chunk, 8 << 10, answer=answered.append)
    dispatch = Dispatch(1, (8 << 10) - 8, 60.0)
    pool_id, planned = dispatch.plan("store", 0, keys, list(range(24)), None)
    dispatch.commit(pool_id, "store", 0, keys, planned, 0.0)
    runner.run_and_answer(jobs.decode_job(planned[0][2]))
    assert [(len(r.outcomes), r.more) for r in answered] == [(8, True), (8, True), (8, False)]
    for result in answered:
        dispatch.complete(jobs.decode_result(jobs.encode_result(result)))
    (res,) = dispatch.take(0)
    assert res.outcomes == [Outcome.OK] * 16 + [Outcome.ERROR] * 8
    assert "OSError: medium gone" in res.error
    assert len(list(tmp_path.rglob("*.kv"))) == 16
    answered.clear()
    runner.run_and_answer(jobs.decode_job(jobs.pack_job(7, "delete", 0, keys)))
    assert [(r.outcomes, r.more) for r in answered] == [
        ([Outcome.OK] * 8, True), ([Outcome.OK] * 8, True), ([Outcome.MISS] * 8, False)]
    answered.clear()
    runner.run_and_answer(jobs.decode_job(jobs.pack_job(8, "load", 0, keys[:16],
                                                        list(range(16)))))
    assert [(r.outcomes, r.more) for r in answered] == [([Outcome.MISS] * 16, False)]


def test_a_store_refused_for_the_free_space_floor_reports_the_free_bytes(tmp_path):
    """The job loop completes a "min_free" refusal with the free bytes the worker sees,
    in the result's error text, where the scheduler half finds them."""
    from shmtier.tiers.fs.backend import FsBackend
    from shmtier.workers import job_loop

    backend = FsBackend(str(tmp_path), "floor-fp", min_free_bytes=1 << 62)
    runner = job_loop.JobRunner([backend], np.zeros((2, 4096), dtype=np.uint8), 4096, 8 << 10)
    (res,) = runner.run(jobs.decode_job(jobs.pack_job(1, "store", 0, [_key(1), _key(2)], [0, 1])))
    assert res.outcomes == [Outcome.REJECTED] * 2
    free = os.statvfs(tmp_path)
    assert re.fullmatch(r"2 REJECTED \(min_free: \d+ bytes free\)", res.error), res.error
    seen = jobs.free_bytes_in(res.error)
    assert abs(seen - free.f_bavail * free.f_frsize) < 1 << 30
    assert jobs.free_bytes_in("x; 1 REJECTED (min_free: 5 bytes free); min_free: 3 bytes free") == 3
    assert jobs.free_bytes_in("2 REJECTED (max_bytes)") is None


def test_the_job_loop_dispatches_through_the_backends_handler_table(tmp_path):
    """An op runs the method the backend's HANDLERS table names; an op the table leaves
    out is answered with an error result naming it (the worker goes on); a table naming
    an unknown op or a missing method fails when the class is defined."""
    from shmtier.tiers.backend import UnsupportedOp
    from shmtier.tiers.fs.backend import FsBackend
    from shmtier.workers import job_loop

    class NoProbe(FsBackend):
        HANDLERS = {op: name for op, name in FsBackend.HANDLERS.items() if op != "probe"}

    backend = NoProbe(str(tmp_path), "handlers-fp", min_free_bytes=0)
    runner = job_loop.JobRunner([backend], np.zeros((1, 4096), dtype=np.uint8), 4096, 8 << 10)
    (probe,) = runner.run(jobs.decode_job(jobs.pack_job(1, "probe", 0, [_key(1), _key(2)])))
    assert probe.outcomes == [Outcome.ERROR] * 2
    assert "NoProbe backend does not handle op 'probe'" in probe.error
    (delete,) = runner.run(jobs.decode_job(jobs.pack_job(2, "delete", 0, [_key(1)])))
    assert delete.outcomes == [Outcome.MISS] and delete.error == ""
    assert backend.handler("store") == backend.store
    with pytest.raises(UnsupportedOp, match="does not handle op 'stop'"):
        backend.handler("stop")
    with pytest.raises(TypeError, match="'copy' is not a backend op"):
        type("Bad", (FsBackend,), {"HANDLERS": {"copy": "store"}})
    with pytest.raises(TypeError, match="op 'store' names 'nope'"):
        type("Bad", (FsBackend,), {"HANDLERS": {"store": "nope"}})


def test_a_result_larger_than_a_ring_slot_is_split_and_merged_key_by_key(tmp_path):
    """Per-key figures take 13 bytes a key: a probe of 1000 two-byte keys fits one job
    slot, its answer does not. The worker splits it; the pool puts every key's outcome
    and stored size back at its position."""
    from shmtier.scheduler.pool.dispatch import Dispatch
    from shmtier.tiers.fs.backend import FsBackend
    from shmtier.workers import job_loop

    slot = 8 << 10
    backend = FsBackend(str(tmp_path), "split-fp", min_free_bytes=0)
    arena = np.arange(4096, dtype=np.uint32).astype(np.uint8).reshape(1, 4096)
    keys = [i.to_bytes(2, "big") for i in range(1000)]
    stored = backend.store(keys[::3], [0] * len(keys[::3]), arena, 4096)
    assert stored.all_ok
    size = dict(zip(keys[::3], stored.stored_bytes))
    runner = job_loop.JobRunner([backend], arena, 4096, slot)
    dispatch = Dispatch(1, slot - 8, 60.0)
    pool_id, planned = dispatch.plan("probe", 0, keys, None, None)
    assert len(planned) == 1  # one job part
    dispatch.commit(pool_id, "probe", 0, keys, planned, 0.0)
    parts = runner.run(jobs.decode_job(planned[0][2]))
    assert len(parts) >= 2 and [p.more for p in parts][-1] is False
    for part in parts:
        raw = jobs.encode_result(part)
        assert len(raw) <= slot - 8
        dispatch.complete(jobs.decode_result(raw))
    (res,) = dispatch.take(0)
    assert res.job_id == pool_id and res.error == ""
    assert res.outcomes == [Outcome.OK if k in size else Outcome.MISS for k in keys]
    assert res.stored_bytes == [size.get(k, 0) for k in keys]
    assert all(t >= 0 for t in res.seconds) and res.logical_bytes == [0] * 1000


def test_result_flags_travel_from_the_backend_to_the_pool_job(tmp_path):
    """What a backend raises (``take_flags``) goes with the result of the job it just ran,
    once, on the first part of a split result; the pool ORs the flags of a job's parts."""
    from shmtier.scheduler.pool.dispatch import Dispatch
    from shmtier.tiers.fs.backend import FsBackend
    from shmtier.workers import job_loop

    class Flagging(FsBackend):
        raised = 0

        def take_flags(self):
            flags, self.raised = self.raised, 0
            return flags

    slot = 8 << 10
    backend = Flagging(str(tmp_path), "flags-fp", min_free_bytes=0)
    runner = job_loop.JobRunner([backend], np.zeros((1, 4096), dtype=np.uint8), 4096, slot)
    dispatch = Dispatch(2, slot - 8, 60.0)
    keys = [i.to_bytes(2, "big") for i in range(2000)]  # 1000 a worker: answers split
    pool_id, planned = dispatch.plan("probe", 0, keys, None, None)
    assert len(planned) == 2
    dispatch.commit(pool_id, "probe", 0, keys, planned, 0.0)
    for n, (_, _, payload, _, _) in enumerate(planned):
        backend.raised = jobs.ResultFlag.NAMESPACE_RESET if n == 1 else 0
        parts = runner.run(jobs.decode_job(payload))
        assert len(parts) >= 2  # split: the flags ride on the first part only
        first = jobs.ResultFlag.NAMESPACE_RESET if n == 1 else 0
        assert [p.flags for p in parts] == [first] + [0] * (len(parts) - 1)
        for part in parts:
            dispatch.complete(jobs.decode_result(jobs.encode_result(part)))
    (res,) = dispatch.take(0)
    assert res.flags == jobs.ResultFlag.NAMESPACE_RESET
    assert res.outcomes == [Outcome.MISS] * 2000
    (again,) = runner.run(jobs.decode_job(jobs.pack_job(9, "probe", 0, keys[:1])))
    assert again.flags == 0  # taken once


def test_the_pool_merges_per_key_figures_at_each_keys_position():
    """Keys bound to the worker of an outstanding job go to it, the rest elsewhere: a
    pool job's parts then hold scattered positions. Each key's outcome, bytes and
    seconds land at its own position; a part's worker that dies mid-answer fails only
    the keys it did not answer."""
    from shmtier.scheduler.pool.dispatch import Dispatch

    d = Dispatch(2, 8 << 10, 60.0)
    first = [_key(i, b"a") for i in range(20)]
    pid, planned = d.plan("store", 0, first, list(range(20)), None)
    d.commit(pid, "store", 0, first, planned, 0.0)
    bound = {k: w for w, _, _, part_keys, _ in planned for k in part_keys}
    keys = [_key(100, b"b"), first[15], _key(101, b"b"), first[3], first[16], _key(102, b"b")]
    pid2, planned2 = d.plan("load", 0, keys, list(range(6)), None)
    d.commit(pid2, "load", 0, keys, planned2, 1.0)
    assert any(list(positions) != list(range(positions[0], positions[0] + len(positions)))
               for *_, positions in planned2)  # scattered positions
    assert all(type(positions) is range for *_, positions in planned)  # nothing was bound
    for k in (first[15], first[3], first[16]):  # bound keys stayed with their worker
        assert any(k in pk and w == bound[k] for w, _, _, pk, _ in planned2)
    for w, part_id, _, part_keys, positions in planned2:
        n = len(part_keys)
        answered = n - 1 if n > 1 else n  # the last key of a longer part: never answered
        per_key = [(keys.index(k) + 1) for k in part_keys[:answered]]
        d.complete(jobs.Result(part_id, [Outcome.OK] * answered, [100 * p for p in per_key],
                               [10 * p for p in per_key], [p / 4 for p in per_key], more=True))
        d.complete(jobs.Result(part_id, error="worker gone"))  # the rest of the part fails
    done = {r.job_id: r for r in d.take(0)}
    res = done[pid2]
    unanswered = {part_keys[-1] for *_, part_keys, _ in planned2 if len(part_keys) > 1}
    for pos, k in enumerate(keys):
        if k in unanswered:
            assert (res.outcomes[pos], res.stored_bytes[pos]) == (Outcome.ERROR, 0)
        else:
            assert res.outcomes[pos] is Outcome.OK
            assert (res.logical_bytes[pos], res.stored_bytes[pos], res.seconds[pos]) == (
                100 * (pos + 1), 10 * (pos + 1), (pos + 1) / 4)
    assert "answered" in res.error and pid not in done


def test_each_id_space_has_its_own_type():
    """Tier job ids (the manager's, vLLM's JobId), pool job ids (what submit returns)
    and wire ids (one part in a ring) are distinct NewTypes on the signatures."""
    import typing

    from shmtier.scheduler.pool import PoolJobId
    from shmtier.scheduler.pool.dispatch import Part, PoolResult
    from shmtier.scheduler.tiering.base import JobId, JobResult, TransferJob
    from shmtier.shared.jobs import WireJobId

    hints = typing.get_type_hints
    assert typing.get_args(hints(WorkerPool.submit)["return"]) == (PoolJobId, type(None))
    assert hints(PoolResult)["job_id"] is PoolJobId and hints(Part)["parent"] is PoolJobId
    assert hints(jobs.Job)["job_id"] is WireJobId and hints(jobs.Result)["job_id"] is WireJobId
    assert hints(jobs.pack_job)["job_id"] is WireJobId
    assert hints(JobResult)["job_id"] is JobId and hints(TransferJob.__init__)["job_id"] is JobId
    assert len({JobId, PoolJobId, WireJobId}) == 3 and JobId(5) == PoolJobId(5) == 5


def test_a_store_that_ends_soon_is_answered_once_and_a_failure_keeps_the_keys_done(tmp_path):
    """Partial answers cost the scheduler a decode and a merge each: a store that ends
    within the answer interval is answered once. A backend that raises in the third
    slice still answers the two slices done (OK) and fails only the rest."""
    from shmtier.workers import job_loop


    chunk = 4096
    arena = np.random.default_rng(2).integers(0, 255, (24, chunk), dtype=np.uint8)
    backend = _store_fails_at_call(6)(str(tmp_path), "once-fp", min_free_bytes=0)
    answered = []
    runner = job_loop.JobRunner([backend], arena, chunk, 8 << 10, answer=answered.append)
    keys = [_key(i, b"once") for i in range(24)]
    runner.run_and_answer(jobs.decode_job(jobs.pack_job(1, "store", 0, keys, list(range(24)))))
    assert [(len(r.outcomes), r.more) for r in answered] == [(24, False)]
    assert answered[0].outcomes == [Outcome.OK] * 24
    answered.clear()
    other = [_key(i, b"once-b") for i in range(24)]
    runner.run_and_answer(jobs.decode_job(jobs.pack_job(2, "store", 0, other, list(range(24)))))
    assert [(r.outcomes, r.more) for r in answered] == [
        ([Outcome.OK] * 16, True), ([Outcome.ERROR] * 8, False)]
    assert "OSError: medium gone" in answered[1].error
