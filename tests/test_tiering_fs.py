"""The whole pipeline through the spec: GPU tensor -> primary -> fs tier (tier
worker processes, real files) -> primary -> GPU tensor."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np

import pytest
from fs_engine import END, GPU_BLOCKS, HIT, MISS, PENDING, RETRY, engines, key  # noqa: F401
from starve import starved
from shmtier.shared.procinfo import tier_worker_pids as worker_processes
import torch

from shmtier.config import ConfigError, KVLayout
from shmtier.contract import ReqContext
from shmtier.shared.jobs import Outcome
from shmtier.tiers.fs import scheduler as fs_tier
from shmtier.spec import TieringOffloadingSpec

@pytest.mark.parametrize("io", [{}, {"direct_io": "writes", "write_depth": 4}],
                         ids=["buffered", "direct-writes"])
@pytest.mark.parametrize("world_size, bpc, page", [(1, 1, 8192), (2, 4, 4096), (1, 2, 6000)])
def test_bytes_round_trip_through_fs_and_back(engines, tmp_path, world_size, bpc, page, io):
    """Through the tier workers and back, byte for byte; with O_DIRECT stores too (4 in
    flight per worker where the filesystem takes O_DIRECT, else buffered)."""
    e = engines(tmp_path, world_size=world_size, bpc=bpc, page=page, chunks=8, **io)
    first = [key(i) for i in range(8)]
    a = ReqContext("a")
    e.offload(first, 0, a)
    with e.manager.lock:
        e.manager.on_request_finished(a)
    e.settle()  # cascades written by the workers
    b = ReqContext("b")
    e.offload([key(100 + i) for i in range(8)], 8 * bpc, b)  # evicts "a" from the CPU tier
    e.settle()
    reader = ReqContext("r")
    seen = e.until_hit(first, reader)
    assert PENDING in seen[0]
    with e.manager.lock:
        spec = e.manager.prepare_load(first, reader)
    dst = list(range(GPU_BLOCKS - 8 * bpc, GPU_BLOCKS))
    for cache in e.caches:
        cache[dst] = 0
    e.copy("load", spec, dst)
    with e.manager.lock:
        e.manager.complete_load(first, reader)
    for cache, original in zip(e.caches, e.originals):
        assert torch.equal(cache[dst], original[: 8 * bpc])
    data = e.manager.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_read_bytes"][("1:fs",)] > 0
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] > 0


def test_warm_restart_serves_what_the_previous_engine_wrote(engines, tmp_path):
    e = engines(tmp_path)
    keys = [key(i) for i in range(6)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    expected = e.originals[0][:6].clone()
    e.close()
    engines_left = engines(tmp_path)  # a new engine, same root and layout
    ctx = ReqContext("again")
    seen = engines_left.until_hit(keys, ctx)
    assert seen[0][0] in (RETRY, PENDING)  # unknown until the scan lands, then promoted
    with engines_left.manager.lock:
        spec = engines_left.manager.prepare_load(keys, ctx)
    engines_left.copy("load", spec, list(range(50, 56)))
    assert torch.equal(engines_left.caches[0][50:56], expected)


def test_a_corrupt_file_is_a_miss_and_counted(engines, tmp_path):
    e = engines(tmp_path, chunks=4)
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) == 4
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    e.offload([key(10 + i) for i in range(4)], 4, ReqContext("b"))  # evict all four
    e.settle()
    answers = e.answers_settled(keys, ReqContext("r"))
    assert answers.count(HIT) == 3 and answers.count(MISS) == 1
    assert not victim.exists()
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.CORRUPT_CHUNKS][("1:fs",)] == 1
    assert data["vllm:kv_offload_tiering_promotion_job_failures"][("1:fs",)] == 1


@pytest.mark.parametrize("mac", [False, True])
def test_a_forged_file_is_served_only_without_a_mac_key(engines, tmp_path, mac):
    """Issue 11 item 7, through the spec and the tier workers: anyone who can write the
    root can put a valid frame (built with the encoder) of a key with other bytes where
    the chunk's file is. Without a MAC key it is promoted and copied to the GPU; with
    ``mac_key_file`` it is a MISS, counted and removed, and the other chunks still HIT."""
    from shmtier.shared.codec import ChunkEncoder, CompressionConfig, parse_frame_header

    root = tmp_path / "root"
    root.mkdir()
    tier = {}
    if mac:
        key_path = tmp_path / "mac.key"
        key_path.write_text(os.urandom(32).hex() + "\n")
        key_path.chmod(0o600)
        tier["mac_key_file"] = str(key_path)
    e = engines(root, chunks=4, **tier)
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    files = sorted(root.rglob("*.kv"))
    assert len(files) == 4
    victim = files[0]
    h = parse_frame_header(memoryview(victim.read_bytes()))
    assert h.header_size == 40 + len(h.key) + (32 if mac else 0)  # the MAC tag
    forged = torch.full((h.raw_len,), 7, dtype=torch.int8).numpy()
    parts, _ = ChunkEncoder(CompressionConfig(mode="none")).encode(memoryview(forged), h.key, 2)
    victim.write_bytes(b"".join(bytes(p) for p in parts))
    e.offload([key(10 + i) for i in range(4)], 4, ReqContext("b"))  # evict all four
    e.settle()
    ctx = ReqContext("r")
    answers = e.answers_settled(keys, ctx)
    data = e.manager.get_stats().data["data"]
    if not mac:  # the attack works: the forged bytes reach the GPU as the chunk
        assert answers == [HIT] * 4
        with e.manager.lock:
            spec = e.manager.prepare_load(keys, ctx)
        dst = list(range(80, 84))
        e.copy("load", spec, dst)
        loaded = {bytes(e.caches[0][b].numpy()) for b in dst}
        assert bytes(forged) in loaded
        assert fs_tier.CORRUPT_CHUNKS not in data or not data[fs_tier.CORRUPT_CHUNKS]
        return
    assert answers.count(HIT) == 3 and answers.count(MISS) == 1
    assert not victim.exists()
    assert data[fs_tier.CORRUPT_CHUNKS][("1:fs",)] == 1
    with e.manager.lock:
        hits = [k for k, a in zip(keys, answers) if a is HIT]
        spec = e.manager.prepare_load(hits, ctx)
    e.copy("load", spec, [80, 81, 82])
    for b, k in zip([80, 81, 82], hits):
        assert torch.equal(e.caches[0][b], e.originals[0][keys.index(k)])


def test_max_bytes_evicts_by_tier_recency(engines, tmp_path):
    e = engines(tmp_path, chunks=4, max_bytes=5 * 8192, **{})
    for batch in range(4):
        e.offload([key(batch * 4 + i) for i in range(4)], batch * 4, ReqContext(f"r{batch}"))
        e.settle()
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert on_disk <= 5 * 8192
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.EVICTED_CHUNKS][("1:fs",)] > 0


def _fill_mixed(engine, blocks) -> None:
    """Make GPU blocks ``blocks`` a mix the codec treats differently: zeros and bf16
    normals compress (to very different sizes), the random bytes already there do not."""
    rng = np.random.default_rng(7)
    page = engine.caches[0].shape[1]
    for n, block in enumerate(blocks):
        for cache in engine.caches:
            if n % 3 == 0:
                cache[block] = 0
            elif n % 3 == 1:
                f = rng.standard_normal(page // 2, dtype=np.float32)
                bf16 = (f.view(np.uint32) >> 16).astype("<u2").view(np.int8)
                cache[block] = torch.from_numpy(bf16.copy())


def _assert_index_is_the_disk(tier, root) -> dict[bytes, int]:
    """The fs tier's index holds each chunk with its file's exact size."""
    files = {bytes.fromhex(p.name[:-len(".kv")]): p.stat().st_size for p in root.rglob("*.kv")}
    assert dict(tier._index) == files
    assert tier.bytes_on_disk == sum(files.values())
    return files


def test_each_stored_chunk_is_indexed_with_its_own_file_size(engines, tmp_path):
    """Per-key stored sizes from the workers reach the index exactly: compressible and
    incompressible chunks of one pool job each count their own file's bytes ("zstd":
    compressed whatever the host's load; "auto" may rightly store raw on a busy host)."""
    e = engines(tmp_path, chunks=12, top={"compression": "zstd"})
    keys = [key(i) for i in range(9)]
    _fill_mixed(e, range(9))
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    tier = e.manager.tiers[0]
    files = _assert_index_is_the_disk(tier, tmp_path)
    assert len(files) == 9 and len(set(files.values())) >= 3  # really a mix of sizes
    assert min(files.values()) < 0.6 * max(files.values())
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] == sum(files.values())
    assert data[fs_tier.STORED_RATIO][("1:fs",)] == sum(files.values())


