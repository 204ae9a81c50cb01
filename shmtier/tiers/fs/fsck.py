"""``shmtier fsck ROOT`` and ``shmtier clean --root ROOT``: check (and repair) an fs tier
root while engines use it.

Runs in: the ``shmtier`` CLI's process. Blocks on the filesystem (one listing per
directory, per chunk an open, an fstat and one read of its header, or of the whole file
with ``verify``).

What it walks is the tier's own layout, through the tier's own code: namespace
directories (``shmtier-<hex>`` with a config.json, opened by ``Namespace.open_existing``),
their fan-out directories (``Namespace.walk``), chunk names (``chunk_names.chunk_key``,
``Namespace.rel_dir``), temp files (``Namespace.temp_orphaned``, the rule of the tier's
own scan) and frames (``shmtier.storage.fsck.FrameCheck``: the codec's checks, and the
chunk size the namespace's fingerprint names). Anything
beside the namespace directories under the root (vLLM's own fs tier files, anyone
else's) is counted and never looked into or touched.

Safe while engines use the root: nothing is followed (every entry is opened, stat'ed and
unlinked relative to its directory's descriptor with ``O_NOFOLLOW``); a file that
vanishes mid-walk is skipped and one that appears may or may not be seen; temp files of
live writers are left alone (a chunk is published by renaming a complete temp file, so
a chunk file is never half-written by a live writer); a bad chunk is removed only if its
name still names the inode that was judged (as the tier's load does: a chunk re-stored
meanwhile is kept). A chunk removed is only a miss for an engine (its index drops the
key when a load finds no file).
"""

from __future__ import annotations

import errno
import os
import stat

from shmtier.storage.chunk_names import chunk_key, is_namespace_name, mac_id_of
from shmtier.storage.fsck import (
    FrameCheck,
    FsckError,
    FsckReport,
    NamespaceReport,
    layout_chunk_bytes,
)
from shmtier.tiers.fs.backend import DEFAULT_STALE_TEMP_AGE_S
from shmtier.tiers.fs.fileio import O_CLOEXEC, close_quietly, pread_full
from shmtier.tiers.fs.load import chunk_file_cap
from shmtier.tiers.fs.namespace import TEMP_SUFFIX, LinkRefused, Namespace, open_nofollow

def fsck_root(root: str, *, verify: bool = False, repair: bool | set[str] = False,
              mac_key: bytes | None = None,
              stale_temp_age_s: float = DEFAULT_STALE_TEMP_AGE_S) -> FsckReport:
    """Check every namespace under fs tier root ``root``; with ``repair`` (True, or the
    set of problem kinds to repair) remove what is bad and removable. ``verify``: decode
    every chunk (CRCs; the MAC too for a namespace of ``mac_key``), not only its header.
    Raises :class:`FsckError` when ``root`` cannot be listed."""
    path = os.path.realpath(os.path.abspath(os.fspath(root)))
    kinds = None if repair is True else set(repair or ())
    report = FsckReport("fs", path, verify, bool(repair))
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            raise FsckError(f"{path} is not a directory")
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as e:
        raise FsckError(f"cannot list {path}: {e.strerror or e}") from None
    for entry in entries:
        if not is_namespace_name(entry.name):
            report.other_entries += 1
            continue
        if entry.is_symlink():
            report.add("link", entry.name, "a link named like a namespace (not followed)",
                       removable=False)
            continue
        if not entry.is_dir(follow_symlinks=False):
            report.other_entries += 1
            continue
        _Walk(path, entry.name, report, verify, kinds, mac_key, stale_temp_age_s).run()
    return report.done()


