"""The fs tier's worker half (shmtier/tiers/fs/backend.py) against real files and processes.

Everything here uses real directories under tmp_path, real tmpfs mounts (skipped when
mounting is not permitted) and real child processes; nothing is mocked. Corruption is
made by editing files on disk exactly as a torn write, bit rot or a misplaced file would.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from shmtier.shared.codec import (
    ChunkEncoder,
    CompressionConfig,
    frame_header_size,
    mac_key_id,
    parse_frame_header,
)
from shmtier.tiers.backend import WorkerContext
from shmtier.shared.jobs import Outcome, decode_result, encode_result
from shmtier.tiers.backend import BatchResult
from shmtier.options import Secret
from shmtier.tiers.fs.backend import FsBackend
from shmtier.tiers.fs.config import FsTierConfig
from shmtier.tiers.fs.namespace import (
    CHUNK_SUFFIX,
    TEMP_SUFFIX,
    choose_fanout_bits,
    namespace_dir_name,
)

# what a frame holds, not whether "auto" compresses on a busy host (test_codec_choice.py)
pytestmark = pytest.mark.usefixtures("idle_host")

FP = "model=test-model|dtype=bfloat16|block=16x4|tp=1|codec=1"
OK, MISS, ERROR, CORRUPT, REJECTED, EXISTS, INVALID = Outcome
PAD = 0xA5  # bytes past chunk_bytes in every row
EMPTY = 0x5A  # rows of the destination arena before a load


def bf16_normal(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """Random-normal bf16 values as bytes (the top 16 bits of float32 normals)."""
    f = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def make_arena(num_rows: int, row_stride: int, chunk_bytes: int, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    arena = np.full((num_rows, row_stride), PAD, dtype=np.uint8)
    for r in range(num_rows):
        if kind == "bf16":
            arena[r, :chunk_bytes - chunk_bytes % 2] = bf16_normal(rng, chunk_bytes - chunk_bytes % 2)
            if chunk_bytes % 2:
                arena[r, chunk_bytes - 1] = 7
        else:
            arena[r, :chunk_bytes] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    return arena


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    """vLLM-shaped keys: a 32-byte block hash + uint32_be group index."""
    rng = np.random.default_rng(1000 + tag)
    return [rng.bytes(32) + (i % 3).to_bytes(4, "big") for i in range(n)]


def backend(root, fp: str = FP, **kw) -> FsBackend:
    kw.setdefault("min_free_bytes", 0)
    return FsBackend(str(root), fp, **kw)


def chunk_files(b: FsBackend) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(b.namespace_dir):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(CHUNK_SUFFIX)]
    return out


def temp_files(root) -> list[str]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(TEMP_SUFFIX)]
    return out


@contextmanager
def tmpfs(size: str):
    """A real tmpfs of ``size`` mounted on a fresh directory; skips if not permitted."""
    d = tempfile.mkdtemp(prefix="shmtier-fs-test-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"mounting a tmpfs is not permitted here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", d], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", d], capture_output=True)
        os.rmdir(d)


def remount_ro(d: str) -> None:
    subprocess.run(["mount", "-o", "remount,ro", d], check=True, capture_output=True)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("mode", ["auto", "none", "zstd"])
@pytest.mark.parametrize("kind", ["bf16", "bytes"])
@pytest.mark.parametrize("chunk_bytes,row_stride,n", [
    (4096, 8192, 24),
    (4097, 8192, 12),  # odd: plain zstd for 2-byte elements, tests the tail byte
    (40_000, 40_960, 16),
    (256 << 10, (256 << 10) + 4096, 6),
    ((1 << 20) + 6, (1 << 20) + 8192, 3),
])
def test_round_trip_is_byte_exact(tmp_path, mode, kind, chunk_bytes, row_stride, n):
    b = backend(tmp_path, codec_config=CompressionConfig(mode=mode))
    src = make_arena(n, row_stride, chunk_bytes, kind, seed=chunk_bytes)
    keys = keys_for(n)
    r = b.store(keys, list(range(n)), src, chunk_bytes)
    assert r.outcomes == [OK] * n, r.outcomes
    assert r.details == [""] * n
    assert r.logical_bytes == [chunk_bytes] * n
    assert r.io_seconds > 0 and r.codec_s > 0
    assert all(t > 0 for t in r.seconds) and sum(r.seconds) >= r.codec_s
    for key, size in zip(keys, r.stored_bytes):
        assert os.path.getsize(b.path_for(key)) == size
    if mode == "none" or kind == "bytes":
        assert r.total_stored >= r.total_logical  # random bytes are stored raw
    elif chunk_bytes % 2 == 0:
        assert r.total_stored < 0.75 * r.total_logical  # split + zstd on bf16

    # Load into a second arena at other rows, leaving some rows unused.
    dst = np.full((n + 3, row_stride), EMPTY, dtype=np.uint8)
    dst[:, chunk_bytes:] = PAD
    rows = list(range(n + 2, 2, -1))[:n]
    before = dst.copy()
    lr = b.load(keys, rows, dst, chunk_bytes)
    assert lr.outcomes == [OK] * n, lr.outcomes
    assert lr.stored_bytes == r.stored_bytes and lr.logical_bytes == [chunk_bytes] * n
    assert all(t > 0 for t in lr.seconds) and sum(lr.seconds) >= lr.codec_s > 0
    for i, row in enumerate(rows):
        assert np.array_equal(dst[row, :chunk_bytes], src[i, :chunk_bytes])
    assert (dst[:, chunk_bytes:] == PAD).all(), "bytes past chunk_bytes were written"
    for row in set(range(n + 3)) - set(rows):
        assert np.array_equal(dst[row], before[row])
    assert (src[:, chunk_bytes:] == PAD).all()
    assert b.counters.files_written == n and b.counters.files_read == n
    assert not temp_files(tmp_path)


def test_fsync_round_trip_and_permissions(tmp_path):
    b = backend(tmp_path, fsync=True)
    src = make_arena(5, 8192, 8000, "bf16")
    keys = keys_for(5)
    assert b.store(keys, range(5), src, 8000).all_ok
    dst = np.zeros_like(src)
    assert b.load(keys, range(5), dst, 8000).all_ok
    assert np.array_equal(dst[:, :8000], src[:, :8000])
    ns = b.namespace_dir
    assert os.path.basename(ns) == namespace_dir_name(FP)
    assert stat.S_IMODE(os.stat(ns).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(ns, "config.json")).st_mode) == 0o600
    for path in chunk_files(b):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.dirname(os.path.dirname(path))).st_mode) == 0o700
    cfg = json.load(open(os.path.join(ns, "config.json")))
    assert cfg["fingerprint"] == FP and cfg["format"] == "shmtier-fs"


def test_store_skips_existing_unless_asked(tmp_path):
    b = backend(tmp_path)
    a = make_arena(2, 8192, 8192, "bf16")
    k = keys_for(1)
    first = b.store(k, [0], a, 8192)
    assert first.outcomes == [OK]
    again = b.store(k, [1], a, 8192)
    assert again.outcomes == [EXISTS] and again.ok(0)
    assert again.stored_bytes == first.stored_bytes and again.logical_bytes == [0]
    dst = np.zeros_like(a)
    b.load(k, [0], dst, 8192)
    assert np.array_equal(dst[0], a[0])  # not overwritten by row 1
    assert b.store(k, [1], a, 8192, skip_existing=False).outcomes == [OK]
    b.load(k, [0], dst, 8192)
    assert np.array_equal(dst[0], a[1])


def test_delete_probe_missing_and_result_message(tmp_path):
    b = backend(tmp_path)
    a = make_arena(4, 8192, 6000, "bytes")
    keys = keys_for(4)
    st = b.store(keys[:3], [0, 1, 2], a, 6000)
    p = b.probe(keys)
    assert p.outcomes == [OK, OK, OK, MISS]
    assert p.stored_bytes[:3] == st.stored_bytes
    lr = b.load(keys[3:], [3], a, 6000)
    assert lr.outcomes == [MISS] and not lr.ok(0)
    d = b.delete([keys[0], keys[3]])
    assert d.outcomes == [OK, MISS] and d.all_ok
    assert d.stored_bytes == [st.stored_bytes[0], 0]
    assert b.probe(keys[:1]).outcomes == [MISS]
    assert b.counters.bytes_on_disk == sum(st.stored_bytes[1:])
    msg = decode_result(encode_result(d.to_result(9)))  # what the job loop sends
    assert msg.outcomes == [OK, MISS] and msg.job_id == 9 and msg.error == ""
    assert msg.stored_bytes == d.stored_bytes and msg.logical_bytes == [0, 0]


def test_invalid_requests_are_per_key_or_whole_job(tmp_path):
    b = backend(tmp_path)
    a = make_arena(2, 8192, 8192, "bytes")
    good = keys_for(1)[0]
    r = b.store([b"", b"k" * 101, good, good], [0, 0, 5, 1], a, 8192)
    assert r.outcomes == [INVALID, INVALID, INVALID, OK]
    assert r.details[:2] == ["key length 0 (must be 1..100)", "key length 101 (must be 1..100)"]
    assert "row 5 out of range" in r.details[2]
    lr = b.load([good, good], [-1, 0], a, 8192)
    assert lr.outcomes == [INVALID, OK] and "row -1 out of range" in lr.details[0]
    with pytest.raises(ValueError, match="differ in length"):
        b.store([good], [0, 1], a, 8192)
    with pytest.raises(ValueError, match="chunk_bytes"):
        b.load([good], [0], a, 8193)
    with pytest.raises(ValueError, match="2-D uint8"):
        b.load([good], [0], a.view(np.uint16), 4096)


# --------------------------------------------------------------------------- corruption


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _truncate(path: str, size: int) -> None:
    os.truncate(path, size)


CORRUPTIONS = {
    # name: (mode, how to damage the file of key 0 (path, header size, other path), reason)
    "torn_half": ("auto", lambda p, hs, q: _truncate(p, os.path.getsize(p) // 2), "length"),
    "header_only": ("none", lambda p, hs, q: _truncate(p, hs), "length"),
    "short_header": ("none", lambda p, hs, q: _truncate(p, 20), "length"),
    "empty": ("auto", lambda p, hs, q: _truncate(p, 0), "length"),
    "appended": ("none", lambda p, hs, q: open(p, "ab").write(b"\0"), "length"),
    "magic": ("auto", lambda p, hs, q: _flip(p, 0), "magic"),
    "header_field": ("none", lambda p, hs, q: _flip(p, 17), "checksum"),  # raw length byte
    "key_bytes": ("none", lambda p, hs, q: _flip(p, 45), "checksum"),  # inside the key
    "payload_raw": ("none", lambda p, hs, q: _flip(p, hs + 3000), "checksum"),
    "payload_zstd": ("auto", lambda p, hs, q: _flip(p, hs + 10), "checksum"),
    "low_plane": ("auto", lambda p, hs, q: _flip(p, os.path.getsize(p) - 5), "checksum"),
    "wrong_key": ("auto", lambda p, hs, q: os.replace(q, p), "key"),
}


@pytest.mark.parametrize("direct_io", [False, "auto"])
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_file_is_reported_removed_and_counted(tmp_path, name, direct_io):
    """Read back buffered and with O_DIRECT (``"auto"``: where the filesystem takes it;
    reads on I/O threads, raw frames copied into the row while checksummed)."""
    mode, damage, reason = CORRUPTIONS[name]
    cb = 64 << 10
    b = backend(tmp_path, codec_config=CompressionConfig(mode=mode))
    src = make_arena(4, cb + 4096, cb, "bf16")
    keys = keys_for(4)
    assert b.store(keys, range(4), src, cb).all_ok
    path = b.path_for(keys[0])
    hs = frame_header_size(len(keys[0]))
    damage(path, hs, b.path_for(keys[3]))

    fresh = backend(tmp_path, codec_config=CompressionConfig(mode=mode),
                    direct_io=direct_io)  # a new reader process
    dst = np.full_like(src, EMPTY)
    lr = fresh.load(keys[:3], [0, 1, 2], dst, cb)
    assert (lr.outcomes[0], lr.details[0]) == (CORRUPT, reason), (lr.outcomes, lr.details)
    assert not lr.ok(0) and lr.logical_bytes[0] == 0
    assert lr.outcomes[1:] == [OK, OK]
    assert np.array_equal(dst[1:3, :cb], src[1:3, :cb])
    assert (dst[:, cb:] == EMPTY).all()
    assert not os.path.exists(path), "corrupt file was not removed"
    c = fresh.counters
    assert c.corrupt_files_detected == 1 and c.corrupt_files_removed == 1
    assert c.corrupt_by_reason == {reason: 1}
    assert fresh.load(keys[:1], [0], dst, cb).outcomes == [MISS]
    assert fresh.probe(keys[:1]).outcomes == [MISS]


@pytest.mark.parametrize("direct_io", [False, "auto"])
def test_every_flipped_bit_position_is_caught_or_harmless(tmp_path, direct_io):
    """Flip each header byte and a spread of payload bytes: a load either reports
    corrupt (and removes the file) or returns the exact bytes; it never serves others.
    Buffered and with O_DIRECT (where the filesystem takes it)."""
    cb = 16 << 10
    for mode in ("none", "auto"):
        (tmp_path / mode).mkdir()
        b = backend(tmp_path / mode, codec_config=CompressionConfig(mode=mode),
                    direct_io=direct_io)
        src = make_arena(1, cb, cb, "bf16", seed=3)
        key = keys_for(1)[0]
        assert b.store([key], [0], src, cb).all_ok
        good = open(b.path_for(key), "rb").read()
        hs = frame_header_size(len(key))
        offsets = list(range(hs)) + list(range(hs, len(good), max(1, (len(good) - hs) // 97)))
        for off in offsets:
            damaged = bytearray(good)
            damaged[off] ^= 0x01
            with open(b.path_for(key), "wb") as f:
                f.write(damaged)
            dst = np.full_like(src, EMPTY)
            out = b.load([key], [0], dst, cb).outcomes[0]
            if out is OK:
                assert np.array_equal(dst, src), f"wrong bytes served after a flip at {off}"
            else:
                assert out is CORRUPT, out
                assert not os.path.exists(b.path_for(key))
        assert b.counters.corrupt_files_removed == len(offsets)  # all caught: CRCs cover all


def test_frame_sized_for_another_chunk_size_is_corrupt(tmp_path):
    b = backend(tmp_path)
    src = make_arena(1, 8192, 8192, "bytes")
    key = keys_for(1)[0]
    b.store([key], [0], src, 8192)
    r = b.load([key], [0], src.copy(), 4096)
    assert (r.outcomes, r.details) == ([CORRUPT], ["length"])


def test_scan_removes_misplaced_files(tmp_path):
    b = backend(tmp_path, max_bytes=1 << 40, chunk_bytes_hint=1 << 20)
    src = make_arena(8, 4096, 4096, "bytes")
    keys = keys_for(8)
    b.store(keys, range(8), src, 4096)
    p0 = b.path_for(keys[0])
    other = next(os.path.dirname(b.path_for(k)) for k in keys
                 if os.path.dirname(b.path_for(k)) != os.path.dirname(p0))
    os.rename(p0, os.path.join(other, os.path.basename(p0)))
    found = {e.key for e in b.scan()}
    assert found == set(keys[1:])
    assert b.counters.misplaced_files_removed == 1


# --------------------------------------------------------------------------- capacity


def test_max_bytes_refuses_before_writing_and_delete_makes_room(tmp_path):
    cb = 64 << 10
    frame = frame_header_size(36) + cb
    b = backend(tmp_path, codec_config=CompressionConfig(mode="none"), max_bytes=3 * frame + 10)
    src = make_arena(5, cb, cb, "bytes")
    keys = keys_for(5)
    r = b.store(keys, range(5), src, cb)
    assert r.outcomes == [OK] * 3 + [REJECTED] * 2
    assert r.details == [""] * 3 + ["max_bytes"] * 2
    assert not r.ok(3) and r.stored_bytes[3:] == [0, 0]
    assert b.probe(keys).outcomes == [OK] * 3 + [MISS] * 2
    assert not temp_files(tmp_path)
    assert b.counters.bytes_on_disk == 3 * frame and b.counters.store_full == 2
    assert b.delete(keys[:1]).all_ok
    assert b.store(keys[3:4], [3], src, cb).outcomes == [OK]
    # The scheduler's own count overrides this process's:
    assert b.store(keys[4:], [4], src, cb, bytes_in_use=0).outcomes == [OK]
    full = b.store(keys[:1], [0], src, cb, bytes_in_use=3 * frame)
    assert (full.outcomes, full.details) == ([REJECTED], ["max_bytes"])


def test_free_space_floor(tmp_path):
    b = backend(tmp_path, min_free_bytes=1 << 62)
    src = make_arena(1, 4096, 4096, "bytes")
    r = b.store(keys_for(1), [0], src, 4096)
    assert (r.outcomes, r.details) == ([REJECTED], ["min_free"])
    assert not chunk_files(b) and not temp_files(tmp_path)


def test_real_enospc_on_a_small_tmpfs():
    cb = 256 << 10
    with tmpfs("1m") as root:
        # Floor disabled, so the write itself hits ENOSPC part-way through a file.
        b = backend(root, codec_config=CompressionConfig(mode="none"), min_free_bytes=None)
        src = make_arena(6, cb, cb, "bytes")
        keys = keys_for(6)
        r = b.store(keys, range(6), src, cb)
        n_ok = r.count(OK)
        assert 1 <= n_ok < 6 and r.outcomes == [OK] * n_ok + [REJECTED] * (6 - n_ok), r.outcomes
        assert "ENOSPC" in r.details[n_ok] and "No space left" in r.details[n_ok], r.details
        assert not temp_files(root), "a partial temp file was left behind"
        assert len(chunk_files(b)) == n_ok
        dst = np.zeros_like(src)
        assert b.load(keys[:n_ok], range(n_ok), dst, cb).all_ok
        assert np.array_equal(dst[:n_ok], src[:n_ok])
        # With the floor on, the same situation is refused before writing anything.
        b2 = backend(root, codec_config=CompressionConfig(mode="none"), min_free_bytes=0)
        floor = b2.store(keys[n_ok:n_ok + 1], [0], src, cb)
        assert (floor.outcomes, floor.details) == ([REJECTED], ["min_free"])
        # Deleting makes room again.
        assert b.delete(keys[:1]).all_ok
        assert b.store(keys[n_ok:n_ok + 1], [n_ok], src, cb).outcomes == [OK]
        b.close()  # backends hold their namespace directory open: let the tmpfs go
        b2.close()


def test_real_enospc_with_o_direct_writes_in_flight():
    """The same full tmpfs with 4 O_DIRECT writes in flight: the writes that fit are
    stored (which ones depends on the I/O threads), every other key is REJECTED with
    ENOSPC (its own write's, or the batch's once one failed), no temp file is left, and
    what was stored loads back exactly."""
    cb = 256 << 10
    with tmpfs("1m") as root:
        b = backend(root, codec_config=CompressionConfig(mode="none"), min_free_bytes=None,
                    direct_io="writes", write_depth=4)
        if not b.direct_writes:
            b.close()
            pytest.skip("this tmpfs does not take O_DIRECT")
        src = make_arena(6, cb, cb, "bytes")
        keys = keys_for(6)
        r = b.store(keys, range(6), src, cb)
        ok = [i for i in range(6) if r.outcomes[i] == OK]
        assert 1 <= len(ok) < 6, r.outcomes
        for i in set(range(6)) - set(ok):
            assert r.outcomes[i] == REJECTED and "ENOSPC" in r.details[i], (i, r.details)
        assert not temp_files(root), "a partial temp file was left behind"
        assert len(chunk_files(b)) == len(ok) and b.counters.files_written == len(ok)
        dst = np.zeros_like(src)
        assert b.load([keys[i] for i in ok], ok, dst, cb).all_ok
        assert all(np.array_equal(dst[i], src[i]) for i in ok)
        b.close()


def test_fanout_is_proportional_and_recorded(tmp_path):
    assert choose_fanout_bits(1 << 30, 1 << 20) == (1, 1)  # 1024 files: 4 leaf dirs
    assert choose_fanout_bits(100 << 30, 1 << 20) == (4, 4)  # 102400 files: 256 leaf dirs
    assert choose_fanout_bits(1 << 40, 1 << 20) == (6, 5)  # 1M files: 2048 leaf dirs
    assert choose_fanout_bits(1 << 60, 4096) == (8, 8)
    cb = 4096
    small = backend(tmp_path, max_bytes=300 * (cb + 200), chunk_bytes_hint=cb)
    src = make_arena(300, cb, cb, "bytes")
    assert small.store(keys_for(300), range(300), src, cb).all_ok
    leaves = {os.path.dirname(p) for p in chunk_files(small)}
    assert len(leaves) <= 4 < 300, "more directories than a 300-file tier needs"
    # A later open with another capacity keeps the recorded fan-out (paths must not move).
    big = backend(tmp_path, max_bytes=1 << 50, chunk_bytes_hint=cb)
    assert big.fanout_bits == small.fanout_bits
    assert big.probe(keys_for(300)).all_ok


# --------------------------------------------------------------------------- errno paths


def test_read_only_root_fails_stores_per_key_and_still_serves_loads():
    cb = 32 << 10
    with tmpfs("4m") as root:
        b = backend(root)
        src = make_arena(6, cb, cb, "bf16")
        keys = keys_for(6)
        assert b.store(keys[:3], range(3), src, cb).all_ok
        _flip(b.path_for(keys[2]), 0)
        remount_ro(root)
        r = b.store(keys[3:], [3, 4, 5], src, cb)
        assert r.outcomes == [ERROR] * 3
        assert all("EROFS" in d and "Read-only file system" in d for d in r.details), r.details
        d = b.delete(keys[:1])
        assert d.outcomes == [ERROR] and "EROFS" in d.details[0]
        # A new worker attaches to the existing namespace and reads.
        b2 = backend(root)
        dst = np.zeros_like(src)
        lr = b2.load(keys[:3], range(3), dst, cb)
        assert lr.outcomes == [OK, OK, CORRUPT] and lr.details[2] == "magic"
        assert np.array_equal(dst[:2], src[:2])
        assert b2.counters.corrupt_files_detected == 1 and b2.counters.corrupt_remove_failed == 1
        assert {e.key for e in b2.scan()} == set(keys[:3])
        with pytest.raises(OSError, match="Read-only"):
            backend(root, fp="another fingerprint")  # cannot create its namespace
        b.close()  # backends hold their namespace directory open: let the tmpfs go
        b2.close()


CHILD_EACCES = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from shmtier.tiers.fs.backend import FsBackend
    os.setgid(65534); os.setuid(65534)  # after the imports: the venv may be root's only
    root = sys.argv[1]
    b = FsBackend(root, "eacces-fp", min_free_bytes=0)
    arena = np.arange(4 * 8192, dtype=np.uint32).astype(np.uint8).reshape(4, 8192)
    keys = [bytes([i]) * 36 for i in range(4)]
    def named(r):
        return [[o.name, d] for o, d in zip(r.outcomes, r.details)]
    first = named(b.store(keys[:2], [0, 1], arena, 8192))
    for dirpath, dirs, files in os.walk(b.namespace_dir):
        os.chmod(dirpath, 0o500)
    second = named(b.store(keys[2:], [2, 3], arena, 8192))
    out = np.zeros_like(arena)
    third = named(b.load(keys[:2], [0, 1], out, 8192))
    same = bool((out[:2] == arena[:2]).all())
    print(json.dumps([first, second, third, same]))
""")


def test_permission_denied_for_an_unprivileged_worker():
    root = tempfile.mkdtemp(prefix="shmtier-fs-eacces-")
    try:
        os.chmod(root, 0o755)
        os.chown(root, 65534, 65534)
        r = subprocess.run([sys.executable, "-c", CHILD_EACCES, root],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0 and "Operation not permitted" in r.stderr:
            pytest.skip("cannot switch to an unprivileged user here")
        assert r.returncode == 0, r.stderr
        first, second, third, same = json.loads(r.stdout)
        assert first == [["OK", ""], ["OK", ""]]
        assert [o for o, _ in second] == ["ERROR", "ERROR"], second
        assert all("EACCES" in d and "Permission denied" in d for _, d in second)
        assert third == [["OK", ""], ["OK", ""]] and same
    finally:
        subprocess.run(["rm", "-rf", root])


@contextmanager
def failing_disk(tmp_path, size_mib: int = 32):
    """A real ext4 on a loop device over a file; yields (mount dir, cut) where ``cut()``
    truncates the backing file so reads of blocks past the cut fail with EIO."""
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(size_mib << 20)
    if subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True).returncode:
        pytest.skip("mkfs.ext4 is not available")
    r = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"no loop device here: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        r = subprocess.run(["mount", dev, str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a loop device here: {r.stderr.strip()}")
        try:
            yield str(mnt), lambda: os.truncate(img, 2 << 20)
        finally:  # lazily if a backend still holds a directory open there (a failed test)
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def test_device_read_errors_are_eio_outcomes_and_keep_the_file(tmp_path):
    cb = 1 << 20
    with failing_disk(tmp_path) as (root, cut):
        b = backend(root, codec_config=CompressionConfig(mode="none"))
        src = make_arena(12, cb, cb, "bytes")
        keys = keys_for(12)
        assert b.store(keys, range(12), src, cb).all_ok
        os.sync()
        for k in keys:  # the next reads must go to the device
            fd = os.open(b.path_for(k), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        cut()
        dst = np.full_like(src, EMPTY)
        r = b.load(keys, range(12), dst, cb)
        kinds = set(r.outcomes)
        assert ERROR in kinds and kinds <= {OK, ERROR}, r.outcomes
        for i, o in enumerate(r.outcomes):
            if o is OK:
                assert np.array_equal(dst[i], src[i])
            else:
                assert r.details[i] == "EIO Input/output error (read)"
                assert os.path.exists(b.path_for(keys[i])), "an unreadable file is not corrupt"
        assert b.counters.corrupt_files_detected == 0
        assert b.counters.load_errors == r.count(ERROR)
        b.close()  # backends hold their namespace directory open: let the disk go


def test_directory_in_the_way_is_an_errno_outcome(tmp_path):
    b = backend(tmp_path)
    src = make_arena(2, 4096, 4096, "bytes")
    key = keys_for(1)[0]
    os.makedirs(b.path_for(key))
    r = b.store([key], [0], src, 4096, skip_existing=False)
    assert r.outcomes == [ERROR] and r.details[0].startswith("EISDIR"), r.details
    assert not temp_files(tmp_path)
    lr = b.load([key], [1], src, 4096)
    assert lr.outcomes == [ERROR] and lr.details[0].startswith("EISDIR")
    assert b.probe([key]).outcomes == [MISS]
    assert b.delete([key]).outcomes == [ERROR]


# --------------------------------------------------------------------------- namespaces


def test_warm_restart_sees_what_the_previous_process_wrote(tmp_path):
    cb = 16 << 10
    src = make_arena(20, cb, cb, "bf16")
    keys = keys_for(20)
    writer = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, numpy as np
        from shmtier.tiers.fs.backend import FsBackend
        b = FsBackend(sys.argv[1], sys.argv[2], min_free_bytes=0)
        arena = np.load(sys.argv[3]); keys = [bytes.fromhex(k) for k in sys.argv[4:]]
        r = b.store(keys, list(range(len(keys))), arena, arena.shape[1])
        print(" ".join(map(str, r.stored_bytes)) if r.all_ok else r.outcomes)
    """), str(tmp_path), FP, _save(tmp_path, src)] + [k.hex() for k in keys],
        capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    sizes = list(map(int, writer.stdout.split()))

    b = backend(tmp_path)
    found = {e.key: e for e in b.scan()}
    assert set(found) == set(keys)
    assert [found[k].stored_bytes for k in keys] == sizes
    assert all(abs(found[k].mtime - time.time()) < 120 for k in keys)
    assert b.counters.bytes_on_disk == sum(sizes)
    assert b.probe(keys).all_ok
    dst = np.zeros_like(src)
    assert b.load(keys, range(20), dst, cb).all_ok
    assert np.array_equal(dst, src)


def _save(tmp_path, arena) -> str:
    path = str(tmp_path / f"arena-{id(arena)}.npy")
    np.save(path, arena)
    return path


def test_fingerprints_get_separate_namespaces_and_foreign_ones_are_refused(tmp_path):
    a = backend(tmp_path, fp="fingerprint A")
    b = backend(tmp_path, fp="fingerprint B")
    assert a.namespace_dir != b.namespace_dir
    src = make_arena(3, 4096, 4096, "bytes")
    keys = keys_for(3)
    assert a.store(keys, range(3), src, 4096).all_ok
    assert b.probe(keys).outcomes == [MISS] * 3
    assert list(b.scan()) == []
    # A namespace directory whose config names another fingerprint is not used.
    cfg_path = os.path.join(b.namespace_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["fingerprint"] = "fingerprint C"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="another layout fingerprint"):
        backend(tmp_path, fp="fingerprint B")
    with open(cfg_path, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        backend(tmp_path, fp="fingerprint B")


MAC_KEY = bytes(range(32))
OTHER_MAC_KEY = bytes(range(1, 33))


def forge_file(path: str, key: bytes, raw: np.ndarray, mac_key: bytes | None = None) -> None:
    """What anyone who can write the root can do: a valid frame (CRCs and all, built with
    the encoder) for ``key`` with other bytes, put where the chunk's file is."""
    enc = ChunkEncoder(CompressionConfig(mode="none"), mac_key=mac_key)
    parts, _ = enc.encode(memoryview(raw), key, 2)
    with open(path, "wb") as f:
        f.write(b"".join(bytes(p) for p in parts))


def test_a_forged_file_is_served_without_a_mac_key_and_refused_with_one(tmp_path):
    """Issue 11 item 7: frames authenticate nothing. Without a MAC key a forged frame of
    the same key is served; with one it is CORRUPT ("mac"), removed and counted, never
    served, and the key can be stored again."""
    cb = 64 << 10
    src = make_arena(3, cb + 4096, cb, "bf16")
    forged_bytes = make_arena(1, cb, cb, "bf16", seed=42)[0]
    keys = keys_for(3)
    for mac_key in (None, MAC_KEY):
        b = backend(tmp_path, mac_key=mac_key)
        assert b.store(keys, range(3), src, cb).all_ok
        path = b.path_for(keys[0])
        forge_file(path, keys[0], forged_bytes)
        dst = np.full_like(src, EMPTY)
        reader = backend(tmp_path, mac_key=mac_key)  # a new reader process
        lr = reader.load(keys, [0, 1, 2], dst, cb)
        assert lr.outcomes[1:] == [OK, OK]
        assert np.array_equal(dst[1:3, :cb], src[1:3, :cb])
        if mac_key is None:  # the attack: the forged bytes are served as the chunk
            assert lr.outcomes[0] is OK
            assert np.array_equal(dst[0, :cb], forged_bytes)
            continue
        assert (lr.outcomes[0], lr.details[0]) == (CORRUPT, "mac")
        assert not os.path.exists(path) and lr.logical_bytes[0] == 0
        assert reader.counters.corrupt_by_reason == {"mac": 1}
    c = backend(tmp_path, mac_key=MAC_KEY)  # a reader process: counts what it refused
    for forger_key in (None, OTHER_MAC_KEY):  # no tag, or a tag of another key
        path = c.path_for(keys[0])
        forge_file(path, keys[0], forged_bytes, mac_key=forger_key)
        # a planted file stands in the way of a store (EXISTS) until a load refuses it
        assert c.store(keys[:1], [0], src, cb).outcomes == [EXISTS]
        dst = np.full_like(src, EMPTY)
        assert c.load(keys[:1], [0], dst, cb).outcomes == [CORRUPT]
        assert not os.path.exists(path)
        assert c.store(keys[:1], [0], src, cb).outcomes == [OK]
        assert c.load(keys[:1], [0], dst, cb).outcomes == [OK]
        assert np.array_equal(dst[0, :cb], src[0, :cb])
    assert c.counters.corrupt_by_reason == {"mac": 2}
    assert c.counters.corrupt_files_removed == 2


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_mac_round_trip_and_a_namespace_per_key(tmp_path, mode):
    cb = 48 << 10
    src = make_arena(3, cb, cb, "bf16", seed=5)
    keys = keys_for(3)
    codec = CompressionConfig(mode=mode)
    plain = backend(tmp_path, codec_config=codec)
    a = backend(tmp_path, codec_config=codec, mac_key=MAC_KEY)
    other = backend(tmp_path, codec_config=codec, mac_key=OTHER_MAC_KEY)
    assert len({plain.namespace_dir, a.namespace_dir, other.namespace_dir}) == 3
    assert a.fingerprint == f"{FP}|mac={mac_key_id(MAC_KEY)}" and MAC_KEY.hex() not in repr(a)
    sr = a.store(keys, range(3), src, cb)
    assert sr.all_ok
    plain_sizes = plain.store(keys, range(3), src, cb).stored_bytes
    for path, size, plain_size in zip(map(a.path_for, keys), sr.stored_bytes, plain_sizes):
        with open(path, "rb") as f:
            frame = f.read()
        h = parse_frame_header(memoryview(frame))
        assert len(h.tag) == 32 and len(frame) == size == plain_size + 32
    plain.delete(keys)
    # engines of other keys, or none, do not see these files; one of the same key does
    assert plain.probe(keys).outcomes == other.probe(keys).outcomes == [MISS] * 3
    assert list(plain.scan()) == list(other.scan()) == []
    same = FsBackend.open(FsTierConfig(root_dir=str(tmp_path), min_free_bytes=0,
                                       mac_key=Secret(MAC_KEY, "test")),
                          WorkerContext(FP, cb, 2, codec))
    assert same.namespace_dir == a.namespace_dir
    assert sorted(e.key for e in same.scan()) == sorted(keys)
    dst = np.full_like(src, EMPTY)
    assert same.load(keys, range(3), dst, cb).outcomes == [OK] * 3
    assert np.array_equal(dst, src)


def test_missing_or_bad_root_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="root_dir does not exist"):
        FsBackend(str(tmp_path / "nope"), FP)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        FsBackend(str(tmp_path / "file"), FP)
    with pytest.raises(ValueError, match="max_bytes"):
        FsBackend(str(tmp_path), FP, max_bytes=0)
    with pytest.raises(ValueError, match="namespace"):
        FsBackend(str(tmp_path), "")
    assert os.listdir(tmp_path) == ["file"]  # nothing half-created


