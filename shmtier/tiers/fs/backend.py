"""The worker half of the ``fs`` tier: chunks as verified files under one directory tree.

Runs in: tier worker processes only, called by the job loop for one job at a time on
the worker's single thread. Every method blocks on the filesystem (a local disk answers
in microseconds to milliseconds; a network filesystem may take seconds); that is why it
never runs in the scheduler process. Imports neither torch nor vLLM.

On-disk layout (format version 1)::

    <root_dir>/                             exists beforehand (the operator's)
      shmtier-<sha256(fingerprint)[:16]>/   namespace, 0700: one per layout fingerprint
        config.json                         0600: format, version, fingerprint, fan-out
        <d1>/<d2>/                          two fan-out levels, 0700, made on first use
          <key hex>.kv                      one chunk = one codec frame, 0600
          .<key hex[:16]>.<boot>-<pid>-<start>-<seq>.tmp   a write in progress

``d1``/``d2`` are bit fields of ``blake2b(key, digest_size=4)`` printed in hex, so chunks
spread evenly whatever the key's structure. Their widths (``fanout_bits``) are chosen
when the namespace is created, proportional to the expected number of files (capacity
/ ``chunk_bytes_hint`` / 512 files per leaf directory, 2..16 bits in all) and recorded
in config.json; every later open uses the recorded widths. Unlike vLLM's fs tier
(docs/vllm-contract.md §10.2: up to 4096 x 256 directories per group, more directories than files),
a 1 TiB tier of 1 MiB chunks gets 2048 leaf directories and a 10 GiB one 32.

A file's content is exactly the frame of ``shmtier.shared.codec`` (magic, version,
codec, element size, raw length, stored length, the full key, a checksum of the raw
bytes, then the payload). A chunk is published by writing a temp file in its final
directory and renaming it over the final name, so a reader sees either no file or a
complete one; with ``fsync=True`` the file is fsynced before the rename and its
directory after it (before the key is reported stored). Temp files carry the writer's
identity (boot id prefix, pid, process start time); ``scan`` removes those of dead
writers (and any older than ``stale_temp_age_s``), so a writer killed mid-store leaves
nothing that is ever mistaken for a chunk.

I/O: buffered by default. With ``direct_io=True`` (or ``"auto"``: wherever a probe
write in the namespace succeeds, as vLLM's fs tier does) files are written and read
with ``O_DIRECT``: a frame is gathered
into a page-aligned buffer, written in whole pages and the file cut back to the frame's
size; a read takes whole pages into the aligned read buffer. That skips the page-cache
copy, which on the development VM cost ~2 s of kernel CPU per GB once the cache held a
few hundred MB of dirty data (the tier workers fell behind on it); warm re-reads then come
from the device, and every store waits for the device, which keeps cascades (and the CPU
rows they pin) in flight longer: measured on a small CPU tier, promotions waited 4x
longer and some were refused for lack of a row. Buffered I/O (``writev``/``preadv``) is
the default for that reason; O_DIRECT pays off under sustained large writes.

Reads are always verified by the codec (magic, version, lengths, key, checksum, and the
file size against the frame's stored length). A file that fails is reported CORRUPT
(the reason as its detail), unlinked (only if the path still names the inode that was
read: a concurrent re-store of the key is kept) and counted. Per-key outcomes are
``shmtier.shared.jobs.Outcome`` members with a detail text (``shmtier.tiers.backend``),
and each key's seconds are measured around its own work.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import numpy as np

from shmtier.shared import procinfo
from shmtier.shared.codec import (
    ChunkDecoder,
    ChunkEncoder,
    CompressionConfig,
    CorruptChunkError,
    frame_header_size,
)
from shmtier.tiers.backend import (
    BatchResult,
    Outcome,
    ScanEntry,
    TierBackend,
    WorkerContext,
    as_arena,
    check_batch,
)

FORMAT_NAME = "shmtier-fs"
FORMAT_VERSION = 1
NAMESPACE_PREFIX = "shmtier-"
CONFIG_NAME = "config.json"
CHUNK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
#: Longest key accepted: its hex name (200 chars + suffix) stays under NAME_MAX (255).
MAX_KEY_BYTES = 100
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_CHUNK_BYTES_HINT = 1 << 20
FILES_PER_LEAF_DIR = 512
MIN_FANOUT_BITS, MAX_FANOUT_BITS = 2, 16
DEFAULT_STALE_TEMP_AGE_S = 900.0
_ALIGN = 4096
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FS_WIDE = (errno.EROFS,) + _NO_SPACE  # after one of these, the rest of a store batch fails too
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_PREFETCH = 16  # files of a load batch opened (and read ahead) at once
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def namespace_dir_name(fingerprint: str) -> str:
    """Directory name of a layout fingerprint's namespace: ``shmtier-<16 hex of sha256>``."""
    return NAMESPACE_PREFIX + hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()[:16]


