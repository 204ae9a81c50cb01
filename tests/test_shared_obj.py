"""Issue 12, the ``obj`` tier end to end: engines (scheduler, GPU ranks, tier worker
processes) on a real S3 server on 127.0.0.1 (SeaweedFS for round trips, sharing and a
killed server; moto where 5xx and slow answers are injected)."""

from __future__ import annotations

import time

import pytest
from fs_engine import END, GPU_BLOCKS, HIT, MISS, PENDING, RETRY, engines, key  # noqa: F401
import torch

from shmtier.config import ConfigError, KVLayout
from shmtier.contract import ReqContext
from shmtier.spec import TieringOffloadingSpec
from shmtier.storage import tier_metrics
from shmtier.tiers.obj import scheduler as obj_tier

LABEL = ("1:obj",)


def obj(server, bucket, **options):
    """Engine options for an obj tier on ``bucket`` of ``server``."""
    return {"tier_type": "obj", "store_config": server.store_config(bucket), **options}


def _objects(server, bucket) -> dict[str, int]:
    client = server.client()
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}
    finally:
        client.close()


@pytest.mark.parametrize("world_size, bpc, page", [(1, 1, 8192), (2, 2, 4096)])
def test_bytes_round_trip_through_a_bucket_and_back(engines, tmp_path, seaweedfs_s3,
                                                    world_size, bpc, page):
    bucket = seaweedfs_s3.new_bucket("rt")
    e = engines(tmp_path, world_size=world_size, bpc=bpc, page=page, chunks=8,
                **obj(seaweedfs_s3, bucket, prefix="kv/a/"))
    first = [key(i) for i in range(8)]
    e.offload(first, 0, ReqContext("a"))
    e.settle()
    e.offload([key(100 + i) for i in range(8)], 8 * bpc, ReqContext("b"))  # evicts "a"
    e.settle()
    reader = ReqContext("r")
    e.until_hit(first, reader)
    dst = list(range(GPU_BLOCKS - 8 * bpc, GPU_BLOCKS))
    with e.manager.lock:
        spec = e.manager.prepare_load(first, reader)
    for cache in e.caches:
        cache[dst] = 0
    e.copy("load", spec, dst)
    for cache, original in zip(e.caches, e.originals):
        assert torch.equal(cache[dst], original[: 8 * bpc])
    objects = _objects(seaweedfs_s3, bucket)
    chunks = {k: v for k, v in objects.items() if k.endswith(".kv")}
    assert len(chunks) == 16 and all(k.startswith("kv/a/shmtier-") for k in chunks)
    assert not any("//" in k for k in objects)
    data = e.manager.get_stats().data["data"]
    assert data[obj_tier.BYTES_STORED][LABEL] == sum(chunks.values())
    assert data["vllm:kv_offload_tiering_read_bytes"][LABEL] > 0


def test_an_engine_promotes_chunks_another_stored_in_the_bucket(engines, tmp_path,
                                                                seaweedfs_s3):
    bucket = seaweedfs_s3.new_bucket("share")
    b = engines(tmp_path, chunks=24, **obj(seaweedfs_s3, bucket))
    b.settle()  # B's listing of the empty bucket has landed
    a = engines(tmp_path, chunks=24, **obj(seaweedfs_s3, bucket))
    keys = [key(i) for i in range(16)]
    a.offload(keys, 0, ReqContext("a"))
    a.settle()
    ctx = ReqContext("b")
    seen = b.until_hit(keys, ctx)
    assert seen[0] == [RETRY] * 16  # HEAD in B's workers first
    assert torch.equal(b.load(keys, ctx, list(range(40, 56))), a.originals[0][:16])
    data = b.manager.get_stats().data["data"]
    assert data[tier_metrics.PROBE_HITS][LABEL] == 16