# --------------------------------------------------------------------------- processes

CHILD_STORE_LOOP = textwrap.dedent("""
    import sys, numpy as np
    from shmtier.shared.codec import CompressionConfig
    from shmtier.tiers.fs.backend import FsBackend
    root, fp, cb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    b = FsBackend(root, fp, min_free_bytes=0, fsync=True,
                  codec_config=CompressionConfig(mode="none"))
    arena = np.random.default_rng(5).integers(0, 256, (2, cb), dtype=np.uint8)
    i = 0
    while True:
        key = i.to_bytes(36, "big")
        arena[i % 2, :8] = np.frombuffer(key[-8:], dtype=np.uint8)
        r = b.store([key], [i % 2], arena, cb)
        assert r.all_ok, r.outcomes
        print(i, flush=True)
        i += 1
""")


def killed_mid_write(root, script: str, *args, ready=None) -> list[str]:
    """Run ``script`` (a Python program; ``args`` its arguments) in a child process that
    writes under ``root`` in a loop and SIGKILL it as soon as a temp file shows, up to 8
    times, until one is left; returns the temp files left. ``ready(line)`` is given the
    child's first line (printed once its loop runs) in each try."""
    leftovers = []
    for attempt in range(8):
        child = subprocess.Popen([sys.executable, "-c", script, str(root), *map(str, args)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline().strip()  # the loop is running
            if ready is not None:
                ready(line)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not temp_files(root):
                pass
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        leftovers = temp_files(root)
        if leftovers:
            break
    return leftovers


def test_killed_writer_leaves_no_visible_partial_chunk_and_temps_are_cleaned(tmp_path):
    cb = 8 << 20
    leftovers = killed_mid_write(tmp_path, CHILD_STORE_LOOP, FP, cb)
    assert leftovers, "never caught the writer mid-store (8 tries)"

    b = backend(tmp_path)
    entries = list(b.scan())
    assert entries and all(len(e.key) == 36 for e in entries)
    assert not temp_files(tmp_path), "scan did not clean the dead writer's temp files"
    assert b.counters.temp_files_removed == len(leftovers)
    dst = np.zeros((len(entries), cb), dtype=np.uint8)
    r = b.load([e.key for e in entries], range(len(entries)), dst, cb)
    assert r.all_ok, r.outcomes
    for row, e in enumerate(entries):
        assert bytes(dst[row, :8]) == e.key[-8:]


CHILD_PROBE_LOOP = textwrap.dedent("""
    import sys
    from shmtier.tiers.fs.backend import FsBackend
    b = FsBackend(sys.argv[1], sys.argv[2], min_free_bytes=0)
    print(b.takes_direct_io(), flush=True)
    while True:
        b.takes_direct_io()
""")


def test_a_direct_io_probe_killed_midway_leaves_a_temp_file_the_scan_removes(tmp_path):
    """A tier worker killed during its start-up O_DIRECT probe (a chaos run's SIGKILL)
    leaves the probe file: it is named as the worker's temp files are, so the next scan
    removes it as a dead writer's (it was kept for 900 s, until stale)."""

    def ready(takes):
        if takes == "False":
            pytest.skip(f"{tmp_path} does not take O_DIRECT: no probe file is left")
        assert takes == "True", "the probing process failed"

    leftovers = killed_mid_write(tmp_path, CHILD_PROBE_LOOP, FP, ready=ready)
    assert leftovers, "never caught the probe midway (8 tries)"
    assert all("direct-probe" in name for name in leftovers)
    b = backend(tmp_path)
    list(b.scan())
    assert not temp_files(tmp_path), "the scan kept the killed probe's file"
    assert b.counters.temp_files_removed == len(leftovers)


CHILD_CONFIG_LOOP = textwrap.dedent("""
    import sys
    from shmtier.tiers.fs.backend import FsBackend
    b = FsBackend(sys.argv[1], sys.argv[2], min_free_bytes=0)
    print("writing", flush=True)
    while True:  # what a worker making the namespace does (config.json exists: not linked)
        b.ns._write_config(b.ns.fd, (1, 1))
""")


def test_a_worker_killed_while_writing_config_json_leaves_a_temp_file_the_scan_removes(
        tmp_path):
    """A tier worker killed while it makes the namespace (a chaos run's SIGKILL, or the
    pool's kill at shutdown when the disk is slow) leaves config.json's temp file in the
    namespace directory: it is named as the worker's temp files are, so the next scan
    removes it as a dead writer's (CI saw one left after a fresh engine's scan)."""
    leftovers = killed_mid_write(tmp_path, CHILD_CONFIG_LOOP, FP)
    assert leftovers, "never caught the config write midway (8 tries)"
    assert all(os.path.basename(p).startswith(".config.") for p in leftovers), leftovers
    b = backend(tmp_path)
    list(b.scan())
    assert not temp_files(tmp_path), "the scan kept the killed writer's config temp file"
    assert b.counters.temp_files_removed == len(leftovers)


def test_temp_files_of_live_or_unknown_writers_are_kept_until_stale(tmp_path):
    b = backend(tmp_path, stale_temp_age_s=60)
    src = make_arena(1, 4096, 4096, "bytes")
    key = keys_for(1)[0]
    b.store([key], [0], src, 4096)
    leaf = os.path.dirname(b.path_for(key))
    mine = os.path.join(leaf, b.ns.temp_name(key.hex()))  # this (live) process is writing
    foreign = os.path.join(leaf, f".{key.hex()[:16]}.ffffffff-1-1-1{TEMP_SUFFIX}")  # other boot/host
    foreign_old = os.path.join(leaf, f".{key.hex()[:16]}.eeeeeeee-1-1-1{TEMP_SUFFIX}")
    for p in (mine, foreign, foreign_old):
        open(p, "wb").close()
    old = time.time() - 3600
    os.utime(foreign_old, (old, old))
    assert [e.key for e in b.scan()] == [key]
    assert os.path.exists(mine) and os.path.exists(foreign) and not os.path.exists(foreign_old)
    assert b.counters.temp_files_removed == 1


CHILD_SAME_KEYS = textwrap.dedent("""
    import os, sys, time, numpy as np
    from shmtier.shared.jobs import Outcome
    from shmtier.tiers.fs.backend import FsBackend
    root, fp, go, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    b = FsBackend(root, fp, min_free_bytes=0)
    arena = np.load(sys.argv[5])
    keys = [bytes([k]) * 36 for k in range(arena.shape[0])]
    bad = []
    print("ready", flush=True)
    while not os.path.exists(go):  # both writers start together
        time.sleep(0.001)
    t0 = time.time()
    for _ in range(rounds):
        r = b.store(keys, list(range(len(keys))), arena, arena.shape[1], skip_existing=False)
        bad += [o.name for o in r.outcomes if o is not Outcome.OK]
    print(t0, time.time(), len(bad), bad[:3])
""")


def test_concurrent_stores_of_the_same_keys_end_with_one_valid_file(tmp_path):
    cb, n = 96 << 10, 8
    arenas = [make_arena(n, cb, cb, "bf16", seed=s) for s in (11, 22)]
    paths = [_save(tmp_path, a) for a in arenas]
    root = tmp_path / "root"
    root.mkdir()
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD_SAME_KEYS, str(root), FP,
                               str(go), "100", p], stdout=subprocess.PIPE, text=True)
             for p in paths]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    # Meanwhile this process reads the keys as they are being replaced: every load is
    # either a MISS (not yet written) or one writer's exact chunk, never a mix.
    b = backend(root)
    keys = [bytes([k]) * 36 for k in range(n)]
    dst = np.zeros_like(arenas[0])
    reads = 0
    while any(p.poll() is None for p in procs):
        r = b.load(keys, range(n), dst, cb)
        for i, o in enumerate(r.outcomes):
            assert o in (OK, MISS), o
            if o is OK:
                reads += 1
                assert any(np.array_equal(dst[i], a[i]) for a in arenas)
    outs = [p.communicate(timeout=120)[0].split(maxsplit=3) for p in procs]  # after "ready"
    assert all(p.returncode == 0 for p in procs)
    assert all(o[2] == "0" for o in outs), outs
    (a0, a1), (b0, b1) = [(float(o[0]), float(o[1])) for o in outs]
    assert max(a0, b0) < min(a1, b1), "the two writers did not overlap in time"
    assert reads > 0
    names = sorted(os.path.basename(p) for p in chunk_files(b))
    assert names == sorted(k.hex() + CHUNK_SUFFIX for k in keys)
    assert not temp_files(root)
    dst = np.zeros_like(arenas[0])
    assert b.load(keys, range(n), dst, cb).all_ok
    for r in range(n):
        assert any(np.array_equal(dst[r], a[r]) for a in arenas), "a mixed chunk was published"


