"""One POSIX shared-memory segment per engine: create, join, claim, close.

Who calls: the scheduler process opens the segment as its *owner*; GPU worker
processes and tier workers open it as *members*. Any of them may arrive first.

Join protocol (all roles)::

    shm_open(O_CREAT | O_EXCL, 0600) ── wins ──▶ creator: flock (still linked? else
            │                                    start over), check /dev/shm's free
            │                                    space, write header, unlock, ftruncate,
            │ exists                             fallocate, pre-fault, state READY (last)
            ▼
    shm_open(existing), flock ──▶ stale (the rule below)? replace it at once; else wait
                           (poll 5 ms, bounded) until state == READY
                           ──▶ check geometry + fingerprint (mismatch names both)

A segment whose owner (or, before any owner claimed it, whose creator) is dead
is *stale*. Opening a stale segment replaces it with a fresh one; an owner
opening with ``warm_restart=True`` re-attaches to it instead when geometry and
fingerprint match, so a restarted scheduler finds what the old one stored.

Lifetime: the owner unlinks the name on ``close()``; a member that created the
segment and closes before any owner claimed it unlinks too. Mappings stay valid
in processes that still hold them. An owner that dies without closing leaves a stale
segment: unless it keeps it for a warm restart, its guardian process removes it and
its ring semaphores (``remove_when_owner_dies``, ``segment_guardian.py``);
``clean_stale_segments()`` (``shmtier clean``) removes what is left otherwise (that and
the listing: ``segment_tools.py``).

Staleness has one rule (``_alive``), the same for an opener (``_join``), ``shmtier ls``
(``list_segments``), ``shmtier clean`` and the guardian (``remove_if_stale``):

* a shmtier header: live while its owner runs (pid, start time and boot id:
  ``SegmentHeader.owner_alive``) or, before any owner claimed it, its creator; stale
  once its creator marked it FAILED;
* no shmtier header (shorter than one, or another magic: a creator that died before
  writing it, or a file that no creator made): stale, unless its ``flock`` is held.
  A creator holds the lock from its ``O_EXCL`` create until its header is written (one
  write), and checks once it has the lock that the name is still its object: a judge
  that takes the lock and finds no header may remove it at once, with no grace period.

Every removal of a segment that exists goes through ``segment_tools.remove_if_stale`` or
``_join``, under the object's ``flock``: ``open_segment`` holds it on an existing
segment from its staleness check to its claim, so nothing removes a segment that a new
owner is re-attaching to. A replaced segment goes at once: an engine never waits out
the open timeout for a creator that is dead.

Space: the creator refuses (:class:`SegmentSpaceError`, the name unlinked again)
when ``/dev/shm`` has less free space than the segment needs, and reserves every
page with ``posix_fallocate`` before mapping it, so the kernel refuses up front
(ENOSPC) instead of a page fault raising SIGBUS later.

May block: ``open_segment`` waits up to ``timeout_s`` for a creator (and for the
lock of an existing segment); ``remove_if_stale`` up to its ``lock_wait_s``;
``remove_when_owner_dies`` while its guardian starts; nothing else blocks.

Size (~740 lines): the join protocol, the stale/warm-restart rules and the space checks
all act on the one header and must agree on its states; split, each half would need the
other's invariants restated.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass

import posix_ipc

from shmtier.shared import procinfo
from shmtier.shared.ipc_wait import open_when_present
from shmtier.shared.chunk_table import GENERATION, ChunkTable
from shmtier.shared.layout import (
    HEADER_SIZE,
    PAGE_SIZE,
    STATS_OFFSET,
    ArenaGeometry,
    SegmentLayout,
)

logger = logging.getLogger(__name__)

MAGIC = b"SHMTIER\x00"
#: 2: the header page's second half is the scheduler's stats area (``stats_area.py``); a
#: version 1 segment has none (its fingerprint text may run into it).
LAYOUT_VERSION = 2
NAME_PREFIX = "shmtier_"
SHM_DIR = "/dev/shm"
MADV_POPULATE_WRITE = 23  # Linux >= 5.14

INITIALISING, READY, FAILED = 0, 1, 2

# magic, version, state | geometry | layout offsets | creator, owner | boot, fingerprint
_HEADER = struct.Struct("<8sII" "QQQII" "QQQQQQQ" "IQIQQ" "16s32sH")
_STATE_OFFSET = 12
_FINGERPRINT_TEXT_OFFSET = _HEADER.size
_FINGERPRINT_TEXT_MAX = STATS_OFFSET - _FINGERPRINT_TEXT_OFFSET  # the text shown; its digest is checked
_OWNER = struct.Struct("<IQ")  # owner pid, owner start time
_OWNER_OFFSET = struct.calcsize("<8sII" "QQQII" "QQQQQQQ" "IQ")
_GENERATION = struct.Struct("<Q")
_GENERATION_OFFSET = _OWNER_OFFSET + _OWNER.size


class SegmentError(RuntimeError):
    """Base class of every segment failure."""


class SegmentMismatchError(SegmentError):
    """The segment exists with another geometry or fingerprint than this process expects."""


class SegmentTimeoutError(SegmentError):
    """The creator did not finish initialising the segment in time."""


class SegmentOwnedError(SegmentError):
    """Another live scheduler owns the segment of this engine id."""


class SegmentSpaceError(SegmentError):
    """The shared-memory filesystem cannot hold a new segment; nothing was left behind.

    ``size``: bytes of the segment; ``reserve``: bytes the caller needs beside it (ring
    semaphores); ``free``: bytes free on ``shm_dir`` when it was refused (for a tmpfs
    without a size limit: this host's memory)."""

    def __init__(self, name: str, size: int, reserve: int, free: int, shm_dir: str):
        self.name, self.size, self.reserve, self.free, self.shm_dir = (
            name, size, reserve, free, shm_dir)
        plus = f" plus {reserve} bytes for its ring semaphores" if reserve else ""
        super().__init__(
            f"segment {name} needs {size} bytes ({human_bytes(size)}){plus} on {shm_dir}, "
            f"which has {free} bytes ({human_bytes(free)}) free: make the segment smaller or "
            f"give {shm_dir} more room (Docker: --shm-size)"
        )


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units for messages, e.g. ``130.0 MiB``."""
    value, unit = float(n), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.1f} {unit}" if unit != "bytes" else f"{n} bytes"


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int | None:
    """Bytes still free on the filesystem of ``shm_dir``; None when that cannot be read.

    A tmpfs mounted without a size limit (``size=0``) reports no blocks; its bound
    is then taken to be this host's physical memory."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    if st.f_blocks == 0:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return st.f_bavail * st.f_frsize


def _check_space(name: str, size: int, reserve: int) -> None:
    """Refuse before anything grows when ``shm_dir`` cannot hold ``size + reserve`` bytes."""
    free = shm_free_bytes()
    if free is not None and size + reserve > free:
        raise SegmentSpaceError(name, size, reserve, free, SHM_DIR)


def _allocate(name: str, fd: int, size: int, reserve: int) -> None:
    """Give the object ``size`` bytes with every page reserved (posix_fallocate).

    The kernel refuses here (ENOSPC; ENOMEM from a memory cgroup) rather than a
    later page fault raising SIGBUS; a tmpfs undoes a failed fallocate."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = shm_free_bytes()
        raise SegmentSpaceError(name, size, reserve, 0 if free is None else free,
                                SHM_DIR) from e


def segment_name(engine_id: str) -> str:
    """The POSIX shm name of ``engine_id``'s segment (with leading slash)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    if safe != engine_id or len(safe) > 180:
        digest = hashlib.sha256(engine_id.encode()).hexdigest()[:12]
        safe = f"{safe[:160]}-{digest}"
    return f"/{NAME_PREFIX}{safe}"


def fingerprint_digest(fingerprint: str) -> bytes:
    return hashlib.sha256(fingerprint.encode()).digest()


@dataclass(frozen=True)
class SegmentHeader:
    """Decoded header of a segment."""

    magic: bytes
    layout_version: int
    state: int
    layout: SegmentLayout  # as written by the creator; its geometry None when not valid
    creator_pid: int
    creator_start: int
    owner_pid: int
    owner_start: int
    generation: int
    boot_id: bytes
    fingerprint_digest: bytes
    fingerprint: str

    @classmethod
    def decode(cls, buf) -> "SegmentHeader":
        (
            magic, version, state,
            num_chunks, row_stride, page_size, world_size, key_width,
            control_off, control_len, rings_off, rings_len, arena_off, arena_len, total_len,
            creator_pid, creator_start, owner_pid, owner_start, generation,
            boot, digest, fp_len,
        ) = _HEADER.unpack_from(buf, 0)
        text = bytes(buf[_FINGERPRINT_TEXT_OFFSET : _FINGERPRINT_TEXT_OFFSET + fp_len])
        try:
            geometry = ArenaGeometry(num_chunks, row_stride, page_size, world_size, key_width)
        except ValueError:
            geometry = None
        layout = SegmentLayout(geometry, control_off, control_len, rings_off, rings_len,
                               arena_off, arena_len, total_len)
        return cls(
            magic, version, state, layout,
            creator_pid, creator_start, owner_pid, owner_start, generation,
            boot, digest, text.decode(errors="replace"),
        )

    @property
    def geometry(self) -> ArenaGeometry | None:
        return self.layout.geometry

    def owner_alive(self) -> bool:
        """Whether the owner (before any owner claimed it: the creator) runs; False for
        a header that is not a shmtier one (it names nobody)."""
        if self.magic != MAGIC:
            return False
        if self.owner_pid:
            return procinfo.is_alive(self.owner_pid, self.owner_start, self.boot_id)
        return procinfo.is_alive(self.creator_pid, self.creator_start, self.boot_id)


def _encode_header(layout: SegmentLayout, fingerprint: str) -> bytes:
    g = layout.geometry
    pid, started = procinfo.me()
    text = fingerprint.encode()[:_FINGERPRINT_TEXT_MAX]
    head = _HEADER.pack(
        MAGIC, LAYOUT_VERSION, INITIALISING,
        g.num_chunks, g.row_stride, g.page_size_per_worker, g.world_size, g.key_width,
        layout.control_off, layout.control_len, layout.rings_off, layout.rings_len,
        layout.arena_off, layout.arena_len, layout.total_len,
        pid, started, 0, 0, 0,
        procinfo.boot_id(), fingerprint_digest(fingerprint), len(text),
    )
    return head + text


def _prefault(buf: mmap.mmap, start: int, length: int) -> None:
    """Fault in [start, start+length) for writing, keeping existing bytes."""
    if length <= 0:
        return
    start_aligned = start - start % PAGE_SIZE
    length = length + (start - start_aligned)
    try:
        buf.madvise(MADV_POPULATE_WRITE, start_aligned, length)
        return
    except (OSError, ValueError, AttributeError):
        pass
    # Older kernels: touch one byte per page, OR-ing 0 so a peer's data survives.
    view = memoryview(buf)[start_aligned : start_aligned + length]
    try:
        for offset in range(0, length, PAGE_SIZE):
            view[offset] |= 0
    finally:
        view.release()


class Segment:
    """An open mapping of one engine's segment.

    Attributes: ``name``, ``layout`` (areas and geometry), ``is_creator``,
    ``is_owner``, ``table`` (the :class:`ChunkTable` over the control area),
    ``arena`` (a flat writable memoryview of all rows), ``rings`` (memoryview
    of the ring area), ``stats`` (the header's stats area: written by the owner's
    ``StatsWriter`` only), ``header()`` for a fresh decode. Close with ``close()``
    or use as a context manager.
    """

    def __init__(self, name: str, buf: mmap.mmap, inode: int, layout: SegmentLayout,
                 *, is_creator: bool, is_owner: bool):
        self.name = name
        self.layout = layout
        self.is_creator = is_creator
        self.is_owner = is_owner
        self._buf = buf
        self._inode = inode
        self._view = memoryview(buf)
        g = layout.geometry
        self.table = ChunkTable(
            self._view[layout.control_off : layout.control_off + layout.control_len],
            g.num_chunks, g.key_width,
        )
        self.arena = self._view[layout.arena_off : layout.arena_off + layout.arena_len]
        self.rings = self._view[layout.rings_off : layout.rings_off + layout.rings_len]
        self.stats = self._view[STATS_OFFSET:HEADER_SIZE]
        self.closed = False
        self.guardian = None  # set by remove_when_owner_dies

    @property
    def geometry(self) -> ArenaGeometry:
        return self.layout.geometry

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name.lstrip("/"))

    def header(self) -> SegmentHeader:
        return SegmentHeader.decode(self._view)

    def arena_rows(self) -> memoryview:
        """Zero-copy 2-D byte view ``(num_chunks, row_stride)`` of the arena."""
        g = self.geometry
        return self.arena.cast("B", (g.num_chunks, g.row_stride)) if g.num_chunks else self.arena

    def prefault(self, rank: int | None = None) -> None:
        """Fault in the ring area and the arena: all of it (rank None) or only ``rank``'s
        slot of every row. (A ring slot's first use must not pay a page fault on the
        scheduler thread: ~130 of them per ring, in the engine's first steps.)"""
        _prefault(self._buf, self.layout.rings_off, self.layout.rings_len)
        g, off = self.geometry, self.layout.arena_off
        if rank is None or g.world_size == 1 and g.page_size_per_worker >= g.row_stride - PAGE_SIZE:
            _prefault(self._buf, off, self.layout.arena_len)
            return
        slot = g.page_size_per_worker
        for row in range(g.num_chunks):
            _prefault(self._buf, off + row * g.row_stride + rank * slot, slot)

    def claim_ownership(self) -> None:
        """Record this process as owner and bump the owner generation (scheduler only).

        Called once per owner incarnation: when the owner creates the segment and when it
        joins one (a warm re-attach to a dead owner's segment); ``open_segment`` refuses an
        owner while another one lives, which is what serialises the claims. The
        generation is the owner incarnation's identity (see :meth:`owner_generation`)."""
        pid, started = procinfo.me()
        _OWNER.pack_into(self._view, _OWNER_OFFSET, pid, started)
        generation = self.header().generation + 1
        _GENERATION.pack_into(self._view, _GENERATION_OFFSET, generation)
        self.table.counters[GENERATION] = generation
        self.is_owner = True

    def owner_generation(self) -> int:
        """The owner generation word of the header: 0 before any owner claimed the
        segment, then bumped by every :meth:`claim_ownership` (written by the owner only).

        Read by tier workers (any process; one 8-byte load, never blocks): a worker ties
        itself to the generation of the owner that started it (the pool passes it on the
        worker's command line) and exits, touching no row or ring, once the word differs:
        its owner died and a new one re-attached (warm restart), whose pool fills the
        worker slots itself (``workers/job_loop.py``, ``shmtier/scheduler/pool/``)."""
        return _GENERATION.unpack_from(self._view, _GENERATION_OFFSET)[0]

    def remove_when_owner_dies(self):
        """Start this segment's guardian: a small process, outside this one's process
        tree, that removes the segment and its ring semaphores if this process dies
        without closing it (``segment_guardian.py``). Owner only, once, for an owner
        that does not keep its segment for a warm restart; ``close()`` lets it go.

        Scheduler process; blocks while the guardian starts (one Python start-up, at
        most 10 s). Returns the :class:`~shmtier.shared.segment_guardian.Guardian`, or
        None (logged as a WARNING) when it could not be started: the engine then runs
        unguarded, and ``shmtier clean`` removes what a crash leaves."""
        if not self.is_owner or self.closed:
            raise SegmentError(f"segment {self.name}: only its open owner starts a guardian")
        if self.guardian is not None:
            return self.guardian
        from shmtier.shared.segment_guardian import Guardian

        self.guardian = Guardian.start(self.name, self._inode)
        return self.guardian

    def _unclaimed(self) -> bool:
        return self.header().owner_pid == 0

    def unlink(self) -> None:
        """Remove the name if it still refers to this segment (never a newer one)."""
        try:
            if os.stat(self.path).st_ino != self._inode:
                return
            posix_ipc.unlink_shared_memory(self.name)
        except (FileNotFoundError, posix_ipc.ExistentialError):
            pass

    def close(self) -> None:
        """Unmap; the owner (or an unclaimed creator) also unlinks the name.

        If something outside this object still exports the mapping (a torch
        tensor over the arena), the mapping stays until that is released.
        """
        if self.closed:
            return
        self.closed = True
        if self.is_owner or (self.is_creator and self._unclaimed()):
            self.unlink()
        if self.guardian is not None:
            self.guardian.release()  # after the unlink: it exits, touching nothing
        self.table.release()
        for view in (self.arena, self.rings, self.stats, self._view):
            try:
                view.release()
            except BufferError:
                pass
        try:
            self._buf.close()
        except BufferError:
            logger.debug("segment %s still exported; unmapped when released", self.name)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_compatible(name: str, header: SegmentHeader, layout: SegmentLayout,
                      fingerprint: str) -> None:
    """Raise SegmentMismatchError naming each field that differs (both values)."""
    if header.magic != MAGIC:
        raise SegmentMismatchError(f"segment {name} is not a shmtier segment (magic {header.magic!r})")
    if header.layout_version != LAYOUT_VERSION:
        raise SegmentMismatchError(
            f"segment {name}: layout version is {header.layout_version} in the segment, "
            f"{LAYOUT_VERSION} expected by this process"
        )
    mine, theirs = layout.geometry, header.geometry
    diffs = []
    for field in ("num_chunks", "row_stride", "page_size_per_worker", "world_size", "key_width"):
        have = getattr(theirs, field, None) if theirs else None
        want = getattr(mine, field)
        if have != want:
            diffs.append(f"{field} is {have} in the segment, {want} expected by this process")
    if header.layout.rings_len != layout.rings_len:
        diffs.append(f"ring area is {header.layout.rings_len} bytes in the segment, "
                     f"{layout.rings_len} expected by this process")
    if header.fingerprint_digest != fingerprint_digest(fingerprint):
        diffs.append(
            f"layout fingerprint is {header.fingerprint!r} in the segment, "
            f"{fingerprint!r} expected by this process"
        )
    if diffs:
        raise SegmentMismatchError(f"segment {name}: " + "; ".join(diffs))


