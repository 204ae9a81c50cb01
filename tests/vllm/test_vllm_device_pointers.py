"""shmtier's block copy worker fed the way vLLM 0.34 feeds an offloading worker:
the GPU side of every transfer as ``DevicePointers`` resolved by vLLM's own
``resolve_device_pointers`` from vLLM's ``GPULoadStoreSpec`` and
``CanonicalKVCaches`` (CPU tensors, built as the connector's
``register_kv_caches`` builds them: int8 ``(num_blocks, page)`` views of each
layer's storage, a packed one with a block stride wider than its page).

A real :class:`BlockCopyWorker` over a real segment; blocks must round-trip
byte-exact and land in the arena exactly where a ``GPULoadStoreSpec`` of the
same blocks puts them (vLLM 0.33's path). vLLM's own connector worker half
(``OffloadingConnectorWorker``) drives stores and loads through it, and turns a
failed copy into a failed receive (async load) or an error (sync load).

Skips on vLLM before 0.34 (no ``vllm.v1.kv_offload.pointer_utils``). Does not
import ``shmtier.vllm``: the worker is used directly.
"""

from __future__ import annotations

import types
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pointer_utils = pytest.importorskip(
    "vllm.v1.kv_offload.pointer_utils",
    reason="vLLM < 0.34: its connector passes GPULoadStoreSpec, not DevicePointers")

from test_copy_worker import arena_array, geometry_for, opened, outcomes  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload import base as vb  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from shmtier.gpu import BlockCopyWorker  # noqa: E402

resolve = pointer_utils.resolve_device_pointers

BLOCKS = 24
LAYER_PAGE = 1024  # fp16 K+V x 16 tokens x 2 heads x 8 dims
PACKED_PAGE, PACKED_STRIDE, PACKED_UNPADDED = 1536, 2048, 1400
PAGES = [LAYER_PAGE, LAYER_PAGE, PACKED_PAGE]
# Group 0: two attention layers (tensors 0, 1); group 1: one layer in a packed
# tensor whose blocks are 2048 bytes apart and use 1400 of their 1536-byte page.
REFS = [[vb.CanonicalKVCacheRef(0, LAYER_PAGE), vb.CanonicalKVCacheRef(1, LAYER_PAGE)],
        [vb.CanonicalKVCacheRef(2, PACKED_UNPADDED)]]


def kv_caches(seed: int | None):
    """vLLM's CanonicalKVCaches over fresh layer storages (random bytes, or zeros),
    and those storages' raw bytes as int8 tensors (to check every byte, padding and
    gaps included)."""
    gen = torch.Generator().manual_seed(seed or 0)
    fill = (lambda n: torch.randint(-128, 128, (n,), dtype=torch.int8, generator=gen)) \
        if seed is not None else (lambda n: torch.zeros(n, dtype=torch.int8))
    layers = [fill(BLOCKS * LAYER_PAGE).view(torch.float16).view(BLOCKS, 2, 16, 2, 8)
              for _ in range(2)]
    packed = fill(BLOCKS * PACKED_STRIDE)
    raws = [layer.view(-1).view(torch.int8) for layer in layers] + [packed]
    views = [torch.tensor([], dtype=torch.int8).set_(layer.untyped_storage(), 0,
                                                     (BLOCKS, LAYER_PAGE), (LAYER_PAGE, 1))
             for layer in layers]
    views.append(torch.tensor([], dtype=torch.int8).set_(
        packed.untyped_storage(), 0, (BLOCKS, PACKED_PAGE), (PACKED_STRIDE, 1)))
    caches = vb.CanonicalKVCaches(
        tensors=[vb.CanonicalKVCacheTensor(v, p) for v, p in zip(views, PAGES)],
        group_data_refs=REFS)
    return caches, raws


def copied(src_raws, dst_raws, pairs_per_group):
    """``dst_raws`` as they must be after copying blocks ``(src, dst)`` per group:
    each ref's unpadded bytes of each block, no other byte changed."""
    want = [r.clone() for r in dst_raws]
    strides = [LAYER_PAGE, LAYER_PAGE, PACKED_STRIDE]
    for refs, pairs in zip(REFS, pairs_per_group):
        for ref in refs:
            t, n, row = ref.tensor_idx, ref.page_size_bytes, strides[ref.tensor_idx]
            for a, b in pairs:
                want[t][b * row:b * row + n] = src_raws[t][a * row:a * row + n]
    return want


