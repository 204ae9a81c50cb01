#!/usr/bin/env python
"""Cascade (store) and promotion (load) GB/s of the fs tier's worker half, against this
machine's limits measured in the same run.

Run from a checkout::

    .venv/bin/python -m bench.fs_tier                  # 256 KiB-2 MiB chunks, 128 MiB per run, 3 repeats
    .venv/bin/python -m bench.fs_tier --quick          # smoke test: 2 sizes, 32 MiB per run
    .venv/bin/python -m bench.fs_tier --dir /mnt/nvme --total-mib 512 --repeats 5
    .venv/bin/python -m bench.fs_tier --json bench/results/fs_tier.json

What runs: one process, one thread -- what one tier worker does. ``FsBackend.store``
and ``FsBackend.load`` are called in batches of ``--batch`` chunks (one job each) over
``--total-mib`` of random-normal bf16 chunks held in a page-aligned, pre-faulted numpy
arena whose rows are one page longer than the chunk (like the segment's arena). Every
store run starts on an empty namespace, so each chunk creates a new file (temp + rename
in a 2-level fan-out directory). Per chunk size, codec (``none``: framed raw;
``auto``: byte-split + zstd) and fsync (off/on):

* store GB/s = logical (raw) bytes / wall time of all ``store`` calls;
* load warm GB/s: right after the store, files in the page cache;
* load cold GB/s: after each file was ``fdatasync``-ed and dropped from the page cache
  (``posix_fadvise(DONTNEED)``), so the read goes to the device (loads are measured in
  the fsync-off runs only: fsync does not change what a load reads);
* scan µs per file (``FsBackend.scan``, the warm-restart walk; dentries and inodes are
  cached since the files were just written), probe µs per key, delete µs per chunk
  (unlink of every file, after they were written back).

Each run's tier is sized at twice the run's bytes (``max_bytes``), which sets its
fan-out as a tier of that size gets it (~512 files per leaf directory when full), so the
store figures are steady-state; the one-time cost of a new leaf directory (2 mkdirs) is
listed with the per-file costs.

``os.sync()`` runs before every timed region so one run's write-back is not billed to
the next. Machine limits, same run, same sizes: ``memcpy`` (np.copyto between
page-aligned rows), the codec alone (``ChunkEncoder.encode`` / ``ChunkDecoder.decode_into``,
mode auto), one big file written and read sequentially in 4 MiB blocks (buffered without
fsync = page-cache speed; buffered + fsync; O_DIRECT when the filesystem permits it;
cold buffered read; O_DIRECT read, with one read and with ``IN_FLIGHT`` reads in flight
from as many threads: the device's bound on a promotion from disk), and the per-file cost of creating and publishing a
file (``open(O_CREAT|O_EXCL)`` + ``close`` + ``rename``, empty and with 4 KiB, then
``unlink``) in the same fan-out layout.

Every figure is the median over ``--repeats`` runs with [min-max]; runs of different
configurations are interleaved (repeat-major) so drift hits them alike. The temp
directory (under ``--dir``, default the system temp dir) is removed at the end, also on
Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from shmtier.bench.common import exit_through_finally, rotated, write_json

from shmtier.shared.codec import ChunkDecoder, ChunkEncoder, CompressionConfig
from shmtier.tiers.fs.backend import FsBackend
from shmtier.tiers.fs.fileio import probe_direct_io

KIB, MIB, GB = 1 << 10, 1 << 20, 1e9
PAGE = mmap.PAGESIZE
BLOCK = 4 * MIB
#: reads in flight of the O_DIRECT limit lines (shmtier's READ_DEPTH; vLLM's 16 I/O threads)
IN_FLIGHT = (8, 16)


# ---------------------------------------------------------------------------- helpers

def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted uint8 buffer."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    a = raw[off:off + nbytes]
    a.fill(0)
    return a


def bf16_arena(n: int, chunk: int, seed: int = 0) -> np.ndarray:
    stride = chunk + PAGE
    arena = aligned(n * stride).reshape(n, stride)
    rng = np.random.default_rng(seed)
    for r in range(n):
        f = rng.standard_normal(chunk // 2, dtype=np.float32)
        arena[r, :chunk] = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return arena


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs, fmt="{:.2f}"):
    if not xs:
        return "-"
    return f"{fmt.format(med(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def drop_cache(path: str) -> None:
    """Write back and evict one file's pages, so the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def chunk_paths(b: FsBackend, keys) -> list[str]:
    return [b.path_for(k) for k in keys]


