"""Read-only snapshots of engines' segments, for ``shmtier ls`` and ``shmtier top``.

Runs in: the ``shmtier`` CLI's process (or any tool). Never blocks on another process
and never writes: a segment is opened ``O_RDONLY`` and mapped read-only, and only its
header, chunk table and ring area are mapped (not the arena); no semaphore is opened and
no lock taken, so a reader at any rate costs the scheduler nothing but the memory
bandwidth of the bytes it reads (measured in tests/test_cli.py).

What a segment tells (docs/architecture.md, "Who reads and writes what"): the header
(geometry, owner, fingerprint), the chunk table (each row's state: free, pending,
ready, pinned), the ring area (per tier
worker slot: heartbeat, holder, claims, the worker's counters, job and result ring
depths), the pool config (tier types and where they store) and the scheduler's
statistics area (per tier: chunks, bytes, lookups and hits, promotions, cascades,
backpressure drops, evictions: ``shmtier/shared/stats_area.py``, read lock-free with its
seqlock; a segment of layout version 1 has none).

Values are read while the engine runs: each word is current, the set is not one
instant's (a row counted pending may be ready by the time the next array is read).
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from shmtier.shared.chunk_table import GENERATION, ChunkTable
from shmtier.shared.layout import HEADER_SIZE, STATS_OFFSET
from shmtier.shared.lanes import worker_lane
from shmtier.shared.pool_config import CONFIG_BYTES, PoolConfig
from shmtier.shared.ring import TIER_COUNTERS
from shmtier.shared.ring_tools import AreaState, inspect_area
from shmtier.shared.segment import (
    LAYOUT_VERSION,
    MAGIC,
    NAME_PREFIX,
    READY,
    SHM_DIR,
    SegmentHeader,
    segment_name,
)
from shmtier.shared.segment_tools import list_segments
from shmtier.shared.stats_area import StatsAreaError, read_stats

_STATES = {0: "initialising", 1: "ready", 2: "failed"}
#: A publish older than this is shown as stale (the scheduler publishes as it steps).
STALE_AFTER_S = 5.0
#: Worker args shown per tier type (never a credential or a MAC key: only these).
_SHOWN_ARGS = ("root_dir", "max_bytes", "prefix", "pool", "size_bytes")
_SHOWN_STORE = ("bucket", "endpoint_override", "region")


@dataclass
class Rows:
    """Arena rows by state: free (no key), pending (a store or promotion writing it),
    ready (evictable), pinned (read by a load, or held for a cascade)."""

    total: int = 0
    free: int = 0
    pending: int = 0
    ready: int = 0
    pinned: int = 0

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass
class TierInfo:
    """A secondary tier as the segment names it: index, type (None: no worker half),
    where it stores (no secrets), and what its tier workers counted that no result shows
    (``worker_counters``: ``ring.TIER_COUNTERS`` summed over the worker slots)."""

    index: int
    type: str | None
    where: dict = field(default_factory=dict)
    worker_counters: dict = field(default_factory=dict)


@dataclass
class WorkerInfo:
    """One tier worker slot (``ring_tools.inspect_area``)."""

    index: int
    pid: int
    alive: bool
    beat_age_s: float | None
    claims: int
    restarts: int
    jobs: int
    bytes: int
    codec_s: float
    failed_keys: int
    job_depth: int
    result_depth: int
    lane: str = ""  # shared/lanes.py: "promotion" or "background" ("" without a pool config)


@dataclass
class SchedulerStats:
    """The scheduler's statistics area as read (``state``): ``live``; ``stale`` (its
    publisher is not the live owner, or its last publish is older than ``STALE_AFTER_S``:
    an engine that does not step does not publish); ``unpublished`` (nothing written: an
    older scheduler, or publishing off); ``absent`` (a segment of layout version 1);
    ``torn`` (no consistent copy: its writer died mid-publish). ``note`` says why in words.
    ``tiers``: one dict per tier (``stats_area.FIELDS``, None where not counted)."""

    state: str
    note: str = ""
    pid: int = 0
    interval_s: float = 0.0
    publishes: int = 0
    published: float = 0.0
    age_s: float | None = None
    started: float = 0.0
    row_bytes: int = 0
    tiers: list[dict] = field(default_factory=list)


@dataclass
class Snapshot:
    """One segment, read at ``taken`` (epoch s) and ``taken_ns`` (CLOCK_MONOTONIC)."""

    name: str
    engine_id: str
    size: int
    alive: bool
    state: str
    owner_pid: int
    creator_pid: int
    generation: int
    fingerprint: str
    geometry: dict | None
    rows: Rows | None
    tiers: list[TierInfo]
    pool: dict | None  # mode, num_workers, slots, slot_size, chunk_bytes, codec
    workers: list[WorkerInfo]
    taken: float
    taken_ns: int
    note: str = ""
    stats: SchedulerStats | None = None

    def as_dict(self) -> dict:
        out = asdict(self)
        if self.rows is not None:
            out["rows"]["used"] = self.rows.used
        return out


def _read_only_map(path: str, length: int) -> tuple[mmap.mmap | None, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        n = min(size, length)
        return (mmap.mmap(fd, n, prot=mmap.PROT_READ) if n else None), size
    finally:
        os.close(fd)


def resolve(engine: str) -> str:
    """The segment name (with its slash) an engine id or a segment name stands for."""
    bare = engine.lstrip("/")
    if bare.startswith(NAME_PREFIX) and os.path.exists(os.path.join(SHM_DIR, bare)):
        return "/" + bare
    return segment_name(engine)


def snapshot(engine: str, *, rows: bool = True) -> Snapshot:
    """A snapshot of ``engine``'s segment (an engine id or a segment name).
    FileNotFoundError when there is none; ``rows=False`` skips the chunk table scan."""
    name = resolve(engine)
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    taken, taken_ns = time.time(), time.monotonic_ns()
    buf, size = _read_only_map(path, HEADER_SIZE)
    empty = Snapshot(name, name.lstrip("/")[len(NAME_PREFIX):], size, False, "no header", 0,
                     0, 0, "", None, None, [], None, [], taken, taken_ns)
    if buf is None or len(buf) < HEADER_SIZE:
        empty.alive = any(s.alive for s in list_segments() if s.name == name)
        return empty
    try:
        header = SegmentHeader.decode(buf)
        stats = _stats(header, buf)
    finally:
        buf.close()
    engine_id = name.lstrip("/")[len(NAME_PREFIX):]
    snap = Snapshot(name, engine_id, size, header.owner_alive(),
                    _STATES.get(header.state, str(header.state)), header.owner_pid,
                    header.creator_pid, header.generation, header.fingerprint, None, None,
                    [], None, [], taken, taken_ns, stats=stats)
    g, lay = header.geometry, header.layout
    if header.magic != MAGIC or header.state != READY or g is None:
        snap.note = "not a ready shmtier segment"
        return snap
    snap.geometry = {"num_chunks": g.num_chunks, "row_stride": g.row_stride,
                     "page_size_per_worker": g.page_size_per_worker,
                     "world_size": g.world_size, "key_width": g.key_width,
                     "arena_bytes": lay.arena_len}
    end = lay.rings_off + lay.rings_len
    if not (HEADER_SIZE <= lay.control_off <= lay.rings_off and end <= min(size, lay.arena_off)):
        snap.note = "offsets in the header do not fit the segment"
        return snap
    buf, _ = _read_only_map(path, end)
    view = memoryview(buf)
    try:
        if rows:
            table = ChunkTable(view[lay.control_off:lay.control_off + lay.control_len],
                               g.num_chunks, g.key_width)
            try:
                snap.rows = _rows(table)
                snap.generation = int(table.counters[GENERATION]) or snap.generation
            finally:
                table.release()
        rings = view[lay.rings_off:end]
        try:
            _pool(snap, rings)
        finally:
            rings.release()
    finally:
        view.release()
        buf.close()
    return snap


def _stats(header: SegmentHeader, buf) -> SchedulerStats | None:
    """The stats area of the header page mapped as ``buf`` (None: not a ready segment)."""
    if header.magic != MAGIC or header.state != READY:
        return None
    if header.layout_version < 2:
        return SchedulerStats("absent", f"segment layout version {header.layout_version} "
                              f"(an older shmtier): it has no statistics area")
    if header.layout_version > LAYOUT_VERSION:
        return SchedulerStats("absent", f"segment layout version {header.layout_version}: "
                              f"this shmtier reads up to {LAYOUT_VERSION}")
    view = memoryview(buf)[STATS_OFFSET:HEADER_SIZE]
    try:
        got = read_stats(view)
    except StatsAreaError as e:
        return SchedulerStats("torn", f"statistics area: {e}")
    finally:
        view.release()
    if got is None:
        return SchedulerStats("unpublished", "the scheduler has not published statistics "
                              "(an older shmtier, or SHMTIER_STATS_INTERVAL_S=0)")
    age = max(0.0, (time.monotonic_ns() - got.published_ns) / 1e9)
    out = SchedulerStats("live", "", got.pid, got.interval_s, got.publishes, got.published,
                         round(age, 3), got.started, got.row_bytes, got.tiers)
    if got.pid != header.owner_pid or not header.owner_alive():
        out.state, out.note = "stale", (f"published by pid {got.pid}, not the live owner "
                                        f"(pid {header.owner_pid})")
    elif age > STALE_AFTER_S:
        out.state, out.note = "stale", (f"last published {age:.1f} s ago (the scheduler "
                                        f"publishes as it steps: is the engine idle?)")
    return out


def _rows(table: ChunkTable) -> Rows:
    key_len = table.numpy("key_len")
    refcnt = table.numpy("refcnt")
    used = key_len != 0
    pending = int(np.count_nonzero(used & (refcnt < 0)))
    pinned = int(np.count_nonzero(used & (refcnt > 0)))
    n_used = int(np.count_nonzero(used))
    return Rows(table.num_chunks, table.num_chunks - n_used, pending, n_used - pending - pinned,
                pinned)


def _pool(snap: Snapshot, rings: memoryview) -> None:
    area: AreaState | None = inspect_area(rings) if len(rings) else None
    config = None
    if len(rings) >= CONFIG_BYTES:
        try:
            config = PoolConfig.read(rings)
        except Exception:  # no config written (no worker-backed tier), or being written
            config = None
    if config is not None:
        snap.pool = {"mode": config.options.workers,
                     "num_workers": config.options.num_tier_workers,
                     "slots": config.slots, "slot_size": config.slot_size,
                     "chunk_bytes": config.chunk_bytes, "codec": config.codec.to_dict(),
                     "job_timeout_s": config.options.tier_job_timeout_s,
                     "promotion_workers": config.options.promotion_workers}
        for i, entry in enumerate(config.tiers):
            snap.tiers.append(TierInfo(i, entry.type if entry else None,
                                       _where(entry.options.to_dict()) if entry else {}))
    if area is None:
        return
    for tier in snap.tiers:
        if tier.type is not None and tier.index < len(area.workers[0].tier_counters):
            tier.worker_counters = {name: sum(w.tier_counters[tier.index][i]
                                              for w in area.workers)
                                    for i, name in enumerate(TIER_COUNTERS)}
    now = time.monotonic_ns()
    for w in area.workers:
        hb, c = w.heartbeat, w.counters
        snap.workers.append(WorkerInfo(
            w.index, hb.pid, w.holder_alive, None if not hb.beat_ns else hb.age_s(now),
            hb.claims, max(0, hb.claims - 1), c.jobs, c.bytes, c.codec_ns / 1e9,
            c.failed_keys, w.job_depth, w.result_depth,
            "" if config is None else worker_lane(w.index, config.options.num_tier_workers,
                                                  config.options.promotion_workers)))


def _where(args: dict) -> dict:
    out = {k: args[k] for k in _SHOWN_ARGS if k in args and args[k] not in (None, "")}
    store = args.get("store_config")
    if isinstance(store, dict):
        out.update({k: store[k] for k in _SHOWN_STORE if store.get(k)})
    return out


def snapshots(*, rows: bool = True) -> list[Snapshot]:
    """A snapshot of every shmtier segment on this host (those that vanish meanwhile left
    out)."""
    out = []
    for status in list_segments():
        try:
            out.append(snapshot(status.name, rows=rows))
        except (FileNotFoundError, ValueError, OSError):
            continue
    return out