def test_a_scan_indexes_each_file_with_its_own_size(engines, tmp_path):
    e = engines(tmp_path, chunks=12)
    keys = [key(i) for i in range(9)]
    _fill_mixed(e, range(9))
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    e.close()
    again = engines(tmp_path)  # a new engine lists the root (warm restart)
    again.settle()
    tier = again.manager.tiers[0]
    assert tier._index_complete
    files = _assert_index_is_the_disk(tier, tmp_path)
    assert set(files) == set(keys) and len(set(files.values())) >= 3


def test_each_tier_job_reports_the_time_and_bytes_of_its_own_keys(engines, tmp_path):
    """Tier jobs combined into one pool job each get the sums of the seconds and logical
    bytes the workers reported for their own keys, not a share of the totals."""
    e = engines(tmp_path, chunks=12)
    tier, pool = e.manager.tiers[0], e.spec.worker_pool
    pool_results, job_results = [], []
    real_take, real_finished = pool.take, tier.get_finished_jobs

    def take(t):
        got = real_take(t)
        pool_results.extend(got)
        return got

    def finished():
        got = list(real_finished())
        job_results.extend(got)
        return got

    pool.take, tier.get_finished_jobs = take, finished
    try:
        _fill_mixed(e, range(6))
        done, start = [], 0
        for name, n in (("one", 1), ("five", 5)):
            ctx = ReqContext(name)
            with e.manager.lock:
                out = e.manager.prepare_store([key(start + i) for i in range(n)], ctx)
            e.copy("store", out.store_spec, list(range(start, start + n)))
            done.append((out.keys_to_store, ctx))
            start += n
        with e.manager.lock:  # two requests' cascades in one step: one pool job
            for keys, ctx in done:
                e.manager.complete_store(keys, ctx)
        e.settle()
    finally:
        pool.take, tier.get_finished_jobs = real_take, real_finished
    (stores,) = [r for r in pool_results if r.op == "store"]
    assert len(stores.keys) == 6 and stores.outcomes == [Outcome.OK] * 6
    chunk = e.spec.chunk_payload_bytes
    assert stores.logical_bytes == [chunk] * 6
    by_bytes = sorted(job_results, key=lambda r: r.transfer_bytes)
    assert [r.transfer_bytes for r in by_bytes] == [chunk, 5 * chunk]
    assert by_bytes[0].transfer_time == sum(stores.seconds[:1])  # its own key's seconds
    assert by_bytes[1].transfer_time == sum(stores.seconds[1:])
    assert all(r.success and r.transfer_time > 0 for r in job_results)


