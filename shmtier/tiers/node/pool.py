"""One node-wide pool of KV chunks in shared memory, mapped by every engine of one layout
on the host (``NodePool``; the design and its reasons: docs/node-pool.md).

Who calls, from which process:

- an engine's scheduler process: ``attach(register=True)`` (an engine-table entry) at
  start, ``lookup`` and ``count_lookup`` on its scheduler thread (lock-free, never block),
  ``stats``, ``detach`` at shutdown (the last engine out unlinks the pool unless ``keep``);
- its tier workers: ``attach(register=False)`` (map only), ``store_many`` /
  ``load_many`` (take the pool's lock twice per batch, copy outside it), ``close``;
- tools and tests: ``NodePool.open`` (an existing pool, any geometry), ``check``,
  ``sweep``; module ``tools.py`` lists and cleans pools without attaching.

Its parts: ``opening.py`` creates or joins the segment, ``mutations.py`` holds the
elementary changes under the lock (a mixin of ``NodePool``), ``repair.py`` the repair,
sweeps and ``check``, over ``layout.py``'s views, ``index.py``, ``lru.py`` and ``tables.py``.

Data flow and locking (``L`` = the pool's lock: ``flock`` on the process's own descriptor
of the segment file, released by the kernel when its holder dies; ``seq`` = the seqlock
word, odd while an index entry or a READY row changes)::

    store_many(keys, srcs)                        load_many(keys, dsts)
      L: find key? EXISTS (bump LRU)                L: find key? else MISS
         reserve: free list, else evict LRU            pin (pid, start, row); bump LRU
           unpinned READY row [seq odd: out of         note its CRC
           index]; row WRITING by (pid, start)
      copy src -> row + CRC-32C (one pass)          copy row -> dst + CRC-32C (one pass)
      L: key READY meanwhile? free row, EXISTS      L: unpin; CRC differs? CORRUPT: drop the
         else [seq odd: CRC, READY, index]             key [seq odd: out of index]; the row
         LRU tail                                      is freed by its last unpin

    lookup(key)   (scheduler thread, no lock, no wait)
      s = seq (odd: try again) -> probe index, compare key, state READY -> seq == s ?
      answer : try again (bounded, then MISS: a false MISS costs a recompute)

Every process entering ``L`` writes itself into the header's ``holder`` and clears it on
the way out; finding it set means the last holder died (or raised) inside: ``repair.py``
rebuilds the index, lists and counts from the rows before anything else. Dead pinners,
dead writers and dead engines are swept when a store finds nothing to evict, and on
attach and detach. A row a dead writer left is never READY, so never served; a load
verifies the CRC of what it copied, so a row changed under it is never served either.

Blocks: ``attach``/``detach``/``close``/``check``/``sweep`` and the two batch calls wait
for ``L`` (up to ``lock_timeout_s``, then NodePoolError / ERROR outcomes); ``attach`` also
up to ``timeout_s`` for a pool another process is creating. ``lookup``, ``count_lookup``
and ``stats`` never wait.

The seqlock relies on x86-64's ordering of plain loads and stores (TSO), as CPython
issues them through ``memoryview``; docs/node-pool.md says what other CPUs would need.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import threading
import time

import numpy as np

from shmtier.shared import procinfo
from shmtier.shared.codec import copy_crc32c, crc32c
from shmtier.shared.jobs import Outcome
from shmtier.shared.segment import _unlink_if_same
from shmtier.storage.chunk_names import key_problem
from shmtier.tiers.node import _index
from shmtier.tiers.node import mutations as _mutations
from shmtier.tiers.node import repair as _repair
from shmtier.tiers.node.index import HashIndex, key_hash
from shmtier.tiers.node.layout import (
    H_CORRUPT,
    H_DROPPED,
    H_EVICTIONS,
    H_FREE_COUNT,
    H_HOLDER_PID,
    H_HOLDER_START,
    H_KEEP,
    H_PINS,
    H_READY,
    H_REPAIRS,
    H_SEQ,
    H_SWEPT_ENGINES,
    H_SWEPT_PINS,
    H_SWEPT_WRITES,
    H_WRITING,
    R_CRC,
    R_KEY,
    R_KHASH,
    R_KLEN,
    R_PINS,
    R_STATE,
    ROW_BYTES,
    ROW_READY,
    RW32,
    Identity,
    NodeLayout,
    Views,
    check_pool_name,
    shm_name,
)
from shmtier.tiers.node.lru import RowLists
from shmtier.tiers.node.mutations import Mutations
from shmtier.tiers.node.opening import (  # noqa: F401 (NodePoolMismatchError: callers catch it here)
    NodePoolError,
    NodePoolMismatchError,
    open_pool,
)
from shmtier.tiers.node.tables import EngineTable, PinTable

logger = logging.getLogger(__name__)

# _index.c keeps its own copy of the record layout (C cannot import layout.py): a layout
# change that leaves it behind fails here, at import, not as wrong answers
_C_LAYOUT = (_index.ROW_BYTES, _index.R_STATE, _index.R_KLEN, _index.R_KHASH, _index.R_KEY,
             _index.ROW_READY, _index.H_SEQ)
if _C_LAYOUT != (ROW_BYTES, R_STATE, R_KLEN, R_KHASH, R_KEY, ROW_READY, H_SEQ):
    raise ImportError(f"shmtier/tiers/node/_index.c's layout constants {_C_LAYOUT} differ "
                      f"from layout.py's: rebuild the extension after changing both")

#: seqlock reads the Python reference lookup tries before it answers MISS; after half of
#: them found a mutation in progress it yields its CPU once (a writer preempted inside its few stores
#: on this CPU gets to finish them: docs/node-pool.md, "Lookups")
LOOKUP_TRIES = 64
_YIELD_AT = LOOKUP_TRIES // 2
#: the same bound for the C lookup, as time (a try there takes tens of nanoseconds: 64 of
#: them would give up inside a writer's few stores): about what the reference's tries take
LOOKUP_BUDGET_NS = 30_000


def _flock(fd: int, timeout_s: float) -> bool:
    """Take the exclusive ``flock`` of ``fd``; poll with a backoff from 20 µs to 1 ms
    (critical sections are microseconds long: ``segment._lock``'s 5 ms would be the wait)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    deadline, delay = time.monotonic() + timeout_s, 20e-6
    while True:
        time.sleep(delay)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            delay = min(delay * 2, 1e-3)


class NodePool(Mutations):
    """A process's mapping of one node pool (the module docstring says who calls what)."""

    def __init__(self, pool: str, fd: int, mm: mmap.mmap, ident: Identity, *,
                 engine_id: str, keep: bool, lock_timeout_s: float):
        self.name = pool
        self.layout = layout = ident.layout
        self.engine_id = engine_id
        self.keep = keep
        self.boot = ident.boot_id
        self.lock_timeout_s = lock_timeout_s
        self.registered = False
        self.closed = False
        self._fd, self._mm, self._inode = fd, mm, os.fstat(fd).st_ino
        self.v = v = Views(mm, layout)
        self.index = HashIndex(v, layout.rows, layout.slots)
        # the lock-free lookups in C (``_index.c``; the Python reference: ``lookup_reference``)
        self._c_lookup = functools.partial(_index.lookup, v.q, v.index, v.meta, layout.rows)
        self._c_lookup_many = functools.partial(_index.lookup_many, v.q, v.index, v.meta,
                                                layout.rows)
        self.lists = RowLists(self.v)
        self.pins = PinTable(self.v)
        self.engines = EngineTable(self.v)
        self._me = procinfo.me()
        self._tlock = threading.Lock()
        self._slot = -1           # this engine's entry in the engine table
        # rows reserved and (row, entry) pins taken by a batch that could not finish: given
        # back the next time this process holds the lock
        self._abandoned_rows: list[int] = []
        self._abandoned_pins: list[tuple[int, int]] = []

    # -- opening and closing -----------------------------------------------------------

    @classmethod
    def attach(cls, name: str, *, row_bytes: int, size_bytes: int, fingerprint: str,
               engine_id: str, keep: bool = False, register: bool = True,
               timeout_s: float = 30.0, lock_timeout_s: float = 10.0) -> "NodePool":
        """Create or join pool ``name`` (``register=True``: an engine's scheduler process,
        which gets an engine-table entry; ``register=False``: its tier workers, which map
        an existing pool only). Raises ValueError for a bad name or size,
        NodePoolMismatchError when the pool was made with another ``row_bytes``,
        ``size_bytes`` or ``fingerprint`` (naming each and both values), NodePoolError
        (no such pool for a worker; engine table full; lock held too long), or
        ``SegmentSpaceError`` when ``/dev/shm`` cannot hold it (nothing left behind)."""
        check_pool_name(name)
        layout = NodeLayout.for_pool(row_bytes, size_bytes)
        fd, mm, ident = open_pool(name, layout, fingerprint, create=register,
                                  timeout_s=timeout_s, lock_timeout_s=lock_timeout_s)
        pool = cls(name, fd, mm, ident, engine_id=engine_id, keep=keep,
                   lock_timeout_s=lock_timeout_s)
        try:
            if register:
                pool._register()
            else:
                pool._slot = pool.engines.find(engine_id)
        except BaseException:
            pool.close()
            raise
        return pool

    @classmethod
    def open(cls, name: str, *, timeout_s: float = 5.0, lock_timeout_s: float = 10.0) -> "NodePool":
        """Map the existing pool ``name`` whatever its geometry (tools, tests)."""
        check_pool_name(name)
        fd, mm, ident = open_pool(name, None, None, create=False, timeout_s=timeout_s,
                                  lock_timeout_s=lock_timeout_s)
        return cls(name, fd, mm, ident, engine_id="", keep=True, lock_timeout_s=lock_timeout_s)

    def _register(self) -> None:
        pid, start = self._me
        with self._locked():
            _repair.sweep(self, _repair.Liveness(self.boot))
            self._slot = self.engines.add(self.engine_id, pid, start, self.keep)
            self.v.q[H_KEEP] = 0  # the last engine out decides again
        if self._slot < 0:
            raise NodePoolError(f"node pool {self.name!r}: its engine table is full (every "
                                f"one of its {len(self.v.engines)} entries is a live engine)")
        self.registered = True

    def detach(self) -> None:
        """Leave the pool (an engine's scheduler process, at shutdown): its entry is
        removed, with those of dead engines; the process that removes the last one unlinks
        the pool unless it (or a dead engine dropped with it) asked to keep it. Then
        ``close``. Idempotent."""
        if self.closed:
            return
        try:
            if self.registered:
                pid, start = self._me
                with self._locked():
                    if self.engines.holds(self._slot, pid, start):
                        self.engines.remove(self._slot)
                    self._sweep_and_leave(self.keep)
                self.registered = False
        finally:
            self.close()

    def _sweep_and_leave(self, keep: bool, include_kept: bool = False) -> dict:
        """Sweep (under the lock); with no engine left, unlink the pool unless ``keep``, a
        dead engine dropped now asked to keep it, or the last one out did (``H_KEEP``;
        ignored with ``include_kept``)."""
        pins, writes, keeps = _repair.sweep(self, _repair.Liveness(self.boot))
        removed = False
        if not self.engines.used():
            q = self.v.q
            if keep or not include_kept and (any(keeps) or q[H_KEEP]):
                q[H_KEEP] = 1
            else:
                _unlink_if_same(shm_name(self.name), self._inode)
                removed = True
                logger.info("node pool %s: last engine out, removed", self.name)
        return {"pins": pins, "writes": writes, "engines": len(keeps), "removed": removed}

    def close(self) -> None:
        """Unmap (tier workers; ``detach`` for an engine). Rows a failed batch left
        reserved are freed first when the lock can be had. Idempotent."""
        if self.closed:
            return
        if (self._abandoned_rows or self._abandoned_pins) and os.getpid() == self._me[0]:
            with contextlib.suppress(NodePoolError):
                with self._locked():
                    pass  # _locked frees them
        self.closed = True
        self.index = self.lists = self.pins = self.engines = None
        self.v.release()
        try:
            self._mm.close()
        except BufferError:
            logger.debug("node pool %s still exported; unmapped when released", self.name)
        os.close(self._fd)

    def __enter__(self) -> "NodePool":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # -- the lock ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self):
        """Hold the pool's lock; repair first when the last holder did not leave cleanly.
        The holder mark is cleared only when the body completes: one that raises leaves
        it for the next locker to repair."""
        if os.getpid() != self._me[0]:
            raise NodePoolError(f"node pool {self.name!r}: mapped by pid {self._me[0]} and "
                                f"used in its forked child {os.getpid()}: attach in the child")
        with self._tlock:
            if not _flock(self._fd, self.lock_timeout_s):
                raise NodePoolError(
                    f"node pool {self.name!r}: its lock stayed held for {self.lock_timeout_s:g}"
                    f" s (holder pid {self.v.q[H_HOLDER_PID]})")
            q = self.v.q
            try:
                last = q[H_HOLDER_PID]
                q[H_HOLDER_START] = self._me[1]
                q[H_HOLDER_PID] = self._me[0]
                if last:
                    logger.warning("node pool %s: pid %d left its lock mid-mutation", self.name,
                                   last)
                    _repair.repair(self, _repair.Liveness(self.boot))
                if self._abandoned_rows or self._abandoned_pins:
                    self._give_back_abandoned()
                yield
                q[H_HOLDER_PID] = 0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _give_back_abandoned(self) -> None:
        pid, start = self._me
        for row in self._abandoned_rows:
            if self._writing_by_me(row, pid, start):
                self.free_row(row)
        for row, entry in self._abandoned_pins:
            self._unpin(row, entry, pid, start)
        self._abandoned_rows.clear()
        self._abandoned_pins.clear()

    # -- lock-free reads ---------------------------------------------------------------

    def lookup(self, key: bytes) -> bool:
        """Whether ``key`` is READY in the pool now (scheduler thread: no lock, no wait;
        at most one ``sched_yield``). A True may be evicted before its load (the load
        answers MISS); a False is at worst a false MISS while others mutate (bounded
        retries). In C (``_index.c``); ``lookup_reference`` is the same in Python."""
        return self._c_lookup(key, key_hash(key), LOOKUP_BUDGET_NS)

    def lookup_many(self, keys) -> list[bool]:
        """``lookup`` of each of ``keys`` under one seqlock bracket (the scheduler thread:
        no lock, no wait): the answers of one read of the index when no mutation ran
        meanwhile, else each key's own ``lookup`` (each answer as ``lookup``'s)."""
        keys = list(keys)
        return self._c_lookup_many(keys, [key_hash(key) for key in keys], LOOKUP_BUDGET_NS)

    def lookup_reference(self, key: bytes) -> bool:
        """``lookup`` in Python, the reference the C is tested against
        (tests/test_node_index_c.py)."""
        h = key_hash(key)
        q, find = self.v.q, self.index.find
        for n in range(LOOKUP_TRIES):
            seq = q[H_SEQ]
            if seq & 1:
                if n == _YIELD_AT:
                    os.sched_yield()
                continue
            found = find(key, h) >= 0
            if q[H_SEQ] == seq:
                return found
        return False

    def used_rows(self) -> int:
        """READY rows in the pool now, every engine's (lock-free: one header read)."""
        return int(self.v.q[H_READY])

    def count_lookup(self, hits: int, lookups: int) -> None:
        """Add to this engine's lookup counters (its scheduler process only; lock-free)."""
        if self.registered:
            self.engines.count(self._slot, "lookups", lookups)
            self.engines.count(self._slot, "hits", hits)

    def stats(self) -> dict:
        """The pool's figures now (lock-free; each figure exact, not one instant):
        rows, row_bytes, size_bytes, used/free/writing/dropped/pinned rows, pins, repairs,
        evictions, corrupt, swept, and per engine its entry and counters. Never waits; one
        pass over the row records and one ``/proc`` read per engine (whether it runs)."""
        v, q, L = self.v, self.v.q, self.layout
        alive = _repair.Liveness(self.boot)
        engines = []
        for slot in self.engines.used():
            e = v.engines[slot]
            entry = {"engine_id": self.engines.engine_id(slot), "pid": int(e["pid"]),
                     "alive": alive(e["pid"], e["start"]), "keep": bool(e["keep"])}
            entry.update({c: int(e[c]) for c in ("lookups", "hits", "stores", "exists",
                                                 "rejected", "loads", "misses", "corrupt",
                                                 "bytes_in", "bytes_out")})
            engines.append(entry)
        return {
            "pool": self.name, "rows": L.rows, "row_bytes": L.row_bytes,
            "size_bytes": L.size_bytes, "used": self.used_rows(), "free": int(q[H_FREE_COUNT]),
            "writing": int(q[H_WRITING]), "dropped": int(q[H_DROPPED]),
            "pinned": int(np.count_nonzero(v.rows["pins"])), "pins": int(q[H_PINS]),
            "repairs": int(q[H_REPAIRS]), "evictions": int(q[H_EVICTIONS]),
            "corrupt": int(q[H_CORRUPT]),
            "swept": {"pins": int(q[H_SWEPT_PINS]), "writes": int(q[H_SWEPT_WRITES]),
                      "engines": int(q[H_SWEPT_ENGINES])},
            "engines": engines,
        }

    # -- batches -----------------------------------------------------------------------

    def _buffer_problem(self, buf, what: str, *, writable: bool) -> str | None:
        try:
            mv = memoryview(buf)
        except TypeError:
            return f"{what} is {type(buf).__name__}, not a buffer"
        if not mv.c_contiguous or (writable and mv.readonly):
            return f"{what} must be a {'writable ' if writable else ''}contiguous buffer"
        if mv.nbytes != self.layout.row_bytes:
            return f"{what} has {mv.nbytes} bytes, the pool's rows {self.layout.row_bytes}"
        return None

    def _batch(self, keys, bufs, what: str, writable: bool, details) -> tuple[list, list]:
        """Outcomes (INVALID where a key or buffer is bad, else None) and the work items
        ``[i, key, hash, buffer]`` of a batch."""
        if len(keys) != len(bufs):
            raise ValueError(f"node pool {self.name!r}: {len(keys)} keys, {len(bufs)} {what}s")
        out, todo = [None] * len(keys), []
        for i, (key, buf) in enumerate(zip(keys, bufs)):
            problem = key_problem(key) or self._buffer_problem(buf, what, writable=writable)
            if problem:
                out[i] = Outcome.INVALID
                _note(details, i, problem)
            else:
                key = bytes(key)
                todo.append([i, key, key_hash(key), memoryview(buf).cast("B")])
        return out, todo

    def store_many(self, keys, srcs, details: dict | None = None) -> list[Outcome]:
        """Store each ``srcs[i]`` (``row_bytes`` bytes) under ``keys[i]``: OK, EXISTS (READY
        already, or stored by another engine meanwhile), REJECTED (no row free and every
        READY row pinned), INVALID (bad key or buffer) or ERROR (the lock). ``details``:
        a dict that gets ``{i: text}`` for outcomes that have one. Tier workers; blocks on
        the lock twice per batch, copies outside it."""
        out, todo = self._batch(keys, srcs, "src", False, details)
        pid, start = self._me
        reserved = []
        try:
            with self._locked():
                for item in todo:
                    i, key, h = item[0], item[1], item[2]
                    row = self.index.find(key, h)
                    if row >= 0:
                        self.lists.bump(row)
                        out[i] = Outcome.EXISTS
                        continue
                    row = self._reserve(key, h)
                    if row < 0:
                        out[i] = Outcome.REJECTED
                        _note(details, i, "every row of the pool is pinned or being written")
                        continue
                    item.append(row)
                    reserved.append(item)
            arena, stride, size = self.v.arena, self.layout.row_stride, self.layout.row_bytes
            for item in reserved:
                off = item[4] * stride
                if _mutations.crash_hook:
                    _mutations.crash_hook("store.copy", self, [it[4] for it in reserved])
                item.append(crc32c(item[1], copy_crc32c(arena[off:off + size], item[3])))
            with self._locked():
                for i, key, h, _, row, crc in reserved:
                    if not self._writing_by_me(row, pid, start):
                        out[i] = Outcome.ERROR
                        _note(details, i, "its reserved row was taken back (pool repaired)")
                    elif self.index.find(key, h) >= 0:
                        self.free_row(row)
                        out[i] = Outcome.EXISTS
                    else:
                        self._publish(row, h, crc)
                        out[i] = Outcome.OK
                reserved = []
                stored = out.count(Outcome.OK)
                self._count(stores=stored, exists=out.count(Outcome.EXISTS),
                            rejected=out.count(Outcome.REJECTED), bytes_in=stored * size)
        except NodePoolError as e:
            _errors(out, details, e)
        finally:
            self._abandoned_rows.extend(item[4] for item in reserved)
        return out

    def load_many(self, keys, dsts, details: dict | None = None) -> list[Outcome]:
        """Copy the chunk of each ``keys[i]`` into ``dsts[i]`` (writable, ``row_bytes``):
        OK (the bytes verified against their CRC), MISS (not READY, or the pin table
        full), CORRUPT (failed its CRC: the key is dropped from the pool; ``dsts[i]``
        undefined) or INVALID / ERROR as ``store_many``. Tier workers; blocks on the lock
        twice per batch, copies outside it."""
        out, todo = self._batch(keys, dsts, "dst", True, details)
        pid, start = self._me
        pinned = []
        try:
            with self._locked():
                for item in todo:
                    i, key, h = item[0], item[1], item[2]
                    row = self.index.find(key, h)
                    if row < 0:
                        out[i] = Outcome.MISS
                        continue
                    entry = self.pins.add(pid, start, row)
                    if entry < 0:
                        _repair.sweep(self, _repair.Liveness(self.boot))
                        entry = self.pins.add(pid, start, row)
                    if entry < 0:
                        out[i] = Outcome.MISS
                        _note(details, i, "the pool's pin table is full")
                        continue
                    if _mutations.crash_hook:
                        _mutations.crash_hook("load.pin", self, [row])
                    self.v.r32[row * RW32 + R_PINS] += 1
                    self.lists.bump(row)
                    item += [row, entry, self.v.r32[row * RW32 + R_CRC]]
                    pinned.append(item)
            arena, stride, size = self.v.arena, self.layout.row_stride, self.layout.row_bytes
            for item in pinned:
                i, key, _, dst, row, _, crc = item
                off = row * stride
                if _mutations.crash_hook:
                    _mutations.crash_hook("load.copy", self, [row])
                good = crc32c(key, copy_crc32c(dst, arena[off:off + size])) == crc
                out[i] = Outcome.OK if good else Outcome.CORRUPT
                if not good:
                    _note(details, i, "checksum")
            with self._locked():
                for i, key, h, _, row, entry, crc in pinned:
                    self._unpin(row, entry, pid, start)
                    if out[i] is Outcome.CORRUPT:
                        self._drop(row, key, crc)
                pinned = []
                self._count(loads=out.count(Outcome.OK), misses=out.count(Outcome.MISS),
                            corrupt=out.count(Outcome.CORRUPT),
                            bytes_out=out.count(Outcome.OK) * size)
        except NodePoolError as e:
            _errors(out, details, e)  # a copy already verified stays OK
        finally:
            self._abandoned_pins.extend((item[4], item[5]) for item in pinned)
        return out

    def _count(self, **counts: int) -> None:
        """Add to this engine's counters (under the lock: several workers write them)."""
        slot = self._slot
        if not self.engines.is_entry_of(slot, self.engine_id):
            slot = self._slot = self.engines.find(self.engine_id) if self.engine_id else -1
        if slot >= 0:
            for counter, n in counts.items():
                if n:
                    self.engines.count(slot, counter, n)

    # -- tools -------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Every invariant that does not hold now (empty: consistent); takes the lock."""
        with self._locked():
            return _repair.check(self)

    def sweep(self, *, remove_unused: bool = False, include_kept: bool = False) -> dict:
        """Drop what dead processes left (pins, half-written rows, engine entries) now;
        ``remove_unused``: then unlink the pool if no engine is left in it and none asked
        to keep it (unless ``include_kept``) (``shmtier clean``, an engine's guardian).
        Returns how many of each it dropped (``pins``, ``writes``, ``engines``) and whether
        it ``removed`` the pool. Takes the lock."""
        with self._locked():
            if remove_unused:
                return self._sweep_and_leave(False, include_kept)
            pins, writes, keeps = _repair.sweep(self, _repair.Liveness(self.boot))
        return {"pins": pins, "writes": writes, "engines": len(keeps), "removed": False}


def _errors(out: list, details: dict | None, error: Exception) -> None:
    """Every key of a batch not decided yet: ERROR, with ``error`` as its detail."""
    for i, outcome in enumerate(out):
        if outcome is None:
            out[i] = Outcome.ERROR
            _note(details, i, str(error))


def _note(details: dict | None, i: int, text: str) -> None:
    if details is not None:
        details[i] = text
