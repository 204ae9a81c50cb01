"""The ``fs`` tier's on-disk layout: one namespace directory per layout fingerprint.

Runs in: tier worker processes only, on the worker's single thread. ``FsBackend``
(``backend.py``) holds one ``Namespace``; it and its write and read paths (``store.py``,
``load.py``) ask it for every path they open, stat, rename or unlink, so that path
construction lives here alone (a planned change opens them relative to directory
descriptors with ``O_NOFOLLOW``). Opening a namespace blocks briefly on the filesystem
(stat of the root, mkdir, config.json read or written and fsynced); ``ensure_dir`` and
``walk`` block on it too; ``temp_name`` (first call in a process) and
``temp_writer_alive`` read a ``/proc/<pid>/stat``; the other methods only compute names.
The module-level functions are pure (tests use them too).

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

A chunk is published by writing a temp file in its final directory and renaming it over
the final name (``store.py``). Temp files carry the writer's identity (boot id prefix,
pid, process start time), so a scan can tell a dead writer's leftovers
(``temp_writer_alive``) from a write in progress.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from typing import Callable, Iterator

from shmtier.shared import procinfo
from shmtier.tiers.fs.fileio import O_CLOEXEC, fsync_dir, is_hex, st_capacity, unlink_quietly, writev_all

FORMAT_NAME = "shmtier-fs"
FORMAT_VERSION = 1
NAMESPACE_PREFIX = "shmtier-"
CONFIG_NAME = "config.json"
CHUNK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
#: Longest key accepted: its hex name (200 chars + suffix) stays under NAME_MAX (255).
MAX_KEY_BYTES = 100
FILES_PER_LEAF_DIR = 512
MIN_FANOUT_BITS, MAX_FANOUT_BITS = 2, 16


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


def key_problem(key) -> str | None:
    """What makes ``key`` unusable as a chunk name (the INVALID detail), or None."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        return f"key is {type(key).__name__}, not bytes"
    n = len(key)
    if not 0 < n <= MAX_KEY_BYTES:
        return f"key length {n} (must be 1..{MAX_KEY_BYTES})"
    return None


def chunk_key(name: str) -> bytes | None:
    """The key a chunk file name ``<key hex>.kv`` stands for, or None for any other name."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    try:
        key = bytes.fromhex(name[:-len(CHUNK_SUFFIX)])
    except ValueError:
        return None
    return key if 0 < len(key) <= MAX_KEY_BYTES else None


class Namespace:
    """The namespace directory of one layout fingerprint under ``root_dir``.

    Construction stats the root, creates the namespace directory and its config.json if
    absent (the fan-out then comes from ``capacity_bytes``, else the root filesystem's
    size, and ``chunk_bytes_hint``) and reads the recorded fan-out; it does not walk the
    tree. Raises FileNotFoundError / NotADirectoryError for a missing root, ValueError
    for a config.json that names another fingerprint or format or is malformed, OSError
    when the namespace cannot be created. Not thread-safe (one per worker process).
    """

    def __init__(self, root_dir: str, fingerprint: str, *, capacity_bytes: int | None,
                 chunk_bytes_hint: int, fsync: bool):
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
        self.fingerprint = fingerprint
        self.fsync = fsync  # fsync parents of new fan-out directories
        self.dir = os.path.join(root, namespace_dir_name(fingerprint))
        capacity = capacity_bytes if capacity_bytes is not None else st_capacity(root)
        self.fanout_bits = self._open(choose_fanout_bits(capacity, chunk_bytes_hint))
        b1, b2 = self.fanout_bits
        self._shift1, self._shift2, self._mask2 = 32 - b1, 32 - b1 - b2, (1 << b2) - 1
        self._w1, self._w2 = (b1 + 3) // 4, (b2 + 3) // 4
        self._known_dirs: set[str] = set()
        self._seq = 0
        self._writer_pid = -1
        self._writer_tag = ""
        self._boot_tag = procinfo.boot_id()[:4].hex()

    # ------------------------------------------------------------------ config.json

    def _open(self, fanout_default: tuple[int, int]) -> tuple[int, int]:
        ns = self.dir
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600)
        try:
            try:
                writev_all(fd, [data], len(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                # link() publishes only if absent: a racing creator's file is kept.
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            unlink_quietly(tmp)
        fsync_dir(self.dir)

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

    def rel_dir(self, key: bytes) -> str:
        """``"<d1>/<d2>"``: the leaf directory of ``key``, relative to the namespace."""
        v = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big")
        return f"{v >> self._shift1:0{self._w1}x}/{(v >> self._shift2) & self._mask2:0{self._w2}x}"

    def locate(self, key: bytes) -> tuple[str, str, str]:
        """``(rel, leaf, path)``: ``key``'s leaf directory relative to the namespace and
        as a path, and its chunk file's path."""
        rel = self.rel_dir(key)
        leaf = os.path.join(self.dir, rel)
        return rel, leaf, os.path.join(leaf, key.hex() + CHUNK_SUFFIX)

    def path_for(self, key: bytes) -> str:
        """The file that holds (or would hold) ``key``'s chunk."""
        return self.locate(key)[2]

    def temp_path(self, leaf: str, key_hex: str) -> str:
        """A new temp file name in ``leaf`` for a write of ``key_hex``'s chunk by this process."""
        return os.path.join(leaf, self.temp_name(key_hex))

    def temp_name(self, key_hex: str) -> str:
        """``.<key hex[:16]>.<boot>-<pid>-<start>-<seq>.tmp``, unique to this process."""
        pid = os.getpid()
        if pid != self._writer_pid:  # first use, or a fork
            _, started = procinfo.me()
            self._writer_pid, self._writer_tag = pid, f"{self._boot_tag}-{pid}-{started}"
        self._seq += 1
        return f".{key_hex[:16]}.{self._writer_tag}-{self._seq}{TEMP_SUFFIX}"

    def temp_writer_alive(self, name: str) -> bool:
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

    # ------------------------------------------------------------------ directories

    def ensure_dir(self, rel: str, *, recheck: bool = False) -> None:
        """Create leaf directory ``rel`` and its parent if absent (fsyncing their parents
        when ``fsync``). Remembered once made: a no-op after that unless ``recheck``
        (the directory was removed behind our back)."""
        if rel in self._known_dirs and not recheck:
            return
        d1 = os.path.join(self.dir, rel.split("/", 1)[0])
        leaf = os.path.join(self.dir, rel)
        for d, parent in ((d1, self.dir), (leaf, d1)):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue
            if self.fsync:
                fsync_dir(parent)
        self._known_dirs.add(rel)

    def walk(self, on_error: Callable[[], None]) -> Iterator[tuple[str, list[os.DirEntry]]]:
        """``(rel, entries)`` for every leaf directory (fan-out names only, no symlinks
        followed); ``on_error()`` once per directory that cannot be listed (skipped)."""
        for d1 in self._subdirs(self.dir, self._w1, on_error):
            for d2 in self._subdirs(d1.path, self._w2, on_error):
                try:
                    entries = list(os.scandir(d2.path))
                except OSError:
                    on_error()
                    continue
                yield f"{d1.name}/{d2.name}", entries

    @staticmethod
    def _subdirs(path: str, width: int, on_error: Callable[[], None]) -> Iterator[os.DirEntry]:
        try:
            entries = list(os.scandir(path))
        except OSError:
            on_error()
            return
        for e in entries:
            if len(e.name) == width and is_hex(e.name) and e.is_dir(follow_symlinks=False):
                yield e
