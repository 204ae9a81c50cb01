"""The worker half of the ``fs`` tier: chunks as verified files under one directory tree.

Runs in: tier worker processes only, called by the job loop for one job at a time on
the worker's thread (O_DIRECT stores also use the write path's own I/O threads, which
finish before ``store`` returns: ``direct_writes.py``). Every method blocks on the filesystem (a local disk answers
in microseconds to milliseconds; a network filesystem may take seconds); that is why it
never runs in the scheduler process. Imports neither torch nor vLLM.

This module holds ``FsBackend``, the ``TierBackend`` the job loop calls: its
construction, delete, probe and scan (metadata only), and its counters; it hands store
and load batches to its write and read paths. The rest of the tier's worker half:

- ``namespace.py``: the on-disk layout (namespace directory per layout fingerprint,
  fan-out directories, chunk and temp file names, config.json); every file and directory
  is reached through it, relative to a directory descriptor, never through a symbolic
  link.
- ``store.py``: the write path (encode, capacity checks, temp file + rename publish).
- ``load.py``: the read path (readahead, whole-file read, verify and decode, corrupt
  files removed).
- ``fileio.py``: low-level file helpers (whole writes and reads, O_DIRECT, fsync, space).
- ``outcomes.py``: the counters and the per-key outcomes of OS errors.

I/O: ``direct_io`` false (this class's default): buffered; true (or ``"auto"``: wherever a
probe write in the namespace succeeds, as vLLM's fs tier does) uses ``O_DIRECT`` both ways,
``"writes"`` only for stores (loads buffered); ``"adaptive"`` (the tier config's default,
where the probe succeeds) reads from the page cache what it holds whole and the rest with
``O_DIRECT`` (``load.py``), and stores buffered until new page cache proves expensive,
then with ``O_DIRECT`` (``store.py``). O_DIRECT stores keep ``write_depth`` writes in flight per
worker (``direct_writes.py``); buffered stores may keep only ``page_cache_bytes`` of a
worker's recent files in the page cache (``writeback.py``). Why buffered is the default,
with measurements: bench/README.md, fs_tier.py and "Writes that miss the page cache".
"""

from __future__ import annotations

import errno
import os
import stat
import time
from typing import Callable, Iterator, Sequence

from shmtier.shared.codec import CompressionConfig, mac_key_id
from shmtier.shared.jobs import ResultFlag
from shmtier.storage.chunk_names import chunk_key, key_problem, with_mac_id
from shmtier.tiers.backend import BatchResult, Outcome, ScanEntry, TierBackend, WorkerContext
from shmtier.tiers.fs.config import DIRECT_IO_VALUES, FsTierConfig
from shmtier.tiers.fs.fileio import probe_direct_io, unlink_quietly
from shmtier.tiers.fs.load import ChunkReader, chunk_file_cap, remove_foreign
from shmtier.tiers.fs.namespace import TEMP_SUFFIX, LinkRefused, Namespace
from shmtier.tiers.fs.outcomes import FsCounters, errno_outcome
from shmtier.tiers.fs.store import ChunkWriter

DEFAULT_CHUNK_BYTES_HINT = 1 << 20
DEFAULT_STALE_TEMP_AGE_S = 900.0
# what stands for a key in the O_DIRECT probe's temp name (``takes_direct_io``)
_PROBE_TEMP_KEY = "direct-probe"


