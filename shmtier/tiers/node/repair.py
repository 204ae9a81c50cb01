"""Making a pool consistent again: repair after a lock holder died mid-mutation, sweeps of
what dead processes left (pins, half-written rows, engine entries), and ``check``, which
states every invariant and reports each one that does not hold.

Who calls: ``pool.py`` (``NodePool._locked``, ``_reserve``, attach/detach, ``check``), in
any process mapping the pool, always under the pool's lock (so nothing here races another
mutator; lookups that run meanwhile see an odd ``seq`` during ``repair`` and answer MISS).
Blocks on nothing but reads of ``/proc`` (one per distinct process per pass). ``p`` is the
calling ``NodePool``: its ``v`` (views), ``layout``, ``index``, ``lists``, ``pins``,
``engines``.

Repair trusts only what a mutation writes last and rebuilds the rest from it
(docs/node-pool.md, "Repair"): the rows' states and keys, the pin entries and the engine
entries are the truth; the index, the LRU and free lists, the per-row pin counts and the
header's counts are derived from them.
"""

from __future__ import annotations

import logging

import numpy as np

from shmtier.shared import procinfo
from shmtier.tiers.node.index import key_hash
from shmtier.tiers.node.layout import (
    DROPPED,
    E_PID,
    ENGINES_MAX,
    EW32,
    FREE,
    H_CLOCK,
    H_DROPPED,
    H_FREE_COUNT,
    H_FREE_HEAD,
    H_LRU_HEAD,
    H_LRU_TAIL,
    H_PIN_FREE,
    H_PINS,
    H_READY,
    H_REPAIRS,
    H_SEQ,
    H_SWEPT_ENGINES,
    H_SWEPT_PINS,
    H_SWEPT_WRITES,
    H_WRITING,
    MAX_KEY_BYTES,
    R_PINS,
    R_STATE,
    ROW_READY,
    ROW_STATES,
    RW32,
    WRITING,
)

logger = logging.getLogger(__name__)


class Liveness:
    """Whether the process (pid, start time) of this boot runs: one ``/proc`` read per
    process per pass (a pass makes one of these)."""

    def __init__(self, boot: bytes):
        self.boot, self._seen = boot, {}

    def __call__(self, pid, start) -> bool:
        key = (int(pid), int(start))
        alive = self._seen.get(key)
        if alive is None:
            alive = self._seen[key] = procinfo.is_alive(key[0], key[1], self.boot)
        return alive


def sweep(p, alive: Liveness) -> tuple[int, int, list[bool]]:
    """Drop the pins of dead processes, free the rows dead writers left WRITING, drop the
    entries of dead engines: (pins dropped, rows freed, keep flags of the engines
    dropped). The pool is consistent before and after."""
    v, q = p.v, p.v.q
    pins_dropped = rows_freed = 0
    for entry in np.flatnonzero(v.pins["pid"]):
        row = int(v.pins["row"][entry])
        if alive(v.pins["pid"][entry], v.pins["start"][entry]):
            continue
        p.pins.remove(int(entry))
        v.r32[row * RW32 + R_PINS] -= 1
        if v.r32[row * RW32 + R_STATE] == DROPPED and v.r32[row * RW32 + R_PINS] == 0:
            p.free_row(row)
        pins_dropped += 1
    for row in np.flatnonzero(v.rows["state"] == WRITING):
        if not alive(v.rows["wpid"][row], v.rows["wstart"][row]):
            p.free_row(int(row))
            rows_freed += 1
    keeps = []
    for slot in p.engines.used():
        if not alive(v.e32[slot * EW32 + E_PID], v.engines["start"][slot]):
            keeps.append(p.engines.keep(slot))
            p.engines.remove(slot)
    q[H_SWEPT_PINS] += pins_dropped
    q[H_SWEPT_WRITES] += rows_freed
    q[H_SWEPT_ENGINES] += len(keeps)
    if pins_dropped or rows_freed or keeps:
        logger.info("node pool %s: swept %d pins and %d half-written rows of dead processes, "
                    "%d dead engines", p.name, pins_dropped, rows_freed, len(keeps))
    return pins_dropped, rows_freed, keeps


