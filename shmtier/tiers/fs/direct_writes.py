"""O_DIRECT chunk writes kept in flight: the worker's thread puts each frame into a free
page-aligned buffer (gathers its parts, or has it encoded there: ``submit_fill``) and goes
on with the next chunk while an I/O thread writes, closes and publishes (renames) the file.

Runs in: tier worker processes. ``ChunkWriter.store`` (``store.py``), on the worker's
thread, calls ``submit`` (blocks while all ``depth`` buffers are in flight: the
backpressure) and ``DirectWrite.outcome`` (blocks until that write is done), both before its
store batch returns, so a key is reported stored only once its file is published. The
I/O threads touch nothing but what ``submit`` hands them: an open temp file, a duplicate
of its leaf directory's descriptor (the namespace's own leaf descriptors are cached and
may be closed by the worker's thread at any time), names, and the buffer.

Why (bench/README.md, "Writes that miss the page cache"): a buffered write of a new file
copies the frame into newly allocated page-cache pages, which on the 2-vCPU VM costs
2.6-7.3 s of kernel CPU per GiB once a run has written ~1.4 GiB, against 0.3-0.8 s with
O_DIRECT, as vLLM's fs tier writes. But one O_DIRECT write waits for the device (1.3-2.2
ms for 1.4 MiB here); written one at a time the tier workers cascaded up to a quarter
fewer chunks. With ``depth`` writes in flight per worker they keep up again.

::

    worker thread                                   I/O thread (one of depth)
    ─────────────                                   ─────────────────────────
    open temp (O_DIRECT), dup leaf fd
    submit: wait for a free buffer, gather (or
            encode) the frame into it (zero-padded
            to a page)                            ──▶ pwrite whole pages, ftruncate to
    ... next chunk ...                                the frame's size, [fsync], close,
    outcome(): wait ◀──────────────────────────────── rename temp -> final, close leaf dup,
                                                      free the buffer
                                                      (on error: unlink temp; None or
                                                      (errno, (Outcome, detail)))
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from shmtier.tiers.fs.config import MAX_WRITE_DEPTH
from shmtier.tiers.fs.fileio import (
    ALIGN,
    PageBuffer,
    close_quietly,
    publish_temp,
    unlink_quietly,
    write_pages,
)
from shmtier.tiers.fs.outcomes import errno_outcome

class DirectWrite:
    """One write handed to an I/O thread: ``outcome()`` waits for it and returns None
    (published) or ``(errno, (Outcome, detail))`` (nothing left behind);
    ``cpu_s`` then holds the CPU seconds it cost (the gather here plus the I/O thread's)."""

    __slots__ = ("_future", "gather_cpu_s", "cpu_s")

    def __init__(self, future: Future, gather_cpu_s: float):
        self._future = future
        self.gather_cpu_s = gather_cpu_s
        self.cpu_s = gather_cpu_s

    def done(self) -> bool:
        return self._future.done()

    def outcome(self) -> tuple[int, tuple] | None:
        problem, io_cpu_s = self._future.result()
        self.cpu_s = self.gather_cpu_s + io_cpu_s
        return problem


class DirectWrites:
    """Up to ``depth`` O_DIRECT writes in flight, each on its own I/O thread with its own
    chunk-sized buffer (allocated on first use: ``depth`` x the largest frame of memory).
    ``fsync``: fsync each file before its rename (the leaf directory's fsync stays with
    the caller, once per batch). ``close()`` waits for what is in flight."""

    def __init__(self, depth: int, *, fsync: bool):
        if not isinstance(depth, int) or not 1 <= depth <= MAX_WRITE_DEPTH:
            raise ValueError(f"fs tier write_depth={depth!r}: must be an integer in "
                             f"1..{MAX_WRITE_DEPTH}")
        self.fsync = fsync
        self._free: queue.SimpleQueue[PageBuffer] = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(PageBuffer(doubling=False))
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="fs-write")

    def submit(self, fd: int, leaf_fd: int, tmp: str, final: str, parts: Sequence,
               size: int) -> DirectWrite:
        """Hand over the open temp file ``fd`` (O_DIRECT) and ``leaf_fd``, a descriptor
        of its directory that the write owns from now on (both are closed by it), to write
        ``parts`` (``size`` bytes) and rename ``tmp`` over ``final``. Blocks while every
        buffer is in flight; the parts are copied before it returns. Should it raise
        (a closed ``DirectWrites``), both descriptors are closed and the temp removed."""
        return self.submit_fill(fd, leaf_fd, tmp, final, size, lambda out: _gather(parts, out))

    def submit_fill(self, fd: int, leaf_fd: int, tmp: str, final: str, size: int,
                    fill: Callable[[memoryview], object]) -> DirectWrite:
        """``submit`` of a frame that ``fill(out)`` writes into the write's buffer itself
        (``out``: a writable view of at least ``size`` bytes, page aligned; its first
        ``size`` bytes are written, e.g. by ``ChunkEncoder.encode_raw_into``: no copy of
        parts). Should ``fill`` raise, the buffer is freed, both descriptors are closed, the
        temp removed and the error raised."""
        started = time.thread_time()
        buf = self._free.get()
        try:
            padded = -(-size // ALIGN) * ALIGN
            out = buf.view(0, padded, padded + ALIGN)
            fill(out[:size].data)
            out[size:] = 0
            gather_s = time.thread_time() - started
            future = self._pool.submit(self._write, fd, leaf_fd, tmp, final, out, size, buf)
        except BaseException:
            self._free.put(buf)
            close_quietly(fd)
            unlink_quietly(tmp, dir_fd=leaf_fd)
            close_quietly(leaf_fd)
            raise
        return DirectWrite(future, gather_s)

    def _write(self, fd: int, leaf_fd: int, tmp: str, final: str, out: np.ndarray,
               size: int, buf: PageBuffer) -> tuple[tuple | None, float]:
        started = time.thread_time()
        try:
            failed = publish_temp(fd, leaf_fd, tmp, final,
                                  lambda f: write_pages(f, out, size), self.fsync)
            problem = None if failed is None else (failed[0].errno or 0,
                                                   errno_outcome(*failed))
            return problem, time.thread_time() - started
        finally:
            self._free.put(buf)
            close_quietly(leaf_fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        while not self._free.empty():
            self._free.get().release()


def _gather(parts: Sequence, out: memoryview) -> None:
    """The frame's ``parts`` copied one after another into ``out``."""
    dst = np.frombuffer(out, dtype=np.uint8)
    at = 0
    for part in parts:
        n = part.nbytes if isinstance(part, memoryview) else len(part)
        dst[at:at + n] = np.frombuffer(part, dtype=np.uint8)
        at += n