def test_a_corrupt_object_is_a_miss_on_both_engines(engines, tmp_path, seaweedfs_s3):
    bucket = seaweedfs_s3.new_bucket("corrupt")
    a = engines(tmp_path, chunks=4, **obj(seaweedfs_s3, bucket))
    b = engines(tmp_path, chunks=8, **obj(seaweedfs_s3, bucket))
    keys = [key(i) for i in range(4)]
    a.offload(keys, 0, ReqContext("a"))
    a.settle()
    a.offload([key(100 + i) for i in range(4)], 4, ReqContext("a2"))  # keys leave A's CPU
    a.settle()
    (name,) = [k for k in _objects(seaweedfs_s3, bucket) if k.endswith(keys[0].hex() + ".kv")]
    client = seaweedfs_s3.client()
    try:
        body = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
        body[-5] ^= 0xFF
        client.put_object(Bucket=bucket, Key=name, Body=bytes(body))
    finally:
        client.close()
    for engine in (b, a):
        ctx = ReqContext(f"r{id(engine)}")
        assert engine.answers_settled(keys, ctx) == [MISS, HIT, HIT, HIT]
        assert torch.equal(engine.load(keys[1:], ctx, [40, 41, 42]), a.originals[0][1:4])
    assert name not in _objects(seaweedfs_s3, bucket)  # deleted by the engine that found it


def test_an_engine_deleting_objects_while_another_loads_them_never_gives_wrong_bytes(
        engines, tmp_path, seaweedfs_s3):
    bucket = seaweedfs_s3.new_bucket("evict")
    one = 8192 + 200
    a = engines(tmp_path, chunks=8, **obj(seaweedfs_s3, bucket, max_bytes=6 * one))
    b = engines(tmp_path, chunks=8, **obj(seaweedfs_s3, bucket))
    blocks, loaded, missed = {}, 0, 0
    for rnd in range(8):
        new = [key(1000 + 4 * rnd + i) for i in range(4)]
        first = 4 * rnd
        a.offload(new, first, ReqContext(f"a{rnd}"))
        a.settle()
        blocks.update({k: first + i for i, k in enumerate(new)})
        a.offload([key(5000 + 4 * rnd + i) for i in range(4)], GPU_BLOCKS - 8, ReqContext("x"))
        recent = list(blocks)[-8:]
        ctx = ReqContext(f"b{rnd}")
        answers = b.answers_while(a, recent, ctx)  # A's cascades evict objects meanwhile
        hits = [k for k, ans in zip(recent, answers) if ans is HIT]
        missed += len(recent) - len(hits)
        if hits:
            got = b.load(hits, ctx, list(range(48, 48 + len(hits))))
            for row, k in zip(got, hits):
                assert torch.equal(row, a.originals[0][blocks[k]]), "wrong bytes served"
            loaded += len(hits)
        a.settle()
        b.settle()
    assert loaded > 0 and missed > 0, (loaded, missed)
    assert sum(_objects(seaweedfs_s3, bucket).get(k, 0) for k in
               _objects(seaweedfs_s3, bucket) if k.endswith(".kv")) <= 6 * one


def _timed(durations, fn):
    t = time.perf_counter()
    out = fn()
    durations.append(time.perf_counter() - t)
    return out


