"""The chunk table: the control area of the segment, one record per arena row.

Layout (struct of arrays, each array 64-byte aligned, native byte order)::

    counters  int64[8]     NUM_ALLOCATED, GENERATION, NEXT_RANK, NEXT_STAMP
    floats    float64[8]   ARC_TARGET
    key_len   uint8[n]     0 = row holds no key
    keys      uint8[n*kw]  key bytes, zero padded to the key width kw
    refcnt    int32[n]     -1 write pending, 0 ready and evictable, k>0 pinned by k readers
    rank_major/rank_minor int64[n]   LRU recency (smaller = older)
    plist     uint8[n]     ARC list of the row (1 = T1, 2 = T2)
    stamp     int64[n]     ARC order within its list (larger = more recent)
    tiers     uint64[n]    bit i = secondary tier i holds the chunk (pipeline)
    ghost_*   same fields for 2n ARC ghost entries (B1/B2 keys, no arena row)

The table is the source of truth for what the primary tier holds; the scheduler
keeps process-local accelerators (key -> row dict, heaps, ordered dicts) that it
rebuilds from these arrays on attach. Only the scheduler process writes the
table; other processes may read it. Scalar access goes through
``memoryview.cast`` views (10x cheaper per element than numpy indexing); numpy is
used for vectorised scans only. The scheduler's C helpers (the CPU tier's
``_rows.RowIndex``, which writes keys and ref counts, and the LRU policy's
``_lru.LRUCore``, which writes ranks) work on buffers of these same views.
"""

from __future__ import annotations

import numpy as np

# indexes into ChunkTable.counters
NUM_ALLOCATED, GENERATION, NEXT_RANK, NEXT_STAMP = range(4)
# indexes into ChunkTable.floats
ARC_TARGET = 0

T1, T2 = 1, 2
B1, B2 = 1, 2

_ALIGN = 64


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


def _fields(num_chunks: int, key_width: int) -> list[tuple[str, str, int]]:
    """(name, memoryview format, element count) of every array, in layout order."""
    n, g = num_chunks, 2 * num_chunks
    return [
        ("counters", "q", 8),
        ("floats", "d", 8),
        ("key_len", "B", n),
        ("keys", "B", n * key_width),
        ("refcnt", "i", n),
        ("rank_major", "q", n),
        ("rank_minor", "q", n),
        ("plist", "B", n),
        ("stamp", "q", n),
        ("tiers", "Q", n),
        ("ghost_key_len", "B", g),
        ("ghost_keys", "B", g * key_width),
        ("ghost_list", "B", g),
        ("ghost_stamp", "q", g),
    ]


_ITEMSIZE = {"B": 1, "i": 4, "q": 8, "Q": 8, "d": 8}


def control_nbytes(num_chunks: int, key_width: int) -> int:
    """Bytes the chunk table needs for ``num_chunks`` rows."""
    return sum(
        _round_up(_ITEMSIZE[fmt] * count) for _, fmt, count in _fields(num_chunks, key_width)
    )


class KeyTooLongError(ValueError):
    pass


class ChunkTable:
    """Typed views over the control area of one segment.

    Attribute names are the array names of the module docstring; each is a
    flat ``memoryview`` cast to its element type (``numpy()`` gives the same
    bytes as numpy arrays for scans).
    """

    def __init__(self, control: memoryview, num_chunks: int, key_width: int):
        self.num_chunks = num_chunks
        self.key_width = key_width
        self.num_ghosts = 2 * num_chunks
        self._views: list[memoryview] = []
        offset = 0
        for name, fmt, count in _fields(num_chunks, key_width):
            nbytes = _ITEMSIZE[fmt] * count
            view = control[offset : offset + nbytes].cast(fmt)
            self._views.append(view)
            setattr(self, name, view)
            offset += _round_up(nbytes)

    @classmethod
    def private(cls, num_chunks: int, key_width: int) -> "ChunkTable":
        """A table in process memory (a CPU tier without a shared segment)."""
        return cls(memoryview(bytearray(control_nbytes(num_chunks, key_width))),
                   num_chunks, key_width)

    # --- keys ---

    def read_key(self, row: int) -> bytes:
        start = row * self.key_width
        return bytes(self.keys[start : start + self.key_len[row]])

    def write_ghost(self, slot: int, key: bytes, which: int, stamp: int) -> None:
        start = slot * self.key_width
        self.ghost_keys[start : start + len(key)] = key
        self.ghost_key_len[slot] = len(key)
        self.ghost_list[slot] = which
        self.ghost_stamp[slot] = stamp

    def read_ghost(self, slot: int) -> bytes:
        start = slot * self.key_width
        return bytes(self.ghost_keys[start : start + self.ghost_key_len[slot]])

    def clear(self) -> None:
        """Forget every row and ghost (reset); counters other than GENERATION too."""
        generation = self.counters[GENERATION]
        for view in self._views:
            np.frombuffer(view, dtype=np.uint8).fill(0)
        self.counters[GENERATION] = generation

    def numpy(self, name: str) -> np.ndarray:
        """A numpy array over the same bytes as array ``name`` (for vectorised scans)."""
        return np.frombuffer(getattr(self, name), dtype=np.dtype(getattr(self, name).format))

    def release(self) -> None:
        """Drop every view so the segment mapping can be closed."""
        for view in self._views:
            try:
                view.release()
            except BufferError:  # a numpy array still looks at it; freed with the mapping
                pass
        self._views.clear()
