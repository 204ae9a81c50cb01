"""The ``fs`` tier's read path: a load (promotion) batch of files verified into arena rows.

Runs in: tier worker processes only; ``FsBackend.load`` (``backend.py``), called by the
job loop for a promotion job, hands the batch to its ``ChunkReader`` on the worker's
single thread. Blocks on the filesystem: per key an open, an fstat and a whole-file read,
and for a corrupt file a stat and an unlink.

Files are opened up to 16 at a time with ``posix_fadvise(WILLNEED)`` (the device reads
them in parallel while earlier ones are verified); each is then read whole (one
``preadv``) into a reusable page-aligned buffer and decoded into the row by the codec,
which checks everything (magic, version, lengths, key, checksum, MAC, and the file size
against the frame's stored length) before and after writing the row. A file larger than
any chunk of the layout could be (``chunk_file_cap``) is not read at all: a foreign
file, the key's MISS, removed and counted, whatever its size (its neighbours in the
batch are answered as if it were not there). With
``direct_io`` the files are read in whole pages with ``O_DIRECT`` instead, up to
``READ_DEPTH`` at once on I/O threads (``direct_reads.py``), and a raw frame is copied
into its row while it is checksummed (``ChunkDecoder.decode_copying``: no page-cache
copy, one pass over the chunk). With ``cache_first`` (``direct_io`` "adaptive") each file
the page cache holds whole (``cachestat(2)``, which starts no I/O: a ``RWF_NOWAIT`` read
would start the readahead it refuses to wait for) is read from it, buffered (memory speed,
no device wait), and only the others with ``O_DIRECT``: no readahead, and a read adds no
page cache, which is what costs CPU on a host whose new page cache is expensive. Where the
kernel has no ``cachestat`` (before Linux 6.5) the reads are buffered. A file that fails is
reported CORRUPT (the reason as its detail), unlinked (only if the path still names the
inode that was read: a concurrent re-store of the key is kept) and counted.

Every file is reached through the ``Namespace``: opened and unlinked relative to its leaf
directory's descriptor with ``O_NOFOLLOW``. A symbolic link at a chunk's name, or in
place of one of its fan-out directories, is never followed: the key is a MISS, counted
in ``links_refused`` (the link is left where it is).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections import deque
from typing import Sequence

from shmtier.shared.codec import ChunkDecoder, CorruptChunkError, frame_header_size
from shmtier.shared.jobs import MAX_KEY_FIGURE
from shmtier.storage.chunk_names import key_problem
from shmtier.tiers.backend import BatchResult, Outcome, as_arena, check_batch, row_problem
from shmtier.tiers.fs.fileio import (
    ALIGN,
    FADV_WILLNEED,
    O_DIRECT,
    PageBuffer,
    cached_whole,
    close_quietly,
    pread_full,
    pread_full_into,
)
from shmtier.tiers.fs.direct_reads import DirectReads
from shmtier.tiers.fs.namespace import LinkRefused, Namespace
from shmtier.tiers.fs.outcomes import FsCounters, errno_outcome

_PREFETCH = 16  # files of a load batch opened (and read ahead) at once
_IN_ROW = memoryview(b"")  # marker: a raw frame's payload was read straight into the row


def chunk_file_cap(key_len: int, chunk_bytes: int | None) -> int:
    """The largest file that may hold a chunk of ``chunk_bytes`` (None: not known) under
    a key of ``key_len`` bytes. A frame is at most its header (with a MAC tag) and the raw
    chunk (the codec stores raw what compression does not shrink); a file somewhat longer
    (up to ``chunk_bytes // 64 + 4096`` more) is a damaged chunk: CORRUPT "length" at
    load. A longer file is no chunk of the layout at all but a foreign file at a chunk's
    name: every op answers MISS for it, removes it and counts it
    (``foreign_files_detected`` / ``_removed``), and never reports its size. Never more
    than a result carries per key (``jobs.MAX_KEY_FIGURE``): without ``chunk_bytes``
    that is the bound."""
    if chunk_bytes is None:
        return MAX_KEY_FIGURE
    cap = frame_header_size(key_len, mac=True) + chunk_bytes + chunk_bytes // 64 + 4096
    return min(cap, MAX_KEY_FIGURE)


def remove_foreign(ns: Namespace, counters: FsCounters, entry: tuple[str, str],
                   st: os.stat_result) -> None:
    """A foreign file (``chunk_file_cap``) judged by ``st`` at ``entry`` (leaf directory,
    name): counted, and removed unless it was replaced meanwhile or the medium refuses
    (EROFS: left, counted as detected only)."""
    counters.foreign_files_detected += 1
    try:
        if ns.unlink_entry_if_same(*entry, st):
            counters.foreign_files_removed += 1
    except OSError:
        pass


class ChunkReader:
    """The read path of one ``FsBackend``: reads and verifies files of ``ns`` into rows,
    counting into ``counters`` (shared with the backend). Not thread-safe: it reuses its
    decoder and read buffer. ``direct_io``: every read with O_DIRECT; ``cache_first``
    (the filesystem takes O_DIRECT): a file from the page cache when it is all there,
    else with O_DIRECT (the module docstring)."""

    def __init__(self, ns: Namespace, counters: FsCounters, *, direct_io: bool,
                 cache_first: bool = False, mac_key: bytes | None = None):
        self.ns = ns
        self.counters = counters
        self.direct_io = direct_io
        self.cache_first = cache_first and not direct_io
        self._decoder = ChunkDecoder(mac_key=mac_key)  # with a key: MAC'd frames only
        self._buf = PageBuffer(doubling=True)  # reusable read buffer
        # O_DIRECT: reads in flight on I/O threads (started on first use)
        self._direct = DirectReads() if direct_io or self.cache_first else None
        self._codec_s = 0.0  # accumulator of the load in progress

    def release(self) -> None:
        """Drop the read buffers and stop the O_DIRECT I/O threads (a later buffered load
        allocates its buffer again; a later O_DIRECT load starts new ones)."""
        self._buf.release()
        if self._direct is not None:
            self._direct.close()
            self._direct = DirectReads()

    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int, *,
             blocked: OSError | None = None) -> BatchResult:
        """``FsBackend.load`` (its docstring is the contract). ``blocked``: why the
        namespace cannot be read now (``Namespace.sync``): every valid key is a MISS (no
        namespace, or a link at its path) or ERROR."""
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("load", n)
        seconds = res.seconds
        self._codec_s = 0.0
        for lo in range(0, n, _PREFETCH):
            opened: dict[int, tuple[int, os.stat_result, tuple[str, str]]] = {}
            try:
                for i in range(lo, min(n, lo + _PREFETCH)):
                    t = time.perf_counter()
                    got = self._open(keys[i], rows[i], a.shape[0], chunk_bytes, res, i,
                                     blocked)
                    if got is not None:
                        opened[i] = got
                    seconds[i] += time.perf_counter() - t
                if self.cache_first:
                    self._read_cached(opened, keys, rows, a, chunk_bytes, res)
                if self._direct is not None:
                    self._read_direct(opened, keys, rows, a, chunk_bytes, res)
                for i in sorted(opened):
                    t = time.perf_counter()
                    fd, st, entry = opened.pop(i)
                    self._read_one(fd, st, entry, bytes(keys[i]), a[rows[i], :chunk_bytes].data,
                                   res, i)
                    seconds[i] += time.perf_counter() - t
            finally:
                for fd, _st, _path in opened.values():
                    close_quietly(fd)
        res.codec_s = self._codec_s
        return res

    def _open(self, key, row, num_rows: int, chunk_bytes: int, res: BatchResult, i: int,
              blocked: OSError | None):
        """Open key's file and start its readahead: (fd, stat, (rel, name)), or None when
        key i's outcome is already decided (set in ``res``): a file larger than any chunk
        of ``chunk_bytes`` (``chunk_file_cap``) is a foreign file's MISS here, before any
        readahead of it."""
        bad = key_problem(key)
        if bad is None:
            bad = row_problem(row, num_rows)
        if bad is not None:
            res.set(i, Outcome.INVALID, bad)
            return None
        c = self.counters
        if blocked is not None:
            if isinstance(blocked, (FileNotFoundError, NotADirectoryError, LinkRefused)):
                c.load_missing += 1
                res.set(i, Outcome.MISS)
            else:
                c.load_errors += 1
                res.set(i, *errno_outcome(blocked, "namespace"))
            return None
        entry = self.ns.locate(bytes(key))
        try:
            # O_NONBLOCK: a FIFO planted at the path must not hang the worker.
            fd, _ = self.ns.open_entry(*entry, os.O_RDONLY | os.O_NONBLOCK)
        except LinkRefused:  # never followed: not a chunk of ours
            c.links_refused += 1
            res.set(i, Outcome.MISS)
            return None
        except (FileNotFoundError, NotADirectoryError):
            c.load_missing += 1
            res.set(i, Outcome.MISS)
            return None
        except OSError as e:
            c.load_errors += 1
            res.set(i, *errno_outcome(e, "open"))
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            if st.st_size > chunk_file_cap(len(key), chunk_bytes):
                close_quietly(fd)
                remove_foreign(self.ns, c, entry, st)
                res.set(i, Outcome.MISS)
                return None
            if self.direct_io:
                # set after the checks: O_DIRECT at open would turn EISDIR into EINVAL
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
            elif FADV_WILLNEED is not None and st.st_size and not self.cache_first:
                # Asynchronous readahead: the batch's files are read from the device in
                # parallel while earlier ones are being verified.
                os.posix_fadvise(fd, 0, st.st_size, FADV_WILLNEED)
        except OSError as e:
            close_quietly(fd)
            c.load_errors += 1
            res.set(i, *errno_outcome(e, "open"))
            return None
        return fd, st, entry

    def _read_direct(self, opened: dict, keys, rows, a, chunk_bytes: int,
                     res: BatchResult) -> None:
        """O_DIRECT: read the ``opened`` files (``{i: (fd, stat, entry)}``, emptied here)
        on the I/O threads, up to their depth at once, and verify each into its row in
        key order as its read finishes."""
        direct, seconds, c = self._direct, res.seconds, self.counters
        mac = self._decoder.mac
        order = deque(sorted(opened))
        inflight: deque = deque()

        def submit_next() -> bool:
            if not order:
                return False
            i = order.popleft()
            t = time.perf_counter()
            fd, st, entry = opened.pop(i)
            key = bytes(keys[i])
            read = direct.submit(fd, st.st_size, chunk_file_cap(len(key), chunk_bytes))
            inflight.append((i, st, entry, key, read))
            seconds[i] += time.perf_counter() - t
            return True

        try:
            while len(inflight) < direct.depth and submit_next():
                pass
            while inflight:
                i, st, entry, key, read = inflight.popleft()
                t = time.perf_counter()
                try:
                    frame = read.result()
                except OSError as e:
                    res.set(i, *errno_outcome(e, "read"))
                    c.load_errors += 1
                    read.release()
                else:
                    short = frame is None or st.st_size < frame_header_size(len(key), mac=mac)
                    self._verdict(frame, "length" if short else None, st, entry, key,
                                  a[rows[i], :chunk_bytes].data, res, i, copying=True)
                    read.release()
                seconds[i] += time.perf_counter() - t
                submit_next()
        finally:
            for _i, _st, _entry, _key, read in inflight:
                read.release()

    def _read_cached(self, opened: dict, keys, rows, a, chunk_bytes: int,
                     res: BatchResult) -> None:
        """Cache first: each of the ``opened`` files (``{i: (fd, stat, entry)}``) that the
        page cache holds whole is read from it, verified into its row and taken out of
        ``opened``; the others stay there, switched to O_DIRECT for ``_read_direct``
        (or, where the kernel has no ``cachestat``, left as they are: buffered, and
        ``cache_first`` ends)."""
        seconds = res.seconds
        for i in sorted(opened):
            t = time.perf_counter()
            fd, st, entry = opened[i]
            try:
                whole = cached_whole(fd, st.st_size)
            except OSError:
                whole = False  # read it with O_DIRECT, which reports what is wrong
            if whole is None:
                self._no_cachestat()
                return
            if whole:
                del opened[i]
                self._read_one(fd, st, entry, bytes(keys[i]), a[rows[i], :chunk_bytes].data,
                               res, i)
            else:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
                except OSError as e:
                    del opened[i]
                    close_quietly(fd)
                    self.counters.load_errors += 1
                    res.set(i, *errno_outcome(e, "open"))
            seconds[i] += time.perf_counter() - t

    def _read_one(self, fd: int, st: os.stat_result, entry: tuple[str, str], key: bytes,
                  out: memoryview, res: BatchResult, i: int) -> None:
        """Read one opened file whole (buffered), verify and decode it into ``out``;
        closes ``fd``."""
        c = self.counters
        size = st.st_size
        chunk_bytes = out.nbytes
        hs = frame_header_size(len(key), mac=self._decoder.mac)
        cap = chunk_file_cap(len(key), chunk_bytes)  # ``_open`` judged larger files
        reason = frame = None
        try:
            if size < hs:
                reason = "length"
            elif size == hs + chunk_bytes:
                # a raw frame's size: header into the buffer, payload straight into the row
                # (one preadv, no copy); verified there (ChunkDecoder.decode_raw_in_place)
                head = self._buf.view(0, hs, hs + ALIGN).data
                if pread_full_into(fd, head, out, size) != size:
                    reason = "length"  # shrank under us: torn
                else:
                    frame = _IN_ROW
            else:
                # placed so that the payload (after the hs-byte header) is page aligned
                pad = (-hs) % ALIGN
                frame = self._buf.view(pad, size, pad + cap + ALIGN).data
                if pread_full(fd, frame, size) != size:
                    reason = "length"  # shrank under us: torn
        except OSError as e:
            res.set(i, *errno_outcome(e, "read"))
            c.load_errors += 1
            return
        finally:
            os.close(fd)
        if reason is None and frame is _IN_ROW:
            try:
                dst = self._decoder.decode_raw_in_place(head, key, out, size)
                if dst is None:  # not a raw frame after all: read it whole and decode
                    frame = self._reread(entry, st, hs, size, cap)
                    if frame is None:
                        reason = "length"
                else:
                    self._codec_s += dst.seconds
            except CorruptChunkError as e:
                reason = getattr(e, "reason", None) or "codec"
            except OSError as e:
                res.set(i, *errno_outcome(e, "read"))
                c.load_errors += 1
                return
        self._verdict(frame, reason, st, entry, key, out, res, i)

    def _no_cachestat(self) -> None:
        """The kernel has no ``cachestat``: no cache-first reads from now on, all
        buffered (as ``direct_io`` false)."""
        self.cache_first = False
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    def _verdict(self, frame, reason: str | None, st: os.stat_result, entry: tuple[str, str],
                 key: bytes, out: memoryview, res: BatchResult, i: int, *,
                 copying: bool = False) -> None:
        """Key ``i``'s outcome from its file read as ``frame`` (``_IN_ROW``: a raw frame
        already verified in ``out``) or failed for ``reason``: the frame decoded into
        ``out`` (``copying``: ``ChunkDecoder.decode_copying``) and OK, or the file CORRUPT
        and removed."""
        if reason is None and frame is not _IN_ROW:
            decode = self._decoder.decode_copying if copying else self._decoder.decode_into
            try:
                dst = decode(frame, key, out)
                self._codec_s += dst.seconds
            except CorruptChunkError as e:
                reason = getattr(e, "reason", None) or "codec"
        size = st.st_size
        if reason is not None:
            self._remove_corrupt(entry, st, reason)
            res.set(i, Outcome.CORRUPT, reason)
            res.stored_bytes[i] = size
            return
        c = self.counters
        res.set(i, Outcome.OK)
        res.logical_bytes[i] = out.nbytes
        res.stored_bytes[i] = size
        c.files_read += 1
        c.bytes_read += size

    def _reread(self, entry: tuple[str, str], st: os.stat_result, hs: int, size: int,
                cap: int) -> memoryview | None:
        """The whole frame of ``entry`` read again into the read buffer (a frame of raw
        size whose header names another codec), or None if the file changed meanwhile."""
        fd, _ = self.ns.open_entry(*entry, os.O_RDONLY | os.O_NONBLOCK)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, now.st_size) != (st.st_dev, st.st_ino, size):
                return None
            pad = (-hs) % ALIGN
            frame = self._buf.view(pad, size, pad + cap + ALIGN).data
            return frame if pread_full(fd, frame, size) == size else None
        finally:
            os.close(fd)

    def _remove_corrupt(self, entry: tuple[str, str], st: os.stat_result, reason: str) -> None:
        c = self.counters
        c.corrupt_files_detected += 1
        c.corrupt_by_reason[reason] = c.corrupt_by_reason.get(reason, 0) + 1
        try:
            # kept when re-stored meanwhile by another writer (not the file we judged)
            # or removed by someone else already
            if not self.ns.unlink_entry_if_same(*entry, st):
                return
        except OSError:
            c.corrupt_remove_failed += 1
            return
        c.corrupt_files_removed += 1
        c.bytes_on_disk = max(0, c.bytes_on_disk - st.st_size)
