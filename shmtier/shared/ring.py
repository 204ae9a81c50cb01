"""Job and result rings of the tier workers: SPSC slot rings in the segment's ring area.

Who uses what (docs/design.md §1, §4)::

    scheduler process (creator)                         tier worker i (attacher)
    RingSet.create(...) ─ creates every semaphore        RingSet.attach(..., worker=i)
    rs.worker(i).jobs.try_put(job) ──── job ring i ────▶ w.jobs.get_many(...)
    rs.worker(i).results.get_many(...) ◀─ result ring i ─ w.results.try_put(result)
    rs.worker(i).last_beat()        ◀── heartbeat i ──── w.beat()

Every ring has exactly one producer and one consumer (single-producer /
single-consumer): the scheduler thread that dispatches is the only producer of
every job ring and the only consumer of every result ring; worker ``i`` is the
only consumer of job ring ``i`` and the only producer of result ring ``i``.
Nothing here is safe for two producers or two consumers of one ring.

Layout of the ring area (little-endian; every block 64-byte aligned)::

    area header   64 B   magic (written last by the creator), version, num_workers,
                         slots, slot_size, creator pid + start time, boot id
    control       CONTROL_SIZE B x num_workers: heartbeat ns (CLOCK_MONOTONIC), holder
                         pid, holder start time, claims (how many processes claimed
                         it); then the worker's counters (``WorkerCounters``: jobs
                         done, logical bytes moved, codec ns, failed keys); then its
                         tiers' counters (``TIER_COUNTERS`` for each of the pool's
                         first ``MAX_COUNTED_TIERS`` tiers: what a tier's backend
                         counts that no result shows, e.g. symbolic links refused);
                         written only by the slot's holder, read by anyone (the tier's
                         scheduler half for its metrics, ``shmtier top``, ``shmtier
                         workers --metrics-port``)
    per worker i: job ring i, then result ring i; each ring:
        ring header 192 B: line 0 slots/slot_size, line 1 head (producer's counter),
                           line 2 tail (consumer's counter) - separate cache lines
        slots       slots x slot_size: u32 payload length, u32 low bits of the
                    sequence number, payload (at most slot_size - 8 bytes)

``head`` counts items ever put, ``tail`` items ever taken; slot ``n % slots``
holds item ``n``. Each ring has two POSIX counting semaphores, named
``<segment name>.w<i>.<job|res>.<items|spaces>`` (in /dev/shm as
``sem.shmtier_...``): *items* (initially 0) counts filled slots, *spaces*
(initially ``slots``) free ones.

Protocol and memory ordering (no mutex anywhere)::

    producer: spaces.trywait ─ fail ─▶ return False (ring full: backpressure)
              write slot[head % slots]; head += 1 (commit); items.post
    consumer: items.wait (sleeps, no spinning); take more tokens with trywait
              while items.value says some are there (one wake-up, many items);
              copy the k slots out; tail += k (commit); spaces.post k times

``sem_post`` is a release and ``sem_wait`` an acquire operation on the
semaphore word (and successive posts form a release sequence), so a consumer
that holds k item tokens sees the k slots fully written, and a producer that
holds a space token sees the consumer done reading that slot — on any CPU, not
only on x86. The ``head``/``tail`` counters are not needed for that; they are
the commit points that crash recovery and metrics (``depth()``) read.

Crash behaviour (the ring never hands out a torn or foreign payload):

* consumer killed while sleeping in ``get``: nothing changed; a replacement
  attaches and continues at ``tail`` (no item lost or doubled).
* consumer killed after taking tokens but before ``tail += k``: the items are
  still in the ring (not *taken*), but k item tokens are gone, so they would
  wait for later posts. Killed after ``tail += k`` but before posting spaces:
  the items count as taken (the pool's business) and up to k spaces are gone.
* producer killed while writing a slot (before ``head += 1``): the item never
  existed; its space token is gone. Killed after ``head += 1`` but before
  posting items: the item is complete and committed, its token is missing.

Lost tokens are restored by :meth:`Ring.resync`, run by the live end *after*
the other end is known dead and *before* a replacement attaches: it sets items
to ``head - tail`` and spaces to ``slots - (head - tail)``.
:meth:`WorkerRings.recover` does that for both rings of a dead worker. The
pool's sequence for worker i: confirm the process is dead, resync and drain its
result ring (those results are valid), read ``jobs.tail`` — every job the
scheduler put with sequence number below it was taken by the dead worker and
is failed by the pool — resync the job ring (optionally discarding the jobs
still in it, which the pool then fails too), start the replacement. Without
lost tokens (the common case: the worker died while sleeping or while working
on a job) resync is a no-op. A waiter killed inside ``sem_wait`` leaves glibc's
waiter count raised, so later posts on that semaphore make one futex syscall
each (still correct; measured here +0.16 µs per post); recreating the ring set
(scheduler restart) resets it.

May block: only ``get``/``get_many`` (at most ``timeout_s``) and
``RingSet.attach`` (at most ``timeout_s``, waiting for the creator). ``try_put``,
``try_get``, ``beat`` and everything else never block.

Nothing here imports torch or vLLM (tier workers import it).

Size (over 600 lines): one contract between two process kinds, a third of it its
documentation; what tools read of an area, and stale-semaphore cleanup: ``ring_tools.py``.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass

import posix_ipc

from shmtier.shared import procinfo
from shmtier.shared.ipc_wait import open_when_present
from shmtier.shared._wire import RingPort

logger = logging.getLogger(__name__)

AREA_MAGIC = b"SHMRINGS"
AREA_VERSION = 2  # 2: the tiers' counters in each control block
AREA_HEADER_SIZE = 64
#: What a worker slot counts per tier (by the pool config's tier index), in this order:
#: counts a tier's backend keeps that no result carries (``TierBackend.worker_counts``),
#: named as the backends' counter fields are. A tier that does not keep one counts 0.
TIER_COUNTERS = ("links_refused", "corrupt_remove_failed", "scan_errors")
MAX_COUNTED_TIERS = 11  # as the stats area's secondary tiers; later tiers are not counted
_TIER_WORDS = 8  # first word of the tiers' counters in a control block
RING_HEADER_SIZE = 192
SLOT_HEADER_SIZE = 8
ALIGN = 64
CONTROL_SIZE = 384  # per worker: 8 words, then the tiers' counters (33 words), 64-aligned
assert (_TIER_WORDS + MAX_COUNTED_TIERS * len(TIER_COUNTERS)) * 8 <= CONTROL_SIZE
SEM_NAME_MAX = 251  # NAME_MAX (255) minus glibc's "sem." prefix in /dev/shm
SHM_DIR = "/dev/shm"

# magic, version, num_workers, slots, slot_size, creator pid, pad, creator start, boot id
_AREA = struct.Struct("<8sIIIIIIQ16s")
_RING_STATIC = struct.Struct("<II")  # slots, slot_size (line 0 of a ring header)
_HEAD = 64 // 8  # index into the ring header cast to uint64
_TAIL = 128 // 8
# per-worker control block, as uint64 indexes
_BEAT_NS, _PID, _START, _CLAIMS = 0, 1, 2, 3
# ...and the worker's counters (monotonic over the slot's holders; zero when the rings are
# created): one writer (the holder), aligned 8-byte words, so readers never see a torn one
_JOBS, _BYTES, _CODEC_NS, _FAILED_KEYS = 4, 5, 6, 7

KINDS = ("job", "res")
#: Named semaphores of one worker's rings (items and spaces of each kind); each one
#: takes a page of /dev/shm.
SEMAPHORES_PER_WORKER = 2 * len(KINDS)


class RingError(RuntimeError):
    """Base class of every ring failure."""


class RingAttachError(RingError):
    """The rings to attach to do not exist (yet, or any more) or do not match."""


class RingBusyError(RingError):
    """Another live process already holds this worker's rings."""


