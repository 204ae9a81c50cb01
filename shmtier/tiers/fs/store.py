"""The ``fs`` tier's write path: a store (cascade) batch of arena rows published as files.

Runs in: tier worker processes only; ``FsBackend.store`` (``backend.py``), called by the
job loop for a cascade job, hands the batch to its ``ChunkWriter`` on the worker's single
thread. Blocks on the filesystem: a stat, the file's create, write(s), optional fsync and
rename per key, a ``statvfs`` per batch and, with ``fsync``, one directory fsync per leaf
directory written. Every file is reached through the ``Namespace``: created, renamed and
unlinked relative to its leaf directory's descriptor, never through a symbolic link (a
link at a chunk's name is replaced by the rename, as any old file is; a link in place of
a fan-out directory fails the key: ERROR, ``ELOOP``, counted in ``links_refused``).

A file's content is exactly the frame of ``shmtier.shared.codec`` (magic, version,
codec, element size, raw length, stored length, the full key, a checksum of the raw
bytes, then the payload). A chunk is published by writing a temp file in its final
directory (``Namespace.temp_name``) and renaming it over the final name, so a reader
sees either no file or a complete one; with ``fsync=True`` the file is fsynced before
the rename and its directory after it (before the key is reported stored).

I/O: buffered (``writev``) by default; with ``direct_io`` the frame is gathered into a
page-aligned buffer, written in whole pages with ``O_DIRECT`` and the file cut back to
the frame's size (``fileio.write_direct``).
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Sequence

from shmtier.shared.codec import ChunkEncoder, CompressionConfig
from shmtier.shared.codec_choice import CodecChooser
from shmtier.tiers.backend import BatchResult, Outcome, as_arena, check_batch, row_problem
from shmtier.tiers.fs.fileio import (
    O_DIRECT,
    PageBuffer,
    available_bytes,
    close_quietly,
    unlink_quietly,
    write_direct,
    writev_all,
)
from shmtier.tiers.chunk_names import key_problem
from shmtier.tiers.fs.namespace import LinkRefused, Namespace
from shmtier.tiers.fs.outcomes import NO_SPACE, FsCounters, errno_outcome

_FS_WIDE = (errno.EROFS,) + NO_SPACE  # after one of these, the rest of a store batch fails too


@dataclass(eq=False)
class ChunkWriter:
    """The write path of one ``FsBackend``: encodes rows and publishes them in ``ns``,
    counting into ``counters`` (shared with the backend). Not thread-safe: it reuses
    its encoders and O_DIRECT buffer."""

    ns: Namespace
    counters: FsCounters
    codec_config: CompressionConfig
    element_size: int
    max_bytes: int | None
    min_free_bytes: int | None
    fsync: bool
    direct_io: bool
    mac_key: bytes | None = field(default=None, repr=False)  # frames carry a MAC tag

    def __post_init__(self) -> None:
        self._encoder = ChunkEncoder(self.codec_config, mac_key=self.mac_key)
        self._raw_encoder = ChunkEncoder(CompressionConfig(mode="none"), mac_key=self.mac_key)
        self._wbuf = PageBuffer(doubling=False)  # reusable O_DIRECT write buffer
        # mode "auto": compress or not by measured cost (shared/codec_choice.py)
        self.chooser = (CodecChooser(f"fs {self.ns.root_dir}", self.codec_config.min_gain)
                        if self.codec_config.mode == "auto" else None)

    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int, *,
              skip_existing: bool, bytes_in_use: int | None, hurry: bool,
              blocked: OSError | None = None) -> BatchResult:
        """``FsBackend.store`` (its docstring is the contract). ``blocked``: why the
        namespace cannot be written now (``Namespace.sync``): every valid key fails so."""
        chooser = self.chooser
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("store", n)
        seconds = res.seconds
        c = self.counters
        used = c.bytes_on_disk if bytes_in_use is None else int(bytes_in_use)
        codec_s = 0.0
        free = None
        fail_rest: tuple[Outcome, str] | None = None
        if blocked is not None:
            fail_rest = errno_outcome(blocked, "namespace")
        elif self.min_free_bytes is not None:
            t = time.perf_counter()
            free = available_bytes(self.ns.fd)
            if n:
                seconds[0] += time.perf_counter() - t
        synced_dirs: dict[str, list[int]] = {}
        num_rows = a.shape[0]
        for i in range(n):
            t = time.perf_counter()
            try:
                key = keys[i]
                bad = key_problem(key)
                row = rows[i]
                if bad is None:
                    bad = row_problem(row, num_rows)
                if bad is not None:
                    res.set(i, Outcome.INVALID, bad)
                    continue
                if fail_rest is not None:
                    res.set(i, *fail_rest)
                    self._count_store_failure(fail_rest[0])
                    continue
                key = bytes(key)
                rel, final = self.ns.locate(key)
                try:
                    st = self.ns.stat_entry(rel, final)
                except OSError:
                    old_size = 0  # absent (or unreachable: the write below reports why)
                else:
                    old_size = st.st_size
                    if stat.S_ISLNK(st.st_mode):  # not a chunk: the rename replaces the link
                        c.links_refused += 1
                        old_size = 0
                    elif skip_existing:
                        res.set(i, Outcome.EXISTS)
                        res.stored_bytes[i] = old_size
                        c.store_exists += 1
                        continue
                compress = chooser is None or chooser.compress_next(hurry)
                encoder = self._encoder if compress else self._raw_encoder
                if chooser is not None:
                    since = chooser.clock()
                parts, est = encoder.encode(a[row, :chunk_bytes].data, key, self.element_size)
                if not compress:
                    if hurry:
                        c.stores_raw_hurried += 1
                    else:
                        c.stores_raw_by_cost += 1
                if chooser is not None:
                    chooser.note_encode(compress, est.raw_bytes, est.stored_bytes, since)
                    since = chooser.clock()
                codec_s += est.seconds
                size = est.stored_bytes
                if self.max_bytes is not None and used - old_size + size > self.max_bytes:
                    res.set(i, Outcome.REJECTED, "max_bytes")
                    c.store_full += 1
                    continue
                if free is not None and free + old_size - size < self.min_free_bytes:
                    res.set(i, Outcome.REJECTED, "min_free")
                    c.store_full += 1
                    continue
                problem = self._publish(rel, final, key.hex(), parts, size)
                if problem is not None:
                    code, failure = problem
                    res.set(i, *failure)
                    self._count_store_failure(failure[0])
                    if code in _FS_WIDE:
                        fail_rest = failure
                    continue
                if chooser is not None:
                    chooser.note_write(size, since)
                res.set(i, Outcome.OK)
                res.logical_bytes[i] = est.raw_bytes
                res.stored_bytes[i] = size
                used += size - old_size
                if free is not None:
                    free -= size - old_size
                c.bytes_on_disk = max(0, c.bytes_on_disk + size - old_size)
                c.files_written += 1
                c.bytes_written += size
                if self.fsync:
                    synced_dirs.setdefault(rel, []).append(i)
            finally:
                seconds[i] += time.perf_counter() - t
        for rel, idx in synced_dirs.items():
            t = time.perf_counter()
            try:
                self.ns.fsync_leaf(rel)
            except OSError as e:  # published but not durable: do not claim it
                failure = errno_outcome(e, "fsync dir")
                for i in idx:
                    res.set(i, *failure)
                    res.logical_bytes[i] = 0
                c.store_errors += len(idx)
            share = (time.perf_counter() - t) / len(idx)
            for i in idx:
                seconds[i] += share
        res.codec_seconds = codec_s
        return res

    def _count_store_failure(self, outcome: Outcome) -> None:
        if outcome is Outcome.REJECTED:
            self.counters.store_full += 1
        else:
            self.counters.store_errors += 1

    def _publish(self, rel: str, final: str, key_hex: str, parts,
                 size: int) -> tuple[int, tuple[Outcome, str]] | None:
        """Temp file + rename in leaf directory ``rel`` (made if absent); None on
        success, else (errno, (outcome, detail)). Leaves no temp file."""
        tmp = self.ns.temp_name(key_hex)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct_io:
            flags |= O_DIRECT
        try:
            # a cached leaf removed behind our back is made again (Namespace.in_leaf)
            fd, leaf = self.ns.open_entry(rel, tmp, flags, create_dirs=True)
        except OSError as e:
            if isinstance(e, LinkRefused):
                self.counters.links_refused += 1
            return e.errno or 0, errno_outcome(e, "create")
        step = "write"
        try:
            if self.direct_io:
                write_direct(fd, parts, size, self._wbuf)
            else:
                writev_all(fd, parts, size)
            if self.fsync:
                step = "fsync"
                os.fsync(fd)
        except OSError as e:
            close_quietly(fd)
            unlink_quietly(tmp, dir_fd=leaf)
            return e.errno or 0, errno_outcome(e, step)
        try:
            step = "close"
            os.close(fd)  # may report a deferred write error (NFS)
            step = "rename"
            os.rename(tmp, final, src_dir_fd=leaf, dst_dir_fd=leaf)  # replaces, never follows
        except OSError as e:
            unlink_quietly(tmp, dir_fd=leaf)
            return e.errno or 0, errno_outcome(e, step)
        return None
