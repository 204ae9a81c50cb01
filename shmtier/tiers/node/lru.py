"""The pool's two row lists: the LRU list of READY rows and the free list of FREE rows.

The LRU list is doubly linked through the records' ``prev``/``next`` (-1 ends it); its
head (``H_LRU_HEAD``) is the least recently used row, evicted first; a store appends at
the tail and a load moves its row there, each with a fresh stamp (``H_CLOCK``), so the
stamps rise along the list and repair can rebuild it by sorting on them. The free list is
singly linked through ``next`` from ``H_FREE_HEAD``.

Who calls: ``pool.py`` (any process mapping the pool) and ``repair.py``, always under the
pool's lock; lookups never read these lists. Nothing here blocks.
"""

from __future__ import annotations

from shmtier.tiers.node.layout import (
    H_CLOCK,
    H_FREE_COUNT,
    H_FREE_HEAD,
    H_LRU_HEAD,
    H_LRU_TAIL,
    R_NEXT,
    R_PINS,
    R_PREV,
    R_STAMP,
    RW32,
    RW64,
    Views,
)


class RowLists:
    """The LRU and free lists of one mapping."""

    def __init__(self, views: Views):
        self.q, self.ri32, self.r32, self.r64 = views.q, views.ri32, views.r32, views.r64

    # -- LRU ---------------------------------------------------------------------------

    def append(self, row: int) -> None:
        """Link ``row`` (in no list) at the tail, with the next stamp."""
        q, ri32 = self.q, self.ri32
        q[H_CLOCK] += 1
        self.r64[row * RW64 + R_STAMP] = q[H_CLOCK]
        tail = q[H_LRU_TAIL]
        ri32[row * RW32 + R_PREV] = tail
        ri32[row * RW32 + R_NEXT] = -1
        if tail >= 0:
            ri32[tail * RW32 + R_NEXT] = row
        else:
            q[H_LRU_HEAD] = row
        q[H_LRU_TAIL] = row

    def unlink(self, row: int) -> None:
        """Take ``row`` out of the LRU list."""
        q, ri32 = self.q, self.ri32
        base = row * RW32
        prev, nxt = ri32[base + R_PREV], ri32[base + R_NEXT]
        if prev >= 0:
            ri32[prev * RW32 + R_NEXT] = nxt
        else:
            q[H_LRU_HEAD] = nxt
        if nxt >= 0:
            ri32[nxt * RW32 + R_PREV] = prev
        else:
            q[H_LRU_TAIL] = prev
        ri32[base + R_PREV] = ri32[base + R_NEXT] = -1

    def bump(self, row: int) -> None:
        """Make ``row`` (in the LRU list) the most recently used."""
        if self.q[H_LRU_TAIL] != row:
            self.unlink(row)
            self.append(row)
        else:
            self.q[H_CLOCK] += 1
            self.r64[row * RW64 + R_STAMP] = self.q[H_CLOCK]

    def victim(self) -> int:
        """The least recently used row nobody pins, or -1 (every READY row pinned)."""
        ri32, r32 = self.ri32, self.r32
        row = self.q[H_LRU_HEAD]
        while row >= 0 and r32[row * RW32 + R_PINS]:
            row = ri32[row * RW32 + R_NEXT]
        return row

    # -- free list ---------------------------------------------------------------------

    def push_free(self, row: int) -> None:
        q = self.q
        self.ri32[row * RW32 + R_NEXT] = q[H_FREE_HEAD]
        q[H_FREE_HEAD] = row
        q[H_FREE_COUNT] += 1

    def pop_free(self) -> int:
        """A FREE row off the free list, or -1."""
        q = self.q
        row = q[H_FREE_HEAD]
        if row >= 0:
            q[H_FREE_HEAD] = self.ri32[row * RW32 + R_NEXT]
            q[H_FREE_COUNT] -= 1
            self.ri32[row * RW32 + R_NEXT] = -1
        return row