def chunks_needed(sizes, indices, bpc) -> int:
    return sum(-(-(n + i % bpc) // bpc) for n, i in zip(sizes, indices) if n)


@pytest.mark.parametrize("bpc, sizes, indices", [
    (1, [5, 3], [0, 2]),
    (4, [5, 3], [6, 3]),  # skips 2 and 3 sub-blocks of each group's first chunk
    (4, [0, 6], [0, 9]),  # an empty group
])
def test_pointer_round_trip_matches_the_block_id_path(bpc, sizes, indices):
    """Stored from vLLM's pointers, the arena equals a store of the same blocks by
    id (vLLM 0.33's path) in a second segment; loaded back by pointers, every
    destination byte is as expected."""
    src, src_raws = kv_caches(seed=bpc)
    dst, dst_raws = kv_caches(seed=None)
    rng = np.random.default_rng(bpc)
    total = sum(sizes)
    src_ids = rng.permutation(BLOCKS)[:total].tolist()
    dst_ids = rng.permutation(BLOCKS)[:total].tolist()
    rows = chunks_needed(sizes, indices, bpc)
    chunks = rng.permutation(rows + 2)[:rows].tolist()
    geometry = geometry_for(PAGES, bpc, 1, rows + 2)
    with opened(f"test-dp-{uuid.uuid4().hex[:12]}", geometry) as seg_ptrs, \
            opened(f"test-dp-{uuid.uuid4().hex[:12]}", geometry) as seg_ids:
        with BlockCopyWorker(src, seg_ptrs, bpc, 0) as storer, \
                BlockCopyWorker(src, seg_ids, bpc, 0) as id_storer:
            spec = vb.GPULoadStoreSpec(src_ids, sizes, indices)
            storer.submit_store(1, resolve(spec, src), CPULoadStoreSpec(chunks))
            id_storer.submit_store(1, spec, CPULoadStoreSpec(chunks))
            storer.wait({1})
            id_storer.wait({1})
            nbytes = sizes[0] * 2 * LAYER_PAGE + sizes[1] * PACKED_UNPADDED
            assert outcomes(storer.get_finished()) == [(1, True, nbytes)]
            assert id_storer.get_finished()[0].transfer_size == nbytes
        arena = arena_array(seg_ptrs)
        assert arena.any() and np.array_equal(arena, arena_array(seg_ids))

        groups = np.repeat(np.arange(len(sizes)), sizes)
        with BlockCopyWorker(dst, seg_ptrs, bpc, 0) as loader:
            loader.submit_load(2, CPULoadStoreSpec(chunks),
                               resolve(vb.GPULoadStoreSpec(dst_ids, sizes, indices), dst))
            loader.wait({2})
            assert outcomes(loader.get_finished()) == [(2, True, nbytes)]
        pairs = [[(a, b) for a, b, g2 in zip(src_ids, dst_ids, groups) if g2 == g]
                 for g in range(len(sizes))]
        for got, want in zip(dst_raws, copied(src_raws, dst_raws, pairs)):
            assert torch.equal(got, want)


def test_expedited_pointer_load_with_vllms_spec(engine_id):
    src, src_raws = kv_caches(seed=7)
    dst, dst_raws = kv_caches(seed=None)
    sizes, indices = [2, 1], [1, 0]
    geometry = geometry_for(PAGES, 2, 1, 4)
    with opened(engine_id, geometry) as segment:
        with BlockCopyWorker(src, segment, 2, 0) as storer, \
                BlockCopyWorker(dst, segment, 2, 0) as loader:
            storer.submit_store(1, resolve(vb.GPULoadStoreSpec([4, 9, 17], sizes, indices), src),
                                CPULoadStoreSpec([3, 0, 1]))
            storer.wait({1})
            loader.submit_load(2, CPULoadStoreSpec([3, 0, 1]),
                               resolve(vb.GPULoadStoreSpec([0, 23, 5], sizes, indices), dst),
                               expedited=True)
            loader.wait({2})
            assert [r.success for r in storer.get_finished() + loader.get_finished()] == [
                True, True]
    want = copied(src_raws, dst_raws, [[(4, 0), (9, 23)], [(17, 5)]])
    for got, expected in zip(dst_raws, want):
        assert torch.equal(got, expected)


def test_bad_pointers_raise_value_error_at_submit(engine_id):
    src, _ = kv_caches(seed=1)
    other, _ = kv_caches(seed=None)
    spec = vb.GPULoadStoreSpec([1, 2, 3], [2, 1], [0, 0])
    geometry = geometry_for(PAGES, 1, 1, 4)
    with opened(engine_id, geometry) as segment:
        with BlockCopyWorker(src, segment, 1, 0) as worker:
            cpu = CPULoadStoreSpec([0, 1, 2])
            with pytest.raises(ValueError, match=r"group 0 data ref 0 \(kv tensor 0\): device "
                                                 r"pointer 0x[0-9a-f]+ of block 0 lies outside"):
                worker.submit_store(1, resolve(spec, other), cpu)  # another cache's tensors
            shifted = resolve(spec, src)
            shifted.ptrs[4] += np.uint64(LAYER_PAGE)  # one page on: not a packed block start
            with pytest.raises(ValueError, match=r"group 1 data ref 0 \(kv tensor 2\): .* is "
                                                 r"1024 bytes past a block boundary"):
                worker.submit_load(2, cpu, shifted)
            beyond = resolve(vb.GPULoadStoreSpec([1, 2, BLOCKS], [2, 1], [0, 0]), src)
            with pytest.raises(ValueError, match=r"kv tensor 2\): .* lies outside"):
                worker.submit_store(3, beyond, cpu)
            padded = resolve(spec, src)
            padded.sizes[4] = np.uint64(PACKED_PAGE)
            with pytest.raises(ValueError, match="unpadded page of 1400 bytes, got 1536"):
                worker.submit_store(4, padded, cpu)
            assert worker.get_finished() == []


def test_vllms_connector_worker_drives_it_and_reports_failed_copies(engine_id):
    """vLLM's OffloadingConnectorWorker resolves the pointers and calls the worker
    itself; a failed async load becomes a failed receive, a failed sync load raises."""
    caches, raws = kv_caches(seed=3)
    geometry = geometry_for(PAGES, 1, 1, 8)
    with opened(engine_id, geometry) as segment, \
            BlockCopyWorker(caches, segment, 1, 0) as worker:
        spec = types.SimpleNamespace(
            replicated_layout=False, get_worker=lambda kv: worker,
            config=types.SimpleNamespace(canonical_layout=False,
                                         parallel=types.SimpleNamespace(rank=0)))
        connector = OffloadingConnectorWorker(spec, None, None)
        # register_kv_caches' last step, without the model config it derives caches from
        connector._init_worker(caches)
        try:
            run = worker._load_queue._execute

            def fails_for_jobs_3_and_4(job):
                if job.job_id in (3, 4):
                    raise OSError("injected copy failure")
                run(job)

            worker._load_queue._execute = fails_for_jobs_3_and_4
            worker._expedited_queue._execute = fails_for_jobs_3_and_4

            def step(load_jobs=None, store_jobs=None):
                connector.start_kv_transfers(OffloadingConnectorMetadata(load_jobs or {}, {}))
                if store_jobs:
                    connector.prepare_store_kv(OffloadingConnectorMetadata({}, store_jobs))

            def gpu(ids):
                return vb.GPULoadStoreSpec(ids, [2, 1], [0, 0])

            step(store_jobs={1: TransferJob("req-s", gpu([2, 3, 4]), CPULoadStoreSpec([5, 6, 7]))})
            step()  # the deferred store is submitted at the start of the next step
            worker.wait({1})
            before = [r.clone() for r in raws]
            step(load_jobs={2: TransferJob("req-ok", CPULoadStoreSpec([5, 6, 7]),
                                           gpu([10, 11, 12])),
                            3: TransferJob("req-bad", CPULoadStoreSpec([5, 6, 7]),
                                           gpu([13, 14, 15]))})
            worker.wait({2, 3})
            assert connector.get_finished(set()) == (set(), {"req-ok", "req-bad"})
            assert connector.take_failed_recving() == {"req-bad"}
            meta = connector.build_connector_worker_meta()
            assert meta.completed_jobs == {1: 1, 2: 1, 3: 1} and meta.failed_jobs == {3}
            for got, want in zip(raws, copied(before, before, [[(2, 10), (3, 11)], [(4, 12)]])):
                assert torch.equal(got, want)

            step(load_jobs={4: TransferJob("req-sync", CPULoadStoreSpec([5, 6, 7]),
                                           gpu([16, 17, 18]), sync=True)})
            with pytest.raises(RuntimeError, match="sync load job 4 failed"):
                connector.get_finished(set())
        finally:
            connector.shutdown()