def test_a_killed_tier_worker_fails_its_jobs_and_is_replaced(engines, tmp_path):
    e = engines(tmp_path)
    pool = e.spec.worker_pool
    keys = [key(i) for i in range(8)]
    e.offload(keys, 0, ReqContext("a"))
    for proc in pool._procs:
        os.kill(proc.pid, 9)  # mid-cascade, or just after
    e.settle()
    deadline = time.monotonic() + 20
    while pool.restarts_total < 2 or any(p is None or p.poll() is not None for p in pool._procs):
        with e.manager.lock:
            e.manager.on_schedule_end(END)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with e.manager.lock:  # the primary copy is intact whatever the cascade did
        assert all(e.manager.lookup(k, ReqContext("x")) is HIT for k in keys)
    e.offload([key(50 + i) for i in range(4)], 20, ReqContext("b"))
    e.settle()
    assert len(list(tmp_path.rglob("*.kv"))) >= 4  # the replacements work


def test_a_starved_tier_worker_is_slow_not_hung_and_counted(engines, tmp_path):
    """A tier worker starved of CPU mid-cascade (``starve.py``: a busy host) is not
    killed: the tier counts it (``worker_late_but_busy``), restarts nothing, and every
    chunk reaches disk and comes back byte-exact once the CPU frees up."""
    e = engines(tmp_path, page=65536, bpc=16, chunks=8, workers=1)  # 1 MiB chunks
    pool, m = e.spec.worker_pool, e.manager
    pool.heartbeat_timeout_s = 0.4  # < one starved slice (a 2 s default may not be)
    e.offload([key(0)], 0, ReqContext("w"))
    e.settle()  # the worker is up
    keys = [key(i) for i in range(1, 5)]
    with starved([p.pid for p in pool._procs]):
        e.offload(keys, 16, ReqContext("a"))  # their cascade: 4 MiB to compress and write
        deadline = time.monotonic() + 30
        while pool.late_beats.spared_total == 0:
            with m.lock:
                m.on_schedule_end(END)
            assert pool.hung_total == 0 and time.monotonic() < deadline
            time.sleep(0.02)
    e.settle()
    data = m.get_stats().data["data"]
    assert data[fs_tier.WORKERS_LATE_BUT_BUSY][("1:fs",)] >= 1
    assert fs_tier.WORKER_RESTARTS not in data and pool.restarts_total == 0
    assert len(list(tmp_path.rglob("*.kv"))) == 5
    for b in range(2):  # 8 more chunks evict keys 0-4 from the 8-row CPU tier
        e.offload([key(100 + 4 * b + i) for i in range(4)], 0, ReqContext(f"b{b}"))
        e.settle()
    e.until_hit(keys, ReqContext("r"))  # promoted back from the files
    got = e.load(keys, ReqContext("r"), list(range(32, 96)))
    assert torch.equal(got, e.originals[0][16:80])  # where keys 1-4 were stored from


def test_fs_tier_config_errors(tmp_path):
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].type = None"):
        TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{}]}, layout, "x")
    with pytest.raises(ConfigError, match=r"'workers'\] = 'fork' is invalid"):
        TieringOffloadingSpec({"cpu_bytes_to_use": 1 << 20, "workers": "fork"}, layout, "x")


def test_two_fs_tiers_on_one_root_are_refused_naming_both(tmp_path):
    """Issue 28: two fs tiers of one engine on one root (by any path: a link, a trailing
    slash) would share one namespace, double-count its bytes and evict each other's
    chunks: refused, naming both tiers. Another directory, or another MAC key (another
    namespace), is fine. (``check_shared_roots``: the spec's config calls it with its
    tiers; here with each tier checked as the spec checks it.)"""
    from shmtier.config import SecondaryTierConfig
    from shmtier.tiers.fs.config import check_shared_roots

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    os.symlink(root, tmp_path / "link")

    def tiers(*entries):
        return [SecondaryTierConfig.from_dict({"type": "fs", **e}, where=f"secondary_tiers[{i}]")
                for i, e in enumerate(entries)]

    with pytest.raises(ConfigError, match=(
            r"secondary_tiers\[1\].root_dir = '.*/link' is invalid: "
            r"secondary_tiers\[0\].root_dir \('.*/root'\) is the same directory, and with no "
            r"MAC key both fs tiers would share one namespace")):
        check_shared_roots(tiers({"root_dir": str(root)}, {"root_dir": str(tmp_path / "link")}))
    key = "ab" * 16
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\].root_dir = .* is invalid: "
                                          r"secondary_tiers\[0\].root_dir is the same directory, "
                                          r"and with the same MAC key"):
        check_shared_roots(tiers({"root_dir": str(root), "mac_key": key},
                                 {"root_dir": str(root / "sub"), "mac_key": key},
                                 {"root_dir": str(root) + "/", "mac_key": key}))
    check_shared_roots(tiers({"root_dir": str(root)}, {"root_dir": str(root / "sub")}))
    check_shared_roots(tiers({"root_dir": str(root)}, {"root_dir": str(root), "mac_key": key}))
    # the spec's config refuses it when the spec is built, before anything is created
    from shmtier.config import TieringConfig

    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].root_dir = .* both fs tiers "
                                          r"would share one namespace"):
        TieringConfig.from_extra_config({"secondary_tiers": [
            {"type": "fs", "root_dir": str(root)}, {"type": "fs", "root_dir": str(root)}]})
    TieringConfig.from_extra_config({"secondary_tiers": [
        {"type": "fs", "root_dir": str(root)}, {"type": "fs", "root_dir": str(root / "sub")}]})


def test_external_worker_pool_serves_the_engine(engine_id, tmp_path):
    """``"workers": "external"`` + ``shmtier workers --engine-id``: the engine's
    cascades are written by workers it did not start."""
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    extra = {"cpu_bytes_to_use": 8 * 8192, "workers": "external", "num_tier_workers": 2,
             "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "min_free_bytes": None}]}
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    manager = spec.get_manager()
    supervisor = subprocess.Popen([sys.executable, "-m", "shmtier", "workers", "--engine-id",
                                   engine_id, "--num-workers", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert "2 tier workers" in supervisor.stdout.readline()
        arena = manager.primary.get_kv_memoryview()
        rows = np.asarray(arena)
        ctx = ReqContext("a")
        keys = [key(i) for i in range(8)]
        with manager.lock:
            out = manager.prepare_store(keys, ctx)
        rows[out.store_spec.chunk_ids] = np.arange(8, dtype=np.uint8)[:, None]
        with manager.lock:
            manager.complete_store(keys, ctx)
        deadline = time.monotonic() + 20
        while True:
            with manager.lock:
                manager.on_schedule_end(END)
                if not manager.has_pending_work():
                    break
            assert time.monotonic() < deadline, "external workers did not serve the jobs"
            time.sleep(0.01)
        assert len(list(tmp_path.rglob("*.kv"))) == 8
        del rows, arena
    finally:
        supervisor.terminate()
        supervisor.wait(10)
        manager.shutdown()


def test_a_stalled_tier_cannot_starve_the_cpu_tier(engines, tmp_path):
    """Cascades waiting for stalled workers pin at most max_pinned_fraction of the CPU
    rows; beyond it they wait unpinned in a queue as long as the cap, the oldest beyond
    that are dropped (counted as backpressure), and CPU stores go on."""
    e = engines(tmp_path, chunks=16, max_pinned_fraction=0.25)
    pids = [p.pid for p in e.spec.worker_pool._procs]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for batch in range(6):  # 12 chunks offered while nothing is written
            out = e.offload([key(batch * 2), key(batch * 2 + 1)], batch * 2, ReqContext(f"r{batch}"))
            assert out.keys_to_store  # the CPU tier always had room
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    e.settle()
    data = e.manager.get_stats().data["data"]
    dropped = data["vllm:kv_offload_tiering_backpressure_blocks_dropped"][("1:fs",)]
    assert dropped == 12 - 4 - 4  # 16 rows x 0.25 = 4 rows may be pinned, 4 keys wait
    assert len(list(tmp_path.rglob("*.kv"))) == 8


def test_one_step_of_promotions_is_one_pool_job_and_each_request_gets_its_outcomes(
        engines, tmp_path):
    """Promotions of several requests queued in one step reach the workers as one
    pool job (one ring put and wake-up per worker), yet each request's job is
    reported on its own: a corrupt file fails only the job of the request that
    asked for it."""
    e = engines(tmp_path, chunks=4)
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    victim = next(p for p in tmp_path.rglob("*.kv") if keys[3].hex() in p.name)
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    e.offload([key(10 + i) for i in range(4)], 4, ReqContext("b"))  # evict all four
    e.settle()
    pool = e.spec.worker_pool
    submitted = []
    real_submit = pool.submit

    def counting_submit(op, tier, job_keys, *args, **kw):
        submitted.append((op, list(job_keys)))
        return real_submit(op, tier, job_keys, *args, **kw)

    pool.submit = counting_submit
    try:
        r1, r2 = ReqContext("r1"), ReqContext("r2")
        m = e.manager
        with m.lock:
            assert [m.lookup(k, r1) for k in keys[:2]] == [PENDING, PENDING]
            assert [m.lookup(k, r2) for k in keys[2:]] == [PENDING, PENDING]
            m.on_schedule_end(END)
        assert [(op, sorted(ks)) for op, ks in submitted] == [("load", sorted(keys))]
        e.settle()
    finally:
        pool.submit = real_submit
    with m.lock:
        assert [m.lookup(k, r1) for k in keys[:2]] == [HIT, HIT]
        assert [m.lookup(k, r2) for k in keys[2:]] == [HIT, MISS]
    data = m.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_promotion_job_failures"][("1:fs",)] == 1
    assert data[fs_tier.CORRUPT_CHUNKS][("1:fs",)] == 1


def test_workers_that_never_start_break_the_tier_which_then_misses_fast(engines, tmp_path,
                                                                        caplog):
    """The root passed the spec's checks, but the tier workers cannot use it (the
    namespace directory holds a config.json of another format: another program's files,
    never an outage to wait out): the pool breaks within a bounded time and says so
    once; the fs tier then answers MISS and fails jobs at once, the scheduler's calls stay
    fast, the CPU tier keeps serving, and nothing is left behind."""
    import json

    from shmtier.tiers.fs.namespace import namespace_dir_name

    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    probe = TieringOffloadingSpec({"cpu_bytes_to_use": 16 * 8192, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path)}]}, layout, "never-built")
    ns = tmp_path / namespace_dir_name(probe.fingerprint)
    ns.mkdir()
    (ns / "config.json").write_text(json.dumps({"format": "another-program",
                                                "format_version": 7}))
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    e = engines(tmp_path)
    pool = e.spec.worker_pool
    ctx, durations = ReqContext("a"), []
    while pool.broken is None:
        t = time.perf_counter()
        with e.manager.lock:
            e.manager.lookup(key(1), ctx)
            e.manager.on_schedule_end(END)
        durations.append(time.perf_counter() - t)
        assert time.monotonic() - started < 20, "the pool never broke"
        time.sleep(0.005)
    assert "cannot build its tier backends" in pool.broken
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("b"))  # cascades to the broken tier fail at once
    e.settle(timeout_s=5)
    for _ in range(20):
        t = time.perf_counter()
        with e.manager.lock:
            answers = [e.manager.lookup(key(100 + i), ReqContext("c")) for i in range(4)]
            e.manager.on_schedule_end(END)
        durations.append(time.perf_counter() - t)
        assert answers == [MISS] * 4  # not RETRY: nothing waits on a broken tier
    with e.manager.lock:
        assert all(e.manager.lookup(k, ReqContext("d")) is HIT for k in keys)  # CPU copy intact
    durations.sort()
    assert durations[len(durations) // 2] < 0.002, f"median step {durations[len(durations) // 2]}"
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.POOL_BROKEN][("1:fs",)] == 1
    assert data["vllm:kv_offload_tiering_cascade_job_failures"][("1:fs",)] >= 1
    broken_logs = [r for r in caplog.records if r.levelno >= logging.ERROR
                   and r.name.startswith("shmtier.scheduler.pool")]
    assert len(broken_logs) == 1, [r.getMessage() for r in broken_logs]
    e.close()
    assert not worker_processes(e.spec.engine_id)