class RingCorruptError(RingError):
    """A slot does not hold the item the counters say it should (protocol misuse)."""


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _check_geometry(num_workers: int, slots: int, slot_size: int) -> None:
    problems = []
    if not 1 <= num_workers <= 4096:
        problems.append(f"num_workers={num_workers} (must be in 1..4096)")
    if not 1 <= slots <= posix_ipc.SEMAPHORE_VALUE_MAX:
        problems.append(f"slots={slots} (must be in 1..{posix_ipc.SEMAPHORE_VALUE_MAX})")
    if slot_size < 2 * SLOT_HEADER_SIZE or slot_size % 8 or slot_size >= 1 << 32:
        problems.append(f"slot_size={slot_size} (must be a multiple of 8, at least "
                        f"{2 * SLOT_HEADER_SIZE} and below 4 GiB)")
    if problems:
        raise ValueError("invalid ring geometry: " + "; ".join(problems))


def ring_nbytes(slots: int, slot_size: int) -> int:
    """Bytes of one ring (header + slots), 64-byte aligned."""
    return _round_up(RING_HEADER_SIZE + slots * slot_size)


def ring_area_nbytes(num_workers: int, slots: int, slot_size: int) -> int:
    """Bytes of the ring area for ``num_workers`` job + result rings of ``slots`` slots.

    ``slot_size`` includes the 8-byte slot header, so the largest payload is
    ``slot_size - 8``. Pass the result as ``rings_len`` to ``open_segment``.
    """
    _check_geometry(num_workers, slots, slot_size)
    return (AREA_HEADER_SIZE + num_workers * CONTROL_SIZE
            + 2 * num_workers * ring_nbytes(slots, slot_size))