# ---------------------------------------------------------------------------- limits

def bench_memcpy(arena: np.ndarray, chunk: int, reps: int) -> list[float]:
    dst = aligned(arena.shape[0] * arena.shape[1]).reshape(arena.shape)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for r in range(arena.shape[0]):
            np.copyto(dst[r, :chunk], arena[r, :chunk])
        out.append(arena.shape[0] * chunk / (time.perf_counter() - t) / GB)
    return out


def bench_codec(arena: np.ndarray, chunk: int, reps: int, keys) -> tuple[list, list, float]:
    enc, dec = ChunkEncoder(CompressionConfig("auto")), ChunkDecoder()
    frames = []
    for r in range(arena.shape[0]):
        parts, st = enc.encode(arena[r, :chunk].data, keys[r], 2)
        frames.append(b"".join(bytes(p) for p in parts))
    ratio = arena.shape[0] * chunk / sum(len(f) for f in frames)
    out = aligned(chunk)
    comp, decomp = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for r in range(arena.shape[0]):
            enc.encode(arena[r, :chunk].data, keys[r], 2)
        comp.append(arena.shape[0] * chunk / (time.perf_counter() - t) / GB)
        t = time.perf_counter()
        for r in range(arena.shape[0]):
            dec.decode_into(memoryview(frames[r]), keys[r], out.data)
        decomp.append(arena.shape[0] * chunk / (time.perf_counter() - t) / GB)
    return comp, decomp, ratio


