"""Listing and removing engine segments from outside: ``shmtier ls`` / ``clean``, the segment
guardian, the ring semaphores' cleanup, the stress run and the tests' leak guard.

Runs in: any process; never maps a segment, only opens its /dev/shm entry read-only to read
the header and take its ``flock``. Judges liveness by ``segment.py``'s one staleness rule
(``_alive``); ``remove_if_stale`` checks and unlinks under the segment's lock, which
``open_segment`` holds from its own staleness check to its claim. May block: only
``remove_if_stale``, up to its ``lock_wait_s``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from shmtier.shared.segment import (
    MAGIC,
    NAME_PREFIX,
    SHM_DIR,
    _alive,
    _lock,
    _read_header,
    _unlink_if_same,
)


@dataclass(frozen=True)
class SegmentStatus:
    name: str
    size: int
    owner_pid: int
    creator_pid: int
    alive: bool
    fingerprint: str


def _status(name: str, fd: int, *, locked: bool) -> SegmentStatus:
    """The status of the segment open as ``fd``, by the staleness rule (``_alive``);
    ``locked``: the caller holds its lock."""
    st = os.fstat(fd)
    header = _read_header(fd)
    alive = _alive(header, fd, locked=locked)
    if header is None or header.magic != MAGIC:
        return SegmentStatus(name, st.st_size, 0, 0, alive, "")
    return SegmentStatus(name, st.st_size, header.owner_pid, header.creator_pid, alive,
                         header.fingerprint)


def _open_entry(name: str) -> int | None:
    try:
        return os.open(os.path.join(SHM_DIR, name.lstrip("/")),
                       os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None


def list_segments() -> list[SegmentStatus]:
    """Every shmtier segment on this host, with whether its owner still runs."""
    found = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return found
    for entry in entries:
        if not entry.startswith(NAME_PREFIX):
            continue
        fd = _open_entry(entry)
        if fd is None:
            continue
        try:
            found.append(_status("/" + entry, fd, locked=False))
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


def remove_if_stale(name: str, *, inode: int | None = None,
                    lock_wait_s: float = 0.0) -> SegmentStatus | None:
    """Unlink segment ``name`` (with its slash) if it is stale (the module docstring's one
    rule) and, with ``inode``, still that object; returns its status as removed, or None
    when nothing was removed (gone, alive, another object, or its lock still held after
    ``lock_wait_s``). Any process; blocks up to ``lock_wait_s``.

    Checks and unlinks under the segment's ``flock``, which ``open_segment`` holds on an
    existing segment from its staleness check to its claim: a segment that a new owner
    re-attached to (warm restart) is alive by then and kept."""
    fd = _open_entry(name)
    if fd is None:
        return None
    try:
        if not _lock(fd, time.monotonic() + lock_wait_s):
            return None
        st = os.fstat(fd)
        if st.st_nlink == 0 or (inode is not None and st.st_ino != inode):
            return None
        status = _status(name, fd, locked=True)
        if status.alive:
            return None
        _unlink_if_same(name, st.st_ino)  # the fd pins the inode: same number, same object
        return status
    except OSError:
        return None
    finally:
        os.close(fd)


def clean_stale_segments(names: "set[str] | None" = None) -> list[str]:
    """Unlink every shmtier segment whose owner (or creator) is dead (only those named in
    ``names``, segment names with their slash, when given); returns their names."""
    return [status.name for status in list_segments()
            if not status.alive and (names is None or status.name in names)
            and remove_if_stale(status.name) is not None]
