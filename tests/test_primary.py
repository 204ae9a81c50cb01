"""CPU primary tier: contract semantics, LRU/ARC cases, warm attach, policies, errors."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtier.contract import LookupResult, ReqContext
from shmtier.scheduler.policies import CachePolicy, CachePolicyFactory
from shmtier.scheduler.primary import CPUOffloadingManager, CPUPrimaryTierOffloadingManager
from shmtier.shared.chunk_table import ChunkTable, KeyTooLongError
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def manager(capacity: int, policy: str = "lru", **kw) -> CPUOffloadingManager:
    return CPUOffloadingManager(ChunkTable.private(capacity, 40), policy, enable_events=True, **kw)


def request(name: str, keys=(), chunk_tokens: int = 16) -> ReqContext:
    ctx = ReqContext(name)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * chunk_tokens)
    return ctx


def store(m, keys, ctx, success=True):
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx, success=success)
    return out


# --- docs/vllm-contract.md §3.2 semantics ---


def test_ref_counts_lookup_states_and_pinning():
    m = manager(2)
    ctx = request("a")
    out = m.prepare_store([key(0), key(1)], ctx)
    assert out.store_spec.chunk_ids.tolist() == [0, 1]
    assert m.lookup(key(0), ctx) == PENDING and m.ref_count(key(0)) == -1
    assert m.prepare_store([key(2)], ctx) is None  # pending rows are not evictable
    m.complete_store([key(0), key(1)], ctx)
    assert m.lookup(key(0), ctx) == HIT
    m.prepare_load([key(0), key(1)], ctx)
    assert [m.ref_count(k) for k in (key(0), key(1), key(2))] == [1, 1, None]
    assert m.prepare_store([key(2)], ctx) is None  # pinned by readers
    m.complete_load([key(1)], ctx)
    out = m.prepare_store([key(2)], ctx)
    assert out.evicted_keys == [key(1)] and out.store_spec.chunk_ids.tolist() == [1]
    with pytest.raises(KeyError, match="not pinned"):
        m.complete_load([key(1)], ctx)


def test_a_load_that_names_a_bad_key_pins_and_unpins_nothing():
    m = manager(2)
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.prepare_store([key(2)], request("b"))  # evicts key 0 (LRU), pending
    with pytest.raises(KeyError, match="not in the CPU tier"):
        m.prepare_load([key(1), key(0)], ctx)
    with pytest.raises(KeyError, match="store has not completed"):
        m.prepare_load([key(1), key(2)], ctx)
    m.complete_store([key(2)], request("b"))
    # key 1 was not left pinned by the refused loads: it is evictable
    assert m.prepare_store([key(3)], request("c")).evicted_keys == [key(1)]
    m.complete_store([key(3)], request("c"))
    m.prepare_load([key(2)], ctx)
    with pytest.raises(KeyError, match="2 times; it holds 1 pins"):
        m.complete_load([key(2), key(2)], ctx)
    # the refused unpin changed nothing: key 2 is still pinned, key 3 is the victim
    assert m.prepare_store([key(4)], request("d")).evicted_keys == [key(3)]
    m.complete_load([key(2)], ctx)
    assert m.prepare_store([key(5)], request("e")) is not None


def test_fresh_slots_before_reused_and_lifo_free_list():
    m = manager(4)
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.prepare_store([key(2)], ctx)
    m.complete_store([key(2)], ctx, success=False)  # row 2 back to the free list
    out = m.prepare_store([key(3), key(4)], ctx)
    assert out.store_spec.chunk_ids.tolist() == [3, 2]  # fresh row 3, then reused 2


def test_never_evicts_keys_of_the_current_offer():
    m = manager(2)
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    assert m.prepare_store([key(0), key(1), key(2)], ctx) is None
    assert m.lookup(key(0), ctx) == HIT and m.lookup(key(1), ctx) == HIT


def test_events_stored_evicted_and_metadata_only_failure():
    m = manager(2)
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.prepare_store([key(2)], ctx)
    m.complete_store([key(2)], ctx, success=False)
    events = [(e.keys, e.removed, e.metadata_only) for e in m.take_events()]
    assert events == [
        ([key(0), key(1)], False, False),
        ([key(0)], True, False),  # evicted, LRU
        ([key(2)], True, True),
    ]
    # a metadata-only event is dropped when a retry re-allocated the key before the drain
    m.prepare_store([key(3)], ctx)
    m.complete_store([key(3)], ctx, success=False)
    m.prepare_store([key(3)], ctx)
    assert [e for e in m.take_events() if e.metadata_only] == []
    m.reset_cache()
    assert list(m.take_events()) == []  # no events on reset


def test_stats_usage_and_allocation_histogram():
    m = manager(4)
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.prepare_store([key(2)], ctx)
    m.prepare_load([key(0)], ctx)
    data = m.get_stats().data["data"]
    assert data["vllm:kv_offload_cpu_cache_usage_perc"][()] == 0.5
    assert data["vllm:kv_offload_cpu_cache_write_usage_perc"][()] == 0.25
    assert data["vllm:kv_offload_cpu_cache_read_usage_perc"][()] == 0.25
    assert data["vllm:kv_offload_cpu_allocation_size"][()] == [2, 1]
    assert "vllm:kv_offload_cpu_allocation_size" not in m.get_stats().data["data"]


def test_store_threshold_counts_offers():
    m = manager(4, store_threshold=2)
    ctx = request("a")
    assert m.prepare_store([key(0)], ctx).keys_to_store == []
    assert m.prepare_store([key(0)], ctx).keys_to_store == [key(0)]
    assert m.get_stats().data["data"]["vllm:kv_offload_stores_skipped"][()] == 1


def test_key_longer_than_the_key_width_is_refused_without_side_effects():
    m = manager(4)
    ctx = request("a")
    with pytest.raises(KeyTooLongError, match="key width of 40 bytes"):
        m.prepare_store([key(0), b"x" * 60], ctx)
    assert m.lookup(key(0), ctx) == MISS
    assert m.prepare_store([key(0)], ctx).store_spec.chunk_ids.tolist() == [0]


# --- LRU (docs/vllm-contract.md §3.6) ---


def test_lru_evicts_request_tails_first_and_head_becomes_mru():
    m = manager(4)
    a_keys = [key(i) for i in range(4)]
    a = request("a", a_keys)
    store(m, a_keys, a)
    # while the request runs, its tail is older than its head
    b = request("b")
    assert m.prepare_store([key(10)], b).evicted_keys == [key(3)]
    m.complete_store([key(10)], b)
    m.on_request_finished(b)
    m.on_request_finished(a)  # a's keys get fresh ranks tail -> head: head is MRU
    c = request("c")
    assert store(m, [key(11), key(12)], c).evicted_keys == [key(10), key(2)]


def test_lru_touch_makes_first_key_most_recent():
    m = manager(3)
    ctx = request("a")
    store(m, [key(0), key(1), key(2)], ctx)
    m.touch([key(0), key(1)], ctx)
    assert store(m, [key(3)], request("b")).evicted_keys == [key(2)]
    assert store(m, [key(4)], request("c")).evicted_keys == [key(1)]


# --- ARC (docs/vllm-contract.md §3.7) ---


def test_arc_reuse_promotes_to_t2_and_t1_is_evicted_first():
    m = manager(3, "arc")
    a = request("a")
    store(m, [key(0), key(1), key(2)], a)
    m.on_request_finished(a)
    reader = request("r")
    m.prepare_load([key(0)], reader)  # a reuse of a ready chunk
    m.complete_load([key(0)], reader)
    m.on_request_finished(reader)
    policy = m._policy
    # finishing "a" re-ranked its inserts tail -> head, so the head is T1's MRU
    assert list(policy.t2) == [key(0)] and list(policy.t1) == [key(2), key(1)]
    assert store(m, [key(3)], request("b")).evicted_keys == [key(2)]
    assert list(policy.b1) == [key(2)]


def test_arc_ghost_hit_adapts_target_and_reinserts_into_t1():
    m = manager(2, "arc")
    store(m, [key(0), key(1)], request("a"))
    store(m, [key(2)], request("b"))  # evicts key(0) into B1
    assert list(m._policy.b1) == [key(0)]
    store(m, [key(0)], request("c"))  # B1 ghost hit: p grows by max(1, |B2|/|B1|)
    assert m._policy.target_t1_size == 1.0
    assert key(0) in m._policy.t1 and key(0) not in m._policy.b1


def test_arc_ghost_lists_are_bounded_by_capacity():
    m = manager(2, "arc")
    for i in range(0, 20, 2):
        store(m, [key(i), key(i + 1)], request(f"r{i}"))
    assert len(m._policy.b1) <= 2 and len(m._policy.b2) <= 2


# --- reference model (independent of vLLM) ---

ops = st.lists(
    st.tuples(st.sampled_from(["store", "complete", "fail", "load", "unload", "finish"]),
              st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True)),
    min_size=5, max_size=60,
)


@pytest.mark.parametrize("policy", ["lru", "arc"])
@settings(max_examples=200, deadline=None)
@given(sequence=ops, capacity=st.integers(1, 6))
def test_against_a_reference_model(policy, sequence, capacity):
    """A dict model of states and pins: the manager may choose victims, but
    never a pinned, pending or offered key, never more rows than capacity,
    and refuses a store exactly when too few rows can be freed."""
    m = manager(capacity, policy)
    ctx = request("r")
    state: dict[bytes, int] = {}  # key -> ref count (-1 pending)
    rows: dict[bytes, int] = {}
    for op, ids in sequence:
        keys = [key(i) for i in ids]
        if op == "store":
            new = [k for k in keys if k not in state]
            evictable = [k for k, c in state.items() if c == 0 and k not in keys]
            out = m.prepare_store(keys, ctx)
            if len(new) > capacity - len(state) + len(evictable):
                assert out is None
                continue
            assert out is not None and out.keys_to_store == new
            assert set(out.evicted_keys) <= set(evictable)
            assert len(out.evicted_keys) == max(0, len(new) - (capacity - len(state)))
            for k in out.evicted_keys:
                del state[k]
                rows.pop(k)
            ids_ = out.store_spec.chunk_ids.tolist()
            assert len(set(ids_)) == len(ids_) and not set(ids_) & set(rows.values())
            assert all(0 <= r < capacity for r in ids_)
            for k, r in zip(new, ids_):
                state[k], rows[k] = -1, r
        elif op in ("complete", "fail"):
            pending = [k for k in keys if state.get(k) == -1]
            m.complete_store(keys, ctx, success=(op == "complete"))
            for k in pending:
                if op == "complete":
                    state[k] = 0
                else:
                    del state[k]
                    rows.pop(k)
        elif op == "load":
            hits = [k for k in keys if state.get(k, -1) >= 0]
            if hits:
                assert m.prepare_load(hits, ctx).chunk_ids.tolist() == [rows[k] for k in hits]
                for k in hits:
                    state[k] += 1
        elif op == "unload":
            pinned = [k for k in keys if state.get(k, 0) > 0]
            m.complete_load(pinned, ctx)
            for k in pinned:
                state[k] -= 1
        elif op == "finish":
            m.on_request_finished(ctx)
            ctx = request(f"r{len(state)}-{ids[0]}")
        for k in (key(i) for i in range(12)):
            expected = MISS if k not in state else (PENDING if state[k] < 0 else HIT)
            assert m.lookup(k, ctx) == expected


# --- warm attach: the table in the segment is the source of truth ---


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_attach_rebuilds_index_and_policy_from_the_segment(engine_id, policy):
    geometry = ArenaGeometry(num_chunks=6, row_stride=4096, page_size_per_worker=4096, world_size=1)
    with open_segment(engine_id, geometry, "fp", owner=True) as segment:
        first = CPUPrimaryTierOffloadingManager(segment, policy)
        a = request("a", [key(i) for i in range(4)])
        store(first, [key(i) for i in range(4)], a)
        first.on_request_finished(a)
        r = request("r")
        first.prepare_load([key(2)], r)
        first.complete_load([key(2)], r)
        first.on_request_finished(r)
        first.prepare_store([key(9)], request("pending"))  # never completes

        control = segment.layout.control_off, segment.layout.control_off + segment.layout.control_len
        snapshot = bytes(segment._view[control[0]:control[1]])  # the table as "first" dies

        # what an owner that never died does next
        first.complete_store([key(9)], request("pending"), success=False)
        expected = [store(first, [key(20 + i)], request(f"n{i}")) for i in range(4)]

        # a restarted owner adopts the table as it was when the first one died
        segment._view[control[0]:control[1]] = snapshot
        second = CPUPrimaryTierOffloadingManager(segment, policy, attach=True)
        lookups = {k: second.lookup(k, r) for k in [key(i) for i in range(4)] + [key(9)]}
        assert lookups == {**{key(i): HIT for i in range(4)}, key(9): MISS}  # pending write dropped
        got = [store(second, [key(20 + i)], request(f"n{i}")) for i in range(4)]
        assert [(o.store_spec.chunk_ids.tolist(), o.evicted_keys) for o in got] == \
               [(o.store_spec.chunk_ids.tolist(), o.evicted_keys) for o in expected]
        assert any(o.evicted_keys for o in got)


def test_primary_tier_exposes_rows_and_read_pins_without_access(engine_id):
    geometry = ArenaGeometry(num_chunks=4, row_stride=8192, page_size_per_worker=4096, world_size=2)
    segment = open_segment(engine_id, geometry, "fp", owner=True)
    m = CPUPrimaryTierOffloadingManager(segment, "lru")
    try:
        ctx = request("a")
        out = m.prepare_write([key(0)], ctx)
        view = m.get_kv_memoryview()
        assert view.shape == (4, 8192) and view.strides[0] == 8192
        np.asarray(view)[out.store_spec.chunk_ids[0], :4] = [1, 2, 3, 4]
        m.complete_write([key(0)], ctx)
        spec = m.prepare_read([key(0)], ctx)
        assert np.asarray(view)[spec.chunk_ids[0], :4].tolist() == [1, 2, 3, 4]
        assert m.prepare_store([key(1), key(2), key(3), key(4)], ctx) is None  # pinned
        m.complete_read([key(0)], ctx)
        del view
    finally:
        m.shutdown()


# --- policies: factory, out-of-tree loading, errors ---


def test_unknown_policy_lists_the_accepted_names():
    with pytest.raises(ValueError, match=r"eviction_policy='mru'.*\['lru', 'arc'\]"):
        manager(4, "mru")


def test_out_of_tree_policy_loads_from_module_path(tmp_path, monkeypatch):
    (tmp_path / "fifo_policy.py").write_text(textwrap.dedent('''
        from collections import OrderedDict
        from shmtier.scheduler.policies import CachePolicy

        class FIFOPolicy(CachePolicy):
            def __init__(self, cache_capacity):
                super().__init__(cache_capacity)
                self.chunks = OrderedDict()
            def get(self, key):
                return self.chunks.get(key)
            def insert(self, key, chunk, req_context):
                self.chunks[key] = chunk
            def remove(self, key):
                del self.chunks[key]
            def touch(self, keys, req_context):
                pass
            def evict(self, n, protected):
                out = [(k, c) for k, c in self.chunks.items()
                       if c.ref_cnt == 0 and k not in protected][:n]
                if len(out) < n:
                    return None
                for k, _ in out:
                    del self.chunks[k]
                return out
            def clear(self):
                self.chunks.clear()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    m = manager(2, "FIFOPolicy", cache_policy_module_path="fifo_policy")
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.touch([key(0)], ctx)
    assert store(m, [key(2)], ctx).evicted_keys == [key(0)]  # FIFO ignores recency
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        manager(2, "Nope", cache_policy_module_path="fifo_policy")
    with pytest.raises(ValueError, match="cannot be imported"):
        manager(2, "FIFOPolicy", cache_policy_module_path="no_such_module_xyz")
    with pytest.raises(ValueError, match="not a CachePolicy subclass"):
        manager(2, "OrderedDict", cache_policy_module_path="fifo_policy")


@pytest.mark.vllm
def test_a_policy_written_for_vllm_runs_unchanged():
    lru = pytest.importorskip("vllm.v1.kv_offload.cpu.policies.lru")
    if not hasattr(lru.LRUCachePolicy, "on_request_access"):  # vLLM 0.32's interface
        with pytest.raises(ValueError, match=r"lacks what shmtier's CPU tier calls: "
                                             r"on_request_access, insert\(key, chunk, req_context\)"):
            manager(2, "LRUCachePolicy",
                    cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru")
        return
    m = manager(2, "LRUCachePolicy", cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru")
    ctx = request("a")
    store(m, [key(0), key(1)], ctx)
    m.prepare_load([key(0)], ctx)
    assert store(m, [key(2)], ctx).evicted_keys == [key(1)]  # vLLM's policy saw the pin


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        CachePolicyFactory.register_cache_policy("lru", "x", "y")
    assert issubclass(CachePolicyFactory.get_cache_policy_cls("arc"), CachePolicy)


# --- reserve_rows: the tiering manager's batched promotion reservations ---


def _state_of(m: CPUOffloadingManager, ctx: ReqContext) -> tuple:
    return (m.resident_keys(), [(e.keys, e.removed) for e in m.take_events()],
            m.get_stats().data["data"], [m.lookup(key(i), ctx) for i in range(40)])


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 8), history=st.lists(st.tuples(
    st.sampled_from(["store", "pin", "fail"]), st.lists(st.integers(0, 15), min_size=1,
                                                        max_size=4)), max_size=12),
       wanted=st.lists(st.integers(16, 30), min_size=1, max_size=8, unique=True),
       protected=st.lists(st.integers(0, 15), max_size=4))
def test_reserve_rows_matches_prepare_store_key_by_key(capacity, history, wanted, protected):
    """reserve_rows(keys) gives the rows, victims, events and stats of one
    prepare_store([key]) per key in order (LRU), keeps ``protected`` from eviction and
    fails a suffix of keys when room runs out."""
    batched, per_key = manager(capacity), manager(capacity)
    for m in (batched, per_key):
        ctx = request("history", [key(i) for i in range(16)])
        for op, idx in history:
            keys = [key(i) for i in idx]
            out = m.prepare_store(keys, ctx)
            if out is None:
                continue
            m.complete_store(out.keys_to_store, ctx, success=op != "fail")
            if op == "pin":
                m.prepare_load([k for k in keys if m.lookup(k, ctx) == HIT], ctx)
        list(m.take_events())
        m.get_stats()
    ctx_b = request("r", [key(i) for i in wanted])
    ctx_p = request("r", [key(i) for i in wanted])
    keys = [key(i) for i in wanted]
    kept = {key(i) for i in protected} & set(per_key.resident_keys())
    # per key, with the protected keys made un-evictable for the duration (pinned)
    hold = request("hold")
    held = [k for k in kept if per_key.lookup(k, hold) == HIT]
    per_key.prepare_load(held, hold)
    expected = []
    for k in keys:
        out = per_key.prepare_store([k], ctx_p)
        expected.append(None if out is None else int(out.store_spec.chunk_ids[0]))
    per_key.complete_load(held, hold)
    obtainable = batched.rows_obtainable(sum(map(batched.is_evictable, kept)))
    got = batched.reserve_rows(keys, ctx_b, kept)
    assert got == expected
    granted = [row for row in got if row is not None]
    assert len(granted) == min(len(keys), obtainable)
    assert got == granted + [None] * (len(keys) - len(granted))  # failures are a suffix
    assert all(k in batched.resident_keys() for k in kept)
    assert _state_of(batched, ctx_b) == _state_of(per_key, ctx_p)


def test_reserve_rows_refuses_keys_longer_than_the_key_width():
    m = manager(2)
    with pytest.raises(KeyTooLongError):
        m.reserve_rows([b"x" * 41], request("r"))
    assert m.resident_keys() == {}


def test_lru_orders_positions_across_the_whole_token_range():
    """Ranks are packed into one int: positions up to 2**48 tokens must order as
    (request rank, -position) does, and larger ones must not break the cache."""
    m = manager(4)
    a = ReqContext("a")  # the older request: its request rank is smaller
    a.set_offload_key_position(key(0), 5)
    store(m, [key(0)], a)
    b = ReqContext("b")
    for k, position in [(key(1), 7), (key(2), 2**48 - 2), (key(3), 2**48 - 1)]:
        b.set_offload_key_position(k, position)
    store(m, [key(1), key(2), key(3)], b)
    # a's chunk is older than any of b's, however far b's positions reach; then
    # b's tail goes first
    assert store(m, [key(4)], request("c")).evicted_keys == [key(0)]
    assert store(m, [key(5)], request("d")).evicted_keys == [key(3)]
    huge = ReqContext("huge")
    huge.set_offload_key_position(key(6), 2**60)
    assert store(m, [key(6)], huge).evicted_keys == [key(2)]
    assert m.lookup(key(6), huge) is LookupResult.HIT