def _root_deleted_and_recreated(engines, tmp_path):
    """An engine whose fs root is deleted (with the chunks it held) and made again by the
    operator while it runs; then new cascades. Returns (engine, root, fs tier, old keys,
    new keys, the pool results the fs tier took)."""
    import shutil

    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=8)
    tier = e.manager.tiers[0]
    taken = e.record_pool_results()
    old = [key(i) for i in range(4)]
    e.offload(old, 0, ReqContext("a"))
    e.settle()
    assert len(list(root.rglob("*.kv"))) == 4
    shutil.rmtree(root)
    root.mkdir()
    new = [key(10 + i) for i in range(4)]
    e.offload(new, 4, ReqContext("b"))
    e.settle()
    return e, root, tier, old, new, taken


class _HeldAnswers:
    """Holds back the fs tier's pool results that ``which(result)`` picks, from the moment
    it is made: ``wait()`` steps the engine until one came and returns it, ``release()``
    delivers what was held with the next results, as a slow answer would arrive.
    Everything else passes through."""

    def __init__(self, e, which):
        self.e, self.tier, self.pool = e, e.manager.tiers[0], e.spec.worker_pool
        self.which = which
        self.real_take, self.held = self.pool.take, []
        self.pool.take = self._take

    @classmethod
    def listings(cls, e) -> "_HeldAnswers":
        """The listing the tier waits for."""
        tier = e.manager.tiers[0]
        return cls(e, lambda r: r.job_id == tier._scan_id)

    @classmethod
    def of(cls, e, op: str) -> "_HeldAnswers":
        """The tier's ``op`` jobs (``"store"``, ``"lookup"``: a lookup's probes...)."""
        tier = e.manager.tiers[0]
        return cls(e, lambda r: tier._jobs.get(r.job_id, ("",))[0] == op)

    def _take(self, t):
        got = self.real_take(t)
        picked = [r for r in got if self.which(r)]
        self.held.extend(picked)
        return [r for r in got if r not in picked]

    def wait(self, timeout_s: float = 20.0, each_step=None):
        """Step the engine (``each_step()`` first, under the lock) until one was held."""
        deadline = time.monotonic() + timeout_s
        while not self.held:
            with self.e.manager.lock:
                if each_step is not None:
                    each_step()
                self.e.manager.on_schedule_end(END)
            assert time.monotonic() < deadline, "the answer never came"
            time.sleep(0.005)
        return self.held[0]

    def pass_on(self) -> None:
        """Results pass from now on; those held still wait for ``release``."""
        self.pool.take = self.real_take

    def release(self) -> None:
        def take(t):
            got = self.held + self.real_take(t)
            self.held.clear()
            self.pool.take = self.real_take
            return got

        self.pool.take = take