def bench_big_file(workdir: str, total: int, reps: int) -> dict[str, list[float]]:
    """Sequential write/read of one big file in BLOCK-sized requests."""
    buf = aligned(BLOCK)
    buf[:] = np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8)
    path = os.path.join(workdir, "bigfile")
    nblk = max(1, total // BLOCK)
    res: dict[str, list[float]] = {}

    def write(flags: int, do_fsync: bool) -> float:
        os.sync()
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            for _ in range(nblk):
                os.write(fd, buf)
            if do_fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return nblk * BLOCK / (time.perf_counter() - t) / GB

    def read_in_flight(n: int) -> float:
        """O_DIRECT, ``n`` threads each reading every ``n``-th block: ``n`` reads in
        flight (what a promotion's I/O threads or ``READ_DEPTH`` keep)."""
        os.sync()
        bufs = [aligned(BLOCK) for _ in range(n)]
        fd = os.open(path, os.O_RDONLY | direct)

        def reader(k: int) -> None:
            for b in range(k, nblk, n):
                os.preadv(fd, [bufs[k]], b * BLOCK)

        t = time.perf_counter()
        try:
            threads = [threading.Thread(target=reader, args=(k,)) for k in range(n)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            os.close(fd)
        return nblk * BLOCK / (time.perf_counter() - t) / GB

    def read(flags: int) -> float:
        os.sync()
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            off = 0
            for _ in range(nblk):
                off += os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
        return nblk * BLOCK / (time.perf_counter() - t) / GB

    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(os.path.join(workdir, "probe"), os.O_WRONLY | os.O_CREAT | direct, 0o600)
        os.write(fd, buf[:PAGE])
        os.close(fd)
        os.unlink(os.path.join(workdir, "probe"))
    except OSError:
        direct = 0
    for _ in range(reps):
        res.setdefault("write buffered (page cache, no fsync)", []).append(write(0, False))
        res.setdefault("write buffered + fsync", []).append(write(0, True))
        res.setdefault("read buffered warm", []).append(read(0))
        drop_cache(path)
        res.setdefault("read buffered cold", []).append(read(0))
        if direct:
            res.setdefault("write O_DIRECT", []).append(write(direct, True))
            res.setdefault("read O_DIRECT", []).append(read(direct))
            for n in IN_FLIGHT:
                res.setdefault(f"read O_DIRECT, {n} in flight", []).append(read_in_flight(n))
    if not direct:
        res["O_DIRECT"] = []  # not permitted on this filesystem
    os.unlink(path)
    return res


def bench_file_create(workdir: str, n: int, reps: int) -> dict[str, list[float]]:
    """µs per file: create + close + rename (empty / 4 KiB), then unlink; p50 per repeat."""
    data = b"x" * 4096
    dirs = [os.path.join(workdir, "fc", f"{i:x}", f"{j:x}") for i in range(4) for j in range(4)]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    out: dict[str, list[float]] = {}
    for rep in range(reps):
        os.sync()
        t = time.perf_counter_ns()
        for i in range(64):
            os.mkdir(os.path.join(workdir, "fc", f"m{rep}-{i}"), 0o700)
            os.mkdir(os.path.join(workdir, "fc", f"m{rep}-{i}", "0"), 0o700)
        out.setdefault("mkdir of a new 2-level leaf", []).append((time.perf_counter_ns() - t) / 1e3 / 64)
        for label, payload in (("create+rename, empty", b""), ("create+write 4 KiB+rename", data)):
            times, paths = [], []
            os.sync()
            for i in range(n):
                d = dirs[i % len(dirs)]
                tmp = os.path.join(d, f".t{rep}-{i}.tmp")
                final = os.path.join(d, f"{rep}-{i}-{len(payload)}.kv")
                t = time.perf_counter_ns()
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                if payload:
                    os.write(fd, payload)
                os.close(fd)
                os.rename(tmp, final)
                times.append((time.perf_counter_ns() - t) / 1e3)
                paths.append(final)
            times.sort()
            out.setdefault(label + " p50", []).append(times[len(times) // 2])
            out.setdefault(label + " p99", []).append(times[int(len(times) * 0.99)])
            t = time.perf_counter_ns()
            for p in paths:
                os.unlink(p)
            out.setdefault("unlink (" + label.split(",")[0].split("+write")[0] + ")", []).append(
                (time.perf_counter_ns() - t) / 1e3 / n)
    shutil.rmtree(os.path.join(workdir, "fc"))
    return out


# ---------------------------------------------------------------------------- fs tier

def run_fs(workdir: str, arena: np.ndarray, chunk: int, mode: str, fsync: bool, batch: int,
           keys, run_id: str, measure_loads: bool, direct: bool) -> dict[str, float]:
    root = os.path.join(workdir, f"root-{run_id}")
    os.mkdir(root)
    n = arena.shape[0]
    # A tier sized for twice the run: its fan-out (2 levels, ~512 files per leaf when
    # full) is what a tier of that size gets, so the run does not pay a mkdir per file.
    b = FsBackend(root, f"bench {chunk} {mode} {run_id}", fsync=fsync,
                  codec_config=CompressionConfig(mode), min_free_bytes=0,
                  max_bytes=2 * n * (chunk + 4096), chunk_bytes_hint=chunk,
                  direct_io=True if direct else False)
    batches = [(keys[i:i + batch], list(range(i, min(n, i + batch)))) for i in range(0, n, batch)]
    out: dict[str, float] = {}
    os.sync()
    io_s = codec_s = 0.0
    stored = 0
    t, cpu = time.perf_counter(), time.thread_time()
    for ks, rows in batches:
        r = b.store(ks, rows, arena, chunk)
        if not r.all_ok:
            raise RuntimeError(f"store failed: {set(r.outcomes)}")
        io_s += r.io_seconds
        codec_s += r.codec_s
        stored += r.total_stored
    wall = time.perf_counter() - t
    out["store"] = n * chunk / wall / GB
    out["store_cpu"] = n * chunk / (time.thread_time() - cpu) / GB
    out["store_io_frac"] = io_s / wall
    out["store_codec_frac"] = codec_s / wall
    out["ratio"] = n * chunk / stored
    if measure_loads:
        os.sync()
        t = time.perf_counter()
        found = sum(1 for _ in b.scan())
        out["scan_us"] = (time.perf_counter() - t) / max(1, found) * 1e6
        if found != n:
            raise RuntimeError(f"scan found {found} chunks, {n} stored")
        t = time.perf_counter()
        for ks, _rows in batches:
            b.probe(ks)
        out["probe_us"] = (time.perf_counter() - t) / n * 1e6
        dst = aligned(arena.size).reshape(arena.shape)
        for label in ("load_warm", "load_cold"):
            if label == "load_cold":
                for p in chunk_paths(b, keys):
                    drop_cache(p)
            os.sync()
            t, cpu = time.perf_counter(), time.thread_time()
            for ks, rows in batches:
                r = b.load(ks, rows, dst, chunk)
                if not r.all_ok:
                    raise RuntimeError(f"load failed: {set(r.outcomes)}")
            out[label] = n * chunk / (time.perf_counter() - t) / GB
            out[label + "_cpu"] = n * chunk / (time.thread_time() - cpu) / GB
        if not np.array_equal(dst[:, :chunk], arena[:, :chunk]):
            raise RuntimeError("loaded bytes differ from stored bytes")
    os.sync()
    t = time.perf_counter()
    for ks, _rows in batches:
        b.delete(ks)
    out["delete_us"] = (time.perf_counter() - t) / n * 1e6
    shutil.rmtree(root)
    return out


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to make the temp directory (default: system temp)")
    ap.add_argument("--sizes-kib", default="256,512,1024,2048", help="chunk sizes in KiB")
    ap.add_argument("--total-mib", type=int, default=128, help="bytes of chunks per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="chunks per store/load call (one job)")
    ap.add_argument("--create-files", type=int, default=2000, help="files for the file-create test")
    ap.add_argument("--quick", action="store_true", help="2 sizes, 32 MiB per run, 500 files")
    ap.add_argument("--io", default="both", choices=("direct", "buffered", "both"),
                    help="the backend's I/O: O_DIRECT (direct_io=true), buffered, or both")
    ap.add_argument("--json", default=None, help="write all figures to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes_kib, args.total_mib, args.create_files = "256,1024", 32, 500
    sizes = [int(s) * KIB for s in args.sizes_kib.split(",")]
    reps = max(1, args.repeats)
    total = args.total_mib * MIB

    workdir = tempfile.mkdtemp(prefix="shmtier-bench-fs-", dir=args.dir)
    exit_through_finally()
    try:
        return _run(args, sizes, reps, total, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, sizes, reps, total, workdir) -> int:
    st = os.statvfs(workdir)
    fs_type = "?"
    try:
        best = ""
        for line in open("/proc/self/mounts"):
            dev, mnt, typ, opts = line.split()[:4]
            if workdir.startswith(mnt) and len(mnt) > len(best):
                best, fs_type = mnt, f"{typ} on {dev} ({mnt}, {opts})"
    except OSError:
        pass
    print("# fs tier bench (shmtier/tiers/fs/backend.py), single process, single thread")
    print(f"host: {platform.node()}  cpus: {os.cpu_count()}  python {platform.python_version()}"
          f"  numpy {np.__version__}")
    print(f"dir: {workdir}  fs: {fs_type}  free {st.f_bavail * st.f_frsize / 2**30:.1f} GiB")
    print(f"chunks: random-normal bf16, {args.total_mib} MiB per run, sizes "
          f"{', '.join(f'{s // KIB} KiB' for s in sizes)}; batch {args.batch} chunks per call; "
          f"{reps} repeats, median [min-max]")
    results: dict = {"args": vars(args), "fs": fs_type, "limits": {}, "fs_tier": {}}

    arenas = {s: bf16_arena(max(1, total // s), s, seed=s // KIB) for s in sizes}
    keys = {s: [os.urandom(32) + (0).to_bytes(4, "big") for _ in range(arenas[s].shape[0])]
            for s in sizes}

    # --- limits
    t0 = time.perf_counter()
    lim_rows = []
    for s in sizes:
        mc = bench_memcpy(arenas[s], s, reps)
        comp, decomp, ratio = bench_codec(arenas[s], s, reps, keys[s])
        lim_rows.append((s, mc, comp, decomp, ratio))
        results["limits"][s] = {"memcpy": mc, "compress": comp, "decompress": decomp, "ratio": ratio}
    big = bench_big_file(workdir, total, reps)
    results["limits"]["big_file"] = big
    create = bench_file_create(workdir, args.create_files, reps)
    results["limits"]["file_create_us"] = create

    # --- fs tier, repeat-major, configurations rotated per repeat
    ios = {"direct": (True,), "buffered": (False,), "both": (True, False)}[args.io]
    if True in ios and not probe_direct_io(workdir):
        print(f"note: {workdir} does not take O_DIRECT; buffered I/O only")
        ios = (False,)
    configs = [(s, m, f, d) for s in sizes for m in ("none", "auto") for f in (False, True)
               for d in ios]
    runs: dict = {c: [] for c in configs}
    for rep in range(reps):
        for c in rotated(configs, rep):
            s, m, f, d = c
            runs[c].append(run_fs(workdir, arenas[s], s, m, f, args.batch, keys[s],
                                  f"{rep}-{s}-{m}-{int(f)}-{int(d)}", measure_loads=not f,
                                  direct=d))
    elapsed = time.perf_counter() - t0

    # --- report
    print("\n## machine limits (same run)")
    print(f"{'chunk':>8} | {'memcpy GB/s':>20} | {'compress GB/s':>20} | {'decompress GB/s':>20} | ratio")
    for s, mc, comp, decomp, ratio in lim_rows:
        print(f"{s // KIB:>5}KiB | {spread(mc):>20} | {spread(comp):>20} | "
              f"{spread(decomp):>20} | {ratio:.3f}")
    print(f"\none {total // MIB} MiB file, {BLOCK // MIB} MiB requests:")
    for label, xs in big.items():
        print(f"  {label:<40} {spread(xs) + ' GB/s' if xs else 'not permitted here'}")
    print(f"\nper-file cost, {args.create_files} files in 16 directories (µs):")
    for label, xs in create.items():
        print(f"  {label:<40} {spread(xs, '{:.1f}')}")

    print("\n## FsBackend (GB/s of logical bytes; store = cascade, load = promotion)")
    hdr = (f"{'chunk':>8} {'codec':>5} {'io':>6} | {'store':>18} | {'store CPU':>18} | "
           f"{'store+fsync':>18} | {'ratio':>5} | {'io/codec %':>10} | {'load warm':>18} | "
           f"{'load cold':>18} | {'load cold CPU':>18}")
    print(hdr)
    print("-" * len(hdr))
    for s in sizes:
        for m in ("none", "auto"):
            for d in ios:
                a, f = runs[(s, m, False, d)], runs[(s, m, True, d)]
                io = med([r["store_io_frac"] for r in a]) * 100
                cod = med([r["store_codec_frac"] for r in a]) * 100
                print(f"{s // KIB:>5}KiB {m:>5} {'direct' if d else 'buffer':>6} | "
                      f"{spread([r['store'] for r in a]):>18} | "
                      f"{spread([r['store_cpu'] for r in a]):>18} | "
                      f"{spread([r['store'] for r in f]):>18} | {med([r['ratio'] for r in a]):5.2f} | "
                      f"{io:4.0f}/{cod:<4.0f}  | {spread([r['load_warm'] for r in a]):>18} | "
                      f"{spread([r['load_cold'] for r in a]):>18} | "
                      f"{spread([r['load_cold_cpu'] for r in a]):>18}")
                results["fs_tier"][f"{s}-{m}-{'direct' if d else 'buffered'}"] = {
                    "nofsync": a, "fsync": f}
    print("(io/codec %: share of store wall time in file syscalls / in the encoder, fsync off;"
          " CPU columns: GB per CPU second of this thread, kernel time included)")
    print("\nper-chunk metadata calls, µs (scan: per file found, warm dentries; probe: per key;"
          " delete: per file, written back)")
    print(f"{'chunk':>8} | {'scan':>18} | {'probe':>18} | {'delete':>18}")
    for s in sizes:
        a = [r for d in ios for m in ("none", "auto") for r in runs[(s, m, False, d)]]
        print(f"{s // KIB:>5}KiB | {spread([r['scan_us'] for r in a], '{:.1f}'):>18} | "
              f"{spread([r['probe_us'] for r in a], '{:.1f}'):>18} | "
              f"{spread([r['delete_us'] for r in a], '{:.0f}'):>18}")
    print(f"elapsed {elapsed:.1f} s")
    if args.json:
        write_json(args.json, results, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
