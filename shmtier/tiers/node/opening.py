"""Creating and joining a node pool's segment: ``segment.py``'s creation protocol, with
its helpers, for a pool (docs/node-pool.md, "The segment"), and the errors that name what
is wrong.

Who calls: ``NodePool.attach``/``open`` (``pool.py``) in an engine's scheduler process, its
tier workers, tools. Blocks: up to ``timeout_s`` for another process creating the pool and
for the file's lock, which joiners hold from their check to their mapping.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time

import numpy as np

from shmtier.options import ConfigError
from shmtier.shared import procinfo
from shmtier.shared.segment import (
    SHM_DIR,
    _allocate,
    _check_space,
    _lock,
    _prefault,
    _unlink_if_same,
    fingerprint_digest,
)
from shmtier.tiers.node.layout import (
    FAILED,
    H_FREE_COUNT,
    H_LRU_HEAD,
    H_LRU_TAIL,
    H_PIN_FREE,
    HEADER_BYTES,
    MAGIC,
    NAME_PREFIX,
    READY,
    STATE_OFFSET,
    VERSION,
    Identity,
    NodeLayout,
    Views,
    encode_identity,
    read_identity,
    shm_name,
)

logger = logging.getLogger(__name__)


class NodePoolError(RuntimeError):
    """A pool cannot be used: it does not exist, its lock stays held, its engine table is
    full, or this object was carried into a forked child. The text names the pool."""


class NodePoolMismatchError(ConfigError):
    """The pool exists with another layout, row size or size than this engine gives: the
    text names the pool, each differing field and both values."""


def _fingerprint_diffs(theirs: str, mine: str) -> list[str]:
    """What differs between two layout fingerprints, field by field when both are
    ``key=value`` words (``PrimaryTierConfig.fingerprint``), else as wholes."""
    def fields(text):
        words = text.split()
        return dict(w.split("=", 1) for w in words) if all("=" in w for w in words) else None
    a, b = fields(theirs), fields(mine)
    if a is None or b is None:
        return [f"layout fingerprint is {theirs!r} in the pool, {mine!r} for this engine"]
    return [f"layout field {k} is {a.get(k)!r} in the pool, {b.get(k)!r} for this engine"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)] or [
        f"layout fingerprint is {theirs!r} in the pool, {mine!r} for this engine"]


def _check_compatible(pool: str, ident: Identity, layout: NodeLayout | None,
                      fingerprint: str | None) -> None:
    """NodePoolMismatchError naming ``pool``, each differing field and both values."""
    where = f"node pool {pool!r} ({SHM_DIR}/{NAME_PREFIX}{pool})"
    if ident.version != VERSION or ident.layout is None:
        raise NodePoolMismatchError(
            f"{where}: layout version is {ident.version} in the pool, {VERSION} expected by "
            f"this process (or its header is damaged); remove it with `shmtier clean`")
    diffs = []
    if layout is not None:
        for field in ("row_bytes", "size_bytes"):
            have, want = getattr(ident.layout, field), getattr(layout, field)
            if have != want:
                diffs.append(f"{field} is {have} in the pool, {want} for this engine")
    if fingerprint is not None and ident.fingerprint_digest != fingerprint_digest(fingerprint):
        diffs.extend(_fingerprint_diffs(ident.fingerprint, fingerprint))
    if diffs:
        raise NodePoolMismatchError(
            f"{where} was made by engines of another configuration: " + "; ".join(diffs)
            + " (every engine of a pool must give the same layout and size_bytes; name "
            "another pool for another layout)")


def _init_tables(mm: mmap.mmap, layout: NodeLayout) -> None:
    """Lay out an empty pool: every row FREE on the free list, every pin entry free."""
    v = Views(mm, layout)
    try:
        q = v.q
        v.index_np[:] = -1
        v.rows["prev"] = -1
        v.rows["next"] = np.append(np.arange(1, layout.rows, dtype=np.int32), -1)
        v.pins["row"] = np.append(np.arange(1, layout.pins_max, dtype=np.int32), -1)
        q[H_LRU_HEAD] = q[H_LRU_TAIL] = -1
        q[H_FREE_COUNT] = layout.rows
        q[H_PIN_FREE] = 0
    finally:
        v.release()


def _create(pool: str, fd: int, layout: NodeLayout, fingerprint: str,
            lock_timeout_s: float) -> mmap.mmap | None:
    """Initialise the file ``fd`` this process just created (``O_EXCL``), following
    ``segment.py``'s creation protocol: the header is written under the lock, in one
    write, before the file grows; state READY last. None when a judge removed the name
    before this process took the lock (the caller starts over)."""
    name, inode, mm = shm_name(pool), os.fstat(fd).st_ino, None
    try:
        if not _lock(fd, time.monotonic() + lock_timeout_s):
            raise NodePoolError(f"node pool {pool!r}: another process held the lock of the "
                                f"pool this process just created")
        try:
            if os.fstat(fd).st_nlink == 0:
                return None
            _check_space(name, layout.total_len, 0)
            os.pwrite(fd, encode_identity(layout, procinfo.me(), procinfo.boot_id(),
                                          fingerprint_digest(fingerprint), fingerprint), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.ftruncate(fd, layout.total_len)
        _allocate(name, fd, layout.total_len, 0)  # ENOSPC now, not SIGBUS on a later fault
        mm = mmap.mmap(fd, layout.total_len)
        _init_tables(mm, layout)
        # Fault the arena in once, here: tmpfs zeroes a fallocated page at its first fault,
        # which would otherwise fall on the first store into each row (~10x its copy).
        _prefault(mm, layout.arena_off, layout.total_len - layout.arena_off)
        struct.pack_into("<I", mm, STATE_OFFSET, READY)  # last: joiners wait for it
        logger.info("node pool %s created: %d rows of %d bytes", pool, layout.rows,
                    layout.row_bytes)
        return mm
    except BaseException:
        if mm is not None:
            struct.pack_into("<I", mm, STATE_OFFSET, FAILED)
            mm.close()
        _unlink_if_same(name, inode)
        raise


def _join(pool: str, fd: int, layout: NodeLayout | None, fingerprint: str | None,
          deadline: float, timeout_s: float) -> tuple[mmap.mmap, Identity] | None:
    """Map the existing pool behind ``fd`` (the caller holds its lock) once its creator
    marked it READY; None when it was stale (its creator died or gave up, or it has no
    pool header) and its name was removed."""
    while True:
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return None
        ident = read_identity(os.pread(fd, HEADER_BYTES, 0)) if st.st_size >= HEADER_BYTES else None
        if ident is not None and ident.magic == MAGIC and ident.state == READY:
            break
        if ident is None or ident.magic != MAGIC or ident.state == FAILED or not \
                procinfo.is_alive(ident.creator_pid, ident.creator_start, ident.boot_id):
            logger.warning("node pool %s is stale (%s); replacing it", pool,
                           "no pool header" if ident is None or ident.magic != MAGIC
                           else f"its creator pid {ident.creator_pid} did not finish it")
            _unlink_if_same(shm_name(pool), st.st_ino)
            return None
        if time.monotonic() > deadline:
            raise NodePoolError(f"node pool {pool!r}: creator pid {ident.creator_pid} did "
                                f"not finish initialising it within {timeout_s:g} s")
        time.sleep(0.005)
    _check_compatible(pool, ident, layout, fingerprint)
    if st.st_size < ident.layout.total_len:
        raise NodePoolMismatchError(f"node pool {pool!r}: its file has {st.st_size} bytes, "
                                    f"{ident.layout.total_len} expected")
    return mmap.mmap(fd, ident.layout.total_len), ident


def open_pool(pool: str, layout: NodeLayout | None, fingerprint: str | None, *, create: bool,
          timeout_s: float, lock_timeout_s: float) -> tuple[int, mmap.mmap, Identity]:
    """Create or join pool ``pool``: (descriptor, mapping, identity)."""
    path = os.path.join(SHM_DIR, shm_name(pool).lstrip("/"))
    deadline = time.monotonic() + timeout_s
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        if create:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                try:
                    mm = _create(pool, fd, layout, fingerprint, lock_timeout_s)
                except BaseException:
                    os.close(fd)
                    raise
                if mm is None:
                    os.close(fd)
                    continue
                return fd, mm, read_identity(mm)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if create:
                continue
            raise NodePoolError(
                f"node pool {pool!r} does not exist ({path}): its engines create it when "
                f"they start (is an engine using it running? `shmtier ls` lists pools)"
            ) from None
        try:
            if not _lock(fd, deadline):
                raise NodePoolError(f"node pool {pool!r}: its lock stayed held for "
                                    f"{timeout_s:g} s")
            try:
                joined = _join(pool, fd, layout, fingerprint, deadline, timeout_s)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        if joined is None:
            os.close(fd)
            continue
        return fd, *joined
