"""The pool's per-process tables: pins (which process holds which row for a load) and
engines (which engines use the pool, with their counters).

Pin table: fixed entries (pid, start time, row); a free entry has pid 0 and links the
next free one through its row field (``H_PIN_FREE``). An entry is written pid last, so a
holder that dies half way leaves an entry that reads free; repair rebuilds the free chain
and the rows' pin counts from the entries (``repair.py``).

Engine table: ENGINES_MAX entries (pid, start time, keep, engine id, counters); pid 0 is a
free entry. A process identity is (pid, start time), with the boot id of the pool's
creator (a pool never outlives a boot: /dev/shm is a tmpfs).

Who calls: ``pool.py`` and ``repair.py`` in any process mapping the pool. Every write here
runs under the pool's lock, except ``EngineTable.count``: an engine's lookup counters,
which only that engine's scheduler process writes. Nothing here blocks.
"""

from __future__ import annotations

from shmtier.tiers.node.layout import (
    E_COUNTER,
    E_ID,
    E_IDLEN,
    E_KEEP,
    E_PID,
    E_START,
    ENGINE_BYTES,
    ENGINE_ID_MAX,
    ENGINES_MAX,
    EW32,
    EW64,
    H_PIN_FREE,
    H_PINS,
    P_PID,
    P_ROW,
    P_START,
    PW32,
    PW64,
    Views,
)


class PinTable:
    """The pin table of one mapping."""

    def __init__(self, views: Views):
        self.q, self.p32, self.pi32, self.p64 = views.q, views.p32, views.pi32, views.p64

    def add(self, pid: int, start: int, row: int) -> int:
        """A new entry pinning ``row`` for (pid, start); -1 when the table is full."""
        q = self.q
        entry = q[H_PIN_FREE]
        if entry < 0:
            return -1
        q[H_PIN_FREE] = self.pi32[entry * PW32 + P_ROW]
        self.pi32[entry * PW32 + P_ROW] = row
        self.p64[entry * PW64 + P_START] = start
        self.p32[entry * PW32 + P_PID] = pid  # last: from here on it is a pin
        q[H_PINS] += 1
        return entry

    def holds(self, entry: int, pid: int, start: int, row: int) -> bool:
        """Whether ``entry`` is (still) the pin of ``row`` by (pid, start)."""
        return (self.p32[entry * PW32 + P_PID] == pid and self.pi32[entry * PW32 + P_ROW] == row
                and self.p64[entry * PW64 + P_START] == start)

    def remove(self, entry: int) -> None:
        """Free ``entry`` (a pin)."""
        q = self.q
        self.p32[entry * PW32 + P_PID] = 0  # first: from here on it is not a pin
        self.pi32[entry * PW32 + P_ROW] = q[H_PIN_FREE]
        q[H_PIN_FREE] = entry
        q[H_PINS] -= 1


class EngineTable:
    """The engine table of one mapping."""

    def __init__(self, views: Views):
        self.e32, self.e64 = views.e32, views.e64
        self._bytes = views.engine_bytes

    def engine_id(self, slot: int) -> str:
        n = min(self.e32[slot * EW32 + E_IDLEN], ENGINE_ID_MAX)
        off = slot * ENGINE_BYTES + E_ID
        return bytes(self._bytes[off:off + n]).decode(errors="replace")

    def add(self, engine_id: str, pid: int, start: int, keep: bool) -> int:
        """A new entry for the engine ``engine_id`` run by (pid, start), its counters zero;
        -1 when all ENGINES_MAX entries are taken."""
        e32, e64 = self.e32, self.e64
        for slot in range(ENGINES_MAX):
            if e32[slot * EW32 + E_PID] == 0:
                break
        else:
            return -1
        self._bytes[slot * ENGINE_BYTES:(slot + 1) * ENGINE_BYTES] = bytes(ENGINE_BYTES)
        text = engine_id.encode()[:ENGINE_ID_MAX]
        off = slot * ENGINE_BYTES + E_ID
        self._bytes[off:off + len(text)] = text
        e32[slot * EW32 + E_IDLEN] = len(text)
        e32[slot * EW32 + E_KEEP] = int(keep)
        e64[slot * EW64 + E_START] = start
        e32[slot * EW32 + E_PID] = pid  # last: from here on the entry counts
        return slot

    def remove(self, slot: int) -> None:
        self.e32[slot * EW32 + E_PID] = 0

    def holds(self, slot: int, pid: int, start: int) -> bool:
        return (self.e32[slot * EW32 + E_PID] == pid
                and self.e64[slot * EW64 + E_START] == start)

    def keep(self, slot: int) -> bool:
        return bool(self.e32[slot * EW32 + E_KEEP])

    def is_entry_of(self, slot: int, engine_id: str) -> bool:
        """Whether ``slot`` is an entry in use of ``engine_id``."""
        return (0 <= slot < ENGINES_MAX and self.e32[slot * EW32 + E_PID] != 0
                and self.engine_id(slot) == engine_id.encode()[:ENGINE_ID_MAX].decode(errors="replace"))

    def find(self, engine_id: str) -> int:
        """The slot of an entry of ``engine_id`` (the first), or -1."""
        text = engine_id.encode()[:ENGINE_ID_MAX]
        for slot in range(ENGINES_MAX):
            if self.e32[slot * EW32 + E_PID] and self.engine_id(slot).encode() == text:
                return slot
        return -1

    def used(self) -> list[int]:
        """Slots of the entries in use."""
        return [s for s in range(ENGINES_MAX) if self.e32[s * EW32 + E_PID]]

    def count(self, slot: int, counter: str, n: int) -> None:
        """Add ``n`` to ``counter`` of entry ``slot``."""
        self.e64[slot * EW64 + E_COUNTER[counter]] += n