def _create(name: str, shm: posix_ipc.SharedMemory, layout: SegmentLayout, fingerprint: str,
            prefault_rank: int | None, prefault: bool, reserve_bytes: int,
            deadline: float) -> Segment | None:
    """Initialise the object ``shm`` just created (``O_EXCL``); None when a judge removed
    it as headerless before this process took its lock (the caller starts over)."""
    buf = None
    inode = os.fstat(shm.fd).st_ino
    try:
        # Until the header is written, the lock is what tells a judge that a creator is
        # at work (the module docstring's rule). A judge that took it first saw no
        # header and may have removed the name: then this object is nobody's.
        if not _lock(shm.fd, deadline):
            raise SegmentTimeoutError(f"segment {name}: another process held the lock of "
                                      f"the segment this process just created")
        if os.fstat(shm.fd).st_nlink == 0:
            return None
        _check_space(name, layout.total_len, reserve_bytes)
        # The header goes in with one write *before* the object grows: a joiner that
        # sees HEADER_SIZE bytes sees who the creator is (state still INITIALISING).
        os.pwrite(shm.fd, _encode_header(layout, fingerprint).ljust(HEADER_SIZE, b"\0"), 0)
        fcntl.flock(shm.fd, fcntl.LOCK_UN)  # before the mapping shares (and keeps) it
        os.ftruncate(shm.fd, layout.total_len)
        _allocate(name, shm.fd, layout.total_len, reserve_bytes)  # no SIGBUS on a later fault
        buf = mmap.mmap(shm.fd, layout.total_len)
        segment = Segment(name, buf, inode, layout, is_creator=True, is_owner=False)
        if prefault:
            segment.prefault(prefault_rank)
        struct.pack_into("<I", buf, _STATE_OFFSET, READY)  # last: joiners wait on it
        return segment
    except BaseException:
        if buf is not None:
            try:
                struct.pack_into("<I", buf, _STATE_OFFSET, FAILED)
                buf.close()
            except (BufferError, ValueError):
                pass
        _unlink_if_same(name, inode)  # a judge may have replaced it meanwhile
        raise
    finally:
        shm.close_fd()