CHILD_OPEN = textwrap.dedent("""
    import sys, time
    from shmtier.tiers.fs.backend import FsBackend
    root, fp, start, max_bytes = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    time.sleep(max(0.0, start - time.time()))
    b = FsBackend(root, fp, max_bytes=max_bytes, chunk_bytes_hint=1 << 20, min_free_bytes=0)
    print(*b.fanout_bits)
""")


def test_workers_starting_together_agree_on_one_namespace(tmp_path):
    start = time.time() + 0.6  # after the interpreters have started
    procs = [subprocess.Popen([sys.executable, "-c", CHILD_OPEN, str(tmp_path), FP, str(start),
                               str(mb)], stdout=subprocess.PIPE, text=True)
             for mb in (1 << 30, 1 << 36, 1 << 40, 1 << 44)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1, f"workers disagree on the fan-out: {outs}"
    ns = os.path.join(tmp_path, namespace_dir_name(FP))
    assert sorted(os.listdir(ns)) == ["config.json"]  # no config temp files left


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=hs.lists(hs.tuples(hs.sampled_from(["store", "overwrite", "load", "delete", "probe"]),
                              hs.lists(hs.integers(0, 5), min_size=1, max_size=4),
                              hs.integers(0, 3)), max_size=25))
def test_operations_match_a_dict_model(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("model")
    cb = 3000
    src = make_arena(4, 4096, cb, "bf16", seed=9)
    keys = keys_for(6, tag=7)
    b = backend(root)
    model: dict[bytes, int] = {}  # key -> source row stored
    for op, idx, row in ops:
        ks = [keys[i] for i in idx]
        if op in ("store", "overwrite"):
            r = b.store(ks, [row] * len(ks), src, cb, skip_existing=(op == "store"))
            for k, o in zip(ks, r.outcomes):
                if o is OK:
                    model[k] = row
                else:
                    assert o is EXISTS and op == "store" and k in model
        elif op == "load":
            dst = np.full((len(ks), 4096), EMPTY, dtype=np.uint8)
            r = b.load(ks, range(len(ks)), dst, cb)
            for j, (k, o) in enumerate(zip(ks, r.outcomes)):
                if k in model:
                    assert o is OK and np.array_equal(dst[j, :cb], src[model[k], :cb])
                else:
                    assert o is MISS
            assert (dst[:, cb:] == EMPTY).all()
        elif op == "delete":
            r = b.delete(ks)
            for k, o in zip(ks, r.outcomes):
                assert o is (OK if k in model else MISS)
                model.pop(k, None)
        else:
            r = b.probe(ks)
            assert r.outcomes == [OK if k in model else MISS for k in ks]
    assert {e.key for e in b.scan()} == set(model)
    assert b.counters.bytes_on_disk == sum(os.path.getsize(b.path_for(k)) for k in model)
    assert not temp_files(root)


def test_batch_result_helpers():
    r = BatchResult("store", [OK, EXISTS, REJECTED, ERROR, REJECTED],
                    ["", "", "max_bytes", "EIO x (write)", "max_bytes"], [1, 0, 0, 0, 0],
                    [2, 3, 0, 0, 0], [0.5, 0.125, 0.25, 0.125, 0.0], codec_s=0.25)
    assert r.succeeded == [True, True, False, False, False] and not r.all_ok
    assert r.count(REJECTED) == 2 and r.total_stored == 5 and r.io_seconds == 0.75
    assert r.summary() == "1 ERROR (EIO x (write)); 2 REJECTED (max_bytes)"
    wire = decode_result(encode_result(r.to_result(3)))
    assert wire.outcomes == r.outcomes and wire.error == r.summary()
    assert (wire.logical_bytes, wire.stored_bytes, wire.seconds, wire.codec_s) == (
        r.logical_bytes, r.stored_bytes, r.seconds, r.codec_s)


def test_direct_io_where_the_filesystem_takes_it_and_buffered_otherwise(tmp_path, monkeypatch):
    """"auto": O_DIRECT where the probe succeeds (files are cut back to the frame's exact
    size); buffered by default, or where O_DIRECT does not exist; true there is a clear
    error. Every way round trips the bytes exactly."""
    from shmtier.tiers.fs import fileio

    rng = np.random.default_rng(5)
    src = bf16_normal(rng, 3 * 12288).reshape(3, 12288)
    keys = keys_for(3)

    def round_trip(b):
        assert b.store(keys, [0, 1, 2], src, 12288).outcomes == [OK] * 3
        for key in keys:
            data = open(b.path_for(key), "rb").read()
            assert len(data) == parse_frame_header(memoryview(data)).frame_size
        out = np.zeros_like(src)
        assert b.load(keys, [2, 1, 0], out, 12288).outcomes == [OK] * 3
        assert np.array_equal(out[::-1], src)

    (tmp_path / "auto").mkdir()
    auto = FsBackend(str(tmp_path / "auto"), "direct-auto", min_free_bytes=0, direct_io="auto")
    assert auto.direct_io == fileio.probe_direct_io(str(tmp_path / "auto"))
    round_trip(auto)
    (tmp_path / "off").mkdir()
    off = FsBackend(str(tmp_path / "off"), "direct-off", min_free_bytes=0)  # the default
    assert off.direct_io is False
    round_trip(off)
    monkeypatch.setattr(fileio, "O_DIRECT", 0)  # a platform without O_DIRECT
    (tmp_path / "none").mkdir()
    none = FsBackend(str(tmp_path / "none"), "direct-none", min_free_bytes=0, direct_io="auto")
    assert none.direct_io is False
    round_trip(none)
    with pytest.raises(OSError, match="direct_io=true"):
        FsBackend(str(tmp_path / "none"), "direct-none", min_free_bytes=0, direct_io=True)
    with pytest.raises(ValueError, match="direct_io='yes'"):
        FsBackend(str(tmp_path), "bad", direct_io="yes")


def _needs_o_direct(path) -> None:
    from shmtier.tiers.fs import fileio

    if not fileio.probe_direct_io(str(path)):
        pytest.skip(f"{path} does not take O_DIRECT")


@pytest.mark.parametrize("fsync", [False, True])
@pytest.mark.parametrize("mode, mac_key", [("auto", None), ("none", None), ("none", MAC_KEY)])
def test_direct_writes_keep_several_files_in_flight_and_round_trip(tmp_path, fsync, mode,
                                                                   mac_key):
    """``direct_io="writes"``: stores go O_DIRECT with ``write_depth`` files in flight on
    I/O threads, loads stay buffered. A batch of 13 chunks of mixed sizes (compressible
    and not; with compression "none" every frame raw, encoded straight into the write's
    buffer, with a MAC tag or not) returns only once every file is published: each file
    is its frame exactly, no temp file is left, the counters and per-key sizes are the
    files', and the bytes load back exactly. The job loop is told to hand over
    ``write_depth`` keys at once."""
    _needs_o_direct(tmp_path)
    b = FsBackend(str(tmp_path), "direct-writes", min_free_bytes=0, direct_io="writes",
                  write_depth=4, fsync=fsync, codec_config=CompressionConfig(mode=mode),
                  mac_key=mac_key)
    assert (b.direct_writes, b.direct_io, b.writes_in_flight) == (True, False, 4)
    rng = np.random.default_rng(9)
    src = np.concatenate([bf16_normal(rng, 7 * 12288).reshape(7, 12288),
                          rng.integers(0, 256, (6, 12288), dtype=np.uint8)])
    keys = keys_for(13)
    res = b.store(keys, list(range(13)), src, 12288)
    assert res.outcomes == [OK] * 13, res.details
    sizes = {k: os.path.getsize(b.path_for(k)) for k in keys}
    assert res.stored_bytes == [sizes[k] for k in keys]
    assert (len(set(sizes.values())) == 1) == (mode == "none")
    raw_encoder = ChunkEncoder(CompressionConfig(mode="none"), mac_key=mac_key)
    for i, key in enumerate(keys):
        data = open(b.path_for(key), "rb").read()
        assert len(data) == parse_frame_header(memoryview(data)).frame_size
        if mode == "none":  # the frame encode makes, byte for byte
            assert data == b"".join(bytes(p) for p in raw_encoder.encode(src[i].data, key, 2)[0])
    assert not list(tmp_path.rglob("*.tmp"))
    assert b.counters.files_written == 13 and b.counters.bytes_on_disk == sum(sizes.values())
    out = np.zeros_like(src)
    assert b.load(keys, list(range(12, -1, -1)), out, 12288).outcomes == [OK] * 13
    assert np.array_equal(out[::-1], src)
    b.close()
    b.close()  # idempotent


@pytest.mark.parametrize("mac_key", [None, MAC_KEY])
def test_direct_loads_keep_several_reads_in_flight_and_answer_each_key(tmp_path, mac_key):
    """``direct_io="auto"`` loads read with O_DIRECT on I/O threads, ``READ_DEPTH`` files
    at once: a batch of 20 keys (more than the depth; raw and compressed frames, rows in
    another order) among which one file is damaged and one missing answers each key
    (OK with the exact bytes, CORRUPT "checksum" removed, MISS) and writes no row it does
    not own; a second load of the same keys and one after the reader's buffers were
    dropped (``close``: what a worker's shutdown does) answer the same, and no temp or
    foreign file is left."""
    from shmtier.tiers.fs.direct_reads import READ_DEPTH

    _needs_o_direct(tmp_path)
    cb = 64 << 10
    n = 20
    assert n > READ_DEPTH
    writer = backend(tmp_path, mac_key=mac_key, codec_config=CompressionConfig(mode="none"))
    src = make_arena(n, cb + 4096, cb, "bf16", seed=4)
    keys = keys_for(n, tag=6)
    assert writer.store(keys[:10], range(10), src, cb).all_ok
    z = backend(tmp_path, mac_key=mac_key, codec_config=CompressionConfig(mode="zstd"))
    assert z.store(keys[10:], range(10, n), src, cb).all_ok
    _flip(writer.path_for(keys[3]), frame_header_size(len(keys[3]), mac=bool(mac_key)) + 99)
    os.unlink(writer.path_for(keys[12]))
    reader = backend(tmp_path, mac_key=mac_key, direct_io="auto")
    assert reader.direct_io is True
    rows = list(range(n - 1, -1, -1))
    want = [OK] * n
    want[3], want[12] = CORRUPT, MISS
    for attempt in range(3):
        dst = np.full_like(src, EMPTY)
        lr = reader.load(keys, rows, dst, cb)
        assert lr.outcomes == want, (attempt, lr.outcomes, lr.details)
        if attempt == 0:
            assert lr.details[3] == "checksum"
            want[3] = MISS  # removed
        for i in range(n):
            if want[i] is OK:
                assert np.array_equal(dst[rows[i], :cb], src[i, :cb]), (attempt, i)
            elif lr.outcomes[i] is MISS:
                assert (dst[rows[i]] == EMPTY).all()
        assert (dst[:, cb:] == EMPTY).all()
        if attempt == 1:
            reader.close()
            reader = backend(tmp_path, mac_key=mac_key, direct_io="auto")
    assert reader.counters.corrupt_files_removed == 0 and not temp_files(tmp_path)
    assert len(chunk_files(reader)) == n - 2
    reader.close()


def test_a_direct_write_that_fails_on_its_io_thread_fails_only_its_key(tmp_path):
    """An O_DIRECT write refused by the kernel on an I/O thread (here EFBIG: the process's
    file-size limit is below the incompressible chunks' frames) is that key's ERROR with
    the errno and the step, its temp file removed; the other keys of the batch, written
    in parallel, are stored. Nothing is left but the stored files."""
    import resource

    _needs_o_direct(tmp_path)
    b = FsBackend(str(tmp_path), "direct-fail", min_free_bytes=0, direct_io="writes",
                  write_depth=4, codec_config=CompressionConfig(mode="zstd"))
    rng = np.random.default_rng(10)
    compressible = np.zeros((3, 65536), dtype=np.uint8)  # frames of ~32 KiB (the low plane)
    noise = rng.integers(0, 256, (3, 65536), dtype=np.uint8)  # frames of ~64 KiB
    src = np.stack([compressible[0], noise[0], compressible[1], noise[1], compressible[2],
                    noise[2]])
    keys = keys_for(6)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (49152, old_limit[1]))
    try:
        res = b.store(keys, list(range(6)), src, 65536)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert res.outcomes == [OK, ERROR] * 3, res.details
    assert all("EFBIG" in res.details[i] and "(write)" in res.details[i] for i in (1, 3, 5))
    files = {p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != "config.json"}
    assert files == {os.path.basename(b.path_for(keys[i])) for i in (0, 2, 4)}
    assert b.counters.files_written == 3 and b.counters.store_errors == 3
    b.close()


