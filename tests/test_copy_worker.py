"""Block copy worker: byte-exact round trips through a real segment, the vLLM
row layout at exact offsets, two ranks in two processes, queue independence,
descriptor errors, the GPU side given as block ids (vLLM 0.32/0.33's
GPULoadStoreSpec) or as device pointers (vLLM 0.34's DevicePointers, here a
local dataclass of the same shape), failed copies reported as failed results.

The "GPU" KV caches are CPU tensors here (what runs everywhere); the copy
semantics are the ones the CUDA path uses.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import multiprocessing as mp
import pathlib
import queue as queue_mod
import threading
import traceback
import types
import uuid
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmtier.contract import CPULoadStoreSpec, GPULoadStoreSpec
from shmtier.gpu import (
    BlockCopyWorker,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment

CTX = mp.get_context("spawn")
FP = "test-copy-worker"


@pytest.fixture
def engine_id() -> str:
    """A unique engine id (tests/conftest.py may provide its own)."""
    return f"test-cw-{uuid.uuid4().hex[:12]}"


def geometry_for(pages: list[int], bpc: int, world_size: int, num_chunks: int) -> ArenaGeometry:
    per_row = ArenaGeometry.for_kv(cpu_bytes_to_use=1 << 40, worker_kv_bytes_per_block=sum(pages),
                                   blocks_per_chunk=bpc, world_size=world_size).row_stride
    return ArenaGeometry.for_kv(cpu_bytes_to_use=num_chunks * per_row,
                                worker_kv_bytes_per_block=sum(pages), blocks_per_chunk=bpc,
                                world_size=world_size)


@contextmanager
def opened(engine_id: str, geometry: ArenaGeometry, rank: int = 0):
    segment = open_segment(engine_id, geometry, FP, owner=True, rank=rank)
    try:
        yield segment
    finally:
        segment.close()


def random_caches(pages, num_blocks, refs, seed):
    """Source caches with random bytes, in vLLM's CanonicalKVCacheTensor form."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(
            torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=gen), page)
        for page in pages
    ]
    return CanonicalKVCaches(tensors, refs)


def zero_caches(pages, num_blocks, refs):
    """Destination caches as bare (num_blocks, page) int8 tensors (the shorthand form)."""
    return CanonicalKVCaches([torch.zeros((num_blocks, p), dtype=torch.int8) for p in pages], refs)