def _read_header(fd: int) -> SegmentHeader | None:
    if os.fstat(fd).st_size < HEADER_SIZE:
        return None
    return SegmentHeader.decode(os.pread(fd, HEADER_SIZE, 0))


def open_segment(
    engine_id: str,
    geometry: ArenaGeometry,
    fingerprint: str,
    *,
    owner: bool,
    rank: int | None = None,
    warm_restart: bool = False,
    prefault: bool = True,
    timeout_s: float = 30.0,
    rings_len: int = 0,
    reserve_bytes: int = 0,
) -> Segment:
    """Create or join the segment of ``engine_id`` (see the module docstring).

    ``owner=True`` for the scheduler (claims ownership, unlinks on close);
    members pass their GPU ``rank`` so only their slot of each row is
    pre-faulted. ``warm_restart``: a segment whose owner is dead is kept, not
    replaced: the owner re-attaches to it, and a member (a GPU worker, which vLLM
    starts before the scheduler) joins it for the owner to come. ``rings_len``
    reserves that many bytes (page rounded) for the tier workers' rings; every opener
    must pass the same value. ``reserve_bytes``: room on ``/dev/shm`` the caller needs
    beside the segment (its ring semaphores), checked only when this process creates
    the segment. Raises
    :class:`SegmentMismatchError`, :class:`SegmentOwnedError`,
    :class:`SegmentTimeoutError` or (when ``/dev/shm`` cannot hold a new segment,
    nothing left behind) :class:`SegmentSpaceError`, each naming the segment and values.
    """
    name = segment_name(engine_id)
    layout = SegmentLayout.for_geometry(geometry, rings_len)
    deadline = time.monotonic() + timeout_s
    prefault_rank = None if owner else rank
    while True:
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            pass
        else:
            segment = _create(name, shm, layout, fingerprint, prefault_rank, prefault,
                              reserve_bytes, deadline)
            if segment is None:
                continue  # removed before its header was written: race again
            if owner:
                segment.claim_ownership()
            return segment
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            continue  # unlinked between our two opens: race again for creation
        try:
            # held from the staleness check to the claim: a guardian or `shmtier clean`
            # (remove_if_stale) waits for it, then sees a live owner
            if not _lock(shm.fd, deadline):
                raise SegmentTimeoutError(
                    f"segment {name}: another process held its lock for {timeout_s:g} s "
                    f"(a guardian or `shmtier clean` removing it, or an opener joining it)")
            outcome = _join(name, shm.fd, layout, fingerprint, owner=owner,
                            warm_restart=warm_restart, deadline=deadline, timeout_s=timeout_s)
            if outcome is None:
                continue  # stale or abandoned segment was removed: start over
            buf, inode = outcome
            segment = Segment(name, buf, inode, layout, is_creator=False, is_owner=False)
            if owner:
                segment.claim_ownership()
        finally:
            # unlocked explicitly: the mapping shares the open file, which keeps a lock
            # past close() for as long as it is mapped
            fcntl.flock(shm.fd, fcntl.LOCK_UN)
            shm.close_fd()
        if prefault and not owner:
            segment.prefault(rank)
        return segment