# --------------------------------------------------------------------------- links and a vanished root


def _plant_outside_frame(tmp_path, key: bytes, src, cb: int) -> str:
    """A valid frame of ``key`` (row 0 of ``src``) in a directory outside the root: its path."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    other = backend(outside)
    assert other.store([key], [0], src, cb).outcomes == [OK]
    return other.path_for(key)


@pytest.mark.parametrize("direct_io", [False, "auto"])
def test_a_symlinked_chunk_file_is_never_served_nor_written_through(tmp_path, direct_io):
    """Issue 11 item 6: a symlink at a chunk's path, to a valid frame outside the root, is
    a MISS for load and probe (counted), is replaced (not written through) by a store,
    and the frame it points at is never touched."""
    cb = 8192
    src = make_arena(2, cb, cb, "bf16")
    key = keys_for(1)[0]
    target = _plant_outside_frame(tmp_path, key, src, cb)
    frame = open(target, "rb").read()
    (tmp_path / "root").mkdir()
    b = backend(tmp_path / "root", direct_io=direct_io)
    os.makedirs(os.path.dirname(b.path_for(key)))
    os.symlink(target, b.path_for(key))
    dst = np.full((1, cb), EMPTY, dtype=np.uint8)
    assert b.load([key], [0], dst, cb).outcomes == [MISS]  # not served
    assert b.probe([key]).outcomes == [MISS]
    assert b.counters.links_refused == 2
    assert list(b.scan()) == []
    r = b.store([key], [1], src, cb)  # skip_existing: a link is not a stored chunk
    assert r.outcomes == [OK], r.details
    assert not os.path.islink(b.path_for(key)) and os.path.isfile(b.path_for(key))
    assert open(target, "rb").read() == frame  # the link's target is untouched
    assert b.load([key], [0], dst, cb).outcomes == [OK]
    assert np.array_equal(dst[0], src[1])
    os.unlink(b.path_for(key))
    os.symlink(target, b.path_for(key))
    assert b.delete([key]).outcomes == [MISS]  # the link is removed, never its target
    assert not os.path.lexists(b.path_for(key)) and open(target, "rb").read() == frame


@pytest.mark.parametrize("level", [1, 2])
def test_a_symlinked_fanout_directory_is_refused_and_nothing_lands_outside(tmp_path, level):
    """Issue 11 item 6: a fan-out directory replaced by a symlink to a directory outside
    the root: a store of a key under it fails (ELOOP, counted) and writes nothing outside;
    a valid frame reached through the link is not served, probed or listed."""
    cb = 8192
    src = make_arena(2, cb, cb, "bf16")
    key = keys_for(1)[0]
    (tmp_path / "root").mkdir()
    b = backend(tmp_path / "root")
    d1, d2 = os.path.relpath(os.path.dirname(b.path_for(key)), b.namespace_dir).split(os.sep)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / d2).mkdir(parents=True)
    if level == 1:
        os.symlink(elsewhere, os.path.join(b.namespace_dir, d1))
    else:
        os.mkdir(os.path.join(b.namespace_dir, d1))
        os.symlink(elsewhere / d2, os.path.join(b.namespace_dir, d1, d2))
    r = b.store([key], [0], src, cb)
    assert r.outcomes == [ERROR] and r.details[0].startswith("ELOOP"), r.details
    assert [p for p in elsewhere.rglob("*") if p.is_file()] == []  # nothing written outside
    assert b.counters.links_refused == 1
    # a valid frame reachable through the link
    frame = open(_plant_outside_frame(tmp_path, key, src, cb), "rb").read()
    with open(elsewhere / d2 / os.path.basename(b.path_for(key)), "wb") as f:
        f.write(frame)
    dst = np.full((1, cb), EMPTY, dtype=np.uint8)
    assert b.load([key], [0], dst, cb).outcomes == [MISS]
    assert b.probe([key]).outcomes == [MISS]
    assert b.delete([key]).outcomes == [MISS]
    assert list(b.scan()) == []
    assert b.counters.links_refused >= 4
    assert os.path.isfile(elsewhere / d2 / os.path.basename(b.path_for(key)))  # kept


def test_the_root_may_be_a_symlink_but_the_namespace_directory_may_not(tmp_path):
    """The operator's root_dir may be a link (resolved once, when the backend opens); a
    link where the namespace directory goes is refused."""
    cb = 4096
    src = make_arena(1, cb, cb, "bytes")
    key = keys_for(1)[0]
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    b = backend(tmp_path / "link")
    assert b.root_dir == str(tmp_path / "real")
    assert b.store([key], [0], src, cb).all_ok
    assert os.path.isfile(os.path.join(tmp_path, "real", namespace_dir_name(FP),
                                       os.path.relpath(b.path_for(key), b.namespace_dir)))
    (tmp_path / "other").mkdir()
    (tmp_path / "ns-elsewhere").mkdir()
    os.symlink(tmp_path / "ns-elsewhere", tmp_path / "other" / namespace_dir_name(FP))
    with pytest.raises(OSError, match="symbolic link refused"):
        backend(tmp_path / "other")
    assert os.listdir(tmp_path / "ns-elsewhere") == []


def test_leaf_directories_removed_behind_a_cached_descriptor_are_found_again(tmp_path):
    """Leaf directory descriptors are cached (at most MAX_OPEN_LEAVES open): a leaf
    removed and made again by another process is found again by a load, and a store into
    a removed leaf makes it again."""
    import shutil

    from shmtier.tiers.fs.namespace import MAX_OPEN_LEAVES

    cb = 4096
    src = make_arena(2, cb, cb, "bytes")
    a = backend(tmp_path, max_bytes=1 << 44)  # 16 fan-out bits: every key its own leaf
    other = backend(tmp_path, max_bytes=1 << 44)
    keys = keys_for(MAX_OPEN_LEAVES + 40)
    fds_before = len(os.listdir("/proc/self/fd"))
    assert a.store(keys, [0] * len(keys), src, cb).all_ok
    assert len(os.listdir("/proc/self/fd")) - fds_before <= MAX_OPEN_LEAVES
    key = keys[-1]  # its leaf is cached in ``a``
    d1 = os.path.dirname(os.path.dirname(a.path_for(key)))
    shutil.rmtree(d1)
    assert other.store([key], [1], src, cb).all_ok  # another worker makes it again
    dst = np.zeros_like(src)
    assert a.load([key], [0], dst, cb).outcomes == [OK]
    assert np.array_equal(dst[0], src[1])
    shutil.rmtree(d1)
    assert a.store([key], [0], src, cb).outcomes == [OK]
    assert a.probe([key]).outcomes == [OK] and other.probe([key]).outcomes == [OK]
    a.close()
    other.close()
    assert len(os.listdir("/proc/self/fd")) <= fds_before


def _namespace_reset(b: FsBackend) -> bool:
    from shmtier.shared.jobs import ResultFlag

    return bool(b.take_flags() & ResultFlag.NAMESPACE_RESET)


def test_a_deleted_namespace_is_recreated_by_the_next_store_and_reported(tmp_path, caplog):
    """Issue 11 item 5: after the namespace directory was deleted, loads and probes
    answer MISS, the next store recreates the namespace (its config.json with the
    recorded fan-out) and succeeds; the loss and the recreation are flagged for the
    scheduler half (``take_flags``) and the recreation is logged once, by the process
    that recreated it."""
    import logging
    import shutil

    cb = 8192
    src = make_arena(4, cb, cb, "bf16")
    keys = keys_for(4)
    a = backend(tmp_path, max_bytes=1 << 40)
    other = backend(tmp_path, max_bytes=1 << 30)  # a second worker on the same root
    bits = a.fanout_bits
    # the process that made the namespace at open says so once (it may have replaced a
    # namespace deleted while no worker held it); one that found it there does not
    assert _namespace_reset(a) and not _namespace_reset(other)
    assert a.store(keys[:2], [0, 1], src, cb).all_ok
    assert not _namespace_reset(a)
    shutil.rmtree(a.namespace_dir)
    caplog.set_level(logging.INFO, logger="shmtier.tiers.fs")
    assert a.load(keys[:2], [0, 1], src.copy(), cb).outcomes == [MISS, MISS]
    assert a.probe(keys[:2]).outcomes == [MISS, MISS]
    assert _namespace_reset(a) and not _namespace_reset(a)  # once per change
    assert a.counters.bytes_on_disk == 0
    assert not os.path.exists(a.namespace_dir)  # reads create nothing
    r = a.store(keys[2:], [2, 3], src, cb)
    assert r.outcomes == [OK, OK], r.details
    assert _namespace_reset(a)
    cfg = json.load(open(os.path.join(a.namespace_dir, "config.json")))
    assert cfg["fingerprint"] == FP and tuple(cfg["fanout_bits"]) == bits
    assert a.counters.bytes_on_disk == sum(r.stored_bytes)
    assert {e.key for e in a.scan()} == set(keys[2:])
    dst = np.zeros_like(src)
    assert a.load(keys, range(4), dst, cb).outcomes == [MISS, MISS, OK, OK]
    assert np.array_equal(dst[2:], src[2:])
    # the other worker still held the old directory: it moves to the new one
    assert other.store(keys[:1], [0], src, cb).outcomes == [OK]
    assert _namespace_reset(other)
    assert a.load(keys[:1], [0], dst, cb).outcomes == [OK]
    warnings = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(warnings) == 1, [rec.getMessage() for rec in warnings]
    assert a.namespace_dir in warnings[0].getMessage()
    assert "recreated" in warnings[0].getMessage()


def test_a_deleted_root_fails_stores_until_it_exists_again(tmp_path, caplog):
    """Issue 11 item 5: the root itself gone: stores fail (ERROR ENOENT, the root is not
    recreated by the tier), loads MISS; once the operator recreates the root, the next
    store recreates the namespace in it."""
    import logging
    import shutil

    cb = 4096
    src = make_arena(2, cb, cb, "bytes")
    keys = keys_for(2)
    root = tmp_path / "root"
    root.mkdir()
    b = backend(root)
    assert b.store(keys[:1], [0], src, cb).all_ok
    shutil.rmtree(root)
    caplog.set_level(logging.WARNING, logger="shmtier.tiers.fs")
    for _ in range(3):
        r = b.store(keys, [0, 1], src, cb)
        assert r.outcomes == [ERROR, ERROR] and all(d.startswith("ENOENT") for d in r.details)
        assert not root.exists()
    assert "root_dir" in r.details[0] and str(root) in r.details[0]
    assert b.load(keys, [0, 1], src.copy(), cb).outcomes == [MISS, MISS]
    assert list(b.scan()) == [] and b.counters.bytes_on_disk == 0
    assert _namespace_reset(b)
    root.mkdir()
    r = b.store(keys, [0, 1], src, cb)
    assert r.outcomes == [OK, OK], r.details
    assert _namespace_reset(b)
    assert {e.key for e in b.scan()} == set(keys)
    messages = [rec.getMessage() for rec in caplog.records]
    assert len(messages) == 2, messages  # root gone (once, not per store), then recreated
    assert "root_dir" in messages[0] and "recreated" in messages[1]


# --------------------------------------------------------------------------- foreign files

BIG = 5 << 30  # a file no chunk could be stored in: over 4 GiB (sparse: costs no disk)


def _plant_big(path: str) -> None:
    """A sparse file of ``BIG`` bytes at ``path`` (replacing what is there), as a user's
    ``truncate -s 5G`` or a stray copy would leave it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(BIG)


