"""Low-level file helpers of the ``fs`` tier: whole writes and reads, O_DIRECT, space.

Runs in: tier worker processes, called on the worker's thread by ``FsBackend``
(``backend.py``), its write and read paths (``store.py``, ``load.py``) and ``Namespace``
(``namespace.py``), and on the I/O threads of ``direct_writes.py`` (``publish_temp``,
``write_pages``, the ``*_quietly`` helpers: each on descriptors it was handed);
``bench/fs_tier.py`` calls ``probe_direct_io``. Every function that
takes a descriptor or a path blocks on the filesystem (microseconds on a local disk,
seconds on a slow network filesystem). Errors are raised as OSError, except that a
short read is returned (a count or None), ``probe_direct_io`` answers False, the
statvfs helpers fall back (1 TiB, None), ``cached_whole`` answers None where the kernel
has no ``cachestat`` and the ``*_quietly`` helpers swallow them. Knows nothing of chunks,
keys or the namespace layout; imports only numpy (and ctypes, for ``cachestat``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Callable

import numpy as np

#: Page size assumed for O_DIRECT offsets, lengths and buffer addresses.
ALIGN = 4096
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else ALIGN


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_NR = ctypes.c_long(451)  # cachestat: the same number on every architecture (after 423)
_NO_FLAGS = ctypes.c_uint(0)
try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):
    _syscall = None


def cached_whole(fd: int, size: int) -> bool | None:
    """Whether the page cache holds every page of the first ``size`` bytes of the file
    open as ``fd``, by ``cachestat(2)`` (Linux 6.5+: one system call, no I/O started, ~1
    µs); None where the kernel (or the platform) has no ``cachestat``. A racing
    eviction may make a True stale: the caller's read then goes to the device."""
    if _syscall is None:
        return None
    if size <= 0:
        return True
    rng, st = _CachestatRange(0, size), _Cachestat()
    # syscall(2) is variadic: each argument passed at its C type (long number, unsigned
    # fd and flags), not as ctypes' default int
    if _syscall(_NR, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), _NO_FLAGS) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            return None  # no cachestat here (EPERM: a seccomp filter refusing it)
        raise OSError(err, os.strerror(err))
    return st.nr_cache >= -(-size // _PAGE)


class PageBuffer:
    """A reusable byte buffer handing out views that start at a chosen offset past a page
    boundary. Grows on demand (to at least twice its size with ``doubling``), never
    shrinks; ``release`` drops it."""

    def __init__(self, *, doubling: bool):
        self._doubling = doubling
        self._a: np.ndarray | None = None

    def view(self, offset: int, size: int, need: int) -> np.ndarray:
        """``size`` bytes starting ``offset`` bytes past a page boundary, from a buffer of
        at least ``need`` bytes (``need`` must cover a page of slack + ``offset + size``)."""
        a = self._a
        if a is None or a.nbytes < need:
            if self._doubling and a is not None:
                need = max(need, 2 * a.nbytes)
            self._a = a = np.empty(need, dtype=np.uint8)
        base = (-a.ctypes.data) % ALIGN + offset
        return a[base:base + size]

    def release(self) -> None:
        self._a = None


#: Most bytes one write system call is given. A kernel built without preemption (this
#: VM's runs PREEMPT_NONE) finishes a system call before its core goes to a task that woke,
#: such as the engine thread at the end of its forward pass. A buffered write of a whole
#: 1.4 MiB chunk into new page cache holds the core for ~0.35 ms when pages are cheap and
#: for several ms when the host must back them; in pieces the writer returns to user space
#: between them, where it can be preempted (bench/README.md, "The engine thread's wake-up
#: behind the tier workers' writes").
WRITE_PIECE_BYTES = 256 * 1024


def writev_all(fd: int, parts, total: int) -> None:
    """Write all of ``parts`` (``total`` bytes) in order, at most ``WRITE_PIECE_BYTES`` per
    ``writev``, continuing after a short write (the kernel takes a whole piece for a regular
    file unless out of space or interrupted). Raises ``OSError`` as ``os.writev`` does."""
    if total <= WRITE_PIECE_BYTES:
        _writev_fully(fd, parts, total)
        return
    for piece, size in _pieces(parts, WRITE_PIECE_BYTES):
        _writev_fully(fd, piece, size)


def _pieces(parts, limit: int):
    """``parts`` cut into consecutive lists of views of at most ``limit`` bytes each,
    with each list's byte count."""
    piece, size = [], 0
    for part in parts:
        view = memoryview(part).cast("B")
        offset = 0
        while offset < len(view):
            n = min(len(view) - offset, limit - size)
            piece.append(view[offset:offset + n])
            size += n
            offset += n
            if size == limit:
                yield piece, size
                piece, size = [], 0
    if piece:
        yield piece, size


def _writev_fully(fd: int, parts, total: int) -> None:
    """One ``writev`` of ``parts``, then more after a short write until all is written."""
    done = os.writev(fd, parts)
    if done == total:
        return
    views = [memoryview(p).cast("B") for p in parts]
    while True:
        rest, skip = [], done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        if not rest:
            return
        views = rest
        done = os.writev(fd, views)
        if done <= 0:
            raise OSError(errno.EIO, "short write")


def pread_full(fd: int, view: memoryview, size: int) -> int:
    """Read the first ``size`` bytes of the file into ``view``; the bytes read (fewer
    only if the file ends early)."""
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:size]], got)
        if n == 0:
            break
        got += n
    return got


