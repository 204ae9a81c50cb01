"""The fs tier's ``page_cache_bytes``: buffered stores leave only a worker's most recent
files in the page cache (``shmtier/tiers/fs/writeback.py``); ``direct_io: "adaptive"``:
loads read from the page cache only what it holds, stores turn O_DIRECT once new page
cache proves expensive (``load.py``, ``store.py``).

Real files on the test's filesystem; what is cached is read with ``mincore(2)`` on a
mapping of each file, so the tests see the kernel's page cache itself.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
from fs_engine import engines, key  # noqa: F401 (the engines fixture)

from bench.fs_tier import drop_cache
from shmtier.contract import ReqContext
from shmtier.shared.codec import CompressionConfig, frame_header_size
from shmtier.shared.jobs import Outcome
from shmtier.storage.tier_metrics import DIRECT_STORES, PAGE_CACHE_BOUNDED
from shmtier.tiers.fs import fileio, writeback
from shmtier.tiers.fs.backend import FsBackend

OK, MISS, CORRUPT = Outcome.OK, Outcome.MISS, Outcome.CORRUPT
CB = 256 * 1024  # chunk bytes: 64 pages

pytestmark = pytest.mark.skipif(not writeback.supported(),
                                reason="no sync_file_range / POSIX_FADV_DONTNEED here")

_libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def cached_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of the file): ``mincore`` of a private
    mapping of it (nothing touched, so nothing is read in)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * pages)()
        failed = _libc.mincore(ctypes.addressof(anchor), size, vec)
        del anchor  # the mapping cannot close while a ctypes object points into it
        if failed:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec), pages
    finally:
        m.close()


def open_files() -> set[str]:
    """Paths this process has open (``/proc/self/fd``)."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            paths.add(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return paths


