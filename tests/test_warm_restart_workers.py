"""A warm-restarted scheduler owns its tier worker slots alone.

A scheduler (a child process here, as in ``shmtier/stress/restart.py``) runs a real worker
pool with an fs tier under ``tmp_path`` and has a backlog of stores in its rings when it is
SIGKILLed; at once (well under the workers' 1 s owner check) this process opens the same
engine with ``warm_restart=True`` and starts its own pool. The dead scheduler's workers
must be gone (they leave on seeing the owner generation change, or the new pool kills
them), every slot must have exactly one live worker, the new pool's, and every job after
the restart must be answered once with byte-exact promotions. Real processes, segment,
semaphores and files; every process, segment and semaphore is removed also on failure.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
from shmtier.shared.procinfo import tier_worker_pids as worker_processes
from test_pool import _alive, _bf16_rows, _fs_tier, _key, _unlink_ours, collect, submit, wait_up

from shmtier.scheduler.pool import WorkerPool
from shmtier.shared import procinfo
from shmtier.shared.jobs import Outcome
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.pool_config import PoolConfig, WorkerPoolOptions, rings_len_for
from shmtier.shared.segment import open_segment

CTX = mp.get_context("spawn")
CHUNK = 64 << 10
ROWS = 64
BEFORE = 16  # chunks the first scheduler stores and sees answered before it dies
SEED = 7
FP = "fp-warm-owner"


def _config(root: str) -> PoolConfig:
    return PoolConfig(slots=64, slot_size=4096, chunk_bytes=CHUNK, heartbeat_interval_s=0.25,
                      tiers=(_fs_tier(root),), options=WorkerPoolOptions(num_tier_workers=2))


def _open(engine_id: str, root: str, *, warm_restart: bool = False):
    geometry = ArenaGeometry(num_chunks=ROWS, row_stride=CHUNK, page_size_per_worker=CHUNK,
                             world_size=1)
    return open_segment(engine_id, geometry, FP, owner=True, warm_restart=warm_restart,
                        rings_len=rings_len_for(_config(root)))


def _rows(n: int) -> np.ndarray:
    return _bf16_rows(np.random.default_rng(SEED), n, CHUNK)


def _first_scheduler(engine_id: str, root: str, stop_worker: bool, conn) -> None:
    """The scheduler that crashes: own the segment, run a pool, store BEFORE chunks and see
    them answered, then queue a backlog of stores (in flight at the kill), report the
    worker pids and wait to be killed. ``stop_worker``: SIGSTOP worker 1 first (a worker
    that cannot notice anything)."""
    seg = _open(engine_id, root)
    pool = WorkerPool(engine_id, seg, _config(root))
    wait_up(SimpleNamespace(pool=pool))
    arena = np.frombuffer(seg.arena, dtype=np.uint8).reshape(ROWS, CHUNK)
    arena[:BEFORE] = _rows(BEFORE)
    ids = [submit(pool, "store", 0, [_key(i, b"before")], [i]) for i in range(BEFORE)]
    results = collect(pool, ids)
    ok = all(r.outcomes == [Outcome.OK] for r in results.values())
    for j in range(48):  # ~48 x 4 x 64 KiB still to store when the scheduler dies
        submit(pool, "store", 0, [_key(1000 + 4 * j + k, b"backlog") for k in range(4)],
               [(4 * j + k) % BEFORE for k in range(4)])
    workers = [(p.pid, procinfo.start_time(p.pid)) for p in pool._procs]
    if stop_worker:
        os.kill(workers[1][0], signal.SIGSTOP)
    conn.send({"ok": ok, "workers": workers, "generation": seg.header().generation})
    time.sleep(120)  # killed by the test long before


class _Restart:
    """Run the first scheduler, kill it, re-attach at once; cleans up whatever happens."""

    def __init__(self, engine_id: str, root: str, stop_worker: bool = False):
        self.engine_id, self.root = engine_id, root
        self.old: list[tuple[int, int]] = []
        self.seg = self.pool = None
        parent, child_conn = CTX.Pipe()
        self.child = CTX.Process(target=_first_scheduler,
                                 args=(engine_id, root, stop_worker, child_conn))
        self.child.start()
        deadline = time.monotonic() + 60
        while not parent.poll(0.1):
            assert self.child.is_alive() and time.monotonic() < deadline, (
                "the first scheduler did not start its pool")
        self.info = parent.recv()
        self.old = self.info["workers"]

    def crash_and_reattach(self, *, with_pool: bool = True) -> float:
        """SIGKILL the first scheduler, then open the engine warm (and start a pool);
        returns the seconds from the kill to the segment re-attached."""
        os.kill(self.child.pid, signal.SIGKILL)
        killed = time.monotonic()
        self.child.join(10)
        self.seg = _open(self.engine_id, self.root, warm_restart=True)
        attached = time.monotonic() - killed
        if with_pool:
            self.pool = WorkerPool(self.engine_id, self.seg, _config(self.root))
        return attached

    def close(self) -> None:
        try:
            if self.child.is_alive():
                self.child.kill()
            self.child.join(10)
            for pid, start in self.old:
                if _alive(pid, start):
                    os.kill(pid, signal.SIGKILL)
            if self.pool is not None:
                self.pool.shutdown(2.0)
        finally:
            if self.seg is not None:
                self.seg.close()
            _unlink_ours(self.engine_id)  # the dead scheduler's semaphores when no pool ran


@pytest.fixture
def restart(engine_id, tmp_path):
    made: list[_Restart] = []

    def make(**kw) -> _Restart:
        r = _Restart(engine_id, str(tmp_path), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_old_workers_leave_when_the_owner_generation_changes(restart):
    """Worker side alone: no new pool; the new owner is alive, so only the generation
    tells the old workers they are orphans."""
    r = restart()
    assert r.info["ok"] and len(r.old) == 2
    attached_s = r.crash_and_reattach(with_pool=False)
    assert attached_s < 0.5, f"re-attached {attached_s:.2f} s after the kill: too late to test"
    assert not r.seg.is_creator
    assert r.seg.header().generation == r.info["generation"] + 1
    t0 = time.monotonic()
    while any(_alive(pid, start) for pid, start in r.old):
        assert time.monotonic() - t0 < 3.0, (
            "the dead scheduler's tier workers still run 3 s after a new owner re-attached")
        time.sleep(0.01)
    print(f"\nre-attached {attached_s * 1000:.0f} ms after the kill; old workers gone "
          f"{time.monotonic() - t0:.2f} s later")


def _assert_sole_holders(r: _Restart) -> list[int]:
    pool = r.pool
    assert not any(_alive(pid, start) for pid, start in r.old), "an old worker still runs"
    pids = wait_up(r)
    old_pids = {pid for pid, _ in r.old}
    for w, pid in enumerate(pids):
        beat = pool.rings.worker(w).last_beat()
        assert beat.pid == pid and pid not in old_pids, (w, beat, pids)
    assert sorted(worker_processes(r.engine_id)) == sorted(pids)
    return pids


def _round_trips(r: _Restart) -> None:
    """Byte-exact promotions of what the first scheduler stored, and of new stores; every
    job answered exactly once (``collect``)."""
    pool, expected = r.pool, _rows(BEFORE)
    arena = np.frombuffer(r.seg.arena, dtype=np.uint8).reshape(ROWS, CHUNK)
    assert np.array_equal(arena[:BEFORE], expected)  # the segment survived: rows kept
    arena[BEFORE:2 * BEFORE] = 0
    ids = [submit(pool, "load", 0, [_key(i, b"before")], [BEFORE + i]) for i in range(BEFORE)]
    got = collect(pool, ids)
    assert all(res.outcomes == [Outcome.OK] for res in got.values()), got
    assert np.array_equal(arena[BEFORE:2 * BEFORE], expected)

    fresh = _bf16_rows(np.random.default_rng(SEED + 1), BEFORE, CHUNK)
    arena[2 * BEFORE:3 * BEFORE] = fresh
    ids = [submit(pool, "store", 0, [_key(i, b"after")], [2 * BEFORE + i])
           for i in range(BEFORE)]
    assert all(res.outcomes == [Outcome.OK] for res in collect(pool, ids).values())
    arena[3 * BEFORE:4 * BEFORE] = 0
    ids = [submit(pool, "load", 0, [_key(i, b"after")], [3 * BEFORE + i]) for i in range(BEFORE)]
    assert all(res.outcomes == [Outcome.OK] for res in collect(pool, ids).values())
    assert np.array_equal(arena[3 * BEFORE:4 * BEFORE], fresh)
    c = [pool.rings.worker(w).counters() for w in range(pool.n)]
    assert sum(x.failed_keys for x in c) == 0 and sum(x.jobs for x in c) == 3 * BEFORE, c


def test_a_warm_restart_within_the_owner_check_gets_the_slots_alone(restart):
    r = restart()
    assert r.info["ok"]
    attached_s = r.crash_and_reattach()
    assert attached_s < 0.5, f"re-attached {attached_s:.2f} s after the kill: too late to test"
    _assert_sole_holders(r)
    _round_trips(r)
    # the old workers left by themselves (the generation), none had to be killed
    assert not any(h.killed for h in r.pool.old_holders), r.pool.old_holders
    assert {h.pid for h in r.pool.old_holders} <= {pid for pid, _ in r.old}
    print(f"\nre-attached {attached_s * 1000:.0f} ms after the kill; old holders "
          f"{[(h.slot, round(h.gone_after_s, 2)) for h in r.pool.old_holders]}")


def test_an_old_worker_that_does_not_leave_is_killed_before_the_new_pool_starts(restart):
    r = restart(stop_worker=True)  # worker 1 is SIGSTOPped: it never sees the generation
    assert r.info["ok"]
    t0 = time.monotonic()
    r.crash_and_reattach()
    took = time.monotonic() - t0
    _assert_sole_holders(r)
    _round_trips(r)
    by_slot = {h.slot: h for h in r.pool.old_holders}
    assert by_slot[1].killed and by_slot[1].pid == r.old[1][0], by_slot
    assert 0 not in by_slot or not by_slot[0].killed, by_slot
    assert 1.9 < took < 10, took  # the 2 s grace, then the kill
