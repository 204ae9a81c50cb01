"""The fs tier's accounting with real tier worker processes and real files (issue 11,
items 2, 3, 4 and 8): ``max_bytes`` is never exceeded, the byte count never drifts,
a worker's death loses no chunk and leaves no orphan, and the free-space floor is kept
by evicting, with one warning.

After each scenario, once the tier settled: the ``fs_bytes_on_disk`` gauge equals the
bytes of the ``*.kv`` files under the root, and the index holds exactly those files
(none unknown to it). During the run a sampler checks the bound on disk.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time

import pytest
from fs_engine import END, GPU_BLOCKS, HIT, MISS, PENDING, engines, key  # noqa: F401
from shmtier.shared.procinfo import tier_worker_pids as worker_processes
import torch

from shmtier.contract import ReqContext
from shmtier.scheduler.pool import WorkerState
from shmtier.shared.codec import MAC_TAG_BYTES
from shmtier.shared.jobs import Outcome
from shmtier.storage import scheduler as storage_tier
from shmtier.tiers.fs import scheduler as fs_tier

LABEL = ("1:fs",)
FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
# One chunk's file: the test caches hold random bytes, which do not compress, so every
# chunk is a raw frame of 8192 bytes of KV, a 40-byte header and the 36-byte key.
FILE = 8192 + 40 + 36


def kv_files(root) -> dict[bytes, int]:
    return {bytes.fromhex(p.name[:-len(".kv")]): p.stat().st_size for p in root.rglob("*.kv")}


class DiskSampler:
    """Samples the bytes of the ``*.kv`` files under ``root`` from a thread until closed.

    A sample lists the files, then stats each one listed and counts those still there:
    every file counted existed at the instant the listing ended, so a sample is never
    more than the disk held at one moment (a walk that summed sizes as it went could
    count a deleted file and its successor together)."""

    def __init__(self, root):
        self.root = str(root)
        self.max = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            paths = [os.path.join(top, name) for top, _dirs, names in os.walk(self.root)
                     for name in names if name.endswith(".kv")]
            total = 0
            for path in paths:
                try:
                    total += os.stat(path).st_size
                except FileNotFoundError:
                    pass
            self.max = max(self.max, total)
            self.samples += 1
            time.sleep(0.001)


def assert_settled(engine, root) -> tuple[dict[bytes, int], dict]:
    """The tier settled: its gauge is the bytes of the files on disk, exactly, and its
    index holds exactly those files (no orphan). Returns the files and the stats."""
    tier = engine.manager.tiers[0]
    files = kv_files(root)
    data = engine.manager.get_stats().data["data"]
    assert data[fs_tier.BYTES_ON_DISK][LABEL] == sum(files.values())
    assert not set(files) - set(tier._index), "files on disk the index does not know"
    assert dict(tier._index) == files
    return files, data


def kill_workers(engine) -> None:
    for pid in worker_processes(engine.spec.engine_id):
        os.kill(pid, signal.SIGKILL)


def stop_workers(engine, sig) -> list[int]:
    pids = worker_processes(engine.spec.engine_id)
    for pid in pids:
        os.kill(pid, sig)
    return pids


def step(engine) -> None:
    with engine.manager.lock:
        engine.manager.on_schedule_end(END)


# --- item 2: max_bytes ---

def test_one_request_larger_than_max_bytes_never_passes_it(engines, tmp_path):
    """max_bytes 24,576 (two chunk files) and a 20-key request (its keys spread over both
    workers): the tier stores the keys as room appears, evicting the older ones,
    never holds more than the bound and keeps the most recent chunks. (Each worker
    used to get the same count of bytes in use and fill the bound on its own; keys
    past it were refused, the oldest kept.)"""
    e = engines(tmp_path, max_bytes=24576, chunks=24)
    e.settle()
    keys = [key(i) for i in range(20)]
    with DiskSampler(tmp_path) as sampler:
        e.offload(keys, 0, ReqContext("a"))
        e.settle(timeout_s=30)
    assert sampler.samples and sampler.max <= 24576, sampler.max
    files, data = assert_settled(e, tmp_path)
    assert set(files) == set(keys[-2:])  # the two most recent
    assert data[fs_tier.EVICTED_CHUNKS][LABEL] == 18
    assert "vllm:kv_offload_tiering_cascade_job_failures" not in data  # all were stored


def test_with_a_mac_key_a_store_reserves_its_whole_frame(engines, tmp_path, caplog):
    """A frame with a MAC carries a tag after its header: each store reserves it too
    (it reserved the frame without the tag, so stores that fit their reservations were
    refused by the workers near the bound). max_bytes of three tagged files and six
    chunks: the tier stores them as room appears, never refused, never past the bound."""
    one = FILE + MAC_TAG_BYTES
    e = engines(tmp_path, max_bytes=3 * one, chunks=24, mac_key="ab" * 32)
    e.settle()
    keys = [key(i) for i in range(6)]
    with DiskSampler(tmp_path) as sampler:
        for i, k in enumerate(keys):
            e.offload([k], i, ReqContext(f"r{i}"))
        e.settle(timeout_s=30)
    files, data = assert_settled(e, tmp_path)
    tier = e.manager.tiers[0]
    assert set(files.values()) == {one} and all(tier._ledger.reservation(k) == one for k in files)
    # three files, the last stored among them (which older ones were evicted depends on the
    # order the two workers' stores landed in)
    assert len(files) == 3 and set(files) <= set(keys) and keys[-1] in files
    assert sampler.max <= 3 * one
    assert "vllm:kv_offload_tiering_cascade_job_failures" not in data
    assert not fs_warnings(caplog)  # nothing refused for space


def test_store_jobs_in_flight_together_share_max_bytes(engines, tmp_path):
    """Several cascades queued while the workers are busy (here: stopped), each sent in
    its own step: together they never pass max_bytes (each used to get the same
    count of bytes in use and fill the bound on its own)."""
    limit = 3 * FILE
    e = engines(tmp_path, max_bytes=limit, chunks=24)  # 12 rows may wait for cascades
    e.settle()
    with DiskSampler(tmp_path) as sampler:
        for rnd in range(3):
            pids = stop_workers(e, signal.SIGSTOP)
            try:
                for r in range(3):  # three requests, three steps, three store jobs
                    first = rnd * 9 + r * 3
                    e.offload([key(first + i) for i in range(3)], first,
                              ReqContext(f"r{rnd}-{r}"))
                    step(e)
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            e.settle(timeout_s=30)
    assert sampler.samples and sampler.max <= limit, sampler.max
    files, _ = assert_settled(e, tmp_path)
    assert len(files) == 3


# --- item 3: the byte count does not drift ---

@pytest.mark.parametrize("first", ["scan", "store"])
def test_a_key_listed_while_its_store_is_in_flight_is_counted_once(engines, tmp_path, first):
    """A warm restart lists the root while the new engine stores the same keys again
    (the workers answer EXISTS): whichever result the tier takes first, each file is
    counted once (the count used to take the listed size and the stored size both)."""
    e = engines(tmp_path)
    keys = [key(i) for i in range(6)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    e.close()
    e2 = engines(tmp_path)
    tier, pool = e2.manager.tiers[0], e2.spec.worker_pool
    real_take, held, stores, released = pool.take, [], [], []

    def take(t):  # hold the listing and the stores until both are in, then pick the order
        got = held + real_take(t)
        held.clear()
        if released:
            return got
        mine = [r for r in got if r.op in ("scan", "store")]
        if {r.op for r in mine} != {"scan", "store"}:
            held.extend(mine)
            return [r for r in got if r not in mine]
        released.append(True)
        stores.extend(r for r in mine if r.op == "store")
        mine.sort(key=lambda r: (r.op == "store") == (first == "scan"))
        return [r for r in got if r not in mine] + mine

    pool.take = take
    assert not tier._index_complete
    e2.offload(keys, 0, ReqContext("b"))  # the listing is held: these stores go meanwhile
    e2.settle()
    assert tier._index_complete and stores
    assert [o for r in stores for o in r.outcomes] == [Outcome.EXISTS] * 6
    files, _ = assert_settled(e2, tmp_path)
    assert set(files) == set(keys)


# --- item 4: a worker's death ---

def test_a_worker_killed_mid_cascade_loses_no_chunk_and_leaves_no_orphan(
        engines, tmp_path, worker_hooks):
    """The workers are killed while 32 chunks are being written (slowly: each publish
    waits 30 ms). The keys of the slices they answered keep their outcomes; the files
    of the rest that were complete are found by a probe and indexed; none is left
    unknown (they used to be reported not stored and stay on disk unaccounted). One
    O_DIRECT write in flight per worker (``write_depth`` 1), so a slice of 8 keys takes
    8 x 30 ms and the kill lands inside one."""
    worker_hooks(fs_root=tmp_path, slow_publish_s=0.03)
    e = engines(tmp_path, chunks=40, max_bytes=40 * FILE, write_depth=1)
    e.settle()
    results = e.record_pool_results()
    keys = [key(i) for i in range(32)]
    e.offload(keys, 0, ReqContext("a"))
    deadline = time.monotonic() + 20
    while len(kv_files(tmp_path)) < 26:  # each worker (16 keys) is past its first slice
        step(e)
        assert time.monotonic() < deadline, "the cascade did not progress"
        time.sleep(0.002)
    kill_workers(e)
    written = kv_files(tmp_path)
    assert len(written) < 32, "the cascade finished before the kill: nothing tested"
    e.settle(timeout_s=30)
    (store,) = [r for r in results if r.op == "store"]
    assert store.outcomes.count(Outcome.OK) >= 16  # two slices answered before the kill
    assert Outcome.ERROR in store.outcomes
    files, _ = assert_settled(e, tmp_path)
    assert set(written) <= set(files)  # every complete file is indexed


def _promoting_to_stopped_workers(e) -> tuple[list[bytes], list[int]]:
    """16 chunks cascaded to the fs tier and evicted from the CPU tier, then a request's
    lookups promote them with every tier worker SIGSTOPped: returns (the keys, the
    stopped workers' pids); the load is with the stopped workers."""
    first = [key(i) for i in range(16)]
    e.offload(first, 0, ReqContext("a"))
    e.settle()
    e.offload([key(100 + i) for i in range(16)], 16, ReqContext("b"))  # evicts "a" from CPU
    e.settle()
    pids = stop_workers(e, signal.SIGSTOP)
    with e.manager.lock:
        assert [e.manager.lookup(k, ReqContext("r1")) for k in first] == [PENDING] * 16
        e.manager.on_schedule_end(END)  # the load goes to the stopped workers
    return first, pids


def test_the_ring_depth_gauge_counts_the_jobs_waiting_for_stopped_workers(engines, tmp_path):
    """``vllm:kv_offload_shmtier_ring_depth``: a load queued for SIGSTOPped workers is
    counted while it waits (the pool reads the rings while a job is outstanding), and
    the gauge is 0 once the workers went on and answered (nothing outstanding: the pool
    answers 0 without reading the rings)."""
    from shmtier.storage.tier_metrics import RING_DEPTH

    e = engines(tmp_path, chunks=16)
    _first, pids = _promoting_to_stopped_workers(e)
    try:
        assert e.manager.get_stats().data["data"][RING_DEPTH][LABEL] >= 1
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    e.settle()
    assert e.spec.worker_pool.outstanding() == 0
    assert e.manager.get_stats().data["data"][RING_DEPTH][LABEL] == 0


def test_a_load_failed_by_a_worker_death_keeps_its_chunks(engines, tmp_path):
    """A promotion whose workers die fails with ERROR: that says nothing about the files,
    so the 16 chunks stay indexed (they used to be dropped: a MISS with the files on
    disk) and, once the failed load's miss window (``probe_timeout_s``: a failing medium
    is not asked again every step) has passed, a fresh request loads them.

    The window counts from the step that takes the failure, so the MISS is asked for at
    that step, not after the tier settled: settling waits for the replacement workers to
    answer the chunks' probes, which on a busy host took longer than the window (the
    lookups then rightly promoted again: this test failed 4 runs in 15 beside two CPU
    hogs)."""
    window = 2.0
    e = engines(tmp_path, chunks=16, probe_timeout_s=window)
    first, pids = _promoting_to_stopped_workers(e)
    failures = []

    def failed() -> bool:  # get_stats hands each step's counts once
        with e.manager.lock:
            data = e.manager.get_stats().data["data"]
        failures.append(data.get(FAILURES, {}).get(LABEL, 0))
        return sum(failures) > 0

    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    e.steps_until(failed, "the promotion failed", timeout_s=30)
    failed_at = time.monotonic()
    with e.manager.lock:
        assert [e.manager.lookup(k, ReqContext("r-now")) for k in first] == [MISS] * 16
    assert time.monotonic() - failed_at < window, "asked too late to see the window"
    e.settle(timeout_s=30)
    failed()
    assert sum(failures) == 1
    assert set(first) <= set(e.manager.tiers[0]._index)
    time.sleep(max(0.0, failed_at + window + 0.1 - time.monotonic()))
    reader = ReqContext("r2")
    e.until_hit(first, reader, timeout_s=30)  # never a MISS
    with e.manager.lock:
        spec = e.manager.prepare_load(first, reader)
    dst = list(range(GPU_BLOCKS - 16, GPU_BLOCKS))
    e.caches[0][dst] = 0
    e.copy("load", spec, dst)
    with e.manager.lock:
        e.manager.complete_load(first, reader)
    assert torch.equal(e.caches[0][dst], e.originals[0][:16])
    assert_settled(e, tmp_path)


def test_a_chunk_removed_by_a_load_that_died_is_probed_not_kept(engines, tmp_path):
    """A worker that finds a chunk corrupt removes its file, and may be killed before it
    answers: the load fails with ERROR, and the file is gone. Keeping that key indexed
    would leave an indexed chunk without a file (the chaos run under load: "indexed
    chunks without a file: 2"); an ERROR is probed instead: the chunks still there are
    indexed again, the removed one is not, and the index is the disk. Here the file is
    removed while the load's workers are stopped, then they are killed."""
    e = engines(tmp_path, chunks=16, probe_timeout_s=0.5)
    first, pids = _promoting_to_stopped_workers(e)
    removed = first[5]
    (path,) = [p for p in tmp_path.rglob("*.kv") if p.name.startswith(removed.hex())]
    path.unlink()  # what the worker did on finding it corrupt, before it was killed
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    e.settle(timeout_s=30)
    data = e.manager.get_stats().data["data"]
    assert data[FAILURES][LABEL] == 1
    tier = e.manager.tiers[0]
    assert removed not in tier._index and set(first) - {removed} <= set(tier._index)
    assert_settled(e, tmp_path)


def test_evicted_files_whose_delete_died_with_its_worker_are_not_orphaned(engines, tmp_path):
    """The tier is full; a cascade evicts two chunks and waits for their delete, which
    dies with its workers: a probe finds the files still there, they are indexed
    again and evicted again, and the cascade goes once they are gone."""
    limit = 2 * FILE + 100
    e = engines(tmp_path, max_bytes=limit)
    old = [key(i) for i in range(2)]
    e.offload(old, 0, ReqContext("a"))
    e.settle()
    new = [key(10 + i) for i in range(2)]
    with DiskSampler(tmp_path) as sampler:
        pids = stop_workers(e, signal.SIGSTOP)
        e.offload(new, 2, ReqContext("b"))
        tier = e.manager.tiers[0]
        deadline = time.monotonic() + 10
        while True:  # the step, or the between-steps round after it, sends the stores:
            step(e)  # evicts "a", its delete goes to the stopped workers; "b" waits
            with e.manager.lock:
                if set(tier._deleting) == set(old):
                    assert set(tier._storing) == set(new)
                    break
            assert time.monotonic() < deadline, "the store never evicted the old chunks"
            time.sleep(0.01)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        e.settle(timeout_s=30)
    assert sampler.max <= limit
    files, data = assert_settled(e, tmp_path)
    assert set(files) == set(new)
    assert "vllm:kv_offload_tiering_cascade_job_failures" not in data


def test_workers_killed_at_random_keep_the_bound_and_the_count(engines, tmp_path, worker_hooks):
    """Cascades into a full tier (evictions, deletes) while workers are killed at random
    moments: the disk never holds more than max_bytes, and once the tier settles its
    count and index are the files on disk."""
    worker_hooks(fs_root=tmp_path, slow_publish_s=0.01)
    limit = 6 * FILE
    e = engines(tmp_path, max_bytes=limit, chunks=24)
    e.settle()
    pool = e.spec.worker_pool
    rng = random.Random(11)
    kills = 0
    with DiskSampler(tmp_path) as sampler:
        for rnd in range(8):
            for r in range(2):
                first = rnd * 6 + r * 3
                e.offload([key(first + i) for i in range(3)], first % 24,
                          ReqContext(f"r{rnd}-{r}"))
            until = time.monotonic() + rng.uniform(0.0, 0.08)
            while time.monotonic() < until:
                step(e)
                time.sleep(0.002)
            if rng.random() >= 0.6:
                e.settle(timeout_s=30)
                continue
            # a worker killed in an earlier round may still be restarting: wait for one up
            deadline = time.monotonic() + 10
            while True:
                healthy = [i for i, s in enumerate(pool.worker_states())
                           if s is WorkerState.HEALTHY]
                if healthy or time.monotonic() > deadline:
                    break
                step(e)
                time.sleep(0.005)
            if healthy:
                proc = pool._procs[rng.choice(healthy)]
                if proc is not None and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    kills += 1
            e.settle(timeout_s=30)
    assert kills >= 3
    assert sampler.samples and sampler.max <= limit, sampler.max
    files, _ = assert_settled(e, tmp_path)
    assert 0 < sum(files.values()) <= limit


# --- item 8: the free-space floor ---

def fs_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == storage_tier.__name__ and r.levelno >= logging.WARNING]