def _on_the_wire(res: BatchResult) -> None:
    """``res`` encodes as the job loop sends it, every figure as the backend gave it."""
    msg = decode_result(encode_result(res.to_result(7)))
    assert msg.stored_bytes == res.stored_bytes and msg.outcomes == res.outcomes


@pytest.mark.parametrize("chunk_bytes_known", [True, False], ids=["layout", "no-layout"])
def test_a_chunk_named_file_no_chunk_could_be_is_a_foreign_miss_removed_and_counted(
        tmp_path, chunk_bytes_known):
    """Issue 28 item 4: a file over 4 GiB at a chunk's name (no frame of this layout, nor
    any the wire could size) is a foreign file for every op: load and probe answer MISS,
    scan leaves it out, delete frees nothing of ours, a store replaces it; each time it is
    removed and counted (``foreign_files_removed``), and its neighbours in the batch are
    answered as if it were not there, with figures the wire carries."""
    cb = 8192
    src = make_arena(4, cb, cb, "bf16")
    keys = keys_for(4)
    b = backend(tmp_path, **({"chunk_bytes": cb} if chunk_bytes_known else {}))
    stored = b.store(keys, range(4), src, cb)
    assert stored.all_ok
    big = b.path_for(keys[0])

    _plant_big(big)
    p = b.probe(keys)
    assert p.outcomes == [MISS, OK, OK, OK] and p.stored_bytes == [0] + stored.stored_bytes[1:]
    _on_the_wire(p)
    assert not os.path.lexists(big) and b.counters.foreign_files_removed == 1

    _plant_big(big)
    listed = {e.key: e.stored_bytes for e in b.scan()}
    assert listed == dict(zip(keys[1:], stored.stored_bytes[1:]))
    assert b.counters.bytes_on_disk == sum(stored.stored_bytes[1:])
    assert not os.path.lexists(big) and b.counters.foreign_files_removed == 2

    _plant_big(big)
    dst = np.full_like(src, EMPTY)
    lr = b.load(keys, range(4), dst, cb)
    assert lr.outcomes == [MISS, OK, OK, OK], lr.details
    assert lr.stored_bytes[0] == 0 and lr.logical_bytes[0] == 0
    assert np.array_equal(dst[1:, :cb], src[1:, :cb])
    _on_the_wire(lr)
    assert not os.path.lexists(big) and b.counters.foreign_files_removed == 3
    assert b.counters.corrupt_files_detected == 0  # not a damaged chunk of ours

    _plant_big(big)
    d = b.delete(keys[:2])
    assert d.outcomes == [MISS, OK] and d.stored_bytes == [0, stored.stored_bytes[1]]
    _on_the_wire(d)
    assert not os.path.lexists(big) and b.counters.foreign_files_removed == 4

    _plant_big(big)
    s = b.store(keys[:1], [0], src, cb)  # skip_existing: a foreign file is no chunk
    assert s.outcomes == [OK] and s.stored_bytes == stored.stored_bytes[:1]
    _on_the_wire(s)
    assert os.path.getsize(big) == stored.stored_bytes[0]
    assert b.counters.foreign_files_removed == 5
    assert b.load(keys[:1], [0], dst, cb).outcomes == [OK]
    assert np.array_equal(dst[0, :cb], src[0, :cb])