def repair(p, alive: Liveness) -> None:
    """Rebuild every derived structure from the rows' states, keys and the pin and engine
    entries (the module docstring); counted in ``repairs``."""
    v, q, rows_n = p.v, p.v.q, p.layout.rows
    if not q[H_SEQ] & 1:
        q[H_SEQ] += 1  # lookups answer MISS until it is even again
    rows, pins = v.rows, v.pins
    state = rows["state"]
    state[state > DROPPED] = FREE
    bad_key = (rows["klen"] == 0) | (rows["klen"] > MAX_KEY_BYTES)
    state[((state == ROW_READY) | (state == WRITING)) & bad_key] = FREE
    for row in np.flatnonzero(state == WRITING):
        if not alive(rows["wpid"][row], rows["wstart"][row]):
            state[row] = FREE
            q[H_SWEPT_WRITES] += 1
    # one READY row per key (the newest); hashes recomputed: they are derived from the key
    newest: dict[bytes, int] = {}
    for row in np.flatnonzero(state == ROW_READY).tolist():
        key = v.key(row)
        rows["khash"][row] = key_hash(key)
        other = newest.get(key)
        if other is None or rows["stamp"][row] > rows["stamp"][other]:
            newest[key] = row
            row = other
        if row is not None:
            state[row] = DROPPED
    # pins: entries of live processes on rows that can be pinned; counts from them
    used = np.flatnonzero(pins["pid"])
    for entry in used.tolist():
        row = int(pins["row"][entry])
        if not (0 <= row < rows_n and state[row] in (ROW_READY, DROPPED)
                and alive(pins["pid"][entry], pins["start"][entry])):
            pins["pid"][entry] = 0
            q[H_SWEPT_PINS] += 1
    live = pins["pid"] != 0
    rows["pins"][:] = np.bincount(pins["row"][live], minlength=rows_n)[:rows_n]
    state[(state == DROPPED) & (rows["pins"] == 0)] = FREE
    _chain(pins["row"], np.flatnonzero(~live), q, H_PIN_FREE)
    q[H_PINS] = int(live.sum())
    # the lists and the index
    ready = np.flatnonzero(state == ROW_READY)
    order = ready[np.argsort(rows["stamp"][ready], kind="stable")]
    rows["prev"][order] = np.concatenate(([-1], order[:-1])) if len(order) else order
    rows["next"][order] = np.concatenate((order[1:], [-1])) if len(order) else order
    q[H_LRU_HEAD] = int(order[0]) if len(order) else -1
    q[H_LRU_TAIL] = int(order[-1]) if len(order) else -1
    q[H_CLOCK] = max(int(q[H_CLOCK]), int(rows["stamp"][ready].max()) if len(ready) else 0)
    free = np.flatnonzero(state == FREE)
    _chain(rows["next"], free, q, H_FREE_HEAD)
    q[H_FREE_COUNT] = len(free)
    p.index.rebuild(order)
    q[H_READY], q[H_WRITING] = len(ready), int((state == WRITING).sum())
    q[H_DROPPED] = int((state == DROPPED).sum())
    for slot in p.engines.used():
        if not alive(v.e32[slot * EW32 + E_PID], v.engines["start"][slot]):
            p.engines.remove(slot)
            q[H_SWEPT_ENGINES] += 1
    q[H_REPAIRS] += 1
    q[H_SEQ] += 1
    logger.warning("node pool %s: repaired after a process died holding its lock "
                   "(%d READY rows, %d pins kept)", p.name, len(ready), int(q[H_PINS]))


def _chain(links, members, q, head_word: int) -> None:
    """Link ``members`` (ascending) through ``links``, -1 ending it; the head into the
    header word ``head_word``."""
    if len(members):
        links[members] = np.concatenate((members[1:], [-1]))
    q[head_word] = int(members[0]) if len(members) else -1


