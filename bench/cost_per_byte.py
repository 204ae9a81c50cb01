#!/usr/bin/env python
"""Tier-worker CPU seconds per GiB cascaded and per GiB promoted, split by step, next to
this machine's limits measured in the same run (issue 14 item 1).

Run from a checkout::

    .venv/bin/python -m bench.cost_per_byte                 # 1408 KiB chunks, 192 MiB per run, 3 repeats
    .venv/bin/python -m bench.cost_per_byte --quick         # smoke test: 32 MiB, 1 repeat
    .venv/bin/python -m bench.cost_per_byte --chunk-kib 256 --total-mib 256 --repeats 5
    .venv/bin/python -m bench.cost_per_byte --json bench/results/cost_per_byte.json

What runs: one process, one thread -- what one tier worker does for one job after
another. A cascade is what the job loop does for a store job: ``jobs.decode_job`` of
the job's wire bytes, ``FsBackend.store`` in slices (2 MiB, as ``workers/job_loop.py``),
``jobs.encode_result`` of its answer; a promotion likewise with ``FsBackend.load`` in
slices of 8 keys, warm (files in the page cache) and cold (each file ``fdatasync``-ed and
dropped with ``posix_fadvise(DONTNEED)``). Chunks: random-normal bf16 in a page-aligned,
pre-faulted arena (rows one page longer than the chunk). Codecs: ``auto`` (byte split +
zstd) and ``none`` (raw frames: what a hurried worker writes). The whole path is timed
with the thread's CPU clock (``getrusage(RUSAGE_THREAD)``: user and kernel apart).

Then each step alone, over the same chunks and frames, timed the same way:

* cascade: ``split`` (byte planes + CRC-32C of the low plane, one C pass), ``compress``
  (zstd of the high plane), ``checksum`` (CRC-32C of the zstd payload and the header;
  of the whole chunk for a raw frame), ``kernel write`` (``writev`` of the frame's parts
  into an open new file: the copy into the page cache), ``file ops`` (create, stat,
  close, rename of the file), ``job`` (decode of the job, encode of the result);
* promotion: ``file ops`` (open, fstat, readahead hint, close), ``kernel read``
  (``preadv`` of the whole file into the read buffer; a raw frame's header into it and
  its payload straight into the row), ``checksum`` (CRC-32C of the stored planes / raw
  bytes), ``decompress`` (zstd of the high plane into scratch, its content checksum
  included), ``merge`` (the planes interleaved into the row), ``job``;
* ``python + rest`` = the whole path minus the sum of the steps: the interpreter's
  work between them (argument checks, per-key bookkeeping, namespace lookups, result
  building) and anything the isolated steps do not reproduce (cache misses).

Limits, same run, same chunks: ``memcpy`` (np.copyto between rows), the codec alone
(``ChunkEncoder.encode`` / ``ChunkDecoder.decode_into``, mode auto, CPU GB/s of one
core), one big file written and read in 4 MiB requests (``fs_tier.bench_big_file``:
buffered, + fsync, O_DIRECT if permitted, cold and warm reads). Every figure: median
over ``--repeats`` with [min-max]; variants interleaved repeat-major. ``os.sync()``
before every timed region. The temp directory is removed at the end (also on SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

from bench.fs_tier import (aligned, bench_big_file, bench_memcpy, bf16_arena, drop_cache, med,
                           spread)
from shmtier.bench.common import exit_through_finally, write_json
from shmtier.shared import jobs
from shmtier.shared._planes import crc32c, merge, split
from shmtier.shared.codec import (ChunkDecoder, ChunkEncoder, CompressionConfig,
                                  frame_header_size, parse_frame_header)
from shmtier.tiers.fs.backend import FsBackend

KIB, MIB, GIB, GB = 1 << 10, 1 << 20, 1 << 30, 1e9
STORE_SLICE = 2 << 20  # workers/job_loop.py _STORE_SLICE_BYTES
LOAD_SLICE = 8  # workers/job_loop.py _KEYS_PER_BEAT
JOB_KEYS = 8  # keys per job


def cpu() -> tuple[float, float]:
    """(user, sys) CPU seconds of this thread."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime


class Clock:
    """Accumulates one step's thread CPU time (``time.thread_time``: ns resolution)."""

    def __init__(self):
        self.s = 0.0

    def __enter__(self):
        self._t = time.thread_time()

    def __exit__(self, *exc):
        self.s += time.thread_time() - self._t


def job_bytes(op: str, keys, rows) -> list[bytes]:
    return [jobs.encode_job(jobs.Job(i, op, 0, keys[i:i + JOB_KEYS], rows[i:i + JOB_KEYS]))
            for i in range(0, len(keys), JOB_KEYS)]


def run_jobs(op: str, backend: FsBackend, wire: list[bytes], arena, chunk: int,
             slice_keys: int) -> tuple[float, float, int]:
    """Run the jobs as the job loop does (decode, backend in slices, encode the result);
    (user s, sys s, stored bytes)."""
    handler = backend.store if op == "store" else backend.load
    stored = 0
    u0, s0 = cpu()
    for raw in wire:
        job = jobs.decode_job(raw)
        outcomes, logical, sizes = [], [], []
        for i in range(0, len(job.keys), slice_keys):
            part = handler(job.keys[i:i + slice_keys], job.rows[i:i + slice_keys], arena, chunk)
            outcomes += part.outcomes
            logical += part.logical_bytes
            sizes += part.stored_bytes
        jobs.encode_result(jobs.Result(job.job_id, outcomes, logical, sizes,
                                       [0.0] * len(outcomes), 0.0))
        if any(o != jobs.Outcome.OK for o in outcomes):
            raise RuntimeError(f"{op} failed: {set(outcomes)}")
        stored += sum(sizes)
    u1, s1 = cpu()
    return u1 - u0, s1 - s0, stored


def steps_store(mode: str, arena, chunk: int, keys, workdir: str) -> dict[str, float]:
    """Each step of a cascade alone (CPU s over all chunks)."""
    n = arena.shape[0]
    enc = ChunkEncoder(CompressionConfig(mode))
    c = {k: Clock() for k in ("split", "compress", "checksum", "kernel write", "file ops", "job")}
    half = chunk // 2
    hi, lo = aligned(half), aligned(half)
    frames = []
    for r in range(n):
        mv = arena[r, :chunk].data
        if mode == "none":
            with c["checksum"]:
                crc32c(mv)
            frames.append([b"h" * 80, mv])
            continue
        with c["split"]:
            split(mv, hi, lo)
        with c["compress"]:
            comp = enc._cctx_split.compress(hi)
        with c["checksum"]:
            crc32c(comp)
            crc32c(b"h" * 80)
        frames.append([b"h" * 80, comp, bytes(lo)])
    d = os.path.join(workdir, "steps-w")
    os.mkdir(d)
    os.sync()
    for r, parts in enumerate(frames):
        tmp, final = os.path.join(d, f".{r}.tmp"), os.path.join(d, f"{r}.kv")
        with c["file ops"]:
            try:
                os.stat(final)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with c["kernel write"]:
            os.writev(fd, parts)
        with c["file ops"]:
            os.close(fd)
            os.rename(tmp, final)
    rows = list(range(n))
    for raw in job_bytes("store", keys, rows):
        with c["job"]:
            job = jobs.decode_job(raw)
            k = len(job.keys)
            jobs.encode_result(jobs.Result(job.job_id, [jobs.Outcome.OK] * k, [chunk] * k,
                                           [chunk] * k, [0.0] * k, 0.0))
    shutil.rmtree(d)
    return {k: v.s for k, v in c.items()}