def choose_fanout_bits(capacity_bytes: int, chunk_bytes_hint: int) -> tuple[int, int]:
    """Fan-out widths (bits of level 1, level 2) for an expected capacity.

    About ``FILES_PER_LEAF_DIR`` files per leaf directory when full, 2..16 bits in all,
    split as evenly as possible (level 1 gets the odd bit)."""
    files = max(1, capacity_bytes // max(1, chunk_bytes_hint))
    leaves = max(1, files // FILES_PER_LEAF_DIR)
    total = min(MAX_FANOUT_BITS, max(MIN_FANOUT_BITS, (leaves - 1).bit_length()))
    return (total + 1) // 2, total // 2


def errno_outcome(exc: OSError, step: str) -> tuple[Outcome, str]:
    """REJECTED for out-of-space errnos, else ERROR; the detail names the errno, its
    text and the step, e.g. ``"ENOSPC No space left on device (write)"``."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, f"E{code}")
    text = exc.strerror or str(exc)
    return (Outcome.REJECTED if code in _NO_SPACE else Outcome.ERROR), f"{name} {text} ({step})"


@dataclass
class FsCounters:
    """Counters of one FsBackend object (this process only; never reset by the backend).

    ``bytes_on_disk`` is what this process knows: set by a completed ``scan``, then
    adjusted by its own stores, deletes and corrupt-file removals. Other processes
    writing the same namespace are not seen until the next scan; the scheduler half's
    index is the authoritative count."""

    bytes_on_disk: int = 0
    files_written: int = 0
    bytes_written: int = 0  # stored (on-disk) bytes of published files
    files_read: int = 0
    bytes_read: int = 0  # stored bytes read from verified files
    files_deleted: int = 0
    store_exists: int = 0
    store_full: int = 0
    store_errors: int = 0
    stores_raw_hurried: int = 0  # stored raw (mode "auto") because the worker was behind
    load_missing: int = 0
    load_errors: int = 0
    corrupt_files_detected: int = 0
    corrupt_files_removed: int = 0
    corrupt_remove_failed: int = 0  # detected, but the medium refused the unlink (e.g. EROFS)
    corrupt_by_reason: dict = field(default_factory=dict)
    temp_files_removed: int = 0
    misplaced_files_removed: int = 0  # chunk files in a directory their key does not map to
    scan_errors: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class FsBackend(TierBackend):
    """Chunks of one layout fingerprint stored as files under ``root_dir``.

    Construct once per tier worker process (the pool's workers each hold one, all on the
    same ``root_dir``; concurrent use from several processes is safe, from several
    threads of one process is not). Construction creates the namespace directory and its
    config.json if absent and blocks briefly on the filesystem; it does not walk the tree.
    The job loop should run ``scan()`` once after start (the warm-restart index rebuild),
    which also removes temp files left by dead writers.

    Raises at construction: FileNotFoundError / NotADirectoryError for a missing root,
    ValueError for invalid arguments or a namespace directory whose config.json names
    another fingerprint or format, OSError when the namespace cannot be created (e.g. a
    read-only root without an existing namespace).

    Capacity: before writing a chunk, ``store`` refuses it (REJECTED, "max_bytes") when
    ``bytes_in_use`` (the job's figure, else this process's ``bytes_on_disk``) plus the
    frame's size would exceed ``max_bytes``, and (REJECTED, "min_free") when the
    filesystem's available space minus the frame would drop below ``min_free_bytes``
    (``os.statvfs`` once per batch, then this batch's writes subtracted; ``None``
    disables the floor). A full medium still answers ENOSPC: REJECTED, "ENOSPC ...". Sizes
    are file sizes (frame bytes). The backend never evicts: the scheduler half decides
    what to delete.
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
        min_free_bytes: int | None = DEFAULT_MIN_FREE_BYTES,
        chunk_bytes_hint: int = DEFAULT_CHUNK_BYTES_HINT,
        stale_temp_age_s: float = DEFAULT_STALE_TEMP_AGE_S,
        direct_io: bool | str = False,
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
        if direct_io not in (True, False, "auto"):
            raise ValueError(f"fs tier direct_io={direct_io!r}: must be true, false or \"auto\"")
        root = os.path.abspath(os.fspath(root_dir))
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"fs tier root_dir does not exist (create it first): {root}"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"fs tier root_dir is not a directory: {root}")

        self.root_dir = root
        self.fingerprint = namespace
        self.fsync = bool(fsync)
        self.element_size = element_size
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.stale_temp_age_s = float(stale_temp_age_s)
        self.codec_config = codec_config if codec_config is not None else CompressionConfig()
        self.counters = FsCounters()
        self.namespace_dir = os.path.join(root, namespace_dir_name(namespace))
        capacity = max_bytes if max_bytes is not None else st_capacity(root)
        self.fanout_bits = self._open_namespace(choose_fanout_bits(capacity, chunk_bytes_hint))
        b1, b2 = self.fanout_bits
        self._shift1, self._shift2, self._mask2 = 32 - b1, 32 - b1 - b2, (1 << b2) - 1
        self._w1, self._w2 = (b1 + 3) // 4, (b2 + 3) // 4
        self._known_dirs: set[str] = set()
        self._encoder = ChunkEncoder(self.codec_config)
        self._raw_encoder = ChunkEncoder(CompressionConfig(mode="none"))
        self._decoder = ChunkDecoder()
        self._buf: np.ndarray | None = None  # reusable read buffer, page aligned
        self._wbuf: np.ndarray | None = None  # reusable O_DIRECT write buffer, page aligned
        self.direct_io = direct_io is not False and probe_direct_io(self.namespace_dir)
        if direct_io is True and not self.direct_io:
            raise OSError(errno.EINVAL, f"fs tier direct_io=true but {self.namespace_dir} does "
                                        f"not support O_DIRECT; set direct_io to "
                                        f"\"auto\" or false")
        self._seq = 0
        self._codec_s = 0.0  # accumulator of the load in progress
        self._writer_pid = -1
        self._writer_tag = ""
        self._boot_tag = procinfo.boot_id()[:4].hex()

    @classmethod
    def open(cls, args: dict, context: WorkerContext) -> "FsBackend":
        """A tier worker's backend for the ``fs`` options ``args`` (``FsTierConfig``'s
        worker options)."""
        return cls(args["root_dir"], context.namespace, fsync=args["fsync"],
                   codec_config=context.codec, element_size=context.element_size,
                   max_bytes=args["max_bytes"], min_free_bytes=args["min_free_bytes"],
                   chunk_bytes_hint=context.chunk_bytes, direct_io=args["direct_io"])

    # ------------------------------------------------------------------ namespace

    def _open_namespace(self, fanout_default: tuple[int, int]) -> tuple[int, int]:
        ns = self.namespace_dir
        created = False
        try:
            os.mkdir(ns, 0o700)
            created = True
        except FileExistsError:
            if not os.path.isdir(ns):
                raise NotADirectoryError(errno.ENOTDIR, f"fs tier namespace path is not a directory: {ns}")
        cfg_path = os.path.join(ns, CONFIG_NAME)
        try:
            cfg = self._read_config(cfg_path)
            if cfg is None:
                self._write_config(cfg_path, fanout_default)
                cfg = self._read_config(cfg_path)  # a racing creator may have won: its file rules
                if cfg is None:
                    raise OSError(errno.EIO, f"fs tier config vanished after writing it: {cfg_path}")
        except BaseException:
            if created:  # nothing half-created (a racing creator's files make this fail: fine)
                try:
                    os.rmdir(ns)
                except OSError:
                    pass
            raise
        return self._check_config(cfg_path, cfg)

    @staticmethod
    def _read_config(path: str) -> dict | None:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            cfg = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"fs tier namespace config is not valid JSON: {path} ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"fs tier namespace config is not a JSON object: {path}")
        return cfg

    def _write_config(self, path: str, fanout: tuple[int, int]) -> None:
        cfg = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "fanout_bits": list(fanout),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        data = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}{TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
        try:
            try:
                _writev_all(fd, [data], len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                # link() publishes only if absent: a racing creator's file is kept.
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            _unlink_quietly(tmp)
        _fsync_dir(self.namespace_dir)

    def _check_config(self, path: str, cfg: dict) -> tuple[int, int]:
        if cfg.get("format") != FORMAT_NAME or cfg.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"fs tier namespace {path} holds format {cfg.get('format')!r} version "
                f"{cfg.get('format_version')!r}; this shmtier reads {FORMAT_NAME!r} version "
                f"{FORMAT_VERSION}"
            )
        if cfg.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"fs tier namespace {path} belongs to another layout fingerprint "
                f"({cfg.get('fingerprint')!r}, expected {self.fingerprint!r}); refusing to use it"
            )
        bits = cfg.get("fanout_bits")
        if (not isinstance(bits, list) or len(bits) != 2
                or not all(isinstance(b, int) and 1 <= b <= 8 for b in bits)):
            raise ValueError(f"fs tier namespace {path}: invalid fanout_bits {bits!r}")
        return bits[0], bits[1]

    # ------------------------------------------------------------------ paths

    def _rel_dir(self, key: bytes) -> str:
        v = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big")
        return f"{v >> self._shift1:0{self._w1}x}/{(v >> self._shift2) & self._mask2:0{self._w2}x}"

    def path_for(self, key: bytes) -> str:
        """The file that holds (or would hold) ``key``'s chunk."""
        return os.path.join(self.namespace_dir, self._rel_dir(key), key.hex() + CHUNK_SUFFIX)

    def _temp_name(self, key_hex: str) -> str:
        pid = os.getpid()
        if pid != self._writer_pid:  # first use, or a fork
            _, started = procinfo.me()
            self._writer_pid, self._writer_tag = pid, f"{self._boot_tag}-{pid}-{started}"
        self._seq += 1
        return f".{key_hex[:16]}.{self._writer_tag}-{self._seq}{TEMP_SUFFIX}"

    def _ensure_dir(self, rel: str) -> None:
        d1 = os.path.join(self.namespace_dir, rel.split("/", 1)[0])
        leaf = os.path.join(self.namespace_dir, rel)
        for d, parent in ((d1, self.namespace_dir), (leaf, d1)):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue
            if self.fsync:
                _fsync_dir(parent)
        self._known_dirs.add(rel)

    @staticmethod
    def _key_problem(key) -> str | None:
        """What makes ``key`` INVALID (the detail), or None."""
        if not isinstance(key, (bytes, bytearray, memoryview)):
            return f"key is {type(key).__name__}, not bytes"
        n = len(key)
        if not 0 < n <= MAX_KEY_BYTES:
            return f"key length {n} (must be 1..{MAX_KEY_BYTES})"
        return None

    # ------------------------------------------------------------------ store

    def store(self, keys: Sequence[bytes], rows: Sequence[int], arena, chunk_bytes: int, *,
              skip_existing: bool = True, bytes_in_use: int | None = None,
              hurry: bool = False) -> BatchResult:
        """Write row ``rows[i]`` (its first ``chunk_bytes``) as the chunk of ``keys[i]``.

        Called by the job loop of a tier worker for a cascade job; blocks on the disk.
        Rows are only read (they are pinned primary rows). Per key: OK (published;
        ``stored_bytes`` = file size), EXISTS (``skip_existing`` and a file is already
        there: nothing written, ``stored_bytes`` = its size; without ``skip_existing`` an
        existing file is replaced atomically and its size credited to the capacity
        checks), REJECTED (capacity: detail ``max_bytes`` or ``min_free``, or ENOSPC/EDQUOT:
        nothing left behind), ERROR, INVALID. After EROFS, ENOSPC or EDQUOT the remaining
        keys of the batch get the same outcome without being tried. ``bytes_in_use``: the
        scheduler's count of the tier's stored bytes, for the ``max_bytes`` check (else
        this process's ``counters.bytes_on_disk``). ``hurry``: the worker is behind; in
        codec mode ``auto`` the chunks are stored as raw frames (checksummed, not
        compressed; counted in ``stores_raw_hurried``). A key's seconds cover its stat,
        encode and publish; the batch's free-space query is charged to its first key, a
        directory fsync (``fsync=True``) shared by the keys published in that directory.
        Raises ValueError only for a malformed batch.
        """
        encoder = self._encoder
        if hurry and self.codec_config.mode == "auto":
            encoder = self._raw_encoder
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("store", n)
        seconds = res.seconds
        c = self.counters
        used = c.bytes_on_disk if bytes_in_use is None else int(bytes_in_use)
        codec_s = 0.0
        free = None
        if self.min_free_bytes is not None:
            t = time.perf_counter()
            free = _available_bytes(self.namespace_dir)
            if n:
                seconds[0] += time.perf_counter() - t
        fail_rest: tuple[Outcome, str] | None = None
        synced_dirs: dict[str, list[int]] = {}
        num_rows = a.shape[0]
        for i in range(n):
            t = time.perf_counter()
            try:
                key = keys[i]
                bad = self._key_problem(key)
                row = rows[i]
                if bad is None:
                    bad = _row_problem(row, num_rows)
                if bad is not None:
                    res.set(i, Outcome.INVALID, bad)
                    continue
                if fail_rest is not None:
                    res.set(i, *fail_rest)
                    self._count_store_failure(fail_rest[0])
                    continue
                key = bytes(key)
                key_hex = key.hex()
                rel = self._rel_dir(key)
                leaf = os.path.join(self.namespace_dir, rel)
                final = os.path.join(leaf, key_hex + CHUNK_SUFFIX)
                try:
                    old_size = os.stat(final).st_size
                except OSError:
                    old_size = 0  # absent (or unreadable: the write below reports why)
                else:
                    if skip_existing:
                        res.set(i, Outcome.EXISTS)
                        res.stored_bytes[i] = old_size
                        c.store_exists += 1
                        continue
                parts, est = encoder.encode(a[row, :chunk_bytes].data, key, self.element_size)
                if encoder is not self._encoder:
                    c.stores_raw_hurried += 1
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
                problem = self._publish(rel, leaf, final, key_hex, parts, size)
                if problem is not None:
                    code, failure = problem
                    res.set(i, *failure)
                    self._count_store_failure(failure[0])
                    if code in _FS_WIDE:
                        fail_rest = failure
                    continue
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
                    synced_dirs.setdefault(leaf, []).append(i)
            finally:
                seconds[i] += time.perf_counter() - t
        for leaf, idx in synced_dirs.items():
            t = time.perf_counter()
            try:
                _fsync_dir(leaf)
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

    def _publish(self, rel: str, leaf: str, final: str, key_hex: str, parts,
                 size: int) -> tuple[int, tuple[Outcome, str]] | None:
        """Temp file + rename; None on success, else (errno, (outcome, detail)). Leaves
        no temp file."""
        tmp = os.path.join(leaf, self._temp_name(key_hex))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        if self.direct_io:
            flags |= _O_DIRECT
        try:
            if rel not in self._known_dirs:
                self._ensure_dir(rel)
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # the directory was removed behind our back
                self._known_dirs.discard(rel)
                self._ensure_dir(rel)
                fd = os.open(tmp, flags, 0o600)
        except OSError as e:
            return e.errno or 0, errno_outcome(e, "create")
        step = "write"
        try:
            if self.direct_io:
                self._write_direct(fd, parts, size)
            else:
                _writev_all(fd, parts, size)
            if self.fsync:
                step = "fsync"
                os.fsync(fd)
        except OSError as e:
            _close_quietly(fd)
            _unlink_quietly(tmp)
            return e.errno or 0, errno_outcome(e, step)
        try:
            step = "close"
            os.close(fd)  # may report a deferred write error (NFS)
            step = "rename"
            os.rename(tmp, final)
        except OSError as e:
            _unlink_quietly(tmp)
            return e.errno or 0, errno_outcome(e, step)
        return None

    def _write_direct(self, fd: int, parts, size: int) -> None:
        """O_DIRECT: the frame is gathered into a page-aligned buffer, written in whole
        pages (DMA from that buffer: no page-cache copy, measured here ~2 s per GB of
        kernel CPU once the cache is dirty) and the file cut back to ``size``."""
        padded = -(-size // _ALIGN) * _ALIGN
        if self._wbuf is None or self._wbuf.nbytes < padded + _ALIGN:
            self._wbuf = np.empty(padded + _ALIGN, dtype=np.uint8)
        base = (-self._wbuf.ctypes.data) % _ALIGN
        buf = self._wbuf[base:base + padded]
        at = 0
        for part in parts:
            n = len(part) if not isinstance(part, memoryview) else part.nbytes
            buf[at:at + n] = np.frombuffer(part, dtype=np.uint8)
            at += n
        buf[size:] = 0
        done = 0
        view = buf.data
        while done < padded:
            k = os.pwrite(fd, view[done:], done)
            if k <= 0:
                raise OSError(errno.EIO, "short write")
            done += k
        if padded != size:
            os.ftruncate(fd, size)

    # ------------------------------------------------------------------ load

    def load(self, keys: Sequence[bytes], rows: Sequence[int], arena,
             chunk_bytes: int) -> BatchResult:
        """Read and verify the chunk of ``keys[i]`` into row ``rows[i]`` (first ``chunk_bytes``).

        Called by the job loop of a tier worker for a promotion job; blocks on the disk.
        Files are opened up to 16 at a time with ``posix_fadvise(WILLNEED)`` (the device
        reads them in parallel); each is then read whole (one ``preadv``) into a reusable
        page-aligned buffer and decoded into the row by the codec, which checks
        everything (key, lengths, CRCs) before and after writing the row.
        Per key: OK (the row holds the exact stored chunk), MISS, CORRUPT (detail: the
        reason; file removed and counted), ERROR, INVALID. For any outcome but OK the
        row's first ``chunk_bytes`` are undefined (the decoder may have written into it
        before a check failed) and must not be served; bytes past ``chunk_bytes`` are
        never written. A frame whose raw length differs from ``chunk_bytes`` is CORRUPT
        ("length"). A key's seconds cover its open, read and decode.
        """
        a = as_arena(arena)
        check_batch(keys, rows, a, chunk_bytes)
        n = len(keys)
        res = BatchResult.empty("load", n)
        seconds = res.seconds
        self._codec_s = 0.0
        for lo in range(0, n, _PREFETCH):
            opened: dict[int, tuple[int, os.stat_result, str]] = {}
            try:
                for i in range(lo, min(n, lo + _PREFETCH)):
                    t = time.perf_counter()
                    got = self._open_for_load(keys[i], rows[i], a.shape[0], res, i)
                    if got is not None:
                        opened[i] = got
                    seconds[i] += time.perf_counter() - t
                for i in sorted(opened):
                    t = time.perf_counter()
                    fd, st, path = opened.pop(i)
                    self._read_one(fd, st, path, bytes(keys[i]), a[rows[i], :chunk_bytes].data,
                                   res, i)
                    seconds[i] += time.perf_counter() - t
            finally:
                for fd, _st, _path in opened.values():
                    _close_quietly(fd)
        res.codec_seconds = self._codec_s
        return res

    def _open_for_load(self, key, row, num_rows: int, res: BatchResult, i: int):
        """Open key's file and start its readahead: (fd, stat, path), or None when key
        i's outcome is already decided (set in ``res``)."""
        bad = self._key_problem(key)
        if bad is None:
            bad = _row_problem(row, num_rows)
        if bad is not None:
            res.set(i, Outcome.INVALID, bad)
            return None
        c = self.counters
        path = self.path_for(bytes(key))
        try:
            # O_NONBLOCK: a FIFO planted at the path must not hang the worker.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
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
            if self.direct_io:
                # set after the checks: O_DIRECT at open would turn EISDIR into EINVAL
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
            elif _FADV_WILLNEED is not None and st.st_size:
                # Asynchronous readahead: the batch's files are read from the device in
                # parallel while earlier ones are being verified.
                os.posix_fadvise(fd, 0, st.st_size, _FADV_WILLNEED)
        except OSError as e:
            _close_quietly(fd)
            c.load_errors += 1
            res.set(i, *errno_outcome(e, "open"))
            return None
        return fd, st, path

    def _read_one(self, fd: int, st: os.stat_result, path: str, key: bytes, out: memoryview,
                  res: BatchResult, i: int) -> None:
        """Read one opened file whole, verify and decode it into ``out``; closes ``fd``."""
        c = self.counters
        size = st.st_size
        chunk_bytes = out.nbytes
        hs = frame_header_size(len(key))
        cap = hs + chunk_bytes + chunk_bytes // 64 + 4096  # frames are never much larger
        reason = None
        try:
            if size < hs or size > cap:
                reason = "length"
            elif self.direct_io:
                frame = self._read_direct(fd, size, cap)
                if frame is None:
                    reason = "length"  # shrank under us: torn
            else:
                frame = self._frame_view(hs, size, cap)
                if _pread_full(fd, frame, size) != size:
                    reason = "length"  # shrank under us: torn
        except OSError as e:
            res.set(i, *errno_outcome(e, "read"))
            c.load_errors += 1
            return
        finally:
            os.close(fd)
        if reason is None:
            try:
                dst = self._decoder.decode_into(frame, key, out)
                self._codec_s += dst.seconds
            except CorruptChunkError as e:
                reason = getattr(e, "reason", None) or "codec"
        if reason is not None:
            self._remove_corrupt(path, st, reason)
            res.set(i, Outcome.CORRUPT, reason)
            res.stored_bytes[i] = size
            return
        res.set(i, Outcome.OK)
        res.logical_bytes[i] = chunk_bytes
        res.stored_bytes[i] = size
        c.files_read += 1
        c.bytes_read += size

    def _read_direct(self, fd: int, size: int, cap: int) -> memoryview | None:
        """O_DIRECT: read the file in whole pages into the page-aligned buffer; the
        frame (``size`` bytes) or None if the file ended early."""
        padded = -(-size // _ALIGN) * _ALIGN
        need = -(-cap // _ALIGN) * _ALIGN + 2 * _ALIGN
        if self._buf is None or self._buf.nbytes < need:
            self._buf = np.empty(max(need, 2 * (self._buf.nbytes if self._buf is not None else 0)),
                                 dtype=np.uint8)
        base = (-self._buf.ctypes.data) % _ALIGN
        view = self._buf[base:base + padded].data
        got = 0
        while got < size:
            k = os.preadv(fd, [view[got:]], got)
            if k <= 0:
                return None
            got += k
        return view[:size]

    def _frame_view(self, hs: int, size: int, cap: int) -> memoryview:
        """A view of ``size`` bytes of the read buffer placed so the payload is page aligned."""
        pad = (-hs) % _ALIGN
        need = pad + cap + _ALIGN
        if self._buf is None or self._buf.nbytes < need:
            self._buf = np.empty(max(need, 2 * (self._buf.nbytes if self._buf is not None else 0)),
                                 dtype=np.uint8)
        base = (-self._buf.ctypes.data) % _ALIGN + pad
        return self._buf[base:base + size].data

    def _remove_corrupt(self, path: str, st: os.stat_result, reason: str) -> None:
        c = self.counters
        c.corrupt_files_detected += 1
        c.corrupt_by_reason[reason] = c.corrupt_by_reason.get(reason, 0) + 1
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return  # re-stored meanwhile by another writer: not the file we judged
            os.unlink(path)
        except FileNotFoundError:
            return  # someone else removed it already
        except OSError:
            c.corrupt_remove_failed += 1
            return
        c.corrupt_files_removed += 1
        c.bytes_on_disk = max(0, c.bytes_on_disk - st.st_size)

    # ------------------------------------------------------------------ delete / probe

    def delete(self, keys: Sequence[bytes]) -> BatchResult:
        """Unlink the chunks of ``keys`` (scheduler-decided eviction). Blocks on the disk.

        Per key: OK (``stored_bytes`` = bytes freed), MISS, ERROR, INVALID. A load
        already reading the file finishes with the old bytes."""
        res = BatchResult.empty("delete", len(keys))
        seconds = res.seconds
        c = self.counters
        for i, key in enumerate(keys):
            t = time.perf_counter()
            try:
                bad = self._key_problem(key)
                if bad is not None:
                    res.set(i, Outcome.INVALID, bad)
                    continue
                path = self.path_for(bytes(key))
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except (FileNotFoundError, NotADirectoryError):
                    res.set(i, Outcome.MISS)
                    continue
                except OSError as e:
                    res.set(i, *errno_outcome(e, "unlink"))
                    continue
                res.set(i, Outcome.OK)
                res.stored_bytes[i] = size
                c.files_deleted += 1
                c.bytes_on_disk = max(0, c.bytes_on_disk - size)
            finally:
                seconds[i] = time.perf_counter() - t
        return res

    def probe(self, keys: Sequence[bytes]) -> BatchResult:
        """Presence by one ``stat`` per key, without reading: OK with ``stored_bytes``
        (present; not verified — a corrupt file is found by ``load``) or MISS."""
        res = BatchResult.empty("probe", len(keys))
        seconds = res.seconds
        for i, key in enumerate(keys):
            t = time.perf_counter()
            try:
                bad = self._key_problem(key)
                if bad is not None:
                    res.set(i, Outcome.INVALID, bad)
                    continue
                try:
                    st = os.stat(self.path_for(bytes(key)))
                except (FileNotFoundError, NotADirectoryError):
                    res.set(i, Outcome.MISS)
                    continue
                except OSError as e:
                    res.set(i, *errno_outcome(e, "stat"))
                    continue
                if stat.S_ISREG(st.st_mode):
                    res.set(i, Outcome.OK)
                    res.stored_bytes[i] = st.st_size
                else:
                    res.set(i, Outcome.MISS)
            finally:
                seconds[i] = time.perf_counter() - t
        return res

    # ------------------------------------------------------------------ scan

    def scan(self) -> Iterator[ScanEntry]:
        """Yield every chunk file of the namespace: ``(key, stored_bytes, mtime)``.

        For the background index rebuild after a (re)start; one ``stat`` per file, no
        reads, so files are not verified (``load`` does that). On the way it removes
        temp files of dead writers (and temp files older than ``stale_temp_age_s``) and
        chunk files sitting in a directory their key does not map to (unreachable by
        ``load``), counting both. Files published during the walk may or may not be
        seen. When the walk completes, ``counters.bytes_on_disk`` is set to the total
        found. Unreadable directories are skipped and counted (``scan_errors``).
        """
        total = 0
        ns = self.namespace_dir
        suffix_len = len(CHUNK_SUFFIX)
        for d1 in self._subdirs(ns, self._w1):
            for d2 in self._subdirs(d1.path, self._w2):
                rel = f"{d1.name}/{d2.name}"
                try:
                    entries = list(os.scandir(d2.path))
                except OSError:
                    self.counters.scan_errors += 1
                    continue
                for e in entries:
                    name = e.name
                    if name.endswith(TEMP_SUFFIX):
                        if name.startswith("."):
                            self._maybe_remove_temp(e)
                        continue
                    if not name.endswith(CHUNK_SUFFIX):
                        continue
                    try:
                        key = bytes.fromhex(name[:-suffix_len])
                    except ValueError:
                        continue
                    if not 0 < len(key) <= MAX_KEY_BYTES:
                        continue
                    if self._rel_dir(key) != rel:
                        self._remove_quietly(e.path, "misplaced_files_removed")
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed meanwhile
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    total += st.st_size
                    yield ScanEntry(key, st.st_size, st.st_mtime)
        self.counters.bytes_on_disk = total

    def remove_stale_temp_files(self) -> int:
        """Walk the namespace only to clean up (``scan`` without the entries); returns the
        number of temp files removed."""
        before = self.counters.temp_files_removed
        for _ in self.scan():
            pass
        return self.counters.temp_files_removed - before

    def _subdirs(self, path: str, width: int):
        try:
            entries = list(os.scandir(path))
        except OSError:
            self.counters.scan_errors += 1
            return
        for e in entries:
            if len(e.name) == width and _is_hex(e.name) and e.is_dir(follow_symlinks=False):
                yield e

    def _maybe_remove_temp(self, entry: os.DirEntry) -> None:
        if self._temp_writer_alive(entry.name):
            try:
                age = time.time() - entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                return
            if age <= self.stale_temp_age_s:
                return
        self._remove_quietly(entry.path, "temp_files_removed")

    def _temp_writer_alive(self, name: str) -> bool:
        """Could the writer of temp file ``name`` still be writing it?

        Same boot and a process with that pid and start time: yes. Same boot, no such
        process: no. Another boot id (a reboot, or another host on a shared filesystem):
        unknown, treated as alive, so only the age rule removes it."""
        try:
            tag = name[1:-len(TEMP_SUFFIX)].rsplit(".", 1)[1]
            boot, pid, started, _seq = tag.split("-")
            pid, started = int(pid), int(started)
        except (IndexError, ValueError):
            return True
        if boot != self._boot_tag:
            return True
        return procinfo.start_time(pid) == started

    def _remove_quietly(self, path: str, counter: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            return
        setattr(self.counters, counter, getattr(self.counters, counter) + 1)

    # ------------------------------------------------------------------ misc

    def close(self) -> None:
        """Drop the read buffer. The backend holds no open descriptors between calls."""
        self._buf = None

    def __repr__(self) -> str:
        return (f"FsBackend({self.namespace_dir!r}, fanout_bits={self.fanout_bits}, "
                f"fsync={self.fsync}, max_bytes={self.max_bytes})")


# ---------------------------------------------------------------------- helpers

def st_capacity(path: str) -> int:
    """Total size of the filesystem holding ``path`` (for the default fan-out)."""
    try:
        v = os.statvfs(path)
    except OSError:
        return 1 << 40
    return v.f_blocks * v.f_frsize


def _available_bytes(path: str) -> int | None:
    try:
        v = os.statvfs(path)
    except OSError:
        return None
    return v.f_bavail * v.f_frsize


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _row_problem(row, num_rows: int) -> str | None:
    """What makes ``row`` INVALID (the detail), or None."""
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        return f"row {row!r} is not an integer"
    if not 0 <= row < num_rows:
        return f"row {row} out of range 0..{num_rows - 1}"
    return None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def probe_direct_io(directory: str) -> bool:
    """Whether ``directory`` takes O_DIRECT: one aligned page written to a probe file
    (as vLLM's fs tier probes). Some network and FUSE filesystems, and tmpfs before
    Linux 6.6, do not."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".direct-probe.{os.getpid()}{TEMP_SUFFIX}")
    page = np.zeros(2 * _ALIGN, dtype=np.uint8)
    base = (-page.ctypes.data) % _ALIGN
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT | _O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        return os.pwrite(fd, page[base:base + _ALIGN].data, 0) == _ALIGN
    except OSError:
        return False
    finally:
        _close_quietly(fd)
        _unlink_quietly(path)


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return s == s.lower()


def _writev_all(fd: int, parts, total: int) -> None:
    """Write all of ``parts``: one writev when the kernel takes it all (as it does for a
    regular file unless out of space or interrupted), else continue after a short write."""
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


def _pread_full(fd: int, view: memoryview, size: int) -> int:
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:size]], got)
        if n == 0:
            break
        got += n
    return got