class _Walk:
    """One namespace's check."""

    def __init__(self, root: str, name: str, report: FsckReport, verify: bool,
                 kinds: set[str] | None, mac_key: bytes | None, stale_temp_age_s: float):
        self.root, self.name, self.report, self.verify = root, name, report, verify
        self.kinds, self.mac_key, self.stale = kinds, mac_key, stale_temp_age_s
        self.ns_report = NamespaceReport(name)
        self._buf = bytearray(4096)

    def run(self) -> None:
        try:
            ns = Namespace.open_existing(self.root, self.name)
        except FileNotFoundError as e:
            if os.path.lexists(os.path.join(self.root, self.name)):
                self.report.add("bad_namespace", self.name, _text(e), removable=False)
            return  # else removed meanwhile
        except (ValueError, OSError) as e:
            self.report.add("bad_namespace", self.name, _text(e), removable=False)
            return
        self.report.namespaces.append(self.ns_report)
        self.ns_report.fingerprint = ns.fingerprint
        self.ns_report.chunk_bytes = layout_chunk_bytes(ns.fingerprint)
        mac_id = mac_id_of(ns.fingerprint)
        self.check = FrameCheck(mac_id, self.mac_key, self.ns_report.chunk_bytes)
        self.ns_report.mac = mac_id is not None
        self.ns_report.mac_checked = self.check.mac_checked
        self.ns = ns
        try:
            for rel, fd, entries in ns.walk(self._unreadable, lambda: None, self._other):
                for e in entries:
                    self._leaf_entry(fd, rel, e)
        finally:
            ns.close()

    # ------------------------------------------------------------------ judging

    def _where(self, rel: str, name: str) -> str:
        return "/".join(p for p in (self.name, rel, name) if p)

    def _unreadable(self) -> None:
        self.report.add("unreadable", self.name, "a directory could not be listed",
                        removable=False)

    def _other(self, fd: int, rel: str, e) -> None:
        """An entry of the namespace or a first-level fan-out directory that is no
        fan-out directory: a temp file (config.json's, a direct-I/O probe), or bad."""
        st = _lstat(fd, e.name)
        if st is None:
            return
        where = self._where(rel, e.name)
        if stat.S_ISLNK(st.st_mode):
            self._bad(fd, e.name, st, "link", where, "not followed")
        elif stat.S_ISDIR(st.st_mode):
            self._bad(fd, e.name, st, "foreign", where, "a directory the layout does not have")
        elif e.name.endswith(TEMP_SUFFIX):
            self._temp(fd, e.name, st, where)
        elif chunk_key(e.name) is not None:
            self._bad(fd, e.name, st, "misplaced", where, "outside the fan-out")
        else:
            self._bad(fd, e.name, st, "foreign", where)

    def _leaf_entry(self, fd: int, rel: str, e) -> None:
        name = e.name
        st = _lstat(fd, name)
        if st is None:
            return  # removed meanwhile
        where = self._where(rel, name)
        if stat.S_ISLNK(st.st_mode):
            self._bad(fd, name, st, "link", where, "not followed")
            return
        if stat.S_ISDIR(st.st_mode):
            self._bad(fd, name, st, "foreign", where, "a directory the layout does not have")
            return
        if name.endswith(TEMP_SUFFIX) and name.startswith("."):
            self._temp(fd, name, st, where)
            return
        key = chunk_key(name)
        if key is None or not stat.S_ISREG(st.st_mode):
            self._bad(fd, name, st, "foreign", where)
        elif self.ns.rel_dir(key) != rel:
            self._bad(fd, name, st, "misplaced", where, f"belongs in {self.ns.rel_dir(key)}")
        else:
            self._chunk(fd, name, key, where)

    def _temp(self, fd: int, name: str, st: os.stat_result, where: str) -> None:
        if self.ns.temp_orphaned(name, st.st_mtime, self.stale):
            self._bad(fd, name, st, "orphan_temp", where, "its writer is gone")
        else:
            self.ns_report.temp_live += 1

    def _chunk(self, dir_fd: int, name: str, key: bytes, where: str) -> None:
        try:
            fd = open_nofollow(name, os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC, dir_fd, where)
        except FileNotFoundError:
            return  # deleted meanwhile (an engine's eviction)
        except LinkRefused:
            return  # replaced by a link since listed: the next run judges it
        except OSError as e:
            self.report.add("unreadable", where, _text(e), removable=False)
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._bad(dir_fd, name, st, "foreign", where)
                return
            size = st.st_size
            cap = chunk_file_cap(len(key), self.ns_report.chunk_bytes)
            if size > cap:  # what the tier's ops remove as a foreign file
                self._bad(dir_fd, name, st, "oversized", where,
                          f"length: {size} bytes, more than any chunk of the layout could be "
                          f"(at most {cap})")
                return
            head = self._read(fd, min(size, FrameCheck.head_bytes(len(key))))
            judged = self.check.check_header(head, key, size)
            if isinstance(judged, tuple):
                self._bad(dir_fd, name, st, judged[0], where, judged[1])
                return
            if self.verify:
                frame = self._read(fd, size)
                if len(frame) != size:
                    return  # shrank under us: replaced or truncated since; the next run sees
                bad = self.check.check_frame(frame, key, judged)
                if bad is not None:
                    self._bad(dir_fd, name, st, bad[0], where, bad[1])
                    return
            self.ns_report.chunks += 1
            self.ns_report.bytes += size
        except OSError as e:
            self.report.add("unreadable", where, _text(e), removable=False)
        finally:
            close_quietly(fd)

    def _read(self, fd: int, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(size)
        view = memoryview(self._buf)
        return view[:pread_full(fd, view, size)]

    # ------------------------------------------------------------------ repairing

    def _bad(self, dir_fd: int, name: str, st: os.stat_result, kind: str, where: str,
             detail: str = "") -> None:
        problem = self.report.add(kind, where, detail, st.st_size)
        if self.kinds is None and not self.report.repair:
            return
        if self.kinds is not None and kind not in self.kinds:
            return
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                problem.detail = (detail + "; " if detail else "") + "replaced meanwhile: kept"
                return
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)  # only an empty one: nothing is removed inside
            else:
                os.unlink(name, dir_fd=dir_fd)  # the entry itself: a link's target is untouched
        except FileNotFoundError:
            pass  # gone already
        except OSError as e:
            problem.detail = (detail + "; " if detail else "") + f"not removed: {_text(e)}"
            return
        problem.repaired = True


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _text(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        code = errno.errorcode.get(e.errno or 0, "")
        return f"{code} {e.strerror}".strip() if not e.filename else f"{code} {e.strerror}: {e.filename}"
    return str(e)[:300]
