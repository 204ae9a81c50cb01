"""Cascades past a tier's pinned-row cap wait instead of being dropped (bench/README.md,
issue 14): the real manager of the spec, its fs tier, tier worker processes and files.

The cap is ``max_pinned_fraction`` of the CPU tier's rows (16 rows here). A tier's jobs go
to its workers at ``on_schedule_end``; until a step runs, the rows of its cascades stay
pinned, which is what a tier that falls behind looks like to the manager.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from fs_engine import END, HIT, MISS, engines, key  # noqa: F401
from shmtier import metrics
from shmtier.contract import ReqContext
from shmtier.shared.procinfo import tier_worker_pids

FS = ("1:fs",)


def on_disk(root) -> set[bytes]:
    """The keys whose chunk files are under ``root``."""
    return {bytes.fromhex(p.name.split(".")[0][-72:]) for p in root.rglob("*.kv")}


def counters(e, totals: dict | None = None) -> dict:
    """This step's stats payload added into ``totals`` (counters summed, gauges kept)."""
    totals = {} if totals is None else totals
    with e.manager.lock:
        payload = e.manager.get_stats().data
    for name, series in payload["data"].items():
        value = series.get(FS, series.get((), None))
        if value is None or isinstance(value, list):
            continue
        if payload["types"][name] == metrics.COUNTER:
            totals[name] = totals.get(name, 0) + value
        else:
            totals[name] = value
    return totals


def test_key_file_names_are_what_on_disk_reads(engines, tmp_path):
    e = engines(tmp_path, chunks=4)
    e.offload([key(1), key(2)], 0, ReqContext("a"))
    e.settle()
    assert on_disk(tmp_path) == {key(1), key(2)}


def test_at_the_cap_keys_wait_unpinned_then_go_and_promote_byte_exact(engines, tmp_path):
    """Cap 4: a cascade of 4 pins 4 rows, the next request's keys are deferred (not
    pinned, not dropped; the request may finish meanwhile) and keep ``has_pending_work``
    true while nothing else is pending. Once the pinned rows complete, the next
    ``prepare_store`` submits them before its own eviction (which then takes other rows,
    although the deferred ones were the least recently used); evicted from the CPU tier
    later, they come back from the fs tier byte for byte."""
    # steps alone, no step-window rounds (which would take the cascades: this test
    # follows what each call of a step does)
    e = engines(tmp_path, chunks=16, max_pinned_fraction=0.25, top={"tier_poll_window": 0})
    e.settle()  # the tier's listing of its root has landed: it is idle
    m = e.manager
    keys = [key(i) for i in range(6)]
    e.offload(keys[0:4], 0, ReqContext("r0"))
    late = ReqContext("r1")
    e.offload(keys[4:6], 4, late)
    with m.lock:
        m.on_request_finished(late)  # its deferred keys still go
        assert [m.primary.is_evictable(k) for k in keys] == [False] * 4 + [True] * 2
        assert m.has_pending_work()
    seen = counters(e)
    assert seen[metrics.CASCADE_DEFERRED_CHUNKS] == 2
    assert metrics.BACKPRESSURE_BLOCKS_DROPPED not in seen
    poller = ReqContext("poller")
    with m.lock:
        m.on_schedule_end(END)  # the tier sends the first job; the cap is still full
    while True:  # a step's first lookup takes the finished jobs (and submits nothing)
        with m.lock:
            assert m.lookup(keys[0], poller) is HIT
        if not counters(e, seen)[metrics.ACTIVE_CASCADE_JOBS]:
            break
        with m.lock:
            m.on_schedule_end(END)
        time.sleep(0.005)
    with m.lock:
        assert not m.tiers[0].has_pending_work() and m.has_pending_work()
        assert on_disk(tmp_path) == set(keys[0:4])
        m.touch(keys[0:4], poller)  # the deferred keys are now the least recently used
    other, fresh = ReqContext("other"), [key(100 + i) for i in range(12)]  # 2 more than free
    with m.lock:
        out = m.prepare_store(fresh, other)
        assert list(out.keys_to_store) == fresh
        ready = m.primary.ready_keys(keys)
        assert len(ready) == 4 and keys[4] in ready and keys[5] in ready  # two others went
        m.complete_store(out.keys_to_store, other, success=False)  # (nothing to cascade)
        m.on_request_finished(poller)
    e.settle()
    assert on_disk(tmp_path) == set(keys)
    e.offload([key(200 + i) for i in range(16)], 40, ReqContext("evictor"))
    e.settle()
    reader = ReqContext("reader")
    e.until_hit(keys[4:6], reader)
    assert torch.equal(e.load(keys[4:6], reader, [70, 71]), e.originals[0][4:6])
    seen = counters(e, seen)
    assert metrics.CASCADE_DEFERRED_LOST_CHUNKS not in seen
    assert metrics.BACKPRESSURE_BLOCKS_DROPPED not in seen