def test_a_listing_that_reports_the_reset_itself_loses_no_chunk_stored_meanwhile(
        engines, tmp_path):
    """A listing taken by a worker that had not seen the namespace change yet carries
    NAMESPACE_RESET itself. Chunks another worker stored into the new namespace after
    that walk passed their directory, reported before the listing, must stay indexed
    (found again by a new listing), not be dropped with the old index: else they are
    files on disk that neither the index nor the bytes gauge knows (seen in a stress run
    with the root deleted under two workers). Made deterministic here: the real listing
    of the real worker is held back until a later store was indexed, then delivered
    flagged as that stale worker would have sent it."""
    import shutil

    from shmtier.shared.jobs import ResultFlag

    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=16)
    tier = e.manager.tiers[0]
    e.offload([key(i) for i in range(4)], 0, ReqContext("a"))
    e.settle()  # (the start-up listing too)
    listings = _HeldAnswers.listings(e)
    shutil.rmtree(root)
    root.mkdir()
    first = [key(10 + i) for i in range(4)]
    e.offload(first, 4, ReqContext("b"))  # makes the namespace again: reset, listing sent
    listing = listings.wait()
    later = [key(20 + i) for i in range(4)]  # stored after the walk, reported before it
    e.offload(later, 8, ReqContext("c"))
    e.steps_until(lambda: all(k in tier._index for k in later),
                  "the later store was never indexed")
    assert not set(later) & set(listing.listed)
    # what a worker that had not synced sends
    listings.held[0] = listing._replace(flags=listing.flags | ResultFlag.NAMESPACE_RESET)
    listings.release()
    e.settle()
    files = _assert_index_is_the_disk(tier, root)
    assert set(files) == set(first) | set(later)
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] == sum(files.values())


def _reset_then_answer_late(e, tier, root, held: _HeldAnswers) -> dict:
    """The operator removes the namespace (the whole root, made again empty); a new
    store makes it anew and reports the reset, which the tier takes, and the new chunks
    are indexed; only then do the ``held`` answers arrive. Returns the files once the
    tier settled (the index is exactly them)."""
    import shutil

    shutil.rmtree(root)
    root.mkdir()
    held.pass_on()
    new = [key(10 + i) for i in range(4)]
    e.offload(new, 4, ReqContext("b"))  # makes the namespace again: reset
    e.steps_until(lambda: all(k in tier._index for k in new),
                  "the new store was never indexed")
    assert tier.namespace_resets >= 1
    held.release()  # the old answers arrive now, as slow ones would
    e.settle()
    files = _assert_index_is_the_disk(tier, root)
    assert set(files) == set(new)
    return files


def test_a_store_answered_after_the_namespace_was_reset_is_probed_not_indexed(
        engines, tmp_path):
    """A cascade published into the namespace, which the operator then removed; another
    worker's op reports the reset (the index dropped, the root listed again) before the
    cascade's own answer comes. That answer describes files gone with the old
    namespace: indexing them would leave indexed chunks without a file, which a listing
    never removes (seen in the chaos run: "indexed chunks without a file: 2"). Its keys
    are probed instead: MISS, and the index is what is on disk. Made deterministic here:
    the real store answer of the real worker is held back until the reset was taken."""
    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=16)
    tier = e.manager.tiers[0]
    e.settle()  # the start-up listing
    held = _HeldAnswers.of(e, "store")
    old = [key(i) for i in range(4)]
    e.offload(old, 0, ReqContext("a"))
    held.wait()
    assert len(list(root.rglob("*.kv"))) == 4  # published, answer held back
    files = _reset_then_answer_late(e, tier, root, held)
    assert _tier_answers_settled(e, tier, old) == [MISS] * 4
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] == sum(files.values())


def test_a_probe_answered_after_the_namespace_was_reset_is_not_adopted(engines, tmp_path):
    """A lookup's probe found a chunk another engine stored (the probe's stat saw the
    file); the operator then removed the namespace, and another op reported the reset
    before the probe's answer came. That answer describes a file gone with the old
    namespace: adopting it would leave an indexed chunk without a file (the chaos run's
    "indexed chunks without a file: 2" under load, after the store case was fixed). It
    is not adopted and the next lookup probes again: MISS. The real probe answer of the
    real worker is held back until the reset was taken."""
    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=16)
    tier = e.manager.tiers[0]
    e.settle()  # the start-up listing: nothing yet
    other = engines(root, chunks=16)
    old = [key(i) for i in range(4)]
    other.offload(old, 0, ReqContext("a"))
    other.settle()
    assert len(list(root.rglob("*.kv"))) == 4 and not any(k in tier._index for k in old)
    held = _HeldAnswers.of(e, "lookup")

    def looked_up():  # the lookup probes the unknown keys; its answer (found) held back
        assert [tier.lookup(k, ReqContext("r")) for k in old] == [RETRY] * 4

    assert list(held.wait(each_step=looked_up).outcomes) == [Outcome.OK] * 4
    _reset_then_answer_late(e, tier, root, held)
    assert _tier_answers_settled(e, tier, old) == [MISS] * 4