def pread_full_into(fd: int, head: memoryview, body: memoryview, size: int) -> int:
    """Read the first ``size`` bytes of the file into ``head`` then ``body`` (one
    ``preadv`` when the kernel gives it all, as it does for a regular file); the bytes
    read (fewer only if the file ends early, or if ``size`` exceeds both)."""
    got = 0
    hn = head.nbytes
    size = min(size, hn + body.nbytes)
    while got < size:
        if got < hn:
            bufs = [head[got:], body[:size - hn]]
        else:
            bufs = [body[got - hn:size - hn]]
        n = os.preadv(fd, bufs, got)
        if n == 0:
            break
        got += n
    return got


def write_pages(fd: int, out: np.ndarray, size: int) -> None:
    """O_DIRECT write of ``out`` (page-aligned, whole pages, holding a ``size``-byte
    frame zero-padded) from offset 0, then the file cut back to ``size`` (DMA from the
    buffer, no page-cache copy; bench/README.md, fs_tier.py, has the measurements)."""
    view, done = out.data, 0
    while done < len(out):
        k = os.pwrite(fd, view[done:], done)
        if k <= 0:
            raise OSError(errno.EIO, "short write")
        done += k
    if len(out) != size:
        os.ftruncate(fd, size)


def publish_temp(fd: int, leaf_fd: int, tmp: str, final: str, write: Callable[[int], None],
                 fsync: bool) -> tuple[OSError, str] | None:
    """Fill the new temp file ``tmp`` (open as ``fd``) with ``write(fd)``, fsync it if
    ``fsync``, close it and rename it over ``final`` in the directory open as ``leaf_fd``
    (replacing any file or link there, never following one): None, or the error and the
    step that failed ("write", "fsync", "close", "rename") with the temp file removed.
    ``fd`` is closed either way."""
    step = "write"
    try:
        write(fd)
        if fsync:
            step = "fsync"
            os.fsync(fd)
    except OSError as e:
        close_quietly(fd)
        unlink_quietly(tmp, dir_fd=leaf_fd)
        return e, step
    try:
        step = "close"
        os.close(fd)  # may report a deferred write error (NFS)
        step = "rename"
        os.rename(tmp, final, src_dir_fd=leaf_fd, dst_dir_fd=leaf_fd)
    except OSError as e:
        unlink_quietly(tmp, dir_fd=leaf_fd)
        return e, step
    return None


def read_direct(fd: int, size: int, cap: int, buf: PageBuffer) -> memoryview | None:
    """O_DIRECT read of a ``size``-byte file (at most ``cap``) in whole pages into ``buf``:
    its bytes, or None if the file ended early."""
    padded = -(-size // ALIGN) * ALIGN
    view = buf.view(0, padded, -(-cap // ALIGN) * ALIGN + 2 * ALIGN).data
    got = 0
    while got < size:
        k = os.preadv(fd, [view[got:]], got)
        if k <= 0:
            return None
        got += k
    return view[:size]


def probe_direct_io(directory: str, *, dir_fd: int | None = None,
                    name: str | None = None) -> bool:
    """Whether ``directory`` (or the directory open as ``dir_fd``) takes O_DIRECT: one
    aligned page written to a new probe file there (as vLLM's fs tier probes), which is
    then removed. Some network and FUSE filesystems, and tmpfs before Linux 6.6, do not.
    ``name``: the probe file's (default ``.direct-probe.<pid>.tmp``); the fs tier passes
    one of its namespace's temp names, so that the file of a process killed mid-probe is
    a dead writer's temp file to the tier's scan and to ``shmtier fsck``."""
    if not O_DIRECT:
        return False
    if name is None:
        name = f".direct-probe.{os.getpid()}.tmp"  # a temp file's suffix
    path = name if dir_fd is not None else os.path.join(directory, name)
    page = np.zeros(2 * ALIGN, dtype=np.uint8)
    base = (-page.ctypes.data) % ALIGN
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_DIRECT | O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
        except FileExistsError:  # a probe of a killed process with this pid
            unlink_quietly(path, dir_fd=dir_fd)
            fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return os.pwrite(fd, page[base:base + ALIGN].data, 0) == ALIGN
    except OSError:
        return False
    finally:
        close_quietly(fd)
        unlink_quietly(path, dir_fd=dir_fd)


def st_capacity(path: str) -> int:
    """Total size of the filesystem holding ``path`` (1 TiB if it cannot be asked)."""
    try:
        v = os.statvfs(path)
    except OSError:
        return 1 << 40
    return v.f_blocks * v.f_frsize


def available_bytes(path: str | int) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (a path
    or an open descriptor), or None."""
    try:
        v = os.statvfs(path)
    except OSError:
        return None
    return v.f_bavail * v.f_frsize


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def unlink_quietly(path: str, *, dir_fd: int | None = None) -> bool:
    """Unlink ``path`` (relative to ``dir_fd`` if given; a link itself, never its
    target); whether it was removed."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def is_hex(s: str) -> bool:
    """Whether ``s`` is lower-case hex digits."""
    try:
        int(s, 16)
    except ValueError:
        return False
    return s == s.lower()