class FsBackend(TierBackend):
    """Chunks of one layout fingerprint stored as files under ``root_dir``.

    Construct once per tier worker process (the pool's workers each hold one, all on the
    same ``root_dir``; concurrent use from several processes is safe, from several
    threads of one process is not). Construction creates the namespace directory and its
    config.json if absent (``Namespace``) and blocks briefly on the filesystem; it does
    not walk the tree. The job loop should run ``scan()`` once after start (the
    warm-restart index rebuild), which also removes temp files left by dead writers.

    Raises at construction: FileNotFoundError / NotADirectoryError for a missing root,
    ValueError for invalid arguments or a namespace directory whose config.json names
    another fingerprint or format, OSError when the namespace cannot be created (e.g. a
    read-only root without an existing namespace) or its path is a symbolic link. With
    ``defer_namespace`` (``open``: every tier worker) a root that is gone, a
    filesystem too full to make the namespace (``namespace.DEFERRABLE``) or a link or a
    file where the namespace directory goes is not an error: the backend starts without
    a namespace (stores fail as below, loads MISS; logged once) and its first store that
    can makes it, so a worker restarted during such an outage starts (else the pool
    would count start failures and break for good). Such a
    backend uses buffered I/O when ``direct_io`` is "adaptive", "auto" or "writes" (nothing to
    probe); with ``direct_io`` true it does not defer.

    A namespace removed while the backend runs (its directory or the whole root deleted):
    every op first checks that the namespace path still names the directory it holds (one
    ``lstat``, charged to the batch's first key). Loads and probes then answer MISS,
    deletes MISS and scan lists nothing; the next store makes the namespace again (with
    the recorded fan-out) when the root exists, else fails every key (ERROR, ENOENT: the
    root is the operator's and never created here) and tries again on the next store.
    A namespace that cannot be made for want of space fails every key of the store
    (REJECTED, ``"ENOSPC ... (namespace)"``; nothing half-made is left) and is tried
    again by the next store too: nothing is remembered as broken, so stores resume as
    soon as the root is back or space is freed (``namespace.py``, "Recovery").
    Each change seen (removed, replaced, made again; with ``flag_created``, also a
    namespace this backend had to make, or could not open, when it opened) raises
    ``ResultFlag.NAMESPACE_RESET``
    (``take_flags``) so that the scheduler half drops its index and lists the tier again,
    and zeroes ``counters.bytes_on_disk``; the process that made the namespace again logs
    it once (WARNING, with the path).

    Capacity: before writing a chunk, ``store`` refuses it (REJECTED, "max_bytes") when
    ``bytes_in_use`` (the job's figure, else this process's ``bytes_on_disk``) plus the
    frame's size would exceed ``max_bytes``, and (REJECTED, "min_free") when the
    filesystem's available space minus the frame would drop below ``min_free_bytes``
    (``os.statvfs`` once per batch, then this batch's writes subtracted; ``None``
    disables the floor). A full medium still answers ENOSPC: REJECTED, "ENOSPC ...". Sizes
    are file sizes (frame bytes). The backend never evicts: the scheduler half decides
    what to delete.

    ``mac_key`` (16..64 secret bytes, or None): every frame written carries a keyed
    BLAKE2b tag, and a load serves only frames whose tag verifies under this key (else
    CORRUPT, "mac": the file is removed and counted like any corrupt file). The key's id
    (``codec.mac_key_id``) is part of the namespace's fingerprint, so engines with
    different keys, or without one, never share a namespace directory: a frame that
    fails the MAC in this namespace was not written by an engine of this key and removing
    it takes nothing from anyone (docs/architecture.md, failure model).
    """

    kind = "fs"

    def __init__(
        self,
        root_dir: str,
        namespace: str,
        *,
        fsync: bool = False,
        codec_config: CompressionConfig | None = None,
        element_size: int = 2,
        max_bytes: int | None = None,
        min_free_bytes: int | None = FsTierConfig.default("min_free_bytes"),
        chunk_bytes_hint: int = DEFAULT_CHUNK_BYTES_HINT,
        stale_temp_age_s: float = DEFAULT_STALE_TEMP_AGE_S,
        direct_io: bool | str = False,
        write_depth: int = FsTierConfig.default("write_depth"),
        page_cache_bytes: int | str | None = None,
        mac_key: bytes | None = None,
        flag_created: bool = True,
        defer_namespace: bool = False,
        chunk_bytes: int | None = None,
    ):
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"fs tier namespace must be a non-empty fingerprint string, got {namespace!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"fs tier max_bytes={max_bytes!r}: must be a positive integer or None")
        if min_free_bytes is not None and (not isinstance(min_free_bytes, int) or min_free_bytes < 0):
            raise ValueError(
                f"fs tier min_free_bytes={min_free_bytes!r}: must be an integer >= 0, or None (no floor)")
        if not isinstance(element_size, int) or not 1 <= element_size <= 255:
            raise ValueError(f"fs tier element_size={element_size!r}: must be an integer in 1..255")
        if not isinstance(chunk_bytes_hint, int) or chunk_bytes_hint <= 0:
            raise ValueError(f"fs tier chunk_bytes_hint={chunk_bytes_hint!r}: must be a positive integer")
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
            raise ValueError(f"fs tier chunk_bytes={chunk_bytes!r}: must be a positive integer "
                             f"or None")
        if direct_io not in DIRECT_IO_VALUES:
            raise ValueError(f"fs tier direct_io={direct_io!r}: must be true, false, "
                             f"\"adaptive\", \"auto\" or \"writes\"")
        self.mac_key_id = mac_key_id(mac_key) if mac_key is not None else None
        namespace = with_mac_id(namespace, self.mac_key_id)
        self.ns = Namespace(root_dir, namespace, capacity_bytes=max_bytes,
                            chunk_bytes_hint=chunk_bytes_hint, fsync=bool(fsync),
                            defer=defer_namespace and direct_io is not True)
        self.root_dir = self.ns.root_dir
        self.fingerprint = namespace
        self.namespace_dir = self.ns.dir
        self.fsync = bool(fsync)
        self.element_size = element_size
        #: the layout's chunk size (None: not known): a file larger than any chunk of it
        #: is foreign (``load.chunk_file_cap``)
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.stale_temp_age_s = float(stale_temp_age_s)
        self.codec_config = codec_config if codec_config is not None else CompressionConfig()
        self.counters = FsCounters()
        direct = direct_io is not False and self.takes_direct_io()
        adaptive = direct_io == "adaptive"
        #: O_DIRECT for stores / for loads from the start (``direct_io`` and what the
        #: filesystem takes); "adaptive": cache-first loads, stores O_DIRECT once new page
        #: cache proves expensive
        self.direct_writes = direct and not adaptive
        self.direct_io = direct and direct_io not in ("writes", "adaptive")
        if direct_io is True and not self.direct_io:
            raise OSError(errno.EINVAL, f"fs tier direct_io=true but {self.namespace_dir} does "
                                        f"not support O_DIRECT; set direct_io to "
                                        f"\"auto\" or false")
        self._writer = ChunkWriter(self.ns, self.counters, codec_config=self.codec_config,
                                   element_size=element_size, max_bytes=max_bytes,
                                   min_free_bytes=min_free_bytes, fsync=self.fsync,
                                   direct_io=self.direct_writes, mac_key=mac_key,
                                   write_depth=write_depth, page_cache_bytes=page_cache_bytes,
                                   direct_when_expensive=direct and adaptive)
        self._write_depth = write_depth
        self._reader = ChunkReader(self.ns, self.counters, direct_io=self.direct_io,
                                   cache_first=direct and adaptive, mac_key=mac_key)
        self._generation = self.ns.generation
        # A namespace this worker had to create may have replaced one the scheduler half
        # indexed (deleted while every worker was restarting), and one it could not open
        # (a link or a file in its place, the root gone) holds none of what it indexed:
        # its first result says so. Not at engine start (``flag_created`` false: a first worker, not a
        # ``WorkerContext.replacement``): the namespace is new to everyone
        # then, and a first worker's late first result must not drop what the others
        # stored meanwhile.
        self._flags = (ResultFlag.NAMESPACE_RESET
                       if flag_created and (self.ns.created_at_open or self.ns.fd < 0)
                       else 0)

    def takes_direct_io(self) -> bool:
        """Whether the namespace's directory takes O_DIRECT (``probe_direct_io``): its
        probe file is named as this process's temp files are (a temp name of the
        namespace), so one left by a process killed mid-probe is removed as a dead
        writer's by the next scan. False without a namespace directory."""
        return self.ns.fd >= 0 and probe_direct_io(
            self.namespace_dir, dir_fd=self.ns.fd, name=self.ns.temp_name(_PROBE_TEMP_KEY))

    @classmethod
    def open(cls, config: FsTierConfig, context: WorkerContext) -> "FsBackend":
        """A tier worker's backend for its tier's ``config``; its namespace deferred while
        the medium cannot hold it (``defer_namespace``)."""
        return cls(config.root_dir, context.namespace, fsync=config.fsync,
                   codec_config=context.codec, element_size=context.element_size,
                   max_bytes=config.max_bytes, min_free_bytes=config.min_free_bytes,
                   chunk_bytes_hint=context.chunk_bytes, direct_io=config.direct_io,
                   write_depth=config.write_depth, page_cache_bytes=config.page_cache_bytes,
                   mac_key=config.mac_secret, flag_created=context.replacement,
                   defer_namespace=True, chunk_bytes=context.chunk_bytes)

    @property
    def writes_in_flight(self) -> int:
        """Store keys the job loop may hand over at once (as many are written in
        parallel: ``write_depth`` while the stores are O_DIRECT)."""
        return self._write_depth if self._writer.stores_direct else 1

    @property
    def fanout_bits(self) -> tuple[int, int] | None:
        """The namespace's recorded fan-out (None while it was never opened)."""
        return self.ns.fanout_bits

    def path_for(self, key: bytes) -> str:
        """The file that holds (or would hold) ``key``'s chunk."""
        return self.ns.path_for(key)

    # ------------------------------------------------------------------ store

    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int, *,
              skip_existing: bool = True, bytes_in_use: int | None = None,
              hurry: bool = False) -> BatchResult:
        """Write row ``rows[i]`` (its first ``chunk_bytes``) as the chunk of ``keys[i]``.

        Called by the job loop of a tier worker for a cascade job; blocks on the disk
        (``store.py``: one temp file + rename per key). Rows are only read (they are
        pinned primary rows). Per key: OK (published;
        ``stored_bytes`` = file size), EXISTS (``skip_existing`` and a file is already
        there: nothing written, ``stored_bytes`` = its size; without ``skip_existing`` an
        existing file is replaced atomically and its size credited to the capacity
        checks), REJECTED (capacity: detail ``max_bytes`` or ``min_free``, or ENOSPC/EDQUOT:
        nothing left behind), ERROR, INVALID. After EROFS, ENOSPC or EDQUOT the remaining
        keys of the batch get the same outcome without being tried; so do all keys when
        the namespace cannot be made again (root gone: ``"ENOENT fs tier root_dir is gone
        ... (namespace)"``). ``bytes_in_use``: the
        scheduler's count of the tier's stored bytes, for the ``max_bytes`` check (else
        this process's ``counters.bytes_on_disk``). ``hurry``: the worker is behind; in
        codec mode ``auto`` that is one input of compression by cost
        (``shared/codec_choice.py``), which may then store raw frames (checksummed, not
        compressed; counted in ``stores_raw_hurried``, or ``stores_raw_by_cost`` when
        not behind). A key's seconds cover its stat,
        encode and publish; the batch's free-space query is charged to its first key, a
        directory fsync (``fsync=True``) shared by the keys published in that directory.
        Raises ValueError only for a malformed batch.
        """
        t = time.perf_counter()
        blocked = self._enter(create=True)
        spent = time.perf_counter() - t
        res = self._writer.store(keys, rows, arena, chunk_bytes, skip_existing=skip_existing,
                                 bytes_in_use=bytes_in_use, hurry=hurry, blocked=blocked)
        if res.seconds:
            res.seconds[0] += spent
        return res

    # ------------------------------------------------------------------ load

    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena,
             chunk_bytes: int) -> BatchResult:
        """Read and verify the chunk of ``keys[i]`` into row ``rows[i]`` (first ``chunk_bytes``).

        Called by the job loop of a tier worker for a promotion job; blocks on the disk
        (``load.py``: files read ahead up to 16 at a time, each read whole and verified
        by the codec, which checks key, lengths and CRCs before and after writing the row).
        Per key: OK (the row holds the exact stored chunk), MISS (no file, no namespace
        now, or a symbolic link: never followed), CORRUPT (detail: the reason; file
        removed and counted), ERROR, INVALID. For any outcome but OK the
        row's first ``chunk_bytes`` are undefined (the decoder may have written into it
        before a check failed) and must not be served; bytes past ``chunk_bytes`` are
        never written. A frame whose raw length differs from ``chunk_bytes`` is CORRUPT
        ("length"). A key's seconds cover its open, read and decode.
        """
        t = time.perf_counter()
        blocked = self._enter(create=False)
        spent = time.perf_counter() - t
        res = self._reader.load(keys, rows, arena, chunk_bytes, blocked=blocked)
        if res.seconds:
            res.seconds[0] += spent
        return res

    # ------------------------------------------------------------------ delete / probe

    def delete(self, keys: Sequence[bytes]) -> BatchResult:
        """Unlink the chunks of ``keys`` (scheduler-decided eviction). Blocks on the disk.

        Per key: OK (``stored_bytes`` = bytes freed), MISS (also for a symbolic link at
        the chunk's name: the link is removed, never its target; counted in
        ``links_refused``; and for a foreign file, ``_foreign``: removed, counted),
        ERROR, INVALID. A load already reading the file finishes
        with the old bytes."""
        return self._per_key("delete", keys, "unlink", self._delete_one)

    def _delete_one(self, res: BatchResult, i: int, key: bytes) -> None:
        rel, name = self.ns.locate(key)
        st = self.ns.stat_entry(rel, name)
        if self._foreign(st, key):  # not a chunk of ours: nothing freed
            remove_foreign(self.ns, self.counters, (rel, name), st)
            res.set(i, Outcome.MISS)
            return
        self.ns.unlink_entry(rel, name)  # a link itself, never its target
        if stat.S_ISLNK(st.st_mode):  # not a chunk of ours: nothing freed
            self.counters.links_refused += 1
            res.set(i, Outcome.MISS)
            return
        size = st.st_size
        res.set(i, Outcome.OK)
        res.stored_bytes[i] = size
        c = self.counters
        c.files_deleted += 1
        c.bytes_on_disk = max(0, c.bytes_on_disk - size)

    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """Presence by one ``stat`` per key, without reading: OK with ``stored_bytes``
        (present; not verified — a corrupt file is found by ``load``) or MISS (also for
        a symbolic link, never followed: counted in ``links_refused``; and for a foreign
        file, ``_foreign``: removed, counted)."""
        return self._per_key("probe", keys, "stat", self._probe_one)

    def _probe_one(self, res: BatchResult, i: int, key: bytes) -> None:
        entry = self.ns.locate(key)
        st = self.ns.stat_entry(*entry)
        if self._foreign(st, key):
            remove_foreign(self.ns, self.counters, entry, st)
            res.set(i, Outcome.MISS)
        elif stat.S_ISREG(st.st_mode):
            res.set(i, Outcome.OK)
            res.stored_bytes[i] = st.st_size
        else:
            if stat.S_ISLNK(st.st_mode):
                self.counters.links_refused += 1
            res.set(i, Outcome.MISS)

    def _per_key(self, op: str, keys: Sequence[bytes], step: str,
                 one: Callable[[BatchResult, int, bytes], None]) -> BatchResult:
        """``op``'s result for ``keys``, key ``i``'s outcome set by ``one(res, i, key)``
        (or INVALID for a bad key), its seconds measured around it. An OSError raised by
        ``one`` is key i's outcome: MISS for a missing file or directory or a link in
        place of a fan-out directory (counted), else ``errno_outcome(e, step)``. With no
        namespace now (``_enter``), every valid key is a MISS (or an ERROR when the
        namespace path cannot be used)."""
        res = BatchResult.empty(op, len(keys))
        seconds = res.seconds
        t = time.perf_counter()
        blocked = self._enter(create=False)
        if keys:
            seconds[0] = time.perf_counter() - t  # charged to the first key
        for i, key in enumerate(keys):
            t = time.perf_counter()
            try:
                bad = key_problem(key)
                if bad is not None:
                    res.set(i, Outcome.INVALID, bad)
                elif blocked is not None:  # no namespace now (MISS), or none usable
                    if isinstance(blocked, (FileNotFoundError, NotADirectoryError, LinkRefused)):
                        res.set(i, Outcome.MISS)
                    else:
                        res.set(i, *errno_outcome(blocked, "namespace"))
                else:
                    one(res, i, bytes(key))
            except LinkRefused:
                self.counters.links_refused += 1
                res.set(i, Outcome.MISS)
            except (FileNotFoundError, NotADirectoryError):
                res.set(i, Outcome.MISS)
            except OSError as e:
                res.set(i, *errno_outcome(e, step))
            finally:
                seconds[i] += time.perf_counter() - t
        return res

    def _foreign(self, st: os.stat_result, key: bytes) -> bool:
        """Whether the file ``st`` at ``key``'s chunk name is larger than any chunk of the
        layout could be (``load.chunk_file_cap``, of ``chunk_bytes``): a foreign file,
        never a chunk of ours, whose size is never reported (it may not fit a result)."""
        return stat.S_ISREG(st.st_mode) and st.st_size > chunk_file_cap(len(key),
                                                                         self.chunk_bytes)

    # ------------------------------------------------------------------ scan

    def scan(self) -> Iterator[ScanEntry]:
        """Yield every chunk file of the namespace: ``(key, stored_bytes, mtime)``.

        For the background index rebuild after a (re)start; one ``stat`` per file, no
        reads, so files are not verified (``load`` does that). On the way it removes
        temp files of dead writers (and temp files older than ``stale_temp_age_s``) and
        chunk files sitting in a directory their key does not map to (unreachable by
        ``load``), counting both. Files published during the walk may or may not be
        seen. When the walk completes, ``counters.bytes_on_disk`` is set to the total
        found. Unreadable directories are skipped and counted (``scan_errors``). No
        symbolic link is followed: one in place of a fan-out directory or a chunk file
        is skipped and counted (``links_refused``); a foreign file (``_foreign``) is left
        out, removed and counted. With no namespace now (removed, and
        no store made it again yet) the listing is empty; with one that cannot be used
        (a link or a file at its path) too, counted in ``scan_errors``.
        """
        total = 0
        c = self.counters
        blocked = self._enter(create=False)
        if blocked is not None:
            if isinstance(blocked, FileNotFoundError):
                c.bytes_on_disk = 0
            else:
                c.scan_errors += 1
            return
        for rel, dir_fd, entries in self.ns.walk(self._scan_error, self._link_refused,
                                                 self._top_entry):
            for e in entries:
                name = e.name
                if name.endswith(TEMP_SUFFIX):
                    if name.startswith("."):
                        self._maybe_remove_temp(e, dir_fd)
                    continue
                key = chunk_key(name)
                if key is None:
                    continue
                if self.ns.rel_dir(key) != rel:
                    if unlink_quietly(name, dir_fd=dir_fd):
                        c.misplaced_files_removed += 1
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if not stat.S_ISREG(st.st_mode):
                    if stat.S_ISLNK(st.st_mode):
                        c.links_refused += 1
                    continue
                if self._foreign(st, key):
                    remove_foreign(self.ns, c, (rel, name), st)
                    continue
                total += st.st_size
                yield ScanEntry(key, st.st_size, st.st_mtime)
        c.bytes_on_disk = total

    def remove_stale_temp_files(self) -> int:
        """Walk the namespace only to clean up (``scan`` without the entries); returns the
        number of temp files removed."""
        before = self.counters.temp_files_removed
        for _ in self.scan():
            pass
        return self.counters.temp_files_removed - before

    def _scan_error(self) -> None:
        self.counters.scan_errors += 1

    def _link_refused(self) -> None:
        self.counters.links_refused += 1

    def _top_entry(self, dir_fd: int, rel: str, entry: os.DirEntry) -> None:
        """The scan's look at the namespace directory's own entries (``Namespace.walk``'s
        ``on_other``): the temp file of a process killed during its O_DIRECT probe
        (``takes_direct_io``) is removed as a dead writer's chunk temp files are."""
        name = entry.name
        if not rel and name.startswith(".") and name.endswith(TEMP_SUFFIX):
            self._maybe_remove_temp(entry, dir_fd)

    def _maybe_remove_temp(self, entry: os.DirEntry, dir_fd: int) -> None:
        if self.ns.temp_writer_alive(entry.name):  # else: no stat needed
            try:
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                return
            if not self.ns.temp_orphaned(entry.name, mtime, self.stale_temp_age_s):
                return
        if unlink_quietly(entry.name, dir_fd=dir_fd):
            self.counters.temp_files_removed += 1

    # ------------------------------------------------------------------ namespace

    def _enter(self, *, create: bool) -> OSError | None:
        """Start of every op: ``Namespace.sync`` (``create`` for a store: make the
        namespace again if it was removed). Returns why the namespace cannot be used now,
        or None. A change of the namespace directory since the last op (removed,
        replaced, made again) raises ``NAMESPACE_RESET`` for the scheduler half
        (``take_flags``), counts in ``namespace_resets`` and zeroes ``bytes_on_disk``."""
        try:
            self.ns.sync(create=create)
            blocked = None
        except OSError as e:
            if isinstance(e, LinkRefused):
                self.counters.links_refused += 1
            blocked = e
        if self.ns.generation != self._generation:
            self._generation = self.ns.generation
            self._flags |= ResultFlag.NAMESPACE_RESET
            self.counters.namespace_resets += 1
            self.counters.bytes_on_disk = 0
        return blocked

    def take_flags(self) -> int:
        """``ResultFlag`` bits raised since the last call (``NAMESPACE_RESET``: the
        namespace directory was removed, replaced or made again, seen by this process;
        the scheduler half should drop its index of the tier and scan again), cleared;
        plus ``COMPRESSION_OFF`` while compression by cost chose raw frames and
        ``PAGE_CACHE_BOUNDED`` while the stores' page cache is bounded and
        ``DIRECT_STORES`` while they are O_DIRECT."""
        flags, self._flags = self._flags, 0
        chooser = self._writer.chooser
        if chooser is not None and chooser.decision is not None and not chooser.decision.compress:
            flags |= ResultFlag.COMPRESSION_OFF  # the compression-by-cost choice: raw
        if self._writer.page_cache_bounded:
            flags |= ResultFlag.PAGE_CACHE_BOUNDED
        if self._writer.stores_direct:
            flags |= ResultFlag.DIRECT_STORES
        return int(flags)

    # ------------------------------------------------------------------ misc

    def close(self) -> None:
        """Drop the read buffer and close the namespace's directory descriptors (the
        namespace directory's and up to ``MAX_OPEN_LEAVES`` leaf directories', held
        between calls). Idempotent; a closed backend answers no further calls."""
        self._writer.close()
        self._reader.release()
        self.ns.close()

    def __repr__(self) -> str:
        return (f"FsBackend({self.namespace_dir!r}, fanout_bits={self.fanout_bits}, "
                f"fsync={self.fsync}, max_bytes={self.max_bytes}, "
                f"mac_key_id={self.mac_key_id})")

