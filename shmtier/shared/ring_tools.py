"""What tools read of a ring area, and the cleanup of stale ring semaphores.

Runs in: any process that inspects an engine's rings without taking part in them: the
``shmtier`` command (``top``, ``ls``, ``clean``), the tier workers' metrics endpoint, the
pool's check for a dead scheduler's workers (``old_holders.py``), the segment guardian, the
stress run and the tests' leak guard. ``inspect_area`` reads bytes only (no semaphore, no
lock, no write); ``clean_stale_ring_semaphores`` unlinks the semaphores of segments whose
owner is gone. Never blocks. The area's layout and the ring protocol are ``ring.py``'s.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import posix_ipc

from shmtier.shared import procinfo
from shmtier.shared.ring import (
    _AREA,
    AREA_HEADER_SIZE,
    AREA_MAGIC,
    AREA_VERSION,
    _BEAT_NS,
    _CLAIMS,
    CONTROL_SIZE,
    _FAILED_KEYS,
    _HEAD,
    Heartbeat,
    _JOBS,
    KINDS,
    MAX_COUNTED_TIERS,
    _PID,
    ring_area_nbytes,
    ring_nbytes,
    SHM_DIR,
    _START,
    _TAIL,
    TIER_COUNTERS,
    _TIER_WORDS,
    WorkerCounters,
)

#: a ring semaphore's /dev/shm entry (``semaphore_name``'s names): its segment, worker, ring
_SEM_RE = re.compile(r"^sem\.(shmtier_.+)\.w\d+\.(job|res)\.(items|spaces)$")


@dataclass(frozen=True)
class SlotState:
    """One worker slot as :func:`inspect_area` read it: heartbeat word, whether its holder
    runs, its counters, and the items waiting in its job ring and its result ring."""

    index: int
    heartbeat: Heartbeat
    holder_alive: bool
    counters: WorkerCounters
    job_depth: int
    result_depth: int
    #: per tier index (the first ``MAX_COUNTED_TIERS``): its ``TIER_COUNTERS``, in order
    tier_counters: tuple = ()


@dataclass(frozen=True)
class AreaState:
    """A ring area as :func:`inspect_area` read it (``creator_alive``: the scheduler that
    created the rings still runs)."""

    num_workers: int
    slots: int
    slot_size: int
    creator_pid: int
    creator_alive: bool
    workers: list[SlotState]


_CONTROL_WORDS = struct.Struct(f"<{_TIER_WORDS + MAX_COUNTED_TIERS * len(TIER_COUNTERS)}Q")
_COUNTER = struct.Struct("<Q")


def inspect_area(region) -> AreaState | None:
    """A snapshot of a ring area for tools (``shmtier top``, ``ls``): geometry, and per
    worker slot its heartbeat word, counters (its tiers' too) and ring depths (``head - tail`` of each
    ring). Reads bytes only: opens no semaphore, writes nothing, takes no lock, so it
    may run in any process at any rate (``region`` may be a read-only mapping). None
    when the area holds no rings (never created, or being torn down). Values are read
    one word at a time while the ends run: each word is current, the set need not be
    one instant's."""
    if len(region) < AREA_HEADER_SIZE:
        return None
    magic, version, nw, ns, size, pid, _, start, boot = _AREA.unpack_from(region, 0)
    if magic != AREA_MAGIC or version != AREA_VERSION:
        return None
    try:
        need = ring_area_nbytes(nw, ns, size)
    except ValueError:
        return None
    if len(region) < need:
        return None
    per_ring = ring_nbytes(ns, size)
    first = AREA_HEADER_SIZE + nw * CONTROL_SIZE
    me_boot = procinfo.boot_id()
    workers = []
    for i in range(nw):
        w = _CONTROL_WORDS.unpack_from(region, AREA_HEADER_SIZE + i * CONTROL_SIZE)
        beat = Heartbeat(w[_BEAT_NS], w[_PID], w[_START], w[_CLAIMS])
        depths = []
        for kind in range(len(KINDS)):
            off = first + (2 * i + kind) * per_ring
            head = _COUNTER.unpack_from(region, off + _HEAD * 8)[0]
            tail = _COUNTER.unpack_from(region, off + _TAIL * 8)[0]
            depths.append(min(max(head - tail, 0), ns))
        alive = bool(beat.pid) and procinfo.is_alive(beat.pid, beat.start_time, me_boot)
        k = len(TIER_COUNTERS)
        tiers = tuple(tuple(w[_TIER_WORDS + t * k:_TIER_WORDS + (t + 1) * k])
                      for t in range(MAX_COUNTED_TIERS))
        workers.append(SlotState(i, beat, alive, WorkerCounters(*w[_JOBS:_FAILED_KEYS + 1]),
                                 depths[0], depths[1], tiers))
    return AreaState(nw, ns, size, pid, procinfo.is_alive(pid, start, boot), workers)


def ring_semaphore_segment(entry: str) -> str | None:
    """The segment name (no slash) a /dev/shm entry like ``sem.shmtier_e.w0.job.items``
    belongs to, or None if the entry is not a ring semaphore (for leak guards and clean)."""
    match = _SEM_RE.match(entry)
    return match.group(1) if match else None


def list_ring_semaphores() -> list[str]:
    """Names (with leading slash) of every shmtier ring semaphore on this host."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []
    return ["/" + e[4:] for e in entries if _SEM_RE.match(e)]


def clean_stale_ring_semaphores(names: "set[str] | None" = None) -> list[str]:
    """Unlink ring semaphores whose segment is gone or whose owner is dead (only those of
    the segments named in ``names``, with their slash, when given).

    For ``shmtier clean``. Returns the names removed. A semaphore of a segment
    whose owner still runs is kept.
    """
    from shmtier.shared.segment_tools import list_segments  # numpy-free; keeps imports lean

    alive = {s.name.lstrip("/") for s in list_segments() if s.alive}
    wanted = None if names is None else {n.lstrip("/") for n in names}
    removed = []
    for name in list_ring_semaphores():
        segment = ring_semaphore_segment("sem." + name[1:])
        if segment in alive or (wanted is not None and segment not in wanted):
            continue
        try:
            posix_ipc.unlink_semaphore(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed
