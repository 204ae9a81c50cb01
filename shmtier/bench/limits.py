"""This machine's limits, measured in the same ``shmtier bench`` run as the figures they
bound: memcpy GB/s (one core, numpy copy between two buffers larger than the caches),
the chunk codec's encode and decode GB/s per core (``thread_time``: CPU seconds, not
inflated by time descheduled), and disk write and read GB/s in the directory the fs tiers
use (write + fsync; the read after ``posix_fadvise(DONTNEED)`` so it comes from the
device where the filesystem honours it). Each figure is the best of ``repeats`` (the
limit is what the machine can do; the other work on a shared box only lowers it).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

KEY = b"\x01" * 32 + (0).to_bytes(4, "big")


def _bf16(nbytes: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    f = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def memcpy_gbps(mib: int = 64, repeats: int = 3) -> float:
    src = np.ones(mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # pre-touch
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        best = max(best, src.nbytes / dt / 1e9)
    return best


def codec_gbps(chunk_bytes: int, mib: int = 16, repeats: int = 3,
               mode: str = "auto") -> tuple[float, float, float]:
    """(encode GB/s per core, decode GB/s per core, ratio) of shmtier's codec in
    ``mode`` on bf16 random-normal chunks."""
    from shmtier.shared.codec import ChunkDecoder, ChunkEncoder, CompressionConfig

    n = max(2, (mib << 20) // chunk_bytes)
    data = _bf16(n * chunk_bytes).reshape(n, chunk_bytes)
    enc = ChunkEncoder(CompressionConfig(mode=mode))
    dec = ChunkDecoder()
    out = np.empty(chunk_bytes, dtype=np.uint8)
    out[:] = 0
    best_e = best_d = 0.0
    ratio = 1.0
    for _ in range(repeats):
        frames, stored, ce = [], 0, 0.0
        for i in range(n):
            c0 = time.thread_time()
            parts, stats = enc.encode(memoryview(data[i]), KEY, 2)
            ce += time.thread_time() - c0
            # the parts may be the encoder's scratch: materialise before the next encode
            frames.append(memoryview(b"".join(bytes(p) for p in parts)))
            stored += stats.stored_bytes
        c0 = time.thread_time()
        for fr in frames:
            dec.decode_into(fr, KEY, memoryview(out))
        cd = time.thread_time() - c0
        total = n * chunk_bytes
        best_e = max(best_e, total / max(ce, 1e-9) / 1e9)
        best_d = max(best_d, total / max(cd, 1e-9) / 1e9)
        ratio = total / max(1, stored)
    return best_e, best_d, ratio


def disk_gbps(directory: str, mib: int = 64, repeats: int = 2,
              block_mib: int = 4) -> tuple[float, float]:
    """(write GB/s with fsync, read GB/s after dropping the file's cached pages)."""
    block = _bf16(block_mib << 20)
    blocks = max(1, mib // block_mib)
    best_w = best_r = 0.0
    fd0, path = tempfile.mkstemp(prefix="shmtier-bench-limits-", dir=directory)
    os.close(fd0)
    try:
        for _ in range(repeats):
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                t0 = time.perf_counter()
                for _ in range(blocks):
                    os.write(fd, block)
                os.fsync(fd)
                dt = time.perf_counter() - t0
            finally:
                os.close(fd)
            best_w = max(best_w, blocks * block.nbytes / dt / 1e9)
            fd = os.open(path, os.O_RDONLY)
            try:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                buf = bytearray(block.nbytes)
                t0 = time.perf_counter()
                got = 0
                while True:
                    n = os.readv(fd, [buf])
                    if n <= 0:
                        break
                    got += n
                dt = time.perf_counter() - t0
            finally:
                os.close(fd)
            best_r = max(best_r, got / dt / 1e9)
    finally:
        os.unlink(path)
    return best_w, best_r


def measure(directory: str, chunk_bytes: int, quick: bool = False) -> dict:
    """Every limit, as a dict for the report (GB/s; seconds it took)."""
    t0 = time.perf_counter()
    mib = 16 if quick else 64
    enc, dec, ratio = codec_gbps(chunk_bytes, mib=8 if quick else 24, repeats=2 if quick else 3)
    w, r = disk_gbps(directory, mib=mib, repeats=1 if quick else 2)
    return {"memcpy_gbps": memcpy_gbps(mib=mib, repeats=2 if quick else 3),
            "codec_encode_gbps_per_core": enc, "codec_decode_gbps_per_core": dec,
            "codec_ratio": ratio, "disk_write_gbps": w, "disk_read_gbps": r,
            "measured_in_s": time.perf_counter() - t0, "dir": directory,
            "cpus": os.cpu_count()}