def test_a_file_a_little_longer_than_its_frame_is_still_a_damaged_chunk(tmp_path):
    """The foreign-file bound leaves room for damage: a chunk's file with bytes appended
    (up to what a chunk of the layout could be, and some) stays CORRUPT "length"."""
    cb = 8192
    src = make_arena(1, cb, cb, "bytes")
    key = keys_for(1)[0]
    b = backend(tmp_path, chunk_bytes=cb, codec_config=CompressionConfig(mode="none"))
    assert b.store([key], [0], src, cb).all_ok
    with open(b.path_for(key), "ab") as f:
        f.write(bytes(cb // 64))
    assert b.probe([key]).outcomes == [OK]
    lr = b.load([key], [0], src.copy(), cb)
    assert (lr.outcomes, lr.details) == ([CORRUPT], ["length"])
    assert b.counters.foreign_files_removed == 0


# --------------------------------------------------------------------------- namespace in the way


def _opened(root, **kw) -> FsBackend:
    """A backend as a tier worker opens it (``FsBackend.open``: the namespace deferred
    while the medium cannot hold it)."""
    config = FsTierConfig(root_dir=str(root), min_free_bytes=0, **kw)
    return FsBackend.open(config, WorkerContext(FP, 8192, 2))


@pytest.mark.parametrize("in_the_way", ["symlink", "file"])
def test_a_worker_starts_with_its_namespace_path_in_the_way_and_recovers(
        tmp_path, caplog, in_the_way):
    """Issue 28 item 5: a link or a plain file where the namespace directory goes is an
    outage, not a start failure: a worker opens its backend anyway (else the pool fails
    to start its workers and breaks for good), refuses the link (nothing is followed or
    written through it), answers MISS, lists nothing, fails stores, warns once; once
    the path is free again (or a directory), the next store makes the namespace and
    works, flagged for the scheduler half."""
    import logging

    cb = 8192
    src = make_arena(2, cb, cb, "bf16")
    keys = keys_for(2)
    root = tmp_path / "root"
    root.mkdir()
    path = root / namespace_dir_name(FP)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if in_the_way == "symlink":
        os.symlink(elsewhere, path)
    else:
        path.write_text("not a directory")
    caplog.set_level(logging.WARNING, logger="shmtier.tiers.fs")
    b = _opened(root)  # raised LinkRefused / NotADirectoryError: a worker that never starts
    try:
        dst = np.full_like(src, EMPTY)
        for _ in range(3):
            assert b.load(keys, [0, 1], dst, cb).outcomes == [MISS, MISS]
            assert b.probe(keys).outcomes == [MISS, MISS]
            assert list(b.scan()) == []
            r = b.store(keys, [0, 1], src, cb)
            assert r.outcomes == [ERROR, ERROR], r.details
            assert r.details[0].startswith("ELOOP" if in_the_way == "symlink" else "ENOTDIR")
        assert (dst == EMPTY).all()
        assert list(elsewhere.iterdir()) == []  # nothing written through the link
        if in_the_way == "symlink":
            assert b.counters.links_refused > 0
        warnings = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings  # once, not per op or per store
        assert str(path) in warnings[0]
        os.unlink(path)
        r = b.store(keys, [0, 1], src, cb)
        assert r.outcomes == [OK, OK], r.details
        assert _namespace_reset(b)
        assert path.is_dir() and not path.is_symlink()
        assert b.load(keys, [1, 0], dst, cb).outcomes == [OK, OK]
        assert np.array_equal(dst[1, :cb], src[0, :cb])
        assert {e.key for e in b.scan()} == set(keys)
    finally:
        b.close()


def test_a_worker_uses_a_namespace_directory_put_back_in_place_of_the_link(tmp_path):
    """The namespace moved away and a link left in its place; once the operator moves the
    directory back, a worker started meanwhile serves the chunks in it."""
    cb = 8192
    src = make_arena(2, cb, cb, "bf16")
    keys = keys_for(2)
    root = tmp_path / "root"
    root.mkdir()
    first = _opened(root)
    assert first.store(keys, [0, 1], src, cb).all_ok
    first.close()
    path = root / namespace_dir_name(FP)
    os.rename(path, tmp_path / "moved")
    os.symlink(tmp_path / "moved", path)
    b = _opened(root)
    try:
        dst = np.full_like(src, EMPTY)
        assert b.load(keys, [0, 1], dst, cb).outcomes == [MISS, MISS]
        os.unlink(path)
        os.rename(tmp_path / "moved", path)
        assert b.load(keys, [0, 1], dst, cb).outcomes == [OK, OK]
        assert np.array_equal(dst[:, :cb], src[:, :cb])
        assert _namespace_reset(b)
    finally:
        b.close()
