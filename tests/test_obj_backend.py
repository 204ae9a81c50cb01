"""The obj tier's config and worker half (shmtier/tiers/obj/) against real S3 servers.

Every test talks real HTTP to a real S3 implementation on 127.0.0.1 (``s3_servers.py``):
SeaweedFS (authentication, kill and restart) or moto's S3 behind a fault-injecting
WSGI layer (5xx, slow answers). Corruption is made by overwriting objects through
boto3, as bit rot, a torn upload or a misplaced object would leave them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import pytest

from s3_servers import free_port
from shmtier.options import ConfigError
from shmtier.shared.codec import CompressionConfig, parse_frame_header
from shmtier.shared.jobs import Outcome
from shmtier.storage.chunk_names import namespace_dir_name
from shmtier.tiers.backend import WorkerContext
from shmtier.tiers.config import TierContext
from shmtier.tiers.obj.backend import ObjBackend
from shmtier.tiers.obj.config import ObjTierConfig

# what an object holds, not whether "auto" compresses on a busy host (test_codec_choice.py)
pytestmark = pytest.mark.usefixtures("idle_host")

FP = "model=test-model|dtype=bfloat16|block=16x4|tp=1|codec=1"
OK, MISS, ERROR, CORRUPT, REJECTED, EXISTS, INVALID = Outcome
PAD = 0xA5
WHERE = "secondary_tiers[0]"


def bf16_arena(n: int, row_stride: int, chunk_bytes: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arena = np.full((n, row_stride), PAD, dtype=np.uint8)
    even = chunk_bytes - chunk_bytes % 2
    for r in range(n):
        f = rng.standard_normal(even // 2, dtype=np.float32)
        arena[r, :even] = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        if chunk_bytes % 2:
            arena[r, chunk_bytes - 1] = 7
    return arena


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    rng = np.random.default_rng(1000 + tag)
    return [rng.bytes(32) + (i % 3).to_bytes(4, "big") for i in range(n)]


def tier_config(server, bucket: str, **options) -> ObjTierConfig:
    opts = {"store_config": server.store_config(bucket)}
    opts.update(options)
    return ObjTierConfig.from_options(opts, where=WHERE,
                                      context=TierContext(chunk_bytes=4096, key_bytes=36))


@contextmanager
def obj_backend(server, bucket: str, *, chunk_bytes: int = 4096, mode: str = "auto",
                **options):
    config = tier_config(server, bucket, **options)
    b = ObjBackend.open(config, WorkerContext(FP, chunk_bytes, 2, CompressionConfig(mode=mode)))
    try:
        yield b
    finally:
        b.close()


def bucket_keys(server, bucket: str) -> list[str]:
    c = server.client()
    try:
        out = []
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            out += [o["Key"] for o in page.get("Contents", ())]
        return out
    finally:
        c.close()


# --------------------------------------------------------------------------- config


def test_config_accepts_vllms_obj_config_unchanged(moto_s3):
    bucket = moto_s3.new_bucket()
    vllm = {"store_config": {"bucket": bucket, "endpoint_override": moto_s3.host_port,
                             "access_key": "AKIAEXAMPLE", "secret_key": "very-secret-value",
                             "scheme": "http"},
            "prefix": "a/b/", "io_threads": 4, "enable_kv_events": False,
            "locality": "REMOTE"}
    cfg = ObjTierConfig.from_options(vllm, where=WHERE)
    assert cfg.prefix == "a/b" and cfg.io_threads == 4 and cfg.locality == "REMOTE"
    assert cfg.store_config.endpoint_override == moto_s3.endpoint
    assert "very-secret-value" not in repr(cfg) and "very-secret-value" not in str(cfg)
    plain = cfg.to_dict()
    assert plain["store_config"] == {
        "bucket": bucket, "endpoint_override": moto_s3.endpoint, "access_key": "AKIAEXAMPLE",
        "secret_key": "very-secret-value", "session_token": "", "region": "",
        "scheme": "http", "ca_bundle": ""}
    assert {k: plain[k] for k in ("prefix", "io_threads", "max_bytes", "connect_timeout_s",
                                  "read_timeout_s", "max_attempts")} == {
        "prefix": "a/b", "io_threads": 4, "max_bytes": None, "connect_timeout_s": 2.0,
        "read_timeout_s": 10.0, "max_attempts": 4}
    import msgpack
    # plain data for the workers, read back there into the same frozen config
    assert ObjTierConfig.from_dict(msgpack.unpackb(msgpack.packb(plain))) == cfg
    # an endpoint with its scheme, odd slashes in the prefix, a MAC key
    cfg = ObjTierConfig.from_options(
        {"store_config": moto_s3.store_config(bucket, endpoint_override=moto_s3.endpoint + "/",
                                              scheme=""),
         "prefix": "//x//y/", "mac_key": "ab" * 32}, where=WHERE)
    assert cfg.prefix == "x/y" and cfg.store_config.endpoint_override == moto_s3.endpoint
    assert ObjTierConfig.from_dict(cfg.to_dict()).mac_secret == bytes.fromhex("ab" * 32)
    assert "abab" not in repr(cfg)


@pytest.mark.parametrize("options,needles", [
    ({"store_config": {"bucket": "kv"}}, ["store_config.bucket", "'kv'", "3..63"]),
    ({"store_config": {"bucket": "Bad_Name"}}, ["store_config.bucket", "lower-case"]),
    ({"store_config": {"bucket": "kvcache", "endpont_override": "x"}},
     ["store_config.endpont_override", "did you mean 'endpoint_override'", "accepted keys"]),
    ({"store_config": {"bucket": "kvcache", "scheme": "ftp"}},
     ["store_config.scheme", "'ftp'", "'http' or 'https'"]),
    ({"store_config": {"bucket": "kvcache", "endpoint_override": "127.0.0.1:99999"}},
     ["store_config.endpoint_override", "99999", "host:port"]),
    ({"store_config": {"bucket": "kvcache", "endpoint_override": "ftp://h:1"}},
     ["store_config.endpoint_override", "scheme 'ftp'"]),
    ({"store_config": {"bucket": "kvcache", "ca_bundle": "/nonexistent/ca.pem"}},
     ["store_config.ca_bundle", "/nonexistent/ca.pem", "CA bundle"]),
    ({"store_config": {"bucket": "kvcache", "access_key": "AK"}},
     ["store_config", "access_key and secret_key go together"]),
    ({"store_config": {"bucket": "kvcache", "secret_key": 12345}},
     ["store_config.secret_key", "<secret, not shown>", "a string"]),
    ({"store_config": "kvcache"}, ["store_config", "a mapping", "got str"]),
    ({}, ["store_config is required"]),
    ({"store_config": {"bucket": "kvcache"}, "io_threads": 0},
     ["io_threads", "0", "integer in 1..256"]),
    ({"store_config": {"bucket": "kvcache"}, "prefix": 5}, ["prefix", "5", "key prefix"]),
    ({"store_config": {"bucket": "kvcache"}, "prefix": "a/../b"}, ["prefix", "'..'"]),
    ({"store_config": {"bucket": "kvcache"}, "probe_timeout_s": 0},
     ["probe_timeout_s", "> 0"]),
    ({"store_config": {"bucket": "kvcache"}, "max_attempts": 0},
     ["max_attempts", "1..20"]),
    ({"store_config": {"bucket": "kvcache"}, "locality": "NEAR"},
     ["locality", "'NEAR'", "'LOCAL' or 'REMOTE'"]),
    ({"store_config": {"bucket": "kvcache"}, "io_thread": 4},
     ["unknown key", "'io_thread'", "did you mean 'io_threads'"]),
])
def test_config_rejects_bad_options_naming_key_value_and_accepted(options, needles):
    with pytest.raises(ConfigError) as e:
        ObjTierConfig.from_options(options, where=WHERE)
    text = str(e.value)
    assert text.startswith(WHERE) or "secondary_tiers[0]" in text
    for needle in needles:
        assert needle in text, (needle, text)
    assert "12345" not in text  # a secret is never shown


def test_config_max_bytes_and_mac_rules(moto_s3):
    bucket = moto_s3.new_bucket()
    with pytest.raises(ConfigError, match=r"max_bytes = 100 .*one chunk's object"):
        tier_config(moto_s3, bucket, max_bytes=100)
    with pytest.raises(ConfigError, match="mac_key_file and .*mac_key are both set"):
        tier_config(moto_s3, bucket, mac_key="00" * 16, mac_key_file=_private_key_file())


def _private_key_file() -> str:
    import os
    import tempfile
    fd, path = tempfile.mkstemp(prefix="shmtier-mac-")
    os.write(fd, b"11" * 16)
    os.close(fd)
    os.chmod(path, 0o600)
    _private_key_file.paths.append(path)
    return path


_private_key_file.paths = []


@pytest.fixture(autouse=True)
def _remove_key_files():
    yield
    import os
    while _private_key_file.paths:
        os.unlink(_private_key_file.paths.pop())


def test_start_up_check_names_endpoint_bucket_and_reason(seaweedfs_s3):
    s = seaweedfs_s3
    bucket = s.new_bucket()
    tier_config(s, bucket)  # the right credentials pass

    def failure(store) -> str:
        t = time.monotonic()
        with pytest.raises(ConfigError) as e:
            ObjTierConfig.from_options({"store_config": store}, where=WHERE)
        assert time.monotonic() - t < 15
        text = str(e.value)
        assert text.count("cannot use bucket") == 1, text
        return text

    text = failure(s.store_config(bucket, secret_key="wrong-secret"))
    assert f"'{bucket}'" in text and s.endpoint in text and "access denied" in text
    assert "wrong-secret" not in text
    text = failure(s.store_config("no-such-bucket-here"))
    assert "'no-such-bucket-here'" in text and s.endpoint in text and "no such bucket" in text
    port = free_port()
    text = failure(s.store_config(bucket, endpoint_override=f"127.0.0.1:{port}"))
    assert f"http://127.0.0.1:{port}" in text and f"'{bucket}'" in text
    assert "connection refused" in text, text


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("chunk_bytes,mode,n", [
    (4096, "auto", 12),
    (4097, "zstd", 6),  # odd: plain zstd, the tail byte
    (40_000, "none", 6),
    ((256 << 10) + 6, "auto", 4),
])
def test_round_trip_is_byte_exact(moto_s3, chunk_bytes, mode, n):
    bucket = moto_s3.new_bucket()
    row_stride = chunk_bytes + 4096
    src = bf16_arena(n, row_stride, chunk_bytes, seed=chunk_bytes)
    keys = keys_for(n)
    with obj_backend(moto_s3, bucket, chunk_bytes=chunk_bytes, mode=mode,
                     prefix="/deep//prefix/") as b:
        r = b.store(keys, list(range(n)), src, chunk_bytes)
        assert r.outcomes == [OK] * n, r.details
        assert r.logical_bytes == [chunk_bytes] * n and all(t > 0 for t in r.seconds)
        assert r.codec_s > 0
        if mode == "none":
            assert r.total_stored > r.total_logical
        elif chunk_bytes % 2 == 0:
            assert r.total_stored < 0.8 * r.total_logical
        dst = np.full((n + 2, row_stride), PAD, dtype=np.uint8)
        rows = list(range(n + 1, 1, -1))[:n]
        lr = b.load(keys, rows, dst, chunk_bytes)
        assert lr.outcomes == [OK] * n, lr.details
        assert lr.stored_bytes == r.stored_bytes
        for i, row in enumerate(rows):
            assert np.array_equal(dst[row, :chunk_bytes], src[i, :chunk_bytes])
        assert (dst[:, chunk_bytes:] == PAD).all()
        assert b.counters.objects_written == n and b.counters.objects_read == n
    names = bucket_keys(moto_s3, bucket)
    ns = f"deep/prefix/{namespace_dir_name(FP)}"
    assert sorted(names) == sorted([f"{ns}/config.json"] +
                                   [f"{ns}/{k.hex()[:3]}/{k.hex()}.kv" for k in keys])
    assert not any("//" in k for k in names)


def test_probe_scan_delete_on_seaweedfs(seaweedfs_s3):
    s = seaweedfs_s3
    bucket = s.new_bucket()
    n = 7
    src = bf16_arena(n, 8192, 4096)
    keys = keys_for(n, tag=1)
    with obj_backend(s, bucket, io_threads=3) as b:
        r = b.store(keys, range(n), src, 4096)
        assert r.all_ok, r.details
        missing = keys_for(2, tag=2)
        p = b.probe(keys + missing + [b""])
        assert p.outcomes == [OK] * n + [MISS, MISS, INVALID]
        assert p.stored_bytes[:n] == r.stored_bytes
        listed = sorted(b.scan())
        assert [(e.key, e.stored_bytes) for e in listed] == sorted(zip(keys, r.stored_bytes))
        assert all(e.mtime > time.time() - 600 for e in listed)
        assert b.counters.bytes_stored == r.total_stored
        # something else under the namespace is not a chunk: skipped and counted
        c = s.client()
        c.put_object(Bucket=bucket, Key=f"{b.base}/zzz/not-a-chunk.kv", Body=b"x")
        c.put_object(Bucket=bucket, Key=f"{b.base}/abc/{keys[0].hex()}.kv", Body=b"x")
        c.close()
        assert len(list(b.scan())) == n and b.counters.scan_skipped == 2
        d = b.delete(keys[:4] + missing[:1])
        assert d.outcomes == [OK] * 5
        assert b.probe(keys).outcomes == [MISS] * 4 + [OK] * (n - 4)
        assert sorted(e.key for e in b.scan()) == sorted(keys[4:])
        dst = np.zeros_like(src)
        lr = b.load(keys, range(n), dst, 4096)
        assert lr.outcomes == [MISS] * 4 + [OK] * (n - 4)
        assert np.array_equal(dst[4:, :4096], src[4:, :4096])
    assert not any("//" in k for k in bucket_keys(s, bucket))


def test_delete_in_batches_of_1000(moto_s3):
    bucket = moto_s3.new_bucket()
    with obj_backend(moto_s3, bucket) as b:
        keys = [i.to_bytes(4, "big") for i in range(1203)]
        c = moto_s3.client()
        for k in keys[:5]:
            c.put_object(Bucket=bucket, Key=b.object_key(k), Body=b"x")
        c.close()
        d = b.delete(keys)
        assert d.outcomes == [OK] * len(keys)
        assert bucket_keys(moto_s3, bucket) == [b.config_key]


# --------------------------------------------------------------------------- corrupt


def test_corrupt_objects_are_deleted_counted_never_served(moto_s3):
    bucket = moto_s3.new_bucket()
    n = 5
    src = bf16_arena(n, 8192, 4096, seed=3)
    keys = keys_for(n, tag=3)
    with obj_backend(moto_s3, bucket) as b:
        assert b.store(keys, range(n), src, 4096).all_ok
        c = moto_s3.client()
        body = [c.get_object(Bucket=bucket, Key=b.object_key(k))["Body"].read() for k in keys]
        flipped = bytearray(body[0])
        flipped[len(flipped) // 2] ^= 0x10
        c.put_object(Bucket=bucket, Key=b.object_key(keys[0]), Body=bytes(flipped))
        c.put_object(Bucket=bucket, Key=b.object_key(keys[1]), Body=body[1][:-100])  # torn
        c.put_object(Bucket=bucket, Key=b.object_key(keys[2]), Body=body[3])  # another key's
        c.put_object(Bucket=bucket, Key=b.object_key(keys[4]), Body=b"junk" * 10)
        assert parse_frame_header(memoryview(body[3])).key == keys[3]
        dst = np.full((n, 8192), 0x33, dtype=np.uint8)
        lr = b.load(keys, range(n), dst, 4096)
        assert lr.outcomes == [CORRUPT, CORRUPT, CORRUPT, OK, CORRUPT], lr.details
        assert lr.details[0] == "checksum" and lr.details[1] == "length"
        assert lr.details[2] == "key"
        assert np.array_equal(dst[3, :4096], src[3, :4096])
        assert lr.logical_bytes == [0, 0, 0, 4096, 0]
        cnt = b.counters
        assert cnt.corrupt_objects_detected == 4 and cnt.corrupt_objects_removed == 4
        assert sum(cnt.corrupt_by_reason.values()) == 4
        assert b.probe(keys).outcomes == [MISS, MISS, MISS, OK, MISS]  # deleted
        assert b.load(keys[:1], [0], dst, 4096).outcomes == [MISS]
        # a frame of another length than the rows' chunk_bytes is not served either
        small = bf16_arena(1, 8192, 2048)
        assert b.store(keys[:1], [0], small, 2048).all_ok
        assert b.load(keys[:1], [0], dst, 4096).outcomes == [CORRUPT]
        c.close()


def test_mac_keyed_frames(moto_s3):
    bucket = moto_s3.new_bucket()
    src = bf16_arena(2, 8192, 4096)
    keys = keys_for(2, tag=4)
    with obj_backend(moto_s3, bucket, mac_key="5a" * 32) as b:
        assert b.store(keys, range(2), src, 4096).all_ok
        dst = np.zeros_like(src)
        assert b.load(keys, range(2), dst, 4096).all_ok
        assert np.array_equal(dst[:, :4096], src[:, :4096])
        keyed_base = b.base
    with obj_backend(moto_s3, bucket) as plain:  # another namespace: never shared
        assert plain.base != keyed_base
        assert plain.load(keys, range(2), dst, 4096).outcomes == [MISS, MISS]


# --------------------------------------------------------------------------- capacity


def test_max_bytes_rejects_what_does_not_fit_and_hurry_stores_raw(moto_s3):
    bucket = moto_s3.new_bucket()
    src = bf16_arena(6, 8192, 4096)
    keys = keys_for(6, tag=5)
    with obj_backend(moto_s3, bucket, max_bytes=3 * 4300, io_threads=1) as b:
        r = b.store(keys, range(6), src, 4096, bytes_in_use=0, hurry=True)
        assert r.outcomes[:3] == [OK] * 3 and r.outcomes[3:] == [REJECTED] * 3
        assert r.details[3:] == ["max_bytes"] * 3
        assert all(s >= 4096 for s in r.stored_bytes[:3])  # raw frames: hurried
        assert b.counters.stores_raw_hurried == 6 and b.counters.store_full == 3
        r = b.store(keys[3:], range(3), src, 4096, bytes_in_use=0)
        assert r.all_ok and all(s < 4096 for s in r.stored_bytes)  # compressed


# --------------------------------------------------------------------------- faults


def test_5xx_on_the_first_two_attempts_is_retried(moto_faults):
    s = moto_faults
    bucket = s.new_bucket()
    src = bf16_arena(1, 8192, 4096)
    keys = keys_for(1, tag=6)
    with obj_backend(s, bucket, io_threads=1, max_attempts=4) as b:
        before = s.faults.requests
        s.faults.fail_next(2, 503, "SlowDown")
        r = b.store(keys, [0], src, 4096)
        assert r.outcomes == [OK], r.details
        assert s.faults.requests - before == 3
        s.faults.fail_next(2, 500, "InternalError")
        dst = np.zeros_like(src)
        assert b.load(keys, [0], dst, 4096).outcomes == [OK]
        assert np.array_equal(dst[0, :4096], src[0, :4096])


def test_persistent_5xx_is_an_error_per_key_quickly(moto_faults):
    s = moto_faults
    bucket = s.new_bucket()
    src = bf16_arena(4, 8192, 4096)
    keys = keys_for(4, tag=7)
    with obj_backend(s, bucket, io_threads=4, max_attempts=2) as b:
        s.faults.fail_fraction(1.0, 500, "InternalError")
        t = time.monotonic()
        r = b.store(keys, range(4), src, 4096)
        assert r.outcomes == [ERROR] * 4
        assert all(d.startswith("HTTP 500 InternalError") for d in r.details), r.details
        assert b.load(keys, range(4), np.zeros_like(src), 4096).outcomes == [ERROR] * 4
        assert b.probe(keys).outcomes == [ERROR] * 4
        assert b.delete(keys).outcomes == [ERROR] * 4
        with pytest.raises(RuntimeError, match="HTTP 500"):
            list(b.scan())
        assert time.monotonic() - t < 10
        assert b.counters.store_errors == 4 and b.counters.scan_errors == 1
        s.faults.reset()
        assert b.store(keys, range(4), src, 4096).all_ok


def test_slow_answers_beyond_read_timeout_are_errors(moto_faults):
    s = moto_faults
    bucket = s.new_bucket()
    src = bf16_arena(2, 8192, 4096)
    keys = keys_for(2, tag=8)
    with obj_backend(s, bucket, read_timeout_s=0.5, max_attempts=1) as b:
        assert b.store(keys, range(2), src, 4096).all_ok
        s.faults.slow(1.5)
        t = time.monotonic()
        lr = b.load(keys, range(2), np.zeros_like(src), 4096)
        p = b.probe(keys)
        took = time.monotonic() - t
        assert lr.outcomes == [ERROR] * 2 and p.outcomes == [ERROR] * 2
        assert all("read timeout" in d for d in lr.details + p.details), lr.details
        assert took < 2.5
        s.faults.reset()
        time.sleep(1.5)  # the delayed requests' server threads finish
        assert b.probe(keys).outcomes == [OK] * 2


def test_server_killed_then_back(seaweedfs_s3_killable):
    s = seaweedfs_s3_killable
    bucket = s.new_bucket()
    n = 4
    src = bf16_arena(n, 8192, 4096, seed=9)
    keys = keys_for(n, tag=9)
    opts = dict(connect_timeout_s=1.0, read_timeout_s=2.0, max_attempts=2)
    with obj_backend(s, bucket, **opts) as b:
        assert b.store(keys[:2], range(2), src, 4096).all_ok
        config = tier_config(s, bucket, **opts)
        s.kill()
        t = time.monotonic()
        dst = np.zeros_like(src)
        assert b.load(keys[:2], range(2), dst, 4096).outcomes == [ERROR] * 2
        assert b.probe(keys).outcomes == [ERROR] * 4
        r = b.store(keys[2:], range(2, 4), src, 4096)
        assert r.outcomes == [ERROR] * 2
        assert all("connection refused" in d for d in r.details), r.details
        assert b.delete(keys[3:]).outcomes == [ERROR]
        with pytest.raises(RuntimeError):
            list(b.scan())
        assert time.monotonic() - t < 15
        # a worker starting while the store is down starts anyway
        late = ObjBackend.open(config, WorkerContext(FP, 4096, 2, CompressionConfig()))
        try:
            assert late.counters.config_write_deferred == 1
            s.start()
            assert late.store(keys[2:], range(2, 4), src, 4096).all_ok
        finally:
            late.close()
        lr = b.load(keys, range(n), dst, 4096)
        assert lr.outcomes == [OK] * n, lr.details
        assert np.array_equal(dst[:, :4096], src[:, :4096])
        assert sorted(e.key for e in b.scan()) == sorted(keys)
