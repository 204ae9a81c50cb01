"""The LRU policy's C core (shmtier.scheduler.policies._lru): what the differential
tests against vLLM do not reach -- its lazy heap under long pin/unpin churn, rank ties,
the table written through, bad input and its buffers released at shutdown."""

from __future__ import annotations

import pytest

from shmtier.contract import ReqContext
from shmtier.scheduler.policies._lru import LRUCore
from shmtier.scheduler.policies.base import ChunkStatus
from shmtier.scheduler.policies.lru import LRUCachePolicy
from shmtier.scheduler.primary import CPUOffloadingManager, CPUPrimaryTierOffloadingManager
from shmtier.shared.chunk_table import NEXT_RANK, ChunkTable
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def lru_manager(capacity: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(ChunkTable.private(capacity, 40), "lru", enable_events=True)


def stored(m: CPUOffloadingManager, keys, ctx: ReqContext):
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return out


def test_pin_unpin_churn_keeps_the_heap_bounded_and_the_order_exact():
    """Every unpin pushes a heap entry; the heap is compacted instead of growing with
    the churn, and the stale entries never change which chunk goes first."""
    m = lru_manager(8)
    ctx = ReqContext("fill")
    stored(m, [key(i) for i in range(8)], ctx)
    m.touch([key(i) for i in range(8)], ctx)  # key(7) oldest ... key(0) most recent
    core = m._policy._core
    reader = ReqContext("reader")
    for _ in range(500):
        m.prepare_load([key(3), key(5)], reader)
        m.complete_load([key(3), key(5)], reader)
    assert core.num_evictable == 8
    assert core.heap_size <= max(64, 2 * 8) + 2
    victims = [stored(m, [key(100 + i)], ReqContext(f"n{i}")).evicted_keys for i in range(8)]
    assert victims == [[key(i)] for i in range(7, -1, -1)]


def test_a_twin_entry_is_evicted_once():
    """Pinning and unpinning without a re-rank leaves two entries of one rank in the
    heap; an eviction of two must still take two different chunks."""
    m = lru_manager(3)
    ctx = ReqContext("fill")
    stored(m, [key(0), key(1), key(2)], ctx)
    m.touch([key(2), key(1), key(0)], ctx)  # key(0) oldest
    m.prepare_load([key(0)], ctx)
    m.complete_load([key(0)], ctx)  # key(0) pushed again at the same rank
    out = m.prepare_store([key(10), key(11)], ReqContext("new"))
    assert out.evicted_keys == [key(0), key(1)]
    assert sorted(m.resident_keys()) == sorted([key(2), key(10), key(11)])


def test_equal_ranks_go_in_key_byte_order():
    """Chunks of one request at the same position (one per KV-cache group) share a rank;
    as in vLLM's tuples, the smaller key bytes go first, and a shorter key before its
    own extensions."""
    m = CPUOffloadingManager(ChunkTable.private(4, 40), "lru")
    ctx = ReqContext("r")
    keys = [key(5, group=1), key(5, group=0), key(4, group=1)[:-1], key(4, group=1)]
    for k in keys:
        ctx.set_offload_key_position(k, 16)
    stored(m, keys, ctx)
    evicted = [stored(m, [key(50 + i)], ReqContext(f"n{i}")).evicted_keys[0] for i in range(4)]
    assert evicted == sorted(keys)


def test_ranks_are_written_through_to_the_table():
    """The table is the source of truth for a warm restart: every rank change is in it."""
    table = ChunkTable.private(4, 40)
    m = CPUOffloadingManager(table, "lru")
    ctx = ReqContext("r")
    ctx.set_offload_key_position(key(0), 32)
    stored(m, [key(0), key(1)], ctx)  # key(1) has no position: a fresh rank
    rows = m.resident_keys()
    # the request's rank is given at its first access, before key(1)'s fresh rank
    assert (table.rank_major[rows[key(0)]], table.rank_minor[rows[key(0)]]) == (1, -32)
    assert (table.rank_major[rows[key(1)]], table.rank_minor[rows[key(1)]]) == (2, 0)
    m.touch([key(0)], ctx)
    assert (table.rank_major[rows[key(0)]], table.rank_minor[rows[key(0)]]) == (3, 0)
    assert table.counters[NEXT_RANK] == 3
    assert m._policy._core.rank(rows[key(0)]) == (3, 0)


def test_protected_chunks_are_skipped_and_stay_evictable():
    m = lru_manager(2)
    ctx = ReqContext("fill")
    stored(m, [key(0), key(1)], ctx)
    core = m._policy._core
    assert core.evict(2, {key(0)}) is None  # only one unprotected chunk: nothing taken
    assert core.num_evictable == 2
    assert core.evict(1, {key(0)}) == [(key(1), m.resident_keys()[key(1)])]
    assert core.evict(1, set()) == [(key(0), 0)]
    assert core.num_evictable == 0


def test_insert_through_the_policy_interface_ranks_and_marks_evictable():
    """CachePolicy.insert (what a manager written for vLLM calls) ranks like the
    primary's batched path and makes a ready chunk evictable at once."""
    table = ChunkTable.private(3, 40)
    rows = {key(0): 0, key(1): 1, key(2): 2}
    policy = LRUCachePolicy(3)
    policy.bind(table, rows)
    ctx = ReqContext("r")
    ctx.set_offload_key_position(key(0), 16)
    ctx.set_offload_key_position(key(1), 32)
    table.refcnt[2] = -1  # key(2): its store is pending
    for k in (key(0), key(1), key(2)):
        policy.insert(k, ChunkStatus(rows[k], table.refcnt), ctx)
    assert (table.rank_major[0], table.rank_minor[0]) == (1, -16)
    assert (table.rank_major[1], table.rank_minor[1]) == (1, -32)
    assert policy.evict(3, set()) is None  # the pending chunk is not evictable
    assert policy.evict_rows(2, set()) == [(key(1), 1), (key(0), 0)]  # tail first
    policy.close()


def test_bad_input_is_refused_with_what_was_wrong():
    table = ChunkTable.private(2, 40)
    with pytest.raises(TypeError, match="rank_major must be a writable int64 buffer"):
        LRUCore({}, table.refcnt, table.rank_minor, table.counters, NEXT_RANK)
    with pytest.raises(ValueError, match="next_rank_index 99 of 8 counters"):
        LRUCore({}, table.rank_major, table.rank_minor, table.counters, 99)
    core = LRUCore({}, table.rank_major, table.rank_minor, table.counters, NEXT_RANK)
    with pytest.raises(TypeError, match="offload keys are bytes, not str"):
        core.insert_pending(["k"], [0], {}, lambda: 1)
    with pytest.raises(IndexError, match="row 2 is outside the table's 2 rows"):
        core.insert_pending([b"k"], [2], {}, lambda: 1)
    with pytest.raises(KeyError):
        core.mark_evictable([b"not resident"])
    core.close()


def test_shutdown_releases_the_table_so_the_segment_unmaps(engine_id):
    geometry = ArenaGeometry(num_chunks=4, row_stride=4096, page_size_per_worker=4096, world_size=1)
    segment = open_segment(engine_id, geometry, "fp", owner=True)
    m = CPUPrimaryTierOffloadingManager(segment, "lru")
    stored(m, [key(0)], ReqContext("r"))
    core = m._policy._core
    m.shutdown()
    assert segment._buf.closed  # nothing held the mapping: it is gone now, not at GC
    with pytest.raises(ValueError, match="LRU core is closed"):
        core.evict(1, set())
    core.close()  # idempotent