def test_an_indexed_chunk_a_listing_removed_as_a_foreign_file_is_probed(engines, tmp_path):
    """A listing sent while chunks are indexed (after a namespace reset, the reset's own
    answer indexes what it stored) walks past one of them that was meanwhile replaced by
    a file too big for any chunk: the worker removes that foreign file and leaves it out.
    The key must not stay indexed without a file (the chaos run under load: "indexed
    chunks without a file: 2", the two planted big files): a key indexed when the
    listing was sent and not in it is probed, MISS, forgotten. The listing is sent here
    by the tier's own method, under the manager's lock, as the reset sends it."""
    from shmtier.stress import faults

    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=16)
    tier = e.manager.tiers[0]
    e.settle()  # the start-up listing
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    assert all(k in tier._index for k in keys)
    (path,) = [p for p in root.rglob("*.kv") if p.name.startswith(keys[2].hex())]
    assert faults.plant_big(str(path)) is not None
    with e.manager.lock:
        tier._list_medium()
    # its answer taken in the steps
    e.steps_until(lambda: not tier._ledger.listing, "the listing was never answered")
    e.settle()
    assert not path.exists()  # the listing took it for a foreign file
    files = _assert_index_is_the_disk(tier, root)
    assert set(files) == set(keys) - {keys[2]}
    assert _tier_answers_settled(e, tier, keys) == [HIT, HIT, MISS, HIT]


def test_a_chunk_found_corrupt_while_the_listing_was_out_is_not_listed_back(engines, tmp_path):
    """A start-up listing walks past a chunk file; before its answer is taken, a lookup
    probes that chunk, a load finds it corrupt and the worker removes it. The listing
    must not put it back into the index (a chunk without a file, counted in the bytes
    gauge). The real listing is held back until then, as a slow answer would be."""
    root = tmp_path / "root"
    root.mkdir()
    writer = engines(root, chunks=8)
    keys = [key(i) for i in range(3)]
    writer.offload(keys, 0, ReqContext("a"))
    writer.settle()
    path = next(p for p in root.rglob("*.kv") if p.name.startswith(keys[0].hex()))
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF  # a payload byte: the load's checksum fails
    path.write_bytes(bytes(damaged))
    e = engines(root, chunks=8)
    tier = e.manager.tiers[0]
    listings = _HeldAnswers.listings(e)  # before any call takes a result: the start-up listing too
    # the listing has walked the root (all three files there)
    assert set(keys) <= set(listings.wait().listed)
    assert e.answers_settled([keys[0]], ReqContext("r")) == [MISS]  # probed, loaded: corrupt
    assert not path.exists()
    listings.release()
    e.settle()
    files = _assert_index_is_the_disk(tier, root)
    assert set(files) == set(keys[1:])


def test_cascades_work_again_once_a_deleted_root_is_back(engines, tmp_path):
    """Issue 11 item 5 (worker half), end to end through the tier workers: after the root
    was deleted and made again, the next cascade recreates the namespace and is stored
    (it failed with ENOENT until a restart), and the workers tell the scheduler half
    (``ResultFlag.NAMESPACE_RESET`` on a pool result)."""
    from shmtier.shared.jobs import ResultFlag

    e, root, tier, old, new, taken = _root_deleted_and_recreated(engines, tmp_path)
    on_disk = {bytes.fromhex(p.name[:-len(".kv")]) for p in root.rglob("*.kv")}
    assert on_disk == set(new)
    stores = [r for r in taken if r.op == "store"]
    assert stores[-1].outcomes == [Outcome.OK] * 4, stores[-1].error
    assert any(r.flags & ResultFlag.NAMESPACE_RESET for r in taken)


def _tier_answers_settled(e, tier, keys, timeout_s=20.0):
    """``tier``'s own answers for ``keys``, asked once per step until none is RETRY."""
    deadline = time.monotonic() + timeout_s
    while True:
        with e.manager.lock:
            e.manager.lookup(keys[0], ReqContext("r"))  # takes the tiers' results first
            answers = [tier.lookup(k, ReqContext("r")) for k in keys]
            e.manager.on_schedule_end(END)
        if RETRY not in answers or time.monotonic() > deadline:
            return answers
        time.sleep(0.005)


def test_a_reset_namespace_drops_the_index_and_is_listed_again(engines, tmp_path):
    """Issue 11 item 5 (scheduler half): on NAMESPACE_RESET the fs tier drops its index
    (the old chunks are gone: MISS, not HIT then a failed load) and lists the root
    again, so the index and the bytes-on-disk gauge are what is on disk."""
    e, root, tier, old, new, taken = _root_deleted_and_recreated(engines, tmp_path)
    files = _assert_index_is_the_disk(tier, root)
    assert set(files) == set(new)
    data = e.manager.get_stats().data["data"]
    assert data[fs_tier.BYTES_ON_DISK][("1:fs",)] == sum(files.values())
    # not known any more: probed (RETRY) and found absent
    assert _tier_answers_settled(e, tier, old) == [MISS] * 4


