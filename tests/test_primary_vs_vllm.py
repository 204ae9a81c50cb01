"""Differential test: shmtier's CPU tier against the installed vLLM's own
CPUOffloadingManager (0.33 or 0.34; their policies decide alike, and 0.34 has no
``touch``, so the ``touch`` step runs only where vLLM has it).

Hypothesis drives both with the same random operation sequences; every
externally visible outcome must agree exactly: lookup results, stored keys,
chunk ids, evicted keys, events and stats. This is the strongest statement of
"vLLM's exact behaviour" for LRU and ARC.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm

vllm_manager = pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
vllm_base = pytest.importorskip("vllm.v1.kv_offload.base")
if not hasattr(vllm_base.OffloadingManager, "lock"):
    pytest.skip("vLLM 0.32's LRU and ARC rank requests differently; shmtier keeps 0.33's "
                "policies there (docs/vllm-contract.md §15)", allow_module_level=True)
HAS_TOUCH = hasattr(vllm_manager.CPUOffloadingManager, "touch")  # gone in 0.34

from shmtier.contract import ReqContext  # noqa: E402
from shmtier.scheduler.primary import CPUOffloadingManager  # noqa: E402
from shmtier.shared.chunk_table import ChunkTable  # noqa: E402

NUM_KEYS = 14
KEYS = [bytes([k]) * 32 + (k % 2).to_bytes(4, "big") for k in range(NUM_KEYS)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 1), st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=6, unique=True)),
        st.tuples(st.just("complete_store"), st.integers(0, 1), st.booleans()),
        st.tuples(st.just("load"), st.integers(0, 1), st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=4, unique=True)),
        st.tuples(st.just("complete_load"), st.integers(0, 1)),
        st.tuples(st.just("finish"), st.integers(0, 1)),
        st.tuples(st.just("touch"), st.integers(0, 1), st.lists(st.integers(0, NUM_KEYS - 1), max_size=4, unique=True)),
        st.tuples(st.just("reset"),),
    ),
    min_size=10,
    max_size=80,
)


class Pair:
    """The two managers plus parallel request contexts and job bookkeeping."""

    def __init__(self, policy: str, capacity: int, with_positions: bool):
        self.ours = CPUOffloadingManager(ChunkTable.private(capacity, 40), policy, enable_events=True)
        self.theirs = vllm_manager.CPUOffloadingManager(capacity, policy, enable_events=True)
        self.with_positions = with_positions
        self.generation = 0
        self.ctx: dict[int, tuple] = {}
        self.pending_stores: dict[int, list] = {}
        self.pending_loads: dict[int, list] = {}

    def context(self, req: int):
        if req not in self.ctx:
            name = f"req{req}-{self.generation}"
            pair = (ReqContext(name), vllm_base.ReqContext(name))
            for c in pair:
                if self.with_positions:
                    for i, key in enumerate(KEYS):
                        c.set_offload_key_position(key, (i + 1) * 16)
            self.ours.on_new_request(pair[0])
            self.theirs.on_new_request(pair[1])
            self.ctx[req] = pair
        return self.ctx[req]

    def check_events_and_stats(self):
        mine = [(e.keys, e.removed, e.metadata_only) for e in self.ours.take_events()]
        theirs = [(list(e.keys), e.removed, e.metadata_only) for e in self.theirs.take_events()]
        assert mine == theirs
        a, b = self.ours.get_stats().data, self.theirs.get_stats().data
        assert a["data"] == b["data"]


def run(pair: Pair, sequence) -> None:
    for op in sequence:
        kind = op[0]
        if kind == "store":
            ours_ctx, their_ctx = pair.context(op[1])
            keys = [KEYS[i] for i in op[2]]
            a = pair.ours.prepare_store(keys, ours_ctx)
            b = pair.theirs.prepare_store(keys, their_ctx)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.keys_to_store == b.keys_to_store
                assert a.evicted_keys == b.evicted_keys
                assert a.store_spec.block_ids.tolist() == b.store_spec.block_ids.tolist()
                if a.keys_to_store:
                    pair.pending_stores.setdefault(op[1], []).append(a.keys_to_store)
        elif kind == "complete_store":
            batches = pair.pending_stores.get(op[1])
            if batches:
                keys = batches.pop(0)
                ours_ctx, their_ctx = pair.context(op[1])
                pair.ours.complete_store(keys, ours_ctx, success=op[2])
                pair.theirs.complete_store(keys, their_ctx, success=op[2])
        elif kind == "load":
            ours_ctx, their_ctx = pair.context(op[1])
            keys = [KEYS[i] for i in op[2]]
            results = [pair.ours.lookup(k, ours_ctx).name for k in keys]
            assert results == [pair.theirs.lookup(k, their_ctx).name for k in keys]
            hits = [k for k, r in zip(keys, results) if r == "HIT"]
            if hits:
                a = pair.ours.prepare_load(hits, ours_ctx)
                b = pair.theirs.prepare_load(hits, their_ctx)
                assert a.block_ids.tolist() == b.block_ids.tolist()
                pair.pending_loads.setdefault(op[1], []).append(hits)
        elif kind == "complete_load":
            batches = pair.pending_loads.get(op[1])
            if batches:
                keys = batches.pop(0)
                ours_ctx, their_ctx = pair.context(op[1])
                pair.ours.complete_load(keys, ours_ctx)
                pair.theirs.complete_load(keys, their_ctx)
        elif kind == "finish":
            if op[1] in pair.ctx:
                ours_ctx, their_ctx = pair.ctx.pop(op[1])
                pair.ours.on_request_finished(ours_ctx)
                pair.theirs.on_request_finished(their_ctx)
                # its in-flight jobs still complete later, under a new context object
                for store in pair.pending_stores.pop(op[1], []):
                    pair.ours.complete_store(store, ours_ctx)
                    pair.theirs.complete_store(store, their_ctx)
                for load in pair.pending_loads.pop(op[1], []):
                    pair.ours.complete_load(load, ours_ctx)
                    pair.theirs.complete_load(load, their_ctx)
        elif kind == "touch" and HAS_TOUCH:
            ours_ctx, their_ctx = pair.context(op[1])
            keys = [KEYS[i] for i in op[2]]
            pair.ours.touch(keys, ours_ctx)
            pair.theirs.touch(keys, their_ctx)
        elif kind == "reset":
            pair.ours.reset_cache()
            pair.theirs.reset_cache()
            pair.pending_stores.clear()
            pair.pending_loads.clear()
            pair.ctx.clear()
            pair.generation += 1
        pair.check_events_and_stats()
    for key in KEYS:
        assert pair.ours.lookup(key, ReqContext("x")).name == pair.theirs.lookup(
            key, vllm_base.ReqContext("x")).name


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("with_positions", [False, True])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=ops, capacity=st.integers(1, 8))
def test_same_outcomes_as_vllm(policy, with_positions, sequence, capacity):
    run(Pair(policy, capacity, with_positions), sequence)
