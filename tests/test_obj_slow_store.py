"""Issue 28, defect 6: a tier worker waiting on a slow object store is busy, not hung.

An engine (scheduler, GPU rank, tier worker processes) with an ``obj`` tier on moto
(``s3_servers.py``), whose GETs are delayed past the pool's 2 s heartbeat timeout but
within ``read_timeout_s``: the promotion completes HIT with the right bytes and no
worker is killed. A worker that really stops (SIGSTOP) in the same wait is still killed
as hung at the heartbeat timeout, and a request slower than ``tier_job_timeout_s`` still
gets its worker killed at the part deadline.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from fs_engine import END, HIT, MISS, PENDING, RETRY, engines, key  # noqa: F401
import torch

from shmtier.contract import ReqContext

DELAY_S = 3.0  # > the pool's heartbeat timeout (2 s), < read_timeout_s


def _stored_then_evicted(e, n: int = 4) -> list[bytes]:
    """``n`` keys stored in the bucket and evicted from the engine's 8-row CPU tier."""
    keys = [key(i) for i in range(n)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle(timeout_s=30)
    e.offload([key(100 + i) for i in range(8)], 8, ReqContext("b"))  # evicts ``keys``
    e.settle(timeout_s=30)
    return keys


def _engine(engines, tmp_path, server, **options):
    return engines(tmp_path, chunks=8, workers=1, tier_type="obj",
                   store_config=server.store_config(server.new_bucket("slow")),
                   read_timeout_s=10.0, max_attempts=1, **options)


def _promote(e, keys, ctx, timeout_s):
    """Look ``keys`` up once per step until none is PENDING or RETRY; every answer seen."""
    deadline, seen = time.monotonic() + timeout_s, []
    while True:
        with e.manager.lock:
            answers = [e.manager.lookup(k, ctx) for k in keys]
            e.manager.on_schedule_end(END)
        seen.append(answers)
        if PENDING not in answers and RETRY not in answers:
            return seen
        assert time.monotonic() < deadline, seen[-3:]
        time.sleep(0.01)


def test_gets_slower_than_the_heartbeat_timeout_complete_and_kill_no_worker(
        engines, tmp_path, moto_faults, caplog):
    e = _engine(engines, tmp_path, moto_faults)
    keys = _stored_then_evicted(e)
    pool = e.spec.worker_pool
    assert pool.heartbeat_timeout_s < DELAY_S
    moto_faults.faults.slow(DELAY_S, methods={"GET"})
    ctx = ReqContext("r")
    t0 = time.monotonic()
    seen = _promote(e, keys, ctx, timeout_s=30)
    took = time.monotonic() - t0
    assert seen[-1] == [HIT] * 4, seen[-3:]
    assert all(MISS not in answers for answers in seen)
    assert took >= DELAY_S and moto_faults.faults.injected >= 1  # it was that slow
    assert pool.hung_total == 0 and pool.restarts_total == 0, caplog.text
    assert "hung" not in caplog.text
    moto_faults.faults.reset()
    got = e.load(keys, ctx, list(range(40, 44)))
    assert torch.equal(got, e.originals[0][:4])


def test_a_worker_stopped_in_a_slow_get_is_still_killed_as_hung(engines, tmp_path,
                                                                moto_faults, caplog):
    e = _engine(engines, tmp_path, moto_faults)
    keys = _stored_then_evicted(e)
    pool = e.spec.worker_pool
    moto_faults.faults.slow(DELAY_S, methods={"GET"})
    ctx = ReqContext("r")
    requests = moto_faults.faults.requests
    with e.manager.lock:
        assert {e.manager.lookup(k, ctx) for k in keys} <= {PENDING, RETRY}
        e.manager.on_schedule_end(END)
    deadline = time.monotonic() + 10
    while moto_faults.faults.requests == requests:  # the worker is in its GETs now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (pid,) = [p.pid for p in pool._procs]
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    caplog.set_level(logging.WARNING)
    seen = _promote(e, keys, ctx, timeout_s=30)
    took = time.monotonic() - stopped
    assert seen[-1] == [MISS] * 4  # its load failed: recomputed, never wrong bytes
    assert pool.hung_total == 1 and pool.timed_out_total == 0
    assert f"tier worker 0 (pid {pid}) hung (no heartbeat for" in caplog.text
    assert took < 2 * pool.heartbeat_timeout_s + 3, took  # not at the 60 s deadline


def test_a_get_slower_than_the_job_deadline_still_kills_its_worker(engines, tmp_path,
                                                                   moto_faults, caplog):
    e = _engine(engines, tmp_path, moto_faults, top={"tier_job_timeout_s": 4.0})
    keys = _stored_then_evicted(e)
    pool = e.spec.worker_pool
    moto_faults.faults.slow(8.0, methods={"GET"})
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    seen = _promote(e, keys, ReqContext("r"), timeout_s=30)
    assert seen[-1] == [MISS] * 4
    assert pool.timed_out_total == 1 and pool.hung_total == 1
    assert "past its 4 s deadline" in caplog.text
    assert time.monotonic() - t0 < 8.0
