"""A promotion from the fs tier whose tier worker is killed (SIGSTOPped, then SIGKILLed at
its job deadline) fails at once, but its primary rows stay held until the pool sees the
process gone (reaped): vLLM 0.34's deferred release, end to end through the real spec,
tier worker processes, segment and files (``shmtier/scheduler/pool/``,
``shmtier/storage/scheduler.py``, ``shmtier/scheduler/tiering/deferred_release.py``).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from fs_engine import END, MISS, PENDING, engines, key  # noqa: F401  (engines: a fixture)
from shmtier import metrics
from shmtier.contract import ReqContext
from shmtier.shared.chunk_table import NUM_ALLOCATED

LABEL = ("1:fs",)
JOB_TIMEOUT_S = 1.0


def free_rows(primary) -> set[int]:
    return set(primary._free_list) | set(range(primary._counters[NUM_ALLOCATED],
                                               primary._num_chunks))


@pytest.mark.timeout(120)
def test_a_promotion_whose_worker_is_killed_holds_its_rows_until_the_worker_is_reaped(
        engines, tmp_path):
    engine = engines(tmp_path, chunks=8, workers=1, probe_timeout_s=0.5,
                     top={"tier_job_timeout_s": JOB_TIMEOUT_S, "tier_poll_interval_s": 0})
    m, primary, pool = engine.manager, engine.manager.primary, engine.spec.worker_pool
    promoted = [key(i) for i in range(4)]
    writer = ReqContext("writer")
    with m.lock:
        m.on_new_request(writer)
    engine.offload(promoted, 0, writer)
    engine.settle()  # cascaded to the fs tier
    engine.offload([key(100 + i) for i in range(8)], 8, writer)  # evicts the first four
    engine.settle()
    with m.lock:
        assert [primary.lookup(k, writer) for k in promoted] == [MISS] * 4

    worker = pool._procs[0]
    worker.send_signal(signal.SIGSTOP)
    try:
        reader = ReqContext("reader")
        with m.lock:
            m.on_new_request(reader)
            assert [m.lookup(k, reader) for k in promoted] == [PENDING] * 4
            m.on_schedule_end(END)  # the load goes to the stopped worker
        held_rows = []
        deadline = time.monotonic() + JOB_TIMEOUT_S + 20
        while not primary.num_deferred_release_chunks:  # one step at a time
            with m.lock:
                m.on_schedule_end(END)
                held_rows = sorted(primary._deferred_rows)
            assert time.monotonic() < deadline, "the promotion was never failed"
            time.sleep(0.01)
        # failed at once: the keys are gone from the primary, their rows held while the
        # killed worker is not reaped (it could still write them)
        assert len(held_rows) == 4
        assert worker.returncode is None
        assert free_rows(primary).isdisjoint(held_rows)
        with m.lock:
            assert [primary.lookup(k, reader) for k in promoted] == [MISS] * 4
            data = m.get_stats().data["data"]
            assert m.has_pending_work()
        assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 4}
        assert data[metrics.PROMOTION_JOB_FAILURES] == {LABEL: 1}

        while primary.num_deferred_release_chunks:  # a later health check reaps it
            with m.lock:
                m.on_schedule_end(END)
            assert time.monotonic() < deadline, "the rows were never released"
            time.sleep(0.01)
        assert worker.returncode == -signal.SIGKILL
        assert set(held_rows) <= free_rows(primary)
        with m.lock:
            data = m.get_stats().data["data"]
            assert [m.lookup(k, reader) for k in promoted] == [MISS] * 4  # load failed: MISS
            m.on_request_finished(reader)
        assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}
        [hold_s] = data[metrics.DEFERRED_RELEASE_HOLD][LABEL]
        assert 0 < hold_s < 10
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(5)

    # no wrong bytes: the replacement promotes the same chunks intact, once it has probed
    # them (a failed load's chunks are probed: its worker may have removed a file it
    # found corrupt before it died) and probe_timeout_s has passed (the failed loads
    # answer MISS until then)
    engine.settle()
    time.sleep(0.5)
    again = ReqContext("again")
    with m.lock:
        m.on_new_request(again)
    engine.until_hit(promoted, again)
    got = engine.load(promoted, again, list(range(40, 44)))
    assert torch.equal(got, engine.originals[0][0:4])
    assert pool.restarts_total == 1
    engine.settle()
    assert primary.num_deferred_release_chunks == 0 and not pool.rows_held()