def _join(name: str, fd: int, layout: SegmentLayout, fingerprint: str, *, owner: bool,
          warm_restart: bool, deadline: float, timeout_s: float):
    """Wait for the segment behind ``fd`` to be ready and map it.

    Returns (mmap, inode), or None when the segment was stale/abandoned and its
    name has been removed (the caller retries creation).
    """
    while True:
        st = os.fstat(fd)
        if st.st_nlink == 0:
            return None  # creator gave up and unlinked it
        header = _read_header(fd)
        if header is not None and header.magic == MAGIC and header.state == READY:
            break
        if not _alive(header, fd, locked=True):  # the caller holds the lock
            if header is None or header.magic != MAGIC or header.state != FAILED:
                logger.warning("segment %s is stale (%s); replacing it", name,
                               _stale_why(header, st.st_size))
            _unlink_if_same(name, st.st_ino)
            return None
        if time.monotonic() > deadline:
            raise SegmentTimeoutError(
                f"segment {name}: creator pid {header.creator_pid} did not finish "
                f"initialising it within {timeout_s:g} s (raise the timeout or remove it "
                f"with `shmtier clean`)"
            )
        time.sleep(0.005)

    if not header.owner_alive():
        if warm_restart:
            _check_compatible(name, header, layout, fingerprint)
            if owner:
                logger.info("segment %s: re-attaching after owner pid %d died (warm restart)",
                            name, header.owner_pid)
            else:
                logger.info("segment %s: joining it for a warm restart (owner pid %d died; "
                            "the next owner re-attaches)", name, header.owner_pid)
        else:
            logger.info("segment %s is stale (owner pid %d dead); replacing it",
                        name, header.owner_pid or header.creator_pid)
            _unlink_if_same(name, st.st_ino)
            return None
    elif owner and header.owner_pid and header.owner_pid != os.getpid():
        raise SegmentOwnedError(
            f"segment {name} is owned by live scheduler pid {header.owner_pid}; "
            f"is another engine running with the same engine id?"
        )
    _check_compatible(name, header, layout, fingerprint)
    if st.st_size < layout.total_len:
        raise SegmentMismatchError(
            f"segment {name}: size is {st.st_size} bytes, {layout.total_len} expected"
        )
    return mmap.mmap(fd, layout.total_len), st.st_ino


