"""The ``fs`` tier's write path: a store (cascade) batch of arena rows published as files.

Runs in: tier worker processes only; ``FsBackend.store`` (``backend.py``), called by the
job loop for a cascade job, hands the batch to its ``ChunkWriter`` on the worker's single
thread. Blocks on the filesystem: a stat, the file's create, write(s), optional fsync and
rename per key, a ``statvfs`` per batch and, with ``fsync``, one directory fsync per leaf
directory written. Every file is reached through the ``Namespace``: created, renamed and
unlinked relative to its leaf directory's descriptor, never through a symbolic link (a
link at a chunk's name is replaced by the rename, as any old file is; a link in place of
a fan-out directory fails the key: ERROR, ``ELOOP``, counted in ``links_refused``). A
file at a chunk's name larger than any chunk could be (``load.chunk_file_cap``) is no
chunk: removed and counted before the key is written (never EXISTS, its size never
credited to the capacity checks).

A file's content is exactly the frame of ``shmtier.shared.codec`` (magic, version,
codec, element size, raw length, stored length, the full key, a checksum of the raw
bytes, then the payload). A chunk is published by writing a temp file in its final
directory (``Namespace.temp_name``) and renaming it over the final name, so a reader
sees either no file or a complete one; with ``fsync=True`` the file is fsynced before
the rename and its directory after it (before the key is reported stored).

I/O: with ``direct_io`` (the fs tier's ``direct_io`` true, "auto" or "writes", where the
filesystem takes O_DIRECT) the temp file is created here and handed to ``DirectWrites``
(``direct_writes.py``): the frame goes into a page-aligned buffer (a raw frame encoded
straight into it, its payload copied and checksummed in one pass:
``ChunkEncoder.encode_raw_into``; a compressed frame's parts gathered), written in whole
pages with ``O_DIRECT`` on an I/O thread and the file cut back to the frame's size, up
to ``write_depth`` files in flight, while this thread encodes the next chunks; the
batch returns once every write it started is published or failed. Else buffered, one
``writev`` per file, on this thread; with ``page_cache_bytes`` each file's writeback is
started after its write and the worker's files past that many bytes are dropped from the
page cache (``writeback.py``; ``"auto"``: the writes are timed until new page cache
proves expensive, then the footprint stops growing). With ``direct_when_expensive``
(``direct_io`` "adaptive", where the filesystem takes O_DIRECT) an ``"auto"`` window that
finds new page cache expensive does not close: from then on this worker's stores are
O_DIRECT, as above (logged once; the ``DIRECT_STORES`` result flag).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Sequence

from shmtier.shared.codec import ChunkEncoder, CompressionConfig, frame_header_size
from shmtier.shared.codec_choice import CodecChooser
from shmtier.storage.chunk_names import key_problem
from shmtier.tiers.backend import BatchResult, Outcome, as_arena, check_batch, row_problem
from shmtier.tiers.fs import writeback
from shmtier.tiers.fs.config import FsTierConfig
from shmtier.tiers.fs.direct_writes import DirectWrite, DirectWrites
from shmtier.tiers.fs.fileio import (
    O_DIRECT,
    available_bytes,
    close_quietly,
    publish_temp,
    unlink_quietly,
    writev_all,
)
from shmtier.tiers.fs.load import chunk_file_cap, remove_foreign
from shmtier.tiers.fs.namespace import LinkRefused, Namespace
from shmtier.tiers.fs.outcomes import NO_SPACE, FsCounters, errno_outcome

logger = logging.getLogger(__name__)

_FS_WIDE = (errno.EROFS,) + NO_SPACE  # after one of these, the rest of a store batch fails too


def _filesystem_wide_failure(in_flight: list) -> tuple[Outcome, str] | None:
    """The failure of a finished O_DIRECT write of the batch that fails the rest too
    (``_FS_WIDE``), if any."""
    for _i, write, *_ in in_flight:
        if write.done():
            problem = write.outcome()
            if problem is not None and problem[0] in _FS_WIDE:
                return problem[1]
    return None


@dataclass(eq=False)
class ChunkWriter:
    """The write path of one ``FsBackend``: encodes rows and publishes them in ``ns``,
    counting into ``counters`` (shared with the backend). Not thread-safe: it reuses
    its encoders; with ``direct_io`` it keeps up to ``write_depth`` writes in flight on
    its own I/O threads (``close()`` stops them). ``direct_when_expensive``: buffered
    stores turn O_DIRECT once new page cache proves expensive (the module docstring)."""

    ns: Namespace
    counters: FsCounters
    codec_config: CompressionConfig
    element_size: int
    max_bytes: int | None
    min_free_bytes: int | None
    fsync: bool
    direct_io: bool
    mac_key: bytes | None = field(default=None, repr=False)  # frames carry a MAC tag
    write_depth: int = FsTierConfig.default("write_depth")
    page_cache_bytes: int | str | None = None  # buffered: recent files left in the page cache
    direct_when_expensive: bool = False

    def __post_init__(self) -> None:
        self._encoder = ChunkEncoder(self.codec_config, mac_key=self.mac_key)
        self._raw_encoder = ChunkEncoder(CompressionConfig(mode="none"), mac_key=self.mac_key)
        self._raw_mode = self.codec_config.mode == "none"  # every frame raw
        self._direct = (DirectWrites(self.write_depth, fsync=self.fsync)
                        if self.direct_io else None)
        # buffered stores with page_cache_bytes: a bounded page-cache footprint
        self._window = (writeback.WritebackWindow(
                            self.page_cache_bytes, self._open_published, f"fs {self.ns.root_dir}",
                            self._go_direct if self.direct_when_expensive else None)
                        if self.page_cache_bytes is not None and not self.direct_io
                        and writeback.supported() else None)
        # mode "auto": compress or not by measured cost (shared/codec_choice.py)
        self.chooser = (CodecChooser(f"fs {self.ns.root_dir}", self.codec_config.min_gain)
                        if self.codec_config.mode == "auto" else None)

    @property
    def page_cache_bounded(self) -> bool:
        """Whether this writer's buffered stores keep a bounded page cache now (a fixed
        ``page_cache_bytes``, or an ``"auto"`` one that found its bound)."""
        return self._window is not None and self._window.max_bytes is not None

    @property
    def stores_direct(self) -> bool:
        """Whether this writer's stores use O_DIRECT now."""
        return self._direct is not None

    def _go_direct(self, s_per_gib: float, written: int) -> None:
        """The window's measure found new page cache expensive: every store from now on
        is O_DIRECT (the window is dropped; what it holds stays for the kernel to
        reclaim)."""
        self._direct = DirectWrites(self.write_depth, fsync=self.fsync)
        self._window = None
        logger.info("tier fs %s: buffered writes cost %.1f s of CPU per GiB (new page cache "
                    "is expensive on this host) after %d MiB written: this worker's stores "
                    "now use O_DIRECT (direct_io \"adaptive\")", self.ns.root_dir, s_per_gib,
                    written >> 20)

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
        # O_DIRECT writes started: (index, write, raw bytes, stored bytes, old size, leaf)
        in_flight: list[tuple[int, DirectWrite, int, int, int, str]] = []
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
                if fail_rest is None and in_flight:
                    fail_rest = _filesystem_wide_failure(in_flight)
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
                    elif old_size > chunk_file_cap(len(key), chunk_bytes):
                        remove_foreign(self.ns, c, (rel, final), st)  # not a chunk either
                        old_size = 0
                    elif skip_existing:
                        res.set(i, Outcome.EXISTS)
                        res.stored_bytes[i] = old_size
                        c.store_exists += 1
                        continue
                compress = chooser is None or chooser.compress_next(hurry)
                encoder = self._encoder if compress else self._raw_encoder
                if not compress:
                    if hurry:
                        c.stores_raw_hurried += 1
                    else:
                        c.stores_raw_by_cost += 1
                src = a[row, :chunk_bytes].data
                # an O_DIRECT raw frame is encoded into its write's buffer (_start_direct)
                direct_raw = self._direct is not None and (not compress or self._raw_mode)
                if direct_raw:
                    parts = None
                    size = frame_header_size(len(key), mac=encoder.mac) + chunk_bytes
                else:
                    if chooser is not None:
                        since = chooser.clock()
                    parts, est = encoder.encode(src, key, self.element_size)
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
                if self._direct is not None:
                    if direct_raw:
                        if chooser is not None:
                            since = chooser.clock()
                        got = []  # the encode's stats, once the write's buffer is filled

                        def fill(out, src=src, key=key, encoder=encoder, got=got):
                            got.append(encoder.encode_raw_into(src, key, self.element_size, out))
                    else:
                        fill = parts
                    problem = self._start_direct(rel, final, key.hex(), fill, size)
                    if direct_raw and got:
                        codec_s += got[0].seconds
                        if chooser is not None:
                            chooser.note_encode(compress, chunk_bytes, size, since)
                    if isinstance(problem, DirectWrite):
                        in_flight.append((i, problem, chunk_bytes, size, old_size, rel))
                        used += size - old_size  # held for the later keys' checks
                        if free is not None:
                            free -= size - old_size
                        continue
                else:
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
                self._count_stored(res, i, est.raw_bytes, size, old_size, rel, synced_dirs)
                used += size - old_size
                if free is not None:
                    free -= size - old_size
            finally:
                seconds[i] += time.perf_counter() - t
        for i, write, raw_bytes, size, old_size, rel in in_flight:
            t = time.perf_counter()
            problem = write.outcome()
            seconds[i] += time.perf_counter() - t
            if problem is not None:
                res.set(i, *problem[1])
                self._count_store_failure(problem[1][0])
                continue
            if chooser is not None:  # the device time overlaps: the worker pays the CPU
                chooser.add_write(size, write.cpu_s, write.cpu_s)
            self._count_stored(res, i, raw_bytes, size, old_size, rel, synced_dirs)
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
        res.codec_s = codec_s
        return res

    def _count_stored(self, res: BatchResult, i: int, raw_bytes: int, size: int,
                      old_size: int, rel: str, synced_dirs: dict[str, list[int]]) -> None:
        """Key ``i`` of ``res`` is published: its outcome, sizes and counters."""
        c = self.counters
        res.set(i, Outcome.OK)
        res.logical_bytes[i] = raw_bytes
        res.stored_bytes[i] = size
        c.bytes_on_disk = max(0, c.bytes_on_disk + size - old_size)
        c.files_written += 1
        c.bytes_written += size
        if self.fsync:
            synced_dirs.setdefault(rel, []).append(i)

    def close(self) -> None:
        """Wait for the O_DIRECT writes in flight (none outlives a store batch) and stop
        the I/O threads. Idempotent."""
        if self._direct is not None:
            self._direct.close()
        if self._window is not None:
            self._window.clear()

    def _open_published(self, where: tuple[str, str]) -> int:
        """A published file, ``(leaf directory, name)``, opened to drop its pages."""
        return self.ns.open_entry(*where, os.O_RDONLY | os.O_NONBLOCK)[0]

    def _count_store_failure(self, outcome: Outcome) -> None:
        if outcome is Outcome.REJECTED:
            self.counters.store_full += 1
        else:
            self.counters.store_errors += 1

    def _create_temp(self, rel: str, key_hex: str, flags: int):
        """Create a temp file for a key in leaf directory ``rel`` (made if absent):
        ``(name, fd, leaf directory fd)``, or (errno, (outcome, detail))."""
        tmp = self.ns.temp_name(key_hex)
        try:
            # a cached leaf removed behind our back is made again (Namespace.in_leaf)
            fd, leaf = self.ns.open_entry(rel, tmp, flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                          create_dirs=True)
        except OSError as e:
            if isinstance(e, LinkRefused):
                self.counters.links_refused += 1
            return e.errno or 0, errno_outcome(e, "create")
        return tmp, fd, leaf

    def _start_direct(self, rel: str, final: str, key_hex: str, frame, size: int):
        """O_DIRECT: create the temp file here and hand its write and rename to an I/O
        thread: a ``DirectWrite``, or (errno, (outcome, detail)) with nothing left
        behind. ``frame``: the frame's parts, or a function writing its ``size`` bytes
        into the write's buffer (``DirectWrites.submit_fill``). The write gets its own
        descriptor of the leaf directory (the namespace's cached one may be closed
        before the rename)."""
        made = self._create_temp(rel, key_hex, O_DIRECT)
        if len(made) == 2:
            return made
        tmp, fd, leaf = made
        try:
            leaf = os.dup(leaf)
        except OSError as e:
            close_quietly(fd)
            unlink_quietly(tmp, dir_fd=leaf)
            return e.errno or 0, errno_outcome(e, "create")
        if callable(frame):
            return self._direct.submit_fill(fd, leaf, tmp, final, size, frame)
        return self._direct.submit(fd, leaf, tmp, final, frame, size)

    def _publish(self, rel: str, final: str, key_hex: str, parts,
                 size: int) -> tuple[int, tuple[Outcome, str]] | None:
        """Buffered: temp file + rename in leaf directory ``rel`` (made if absent); None
        on success, else (errno, (outcome, detail)). Leaves no temp file."""
        made = self._create_temp(rel, key_hex, 0)
        if len(made) == 2:
            return made
        tmp, fd, leaf = made
        window = self._window

        def write(f: int) -> None:
            if window is not None and window.measuring:  # is new page cache expensive?
                cpu = time.thread_time()
                writev_all(f, parts, size)
                window.note_write(size, time.thread_time() - cpu)
            else:
                writev_all(f, parts, size)
            if window is not None:
                window.start(f)

        failed = publish_temp(fd, leaf, tmp, final, write, self.fsync)
        if failed is None and window is not None:
            window.published((rel, final), size)
        return None if failed is None else (failed[0].errno or 0, errno_outcome(*failed))
