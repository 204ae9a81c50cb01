"""Node pools seen from outside: list them (``shmtier ls``/``top``, the tests' leak guard)
and remove the ones no engine uses any more (``shmtier clean``, an engine's guardian).

Runs in: any process. ``list_pools`` never maps a pool: it reads the header and the engine
table with ``pread`` and never blocks. ``clean_pools`` maps each candidate and takes its
lock (``NodePool.sweep``), so it may wait up to the lock timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from shmtier.shared import procinfo
from shmtier.shared.segment import SHM_DIR
from shmtier.tiers.node.layout import (
    ENGINE_BYTES,
    ENGINE_DTYPE,
    ENGINES_MAX,
    H_KEEP,
    H_READY,
    HEADER_BYTES,
    MAGIC,
    READY,
    pool_of,
    read_identity,
    shm_name,
)


@dataclass(frozen=True)
class PoolStatus:
    """One pool as its header says: ``engines`` lists (engine id, pid, alive) of its
    engine-table entries; ``valid`` is False for a file under the pools' prefix that is
    not a complete pool (a creator died, or no pool header)."""

    pool: str
    path: str
    size: int
    valid: bool
    fingerprint: str = ""
    rows: int = 0
    row_bytes: int = 0
    used: int = 0
    kept: bool = False
    engines: tuple = ()

    @property
    def live_engines(self) -> int:
        return sum(alive for _, _, alive in self.engines)


def read_status(pool: str) -> PoolStatus | None:
    """The status of pool ``pool``, or None when it does not exist."""
    path = os.path.join(SHM_DIR, shm_name(pool).lstrip("/"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER_BYTES, 0)
        if len(head) < HEADER_BYTES:
            return PoolStatus(pool, path, size, False)
        ident = read_identity(head)
        if ident.magic != MAGIC or ident.state != READY or ident.layout is None:
            return PoolStatus(pool, path, size, False)
        words = np.frombuffer(head, dtype="<i8")
        table = np.frombuffer(os.pread(fd, ENGINES_MAX * ENGINE_BYTES, ident.layout.engines_off),
                              dtype=ENGINE_DTYPE)
        engines = tuple(
            (bytes(e["id"][:e["idlen"]]).decode(errors="replace"), int(e["pid"]),
             procinfo.is_alive(int(e["pid"]), int(e["start"]), ident.boot_id))
            for e in table if e["pid"])
        return PoolStatus(pool, path, size, True, ident.fingerprint, ident.layout.rows,
                          ident.layout.row_bytes, int(words[H_READY]), bool(words[H_KEEP]),
                          engines)
    except OSError:
        return None
    finally:
        os.close(fd)


def list_pools() -> list[PoolStatus]:
    """Every node pool on this host."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        pool = pool_of(entry)
        status = read_status(pool) if pool else None
        if status is not None:
            found.append(status)
    return found


def clean_pools(names: "set[str] | None" = None, *, include_kept: bool = False) -> list[str]:
    """Remove every pool (only those named in ``names`` when given) that no live engine
    uses, after sweeping what dead ones left; a pool its last engine asked to keep stays
    unless ``include_kept``. Returns the pools removed. A pool another process is still
    creating is left alone; an invalid one is replaced by its next creator (``pool.py``)."""
    from shmtier.tiers.node.pool import NodePool, NodePoolError  # maps: numpy and the codec

    removed = []
    for status in list_pools():
        if not status.valid or status.live_engines or (names is not None and status.pool not in names):
            continue
        if status.kept and not include_kept:
            continue
        try:
            pool = NodePool.open(status.pool)
        except (NodePoolError, ValueError):
            continue
        try:
            if pool.sweep(remove_unused=True, include_kept=include_kept)["removed"]:
                removed.append(status.pool)
        except NodePoolError:
            pass
        finally:
            pool.close()
    return removed