def expected_placement(pages, refs, bpc, geometry, rank, gpu_ids, chunk_ids, sizes, indices):
    """Independent model of the layout: yields (tensor, nbytes, gpu block, arena offset)."""
    tensor_off = np.concatenate([[0], np.cumsum([p * bpc for p in pages])[:-1]])
    gpos = cpos = 0
    for g, (size, first) in enumerate(zip(sizes, indices)):
        if size == 0:
            continue
        skip = first % bpc
        for k in range(size):
            chunk = chunk_ids[cpos + (skip + k) // bpc]
            j = (skip + k) % bpc
            for ref in refs[g]:
                t = ref.tensor_idx
                offset = (chunk * geometry.row_stride + rank * geometry.page_size_per_worker
                          + tensor_off[t] + j * pages[t])
                yield t, ref.page_size_bytes, gpu_ids[gpos + k], offset
        gpos += size
        cpos += -(-(size + skip) // bpc)


@dataclasses.dataclass
class Pointers:
    """The shape of vLLM 0.34's ``DevicePointers`` (this file stays vLLM-free)."""

    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple
    group_data_ref_counts: tuple
    block_indices: tuple


def pointers_for(caches, refs, block_ids, sizes, indices) -> Pointers:
    """Addresses of blocks ``block_ids`` (groups of ``sizes``) of every ref, in vLLM's
    order: for each group, for each ref, for each block (``base + id * row stride``)."""
    ptrs, nbytes, pos = [], [], 0
    for size, group in zip(sizes, refs):
        ids = list(block_ids[pos:pos + size])
        for ref in group:
            entry = caches.tensors[ref.tensor_idx]
            tensor = entry if isinstance(entry, torch.Tensor) else entry.tensor
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in ids]
            nbytes += [ref.page_size_bytes] * len(ids)
        pos += size
    return Pointers(np.array(ptrs, dtype=np.uint64), np.array(nbytes, dtype=np.uint64),
                    tuple(sizes), tuple(len(group) for group in refs), tuple(indices))


def outcomes(results) -> list[tuple]:
    """(job id, success, bytes) of each TransferResult."""
    return [(r.job_id, r.success, r.transfer_size) for r in results]


def arena_array(segment) -> np.ndarray:
    return np.frombuffer(segment.arena_rows(), dtype=np.uint8).reshape(-1)


def check_store_and_round_trip(segment, pages, refs, bpc, rank, sizes, indices, chunk_ids,
                               num_blocks=64, seed=0, threads=True, check_whole_arena=True,
                               consecutive=False, patch=None, pointers=False):
    """Store, verify the arena byte-exactly, load into fresh caches, verify.

    GPU block ids are scattered, or (``consecutive``) runs of ascending ids; the
    GPU side is a GPULoadStoreSpec, or (``pointers``) device pointers to those blocks.
    """
    geometry = segment.geometry
    rng = np.random.default_rng(seed)
    src = random_caches(pages, num_blocks, refs, seed)
    dst = zero_caches(pages, num_blocks, refs)
    total = sum(sizes)
    gpu_ids = rng.permutation(num_blocks)[:total].tolist()
    load_ids = rng.permutation(num_blocks)[:total].tolist()
    if consecutive:
        gpu_ids = list(range(1, 1 + total))
        load_ids = list(range(num_blocks - total, num_blocks))
    src_spec = GPULoadStoreSpec(gpu_ids, sizes, indices)
    dst_spec = GPULoadStoreSpec(load_ids, sizes, indices)
    if pointers:
        src_spec = pointers_for(src, refs, gpu_ids, sizes, indices)
        dst_spec = pointers_for(dst, refs, load_ids, sizes, indices)
    cpu_spec = CPULoadStoreSpec(chunk_ids)
    placement = list(expected_placement(pages, refs, bpc, geometry, rank,
                                         gpu_ids, chunk_ids, sizes, indices))
    expected_bytes = sum(n for _, n, _, _ in placement)

    def one_job(caches, job_id, store):
        """One job on a fresh worker over ``caches``; asserts it succeeded whole."""
        with BlockCopyWorker(caches, segment, bpc, rank, threads=threads) as worker:
            if patch:
                patch(worker)
            if store:
                assert worker.submit_store(job_id, src_spec, cpu_spec) is True
            else:
                assert worker.submit_load(job_id, cpu_spec, dst_spec) is True
            worker.wait({job_id})
            results = worker.get_finished()
        assert outcomes(results) == [(job_id, True, expected_bytes)]
        assert results[0].transfer_time >= 0

    before = arena_array(segment).copy()
    one_job(src, 7, store=True)

    arena = arena_array(segment)
    want = before.copy()
    for t, nbytes, block, offset in placement:
        block_bytes = src.tensors[t].tensor[block, :nbytes].numpy().view(np.uint8)
        np.testing.assert_array_equal(arena[offset:offset + nbytes], block_bytes)
        want[offset:offset + nbytes] = block_bytes
    if check_whole_arena:  # nothing else written: padding, other slots, other rows
        assert np.array_equal(arena, want)

    one_job(dst, 8, store=False)

    want_dst = [torch.zeros_like(t) for t in dst.tensors]
    moved = dict(zip(gpu_ids, load_ids))
    for t, nbytes, block, _ in placement:
        want_dst[t][moved[block], :nbytes] = src.tensors[t].tensor[block, :nbytes]
    for t in range(len(pages)):
        assert torch.equal(dst.tensors[t], want_dst[t]), f"tensor {t} differs after load"
    return arena


def round_trips(engine_id, pages, refs, *, bpc, num_chunks, jobs, world_size=1, rank=0):
    """A segment for this cache layout; each job (check_store_and_round_trip's keyword
    arguments) stored, checked and loaded back in turn. Returns the geometry and a
    copy of the arena after each job."""
    geometry = geometry_for(pages, bpc, world_size, num_chunks)
    with opened(engine_id, geometry, rank=rank) as segment:
        return geometry, [check_store_and_round_trip(segment, pages, refs, bpc, rank, **job).copy()
                          for job in jobs]


def use_cuda_copy_plan(worker):
    """Run the CUDA path's copy decomposition (runs, device staging) on CPU tensors."""
    worker._store_queue._execute = worker._cuda_store
    worker._load_queue._execute = worker._cuda_load
    worker._expedited_queue._execute = worker._cuda_load


ROUND_TRIPS = {  # layout: (pages, refs, bpc, num_chunks, world_size, rank); one job
    "one-block-per-chunk": (([8192], [[CanonicalKVCacheRef(0, 8192)]], 1, 16, 1, 0),
                            dict(sizes=[5], indices=[3], chunk_ids=[9, 2, 3, 4, 15])),
    # consecutive chunks: whole rows are contiguous (one tensor fills the row)
    "four-blocks-per-chunk": (([4096], [[CanonicalKVCacheRef(0, 4096)]], 4, 12, 1, 0),
                              dict(sizes=[16], indices=[8], chunk_ids=[4, 5, 6, 11])),
    "cuda-copy-plan-on-cpu-tensors": (
        ([6144, 2048], [[CanonicalKVCacheRef(0, 6144), CanonicalKVCacheRef(1, 2048)],
                        [CanonicalKVCacheRef(1, 1500)]], 3, 10, 2, 1),
        dict(sizes=[8, 4], indices=[2, 4], chunk_ids=[7, 1, 0, 8, 2, 3],
             patch=use_cuda_copy_plan)),
}


@pytest.mark.parametrize("case, variant", [
    ("one-block-per-chunk", {"threads": True}),
    ("one-block-per-chunk", {"threads": False}),
    ("four-blocks-per-chunk", {"consecutive": False}),
    ("four-blocks-per-chunk", {"consecutive": True}),
    ("cuda-copy-plan-on-cpu-tensors", {"consecutive": False}),
    ("cuda-copy-plan-on-cpu-tensors", {"consecutive": True}),
    ("one-block-per-chunk", {"pointers": True}),
    ("one-block-per-chunk", {"pointers": True, "threads": False}),
    ("four-blocks-per-chunk", {"pointers": True}),
    ("four-blocks-per-chunk", {"pointers": True, "consecutive": True}),
    ("cuda-copy-plan-on-cpu-tensors", {"pointers": True}),
    ("cuda-copy-plan-on-cpu-tensors", {"pointers": True, "consecutive": True}),
])
def test_round_trip(engine_id, case, variant):
    (pages, refs, bpc, num_chunks, world_size, rank), job = ROUND_TRIPS[case]
    round_trips(engine_id, pages, refs, bpc=bpc, num_chunks=num_chunks, world_size=world_size,
                rank=rank, jobs=[{**job, **variant}])


def test_unaligned_first_block_partial_chunks(engine_id):
    # pages of 3072: not a multiple of the OS page, rows carry tail padding;
    # logical blocks 6..14: skip 2 of chunk 0, chunks 1 full, chunk 2 has 3
    geometry, (arena,) = round_trips(engine_id, [3072], [[CanonicalKVCacheRef(0, 3072)]], bpc=4,
                                     num_chunks=8,
                                     jobs=[dict(sizes=[9], indices=[6], chunk_ids=[3, 0, 5])])
    row3 = arena[3 * geometry.row_stride:3 * geometry.row_stride + 2 * 3072]
    assert not row3.any(), "skipped sub-blocks of the first chunk were written"


def test_two_groups_two_tensors_unpadded_pages(engine_id):
    pages = [6144, 2048]
    refs = [
        [CanonicalKVCacheRef(0, 5000), CanonicalKVCacheRef(1, 2048)],
        [CanonicalKVCacheRef(1, 1500)],  # a second group sharing tensor 1
    ]
    round_trips(engine_id, pages, refs, bpc=2, num_chunks=10, jobs=[
        dict(sizes=[5, 3], indices=[4, 3], chunk_ids=[7, 1, 0, 8, 2]),
        dict(sizes=[5, 3], indices=[4, 3], chunk_ids=[3, 4, 5, 6, 9], consecutive=True,
             check_whole_arena=False),
        dict(sizes=[4, 3], indices=[1, 2], chunk_ids=[9, 3, 2, 6, 0], pointers=True,
             check_whole_arena=False)])


def _vllm_attribute_names() -> dict[str, set[str]]:
    """Field/attribute names of vLLM 0.33's classes, read from its source (no import:
    importing vLLM costs seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "v1/kv_offload/base.py"
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        found = names.setdefault(node.name, set())
        for item in ast.walk(node):
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.add(item.target.id)
            targets = item.targets if isinstance(item, ast.Assign) else (
                [item.target] if isinstance(item, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    found.add(target.attr)
    return names


def test_duck_typed_foreign_objects_with_vllm_attribute_names(engine_id):
    """Objects that merely carry vLLM's attribute names work (a vLLM
    CanonicalKVCaches and its specs pass straight in); a zero-size group
    consumes no ids."""
    vllm_names = _vllm_attribute_names()
    for ours in (CanonicalKVCacheTensor, CanonicalKVCacheRef, CanonicalKVCaches):
        theirs = vllm_names[ours.__name__] - {"ALL"}
        assert {f.name for f in dataclasses.fields(ours)} == theirs, ours.__name__
    assert {"block_ids", "group_sizes", "block_indices"} <= (
        vllm_names["GPULoadStoreSpec"] | vllm_names["BlockIDsLoadStoreSpec"])

    ns = types.SimpleNamespace
    pages = [4096, 4096]
    refs = [[ns(tensor_idx=0, page_size_bytes=4096, mapping=None)],
            [ns(tensor_idx=1, page_size_bytes=4000, mapping=None)]]
    geometry = geometry_for(pages, 2, 1, 6)
    with opened(engine_id, geometry) as segment:
        gen = torch.Generator().manual_seed(3)
        src = [torch.randint(-128, 128, (8, p), dtype=torch.int8, generator=gen) for p in pages]
        out = [torch.zeros(8, p, dtype=torch.int8) for p in pages]
        caches = ns(tensors=[ns(tensor=t, page_size_bytes=p) for t, p in zip(src, pages)],
                    group_data_refs=refs)
        dst = ns(tensors=[ns(tensor=t.view(8, 2, p // 2), page_size_bytes=p)
                          for t, p in zip(out, pages)], group_data_refs=refs)
        ids = np.array([4, 2], dtype=np.int32)
        with BlockCopyWorker(caches, segment, 2, 0) as storer, \
                BlockCopyWorker(dst, segment, 2, 0) as loader:
            storer.submit_store(1, ns(block_ids=np.array([5, 6, 1], dtype=np.int32),
                                      group_sizes=[0, 3], block_indices=[0, 1]),
                                ns(block_ids=ids))
            storer.wait({1})
            loader.submit_load(2, ns(block_ids=ids),
                               ns(block_ids=np.array([0, 2, 4], dtype=np.int32),
                                  group_sizes=[0, 3], block_indices=[0, 1]))
            loader.wait({2})
            assert [r.transfer_size for r in storer.get_finished()] == [3 * 4000]
            assert [r.transfer_size for r in loader.get_finished()] == [3 * 4000]
        for a, b in zip([5, 6, 1], [0, 2, 4]):
            assert torch.equal(out[1][b, :4000], src[1][a, :4000])
            assert not out[1][b, 4000:].any()
        assert not out[0].any()


def test_cpu_views_follow_vllm_worker_view_layout(engine_id):
    pages = [4096, 1024]
    geometry = geometry_for(pages, 3, 2, 4)
    refs = [[CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 1024)]]
    with opened(engine_id, geometry, rank=1) as segment:
        caches = zero_caches(pages, 4, refs)
        with BlockCopyWorker(caches, segment, 3, 1) as worker:
            assert worker.tensor_offsets == [0, 3 * 4096]
            slot = geometry.page_size_per_worker
            for view, page, off in zip(worker.cpu_views, pages, worker.tensor_offsets):
                assert view.shape == (4, page * 3)
                assert view.stride() == (geometry.row_stride, 1)
                assert view.storage_offset() == slot + off
                assert view.data_ptr() == worker.cpu_views[0].data_ptr() + off
        with pytest.raises(ValueError, match="page_size_per_worker"):
            BlockCopyWorker(zero_caches([8192, 1024], 4, refs), segment, 3, 1)
        with pytest.raises(ValueError, match="world_size"):
            BlockCopyWorker(caches, segment, 3, 2)


def test_expedited_load_not_behind_regular_load(engine_id):
    pages = [4096]
    refs = [[CanonicalKVCacheRef(0, 4096)]]
    geometry = geometry_for(pages, 1, 1, 8)
    with opened(engine_id, geometry) as segment:
        src = random_caches(pages, 8, refs, seed=5)
        dst = zero_caches(pages, 8, refs)
        with BlockCopyWorker(src, segment, 1, 0) as storer:
            storer.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0, 1]))
            storer.wait({1})
        worker = BlockCopyWorker(dst, segment, 1, 0)
        release = threading.Event()
        entered = threading.Event()
        regular = worker._load_queue
        run_regular = regular._execute

        def blocked(job):  # the regular load queue is stuck on a long copy
            entered.set()
            release.wait(10)
            run_regular(job)

        regular._execute = blocked
        try:
            worker.submit_load(10, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1], [0]))
            worker.submit_load(11, CPULoadStoreSpec([1]), GPULoadStoreSpec([4], [1], [0]))
            assert entered.wait(10)
            worker.submit_load(12, CPULoadStoreSpec([1]), GPULoadStoreSpec([5], [1], [0]),
                               expedited=True)
            worker.wait({12})
            done = worker.get_finished()
            assert [r.job_id for r in done] == [12]
            assert torch.equal(dst.tensors[0][5], src.tensors[0].tensor[1])
            assert not dst.tensors[0][3].any()  # the regular load has not run
            release.set()
            worker.wait({10, 11, 999})  # unknown ids are ignored
            assert [r.job_id for r in worker.get_finished()] == [10, 11]
            assert torch.equal(dst.tensors[0][3], src.tensors[0].tensor[0])
            assert worker.get_finished() == []
        finally:
            release.set()
            worker.shutdown()


def test_get_finished_reports_only_completed_jobs(engine_id):
    pages = [4096]
    refs = [[CanonicalKVCacheRef(0, 4096)]]
    geometry = geometry_for(pages, 1, 1, 4)
    with opened(engine_id, geometry) as segment:
        worker = BlockCopyWorker(random_caches(pages, 4, refs, 1), segment, 1, 0)
        gate = threading.Event()
        store_queue = worker._store_queue
        run = store_queue._execute
        store_queue._execute = lambda job: (gate.wait(10), run(job))
        try:
            worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
            worker.submit_store(2, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([1]))
            assert worker.get_finished() == []
            gate.set()
            worker.wait({2})
            assert [r.job_id for r in worker.get_finished()] == [1, 2]
        finally:
            gate.set()
            worker.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            worker.submit_store(3, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_descriptors_match_layout_model(data):
    """Random tensors, refs, groups, offsets and ranks against the independent model."""
    bpc = data.draw(st.integers(1, 5), label="bpc")
    pages = data.draw(st.lists(st.sampled_from([512, 1000, 1536, 4096]), min_size=1,
                               max_size=3), label="pages")
    refs = [
        [CanonicalKVCacheRef(t, data.draw(st.integers(1, pages[t])))
         for t in data.draw(st.lists(st.integers(0, len(pages) - 1), max_size=3))]
        for _ in range(data.draw(st.integers(1, 3), label="groups"))
    ]
    sizes = [data.draw(st.integers(0, 7)) for _ in refs]
    indices = [data.draw(st.integers(0, 20)) for _ in refs]
    rows = sum(-(-(n + i % bpc) // bpc) for n, i in zip(sizes, indices) if n)
    world_size = data.draw(st.integers(1, 2), label="world_size")
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    num_chunks = rows + data.draw(st.integers(1, 3))
    chunk_ids = data.draw(st.permutations(range(num_chunks)))[:rows]
    pointers = data.draw(st.booleans(), label="pointers")
    geometry = geometry_for(pages, bpc, world_size, num_chunks)
    with opened(f"test-cw-{uuid.uuid4().hex[:12]}", geometry, rank=rank) as segment:
        check_store_and_round_trip(segment, pages, refs, bpc, rank, sizes, indices, chunk_ids,
                                   num_blocks=sum(sizes) + 3, seed=rows, pointers=pointers)


def test_failed_copy_is_reported_not_raised(engine_id):
    pages = [4096]
    refs = [[CanonicalKVCacheRef(0, 4096)]]
    geometry = geometry_for(pages, 1, 1, 4)
    with opened(engine_id, geometry) as segment:
        with BlockCopyWorker(zero_caches(pages, 4, refs), segment, 1, 0) as worker:
            def boom(job):
                raise RuntimeError("injected copy failure")

            worker._store_queue._execute = boom
            worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
            worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([1], [1], [0]))
            worker.wait({1, 2})
            results = {r.job_id: r for r in worker.get_finished()}
            assert not results[1].success and results[1].transfer_size == 0
            assert results[2].success and results[2].transfer_size == 4096


@pytest.mark.parametrize(
    "gpu, sizes, indices, chunks, message",
    [
        ([0, 1, 2], [3], [0], [0], "needs 3 GPU block ids and 2 chunk ids"),  # a chunk short
        ([0, 1, 2], [3], [0], [0, 1, 2], "not consumed exactly"),  # one chunk too many
        ([0, 1, 2], [3], [1], [0], "needs 3 GPU block ids and 2 chunk ids"),  # skip spills over
        ([0, 1], [1], [0], [0], "1 GPU block ids and 1 chunk ids"),  # GPU ids left over
        ([0, 1], [1, 1], [0, 0], [0, 1], "2 group sizes .* 1 groups"),
        ([0, 99], [2], [0], [0], "GPU block ids must lie in 0..15"),
        ([0, 1], [2], [0], [6], "chunk ids must lie in 0..5"),
    ],
)
def test_wrong_descriptors_raise_clear_errors(engine_id, gpu, sizes, indices, chunks, message):
    pages = [4096]
    refs = [[CanonicalKVCacheRef(0, 4096)]]
    geometry = geometry_for(pages, 2, 1, 6)
    with opened(engine_id, geometry) as segment:
        with BlockCopyWorker(zero_caches(pages, 16, refs), segment, 2, 0) as worker:
            spec = GPULoadStoreSpec.__new__(GPULoadStoreSpec)  # bypass its own checks
            spec.block_ids, spec.group_sizes, spec.block_indices = (
                np.asarray(gpu, dtype=np.int32), tuple(sizes), tuple(indices))
            with pytest.raises(ValueError, match=message):
                worker.submit_store(1, spec, CPULoadStoreSpec(chunks))
            with pytest.raises(ValueError, match=message):
                worker.submit_load(2, CPULoadStoreSpec(chunks), spec)
            assert worker.get_finished() == []
            with pytest.raises(ValueError, match="GPULoadStoreSpec"):
                worker.submit_store(3, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]))


# ----------------------------------------------------------------------------- device pointers

PTR_PAGES = [4096, 2048]
PTR_ROW = 2560  # tensor 1's block stride: a packed layout, wider than its page
PTR_REFS = [[CanonicalKVCacheRef(0, 4096), CanonicalKVCacheRef(1, 2000)]]


def strided_caches(seed: int | None) -> CanonicalKVCaches:
    """Tensor 0 plain; tensor 1 a (16, 2048) view with a 2560-byte block stride.
    Random bytes (``seed``), or zeros."""
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda *shape: torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)) \
        if seed is not None else (lambda *shape: torch.zeros(shape, dtype=torch.int8))
    return CanonicalKVCaches([make(16, 4096), make(16, PTR_ROW)[:, :2048]], PTR_REFS)


def test_pointers_into_a_strided_tensor_round_trip(engine_id):
    geometry = geometry_for(PTR_PAGES, 2, 1, 6)
    with opened(engine_id, geometry) as segment:
        src, dst = strided_caches(seed=4), strided_caches(seed=None)
        with BlockCopyWorker(src, segment, 2, 0) as storer, \
                BlockCopyWorker(dst, segment, 2, 0) as loader:
            storer.submit_store(1, pointers_for(src, PTR_REFS, [3, 5, 6], [3], [1]),
                                CPULoadStoreSpec([4, 0]))
            storer.wait({1})
            loader.submit_load(2, CPULoadStoreSpec([4, 0]),
                               pointers_for(dst, PTR_REFS, [9, 0, 15], [3], [1]))
            loader.wait({2})
            assert outcomes(storer.get_finished()) == [(1, True, 3 * 6096)]
            assert outcomes(loader.get_finished()) == [(2, True, 3 * 6096)]
        expected = [torch.zeros(16, page, dtype=torch.int8) for page in PTR_PAGES]
        for a, b in zip([3, 5, 6], [9, 0, 15]):
            expected[0][b] = src.tensors[0][a]
            expected[1][b, :2000] = src.tensors[1][a, :2000]
        assert torch.equal(dst.tensors[0], expected[0])
        assert torch.equal(dst.tensors[1], expected[1])  # unpadded bytes only
        assert not dst.tensors[1].as_strided((16, PTR_ROW - 2048), (PTR_ROW, 1), 2048).any(), \
            "bytes between tensor 1's pages were written"


def _mutated(good: Pointers, tensors, case: str) -> Pointers:
    p = dataclasses.replace(good, ptrs=good.ptrs.copy(), sizes=good.sizes.copy())
    base0, base1 = tensors[0].data_ptr(), tensors[1].data_ptr()
    if case == "groups":
        p.group_block_counts, p.group_data_ref_counts, p.block_indices = (3, 0), (2, 0), (1, 0)
    elif case == "refs":
        p.group_data_ref_counts = (1,)
    elif case == "negative-count":
        p.group_block_counts = (-1,)
    elif case == "short":
        p.ptrs = p.ptrs[:-1]
    elif case == "float":
        p.ptrs = p.ptrs.astype(np.float64)
    elif case == "padded-size":
        p.sizes[4] = 2048
    elif case == "past-the-end":
        p.ptrs[0] = base0 + 16 * 4096
    elif case == "below":
        p.ptrs[2] = base0 - 4096
    elif case == "other-tensor":
        p.ptrs[3] = base0 + 3 * 4096  # ref 1's block, pointing into tensor 0
    elif case == "page-not-row":
        p.ptrs[3] = base1 + 2048  # one page on, but tensor 1's blocks are 2560 apart
    return p


@pytest.mark.parametrize("case, message", [
    ("groups", "2 group block counts, 2 data-ref counts and 2 block indices, but the KV "
               "caches have 1 groups"),
    ("refs", "carry 1 data refs per block, but the KV caches' group 0 has 2"),
    ("negative-count", "group_block_counts=-1"),
    ("short", "carry 5 ptrs and 6 sizes, but .* need 6"),
    ("float", "ptrs must be a 1-D integer array"),
    ("padded-size", r"data ref 1 \(kv tensor 1\): copy sizes must equal the ref's unpadded "
                    "page of 2000 bytes, got 2048 for block 1"),
    ("past-the-end", r"data ref 0 \(kv tensor 0\): device pointer 0x[0-9a-f]+ of block 0 "
                     "lies outside the tensor's blocks"),
    ("below", r"kv tensor 0\): device pointer .* of block 2 lies outside"),
    ("other-tensor", r"data ref 1 \(kv tensor 1\): .* of block 0 lies outside"),
    ("page-not-row", "of block 0 is 2048 bytes past a block boundary .*block stride 2560"),
])
def test_wrong_device_pointers_raise_clear_errors(engine_id, case, message):
    geometry = geometry_for(PTR_PAGES, 2, 1, 6)
    with opened(engine_id, geometry) as segment:
        caches = strided_caches(seed=None)
        good = pointers_for(caches, PTR_REFS, [3, 5, 6], [3], [1])
        bad = _mutated(good, caches.tensors, case)
        with BlockCopyWorker(caches, segment, 2, 0) as worker:
            with pytest.raises(ValueError, match=message):
                worker.submit_store(1, bad, CPULoadStoreSpec([0, 1]))
            with pytest.raises(ValueError, match=message):
                worker.submit_load(2, CPULoadStoreSpec([0, 1]), bad, expedited=True)
            # the chunk side is checked by the same planner as for block ids
            with pytest.raises(ValueError, match="needs 3 GPU block ids and 2 chunk ids"):
                worker.submit_store(3, good, CPULoadStoreSpec([0]))
            assert worker.get_finished() == []


@pytest.mark.parametrize("threads", [True, False])
def test_failed_copy_keeps_its_place_and_later_jobs_run(engine_id, threads):
    pages = [4096]
    refs = [[CanonicalKVCacheRef(0, 4096)]]
    geometry = geometry_for(pages, 1, 1, 4)
    with opened(engine_id, geometry) as segment:
        src = random_caches(pages, 4, refs, seed=2)
        with BlockCopyWorker(src, segment, 1, 0, threads=threads) as worker:
            run = worker._store_queue._execute

            def fails_for_job_2(job):
                if job.job_id == 2:
                    raise OSError("injected copy failure")
                run(job)

            worker._store_queue._execute = fails_for_job_2
            for job_id in (1, 2, 3):
                assert worker.submit_store(job_id, pointers_for(src, refs, [job_id], [1], [0]),
                                           CPULoadStoreSpec([job_id])) is True
            worker.wait({1, 2, 3})
            assert outcomes(worker.get_finished()) == [
                (1, True, 4096), (2, False, 0), (3, True, 4096)]
        arena = arena_array(segment)
        for chunk in (1, 3):
            start = chunk * geometry.row_stride
            assert np.array_equal(arena[start:start + 4096],
                                  src.tensors[0].tensor[chunk].numpy().view(np.uint8))
        assert not arena[2 * geometry.row_stride:2 * geometry.row_stride + 4096].any()


def test_cuda_queue_reports_device_errors_as_failed_jobs(monkeypatch):
    """CudaQueue's bookkeeping with stand-ins for torch.cuda's stream and events
    (no GPU here): a launch that raises, an event that raises when polled or waited
    on, or one never recorded, is a failed result in its place; nothing raises."""
    from shmtier.gpu import copy_queues

    class Event:
        def __init__(self, enable_timing=False):
            self.state = "unrecorded"

        def record(self, stream):
            if self.state == "fail-record":
                raise RuntimeError("CUDA error: record")
            self.state = "pending"

        def query(self):
            if self.state == "error":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return self.state == "done"

        def synchronize(self):
            if self.state == "error":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            self.state = "done"

        def elapsed_time(self, end):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Stream",
                        lambda device=None: types.SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(copy_queues, "clear_cuda_error", lambda: None)

    def execute(job):  # job id -> what the device does with it
        if job.job_id == 3:
            raise RuntimeError("CUDA error: invalid argument")  # fails at launch
        if job.job_id == 5:
            job.end_event.state = "fail-record"  # its end event cannot be recorded
        return []

    queue = copy_queues.CudaQueue("store", execute, torch.device("cuda", 0))
    jobs = {}
    for job_id in (1, 2, 3, 4):
        jobs[job_id] = copy_queues.Job(job_id, [], 100)
        queue.submit(jobs[job_id])
    jobs[1].end_event.state = "done"
    jobs[2].end_event.state = "error"  # the copy faulted on the device
    jobs[3].end_event.state = "done"  # its end event was recorded after the failed launch
    assert outcomes(queue.get_finished()) == [(1, True, 100), (2, False, 0), (3, False, 0)]
    assert queue.get_finished() == []  # job 4 still running
    jobs[4].end_event.state = "error"
    queue.wait({4})  # logged, not raised
    assert outcomes(queue.get_finished()) == [(4, False, 0)]
    assert len(queue._events) == 2  # only job 1's events are reused

    queue.submit(copy_queues.Job(5, [], 100))
    assert outcomes(queue.get_finished()) == [(5, False, 0)]  # nothing to wait for


# ----------------------------------------------------------------------------- two ranks

MP_PAGES = [8192, 2048]
MP_REFS = [[CanonicalKVCacheRef(0, 8192), CanonicalKVCacheRef(1, 2000)]]
MP_BPC = 2
MP_SIZES, MP_INDICES = [7], [1]
MP_CHUNKS = [5, 0, 3, 6]
MP_NUM_BLOCKS = 16


def mp_gpu_ids(rank: int) -> list[int]:
    return np.random.default_rng(100 + rank).permutation(MP_NUM_BLOCKS)[:7].tolist()


def _rank_main(engine_id, geometry, rank, barrier, results):
    """Child process = one GPU worker: join, store its blocks, load them back."""
    try:
        segment = open_segment(engine_id, geometry, FP, owner=False, rank=rank, timeout_s=20)
        try:
            src = random_caches(MP_PAGES, MP_NUM_BLOCKS, MP_REFS, seed=rank)
            dst = zero_caches(MP_PAGES, MP_NUM_BLOCKS, MP_REFS)
            ids = mp_gpu_ids(rank)
            with BlockCopyWorker(src, segment, MP_BPC, rank) as storer, \
                    BlockCopyWorker(dst, segment, MP_BPC, rank) as loader:
                barrier.wait(20)  # both ranks write the same rows at the same time
                storer.submit_store(1, GPULoadStoreSpec(ids, MP_SIZES, MP_INDICES),
                                    CPULoadStoreSpec(MP_CHUNKS))
                storer.wait({1})
                barrier.wait(20)  # both slots complete before anyone reads back
                loader.submit_load(2, CPULoadStoreSpec(MP_CHUNKS),
                                   GPULoadStoreSpec(ids, MP_SIZES, MP_INDICES))
                loader.wait({2})
                sizes = [r.transfer_size for r in storer.get_finished() + loader.get_finished()]
            for t, ref in enumerate(MP_REFS[0]):
                n = ref.page_size_bytes
                assert torch.equal(dst.tensors[t][ids, :n], src.tensors[t].tensor[ids, :n]), t
            results.put((rank, "ok", sizes))
        finally:
            segment.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def test_two_ranks_two_processes_share_one_segment(engine_id):
    geometry = geometry_for(MP_PAGES, MP_BPC, 2, 8)
    with opened(engine_id, geometry) as segment:
        barrier, results = CTX.Barrier(2), CTX.Queue()
        procs = [CTX.Process(target=_rank_main, args=(engine_id, geometry, r, barrier, results))
                 for r in range(2)]
        try:
            for p in procs:
                p.start()
            got = {}
            for _ in procs:
                try:
                    rank, status, detail = results.get(timeout=60)
                except queue_mod.Empty:
                    pytest.fail("a rank process did not report within 60 s")
                assert status == "ok", f"rank {rank} failed:\n{detail}"
                got[rank] = detail
            for p in procs:
                p.join(20)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        nbytes = 7 * (8192 + 2000)
        assert got == {0: [nbytes, nbytes], 1: [nbytes, nbytes]}

        # The parent checks both slots byte-exactly, and that nothing else changed.
        arena = arena_array(segment)
        want = np.zeros_like(arena)
        for rank in range(2):
            src = random_caches(MP_PAGES, MP_NUM_BLOCKS, MP_REFS, seed=rank)
            for t, n, block, off in expected_placement(
                    MP_PAGES, MP_REFS, MP_BPC, geometry, rank, mp_gpu_ids(rank),
                    MP_CHUNKS, MP_SIZES, MP_INDICES):
                want[off:off + n] = src.tensors[t].tensor[block, :n].numpy().view(np.uint8)
                lo = rank * geometry.page_size_per_worker
                assert lo <= off % geometry.row_stride < lo + geometry.page_size_per_worker
        assert np.array_equal(arena, want)
