"""Byte layout of a node pool's shared segment: where each table lives, what one record
holds, and the typed views every module of the pool reads it through.

Who uses it: every process that maps a pool (engines' scheduler processes, their tier
workers, the ``shmtier`` CLI, tests). Pure arithmetic and views; never blocks.

Segment (``/dev/shm/shmtier-node_<pool>``; docs/node-pool.md has the why)::

    0       header page: identity (struct _IDENT: magic, version, state, geometry,
            offsets, creator, boot id, fingerprint digest and text) | at 1024 the
            seqlock word ``seq`` alone on its cache line | from 1088 the mutable
            words (holder, list heads, counts, counters), one int64 each (H_*)
    4096    engine table: ENGINES_MAX entries of ENGINE_BYTES (E_*)
            pin table: pins_max entries of PIN_BYTES (P_*)
            row metadata: rows records of ROW_BYTES (R_*: state, key, CRC, LRU links, pins,
            writer)
            hash index: slots int32 row numbers, -1 empty (index.py)
    arena   rows x row_stride bytes (2 MiB aligned when it is that big)

Views: ``Views(buf, layout)`` casts each area once (``q`` header words; ``u32``/``i32``/
``u64`` over the row records and the tables), and numpy record arrays for the whole-table
passes (repair, check, sweeps, stats). Record fields are addressed as
``view[record * WORDS + FIELD]``: the hot paths avoid an attribute or a call per field.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

from shmtier.shared.layout import HUGE_PAGE_SIZE, PAGE_SIZE, round_up
from shmtier.storage.chunk_names import MAX_KEY_BYTES

MAGIC = b"SHMTNODE"
VERSION = 1
#: Not ``shmtier_``: an engine's own segments are ``shmtier_<engine_id>``, which the engine
#: tools (``segment_tools.list_segments``, ``shmtier clean``) judge by their own header; a
#: pool under that prefix would be judged stale by them, and ``shmtier_node_x`` would be
#: engine ``node_x``'s segment.
NAME_PREFIX = "shmtier-node_"
POOL_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
POOL_NAME_ACCEPTED = "1 to 64 characters of A-Z a-z 0-9 _ . -"

# segment states (the header's ``state``; joiners wait for READY)
INITIALISING, READY, FAILED = 0, 1, 2

# row states: FREE (on the free list), WRITING (reserved by a writer, in no list), READY
# (in the index and the LRU list), DROPPED (failed its CRC while pinned: in no list, freed
# by the last unpin)
FREE, WRITING, ROW_READY, DROPPED = 0, 1, 2, 3
ROW_STATES = {FREE: "FREE", WRITING: "WRITING", ROW_READY: "READY", DROPPED: "DROPPED"}

HEADER_BYTES = 4096
# magic, version, state | row_bytes, size_bytes, row_stride, rows, slots | engines_max,
# pins_max | engines_off, pins_off, meta_off, index_off, arena_off, total_len | creator pid,
# start | boot id | fingerprint digest, text length
_IDENT = struct.Struct("<8sII" "QQQQQ" "II" "QQQQQQ" "IQ" "16s" "32sH")
STATE_OFFSET = 12
FP_TEXT_OFFSET = _IDENT.size
FP_TEXT_MAX = 1024 - FP_TEXT_OFFSET

# header int64 words (index into a "q" cast of the header page)
H_SEQ = 128               # byte 1024: the seqlock, alone on its cache line
H_HOLDER_PID = 136        # byte 1088: who is inside the critical section (0: nobody)
H_HOLDER_START = 137
H_REPAIRS = 138
H_FREE_HEAD = 139         # free list (through R_NEXT)
H_FREE_COUNT = 140
H_LRU_HEAD = 141          # least recently used READY row (evicted first)
H_LRU_TAIL = 142
H_CLOCK = 143             # last LRU stamp given
H_READY = 144             # READY rows
H_WRITING = 145
H_DROPPED = 146
H_PIN_FREE = 147          # free pin entries (through P_ROW)
H_PINS = 148              # pin entries in use
H_EVICTIONS = 149
H_CORRUPT = 150
H_SWEPT_PINS = 151        # dead pinners' entries dropped
H_SWEPT_WRITES = 152      # dead writers' rows freed
H_SWEPT_ENGINES = 153     # dead engines' entries dropped
H_KEEP = 154              # 1: a leaving engine asked to keep the pool

# row record: ROW_BYTES bytes; u32 words / u64 words
ROW_BYTES = 160
RW32, RW64 = ROW_BYTES // 4, ROW_BYTES // 8
R_STATE, R_KLEN, R_KHASH, R_CRC = 0, 1, 2, 3   # u32 words
R_STAMP = 2                                    # u64 word (bytes 16..24)
R_PREV, R_NEXT = 6, 7                          # i32 words (LRU links; R_NEXT: free list)
R_PINS, R_WPID = 8, 9                          # u32 words
R_WSTART = 5                                   # u64 word (bytes 40..48)
R_KEY = 48                                     # byte offset of the key
assert R_KEY + MAX_KEY_BYTES <= ROW_BYTES

ROW_DTYPE = np.dtype({
    "names": ["state", "klen", "khash", "crc", "stamp", "prev", "next", "pins", "wpid",
              "wstart", "key"],
    "formats": ["<u4", "<u4", "<u4", "<u4", "<u8", "<i4", "<i4", "<u4", "<u4", "<u8",
                f"S{MAX_KEY_BYTES}"],
    "offsets": [0, 4, 8, 12, 16, 24, 28, 32, 36, 40, R_KEY],
    "itemsize": ROW_BYTES,
})

# pin entry: pid u32 (0: free), row i32 (free: the next free entry), start u64
PIN_BYTES = 16
PW32, PW64 = PIN_BYTES // 4, PIN_BYTES // 8
P_PID, P_ROW, P_START = 0, 1, 1                # u32, i32, u64 words
PIN_DTYPE = np.dtype({"names": ["pid", "row", "start"], "formats": ["<u4", "<i4", "<u8"],
                      "offsets": [0, 4, 8], "itemsize": PIN_BYTES})

# engine entry: pid u32 (0: free), keep u32, start u64, counters u64, id (length u32 + text)
ENGINES_MAX = 64
ENGINE_BYTES = 256
EW32, EW64 = ENGINE_BYTES // 4, ENGINE_BYTES // 8
E_PID, E_KEEP, E_IDLEN = 0, 1, 26              # u32 words
E_START = 1                                    # u64 word
#: per-engine counters (u64 words 3..): lookups/hits are written by the engine's scheduler
#: process alone (lock-free); the others by its tier workers under the pool's lock
COUNTERS = ("lookups", "hits", "stores", "exists", "rejected", "loads", "misses", "corrupt",
            "bytes_in", "bytes_out")
E_COUNTER = {name: 3 + i for i, name in enumerate(COUNTERS)}
E_ID = 112                                     # byte offset of the engine id text
ENGINE_ID_MAX = ENGINE_BYTES - E_ID
ENGINE_DTYPE = np.dtype({
    "names": ["pid", "keep", "start", *COUNTERS, "idlen", "id"],
    "formats": ["<u4", "<u4", "<u8", *["<u8"] * len(COUNTERS), "<u4", f"S{ENGINE_ID_MAX}"],
    "offsets": [0, 4, 8, *[8 * E_COUNTER[c] for c in COUNTERS], 4 * E_IDLEN, E_ID],
    "itemsize": ENGINE_BYTES,
})


def check_pool_name(name) -> str:
    """``name`` if it is a valid pool name, else ValueError naming it and what is accepted."""
    if not isinstance(name, str) or not POOL_NAME_RE.fullmatch(name):
        raise ValueError(f"node pool name {name!r} is invalid: expected {POOL_NAME_ACCEPTED}")
    return name


def shm_name(pool: str) -> str:
    """The POSIX shm name (with its slash) of pool ``pool``'s segment."""
    return f"/{NAME_PREFIX}{pool}"


