"""A bounded page-cache footprint for buffered stores: each written file's writeback starts
at once, and once a worker's recent files hold more than a bound of page cache the oldest
are waited for (their writeback long done by then) and dropped from the cache.

Runs in: tier worker processes (``ChunkWriter``, the fs tier's ``page_cache_bytes``, on
the worker's single thread; not thread-safe). Blocks only in ``published``, when the
oldest file's writeback is still running (it had the bound's worth of later writes'
time to finish), and for the open of that file.

The bound is fixed (``page_cache_bytes`` an integer) or found (``"auto"``): the window
then starts open (no writeback started, nothing dropped: the kernel's choice) and times
the CPU its buffered writes take; once one measure of ``AUTO_MEASURE_BYTES`` costs more
than ``AUTO_EXPENSIVE_S_PER_GIB`` per GiB, new page cache is expensive on this host, and
the window closes at the page cache it already holds (at least ``AUTO_MIN_BYTES``): the
footprint stops growing, the files written before are written back ahead of their drop
(``_LOOKAHEAD``) so that a drop does not wait for the device. On a host where the
page cache is cheap, the window never closes.

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
import logging
import os
from collections import deque
from typing import Any, Callable

from shmtier.tiers.fs.fileio import close_quietly

logger = logging.getLogger(__name__)

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* (linux/fs.h)
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)

#: ``page_cache_bytes`` value for a bound the window finds itself.
AUTO = "auto"
#: Buffered-write CPU per GiB above which new page cache counts as expensive. Here a
#: write into recycled or first-touched pages costs 0.35-1.0 s/GiB, into memory the VM
#: handed back 4.2-8.4 (bench/README.md, "A bounded page cache for the stores").
AUTO_EXPENSIVE_S_PER_GIB = 2.5
#: Bytes written per measure of that cost (one slow write cannot close the window).
AUTO_MEASURE_BYTES = 32 << 20
#: The least page cache an auto window keeps once closed.
AUTO_MIN_BYTES = 64 << 20
#: Files an open window remembers (the oldest forgotten are never dropped by it).
_TRACK_MAX_FILES = 1 << 14
#: Files ahead of the next drop whose writeback is started, so that a drop finds them
#: clean (those written before an auto window closed: no writeback was started for them).
_LOOKAHEAD = 8


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none (Python's ``os``
    does not wrap it). Looked up in the symbols the interpreter has loaded already (libc
    among them), not with ``ctypes.util.find_library``: that runs ``ldconfig`` in a child
    process, and a tier worker imports this module inside its first job. On a busy host
    the worker (and so its child) gets next to no CPU, and while a child has not yet
    exec'd, its parent waits in the kernel (vfork) unable to beat: it was judged hung
    and killed (tests/test_pool.py, test_a_worker_starved_of_cpu_is_slow_not_hung)."""
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
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
    cache (``supported()`` must be true), or with ``max_bytes`` ``AUTO`` up to what they
    hold when new page cache turns out expensive (module docstring). ``start(fd)``: a
    file was just written through ``fd``; ``note_write(size, cpu_s)``: that write's
    thread CPU (only asked for while ``measuring``); ``published(where, size)``: it is
    published at ``where``; older files past the window are then reopened with
    ``open_file(where)`` (which may raise OSError: a file deleted since is simply gone,
    its pages with it) and dropped. No descriptor is kept between calls, so a deleted
    file's space is freed at once. ``label`` names the tier in the log line an auto
    window writes when it closes. ``instead_of_closing(s_per_gib, bytes_written)``: called,
    when given, where an auto window's measure comes out expensive, in place of closing it
    (the caller stops writing buffered: O_DIRECT); the window then measures no more."""

    def __init__(self, max_bytes: int | str, open_file: Callable[[Any], int], label: str = "",
                 instead_of_closing: Callable[[float, int], None] | None = None):
        #: the bound; None while an auto window is open
        self.max_bytes: int | None = None if max_bytes == AUTO else int(max_bytes)
        self._open = open_file
        self._label = label
        self._instead_of_closing = instead_of_closing
        self._handed_over = False
        # (where, bytes, writeback started), oldest first
        self._files: deque[tuple[Any, int, bool]] = deque()
        self._bytes = 0
        self._measured_bytes = 0
        self._measured_cpu_s = 0.0
        self._written = 0
        #: an auto window that closed: the CPU s per GiB of the measure that closed it,
        #: and the bytes written (``note_write``) by then
        self.closed_by: float | None = None
        self.closed_at_bytes: int | None = None

    @property
    def measuring(self) -> bool:
        """Whether the caller should time its writes for ``note_write``."""
        return self.max_bytes is None and not self._handed_over

    def start(self, fd: int) -> None:
        """Start the writeback of the file just written through ``fd`` (not waited for;
        not while an auto window is open). A failure costs only the cache footprint: the
        write itself is its caller's."""
        if self.max_bytes is not None:
            _sync_file_range(fd, 0, 0, _WRITE)

    def note_write(self, size: int, cpu_s: float) -> None:
        """A buffered write of ``size`` bytes took ``cpu_s`` of this thread's CPU. Closes
        an auto window at its footprint once a measure comes out expensive."""
        if not self.measuring:
            return
        self._written += size
        self._measured_bytes += size
        self._measured_cpu_s += cpu_s
        if self._measured_bytes < AUTO_MEASURE_BYTES:
            return
        s_per_gib = self._measured_cpu_s / self._measured_bytes * (1 << 30)
        self._measured_bytes, self._measured_cpu_s = 0, 0.0
        if s_per_gib > AUTO_EXPENSIVE_S_PER_GIB:
            if self._instead_of_closing is not None:
                self._handed_over = True
                self._instead_of_closing(s_per_gib, self._written)
                return
            self.max_bytes = max(AUTO_MIN_BYTES, self._bytes)
            self.closed_by = s_per_gib
            self.closed_at_bytes = self._written
            logger.info("tier %s: buffered writes cost %.1f s of CPU per GiB (new page cache "
                        "is expensive on this host) after %d MiB written: this worker's "
                        "stores now keep at most %d MiB in the page cache (page_cache_bytes "
                        "\"auto\")", self._label, s_per_gib, self._written >> 20,
                        self.max_bytes >> 20)

    def published(self, where: Any, size: int) -> None:
        """A file of ``size`` bytes written (``start``) is published at ``where``; drop
        the oldest files past the window (waiting for a writeback still running)."""
        bound = self.max_bytes
        self._files.append((where, size, bound is not None))
        self._bytes += size
        if bound is None:  # an open auto window: remember, drop nothing
            if len(self._files) > _TRACK_MAX_FILES:
                self._bytes -= self._files.popleft()[1]
            return
        while self._bytes > bound and len(self._files) > 1:
            old, n, _started = self._files.popleft()
            self._bytes -= n
            self._with_file(old, _WAIT_BEFORE | _WRITE | _WAIT_AFTER, drop=True)
        for i in range(min(_LOOKAHEAD, len(self._files) - 1)):
            old, n, started = self._files[i]
            if not started:
                self._files[i] = (old, n, True)
                self._with_file(old, _WRITE, drop=False)

    def _with_file(self, where: Any, flags: int, drop: bool) -> None:
        """``sync_file_range(flags)`` on the file at ``where`` and, with ``drop`` and
        nothing failed, drop its pages; a file gone since is skipped."""
        try:
            fd = self._open(where)
        except OSError:
            return  # deleted meanwhile: its pages went with it
        try:
            if _sync_file_range(fd, 0, 0, flags) == 0 and drop:
                os.posix_fadvise(fd, 0, 0, _FADV_DONTNEED)
        except OSError:
            pass
        finally:
            close_quietly(fd)

    def clear(self) -> None:
        """Forget the files (their pages stay cached until the kernel needs them)."""
        self._files.clear()
        self._bytes = 0
