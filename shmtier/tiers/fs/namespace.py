"""The ``fs`` tier's on-disk layout: one namespace directory per layout fingerprint.

Runs in: tier worker processes only, on the worker's thread (never on the I/O threads of
``direct_writes.py``: they get their own descriptors). ``FsBackend``
(``backend.py``) holds one ``Namespace``; it and its write and read paths (``store.py``,
``load.py``) reach every file and directory under the namespace through it: never by a
path, always by a name relative to a directory descriptor, without following a
symbolic link (below). Opening a namespace blocks briefly on the filesystem (stat of
the root, mkdir, config.json read or written and fsynced); the entry operations
(``open_entry``, ``stat_entry``, ``unlink_entry``, ``fsync_leaf``) and ``walk`` block
on it too; ``temp_name`` (first call in a process) and ``temp_writer_alive`` read a
``/proc/<pid>/stat``; ``locate``, ``path_for`` and ``rel_dir`` only compute names.
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
the final name (``store.py``); config.json by linking its temp file, in the namespace
directory. Temp files carry the writer's identity (boot id prefix, pid, process start
time), so a scan can tell a dead writer's leftovers (``temp_writer_alive``) from a write
in progress.

Symbolic links: ``root_dir`` is the operator's and may be (or pass through) a link: it
is resolved once, when the namespace is opened (``root_dir`` then holds the resolved
path; a link changed later is not followed to its new target). Below it nothing is
followed: the namespace directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and
held open; each fan-out level is opened relative to its parent's descriptor the same
way (the leaf directories' descriptors are cached, at most ``MAX_OPEN_LEAVES``); chunk,
temp and config files are opened, created, stat'ed, renamed and unlinked relative to
their directory's descriptor with ``O_NOFOLLOW`` (or ``follow_symlinks=False``). A
link anywhere below the root where the layout has a directory or a file raises
``LinkRefused`` (an OSError, errno ELOOP): for that key a load or probe is a MISS and a
store fails; nothing is ever read or written through a link.

A namespace that vanishes (its directory, or the whole root, deleted while workers run):
``sync``, called once per backend call, sees that the path no longer names the directory
held and lets go of it; loads and probes then answer MISS, and the next store makes the
namespace again (config.json with the fan-out recorded before) if the root exists (the
root is the operator's: it is never created, stores fail with ENOENT until it is back).
Every such change bumps ``generation`` (the backend reports it to the scheduler half); the
process that makes the namespace again logs it once (WARNING, with the path).

Recovery (when the namespace is retried): nothing is remembered as broken. Every store
calls ``sync(create=True)``, which, while no directory is held, tries again to open or
make the namespace: the root gone (ENOENT), the filesystem full while config.json is
written (ENOSPC, EDQUOT: the half-made directory is removed), a link or a file at its
path. So the first store after the operator recreated the root or freed space makes it;
loads and probes answer MISS meanwhile. Each such failure is logged once per change of
state (WARNING, naming the path and the errno; again only after the namespace was usable
in between or the reason changed), never per store or per chunk. A worker that starts
while the namespace cannot be made for a reason of the medium's state (the root gone,
the filesystem full: ``defer=True``, what tier workers use) starts without it and makes
it at its first store, so a worker restarted during such an outage does not fail to
start (a pool whose workers fail to start breaks for good). A symbolic link or a plain
file where the namespace directory goes is such an outage too (issue 28): the link is
refused (loads and probes MISS, stores fail with ``ELOOP`` or ``ENOTDIR``, logged once),
a worker starts anyway, and the namespace is used again once the path is free (made at
the next store) or a directory. A namespace directory whose config.json names another
fingerprint or format is not an outage: it is someone else's, and opening it fails.

Size (over 600 lines): the namespace's creation, adoption, reset and link checks act on
one directory's states and must agree on them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import time
from collections import OrderedDict
from typing import Callable, Iterator, TypeVar

from shmtier.shared import procinfo
from shmtier.storage.chunk_names import (  # noqa: F401 (re-exported: one source of truth)
    CHUNK_SUFFIX,
    MAX_KEY_BYTES,
    NAMESPACE_PREFIX,
    chunk_key,
    chunk_name,
    key_problem,
    namespace_dir_name,
)
from shmtier.tiers.fs.fileio import (
    O_CLOEXEC,
    O_DIRECTORY,
    O_NOFOLLOW,
    close_quietly,
    is_hex,
    st_capacity,
    unlink_quietly,
    writev_all,
)

logger = logging.getLogger(__name__)

FORMAT_NAME = "shmtier-fs"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TEMP_SUFFIX = ".tmp"
CONFIG_TEMP_STEM = "config"  # config.json's temp file: ``.config.<writer>-<seq>.tmp``
FILES_PER_LEAF_DIR = 512
MIN_FANOUT_BITS, MAX_FANOUT_BITS = 2, 16
#: Leaf directory descriptors a namespace keeps open (least recently used closed first).
MAX_OPEN_LEAVES = 128
#: Errnos of the medium's state that a deferred open (``Namespace(defer=True)``) waits
#: out: the root gone, the filesystem or quota full. (A link or a file at the namespace
#: path is waited out too: ``_in_the_way``.)
DEFERRABLE = (errno.ENOENT, errno.ENOSPC, errno.EDQUOT)
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT)

_DIR_FLAGS = os.O_RDONLY | O_DIRECTORY
_T = TypeVar("_T")


def _in_the_way(e: OSError) -> bool:
    """Whether ``e`` (raised opening the namespace of a root that exists) says that a
    link or a file sits where the namespace directory goes: an outage a deferred open
    waits out like the root gone (``Namespace(defer=True)``), not a reason to fail."""
    return isinstance(e, LinkRefused) or e.errno == errno.ENOTDIR


class LinkRefused(OSError):
    """A symbolic link where the namespace layout has a directory or a file of its own.
    Never followed; errno ELOOP, the text names the link."""

    def __init__(self, where: str):
        super().__init__(errno.ELOOP, f"symbolic link refused: {where}")


def open_nofollow(name: str, flags: int, dir_fd: int, where: str, mode: int = 0o600) -> int:
    """``openat(dir_fd, name, flags | O_NOFOLLOW | O_CLOEXEC)``; ``LinkRefused`` (naming
    ``where``) when ``name`` is a symbolic link, else the OSError of the open."""
    try:
        return os.open(name, flags | O_NOFOLLOW | O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        # a link's open fails with ELOOP, or ENOTDIR when O_DIRECTORY is asked for
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                raise e from None
            if stat.S_ISLNK(st.st_mode):
                raise LinkRefused(where) from None
        raise


def read_config(fd: int, path: str) -> dict | None:
    """The config.json of the namespace directory open as ``fd`` (``path`` names it in
    errors), or None when there is none. Never follows a link: ValueError for a link, for
    a file that is not JSON or not a JSON object."""
    try:
        cfd = open_nofollow(CONFIG_NAME, os.O_RDONLY | os.O_NONBLOCK, fd, path)
    except FileNotFoundError:
        return None
    except LinkRefused:
        raise ValueError(f"fs tier namespace config is a symbolic link (refused): "
                         f"{path}") from None
    with open(cfd, "rb") as f:
        raw = f.read()
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"fs tier namespace config is not valid JSON: {path} ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"fs tier namespace config is not a JSON object: {path}")
    return cfg


def choose_fanout_bits(capacity_bytes: int, chunk_bytes_hint: int) -> tuple[int, int]:
    """Fan-out widths (bits of level 1, level 2) for an expected capacity.

    About ``FILES_PER_LEAF_DIR`` files per leaf directory when full, 2..16 bits in all,
    split as evenly as possible (level 1 gets the odd bit)."""
    files = max(1, capacity_bytes // max(1, chunk_bytes_hint))
    leaves = max(1, files // FILES_PER_LEAF_DIR)
    total = min(MAX_FANOUT_BITS, max(MIN_FANOUT_BITS, (leaves - 1).bit_length()))
    return (total + 1) // 2, total // 2


class Namespace:
    """The namespace directory of one layout fingerprint under ``root_dir``.

    Construction resolves and stats the root, creates the namespace directory and its
    config.json if absent (the fan-out then comes from ``capacity_bytes``, else the root
    filesystem's size, and ``chunk_bytes_hint``), opens the directory (held until
    ``close``) and reads the recorded fan-out; it does not walk the tree. With
    ``create=False`` (tools: ``open_existing``) nothing is created: a missing directory or
    config.json raises FileNotFoundError. Raises
    FileNotFoundError / NotADirectoryError for a missing root, ``LinkRefused`` when the
    namespace path is a symbolic link, ValueError for a config.json that names another
    fingerprint or format, is malformed or is a link, OSError when the namespace cannot
    be created. With ``defer`` (and ``create``), a root that does not exist and a
    namespace that cannot be made for want of space (``DEFERRABLE``) raise nothing, nor
    does a link or a file at the namespace path (the root itself must be a directory):
    the namespace starts with no directory held (``fd`` -1, ``fanout_bits`` None; logged
    once) and the first ``sync(create=True)`` that can makes or opens it (a link is
    never followed meanwhile: ``sync`` refuses it each time). Not thread-safe (one per
    worker process).
    """

    def __init__(self, root_dir: str, fingerprint: str, *, capacity_bytes: int | None,
                 chunk_bytes_hint: int, fsync: bool, create: bool = True,
                 defer: bool = False):
        root = os.path.realpath(os.path.abspath(os.fspath(root_dir)))  # resolved once
        self.root_dir = root
        self.fingerprint = fingerprint
        self.fsync = fsync  # fsync parents of new fan-out directories
        self.name = namespace_dir_name(fingerprint)
        self.dir = os.path.join(root, self.name)
        self._fd = -1
        self._id: tuple[int, int] | None = None  # (st_dev, st_ino) of the directory held
        self._leaves: OrderedDict[str, int] = OrderedDict()  # rel -> leaf directory fd
        #: Changes of the directory at the namespace path seen since opening (removed,
        #: replaced, made again): the namespace's chunks before a change may be gone.
        self.generation = 0
        #: The recorded fan-out (level 1, level 2 bits); None before the namespace was
        #: first opened (a deferred open).
        self.fanout_bits: tuple[int, int] | None = None
        self._capacity_bytes, self._chunk_bytes_hint = capacity_bytes, chunk_bytes_hint
        #: Why the namespace could not be made or opened, as last logged (None: usable,
        #: or not tried since it was): one WARNING per change of state.
        self._unusable: tuple[int, str] | None = None
        # the writer's identity in temp file names (``temp_name``): set before the first
        # attach, which may write config.json's
        self._seq = 0
        self._writer_pid = -1
        self._writer_tag = ""
        self._boot_tag = procinfo.boot_id()[:4].hex()
        created = False
        root_ok = False
        try:
            self._check_root()
            root_ok = True
            fd, bits, created = self._attach(self._default_fanout(), create=create)
        except OSError as e:
            if not (defer and create and (e.errno in DEFERRABLE
                                          or (root_ok and _in_the_way(e)))):
                raise
            self._note_unusable(e)
        else:
            self._adopt(fd, bits)
        #: This process made the namespace directory when it opened it: a namespace that
        #: was deleted while no worker held it (all of them restarting) is found only so.
        self.created_at_open = created

    def _check_root(self) -> None:
        """FileNotFoundError / NotADirectoryError unless the root is a directory now."""
        try:
            st = os.stat(self.root_dir)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"fs tier root_dir does not exist (create it first): "
                              f"{self.root_dir}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"fs tier root_dir is not a directory: "
                                                    f"{self.root_dir}")

    def _default_fanout(self) -> tuple[int, int]:
        """The fan-out a namespace made now gets (``capacity_bytes``, else the size of
        the root's filesystem, and ``chunk_bytes_hint``)."""
        capacity = (self._capacity_bytes if self._capacity_bytes is not None
                    else st_capacity(self.root_dir))
        return choose_fanout_bits(capacity, self._chunk_bytes_hint)

    def _note_unusable(self, e: OSError) -> None:
        """Log, once per change of state, why the namespace cannot be made or opened now."""
        why = (e.errno or 0, str(e))
        if why == self._unusable:
            return
        self._unusable = why
        logger.warning("fs tier namespace %s cannot be made or opened now (%s: %s): stores "
                       "fail until it can; each store tries again (logged once until it "
                       "works or the reason changes)", self.dir,
                       errno.errorcode.get(why[0], why[0]), e.strerror or e)

    @property
    def fd(self) -> int:
        """The namespace directory's descriptor (-1 once closed, or none held now)."""
        return self._fd

    def close(self) -> None:
        """Close the namespace directory's and the cached leaf directories' descriptors."""
        self._forget_leaves()
        if self._fd >= 0:
            close_quietly(self._fd)
            self._fd = -1
            self._id = None

    def sync(self, *, create: bool) -> None:
        """Make sure the directory held is still the one at the namespace path (one
        ``lstat`` when it is). When it is not (removed, replaced, or held no more), let go
        of it and use what is there now: a directory is opened (its config.json read, or
        written with the recorded fan-out if absent); nothing there and ``create``: the
        namespace is made again, if the root exists. Each change bumps ``generation``.

        Raises FileNotFoundError when there is no namespace now (none there and not
        ``create``, or the root is gone), ``LinkRefused`` / NotADirectoryError when a
        link or a file sits at the namespace path, OSError (EINVAL for a config.json
        that names another fingerprint or is malformed) when it cannot be used."""
        try:
            st = os.stat(self.dir, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is not None and self._fd >= 0 and (st.st_dev, st.st_ino) == self._id:
            return  # the common case
        if self._fd >= 0:
            logger.info("fs tier namespace %s: the directory held was removed or replaced",
                        self.dir)
            self.close()
            self.generation += 1
        if st is None and not create:
            raise FileNotFoundError(errno.ENOENT, f"fs tier namespace is gone: {self.dir}")
        try:
            fd, bits, created = self._reopen(st, create)
        except OSError as e:
            if create:
                self._note_unusable(e)
            raise
        self._unusable = None
        self._adopt(fd, bits)
        self.generation += 1
        if created:
            logger.warning("fs tier namespace %s was gone; recreated it (fan-out bits %s): "
                           "the chunks stored in it before are lost", self.dir, bits)
        else:
            logger.info("fs tier namespace %s: using the directory now there", self.dir)

    def _reopen(self, st: os.stat_result | None,
                create: bool) -> tuple[int, tuple[int, int], bool]:
        """``_attach`` for ``sync``: what is at the namespace path now (``st``, None:
        nothing) opened, or made when absent and ``create`` (the root must exist)."""
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise LinkRefused(f"fs tier namespace {self.dir}")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(
                errno.ENOTDIR, f"fs tier namespace path is not a directory: {self.dir}")
        if st is None and not os.path.isdir(self.root_dir):
            raise FileNotFoundError(
                errno.ENOENT, f"fs tier root_dir is gone: {self.root_dir} (not recreated "
                              f"by the tier)")
        try:
            return self._attach(self.fanout_bits or self._default_fanout(), create=create)
        except ValueError as e:
            raise OSError(errno.EINVAL, str(e)) from None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ config.json

    def _attach(self, fanout_default: tuple[int, int], *,
                create: bool) -> tuple[int, tuple[int, int], bool]:
        """Open the namespace directory (making it and its config.json first if absent
        and ``create``): ``(fd, recorded fan-out, whether this call made the directory)``."""
        root_fd = os.open(self.root_dir, _DIR_FLAGS | O_CLOEXEC)  # the operator's: followed
        try:
            created = False
            if create:
                try:
                    os.mkdir(self.name, 0o700, dir_fd=root_fd)
                    created = True
                except FileExistsError:
                    pass
            try:
                fd = open_nofollow(self.name, _DIR_FLAGS, root_fd, f"fs tier namespace {self.dir}")
            except NotADirectoryError:
                raise NotADirectoryError(errno.ENOTDIR, f"fs tier namespace path is not a "
                                                        f"directory: {self.dir}") from None
            try:
                bits = self._config(fd, fanout_default, create=create)
            except BaseException as e:
                close_quietly(fd)
                # Nothing half-made is left: the directory goes if this call made it, or if
                # config.json could not be written for space (another worker made it and
                # could not finish either: its rmdir may have met this call's temp file).
                # rmdir removes only an empty directory; a creator racing this one sees
                # the directory it holds vanish at its next ``sync``.
                if created or (isinstance(e, OSError) and e.errno in _SPACE_ERRORS):
                    try:
                        os.rmdir(self.name, dir_fd=root_fd)
                    except OSError:
                        pass
                raise
            return fd, bits, created
        finally:
            os.close(root_fd)

    def _config(self, fd: int, fanout_default: tuple[int, int], *,
                create: bool = True) -> tuple[int, int]:
        cfg = self._read_config(fd)
        if cfg is None and not create:
            raise FileNotFoundError(errno.ENOENT, f"fs tier namespace has no {CONFIG_NAME}: "
                                                  f"{self.dir}")
        if cfg is None:
            self._write_config(fd, fanout_default)
            cfg = self._read_config(fd)  # a racing creator may have won: its file rules
            if cfg is None:
                raise OSError(errno.EIO, f"fs tier config vanished after writing it: "
                                         f"{os.path.join(self.dir, CONFIG_NAME)}")
        return self._check_config(os.path.join(self.dir, CONFIG_NAME), cfg)

    def _read_config(self, fd: int) -> dict | None:
        return read_config(fd, os.path.join(self.dir, CONFIG_NAME))

    @classmethod
    def open_existing(cls, root_dir: str, dir_name: str) -> "Namespace":
        """The namespace directory ``dir_name`` under ``root_dir`` as it is, for tools
        (``shmtier fsck``, ``shmtier clean --root``): its fingerprint is read from its
        config.json, which must name the fingerprint the directory is named after.
        Creates nothing. Raises FileNotFoundError (no such directory, or no
        config.json), ``LinkRefused`` (a link at its path), NotADirectoryError, ValueError
        (config.json malformed, another format, or a fingerprint of another name)."""
        root = os.path.realpath(os.path.abspath(os.fspath(root_dir)))
        path = os.path.join(root, dir_name)
        root_fd = os.open(root, _DIR_FLAGS | O_CLOEXEC)
        try:
            fd = open_nofollow(dir_name, _DIR_FLAGS, root_fd, f"fs tier namespace {path}")
        finally:
            os.close(root_fd)
        try:
            cfg = read_config(fd, os.path.join(path, CONFIG_NAME))
        finally:
            os.close(fd)
        if cfg is None:
            raise FileNotFoundError(errno.ENOENT, f"fs tier namespace has no {CONFIG_NAME}: "
                                                  f"{path}")
        fingerprint = cfg.get("fingerprint")
        if not isinstance(fingerprint, str) or namespace_dir_name(fingerprint) != dir_name:
            raise ValueError(f"fs tier namespace {path}: its {CONFIG_NAME} names fingerprint "
                             f"{fingerprint!r}, which is not the directory's")
        return cls(root, fingerprint, capacity_bytes=1, chunk_bytes_hint=1, fsync=False,
                   create=False)

    def _write_config(self, fd: int, fanout: tuple[int, int]) -> None:
        cfg = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "fanout_bits": list(fanout),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        data = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        # named as a chunk's temp file (the writer's identity in it): the tier's scan and
        # fsck remove it once its writer is dead (a worker killed while making the
        # namespace), as they do chunk temp files
        tmp = self.temp_name(CONFIG_TEMP_STEM)
        tfd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fd,
                            os.path.join(self.dir, tmp))
        try:
            try:
                writev_all(tfd, [data], len(data))
                os.fsync(tfd)
            finally:
                os.close(tfd)
            try:
                # link() publishes only if absent: a racing creator's file is kept.
                os.link(tmp, CONFIG_NAME, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
        finally:
            unlink_quietly(tmp, dir_fd=fd)
        os.fsync(fd)

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

    def _adopt(self, fd: int, bits: tuple[int, int]) -> None:
        """Use the namespace directory open as ``fd`` with fan-out ``bits``."""
        self._forget_leaves()
        if self._fd >= 0:
            close_quietly(self._fd)
        self._fd = fd
        st = os.fstat(fd)
        self._id = (st.st_dev, st.st_ino)
        self.fanout_bits = bits
        b1, b2 = bits
        self._shift1, self._shift2, self._mask2 = 32 - b1, 32 - b1 - b2, (1 << b2) - 1
        self._w1, self._w2 = (b1 + 3) // 4, (b2 + 3) // 4

    # ------------------------------------------------------------------ names

    def rel_dir(self, key: bytes) -> str:
        """``"<d1>/<d2>"``: the leaf directory of ``key``, relative to the namespace."""
        v = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big")
        return f"{v >> self._shift1:0{self._w1}x}/{(v >> self._shift2) & self._mask2:0{self._w2}x}"

    def locate(self, key: bytes) -> tuple[str, str]:
        """``(rel, name)``: ``key``'s leaf directory relative to the namespace, and its
        chunk file's name in it (the arguments of the entry operations)."""
        return self.rel_dir(key), chunk_name(key)

    def path_for(self, key: bytes) -> str:
        """The path of the file that holds (or would hold) ``key``'s chunk (for messages
        and tests: the backend itself never opens a path)."""
        rel, name = self.locate(key)
        return os.path.join(self.dir, rel, name)

    def temp_name(self, key_hex: str) -> str:
        """``.<key hex[:16]>.<boot>-<pid>-<start>-<seq>.tmp``, unique to this process
        (``key_hex`` is ``CONFIG_TEMP_STEM`` for config.json's)."""
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

    def temp_orphaned(self, name: str, mtime: float, stale_age_s: float) -> bool:
        """Is temp file ``name`` (modified at ``mtime``, epoch s) a leftover nobody will
        finish? Its writer is dead (``temp_writer_alive``), or it is older than
        ``stale_age_s`` (a writer of another boot or host, or one hung that long). The
        rule of the tier's scan and of ``shmtier fsck`` / ``clean --root``."""
        return not self.temp_writer_alive(name) or time.time() - mtime > stale_age_s

    # ------------------------------------------------------------------ directories

    def _leaf(self, rel: str, create: bool) -> tuple[int, bool]:
        """``(fd, cached)``: leaf directory ``rel`` opened level by level without following
        links (made first, fsyncing its parent when ``fsync``, if absent and ``create``);
        ``cached``: the descriptor came from the cache. FileNotFoundError when absent
        (and not ``create``), ``LinkRefused`` for a link on the way."""
        leaves = self._leaves
        fd = leaves.get(rel)
        if fd is not None:
            leaves.move_to_end(rel)
            return fd, True
        if self._fd < 0:
            raise FileNotFoundError(errno.ENOENT, f"fs tier namespace is not open: {self.dir}")
        d1, d2 = rel.split("/", 1)
        fd1 = self._subdir(self._fd, d1, create, d1)
        try:
            fd = self._subdir(fd1, d2, create, rel)
        finally:
            os.close(fd1)
        leaves[rel] = fd
        if len(leaves) > MAX_OPEN_LEAVES:
            close_quietly(leaves.popitem(last=False)[1])
        return fd, False

    def _subdir(self, parent_fd: int, name: str, create: bool, rel: str) -> int:
        where = os.path.join(self.dir, rel)
        try:
            return open_nofollow(name, _DIR_FLAGS, parent_fd, where)
        except FileNotFoundError:
            if not create:
                raise
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        else:
            if self.fsync:
                os.fsync(parent_fd)
        return open_nofollow(name, _DIR_FLAGS, parent_fd, where)

    def _leaf_current(self, rel: str, fd: int) -> bool:
        """Whether cached descriptor ``fd`` is still the directory named ``rel``."""
        try:
            held = os.fstat(fd)
            now = os.stat(rel, dir_fd=self._fd, follow_symlinks=False)
        except OSError:
            return False
        return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)

    def _forget_leaf(self, rel: str) -> None:
        fd = self._leaves.pop(rel, None)
        if fd is not None:
            close_quietly(fd)

    def _forget_leaves(self) -> None:
        while self._leaves:
            close_quietly(self._leaves.popitem()[1])

    def in_leaf(self, rel: str, op: Callable[[int], _T], *, create: bool = False) -> _T:
        """``op(fd)`` with leaf directory ``rel``'s descriptor (see ``_leaf``). ``op`` must
        be one call that has no effect when it fails (an open, a stat, an unlink): when it
        raises FileNotFoundError on a cached descriptor whose directory was removed or
        replaced meanwhile, it is run once more on the directory now at ``rel``."""
        fd, cached = self._leaf(rel, create)
        try:
            return op(fd)
        except FileNotFoundError:
            if not cached or self._leaf_current(rel, fd):
                raise
        self._forget_leaf(rel)
        fd, _ = self._leaf(rel, create)
        return op(fd)

    def open_entry(self, rel: str, name: str, flags: int, *, create_dirs: bool = False,
                   mode: int = 0o600) -> tuple[int, int]:
        """Open (or with ``O_CREAT`` create) file ``name`` of leaf directory ``rel``
        without following a link: ``(fd, leaf directory fd)``. The leaf's descriptor
        stays valid until the next entry operation (rename and unlink relative to it)."""
        where = os.path.join(self.dir, rel, name)
        return self.in_leaf(rel, lambda d: (open_nofollow(name, flags, d, where, mode), d),
                            create=create_dirs)

    def stat_entry(self, rel: str, name: str) -> os.stat_result:
        """``lstat`` of entry ``name`` of leaf directory ``rel`` (a link is reported as
        one, never followed); FileNotFoundError when it or its directory is absent."""
        return self.in_leaf(rel, lambda d: os.stat(name, dir_fd=d, follow_symlinks=False))

    def unlink_entry(self, rel: str, name: str) -> None:
        """Unlink entry ``name`` of leaf directory ``rel`` (a link itself, never its target)."""
        self.in_leaf(rel, lambda d: os.unlink(name, dir_fd=d))

    def unlink_entry_if_same(self, rel: str, name: str, st: os.stat_result) -> bool:
        """Unlink entry ``name`` of leaf directory ``rel`` only if it is still the file
        ``st`` describes (device and inode): one made again under the name meanwhile (a
        concurrent store of the key) is kept. True when this call removed it, False when
        it was gone or replaced; other OSErrors (EROFS, EACCES) propagate."""
        def unlink_same(d: int) -> bool:
            now = os.stat(name, dir_fd=d, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False
            os.unlink(name, dir_fd=d)
            return True

        try:
            return self.in_leaf(rel, unlink_same)
        except FileNotFoundError:
            return False

    def fsync_leaf(self, rel: str) -> None:
        """fsync leaf directory ``rel`` (makes the entries created or renamed in it durable)."""
        os.fsync(self._leaf(rel, False)[0])

    def walk(self, on_error: Callable[[], None], on_link: Callable[[], None],
             on_other: Callable[[int, str, os.DirEntry], None] | None = None,
             ) -> Iterator[tuple[str, int, list[os.DirEntry]]]:
        """``(rel, fd, entries)`` for every leaf directory (fan-out names only): its
        descriptor (valid until the next item) and its entries, listed through it.
        Nothing is followed: ``on_link()`` once per link in place of a fan-out
        directory, ``on_error()`` once per directory that cannot be listed (skipped).
        ``on_other(fd, rel, entry)``: each entry of the namespace directory (``rel``
        "") and of a first-level fan-out directory (``rel`` its name) that is not a
        fan-out directory of the layout, config.json apart, with its directory's
        descriptor (valid during the call): what ``shmtier fsck`` judges."""
        if self._fd < 0:
            return
        top = None if on_other is None else (
            lambda e: e.name != CONFIG_NAME and on_other(self._fd, "", e))
        for d1 in self._subdirs(self._fd, self._w1, on_error, on_link, top):
            fd1 = self._open_listed(self._fd, d1, d1, on_error, on_link)
            if fd1 is None:
                continue
            try:
                mid = None if on_other is None else (
                    lambda e, fd1=fd1, d1=d1: on_other(fd1, d1, e))
                for d2 in self._subdirs(fd1, self._w2, on_error, on_link, mid):
                    rel = f"{d1}/{d2}"
                    fd2 = self._open_listed(fd1, d2, rel, on_error, on_link)
                    if fd2 is None:
                        continue
                    try:
                        try:
                            entries = list(os.scandir(fd2))
                        except OSError:
                            on_error()
                            continue
                        yield rel, fd2, entries
                    finally:
                        os.close(fd2)
            finally:
                os.close(fd1)

    def _open_listed(self, parent_fd: int, name: str, rel: str, on_error: Callable[[], None],
                     on_link: Callable[[], None]) -> int | None:
        try:
            return open_nofollow(name, _DIR_FLAGS, parent_fd, os.path.join(self.dir, rel))
        except LinkRefused:  # replaced by a link since it was listed
            on_link()
        except FileNotFoundError:
            pass  # removed since it was listed
        except OSError:
            on_error()
        return None

    @staticmethod
    def _subdirs(fd: int, width: int, on_error: Callable[[], None],
                 on_link: Callable[[], None],
                 on_other: Callable[[os.DirEntry], None] | None = None) -> Iterator[str]:
        try:
            entries = list(os.scandir(fd))
        except OSError:
            on_error()
            return
        for e in entries:
            if len(e.name) == width and is_hex(e.name):
                if e.is_symlink():
                    on_link()
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        yield e.name
                        continue
                except OSError:
                    pass
            if on_other is not None:
                on_other(e)
