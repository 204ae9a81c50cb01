"""O_DIRECT chunk reads kept in flight: the files of a load batch are read on I/O threads,
each into a page-aligned buffer of its own, while the worker's thread verifies and
copies the ones already read into their rows.

Runs in: tier worker processes. ``ChunkReader.load`` (``load.py``), on the worker's
thread, calls ``submit`` for at most ``depth`` reads at a time (it waits for the oldest
before it submits more) and ``DirectRead.result`` (blocks until that read is done),
then ``DirectRead.release`` once the frame is decoded; all before its load batch
returns. An I/O thread touches only the descriptor it is handed (it closes it) and its
buffer.

Why (bench/README.md, "Cost per byte over a long run"): a buffered read of a file the
page cache does not hold costs the worker the kernel's copy out of the page cache and
the page cache's upkeep, about half of the promotion lane's CPU over issue 29's long
run; vLLM's fs tier reads with O_DIRECT. One O_DIRECT read at a time waits for the
device file after file (no readahead), which made promotions slower than vLLM's 16
reader threads; ``depth`` reads in flight keep the device busy as the readahead did.

::

    worker thread                                  I/O thread (one of depth)
    ─────────────                                  ─────────────────────────
    open (O_DIRECT), fstat, checks
    submit ──────────────────────────────────────▶ preadv whole pages into its buffer,
    ... next file ...                              close the file
    result(): wait ◀────────────────────────────── frame | None (ended early) | OSError
    verify + copy into the row (copy_crc32c)
    release(): the buffer is free again
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor

from shmtier.tiers.fs.config import READ_DEPTH
from shmtier.tiers.fs.fileio import PageBuffer, close_quietly, read_direct


class DirectRead:
    """One read handed to an I/O thread: ``result()`` waits for it and returns the
    file's bytes (a view of the read's buffer, valid until ``release()``) or None if
    the file ended early; an ``OSError`` of the read is raised."""

    __slots__ = ("_future", "_buf", "_free")

    def __init__(self, future: Future, buf: PageBuffer, free: queue.SimpleQueue):
        self._future = future
        self._buf = buf
        self._free = free

    def result(self) -> memoryview | None:
        return self._future.result()

    def release(self) -> None:
        """The buffer back to the pool (after the frame was decoded, or given up)."""
        if self._buf is not None:
            self._future.exception()  # the read has finished with the buffer
            self._free.put(self._buf)
            self._buf = None


class DirectReads:
    """Up to ``depth`` O_DIRECT reads in flight, each on its own I/O thread into its own
    page-aligned buffer (grown to the largest file read: ``depth`` x a chunk of memory).
    ``close()`` waits for what is in flight and drops the buffers."""

    def __init__(self, depth: int = READ_DEPTH):
        self.depth = depth
        self._free: queue.SimpleQueue[PageBuffer] = queue.SimpleQueue()
        for _ in range(depth):
            self._free.put(PageBuffer(doubling=False))
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="fs-read")

    def submit(self, fd: int, size: int, cap: int) -> DirectRead:
        """Read the ``size``-byte file open as ``fd`` (with O_DIRECT; at most ``cap``
        bytes) whole on an I/O thread, which closes ``fd``. The caller keeps at most
        ``depth`` reads unreleased (this blocks until a buffer is free). Should it raise
        (a closed ``DirectReads``), ``fd`` is closed."""
        buf = self._free.get()
        try:
            future = self._pool.submit(_read, fd, size, cap, buf)
        except BaseException:
            self._free.put(buf)
            close_quietly(fd)
            raise
        return DirectRead(future, buf, self._free)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        while not self._free.empty():
            self._free.get().release()


def _read(fd: int, size: int, cap: int, buf: PageBuffer) -> memoryview | None:
    try:
        return read_direct(fd, size, cap, buf)
    finally:
        close_quietly(fd)