def _unlink_if_same(name: str, inode: int) -> None:
    try:
        if os.stat(os.path.join(SHM_DIR, name.lstrip("/"))).st_ino == inode:
            posix_ipc.unlink_shared_memory(name)
    except (FileNotFoundError, posix_ipc.ExistentialError):
        pass


def _lock(fd: int, deadline: float) -> bool:
    """Take the exclusive ``flock`` of the segment behind ``fd`` (released by ``LOCK_UN``,
    or once every descriptor and mapping of that open file is gone), polling every 5 ms
    until ``deadline`` (``time.monotonic()``); whether it was taken. Holders keep it
    briefly: a staleness check and what follows it (a joiner: also its wait for the
    creator's ready mark)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _alive(header: SegmentHeader | None, fd: int, *, locked: bool) -> bool:
    """The staleness rule (module docstring) for the segment open as ``fd`` whose header
    reads ``header`` (None: shorter than one): whether it is live. ``locked``: the
    caller holds the segment's lock (then a segment without a header is stale: no
    creator is writing one); else a held lock means a creator is writing it."""
    if header is None or header.magic != MAGIC:
        return not locked and _lock_held(fd)
    if header.state == FAILED:
        return False  # its creator gave up on it (and unlinks it, if it still runs)
    return header.owner_alive()


def _stale_why(header: SegmentHeader | None, size: int) -> str:
    """Why a segment the rule calls stale is, for a log line."""
    if header is None:
        return (f"{size} bytes, no header: its creator died before writing one, or no "
                f"shmtier creator made it")
    if header.magic != MAGIC:
        return f"no shmtier header (magic {header.magic!r}): no shmtier creator made it"
    if header.state == FAILED:
        return "its creator gave up initialising it"
    if header.state != READY:
        return f"creator pid {header.creator_pid} died while initialising it"
    return f"owner pid {header.owner_pid or header.creator_pid} dead"


def _lock_held(fd: int) -> bool:
    """Whether another open file holds the segment's ``flock`` now (never waits)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def join_existing(engine_id: str, *, timeout_s: float = 30.0) -> Segment:
    """Join a running engine's segment without knowing its geometry (tier workers).

    Geometry, ring area and fingerprint are taken from the segment's header;
    waits up to ``timeout_s`` for the segment to exist and be ready. Raises
    :class:`SegmentTimeoutError` naming the segment when it never appears,
    and :class:`SegmentError` when its owner is dead (nothing to serve).
    """
    name = segment_name(engine_id)
    deadline = time.monotonic() + timeout_s
    while True:
        shm = open_when_present(
            lambda: posix_ipc.SharedMemory(name), deadline, 0.02, lambda: SegmentTimeoutError(
                f"segment {name} of engine {engine_id!r} does not exist after {timeout_s:g} s "
                f"(is the engine running? `shmtier segments` lists what exists)"))
        try:
            header = _read_header(shm.fd)
            if header is None or header.magic != MAGIC or header.state != READY:
                if time.monotonic() > deadline:
                    raise SegmentTimeoutError(f"segment {name} is not ready after {timeout_s:g} s")
                time.sleep(0.02)
                continue
            if not header.owner_alive():
                raise SegmentError(f"segment {name}: its owner pid "
                                   f"{header.owner_pid or header.creator_pid} is not running")
            layout = SegmentLayout.for_geometry(header.geometry, header.layout.rings_len)
            buf = mmap.mmap(shm.fd, layout.total_len)
            return Segment(name, buf, os.fstat(shm.fd).st_ino, layout, is_creator=False,
                           is_owner=False)
        finally:
            shm.close_fd()
