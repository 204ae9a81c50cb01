"""The pool's elementary mutations, each under the lock: reserve a row for a store (free
list, else evict), publish it, unpin, drop a corrupt key, free a row. ``NodePool`` (pool.py)
inherits them; its batches call them.

Who calls: tier workers' ``store_many``/``load_many`` and the sweeps (``repair.py``), in any
process mapping the pool, always holding the pool's lock. Never blocks. Each change that a
lookup could see (an index entry, a READY row's state) is made with ``seq`` odd, for just
those stores: what to write is worked out first (docs/node-pool.md, "Lookups"). A row's
state, which repair trusts, is written before what repair derives from it (index, lists,
counts), and a reservation's writer before its state (docs/node-pool.md, "Repair").
"""

from __future__ import annotations

import logging

from shmtier.tiers.node import repair as _repair
from shmtier.tiers.node.layout import (
    DROPPED,
    FREE,
    H_CORRUPT,
    H_DROPPED,
    H_EVICTIONS,
    H_READY,
    H_SEQ,
    H_WRITING,
    R_CRC,
    R_KHASH,
    R_PINS,
    R_STATE,
    R_WPID,
    R_WSTART,
    ROW_READY,
    RW32,
    RW64,
    WRITING,
)

logger = logging.getLogger(__name__)

#: Test hook: called as ``crash_hook(point, pool, rows)`` at named points inside the
#: mutations and the batches' copies (``tests/test_node_pool.py`` stops a process there
#: and SIGKILLs it). None in production: each point costs one global read.
crash_hook = None


class Mutations:
    """Mixin of ``NodePool``: uses its ``v``, ``index``, ``lists``, ``pins``, ``boot``,
    ``name`` and ``_me``."""

    def _writing_by_me(self, row: int, pid: int, start: int) -> bool:
        r32 = self.v.r32
        return (r32[row * RW32 + R_STATE] == WRITING and r32[row * RW32 + R_WPID] == pid
                and self.v.r64[row * RW64 + R_WSTART] == start)

    def _reserve(self, key: bytes, h: int) -> int:
        """A row for ``key``, WRITING by this process: a free one, else the least recently
        used unpinned READY row evicted; -1 when there is none even after a sweep."""
        lists, v = self.lists, self.v
        row = lists.pop_free()
        if row < 0:
            row = lists.victim()
        if row < 0:
            _repair.sweep(self, _repair.Liveness(self.boot))
            row = lists.pop_free()
            if row < 0:
                row = lists.victim()
        if row < 0:
            return -1
        if v.r32[row * RW32 + R_STATE] == ROW_READY:
            self._evict(row)
        base = row * RW32
        v.r64[row * RW64 + R_WSTART] = self._me[1]
        v.r32[base + R_WPID] = self._me[0]
        v.set_key(row, key)
        v.r32[base + R_KHASH] = h
        v.r32[base + R_PINS] = 0
        v.r32[base + R_STATE] = WRITING  # last: from here on a dead writer's row is swept
        if crash_hook:
            crash_hook("reserve", self, [row])
        v.q[H_WRITING] += 1
        return row

    def _evict(self, row: int) -> None:
        q, r32 = self.v.q, self.v.r32
        writes = self.index.plan_remove(row, r32[row * RW32 + R_KHASH])
        q[H_SEQ] += 1
        r32[row * RW32 + R_STATE] = FREE
        if crash_hook:
            crash_hook("evict", self, [row])
        self.index.apply(writes)
        q[H_SEQ] += 1
        self.lists.unlink(row)
        q[H_READY] -= 1
        q[H_EVICTIONS] += 1

    def _publish(self, row: int, h: int, crc: int) -> None:
        q, r32, index = self.v.q, self.v.r32, self.index
        slot = index.free_slot(h)
        r32[row * RW32 + R_CRC] = crc
        q[H_SEQ] += 1
        r32[row * RW32 + R_STATE] = ROW_READY
        if crash_hook:
            crash_hook("publish", self, [row])
        index.slots[slot] = row
        q[H_SEQ] += 1
        self.lists.append(row)
        q[H_WRITING] -= 1
        q[H_READY] += 1

    def _unpin(self, row: int, entry: int, pid: int, start: int) -> None:
        if not self.pins.holds(entry, pid, start, row):
            return  # a repair dropped it
        r32 = self.v.r32
        r32[row * RW32 + R_PINS] -= 1
        if crash_hook:
            crash_hook("unpin", self, [row])
        self.pins.remove(entry)
        if r32[row * RW32 + R_STATE] == DROPPED and r32[row * RW32 + R_PINS] == 0:
            self.free_row(row)

    def _drop(self, row: int, key: bytes, crc: int) -> None:
        """Take the READY row ``row`` of ``key`` out (it failed its CRC); freed by its
        last unpin."""
        v, q = self.v, self.v.q
        if v.r32[row * RW32 + R_STATE] != ROW_READY or v.r32[row * RW32 + R_CRC] != crc \
                or v.key(row) != key:
            return  # dropped or replaced meanwhile
        writes = self.index.plan_remove(row, v.r32[row * RW32 + R_KHASH])
        q[H_SEQ] += 1
        v.r32[row * RW32 + R_STATE] = DROPPED
        if crash_hook:
            crash_hook("drop", self, [row])
        self.index.apply(writes)
        q[H_SEQ] += 1
        self.lists.unlink(row)
        q[H_READY] -= 1
        q[H_CORRUPT] += 1
        q[H_DROPPED] += 1
        logger.warning("node pool %s: key %s failed its checksum; dropped", self.name, key.hex())
        if v.r32[row * RW32 + R_PINS] == 0:
            self.free_row(row)

    def free_row(self, row: int) -> None:
        """Put the WRITING or DROPPED row ``row`` (in no list) on the free list."""
        q, r32 = self.v.q, self.v.r32
        state = r32[row * RW32 + R_STATE]
        if state == WRITING:
            q[H_WRITING] -= 1
        elif state == DROPPED:
            q[H_DROPPED] -= 1
        r32[row * RW32 + R_STATE] = FREE
        self.lists.push_free(row)