def pool_of(entry: str) -> str | None:
    """The pool name of a ``/dev/shm`` entry (no slash) that is a node pool, else None."""
    if entry.startswith(NAME_PREFIX) and POOL_NAME_RE.fullmatch(entry[len(NAME_PREFIX):]):
        return entry[len(NAME_PREFIX):]
    return None


@dataclass(frozen=True)
class NodeLayout:
    """Geometry and area offsets of one pool (identical in every process that maps it)."""

    row_bytes: int      # bytes of one chunk (the engines' chunk payload)
    size_bytes: int     # the arena's bound as configured
    row_stride: int     # row_bytes rounded up to the page size
    rows: int
    slots: int          # hash index slots: a power of two >= 2 x rows
    pins_max: int
    engines_off: int
    pins_off: int
    meta_off: int
    index_off: int
    arena_off: int
    total_len: int

    @classmethod
    def for_pool(cls, row_bytes: int, size_bytes: int) -> "NodeLayout":
        """The layout of a pool of ``size_bytes`` of rows of ``row_bytes``; ValueError
        naming the value when either is not a positive int or the size holds no row."""
        for key, value in (("row_bytes", row_bytes), ("size_bytes", size_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"node pool {key} = {value!r} is invalid: expected an int >= 1")
        row_stride = round_up(row_bytes, PAGE_SIZE)
        rows = size_bytes // row_stride
        if rows < 1:
            raise ValueError(
                f"node pool size_bytes = {size_bytes} is invalid: expected at least one row "
                f"of {row_stride} bytes (row_bytes {row_bytes} rounded up to the page size)")
        slots = 1 << max(1, (2 * rows - 1).bit_length())
        pins_max = max(rows, 1024)
        engines_off = HEADER_BYTES
        pins_off = engines_off + ENGINES_MAX * ENGINE_BYTES
        meta_off = pins_off + round_up(pins_max * PIN_BYTES, 64)
        index_off = meta_off + rows * ROW_BYTES
        arena_len = rows * row_stride
        align = HUGE_PAGE_SIZE if arena_len >= HUGE_PAGE_SIZE else PAGE_SIZE
        arena_off = round_up(index_off + slots * 4, align)
        return cls(row_bytes, size_bytes, row_stride, rows, slots, pins_max, engines_off,
                   pins_off, meta_off, index_off, arena_off, arena_off + arena_len)


@dataclass(frozen=True)
class Identity:
    """The header's identity part, decoded (``read_identity``)."""

    magic: bytes
    version: int
    state: int
    layout: NodeLayout | None       # None when the numbers in it make no layout
    creator_pid: int
    creator_start: int
    boot_id: bytes
    fingerprint_digest: bytes
    fingerprint: str                # the text (first FP_TEXT_MAX bytes) for messages


def encode_identity(layout: NodeLayout, creator: tuple[int, int], boot: bytes,
                    digest: bytes, fingerprint: str) -> bytes:
    """The header page as the creator writes it (state INITIALISING, words zero)."""
    text = fingerprint.encode()[:FP_TEXT_MAX]
    head = _IDENT.pack(
        MAGIC, VERSION, INITIALISING,
        layout.row_bytes, layout.size_bytes, layout.row_stride, layout.rows, layout.slots,
        ENGINES_MAX, layout.pins_max,
        layout.engines_off, layout.pins_off, layout.meta_off, layout.index_off,
        layout.arena_off, layout.total_len,
        creator[0], creator[1], boot, digest, len(text))
    return (head + text).ljust(HEADER_BYTES, b"\0")


def read_identity(buf) -> Identity:
    """Decode the identity part of a header page (``buf``: at least HEADER_BYTES)."""
    (magic, version, state, row_bytes, size_bytes, row_stride, rows, slots, engines_max,
     pins_max, engines_off, pins_off, meta_off, index_off, arena_off, total_len,
     cpid, cstart, boot, digest, fp_len) = _IDENT.unpack_from(buf, 0)
    text = bytes(buf[FP_TEXT_OFFSET:FP_TEXT_OFFSET + min(fp_len, FP_TEXT_MAX)])
    layout = None
    if magic == MAGIC and engines_max == ENGINES_MAX:
        try:
            expected = NodeLayout.for_pool(row_bytes, size_bytes)
        except ValueError:
            expected = None
        found = NodeLayout(row_bytes, size_bytes, row_stride, rows, slots, pins_max,
                           engines_off, pins_off, meta_off, index_off, arena_off, total_len)
        layout = found if found == expected else None
    return Identity(magic, version, state, layout, cpid, cstart, boot, digest,
                    text.decode(errors="replace"))


class Views:
    """Typed views of one mapping's areas (see the module docstring). ``release()`` before
    the mapping closes."""

    def __init__(self, buf, layout: NodeLayout):
        mv = memoryview(buf)
        self.mv = mv
        self.q = mv[:HEADER_BYTES].cast("q")
        meta = mv[layout.meta_off:layout.meta_off + layout.rows * ROW_BYTES]
        self.r32, self.ri32, self.r64 = meta.cast("I"), meta.cast("i"), meta.cast("Q")
        pins = mv[layout.pins_off:layout.pins_off + layout.pins_max * PIN_BYTES]
        self.p32, self.pi32, self.p64 = pins.cast("I"), pins.cast("i"), pins.cast("Q")
        engines = mv[layout.engines_off:layout.engines_off + ENGINES_MAX * ENGINE_BYTES]
        self.e32, self.e64 = engines.cast("I"), engines.cast("Q")
        self.index = mv[layout.index_off:layout.index_off + layout.slots * 4].cast("i")
        self.arena = mv[layout.arena_off:layout.total_len]
        self.rows = np.frombuffer(meta, dtype=ROW_DTYPE)
        self.pins = np.frombuffer(pins, dtype=PIN_DTYPE)
        self.engines = np.frombuffer(engines, dtype=ENGINE_DTYPE)
        self.index_np = np.frombuffer(self.index, dtype=np.int32)
        self.meta, self.pin_bytes, self.engine_bytes = meta, pins, engines

    def key(self, row: int) -> bytes:
        """The key bytes row ``row``'s record holds (as its length says)."""
        base = row * RW32
        n = min(self.r32[base + R_KLEN], MAX_KEY_BYTES)
        off = row * ROW_BYTES + R_KEY
        return bytes(self.meta[off:off + n])

    def set_key(self, row: int, key: bytes) -> None:
        off = row * ROW_BYTES + R_KEY
        self.meta[off:off + len(key)] = key
        self.r32[row * RW32 + R_KLEN] = len(key)

    def release(self) -> None:
        self.rows = self.pins = self.engines = self.index_np = None
        for view in (self.q, self.r32, self.ri32, self.r64, self.p32, self.pi32, self.p64,
                     self.e32, self.e64, self.index, self.arena, self.meta, self.pin_bytes, self.engine_bytes, self.mv):
            try:
                view.release()
            except BufferError:
                pass