def _namespace_path(e, root):
    from shmtier.tiers.fs.namespace import namespace_dir_name

    return root / namespace_dir_name(e.spec.fingerprint)


def _restart_every_worker(e) -> None:
    """SIGKILL each tier worker in turn and wait until the pool has replaced it (its
    replacement built its backend and beats); the pool must not break meanwhile."""
    pool = e.spec.worker_pool
    for slot, pid in pool.healthy_workers():
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any(s == slot and p != pid for s, p in pool.healthy_workers()):
            assert pool.broken is None, pool.broken
            assert time.monotonic() < deadline, "the worker was not replaced"
            with e.manager.lock:
                e.manager.on_schedule_end(END)
            time.sleep(0.02)


@pytest.mark.parametrize("in_the_way", ["symlink", "file"])
def test_a_namespace_replaced_by_a_link_or_a_file_is_an_outage_the_tier_recovers_from(
        engines, tmp_path, in_the_way, caplog):
    """Issue 28 item 5: the namespace directory replaced by a symlink (or a plain file)
    while the engine runs, then every tier worker restarted: the replacements start (they
    failed 3 times within 30 s and the pool broke for good, even after the link was
    removed); the tier refuses the link (nothing read or written through it), answers
    MISS, fails cascades cleanly; once the path is free again the next cascades make the
    namespace and promote byte-exact."""
    import shutil

    root = tmp_path / "root"
    root.mkdir()
    e = engines(root, chunks=8, workers=2)
    tier = e.manager.tiers[0]
    old = [key(i) for i in range(4)]
    e.offload(old, 0, ReqContext("a"))
    e.settle()
    path = _namespace_path(e, root)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(path, elsewhere)  # the chunks are out of the tier's reach now
    if in_the_way == "symlink":
        os.symlink(elsewhere, path)
    else:
        path.write_text("not a directory")
    caplog.set_level(logging.WARNING)
    _restart_every_worker(e)
    e.offload([key(10 + i) for i in range(8)], 4, ReqContext("b"))  # old ones out of the CPU
    e.settle()
    assert e.spec.worker_pool.broken is None
    assert _tier_answers_settled(e, tier, old) == [MISS] * 4  # nothing through the link
    assert sorted(p.name for p in elsewhere.rglob("*.kv")) == sorted(
        k.hex() + ".kv" for k in old)  # nothing written through it either
    with e.manager.lock:
        assert e.manager.lookup(old[0], ReqContext("c")) is MISS
    assert not any("cannot build its tier backends" in r.getMessage() for r in caplog.records)
    os.unlink(path)
    resumed = [key(20 + i) for i in range(4)]
    e.offload(resumed, 12, ReqContext("d"))
    e.settle()
    assert path.is_dir() and not path.is_symlink()
    assert {bytes.fromhex(p.name[:-3]) for p in path.rglob("*.kv")} >= set(resumed)
    e.offload([key(30 + i) for i in range(8)], 16, ReqContext("e"))  # out of the CPU tier
    e.settle()
    reader = ReqContext("reader")
    e.until_hit(resumed, reader)
    got = e.load(resumed, reader, list(range(GPU_BLOCKS - 4, GPU_BLOCKS)))
    assert torch.equal(got, e.originals[0][12:16])
    assert e.spec.worker_pool.broken is None


def test_a_fresh_engine_on_a_root_whose_namespace_is_a_link_starts_and_recovers(
        engines, tmp_path):
    """Issue 28 item 5, at start: an engine whose namespace path is a symlink (it was
    broken from the start: its workers never started) runs without the tier's chunks
    (MISS; cascades fail), and once the link is removed stores and promotes."""
    from shmtier.tiers.fs.namespace import namespace_dir_name

    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    probe = TieringOffloadingSpec({"cpu_bytes_to_use": 16 * 8192, "secondary_tiers": [
        {"type": "fs", "root_dir": str(root)}]}, layout, "never-built")
    path = root / namespace_dir_name(probe.fingerprint)
    os.symlink(elsewhere, path)
    e = engines(root, chunks=8, workers=2)
    tier = e.manager.tiers[0]
    keys = [key(i) for i in range(4)]
    e.offload(keys, 0, ReqContext("a"))
    e.settle()
    assert e.spec.worker_pool.broken is None
    assert list(elsewhere.iterdir()) == []
    assert not set(tier.indexed_chunks()) & set(keys)
    os.unlink(path)
    later = [key(10 + i) for i in range(4)]
    e.offload(later, 4, ReqContext("b"))
    e.settle()
    e.offload([key(20 + i) for i in range(8)], 8, ReqContext("c"))  # out of the CPU tier
    e.settle()
    reader = ReqContext("reader")
    e.until_hit(later, reader)
    got = e.load(later, reader, list(range(GPU_BLOCKS - 4, GPU_BLOCKS)))
    assert torch.equal(got, e.originals[0][4:8])
    assert e.spec.worker_pool.broken is None
