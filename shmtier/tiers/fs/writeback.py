"""A bounded page-cache footprint for buffered stores: each written file's writeback starts
at once, and once a worker's recent files hold more than ``max_bytes`` of page cache the
oldest are waited for (their writeback long done by then) and dropped from the cache.

Runs in: tier worker processes (``ChunkWriter``, the fs tier's ``page_cache_bytes``, on
the worker's single thread; not thread-safe). Blocks only in ``published``, when the
oldest file's writeback is still running (it had ``max_bytes`` of later writes' time to
finish), and for the open of that file.

Why (bench/README.md, "A bounded page cache for the stores"): on the 2-vCPU VM a buffered write
into new page-cache pages costs 5-8 s of kernel CPU per GiB once ~1 GiB of memory the guest
had handed back to the host is touched again (anonymous memory costs the same: it is the
VM's, not the filesystem's), against ~1 s when the pages come from files just dropped. A
window keeps the page cache of the stores recycling the same pages instead of growing into
fresh memory, and keeps a second copy of the KV out of the host's memory, as O_DIRECT does,
without making the worker wait for the device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections import deque
from typing import Any, Callable

from shmtier.tiers.fs.fileio import close_quietly

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none (Python's ``os``
    does not wrap it)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        f = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_sync_file_range = _load_sync_file_range()


def supported() -> bool:
    """Whether this platform can start and wait for one file's writeback and drop it."""
    return _sync_file_range is not None and _FADV_DONTNEED is not None


class WritebackWindow:
    """The files a worker wrote most recently, up to ``max_bytes`` of them left in the page
    cache (``supported()`` must be true). ``start(fd)``: a file was just written through
    ``fd``, start its writeback; ``published(where, size)``: it is published at ``where``;
    older files past the window are then reopened with ``open_file(where)`` (which may
    raise OSError: a file deleted since is simply gone, its pages with it) and dropped.
    No descriptor is kept between calls, so a deleted file's space is freed at once."""

    def __init__(self, max_bytes: int, open_file: Callable[[Any], int]):
        self.max_bytes = max_bytes
        self._open = open_file
        self._files: deque[tuple[Any, int]] = deque()  # (where, bytes), oldest first
        self._bytes = 0

    @staticmethod
    def start(fd: int) -> None:
        """Start the writeback of the file just written through ``fd`` (not waited for).
        A failure costs only the cache footprint: the write itself is its caller's."""
        _sync_file_range(fd, 0, 0, _WRITE)

    def published(self, where: Any, size: int) -> None:
        """A file of ``size`` bytes written (``start``) is published at ``where``; drop
        the oldest files past the window (waiting for a writeback still running)."""
        self._files.append((where, size))
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._files) > 1:
            old, n = self._files.popleft()
            self._bytes -= n
            try:
                fd = self._open(old)
            except OSError:
                continue  # deleted meanwhile: its pages went with it
            try:
                if _sync_file_range(fd, 0, 0, _WAIT_BEFORE | _WRITE | _WAIT_AFTER) == 0:
                    os.posix_fadvise(fd, 0, 0, _FADV_DONTNEED)
            except OSError:
                pass
            finally:
                close_quietly(fd)

    def clear(self) -> None:
        """Forget the files (their pages stay cached until the kernel needs them)."""
        self._files.clear()
        self._bytes = 0