def steps_load(arena, chunk: int, keys, paths: list[str], cold: bool) -> dict[str, float]:
    """Each step of a promotion alone, over the files the whole run read."""
    n = arena.shape[0]
    dec = ChunkDecoder()
    c = {k: Clock() for k in ("file ops", "kernel read", "checksum", "decompress",
                              "merge", "job")}
    if cold:
        for p in paths:
            drop_cache(p)
    os.sync()
    buf = aligned(chunk + 2 * 4096 + chunk // 64)
    out = aligned(chunk)
    hi = aligned(chunk // 2)
    for p in paths:
        with c["file ops"]:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
            st = os.fstat(fd)
            os.posix_fadvise(fd, 0, st.st_size, os.POSIX_FADV_WILLNEED)
        view = buf[:st.st_size].data
        if st.st_size == frame_header_size(len(keys[0])) + chunk:  # raw: into the row
            head = view[:st.st_size - chunk]
            with c["kernel read"]:
                os.preadv(fd, [head, out.data], 0)
            with c["file ops"]:
                os.close(fd)
            with c["checksum"]:
                crc32c(out.data)
            continue
        with c["kernel read"]:
            os.preadv(fd, [view], 0)
        with c["file ops"]:
            os.close(fd)
        h = parse_frame_header(view)
        payload = view[h.header_size:]
        half = h.raw_len // 2
        comp, lo = payload[:h.stored_len - half], payload[h.stored_len - half:]
        with c["checksum"]:
            crc32c(comp)
            crc32c(lo)
        with c["decompress"]:
            dec._decompress(comp, hi.data, checksummed=True)
        with c["merge"]:
            merge(hi, lo, out.data)
    rows = list(range(n))
    for raw in job_bytes("load", keys, rows):
        with c["job"]:
            job = jobs.decode_job(raw)
            k = len(job.keys)
            jobs.encode_result(jobs.Result(job.job_id, [jobs.Outcome.OK] * k, [chunk] * k,
                                           [chunk] * k, [0.0] * k, 0.0))
    return {k: v.s for k, v in c.items()}


def one_repeat(mode: str, arena, chunk: int, keys, workdir: str, rep: int) -> dict:
    n = arena.shape[0]
    root = os.path.join(workdir, f"root-{mode}-{rep}")
    os.mkdir(root)
    b = FsBackend(root, f"cost {mode} {rep}", codec_config=CompressionConfig(mode),
                  min_free_bytes=0, max_bytes=2 * n * (chunk + 4096), chunk_bytes_hint=chunk)
    # mode auto measured compressing every chunk: compression by cost off (on a busy host
    # it could choose raw frames, which mode none measures)
    b._writer.chooser = None
    rows = list(range(n))
    out: dict = {}
    os.sync()
    u, s, stored = run_jobs("store", b, job_bytes("store", keys, rows), arena, chunk,
                            max(1, STORE_SLICE // chunk))
    out["cascade"] = {"whole": u + s, "user": u, "sys": s,
                      "steps": steps_store(mode, arena, chunk, keys, workdir)}
    out["ratio"] = n * chunk / stored
    paths = [b.path_for(k) for k in keys]
    dst = aligned(arena.size).reshape(arena.shape)
    for label, cold in (("promote warm", False), ("promote cold", True)):
        if cold:
            for p in paths:
                drop_cache(p)
        os.sync()
        u, s, _ = run_jobs("load", b, job_bytes("load", keys, rows), dst, chunk, LOAD_SLICE)
        if not np.array_equal(dst[:, :chunk], arena[:, :chunk]):
            raise RuntimeError("promoted rows differ from the cascaded ones")
        out[label] = {"whole": u + s, "user": u, "sys": s,
                      "steps": steps_load(arena, chunk, keys, paths, cold)}
    b.close() if hasattr(b, "close") else None
    shutil.rmtree(root)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk-kib", type=int, default=1408)
    ap.add_argument("--total-mib", type=int, default=192, help="chunk bytes per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="auto,none")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: system tmp)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.total_mib, args.repeats = 32, 1
    chunk = args.chunk_kib * KIB
    n = max(8, args.total_mib * MIB // chunk)
    modes = args.modes.split(",")
    exit_through_finally()
    workdir = tempfile.mkdtemp(prefix="shmtier-cost-", dir=args.dir)
    try:
        return _run(args, chunk, n, modes, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, chunk: int, n: int, modes: list[str], workdir: str) -> int:
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}; dir {workdir}")
    print(f"chunk {chunk // KIB} KiB, {n} chunks ({n * chunk / MIB:.0f} MiB) per run, "
          f"{args.repeats} repeats, modes {modes}")
    arena = bf16_arena(n, chunk)
    keys = [os.urandom(32) + r.to_bytes(4, "big") for r in range(n)]
    runs: dict[str, list] = {m: [] for m in modes}
    limits: dict[str, list] = {}
    for rep in range(args.repeats):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            runs[m].append(one_repeat(m, arena, chunk, keys, workdir, rep))
        limits.setdefault("memcpy GB/s", []).extend(bench_memcpy(arena, chunk, 1))
        comp, decomp = bench_codec_cpu(arena, chunk, keys)
        limits.setdefault("codec auto compress GB/s per core", []).append(comp)
        limits.setdefault("codec auto decompress GB/s per core", []).append(decomp)
        for k, v in bench_big_file(workdir, min(256 * MIB, n * chunk), 1).items():
            limits.setdefault(f"fs {k} GB/s", []).extend(v)
    gib = n * chunk / GIB
    report: dict = {"chunk_bytes": chunk, "chunks": n, "load_avg_end": os.getloadavg()[0],
                    "limits": limits, "modes": {}}
    print(f"\nmachine limits (same run), median [min-max]:")
    for k, v in limits.items():
        print(f"  {k:<52} {spread(v)}")
    for m in modes:
        rs = runs[m]
        print(f"\nmode {m}: ratio {med([r['ratio'] for r in rs]):.3f}; tier-worker CPU s per GiB "
              f"(logical), median [min-max]")
        report["modes"][m] = {}
        for path in ("cascade", "promote warm", "promote cold"):
            whole = [r[path]["whole"] / gib for r in rs]
            sysp = [r[path]["sys"] / gib for r in rs]
            steps = {k: [r[path]["steps"][k] / gib for r in rs] for k in rs[0][path]["steps"]}
            rest = [w - sum(r[path]["steps"].values()) / gib for w, r in zip(whole, rs)]
            print(f"  {path:<14} whole {spread(whole)} (kernel {spread(sysp)}); "
                  f"= {1 / med(whole):.2f} GB/s per core" if med(whole) else "")
            for k, v in steps.items():
                if med(v) > 0.0005:
                    print(f"      {k:<16} {spread(v, '{:.3f}')}  {100 * med(v) / med(whole):4.0f}%")
            print(f"      {'python + rest':<16} {spread(rest, '{:.3f}')}  "
                  f"{100 * med(rest) / med(whole):4.0f}%")
            report["modes"][m][path] = {"whole": whole, "sys": sysp, "steps": steps, "rest": rest}
        report["modes"][m]["ratio"] = [r["ratio"] for r in rs]
    print(f"\nload avg at end {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, report)
    return 0


def bench_codec_cpu(arena, chunk: int, keys) -> tuple[float, float]:
    """Codec alone, mode auto: CPU GB/s of one core (thread time), compress and decompress."""
    enc, dec = ChunkEncoder(CompressionConfig("auto")), ChunkDecoder()
    n = arena.shape[0]
    frames, spent = [], 0.0
    for r in range(n):
        t = time.thread_time()
        parts, _ = enc.encode(arena[r, :chunk].data, keys[r], 2)
        spent += time.thread_time() - t
        frames.append(b"".join(bytes(p) for p in parts))
    comp = n * chunk / spent / GB
    out = aligned(chunk)
    t = time.thread_time()
    for r in range(n):
        dec.decode_into(memoryview(frames[r]), keys[r], out.data)
    return comp, n * chunk / (time.thread_time() - t) / GB


if __name__ == "__main__":
    sys.exit(main())