def test_keys_evicted_while_deferred_are_skipped_and_counted_lost(engines, tmp_path):
    """Cap 8: 8 rows pinned, 2 keys deferred; a store that needs every free row evicts
    those two (unpinned, least recent). When the pins drop they are skipped and counted
    lost, the rest of the tier's work is done and nothing stays pending."""
    e = engines(tmp_path, chunks=16, max_pinned_fraction=0.5)
    m = e.manager
    first, deferred = [key(i) for i in range(8)], [key(8), key(9)]
    e.offload(first, 0, ReqContext("r0"))
    e.offload(deferred, 8, ReqContext("r1"))
    other, fresh = ReqContext("other"), [key(20 + i) for i in range(8)]
    with m.lock:
        out = m.prepare_store(fresh, other)
        assert list(out.keys_to_store) == fresh
        assert m.primary.ready_keys(deferred) == []  # evicted from the CPU tier
        m.complete_store(out.keys_to_store, other, success=False)  # nothing to cascade
    e.settle()
    assert on_disk(tmp_path) == set(first)
    seen = counters(e)
    assert seen[metrics.CASCADE_DEFERRED_CHUNKS] == 2
    assert seen[metrics.CASCADE_DEFERRED_LOST_CHUNKS] == 2
    assert metrics.BACKPRESSURE_BLOCKS_DROPPED not in seen


def test_the_deferred_queue_holds_cap_keys_and_drops_the_oldest(engines, tmp_path):
    """Cap 4 with the tier workers stopped: 4 rows pinned, then three cascades of 2 keys;
    the queue holds 4 keys, so the oldest cascade's keys are dropped (one cascade, two
    chunks counted as backpressure drops) and the two later ones are written."""
    e = engines(tmp_path, chunks=16, max_pinned_fraction=0.25)
    pids = tier_worker_pids(e.spec.engine_id)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        e.offload([key(i) for i in range(4)], 0, ReqContext("pinned"))
        with e.manager.lock:
            e.manager.on_schedule_end(END)  # to the stopped workers
        for n in range(3):
            e.offload([key(10 + 2 * n), key(11 + 2 * n)], 10 + 2 * n, ReqContext(f"d{n}"))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    e.settle()
    assert on_disk(tmp_path) == {key(i) for i in (0, 1, 2, 3, 12, 13, 14, 15)}
    seen = counters(e)
    assert seen[metrics.CASCADE_DEFERRED_CHUNKS] == 6
    assert seen[metrics.BACKPRESSURE_STORES_DROPPED] == 1
    assert seen[metrics.BACKPRESSURE_BLOCKS_DROPPED] == 2
    assert metrics.CASCADE_DEFERRED_LOST_CHUNKS not in seen


def test_reset_cache_writes_the_deferred_keys_before_it_drops_the_cpu_tier(engines, tmp_path):
    """The tiers keep their data over a reset: deferred keys are submitted (past the cap)
    and drained with the rest; afterwards nothing is pending and they promote."""
    e = engines(tmp_path, chunks=16, max_pinned_fraction=0.25)
    m = e.manager
    keys = [key(i) for i in range(6)]
    e.offload(keys[0:4], 0, ReqContext("r0"))
    e.offload(keys[4:6], 4, ReqContext("r1"))
    with m.lock:
        assert m.has_pending_work()
        m.reset_cache()
        assert not m.has_pending_work()
        m.on_reset_flushed()
    assert on_disk(tmp_path) == set(keys)
    assert e.answers_settled(keys[4:6], ReqContext("after")) == [HIT, HIT]


def test_a_backpressure_rejection_still_drops_the_cascade(engines, tmp_path):
    """The configured detector, under pressure with DropStorePolicy, rejects a cascade: it
    is dropped and counted as before (docs/vllm-contract.md §8), never deferred."""
    e = engines(tmp_path, chunks=16, backpressure={
        "backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
        "warmup_completions": 1, "decay_half_life_s": 0})
    detector = e.manager.tiers[0].bp_detector
    for _ in range(2):  # the warm-up's one sample seeds the EMA, the next one judges
        detector.on_store_completed(10.0, 2**20)  # 10 s/MiB: far above high water
    assert detector.is_under_pressure()
    keys = [key(i) for i in range(3)]
    e.offload(keys, 0, ReqContext("r"))
    e.settle()
    assert on_disk(tmp_path) == set()
    with e.manager.lock:
        assert e.manager.primary.ready_keys(keys) == keys
    seen = counters(e)
    assert seen[metrics.BACKPRESSURE_STORES_DROPPED] == 1
    assert seen[metrics.BACKPRESSURE_BLOCKS_DROPPED] == 3
    assert metrics.CASCADE_DEFERRED_CHUNKS not in seen
