#!/usr/bin/env python
"""How late a sleeping thread gets its CPU back while background writers write files in
pieces of a given size: the kernel effect behind the fs tier's ``WRITE_PIECE_BYTES``.

Run from a checkout::

    .venv/bin/python -m bench.wake_latency                       # pieces 1408, 256, 64 KiB, x2
    .venv/bin/python -m bench.wake_latency --pieces-kib 1408,128 --rounds 3 --seconds 5

Method: per round and piece size, ``--writers`` processes (2: the default tier worker
count) at the tier workers' scheduling (SCHED_BATCH, niceness 10) write new 1408 KiB files
(the design's chunk) into a fresh temp directory with one ``write`` per piece (keeping all
of them: the page cache grows, as an unbounded fs tier's does; ``--keep-files N`` truncates
older ones), removed after the round; meanwhile this
process's main thread (SCHED_OTHER, niceness 0, as an engine thread) sleeps 1 ms again and
again for ``--seconds`` and notes how late each sleep ended. Figures: lateness p50, p99,
p99.9, max in µs and the sleeps measured; sizes alternate within a round. On a kernel
without preemption (``PREEMPT_NONE``: a system call runs to its end before the core goes
to a task that woke) the lateness follows the time one write holds the core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

from shmtier.bench.common import exit_through_finally, fmt_mr, join_or_kill, med_range, pct

CHUNK = 1408 * 1024


def _writer(piece: int, directory: str, keep: int, stop) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        os.nice(10)
    except (OSError, AttributeError):
        pass
    data = memoryview(np.random.default_rng(os.getpid()).integers(
        0, 256, CHUNK, dtype=np.uint8).tobytes())
    n = 0
    while not stop.is_set():
        path = os.path.join(directory, f"{os.getpid()}_{n}")
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            for off in range(0, CHUNK, piece):
                os.write(fd, data[off:off + piece])
        finally:
            os.close(fd)
        if keep and n >= keep:  # the oldest file's blocks and page cache freed
            os.truncate(os.path.join(directory, f"{os.getpid()}_{n - keep}"), 0)
        n += 1


def one_round(piece: int, writers: int, keep: int, seconds: float, parent: str) -> list[int]:
    """Sleep lateness in ns while ``writers`` processes write in ``piece``-byte pieces,
    each keeping its last ``keep`` files (0: all)."""
    directory = tempfile.mkdtemp(prefix="wake_latency_", dir=parent)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(piece, directory, keep, stop), daemon=True)
             for _ in range(writers)]
    late = []
    try:
        for p in procs:
            p.start()
        time.sleep(0.5)  # the writers at full speed
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter_ns()
            time.sleep(0.001)
            late.append(time.perf_counter_ns() - t0 - 1_000_000)
    finally:
        stop.set()
        join_or_kill(procs, 10)
        shutil.rmtree(directory, ignore_errors=True)
    return late


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces-kib", default="1408,256,64", help="write sizes, KiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured per round and size")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--keep-files", type=int, default=0,
                    help="files each writer keeps, older ones truncated (0: all, the page "
                         "cache grows as an unbounded fs tier's does)")
    ap.add_argument("--dir", default=None, help="parent of the temp directory (default: system tmp)")
    args = ap.parse_args(argv)
    exit_through_finally()
    pieces = [int(x) * 1024 for x in args.pieces_kib.split(",")]
    print(f"wake_latency: python {platform.python_version()}, {os.cpu_count()} CPUs, kernel "
          f"{platform.release()}, load avg {os.getloadavg()[0]:.2f}; {args.writers} writers "
          f"(SCHED_BATCH, nice 10) of {CHUNK // 1024} KiB files, 1 ms sleeps for "
          f"{args.seconds:g} s per round; lateness µs: median [min-max] over rounds")
    results: dict[int, list[list[int]]] = {p: [] for p in pieces}
    for r in range(args.rounds):
        for piece in pieces:
            late = one_round(piece, args.writers, args.keep_files, args.seconds, args.dir)
            results[piece].append(late)
            us = [v / 1e3 for v in late]
            print(f"  round {r + 1} piece {piece // 1024:5d} KiB: p50 {pct(us, 50):.0f} p99 "
                  f"{pct(us, 99):.0f} p99.9 {pct(us, 99.9):.0f} max {max(us):.0f} "
                  f"({len(us)} sleeps)", flush=True)
    print("piece KiB      p50           p99                p99.9              max")
    for piece in pieces:
        rows = [[v / 1e3 for v in late] for late in results[piece]]
        cells = [fmt_mr(med_range([pct(r, q) for r in rows]), 0) for q in (50, 99, 99.9)]
        cells.append(fmt_mr(med_range([max(r) for r in rows]), 0))
        print(f"{piece // 1024:9d}  " + "  ".join(f"{c:>17}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