def test_a_killed_server_fails_jobs_cleanly_and_the_tier_recovers(engines, tmp_path,
                                                                   seaweedfs_s3_killable):
    server = seaweedfs_s3_killable
    bucket = server.new_bucket("kill")
    e = engines(tmp_path, chunks=8, **obj(server, bucket, max_attempts=2,
                                          connect_timeout_s=0.5, read_timeout_s=2.0,
                                          probe_timeout_s=5.0))
    stored = [key(i) for i in range(4)]
    e.offload(stored, 0, ReqContext("a"))
    e.settle()
    server.kill()
    durations = []
    m = e.manager
    # cascades fail cleanly (the CPU copies stay), promotions of indexed keys fail, and
    # lookups of unknown keys end in MISS; no scheduler call waits on the network
    e.offload([key(100 + i) for i in range(4)], 4, ReqContext("b"))
    e.offload([key(200 + i) for i in range(4)], 8, ReqContext("c"))  # stored evicted from CPU
    deadline = time.monotonic() + 30
    ctx = ReqContext("r")
    while True:
        with m.lock:
            answers = _timed(durations, lambda: [m.lookup(k, ctx) for k in stored + [key(999)]])
            _timed(durations, lambda: m.on_schedule_end(END))
        with m.lock:
            pending = _timed(durations, m.has_pending_work)
        if not pending and PENDING not in answers and RETRY not in answers:
            break
        assert time.monotonic() < deadline, answers
        time.sleep(0.005)
    assert answers == [MISS] * 5  # loads failed, unknown key not found: never wrong bytes
    durations.sort()
    assert durations[len(durations) // 2] < 0.002 and durations[-1] < 0.25, durations[-5:]
    server.start()
    fresh = [key(300 + i) for i in range(4)]
    e.offload(fresh, 12, ReqContext("d"))
    e.settle(timeout_s=30)
    assert sum(k.endswith(".kv") for k in _objects(server, bucket)) >= 4  # stores work again


def test_5xx_and_slow_answers_are_retried_then_backpressure_drops_cascades(engines, tmp_path,
                                                                           moto_faults):
    server = moto_faults
    bucket = server.new_bucket("faults")
    e = engines(tmp_path, chunks=64, **obj(server, bucket, max_attempts=3,
                                           read_timeout_s=2.0, backpressure={}))
    server.faults.fail_next(2, methods=("PUT",))  # retried: the cascade succeeds
    e.offload([key(i) for i in range(2)], 0, ReqContext("ok"))
    e.settle(timeout_s=30)
    assert sum(k.endswith(".kv") for k in _objects(server, bucket)) == 2
    server.faults.fail_fraction(1.0, methods=("PUT",))  # every PUT fails: 5xx
    durations = []
    for rnd in range(8):
        keys = [key(100 + 2 * rnd + i) for i in range(2)]
        t = time.perf_counter()
        e.offload(keys, 2 + 2 * rnd, ReqContext(f"f{rnd}"))
        durations.append(time.perf_counter() - t)
        e.settle(timeout_s=30)
    data = e.manager.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_backpressure_stores_dropped"][LABEL] >= 1
    assert max(durations) < 0.25  # the scheduler side never waited on the store
    assert sum(k.endswith(".kv") for k in _objects(server, bucket)) == 2


def test_wrong_credentials_or_a_missing_bucket_fail_at_start_naming_endpoint_and_bucket(
        engine_id, seaweedfs_s3):
    layout = KVLayout("m", "bfloat16", 16, 8192, 1)
    bucket = seaweedfs_s3.new_bucket("creds")
    cases = [(seaweedfs_s3.store_config(bucket, secret_key="s3cr3t-not-shown"), bucket),
             (seaweedfs_s3.store_config("no-such-bucket-here"), "no-such-bucket-here")]
    for store_config, name in cases:
        with pytest.raises(ConfigError) as e:
            TieringOffloadingSpec({"cpu_bytes_to_use": 16 * 8192, "secondary_tiers": [
                {"type": "obj", "store_config": store_config}]}, layout, engine_id)
        text = str(e.value)
        assert name in text and seaweedfs_s3.host_port in text, text
        assert "s3cr3t" not in text  # the secret is never shown


def test_slow_answers_raise_the_store_latency_until_backpressure_drops_cascades(
        engines, tmp_path, moto_faults):
    server = moto_faults
    bucket = server.new_bucket("slow")
    e = engines(tmp_path, chunks=64, **obj(server, bucket, read_timeout_s=5.0,
                                           backpressure={"warmup_completions": 2}))
    server.faults.slow(0.4, methods=("PUT",))  # 8 KiB in 0.4 s: ~50 s/MiB, far past high water
    durations = []
    for rnd in range(6):
        t = time.perf_counter()
        e.offload([key(10 * rnd)], rnd, ReqContext(f"s{rnd}"))
        durations.append(time.perf_counter() - t)
        e.settle(timeout_s=30)
    data = e.manager.get_stats().data["data"]
    assert data["vllm:kv_offload_tiering_backpressure_stores_dropped"][LABEL] >= 1
    assert max(durations) < 0.25  # the scheduler side never waited on the slow store
    stored = sum(k.endswith(".kv") for k in _objects(server, bucket))
    assert 2 <= stored < 6  # the warm-up cascades went (slowly), later ones were dropped