def check(p) -> list[str]:
    """Every invariant of the pool that does not hold, one line each (empty: consistent).
    The caller holds the lock."""
    v, q, L = p.v, p.v.q, p.layout
    rows, pins = v.rows, v.pins
    problems: list[str] = []
    state = rows["state"]
    if q[H_SEQ] & 1:
        problems.append(f"seq {q[H_SEQ]} is odd outside a mutation")
    for row in np.flatnonzero(state > DROPPED).tolist():
        problems.append(f"row {row}: state {state[row]} is none of {ROW_STATES}")
    ready = set(np.flatnonzero(state == ROW_READY).tolist())
    # index <-> READY rows
    keys: dict[bytes, int] = {}
    for row in sorted(ready):
        key = v.key(row)
        if not 0 < len(key) <= MAX_KEY_BYTES:
            problems.append(f"row {row}: READY with key length {rows['klen'][row]}")
        if rows["khash"][row] != key_hash(key):
            problems.append(f"row {row}: key hash {rows['khash'][row]} is not its key's")
        if key in keys:
            problems.append(f"rows {keys[key]} and {row}: both READY with key {key.hex()}")
        keys[key] = row
        if p.index.find(key, int(rows["khash"][row])) != row:
            problems.append(f"row {row}: READY but its key {key.hex()} is not found in the index")
    slots = v.index_np
    entries = slots[slots >= 0]
    if len(entries) != len(set(entries.tolist())):
        problems.append("index: a row has more than one slot")
    for slot in np.flatnonzero(slots >= 0).tolist():
        row = int(slots[slot])
        if row not in ready:
            problems.append(f"index slot {slot}: row {row} is not READY")
            continue
        for back in range(1, p.index.home_distance(slot) + 1):
            if slots[(slot - back) & (L.slots - 1)] < 0:
                problems.append(f"index slot {slot}: row {row} unreachable from its home")
                break
    # LRU list: the READY rows, linked both ways, stamps rising
    seen, row, prev, stamp = [], int(q[H_LRU_HEAD]), -1, 0
    while row >= 0 and len(seen) <= L.rows:
        if rows["prev"][row] != prev:
            problems.append(f"LRU: row {row}'s prev is {rows['prev'][row]}, not {prev}")
        if rows["stamp"][row] < stamp:
            problems.append(f"LRU: row {row}'s stamp {rows['stamp'][row]} falls below {stamp}")
        seen.append(row)
        prev, stamp, row = row, int(rows["stamp"][row]), int(rows["next"][row])
    if set(seen) != ready or len(seen) != len(ready):
        problems.append(f"LRU list holds {len(seen)} rows, {len(ready)} are READY "
                        f"(differing: {sorted(set(seen) ^ ready)[:8]})")
    if q[H_LRU_TAIL] != prev:
        problems.append(f"LRU tail is {q[H_LRU_TAIL]}, the list ends at {prev}")
    # free list: the FREE rows
    free = set(np.flatnonzero(state == FREE).tolist())
    seen, row = [], int(q[H_FREE_HEAD])
    while row >= 0 and len(seen) <= L.rows:
        seen.append(row)
        row = int(rows["next"][row])
    if set(seen) != free or len(seen) != len(free) or q[H_FREE_COUNT] != len(free):
        problems.append(f"free list holds {len(seen)} rows (count {q[H_FREE_COUNT]}), "
                        f"{len(free)} are FREE")
    # pins: per-row counts from the entries; pinned rows READY or DROPPED
    live = pins["pid"] != 0
    in_range = (pins["row"] >= 0) & (pins["row"] < L.rows)
    for entry in np.flatnonzero(live & ~in_range).tolist():
        problems.append(f"pin entry {entry}: row {pins['row'][entry]} out of range")
    counts = np.bincount(pins["row"][live & in_range], minlength=L.rows)[:L.rows]
    for row in np.flatnonzero(counts != rows["pins"]).tolist():
        problems.append(f"row {row}: pin count {rows['pins'][row]}, {counts[row]} pin entries")
    for row in np.flatnonzero((rows["pins"] > 0) & (state != ROW_READY) & (state != DROPPED)).tolist():
        problems.append(f"row {row}: pinned while {ROW_STATES.get(int(state[row]))}")
    for row in np.flatnonzero((state == DROPPED) & (rows["pins"] == 0)).tolist():
        problems.append(f"row {row}: DROPPED with no pin (should be FREE)")
    seen, entry = 0, int(q[H_PIN_FREE])
    while entry >= 0 and seen <= L.pins_max:
        if pins["pid"][entry]:
            problems.append(f"pin free list holds entry {entry}, which is in use")
            break
        seen, entry = seen + 1, int(pins["row"][entry])
    if seen + int(live.sum()) != L.pins_max or q[H_PINS] != int(live.sum()):
        problems.append(f"pin table: {seen} free + {int(live.sum())} used entries "
                        f"(count {q[H_PINS]}) of {L.pins_max}")
    for word, name, want in ((H_READY, "READY", len(ready)),
                             (H_WRITING, "WRITING", int((state == WRITING).sum())),
                             (H_DROPPED, "DROPPED", int((state == DROPPED).sum()))):
        if q[word] != want:
            problems.append(f"header counts {q[word]} {name} rows, {want} are")
    if len(v.engines) != ENGINES_MAX:
        problems.append("engine table size")
    return problems