def semaphore_name(segment_name: str, worker: int, kind: str, which: str) -> str:
    """POSIX name of one ring semaphore, e.g. ``/shmtier_e1.w3.job.items``.

    Raises ValueError when the name would exceed the 251-character limit.
    """
    base = segment_name if segment_name.startswith("/") else "/" + segment_name
    name = f"{base}.w{worker}.{kind}.{which}"
    if len(name) - 1 > SEM_NAME_MAX:
        raise ValueError(
            f"semaphore name {name[:40]}... is {len(name) - 1} characters; POSIX semaphores "
            f"allow {SEM_NAME_MAX} here (use a shorter engine id)"
        )
    return name


def _unlink_sem(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def _create_sem(name: str, value: int) -> posix_ipc.Semaphore:
    """Create ``name`` exclusively (0600); a leftover of a dead owner is replaced."""
    try:
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=value)
    except posix_ipc.ExistentialError:
        logger.warning("replacing stale ring semaphore %s", name)
        _unlink_sem(name)
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=value)


def _set_sem(sem: posix_ipc.Semaphore, value: int) -> None:
    """Move a semaphore to ``value`` (only while nobody else uses it)."""
    while sem.value > value:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            break
    for _ in range(value - sem.value):
        sem.release()


class Ring:
    """One single-producer / single-consumer ring (see the module docstring).

    Built by :class:`RingSet`; a process uses either the producer half
    (``try_put``) or the consumer half (``get``, ``get_many``, ``try_get``),
    from one thread at a time. ``max_payload`` is the largest payload a slot
    holds. The non-blocking data path (putting, taking what is there) is
    ``shmtier.shared._wire.RingPort``, in C; waiting for items, counters and
    recovery are here.
    """

    def __init__(self, region: memoryview, items: posix_ipc.Semaphore,
                 spaces: posix_ipc.Semaphore, slots: int, slot_size: int, label: str):
        self.label = label
        self.slots = slots
        self.slot_size = slot_size
        self.max_payload = slot_size - SLOT_HEADER_SIZE
        self._region = region
        self._ctr = region[:RING_HEADER_SIZE].cast("Q")
        self._items = items
        self._spaces = spaces
        # Each end keeps its own counter privately (the port's head and tail) and
        # publishes it; it is the only writer of that word, so the private copy is
        # always current.
        self._port = RingPort(region, slots, slot_size, items.name, spaces.name, label,
                              RingCorruptError, self._dropped_tokens)
        # try_put(payload) -> bool: append one payload, never blocking; False when the
        # ring is full (backpressure). Producer only (one thread). ValueError when the
        # payload is longer than max_payload (split it first: jobs.split_job).
        self.try_put = self._port.try_put
        # depth() -> int: items put and not yet taken (a snapshot; either end, any
        # process). Read every step by the pool's poll and its ring-depth gauge.
        self.depth = self._port.depth

    def _dropped_tokens(self, n: int) -> None:
        logger.warning("%s: %d item token(s) without an item dropped", self.label, n)

    def _init_header(self) -> None:
        _RING_STATIC.pack_into(self._region, 0, self.slots, self.slot_size)
        self._ctr[_HEAD] = self._ctr[_TAIL] = self._port.head = self._port.tail = 0

    # --- consumer half ---

    def get(self, timeout_s: float | None = None) -> bytes | None:
        """Take the oldest payload, sleeping up to ``timeout_s`` (None: forever).

        Consumer only. Returns None on timeout. ``timeout_s=0`` never blocks.
        """
        got = self.get_many(1, timeout_s)
        return got[0] if got else None

    def try_get(self) -> bytes | None:
        """Take the oldest payload if there is one; never blocks. Consumer only."""
        got = self.get_many(1, 0)
        return got[0] if got else None

    def get_many(self, max_items: int, timeout_s: float | None = None) -> list[bytes]:
        """Take up to ``max_items`` payloads, oldest first, in one wake-up.

        Consumer only (one thread). Sleeps on the items semaphore (no spinning) up to
        ``timeout_s`` (None: forever, 0: never blocks) for the first payload,
        then takes whatever else is already there without blocking. Returns an
        empty list on timeout. A signal handled by Python does not end the wait
        early (the remaining time is waited); one that raises (SIGINT) does.
        """
        if timeout_s is not None and timeout_s <= 0:
            return self._port.take(max_items)  # never blocks
        if max_items < 1:
            raise ValueError(f"{self.label}: max_items must be >= 1, got {max_items}")
        if not self._wait(self._items, timeout_s):
            return []
        return self._port.take(max_items, True)  # the token just taken, and what else is there

    def _wait(self, sem: posix_ipc.Semaphore, timeout_s: float) -> bool:
        """Take one token of ``sem``, sleeping up to ``timeout_s`` (None: forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                sem.acquire(None if deadline is None else max(0.0, deadline - time.monotonic()))
                return True
            except posix_ipc.BusyError:
                return False
            except posix_ipc.SignalError:
                continue  # a Python handler ran; keep waiting for the rest

    # --- either end ---

    @property
    def head(self) -> int:
        """Items ever put (read from the segment; the producer's commit counter)."""
        return self._ctr[_HEAD]

    @property
    def tail(self) -> int:
        """Items ever taken (read from the segment; the consumer's commit counter)."""
        return self._ctr[_TAIL]

    def free_slots(self) -> int:
        """Slots a ``try_put`` can take right now (the spaces semaphore's value).

        Exact for the producer: only it lowers the value; the consumer may
        raise it meanwhile (a slot handed back), never lower it."""
        return self._spaces.value

    def resync(self, discard_pending: bool = False) -> int:
        """Restore the semaphores from the counters after the other end died.

        Call from the live end, after the other end's process is known dead
        and before a replacement attaches, while this end is not inside a ring
        call. Sets items to ``head - tail`` and spaces to the rest; with
        ``discard_pending`` the pending items are dropped first (``tail =
        head``). Returns the number of items pending afterwards.
        """
        head, tail = self._ctr[_HEAD], self._ctr[_TAIL]
        if not 0 <= head - tail <= self.slots:
            raise RingCorruptError(
                f"{self.label}: head {head} and tail {tail} are not within {self.slots} slots"
            )
        if discard_pending:
            self._ctr[_TAIL] = tail = head
        self._port.head, self._port.tail = head, tail
        pending = head - tail
        _set_sem(self._items, pending)
        _set_sem(self._spaces, self.slots - pending)
        return pending

    def __repr__(self) -> str:
        return f"<Ring {self.label} head={self.head} tail={self.tail} slots={self.slots}>"

    def _release(self) -> None:
        self._port.close()
        for view in (self._ctr, self._region):
            try:
                view.release()
            except (BufferError, ValueError):
                pass


@dataclass(frozen=True)
class Heartbeat:
    """One worker's heartbeat word: last beat (CLOCK_MONOTONIC ns, 0 = never) and holder."""

    beat_ns: int
    pid: int
    start_time: int
    claims: int

    def age_s(self, now_ns: int | None = None) -> float:
        """Seconds since the last beat (inf if it never beat)."""
        if not self.beat_ns:
            return float("inf")
        return ((time.monotonic_ns() if now_ns is None else now_ns) - self.beat_ns) / 1e9


@dataclass(frozen=True)
class WorkerCounters:
    """What the holders of one worker slot did since the rings were created (the slot's
    counter words; each holder adds to them, so they survive a worker's restart):
    ``jobs`` (job parts run and answered), ``bytes`` (logical chunk bytes stored and
    loaded), ``codec_ns`` (time in the codec), ``failed_keys`` (keys answered ERROR,
    CORRUPT or INVALID)."""

    jobs: int
    bytes: int
    codec_ns: int
    failed_keys: int


class WorkerRings:
    """Worker ``index``'s job ring, result ring and heartbeat word.

    In the scheduler: ``jobs`` is put to, ``results`` taken from,
    ``last_beat()`` read, ``recover()`` run after the worker died. In the
    worker: ``claim()`` once, then ``jobs`` taken from, ``results`` put to,
    ``beat()`` at least every heartbeat interval (e.g. after every
    ``get_many`` with a timeout of the interval).
    """

    def __init__(self, index: int, jobs: Ring, results: Ring, control: memoryview):
        self.index = index
        self.jobs = jobs
        self.results = results
        self._ctl = control

    def beat(self) -> None:
        """Record 'alive now' (worker process; one 8-byte store, never blocks)."""
        self._ctl[_BEAT_NS] = time.monotonic_ns()

    def last_beat(self) -> Heartbeat:
        """The heartbeat word as last written (any process)."""
        ctl = self._ctl
        return Heartbeat(ctl[_BEAT_NS], ctl[_PID], ctl[_START], ctl[_CLAIMS])

    def tally(self, jobs: int, nbytes: int, codec_ns: int, failed_keys: int) -> None:
        """Add to the slot's counters (the holder only: one writer; four 8-byte stores,
        no lock, never blocks)."""
        ctl = self._ctl
        ctl[_JOBS] += jobs
        ctl[_BYTES] += nbytes
        ctl[_CODEC_NS] += codec_ns
        ctl[_FAILED_KEYS] += failed_keys

    def counters(self) -> WorkerCounters:
        """The slot's counters as last written (any process)."""
        ctl = self._ctl
        return WorkerCounters(ctl[_JOBS], ctl[_BYTES], ctl[_CODEC_NS], ctl[_FAILED_KEYS])

    def tally_tier(self, tier: int, counts) -> None:
        """Add ``counts`` (one int per ``TIER_COUNTERS`` name, in order) to tier ``tier``'s
        counters (the holder only; a tier from ``MAX_COUNTED_TIERS`` on is not counted).
        Never blocks."""
        if not 0 <= tier < MAX_COUNTED_TIERS:
            return
        ctl, base = self._ctl, _TIER_WORDS + tier * len(TIER_COUNTERS)
        for i, n in enumerate(counts):
            if n:
                ctl[base + i] += n

    def tier_counters(self, tier: int) -> tuple[int, ...]:
        """Tier ``tier``'s counters as last written (``TIER_COUNTERS`` order; zeros for a
        tier not counted). Any process."""
        if not 0 <= tier < MAX_COUNTED_TIERS:
            return (0,) * len(TIER_COUNTERS)
        base = _TIER_WORDS + tier * len(TIER_COUNTERS)
        return tuple(self._ctl[base:base + len(TIER_COUNTERS)])

    def claim(self) -> None:
        """Record the calling process as this worker slot's holder and beat.

        Worker process, once after attaching. Raises :class:`RingBusyError`
        if another live process holds the slot (a replacement started before
        its predecessor died, or a duplicate worker index).
        """
        ctl = self._ctl
        pid, start = ctl[_PID], ctl[_START]
        if pid and pid != os.getpid() and procinfo.is_alive(pid, start, procinfo.boot_id()):
            raise RingBusyError(
                f"worker slot {self.index} ({self.jobs.label}) is held by live pid {pid}"
            )
        me, started = procinfo.me()
        ctl[_PID], ctl[_START] = me, started
        ctl[_CLAIMS] += 1
        self.beat()

    def unclaim(self) -> bool:
        """Clear the holder record if the calling process is the holder (pid and start
        time match); returns whether it did.

        Worker process, on exit. A process that is not the holder (a duplicate worker
        whose :meth:`claim` failed) leaves the live holder's record alone. The pool
        clears a dead holder's record with :meth:`clear_dead_holder`.
        """
        ctl = self._ctl
        pid, started = procinfo.me()
        if ctl[_PID] != pid or ctl[_START] != started:
            return False
        ctl[_PID] = 0
        ctl[_START] = 0
        return True

    def clear_dead_holder(self) -> None:
        """Clear the holder record of a holder that is no longer running (the pool's
        recovery of a dead worker, in the scheduler). Raises :class:`RingBusyError` if
        the recorded holder still runs."""
        ctl = self._ctl
        pid, started = ctl[_PID], ctl[_START]
        if pid and procinfo.is_alive(pid, started, procinfo.boot_id()):
            raise RingBusyError(f"worker slot {self.index}: holder pid {pid} is still alive")
        if ctl[_PID] == pid and ctl[_START] == started:  # not re-claimed meanwhile
            ctl[_PID] = 0
            ctl[_START] = 0

    def holder_alive(self) -> bool:
        """True if the process that claimed this slot still runs (any process)."""
        ctl = self._ctl
        return bool(ctl[_PID]) and procinfo.is_alive(ctl[_PID], ctl[_START], procinfo.boot_id())

    def recover(self, discard_jobs: bool = False) -> tuple[int, int]:
        """Resync both rings after the worker died; scheduler only, before the replacement.

        Returns (jobs still pending in the job ring, results pending in the
        result ring). Read ``jobs.tail`` before (jobs below it were taken by
        the dead worker) and drain ``results`` after (they are valid results).
        """
        if self.holder_alive():
            raise RingBusyError(
                f"worker slot {self.index}: holder pid {self._ctl[_PID]} is still alive"
            )
        pending_results = self.results.resync()
        pending_jobs = self.jobs.resync(discard_pending=discard_jobs)
        self.clear_dead_holder()
        return pending_jobs, pending_results

    def _release(self) -> None:
        self.jobs._release()
        self.results._release()
        try:
            self._ctl.release()
        except (BufferError, ValueError):
            pass


class RingSet:
    """All workers' rings in one segment's ring area.

    Build with :meth:`create` (scheduler, the segment owner: creates every
    semaphore, initialises the area) or :meth:`attach` (worker process: opens
    the existing semaphores of one worker or all). Close before the segment:
    ``close()`` drops the handles and views; a creator's ``close()`` also
    unlinks every semaphore. Usable as a context manager.
    """

    def __init__(self, segment_name: str, region: memoryview, num_workers: int,
                 slots: int, slot_size: int, *, create: bool):
        self.segment_name = segment_name
        self.num_workers = num_workers
        self.slots = slots
        self.slot_size = slot_size
        self.is_creator = create
        self.closed = False
        self._unlinked = False
        self._region = region
        self._views: list[memoryview] = []
        self._sems: list[posix_ipc.Semaphore] = []
        self._created_names: list[str] = []
        self._workers: list[WorkerRings | None] = [None] * num_workers
        self._rings: list[Ring] = []
        self._control = region[AREA_HEADER_SIZE : AREA_HEADER_SIZE + num_workers * CONTROL_SIZE]
        self._views.append(self._control)

    # --- construction ---

    @classmethod
    def create(cls, segment_name: str, region: memoryview, num_workers: int, slots: int,
               slot_size: int) -> "RingSet":
        """Create the rings of ``num_workers`` workers (scheduler, segment owner only).

        ``region`` is the segment's ring area (``segment.rings``), at least
        ``ring_area_nbytes(...)`` bytes. Semaphores left by a dead previous
        owner of the same segment name are replaced. The area's magic is
        written last, so attachers never see half-made rings. If anything
        fails, what was created is removed again (reverse order) and the error
        propagates. Never blocks.
        """
        need = ring_area_nbytes(num_workers, slots, slot_size)
        if len(region) < need:
            raise ValueError(
                f"ring area of {segment_name} is {len(region)} bytes; {num_workers} workers x "
                f"{slots} slots x {slot_size} B need {need} (pass rings_len=ring_area_nbytes(...))"
            )
        self = cls(segment_name, region, num_workers, slots, slot_size, create=True)
        try:
            region[:AREA_HEADER_SIZE] = bytes(AREA_HEADER_SIZE)  # not ready while we build
            ctl = self._control.cast("Q")
            self._views.insert(0, ctl)
            for i in range(num_workers * CONTROL_SIZE // 8):
                ctl[i] = 0
            for i in range(num_workers):
                rings = []
                for kind in KINDS:
                    items = self._make_sem(semaphore_name(segment_name, i, kind, "items"), 0)
                    spaces = self._make_sem(semaphore_name(segment_name, i, kind, "spaces"), slots)
                    ring = self._ring(i, kind, items, spaces)
                    ring._init_header()
                    rings.append(ring)
                self._workers[i] = WorkerRings(i, rings[0], rings[1], self._worker_ctl(i))
            pid, start = procinfo.me()
            _AREA.pack_into(region, 0, b"\0" * 8, AREA_VERSION, num_workers, slots, slot_size,
                            pid, 0, start, procinfo.boot_id())
            region[:8] = AREA_MAGIC  # ready mark, last
        except BaseException:
            self._abort()
            raise
        return self

    @classmethod
    def attach(cls, segment_name: str, region: memoryview, *, worker: int | None = None,
               num_workers: int | None = None, slots: int | None = None,
               slot_size: int | None = None, timeout_s: float = 10.0) -> "RingSet":
        """Open the existing rings of ``worker`` (None: every worker).

        Worker processes (and tools). Geometry is read from the area; pass
        ``num_workers``/``slots``/``slot_size`` to have it checked. Waits up to
        ``timeout_s`` (polling every 5 ms) for the creator to finish; raises
        :class:`RingAttachError` naming the segment and the missing semaphore
        or the mismatching values, or when the creator is dead.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            magic, version, nw, ns, size, pid, _, start, boot = _AREA.unpack_from(region, 0)
            if magic == AREA_MAGIC:
                break
            if time.monotonic() > deadline:
                raise RingAttachError(
                    f"rings of segment {segment_name} were not created within {timeout_s:g} s "
                    f"(is the scheduler running with tier workers configured?)"
                )
            time.sleep(0.005)
        if version != AREA_VERSION:
            raise RingAttachError(f"rings of segment {segment_name}: layout version {version}, "
                                  f"{AREA_VERSION} expected by this process")
        expect = {"num_workers": (num_workers, nw), "slots": (slots, ns),
                  "slot_size": (slot_size, size)}
        diffs = [f"{k} is {have} in the segment, {want} expected by this process"
                 for k, (want, have) in expect.items() if want is not None and want != have]
        if diffs:
            raise RingAttachError(f"rings of segment {segment_name}: " + "; ".join(diffs))
        if len(region) < ring_area_nbytes(nw, ns, size):
            raise RingAttachError(f"ring area of {segment_name} is {len(region)} bytes, "
                                  f"too small for {nw} workers x {ns} slots x {size} B")
        if not procinfo.is_alive(pid, start, boot):
            raise RingAttachError(f"rings of segment {segment_name} were created by pid {pid}, "
                                  f"which is no longer running")
        if worker is not None and not 0 <= worker < nw:
            raise RingAttachError(f"rings of segment {segment_name}: worker {worker} does not "
                                  f"exist (num_workers is {nw})")
        self = cls(segment_name, region, nw, ns, size, create=False)
        try:
            ctl = self._control.cast("Q")
            self._views.insert(0, ctl)
            for i in range(nw) if worker is None else (worker,):
                rings = []
                for kind in KINDS:
                    items, spaces = (
                        self._open_sem(semaphore_name(segment_name, i, kind, which), deadline)
                        for which in ("items", "spaces"))
                    rings.append(self._ring(i, kind, items, spaces))
                self._workers[i] = WorkerRings(i, rings[0], rings[1], self._worker_ctl(i))
        except BaseException:
            self._abort()
            raise
        return self

    @classmethod
    def for_segment(cls, segment, *, create: bool, num_workers: int | None = None,
                    slots: int | None = None, slot_size: int | None = None,
                    worker: int | None = None, timeout_s: float = 10.0) -> "RingSet":
        """:meth:`create` or :meth:`attach` over an open ``Segment``'s ring area."""
        if create:
            return cls.create(segment.name, segment.rings, num_workers, slots, slot_size)
        return cls.attach(segment.name, segment.rings, worker=worker, num_workers=num_workers,
                          slots=slots, slot_size=slot_size, timeout_s=timeout_s)

    def _make_sem(self, name: str, value: int) -> posix_ipc.Semaphore:
        sem = _create_sem(name, value)
        self._created_names.append(name)
        self._sems.append(sem)
        return sem

    def _open_sem(self, name: str, deadline: float) -> posix_ipc.Semaphore:
        sem = open_when_present(
            lambda: posix_ipc.Semaphore(name), deadline, 0.005, lambda: RingAttachError(
                f"ring semaphore {name} of segment {self.segment_name} does not exist "
                f"(the scheduler closed its rings, or they were removed)"))
        self._sems.append(sem)
        return sem

    def _ring_offset(self, worker: int, kind: str) -> int:
        per_ring = ring_nbytes(self.slots, self.slot_size)
        first = AREA_HEADER_SIZE + self.num_workers * CONTROL_SIZE
        return first + (2 * worker + KINDS.index(kind)) * per_ring

    def _ring(self, worker: int, kind: str, items, spaces) -> Ring:
        off = self._ring_offset(worker, kind)
        region = self._region[off : off + ring_nbytes(self.slots, self.slot_size)]
        label = f"{self.segment_name}.w{worker}.{kind}"
        ring = Ring(region, items, spaces, self.slots, self.slot_size, label)
        self._rings.append(ring)
        self._views.extend((ring._ctr, region))
        return ring

    def _worker_ctl(self, worker: int) -> memoryview:
        view = self._control[worker * CONTROL_SIZE : (worker + 1) * CONTROL_SIZE].cast("Q")
        self._views.insert(0, view)
        return view

    def _abort(self) -> None:
        """Undo a failed construction: reverse order, nothing raised."""
        try:
            if self.is_creator:
                self._region[:8] = bytes(8)
        except (ValueError, TypeError):
            pass
        for name in reversed(self._created_names):
            _unlink_sem(name)
        self._unlinked = True
        self._close_handles()

    # --- use ---

    def worker(self, index: int) -> WorkerRings:
        """The rings of worker ``index`` (attached ones only in an attacher)."""
        rings = self._workers[index] if 0 <= index < self.num_workers else None
        if rings is None:
            raise KeyError(f"worker {index} of {self.segment_name} is not attached in this process")
        return rings

    @property
    def workers(self) -> list[WorkerRings]:
        """Every attached worker's rings, by index."""
        return [w for w in self._workers if w is not None]

    def owner_alive(self) -> bool:
        """True while the process that created the rings runs (workers poll this)."""
        magic, _, _, _, _, pid, _, start, boot = _AREA.unpack_from(self._region, 0)
        return magic == AREA_MAGIC and procinfo.is_alive(pid, start, boot)

    # --- teardown ---

    def unlink(self) -> None:
        """Remove every semaphore name this process created (creator); idempotent.

        Clears the area's ready mark first, so late attachers fail fast
        instead of opening removed names. A no-op in attachers and on the
        second call (never removes a newer creator's semaphores).
        """
        if self._unlinked or not self.is_creator:
            return
        self._unlinked = True
        try:
            self._region[:8] = bytes(8)
        except (ValueError, TypeError):
            pass  # region already released
        for name in reversed(self._created_names):
            _unlink_sem(name)

    def close(self, unlink: bool | None = None) -> None:
        """Close semaphore handles and drop the views; idempotent, never blocks.

        ``unlink`` defaults to True for the creator (the scheduler owns the
        names, as it owns the segment). Call before closing the segment.
        """
        if self.closed:
            return
        if self.is_creator if unlink is None else unlink:
            self.unlink()
        self._close_handles()

    def _close_handles(self) -> None:
        self.closed = True
        for ring in self._rings:  # the ports first: they hold the regions and semaphores
            ring._port.close()
        self._rings.clear()
        for sem in reversed(self._sems):
            try:
                sem.close()
            except posix_ipc.Error:
                pass
        self._sems.clear()
        for view in self._views:
            try:
                view.release()
            except (BufferError, ValueError):
                pass
        self._views.clear()
        self._workers = [None] * self.num_workers

    def __enter__(self) -> "RingSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