def test_the_free_space_floor_is_kept_by_evicting_with_one_warning(
        engines, tmp_path, worker_hooks, caplog):
    """A small filesystem (the workers see 64 KiB + four chunk files of it): once the
    floor is reached, the workers refuse stores; the tier evicts its least recently
    used chunks by the free bytes they report and stores again, so every cascade
    lands, and it says so once, with the numbers (it used to refuse every cascade
    with one warning each and evict nothing)."""
    floor = 64 << 10
    capacity = floor + 4 * FILE
    worker_hooks(fs_root=tmp_path, fs_capacity=capacity)
    caplog.set_level(logging.WARNING)
    e = engines(tmp_path, workers=1, min_free_bytes=floor)
    e.settle()
    with DiskSampler(tmp_path) as sampler:
        for r in range(8):
            e.offload([key(2 * r), key(2 * r + 1)], (2 * r) % 16, ReqContext(f"r{r}"))
            e.settle(timeout_s=30)
    assert sampler.max <= capacity - floor
    files, data = assert_settled(e, tmp_path)
    assert set(files) >= {key(14), key(15)} and len(files) == 3  # 3 fit above the floor
    assert data[fs_tier.EVICTED_CHUNKS][LABEL] == 13
    assert "vllm:kv_offload_tiering_cascade_job_failures" not in data
    (warning,) = fs_warnings(caplog)
    assert f"min_free_bytes ({floor})" in warning and "bytes free" in warning
    assert "the tier holds" in warning and "evicting" in warning


def test_a_filesystem_too_small_for_the_default_floor_warns_once(
        engines, tmp_path, worker_hooks, caplog):
    """The default floor (1 GiB) on a 1 MiB filesystem: no eviction can make room, so the
    cascades fail (the CPU tier keeps serving), with one warning naming the free
    bytes, the floor and what the tier holds (it used to warn once per job)."""
    worker_hooks(fs_root=tmp_path, fs_capacity=1 << 20)
    caplog.set_level(logging.WARNING)
    e = engines(tmp_path, min_free_bytes=1 << 30)
    e.settle()
    for r in range(4):
        e.offload([key(2 * r), key(2 * r + 1)], 2 * r, ReqContext(f"r{r}"))
        e.settle()
    files, data = assert_settled(e, tmp_path)
    assert not files
    assert data["vllm:kv_offload_tiering_cascade_job_failures"][LABEL] == 4
    assert fs_tier.EVICTED_CHUNKS not in data
    (warning,) = fs_warnings(caplog)
    assert "min_free_bytes (1073741824)" in warning and "bytes free" in warning
    assert "holds only 0 bytes" in warning
    with e.manager.lock:
        assert all(e.manager.lookup(key(i), ReqContext("x")) is HIT for i in range(8))
