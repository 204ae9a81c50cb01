"""The CPU tier's per-key row bookkeeping in C (shmtier.scheduler._rows): refused input
changes nothing, the table holds what the rows dict says, and the request access record."""

from __future__ import annotations

import pytest

from shmtier.contract import GROUP_SUFFIX_LEN, ReqContext, get_offload_group_idx
from shmtier.scheduler._rows import RowIndex, first_accesses
from shmtier.scheduler.primary import CPUOffloadingManager
from shmtier.shared.chunk_table import ChunkTable


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def index(capacity: int = 4, key_width: int = 40) -> tuple[RowIndex, dict, ChunkTable]:
    table = ChunkTable.private(capacity, key_width)
    rows: dict = {}
    return RowIndex(rows, table.keys, table.key_len, table.refcnt, table.tiers, key_width), rows, table


def test_claim_writes_the_table_and_refuses_bad_keys_without_writing():
    ix, rows, table = index()
    with pytest.raises(ValueError, match="offload key of 41 bytes does not fit the key width of 40"):
        ix.claim([key(0), b"x" * 41], [0, 1])
    with pytest.raises(TypeError, match="offload keys are bytes, not str"):
        ix.claim(["k"], [0])
    with pytest.raises(IndexError, match="row 4 is outside the table's 4 rows"):
        ix.claim([key(0)], [4])
    assert rows == {} and table.key_len[0] == 0
    ix.claim([key(0), key(1)], [2, 0])
    assert rows == {key(0): 2, key(1): 0}
    assert table.read_key(2) == key(0) and table.read_key(0) == key(1)
    assert table.refcnt[2] == table.refcnt[0] == -1
    assert ix.classify([key(0), key(5)]) == ([key(5)], [])  # pending: in neither list
    assert ix.mark_stored([key(0), key(5), key(0)]) == [key(0)]  # once, absent ignored
    assert ix.classify([key(0), key(5), key(1)]) == ([key(5)], [key(0)])
    assert ix.ready_keys([key(1), key(0)]) == [key(0)]


def test_pins_count_per_listing_and_release_frees_the_row():
    ix, rows, table = index()
    ix.claim([key(0), key(1)], [0, 1])
    ix.mark_stored([key(0), key(1)])
    ids, pinned = ix.pin([key(0), key(0), key(1)])
    assert ids == [0, 0, 1] and pinned == [key(0), key(1)]  # a key leaves 0 once
    assert table.refcnt[0] == 2 and table.refcnt[1] == 1
    with pytest.raises(KeyError, match="lists key .* 3 times; it holds 2 pins"):
        ix.unpin([key(0)] * 3)
    assert table.refcnt[0] == 2  # refused: nothing dropped
    assert ix.unpin([key(0), key(1)]) == [key(1)]
    assert ix.unpin([key(0)]) == [key(0)]
    table.tiers[1] = 0b101
    free: list[int] = [3]
    ix.release([(key(1), 1)], free)
    assert rows == {key(0): 0} and free == [3, 1]
    assert table.key_len[1] == 0 and table.tiers[1] == 0
    with pytest.raises(KeyError):
        ix.release([(key(1), 1)], free)  # not resident any more


def test_a_failed_store_listed_twice_is_released_once():
    m = CPUOffloadingManager(ChunkTable.private(2, 40), "lru", enable_events=True)
    ctx = ReqContext("r")
    out = m.prepare_store([key(0), key(1)], ctx)
    m.complete_store([key(0), key(0)], ctx, success=False)
    assert m.resident_keys() == {key(1): out.store_spec.chunk_ids.tolist()[1]}
    assert m.prepare_store([key(2)], ctx).store_spec.chunk_ids.tolist() == [0]  # row 0 reused


def test_first_accesses_keep_order_groups_and_seen():
    seen: set = {key(1)}
    groups: dict = {}
    keys = (k for k in [key(0), key(1), key(2, 1), key(0), key(3)])  # any iterable
    assert first_accesses(keys, seen, groups, GROUP_SUFFIX_LEN) == [key(0), key(2, 1), key(3)]
    assert seen == {key(0), key(1), key(2, 1), key(3)}
    assert groups == {0: [key(0), key(3)], 1: [key(2, 1)]}  # by KV-cache group index
    assert first_accesses([key(0)], seen, groups, GROUP_SUFFIX_LEN) == []
    big = key(5, 0x01020304)  # the index is the suffix read big-endian, as the contract's
    assert first_accesses([big], seen, groups, GROUP_SUFFIX_LEN) == [big]
    assert groups[get_offload_group_idx(big)] == [big] and get_offload_group_idx(big) == 0x01020304
    with pytest.raises(TypeError, match="offload keys are bytes of at least 4"):
        first_accesses([b"ab"], seen, groups, GROUP_SUFFIX_LEN)


def test_a_closed_index_refuses_calls():
    ix, _, _ = index()
    ix.close()
    ix.close()  # idempotent
    with pytest.raises(ValueError, match="row index is closed"):
        ix.classify([key(0)])
