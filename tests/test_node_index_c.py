"""The node pool's lookup in C (``shmtier/tiers/node/_index.c``) against its Python reference
(``NodePool.lookup_reference``, ``index._finder``): the same answers on real pools, on
index and record bytes as torn as a concurrent mutation can leave them, under a sequence
word held odd, and the same errors for bad arguments.

scripts/test-sanitizers runs this file again against the extension built with
AddressSanitizer and UndefinedBehaviorSanitizer (the garbage states probe its bounds).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid

import pytest
from conftest import SESSION_PREFIX
from node_pool_proc import key, payload

from shmtier.tiers.node import _index
from shmtier.tiers.node.index import _finder, key_hash
from shmtier.tiers.node.layout import (
    H_SEQ,
    HEADER_BYTES,
    R_KEY,
    R_KHASH,
    R_KLEN,
    R_STATE,
    ROW_BYTES,
    ROW_READY,
    RW32,
    shm_name,
)
from shmtier.tiers.node.pool import LOOKUP_BUDGET_NS, NodePool

FP = "model=m dtype=bfloat16 block=16x1 bytes_per_block=8192 world=1 replicated=0"
ROW = 8192


@pytest.fixture
def pool():
    name = f"{SESSION_PREFIX}{uuid.uuid4().hex[:12]}"
    p = NodePool.attach(name, row_bytes=ROW, size_bytes=64 * ROW, fingerprint=FP,
                        engine_id="e", register=True)
    try:
        yield p
    finally:
        p.detach()
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/shm/" + shm_name(name).lstrip("/"))


def test_a_pool_answers_the_same_in_c_and_in_python(pool):
    ids = list(range(0, 40, 2))
    assert all(o.name == "OK" for o in pool.store_many([key(i) for i in ids],
                                                       [payload(i, ROW) for i in ids]))
    # evict some (freed rows leave their records behind: the state decides)
    pool.store_many([key(i) for i in range(100, 130)], [payload(i, ROW) for i in range(100, 130)])
    probes = [key(i) for i in range(140)] + [b"", b"x" * 100, b"y" * 101, b"z" * 500]
    want = [pool.lookup_reference(k) for k in probes]
    assert [pool.lookup(k) for k in probes] == want
    assert pool.lookup_many(probes) == want
    assert pool.lookup_many([]) == []
    assert any(want) and not all(want)


class _Scratch:
    """A header page, index slots and row records in plain memory, with the views
    ``_finder`` reads: states a live pool shows only for an instant."""

    def __init__(self, rows: int, slots: int):
        self.rows, self.slots = rows, slots
        self.header = bytearray(HEADER_BYTES)
        self.slot_bytes = bytearray(b"\xff" * (slots * 4))  # every slot empty (-1)
        # two spare records past ``rows``: a row number just out of range is never read
        self.record_bytes = bytearray((rows + 2) * ROW_BYTES)
        self.q = memoryview(self.header).cast("q")
        self.index = memoryview(self.slot_bytes).cast("i")
        self.meta = memoryview(self.record_bytes)[:rows * ROW_BYTES]
        self.r32 = self.meta.cast("I")

    def put(self, row: int, key_bytes: bytes, state: int = ROW_READY, slot: int | None = None,
            klen: int | None = None, khash: int | None = None) -> None:
        base = row * RW32
        self.r32[base + R_STATE] = state
        self.r32[base + R_KLEN] = len(key_bytes) if klen is None else klen
        self.r32[base + R_KHASH] = key_hash(key_bytes) if khash is None else khash
        off = row * ROW_BYTES + R_KEY
        self.meta[off:off + len(key_bytes)] = key_bytes
        home = key_hash(key_bytes) & (self.slots - 1) if slot is None else slot
        for _ in range(self.slots):
            if self.index[home] < 0:
                break
            home = (home + 1) & (self.slots - 1)
        self.index[home] = row

    def c(self, key_bytes: bytes, budget_ns: int = LOOKUP_BUDGET_NS) -> bool:
        return _index.lookup(self.q, self.index, self.meta, self.rows, key_bytes,
                             key_hash(key_bytes), budget_ns)

    def py(self, key_bytes: bytes) -> bool:
        find = _finder(self, self.rows, self.slots - 1)
        return find(key_bytes, key_hash(key_bytes)) >= 0


@pytest.mark.parametrize("seed", range(40))
def test_torn_index_and_records_answer_the_same_and_stay_in_bounds(seed):
    """Random slots (row numbers in and out of range, negative), records with matching
    and nearly matching hashes, lengths and states, and keys planted at their home slot or
    displaced: C and Python agree on every probe, and the C reads nothing past its
    buffers (the sanitizer run checks)."""
    rng = random.Random(seed)
    rows, slots = rng.choice([(1, 2), (7, 16), (50, 128)])
    s = _Scratch(rows, slots)
    keys = [rng.randbytes(rng.randint(0, 100)) for _ in range(rows)]
    for row, k in enumerate(keys):
        choice = rng.random()
        if choice < 0.5:
            s.put(row, k)
        elif choice < 0.6:
            s.put(row, k, state=rng.choice([0, 1, 3]))  # FREE, WRITING, DROPPED
        elif choice < 0.7:
            s.put(row, k, klen=rng.choice([len(k) + 1, 0xFFFFFFFF, 200]))
        elif choice < 0.8:
            s.put(row, k, khash=key_hash(k) ^ 1)
        else:
            s.put(row, k, slot=rng.randrange(slots))
    for slot in range(slots):  # torn: anything at all in some slots
        if rng.random() < 0.15:
            s.index[slot] = rng.choice([rows, rows + 1, 2**31 - 1, -2, -2**31,
                                        rng.randrange(max(rows, 1))])
    probes = keys + [rng.randbytes(rng.randint(0, 112)) for _ in range(20)]
    probes += [k[:-1] for k in keys if k] + [k + b"\0" for k in keys]
    for k in probes:
        assert s.c(k) == s.py(k), (seed, k)


def test_a_full_index_without_the_key_ends_after_one_pass():
    """Every slot holds a row (a torn state: the live index keeps half its slots empty):
    the probe stops after ``slots`` reads in both, answering not found."""
    s = _Scratch(4, 4)
    for row in range(4):
        s.put(row, bytes([row]) * 8)
    assert not s.c(b"absent") and not s.py(b"absent")
    assert all(s.c(bytes([row]) * 8) for row in range(4))


def test_a_sequence_word_held_odd_answers_miss_after_its_budget():
    s = _Scratch(2, 4)
    s.put(0, b"present")
    assert s.c(b"present")
    s.q[H_SEQ] = 1  # a mutation under way and never finished (its writer stopped)
    started = time.perf_counter_ns()
    assert not s.c(b"present")
    took = time.perf_counter_ns() - started
    assert LOOKUP_BUDGET_NS <= took < 100 * LOOKUP_BUDGET_NS, took  # it waited, boundedly
    assert not s.c(b"present", budget_ns=0)
    assert _index.lookup_many(s.q, s.index, s.meta, s.rows, [b"present"],
                              [key_hash(b"present")], 4) == [False]
    s.q[H_SEQ] = 2
    assert s.c(b"present")
    assert _index.lookup_many(s.q, s.index, s.meta, s.rows, [b"present", b"x"],
                              [key_hash(b"present"), key_hash(b"x")], 4) == [True, False]


def test_bad_arguments_are_named():
    s = _Scratch(2, 4)
    with pytest.raises(TypeError, match="key: expected bytes, got str"):
        _index.lookup(s.q, s.index, s.meta, 2, "k", 0, 4)
    with pytest.raises(TypeError, match=r"lookup\(header, slots, records, rows, key, hash, budget_ns\)"):
        _index.lookup(s.q, s.index, s.meta, 2, b"k")
    with pytest.raises(ValueError, match="power of two"):
        _index.lookup(s.q, memoryview(bytearray(12)).cast("i"), s.meta, 2, b"k", 0, 4)
    with pytest.raises(ValueError, match="3 rows do not fit"):
        _index.lookup(s.q, s.index, s.meta, 3, b"k", 0, 4)
    with pytest.raises(ValueError, match="header"):
        _index.lookup(bytearray(8), s.index, s.meta, 2, b"k", 0, 4)
    with pytest.raises(ValueError, match="budget_ns must be >= 0"):
        _index.lookup(s.q, s.index, s.meta, 2, b"k", 0, -1)
    with pytest.raises(TypeError, match="two lists of one length"):
        _index.lookup_many(s.q, s.index, s.meta, 2, [b"k"], [], 4)
    with pytest.raises(TypeError, match="key: expected bytes, got int"):
        _index.lookup_many(s.q, s.index, s.meta, 2, [b"k", 3], [0, 0], 4)


def test_the_c_layout_is_the_pools():
    assert (_index.ROW_BYTES, _index.R_STATE, _index.R_KLEN, _index.R_KHASH, _index.R_KEY,
            _index.ROW_READY, _index.H_SEQ) == (ROW_BYTES, R_STATE, R_KLEN, R_KHASH, R_KEY,
                                                ROW_READY, H_SEQ)
