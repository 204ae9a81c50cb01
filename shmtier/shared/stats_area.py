"""The scheduler's statistics area in the segment: one writer, lock-free readers (a seqlock).

Who uses it: the scheduler process writes it (``shmtier/scheduler/stats_publisher.py``,
the only writer: one thread, under the tiering manager's lock); tools read it
(``shmtier/shared/snapshot.py`` for ``shmtier top``) through a read-only mapping. Neither
side blocks or takes a lock: the writer never waits for a reader, a reader retries.

Where: the second half of the segment header's page (``layout.STATS_OFFSET``,
``STATS_SIZE`` bytes; segment layout version 2, docs/architecture.md "Segment layout").
Layout (little-endian)::

    0    8s  magic "SHMSTATS" (written once the first publish is complete)
    8    Q   seq: odd while a publish is being written, even when complete
    16   I   CRC-32 of bytes [20, STATS_SIZE)
    20   I   format (1)          24  I  records (n <= MAX_RECORDS)
    28   I   publisher pid       32  I  publish interval (ms)
    40   Q   publishes (the generation of the values below)
    48   Q   published at (CLOCK_REALTIME ns)     56  Q  published at (CLOCK_MONOTONIC ns)
    64   Q   row bytes (a CPU tier row)           72  Q  publisher started (CLOCK_REALTIME ns)
    80   24s x MAX_RECORDS   record labels ("0:primary", "1:fs", ...: the metrics' tier label)
    368  q x len(FIELDS) x MAX_RECORDS   records, one per tier: FIELDS (-1: not counted)

Seqlock: the writer makes ``seq`` odd, writes everything, makes it even (the same
value plus one); a reader reads ``seq`` (odd: retry), copies the area, reads ``seq``
again (changed: retry). The copy is also checked against its CRC, so a reader on a CPU
that reorders loads (not x86-64) cannot take a mixed copy for a good one either. Every
record carries the publish's generation (``FIELDS[0]``), so a test can see that one read
never mixes two publishes.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass, field

from shmtier.shared.layout import STATS_SIZE

MAGIC = b"SHMSTATS"
FORMAT = 1
MAX_RECORDS = 12  # the CPU tier and up to 11 secondary tiers
LABEL_BYTES = 24
#: One record's fields, in order. chunks/bytes: held now; lookups/hits/misses: resolved
#: chunk lookups (counted once per request and key, as the chunk_queries metric);
#: promotions/cascades: chunks moved into / out of the CPU tier (and their bytes);
#: *_failures: jobs; bp_dropped_*: cascade jobs and chunks backpressure dropped;
#: evictions: chunks the tier evicted for capacity.
FIELDS = ("generation", "chunks", "bytes", "lookups", "hits", "misses", "promotions",
          "promoted_bytes", "cascades", "cascaded_bytes", "promotion_failures",
          "cascade_failures", "bp_dropped_jobs", "bp_dropped_chunks", "evictions")
NOT_COUNTED = -1

_CRC = struct.Struct("<I")
_BODY = struct.Struct("<IIII4xQQQQQ" + f"{LABEL_BYTES}s" * MAX_RECORDS
                      + "q" * (len(FIELDS) * MAX_RECORDS))
_CRC_OFFSET, _BODY_OFFSET = 16, 20
_SEQ_WORD = 1  # index of seq in the area cast to uint64
#: How long a reader retries before it calls the area torn: a writer descheduled in the
#: middle of a publish (a loaded host) holds it odd for a scheduler time slice or so.
_READ_BUDGET_S = 0.5
assert _BODY_OFFSET + _BODY.size <= STATS_SIZE


@dataclass
class StatsRead:
    """One consistent read of the area: who published, when, and one dict per record
    (``label`` and ``FIELDS``; a field a tier does not count is None)."""

    pid: int
    interval_s: float
    publishes: int
    published: float  # epoch s
    published_ns: int  # CLOCK_MONOTONIC ns (this host)
    started: float  # epoch s
    row_bytes: int
    tiers: list[dict] = field(default_factory=list)


class StatsAreaError(RuntimeError):
    """The area could not be read consistently (its writer died while publishing)."""


class StatsWriter:
    """The single writer of one segment's stats area (scheduler process, one thread at a
    time). ``area`` is the writable ``STATS_SIZE``-byte view (``Segment.stats``). Never
    blocks."""

    def __init__(self, area: memoryview, labels: list[str], *, interval_s: float,
                 row_bytes: int):
        if len(area) != STATS_SIZE:
            raise ValueError(f"stats area is {len(area)} bytes, {STATS_SIZE} expected")
        self._area = area
        self._labels = [label.encode()[:LABEL_BYTES] for label in labels[:MAX_RECORDS]]
        self._labels += [b""] * (MAX_RECORDS - len(self._labels))
        self._n = min(len(labels), MAX_RECORDS)
        self._head = (FORMAT, self._n, os.getpid(), int(round(interval_s * 1000)))
        self._row_bytes = row_bytes
        self._started = time.time_ns()
        self._body = bytearray(_BODY.size)
        self.publishes = 0

    @property
    def records(self) -> int:
        return self._n

    def publish(self, records: list[list[int]]) -> None:
        """Write ``records`` (one list of ``len(FIELDS)`` ints per label; its generation
        field is set here) as the next publish."""
        self.publishes += 1
        gen = self.publishes
        flat: list[int] = []
        for rec in records[:self._n]:
            rec[0] = gen
            flat.extend(rec)
        flat.extend([0] * (len(FIELDS) * MAX_RECORDS - len(flat)))
        _BODY.pack_into(self._body, 0, *self._head, gen, time.time_ns(), time.monotonic_ns(),
                        self._row_bytes, self._started, *self._labels, *flat)
        crc = zlib.crc32(self._body)
        # seq through a uint64 view: one aligned 8-byte store each (struct would write bytes)
        with self._area[:16].cast("Q") as words:
            seq = words[_SEQ_WORD]
            seq += 1 if seq % 2 == 0 else 0  # odd (a writer that died mid-write left it odd)
            words[_SEQ_WORD] = seq
            _CRC.pack_into(self._area, _CRC_OFFSET, crc)
            self._area[_BODY_OFFSET:_BODY_OFFSET + _BODY.size] = self._body
            words[_SEQ_WORD] = seq + 1
        if gen == 1:
            self._area[:8] = MAGIC  # last: a reader that sees it sees a complete publish


def read_stats(area) -> StatsRead | None:
    """One consistent copy of the stats ``area`` (a ``STATS_SIZE``-byte buffer, e.g. of a
    read-only mapping), or None when nothing was ever published there. Retries while the
    writer is mid-publish; raises :class:`StatsAreaError` when no consistent copy could be
    had within ``_READ_BUDGET_S`` (a writer that died while publishing). Any process; never
    blocks on another process (it spins 100 tries, then sleeps 50 us between tries, for
    at most ``_READ_BUDGET_S``)."""
    view = memoryview(area)
    words = view[:16].cast("Q")  # seq: one aligned 8-byte load each
    try:
        if bytes(view[:8]) != MAGIC:
            return None
        deadline, tries = 0.0, 0
        while True:
            seq = words[_SEQ_WORD]
            if seq % 2 == 0:
                blob = bytes(view[:STATS_SIZE])
                if words[_SEQ_WORD] == seq:
                    (crc,) = _CRC.unpack_from(blob, _CRC_OFFSET)
                    body = blob[_BODY_OFFSET:_BODY_OFFSET + _BODY.size]
                    if zlib.crc32(body) == crc:
                        return _decode(body)
            tries += 1
            if tries >= 100:
                now = time.monotonic()
                if not deadline:
                    deadline = now + _READ_BUDGET_S
                elif now > deadline:
                    raise StatsAreaError(f"no consistent copy in {_READ_BUDGET_S:g} s (seq "
                                         f"{seq}: its writer died while publishing?)")
                time.sleep(50e-6)
    finally:
        words.release()
        view.release()


def _decode(body: bytes) -> StatsRead:
    values = _BODY.unpack(body)
    fmt, n, pid, interval_ms, gen, published, published_ns, row_bytes, started = values[:9]
    if fmt != FORMAT:
        raise StatsAreaError(f"stats area format {fmt}, this shmtier reads {FORMAT}")
    labels = values[9:9 + MAX_RECORDS]
    flat = values[9 + MAX_RECORDS:]
    k = len(FIELDS)
    out = StatsRead(pid, interval_ms / 1000, gen, published / 1e9, published_ns, started / 1e9,
                    row_bytes)
    for i in range(min(n, MAX_RECORDS)):
        rec = flat[i * k:(i + 1) * k]
        d = {"label": labels[i].rstrip(b"\0").decode(errors="replace")}
        d.update((name, None if v == NOT_COUNTED else v) for name, v in zip(FIELDS, rec))
        out.tiers.append(d)
    return out
