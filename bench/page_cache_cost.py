"""What a new byte of page cache (or of anonymous memory) costs this machine, and what
keeping the stores' page cache to a window saves (the fs tier's ``page_cache_bytes``).

Method: one thread writes rounds of new files of ``--file-kib`` (default 1408 KiB, the §10
chunk) into a fresh temp directory (under ``--dir``, default the system temp dir), each
as the fs tier does (create a temp file, one write, rename); per round the thread's CPU
seconds and wall seconds per GiB. Modes, run one after another:

* ``plain``: buffered, nothing else (the fs tier's default);
* ``window``: buffered, writeback started after each file and files past the window
  (``--window-mib``) waited for and dropped (``shmtier/tiers/fs/writeback.py``, the same
  class the tier uses); "waited" is the time spent waiting for a writeback;
* ``auto``: the window as ``page_cache_bytes: "auto"`` runs it (the tier's default): each
  write timed, no bound until a measure is expensive; the line says when it closed and
  at what bound;
* ``anon``: the same bytes copied into new anonymous memory (mmap), kept until the end,
  to tell the machine's cost of new memory from the filesystem's.

Every mode's files are removed before the next mode starts, and the temp directory at
the end (also on Ctrl-C). On a VM whose balloon reports free memory to the host, the
first ~1 GiB of a mode is cheap (memory freed moments before) and later rounds show what
memory the guest has to get back costs; ``window`` should stay flat.

    .venv/bin/python -m bench.page_cache_cost                    # 6 rounds of 400 files each mode
    .venv/bin/python -m bench.page_cache_cost --rounds 3 --files 200 --modes plain,window
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from shmtier.tiers.fs import writeback


def run_files(root: str, mode: str, rounds: int, files: int, size: int,
              window_bytes: int) -> list[tuple[float, float, float]]:
    data = os.urandom(size)
    bound = {"window": window_bytes, "auto": writeback.AUTO}.get(mode)
    win = (writeback.WritebackWindow(bound, lambda name: os.open(name, os.O_RDONLY))
           if bound is not None else None)
    out, k = [], 0
    for _ in range(rounds):
        waited = 0.0
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for _ in range(files):
            final = os.path.join(root, f"f{k}")
            k += 1
            fd = os.open(final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if win is not None and win.measuring:  # as the tier's ChunkWriter does
                    cpu = time.thread_time()
                    os.write(fd, data)
                    win.note_write(size, time.thread_time() - cpu)
                else:
                    os.write(fd, data)
                if win is not None:
                    win.start(fd)
            finally:
                os.close(fd)
            os.rename(final + ".tmp", final)
            if win is not None:
                t = time.perf_counter()
                win.published(final, size)
                waited += time.perf_counter() - t
        gib = files * size / 2**30
        out.append(((time.thread_time() - cpu0) / gib, (time.perf_counter() - wall0) / gib,
                    waited / gib))
    if mode == "auto":
        print(f"auto    closed: " + ("no (writes stayed cheap)" if win.closed_by is None else
              f"after {win.closed_at_bytes / 2**30:.2f} GiB written, at {win.closed_by:.1f} "
              f"s/GiB, bound {win.max_bytes / 2**20:.0f} MiB"))
    return out


def run_anon(rounds: int, files: int, size: int) -> list[tuple[float, float, float]]:
    data = os.urandom(size)
    kept, out = [], []
    for _ in range(rounds):
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        m = mmap.mmap(-1, files * size)
        for i in range(files):
            m[i * size:(i + 1) * size] = data
        kept.append(m)
        gib = files * size / 2**30
        out.append(((time.thread_time() - cpu0) / gib, (time.perf_counter() - wall0) / gib, 0.0))
    for m in kept:
        m.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="parent of the temp directory")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--files", type=int, default=400, help="files (or copies) per round")
    ap.add_argument("--file-kib", type=int, default=1408)
    ap.add_argument("--window-mib", type=int, default=64, help="window mode's bound")
    ap.add_argument("--modes", default="plain,window,auto,anon")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in ("plain", "window", "auto", "anon")]
    if bad:
        ap.error(f"--modes: unknown {bad} (plain, window, auto, anon)")
    if {"window", "auto"} & set(modes) and not writeback.supported():
        ap.error("window and auto modes need sync_file_range and POSIX_FADV_DONTNEED (Linux)")
    size = args.file_kib << 10
    print(f"# page_cache_cost: {args.rounds} rounds x {args.files} x {args.file_kib} KiB "
          f"({args.files * size / 2**30:.2f} GiB a round) per mode; window {args.window_mib} MiB; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print("# CPU and wall: seconds of this thread per GiB written; waited: inside the window's "
          "waits for writeback")
    top = tempfile.mkdtemp(prefix="shmtier-bench-pagecache-", dir=args.dir)
    try:
        for mode in modes:
            root = os.path.join(top, mode)
            os.mkdir(root)
            rows = (run_anon(args.rounds, args.files, size) if mode == "anon" else
                    run_files(root, mode, args.rounds, args.files, size, args.window_mib << 20))
            shutil.rmtree(root)
            for r, (cpu, wall, waited) in enumerate(rows):
                print(f"{mode:7s} round {r}: CPU {cpu:5.2f}  wall {wall:5.2f}  waited {waited:4.2f}")
            late = [c for c, _w, _x in rows[2:]] or [c for c, _w, _x in rows]
            print(f"{mode:7s} rounds 3+ (all if fewer): CPU s/GiB median {statistics.median(late):.2f} "
                  f"[{min(late):.2f}-{max(late):.2f}]")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