def keys_for(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def test_only_the_most_recent_stores_stay_in_the_page_cache(tmp_path):
    """10 incompressible chunks stored one per call with ``page_cache_bytes`` of about 3
    files: the 7 oldest files are written back and none of their pages stays cached, the
    newest stay whole; every chunk loads back byte for byte (the dropped ones from the
    device). Without the option every file stays cached (the kernel's choice here)."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, (10, CB), dtype=np.uint8)  # raw frames: CB + header each
    keys = keys_for(10)
    root = tmp_path / "window"
    root.mkdir()
    b = FsBackend(str(root), "window", min_free_bytes=0, page_cache_bytes=3 * CB + 3 * 4096)
    for i in range(10):
        assert b.store([keys[i]], [i], src, CB).outcomes == [OK]
    cached = [cached_pages(b.path_for(k)) for k in keys]
    assert all(c == 0 for c, _n in cached[:7]), cached
    assert all(c == n for c, n in cached[7:]), cached
    out = np.zeros_like(src)
    assert b.load(keys, list(range(10)), out, CB).outcomes == [OK] * 10
    assert np.array_equal(out, src)
    b.close()

    plain_root = tmp_path / "plain"
    plain_root.mkdir()
    plain = FsBackend(str(plain_root), "plain", min_free_bytes=0)  # the default: no limit
    for i in range(10):
        assert plain.store([keys[i]], [i], src, CB).outcomes == [OK]
    assert all(c == n for c, n in (cached_pages(plain.path_for(k)) for k in keys))
    plain.close()


def test_a_file_deleted_inside_the_window_is_gone_at_once_and_skipped(tmp_path):
    """The window keeps no descriptor: a chunk deleted while its file is still among the
    recent ones frees its space at once, and dropping it later is skipped without a
    fuss; a chunk stored again replaces the file and is served with its new bytes."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, (6, CB), dtype=np.uint8)
    keys = keys_for(6)
    b = FsBackend(str(tmp_path), "window-del", min_free_bytes=0, page_cache_bytes=2 * CB)
    assert b.store(keys[:2], [0, 1], src, CB).all_ok
    path0 = b.path_for(keys[0])
    assert b.delete([keys[0]]).all_ok
    assert not os.path.exists(path0)
    assert path0 not in open_files()  # no descriptor keeps the deleted file's blocks
    assert b.store(keys[2:6], [2, 3, 4, 5], src, CB).all_ok  # pushes key 0's entry out
    assert b.store([keys[1]], [5], src, CB, skip_existing=False).all_ok  # key 1: row 5's bytes
    out = np.zeros_like(src)
    res = b.load(keys, list(range(6)), out, CB)
    assert res.outcomes == [MISS] + [OK] * 5
    assert np.array_equal(out[1], src[5]) and np.array_equal(out[2:], src[2:])
    b.close()


def test_page_cache_bytes_is_checked_and_reaches_the_workers(tmp_path):
    """The spec names the key and what it accepts; a valid value reaches the workers."""
    from tests.test_tier_config import build

    with pytest.raises(ValueError, match=r"\.page_cache_bytes = 0 is invalid: expected an "
                                         r"integer >= 1, or null \(no limit\)"):
        build({"type": "fs", "root_dir": str(tmp_path), "page_cache_bytes": 0})
    spec = build({"type": "fs", "root_dir": str(tmp_path), "page_cache_bytes": 1 << 26})
    assert spec.pool_config.tiers[0].options.page_cache_bytes == 1 << 26


class _Opened:
    """``open_file`` for a window over real files in ``root``: opens ``root/where``."""

    def __init__(self, root):
        self.root = root

    def __call__(self, where) -> int:
        return os.open(os.path.join(self.root, where), os.O_RDONLY)


def _write(root, name: str, data: bytes) -> int:
    fd = os.open(os.path.join(root, name), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return len(data)


def test_auto_window_stays_open_while_writes_are_cheap_and_closes_at_its_footprint(tmp_path):
    """``page_cache_bytes: "auto"``, the rule with given write costs: below
    ``AUTO_EXPENSIVE_S_PER_GIB`` (or before a whole ``AUTO_MEASURE_BYTES`` is measured)
    nothing is dropped and no writeback is started; the first expensive measure bounds
    the window at what it then holds (at least ``AUTO_MIN_BYTES``), after which each
    new file pushes the oldest out of the page cache."""
    gib = 1 << 30
    step = writeback.AUTO_MEASURE_BYTES // 4
    w = writeback.WritebackWindow(writeback.AUTO, _Opened(str(tmp_path)), "test")
    assert w.measuring and w.max_bytes is None
    # cheap: 1.0 s/GiB over several whole measures -> stays open, drops nothing
    for i in range(12):
        w.note_write(step, 1.0 * step / gib)
        w.published(f"f{i}", step)
    assert w.measuring and w.max_bytes is None and w.closed_by is None
    # one very slow write inside a measure that is cheap on the whole: still open
    w.note_write(step, 0.5 * writeback.AUTO_EXPENSIVE_S_PER_GIB * step / gib)
    for _ in range(3):
        w.note_write(step, 0.2 * step / gib)
    assert w.max_bytes is None
    # expensive: a whole measure at 6 s/GiB closes it at the footprint (12 files tracked)
    for _ in range(3):
        w.note_write(step, 6.0 * step / gib)
    assert w.max_bytes is None  # the measure is not complete yet
    w.note_write(step, 6.0 * step / gib)
    assert not w.measuring
    assert w.max_bytes == max(writeback.AUTO_MIN_BYTES, 12 * step)
    assert round(w.closed_by, 3) == 6.0 and w.closed_at_bytes == 20 * step


def test_auto_window_keeps_at_least_its_minimum(tmp_path):
    """A window that closes early (little written) keeps ``AUTO_MIN_BYTES``."""
    gib = 1 << 30
    w = writeback.WritebackWindow(writeback.AUTO, _Opened(str(tmp_path)), "test")
    w.published("only", 4096)
    w.note_write(writeback.AUTO_MEASURE_BYTES, 3.0 * writeback.AUTO_MEASURE_BYTES / gib)
    assert w.max_bytes == writeback.AUTO_MIN_BYTES


def test_closed_auto_window_drops_the_oldest_real_files(tmp_path, monkeypatch):
    """Real files: an auto window that closed at 4 files' worth drops the oldest file
    from the page cache for each new one (written back first), starts the writeback of
    the files written while it was open ahead of their drop, and leaves the newest
    cached; the bytes in every file are unchanged."""
    monkeypatch.setattr(writeback, "AUTO_MIN_BYTES", 1)
    monkeypatch.setattr(writeback, "AUTO_MEASURE_BYTES", CB)
    rng = np.random.default_rng(5)
    blobs = [rng.integers(0, 256, CB, dtype=np.uint8).tobytes() for _ in range(7)]
    root = str(tmp_path)
    w = writeback.WritebackWindow(writeback.AUTO, _Opened(root), "test")
    for i in range(4):  # cheap while open: all stay cached
        n = _write(root, f"f{i}", blobs[i])
        w.note_write(n, 0.0)
        w.published(f"f{i}", n)
    assert all(cached_pages(os.path.join(root, f"f{i}"))[0] == CB // mmap.PAGESIZE
               for i in range(4))
    n = _write(root, "f4", blobs[4])
    w.note_write(n, 10.0)  # expensive: closes at the 4 files' footprint
    assert w.max_bytes == 4 * CB
    for i in range(4, 7):
        if i > 4:
            n = _write(root, f"f{i}", blobs[i])
        fd = os.open(os.path.join(root, f"f{i}"), os.O_RDONLY)
        try:
            w.start(fd)
        finally:
            os.close(fd)
        w.published(f"f{i}", n)
    cached = [cached_pages(os.path.join(root, f"f{i}"))[0] for i in range(7)]
    assert cached[:3] == [0, 0, 0], cached  # the 3 oldest dropped, one per new file
    assert all(c == CB // mmap.PAGESIZE for c in cached[3:]), cached
    for i in range(7):
        with open(os.path.join(root, f"f{i}"), "rb") as f:
            assert f.read() == blobs[i]


def test_page_cache_bytes_auto_is_accepted_and_reaches_the_workers(tmp_path):
    """"auto" is a valid value (any other string names the key and what is accepted)."""
    from tests.test_tier_config import build

    spec = build({"type": "fs", "root_dir": str(tmp_path), "page_cache_bytes": "auto"})
    assert spec.pool_config.tiers[0].options.page_cache_bytes == "auto"
    with pytest.raises(ValueError, match=r"\.page_cache_bytes = 'big' is invalid: expected an "
                                         r"integer >= 1, or null \(no limit\), or 'auto'"):
        build({"type": "fs", "root_dir": str(tmp_path), "page_cache_bytes": "big"})


@pytest.mark.parametrize("bound, expected", [(None, 0), ("auto", 0), (8192, 1)])
def test_the_page_cache_gauge_says_whether_the_workers_bound_it(engines, tmp_path, bound,
                                                                expected):
    """Real tier workers: after a cascade, ``vllm:kv_offload_shmtier_page_cache_bounded``
    is 1 with a fixed bound and 0 without one, or with "auto" while its writes are
    cheap (a few 8 KiB files never complete a measure)."""
    e = engines(tmp_path, page_cache_bytes=bound)
    e.settle()
    e.offload([key(i) for i in range(6)], 0, ReqContext("a"))
    e.settle()
    assert e.manager.get_stats().data["data"][PAGE_CACHE_BOUNDED][("1:fs",)] == expected


def test_an_auto_window_that_closes_in_a_worker_drops_and_says_so(engines, tmp_path,
                                                                  worker_hooks):
    """Real tier workers with ``page_cache_bytes: "auto"`` whose writes all count as
    expensive (a test hook, tests/worker_hooks): each worker's window closes after its
    first files, the gauge turns 1, the oldest files leave the page cache while the
    newest stay, and every chunk file still loads back whole and verified."""
    worker_hooks(fs_root=tmp_path, page_cache_measure=2 * 8192)
    # buffered: with direct_io "adaptive" (the default) the window would not close
    e = engines(tmp_path, page_cache_bytes="auto", direct_io=False, chunks=24)
    e.settle()
    keys = [key(i) for i in range(16)]
    for i in range(0, 16, 2):  # one job of 2 keys a step: the files come in order
        e.offload(keys[i:i + 2], i, ReqContext(f"r{i}"))
        e.settle()
    assert e.manager.get_stats().data["data"][PAGE_CACHE_BOUNDED][("1:fs",)] == 1
    paths = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    assert len(paths) == 16
    cached = [cached_pages(str(p)) for p in paths]
    # each worker's window closed at one file (its footprint then): it keeps its newest
    # file whole and has dropped the rest; the newest file of all is one of those kept
    whole = sum(1 for c, n in cached if c == n)
    assert cached[-1][0] == cached[-1][1] and whole in (1, 2), cached
    assert sum(1 for c, _n in cached if c == 0) == 16 - whole, cached
    reader = FsBackend(str(tmp_path), e.spec.fingerprint, min_free_bytes=0)  # the tier's files
    try:
        chunk = e.spec.chunk_payload_bytes
        out = np.zeros((16, chunk), dtype=np.uint8)
        res = reader.load(keys, list(range(16)), out, chunk)
        assert res.outcomes == [OK] * 16  # whole and verified (checksums)
    finally:
        reader.close()


def _needs_o_direct_and_cachestat(path) -> None:
    if not fileio.probe_direct_io(str(path)):
        pytest.skip(f"{path} does not take O_DIRECT")
    probe = os.path.join(path, "cachestat-probe")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT)
    try:
        if fileio.cached_whole(fd, 1) is None:
            pytest.skip("no cachestat(2) here (Linux < 6.5)")
    finally:
        os.close(fd)
        os.unlink(probe)


def test_adaptive_loads_read_what_the_page_cache_holds_and_the_rest_with_o_direct(tmp_path):
    """``direct_io: "adaptive"``: files the page cache holds whole are read from it, the
    others with O_DIRECT, which leaves them out of the page cache (a buffered read, as
    ``direct_io`` false does, brings them in: the contrast at the end). Raw and
    compressed frames, in both ways: the exact bytes; a damaged file in each way is
    CORRUPT, removed; a missing one MISS."""
    _needs_o_direct_and_cachestat(tmp_path)
    n = 12
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, (n, CB), dtype=np.uint8)
    src[6:] //= 64  # compressible: zstd frames
    keys = [key(i) for i in range(n)]
    raw = FsBackend(str(tmp_path), "fp-adaptive", min_free_bytes=0,
                    codec_config=CompressionConfig(mode="none"))
    z = FsBackend(str(tmp_path), "fp-adaptive", min_free_bytes=0,
                  codec_config=CompressionConfig(mode="zstd"))
    assert raw.store(keys[:6], range(6), src, CB).all_ok
    assert z.store(keys[6:], range(6, n), src, CB).all_ok
    paths = [raw.path_for(k) for k in keys]
    assert os.path.getsize(paths[8]) < CB  # compressed
    cold = [1, 2, 4, 7, 8, 10]  # not in the page cache when loaded
    for i in cold:
        drop_cache(paths[i])
    hs = frame_header_size(len(keys[0]))
    for i in (3, 4):  # one damaged file cached, one not
        with open(paths[i], "r+b") as f:
            f.seek(hs + 5)
            b = f.read(1)
            f.seek(hs + 5)
            f.write(bytes([b[0] ^ 0x10]))
        if i in cold:
            drop_cache(paths[i])
    os.unlink(paths[11])
    for i in cold:
        assert cached_pages(paths[i])[0] == 0, i
    reader = FsBackend(str(tmp_path), "fp-adaptive", min_free_bytes=0, direct_io="adaptive")
    try:
        assert (reader.direct_io, reader.direct_writes) == (False, False)
        out = np.zeros_like(src)
        res = reader.load(keys, list(range(n)), out, CB)
        want = [OK] * n
        want[3], want[4], want[11] = CORRUPT, CORRUPT, MISS
        assert res.outcomes == want, res.details
        assert res.details[3] == res.details[4] == "checksum"
        for i in range(n):
            if want[i] is OK:
                assert np.array_equal(out[i], src[i]), i
        assert not os.path.exists(paths[3]) and not os.path.exists(paths[4])
        for i in set(cold) - {4}:
            assert cached_pages(paths[i])[0] == 0, (i, "an O_DIRECT read adds no page cache")
        for i in set(range(11)) - set(cold) - {3}:
            got, pages = cached_pages(paths[i])
            assert got == pages, (i, got, pages)
    finally:
        reader.close()
    buffered = FsBackend(str(tmp_path), "fp-adaptive", min_free_bytes=0, direct_io=False)
    try:
        assert buffered.load([keys[1]], [1], out, CB).outcomes == [OK]
        assert cached_pages(paths[1])[0] > 0  # a buffered read of a cold file caches it
    finally:
        buffered.close()
        raw.close()
        z.close()


def test_adaptive_stores_turn_o_direct_once_new_page_cache_proves_expensive(
        engines, tmp_path, worker_hooks):
    """Real tier workers with the defaults (``direct_io: "adaptive"``,
    ``page_cache_bytes: "auto"``) whose buffered writes all count as expensive (a test
    hook, tests/worker_hooks): after its first measure each worker stores with O_DIRECT
    (the gauge ``direct_stores`` turns 1, its page cache is not bounded instead: that
    gauge stays 0), the files stored after the switch are not in the page cache, and
    every chunk loads back exactly."""
    _needs_o_direct_and_cachestat(tmp_path)
    worker_hooks(fs_root=tmp_path, page_cache_measure=2 * 8192)
    e = engines(tmp_path, chunks=24)
    e.settle()
    stats = e.manager.get_stats().data["data"]
    assert stats[DIRECT_STORES][("1:fs",)] == 0
    keys = [key(i) for i in range(16)]
    for i in range(0, 16, 2):  # one job of 2 keys a step: the files come in order
        e.offload(keys[i:i + 2], i, ReqContext(f"r{i}"))
        e.settle()
    stats = e.manager.get_stats().data["data"]
    assert stats[DIRECT_STORES][("1:fs",)] == 1
    assert stats[PAGE_CACHE_BOUNDED][("1:fs",)] == 0
    paths = sorted(tmp_path.rglob("*.kv"), key=lambda p: p.stat().st_mtime_ns)
    assert len(paths) == 16
    cached = [cached_pages(str(p))[0] for p in paths]
    # each of the 2 workers wrote at most its first 2 files buffered (a measure is 2
    # files here); the newest half were all written with O_DIRECT
    assert not any(cached[8:]), cached
    assert sum(1 for c in cached if c) <= 4, cached
    reader = FsBackend(str(tmp_path), e.spec.fingerprint, min_free_bytes=0)
    try:
        chunk = e.spec.chunk_payload_bytes
        out = np.zeros((16, chunk), dtype=np.uint8)
        res = reader.load(keys, list(range(16)), out, chunk)
        assert res.outcomes == [OK] * 16  # whole and verified (checksums)
        for i in range(16):  # the bytes the engine's GPU blocks held
            assert np.array_equal(out[i], e.originals[0][i].numpy().view(np.uint8)), i
    finally:
        reader.close()
