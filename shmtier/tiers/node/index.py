"""The pool's hash index: key -> row of a READY row, open addressing over int32 slots.

Slots are a power of two, at least twice the rows (so at least half of them are empty at
any instant); an entry is a row number, -1 an empty slot. A key's home slot is its
CRC-32C (``key_hash``, also kept in the row's record) masked to the slots; collisions
probe linearly; deletion shifts the following entries back (no tombstones, so a probe
ends at the first empty slot and lookups stay short however long the pool runs).

Who calls: ``pool.py`` in every process that maps the pool. ``find`` runs lock-free in
the scheduler process (the caller brackets it with the seqlock and must treat what it
returns as a guess until the sequence word is found unchanged: a concurrent shift can
show it torn state, which ``find`` survives: rows out of range are skipped and probes are
bounded). Every write runs under the pool's lock; ``free_slot`` and ``plan_remove`` only
read, so the caller's seqlock write (odd ``seq``) covers just the stores they plan.
Nothing here blocks.
"""

from __future__ import annotations

from shmtier.shared.codec import crc32c
from shmtier.tiers.node.layout import R_KEY, R_KHASH, R_KLEN, R_STATE, ROW_BYTES, ROW_READY, RW32, Views

key_hash = crc32c


class HashIndex:
    """The index of one mapping (``views``: its ``Views``)."""

    def __init__(self, views: Views, rows: int, slots: int):
        self.v = views
        self.slots = views.index
        self.rows = rows
        self.mask = slots - 1
        self.meta = views.meta
        self.find = _finder(views, rows, self.mask)

    # ``find(key, h)``: the row of READY ``key`` (its hash ``h``), or -1 (``_finder``).

    def insert(self, row: int, h: int) -> None:
        """Enter ``row`` (hash ``h``; not in the index yet) at the first empty slot from
        its home."""
        self.slots[self.free_slot(h)] = row

    def free_slot(self, h: int) -> int:
        """The slot an entry of hash ``h`` goes to: the first empty one from its home."""
        slots, mask = self.slots, self.mask
        slot = h & mask
        while slots[slot] >= 0:
            slot = (slot + 1) & mask
        return slot

    def plan_remove(self, row: int, h: int) -> list[tuple[int, int]]:
        """The slot writes that take ``row`` (hash ``h``) out, shifting back the entries
        after it that probed past its slot; empty when it is not there. Only reads: the
        caller applies them (``apply``) inside its seqlock write, which stays as short as
        a few stores. (The probe only reads slots after every slot it plans to write.)"""
        slots, mask, r32 = self.slots, self.mask, self.v.r32
        hole = h & mask
        for _ in range(mask + 1):
            here = slots[hole]
            if here == row:
                break
            if here < 0:
                return []
            hole = (hole + 1) & mask
        else:
            return []
        writes, probe = [], hole
        while True:
            probe = (probe + 1) & mask
            moved = slots[probe]
            if moved < 0:
                break
            home = r32[moved * RW32 + R_KHASH] & mask
            # ``moved`` may fill the hole unless its home lies cyclically in (hole, probe]
            if (probe > hole and (home <= hole or home > probe)) or \
                    (probe < hole and home <= hole and home > probe):
                writes.append((hole, moved))
                hole = probe
        writes.append((hole, -1))
        return writes

    def apply(self, writes: list[tuple[int, int]]) -> None:
        slots = self.slots
        for slot, value in writes:
            slots[slot] = value

    def rebuild(self, ready_rows) -> None:
        """Empty the index and enter ``ready_rows`` (their hashes as recorded): repair."""
        self.v.index_np[:] = -1
        r32 = self.v.r32
        for row in ready_rows:
            self.insert(int(row), r32[int(row) * RW32 + R_KHASH])

    def home_distance(self, slot: int) -> int:
        """How far the entry at ``slot`` sits past its home slot (check)."""
        home = self.v.r32[self.slots[slot] * RW32 + R_KHASH] & self.mask
        return (slot - home) & self.mask


def _finder(views: Views, rows: int, mask: int):
    """``HashIndex.find`` of one mapping: a closure over its views (the scheduler's
    lookups run it once per key: locals, not attribute reads, and one slot read per
    probe). At most ``mask + 1`` probes, rows out of range skipped (a torn read)."""
    slots, r32, meta = views.index, views.r32, views.meta

    def find(key: bytes, h: int) -> int:
        slot = h & mask
        row = slots[slot]
        probes = mask
        while row >= 0:
            if row < rows:
                base = row * RW32
                if r32[base + R_KHASH] == h and r32[base + R_KLEN] == len(key) \
                        and r32[base + R_STATE] == ROW_READY:
                    off = row * ROW_BYTES + R_KEY
                    if meta[off:off + len(key)] == key:
                        return row
            if not probes:
                return -1
            probes -= 1
            slot = (slot + 1) & mask
            row = slots[slot]
        return -1

    return find
