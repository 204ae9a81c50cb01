"""Block copy worker: moves KV blocks between a GPU worker's KV caches and its
slot of the arena rows of the engine's segment (shmtier's ``OffloadingWorker``).

Runs in: every GPU worker process (one per TP/PP rank; vLLM's worker, or a
test/bench process playing one). The spec's ``get_worker`` builds one
:class:`BlockCopyWorker` per process; the connector's worker half then calls
``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait`` from that
process's main thread, once or a few times per step, and ``shutdown`` once.

Shared bytes it touches: only this rank's slot of each arena row,
``[rank * page_size_per_worker, (rank + 1) * page_size_per_worker)`` of row
``c``, and its own KV tensors. Nothing in the control area, rings or header.

Row layout (identical to vLLM 0.33's ``SharedOffloadRegion`` direct layout,
docs/vllm-contract.md §4): inside a rank's slot the canonical tensors are concatenated in
order; tensor ``t`` takes ``page_bytes[t] * blocks_per_chunk`` bytes, and
sub-block ``j`` of chunk ``c`` of tensor ``t`` starts at
``c * row_stride + rank * page_size_per_worker + tensor_offset[t] + j * page_bytes[t]``
in the arena.

Transfer descriptors (docs/vllm-contract.md §5): ``group_sizes`` and ``block_indices`` come
from the GPU-side spec. For group ``g`` of ``size`` GPU blocks whose first block
has logical index ``idx``, the CPU side skips ``idx % blocks_per_chunk``
sub-blocks of its first chunk and consumes ``cdiv(size + skip,
blocks_per_chunk)`` chunk ids; the GPU side consumes ``size`` block ids. Groups
are consumed in order and every id of both specs must be used exactly once
(else ``ValueError`` at submit). For every ref of a group the ref's *unpadded*
page bytes of each block are copied.

vLLM 0.34 passes the GPU side as ``DevicePointers`` instead (one address and
size per block and ref, the same ``block_indices``): they are checked against
the KV tensors and turned back into block ids per ref
(``device_pointers.py``), then planned and copied exactly like a spec's ids,
so every copy reads or writes exactly the given addresses.

Execution:

* CUDA (KV tensors on a CUDA device): the worker's slot ranges are registered
  with ``cudaHostRegister`` (all-or-nothing; on failure the arena stays
  pageable: correct, slower). Each queue (store, load, expedited load) owns a
  CUDA stream that first waits on the submitting thread's current stream, so a
  store sees finished KV and a load follows the zeroing of its destination
  blocks; copies are ``non_blocking``; events give completion and timing.
* CPU tensors (tests, benchmarks, machines without CUDA): each queue owns one
  daemon thread that runs its jobs in submission order, one ``memmove`` per
  run of blocks contiguous on both sides (the GIL is released during each
  copy). Not ``index_select``/``copy_``: see ``_cpu_copy`` for why.

Expedited loads (sync loads the connector waits on before the forward) have
their own queue, so they never wait behind regular loads. Completion is
reported in submission order per queue; a copy that fails is reported as a
failed result, never raised from ``get_finished``/``wait``. The jobs and both
kinds of queue are in ``copy_queues.py``; this module plans the copies and
performs them.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from shmtier.contract import TransferResult
from shmtier.gpu.canonical import block_tensors
from shmtier.gpu.copy_queues import CudaQueue, Job, RefCopy, ThreadQueue, clear_cuda_error
from shmtier.gpu.device_pointers import blocks_from_pointers, is_device_pointers
from shmtier.shared.layout import PAGE_SIZE

logger = logging.getLogger(__name__)

# Host registration: bounded pieces, and per-slot ranges only when that saves
# enough per row to pay for one call per row (vLLM's thresholds).
MAX_HOST_REGISTER_BYTES = 64 << 30
MIN_SLOT_REGISTER_SAVINGS = 3 << 20
# CUDA stores of scattered GPU blocks gather through device staging in pieces
# of at most this many bytes (bounds the extra device memory per job).
MAX_STAGING_BYTES = 64 << 20

_memmove = ctypes.memmove  # a plain C call: releases the GIL


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run_bounds(breaks: np.ndarray, n: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of ``n`` items split after every True in ``breaks``
    (``breaks[k]`` separates item ``k`` from item ``k + 1``)."""
    if n == 0:
        return []
    cuts = (np.flatnonzero(breaks) + 1).tolist()
    return list(zip([0] + cuts, cuts + [n]))


# ----------------------------------------------------------------------------- pinning


def _host_register(ranges: list[tuple[int, int]]) -> list[int]:
    """Register every (address, length) range, or none: returns the registered
    addresses (empty after a failure, which is rolled back and logged)."""
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for address, length in ranges:
        err = int(cudart.cudaHostRegister(address, length, 0))
        if err == 0:
            done.append(address)
            continue
        clear_cuda_error()
        logger.warning(
            "cudaHostRegister failed (error %d) at %#x (+%d bytes); the arena stays "
            "pageable: copies are correct but slower", err, address, length)
        _host_unregister(done)
        return []
    return done


def _host_unregister(addresses: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for address in reversed(addresses):
        err = int(cudart.cudaHostUnregister(address))
        if err:
            clear_cuda_error()
            logger.warning("cudaHostUnregister(%#x) failed (error %d)", address, err)


# ----------------------------------------------------------------------------- worker


class BlockCopyWorker:
    """Copies KV blocks between this rank's KV caches and its slot of the arena.

    Built by the spec's ``get_worker`` in each GPU worker process, after
    ``open_segment(..., owner=False, rank=rank)``. Construction may block
    briefly (host registration of the slot ranges on CUDA); it never waits on
    other processes.

    Args:
        kv_caches: shmtier's or vLLM's ``CanonicalKVCaches`` (see
            :mod:`shmtier.gpu.canonical`). All tensors on one device: CUDA, or
            CPU (tests, benchmarks, CPU-only machines).
        segment: the engine's open :class:`~shmtier.shared.segment.Segment`.
        blocks_per_chunk: GPU blocks per arena chunk (``>= 1``).
        rank: this worker's slot index in each row (``0 <= rank < world_size``).
        threads: CPU tensors only; False runs every copy inline at submit
            (synchronous), True (default) on one thread per queue.
        close_segment: close ``segment`` in :meth:`shutdown` (the worker then
            owns it, like vLLM's worker owns its mmap region).
        pin_memory: CUDA only; register the slot ranges with the driver
            (default True). Ignored for CPU tensors.

    Attributes: ``cpu_views`` (per tensor, the int8 ``(num_chunks,
    page_bytes * blocks_per_chunk)`` zero-copy view of this rank's part of
    every row, row stride ``row_stride``), ``tensor_offsets`` (byte offset of
    each tensor inside the slot), ``page_sizes``, ``is_cuda``,
    ``host_memory_pinned``.
    """

    def __init__(
        self,
        kv_caches: Any,
        segment: Any,
        blocks_per_chunk: int,
        rank: int,
        *,
        threads: bool = True,
        close_segment: bool = False,
        pin_memory: bool = True,
    ):
        geometry = segment.geometry
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk={blocks_per_chunk} (must be >= 1)")
        if not 0 <= rank < geometry.world_size:
            raise ValueError(
                f"rank={rank} outside the segment's world_size={geometry.world_size}")
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.rank = int(rank)
        self.num_chunks = geometry.num_chunks
        self.row_stride = geometry.row_stride
        self.slot_offset = rank * geometry.page_size_per_worker
        self._segment = segment
        self._close_segment = close_segment
        self._closed = False

        blocks = block_tensors(kv_caches)
        if not blocks:
            raise ValueError("kv_caches has no tensors")
        devices = {t.device for t in blocks}
        if len(devices) != 1:
            raise ValueError(f"kv tensors are on several devices: {sorted(map(str, devices))}")
        device = blocks[0].device
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("kv tensors are on CUDA but CUDA is not available")
            self.is_cuda = True
        elif device.type == "cpu":
            self.is_cuda = False
        else:
            raise ValueError(f"kv tensors on unsupported device {device}")
        self.device = device
        self._blocks = blocks
        self.page_sizes = [int(t.shape[1]) for t in blocks]

        # Validate the refs once; keep (tensor_idx, unpadded bytes) pairs.
        self._group_refs: list[list[tuple[int, int]]] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            group = []
            for ref in refs:
                t, nbytes = int(ref.tensor_idx), int(ref.page_size_bytes)
                if not 0 <= t < len(blocks):
                    raise ValueError(
                        f"group {g}: ref tensor_idx={t} but there are {len(blocks)} tensors")
                if not 0 < nbytes <= self.page_sizes[t]:
                    raise ValueError(
                        f"group {g}: ref page_size_bytes={nbytes} must be in "
                        f"1..{self.page_sizes[t]} (tensor {t}'s page)")
                group.append((t, nbytes))
            self._group_refs.append(group)
        # Largest block id + 1 each group may address (its tensors' minimum).
        self._group_num_blocks = [
            min((int(blocks[t].shape[0]) for t, _ in group), default=1 << 62)
            for group in self._group_refs
        ]

        # Carve this rank's slot: tensors concatenated, each bpc pages wide.
        self.tensor_offsets = []
        offset = 0
        for page in self.page_sizes:
            self.tensor_offsets.append(offset)
            offset += page * self.blocks_per_chunk
        if offset > geometry.page_size_per_worker:
            raise ValueError(
                f"the kv tensors need {offset} bytes per chunk "
                f"({self.page_sizes} x blocks_per_chunk={self.blocks_per_chunk}) but a "
                f"rank's slot holds page_size_per_worker={geometry.page_size_per_worker}")

        if self.num_chunks:
            # numpy holds a buffer export, so the segment cannot unmap under us.
            self._arena = torch.from_numpy(
                np.frombuffer(segment.arena_rows(), dtype=np.int8).reshape(-1))
        else:
            self._arena = torch.empty(0, dtype=torch.int8)
        self.cpu_views = [
            torch.as_strided(self._arena, (self.num_chunks, page * self.blocks_per_chunk),
                             (self.row_stride, 1), self.slot_offset + off)
            for page, off in zip(self.page_sizes, self.tensor_offsets)
        ] if self.num_chunks else [
            torch.empty((0, page * self.blocks_per_chunk), dtype=torch.int8)
            for page in self.page_sizes
        ]

        self._registered: list[int] = []
        self.host_memory_pinned = False
        if self.is_cuda:
            if pin_memory and self.num_chunks:
                self._registered = _host_register(self._pin_ranges(geometry))
                self.host_memory_pinned = bool(self._registered)
            make = lambda name, fn: CudaQueue(name, fn, device)  # noqa: E731
            store_fn, load_fn = self._cuda_store, self._cuda_load
        else:
            make = lambda name, fn: ThreadQueue(name, fn, threads)  # noqa: E731
            store_fn, load_fn = self._cpu_store, self._cpu_load
        try:
            self._store_queue = make("store", store_fn)
            self._load_queue = make("load", load_fn)
            self._expedited_queue = make("expedited-load", load_fn)
        except BaseException:
            # Leave nothing half-created: no registration outlives a failed worker.
            if self._registered:
                _host_unregister(self._registered)
            self._registered, self.cpu_views, self._arena = [], [], None
            raise
        self._queues = (self._store_queue, self._load_queue, self._expedited_queue)

    # ------------------------------------------------------------------ public API

    def submit_store(self, job_id: int, src: Any, dst: Any) -> bool:
        """Queue a copy of the GPU blocks ``src`` into the chunks of ``dst``
        (CPULoadStoreSpec). Returns True.

        ``src`` is a GPULoadStoreSpec (vLLM 0.32/0.33: block ids) or a
        DevicePointers (vLLM 0.34: ``resolve_device_pointers``' addresses,
        checked to be whole blocks of this worker's KV tensors). Called by the
        connector's worker half (``start_kv_transfers`` /
        ``handle_preemptions``) in the GPU worker process. Never blocks on the
        copy; raises ``ValueError`` at once if the descriptors are
        inconsistent. A copy that fails later is reported by ``get_finished``
        with ``success=False``.
        """
        self._check_open()
        copies, nbytes = self._plan(src, dst)
        self._store_queue.submit(Job(job_id, copies, nbytes))
        return True

    def submit_load(self, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        """Queue a copy from the chunks of ``src`` (CPULoadStoreSpec) into the
        GPU blocks ``dst`` (GPULoadStoreSpec or DevicePointers, as for
        :meth:`submit_store`). Returns True.

        ``expedited`` (a sync load the caller will ``wait`` on this step) uses
        its own queue, never behind regular loads. Called by the connector's
        worker half in the GPU worker process; never blocks on the copy;
        raises ``ValueError`` at once if the descriptors are inconsistent. A
        copy that fails later is reported by ``get_finished`` with
        ``success=False``.
        """
        self._check_open()
        copies, nbytes = self._plan(dst, src)
        queue = self._expedited_queue if expedited else self._load_queue
        queue.submit(Job(job_id, copies, nbytes))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs completed since the last call: stores, then loads, then
        expedited loads, each in submission order. ``transfer_size`` = bytes
        this worker copied, ``transfer_time`` = seconds the copy ran. A job
        whose copy raised (CPU: in its queue thread; CUDA: at launch, or an
        error its stream's event reports) comes back ``success=False``,
        ``transfer_size=0``; it is never raised here.

        Called by the connector's worker half once per step in the GPU worker
        process. Never blocks.
        """
        results: list[TransferResult] = []
        for queue in self._queues:
            results += queue.get_finished()
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until every listed job has completed (unknown or already
        reported ids are ignored); they are still reported by ``get_finished``.

        Called by the connector's worker half in the GPU worker process before
        a forward that needs sync loads, or when flushing stores of preempted
        requests. Blocks.
        """
        ids = set(job_ids)
        for queue in self._queues:
            queue.wait(ids)

    def shutdown(self) -> None:
        """Finish every submitted copy, stop the queues, unregister pinned
        ranges and drop the arena views (closing the segment when the worker
        owns it). Idempotent.

        Called once by the spec/connector at worker shutdown in the GPU worker
        process. Blocks until outstanding copies are done.
        """
        if self._closed:
            return
        self._closed = True
        failed = False
        for queue in self._queues:
            try:
                queue.shutdown()
            except Exception:  # noqa: BLE001 - keep releasing the rest
                logger.exception("shutting down copy queue %s failed", queue.name)
                failed = True
        if self._registered:
            if failed:
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001
                    logger.warning("device synchronize before unregistering failed",
                                   exc_info=True)
            _host_unregister(self._registered)
            self._registered = []
            self.host_memory_pinned = False
        self.cpu_views = []
        self._arena = None
        if self._close_segment:
            self._segment.close()

    def __enter__(self) -> "BlockCopyWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ planning

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("BlockCopyWorker is shut down")

    def _plan(self, gpu_side: Any, cpu_spec: Any) -> tuple[list[RefCopy], int]:
        """Turn a (GPU side, CPU spec) pair into per-ref copy lists (docs/vllm-contract.md §5).

        ``gpu_side`` is a GPULoadStoreSpec (block ids; vLLM 0.32/0.33) or a
        DevicePointers (addresses; vLLM 0.34), mapped back to block ids by
        :func:`~shmtier.gpu.device_pointers.blocks_from_pointers`; the chunk
        layout below is the same for both. Runs in the submitting thread;
        raises ``ValueError`` naming the problem.
        """
        if is_device_pointers(gpu_side):
            pointed = blocks_from_pointers(gpu_side, self._blocks, self._group_refs)
            group_sizes, block_indices = pointed.group_sizes, pointed.block_indices
            num_gpu = sum(group_sizes)  # consistent by construction
        else:
            try:
                group_sizes = [int(s) for s in gpu_side.group_sizes]
                block_indices = [int(i) for i in gpu_side.block_indices]
                gpu_ids = np.asarray(gpu_side.block_ids, dtype=np.int64).reshape(-1)
            except AttributeError:
                raise ValueError(
                    f"the GPU side of a transfer must be a GPULoadStoreSpec (block_ids, "
                    f"group_sizes, block_indices) or DevicePointers (ptrs, sizes, "
                    f"group_block_counts, group_data_ref_counts, block_indices), got "
                    f"{type(gpu_side).__name__}") from None
            pointed, num_gpu = None, len(gpu_ids)
        cpu_ids = np.asarray(cpu_spec.block_ids, dtype=np.int64).reshape(-1)
        num_groups = len(self._group_refs)
        if len(group_sizes) != num_groups or len(block_indices) != num_groups:
            raise ValueError(
                f"transfer has {len(group_sizes)} group sizes and {len(block_indices)} "
                f"block indices, but the KV caches have {num_groups} groups")
        if len(cpu_ids) and (cpu_ids.min() < 0 or cpu_ids.max() >= self.num_chunks):
            raise ValueError(
                f"chunk ids must lie in 0..{self.num_chunks - 1}, "
                f"got min {cpu_ids.min()} max {cpu_ids.max()}")

        bpc = self.blocks_per_chunk
        copies: list[RefCopy] = []
        nbytes = 0
        gpos = cpos = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
            if size == 0:
                continue
            if size < 0 or first < 0:
                raise ValueError(f"group {g}: size={size}, block_index={first} (need >= 0)")
            skip = first % bpc
            rows = _cdiv(size + skip, bpc)
            if gpos + size > num_gpu or cpos + rows > len(cpu_ids):
                raise ValueError(
                    f"group {g} needs {size} GPU block ids and {rows} chunk ids "
                    f"(skip {skip} of {bpc} blocks per chunk) after {gpos} and {cpos} "
                    f"consumed, but the transfer has {num_gpu} GPU block ids and "
                    f"{len(cpu_ids)} chunk ids")
            if pointed is not None:
                ref_gpu = pointed.ref_blocks[g]  # each ref's own tensor, bounds-checked
            else:
                group_gpu = gpu_ids[gpos:gpos + size]
                limit = self._group_num_blocks[g]
                if group_gpu.min() < 0 or group_gpu.max() >= limit:
                    raise ValueError(
                        f"group {g}: GPU block ids must lie in 0..{limit - 1}, got "
                        f"min {group_gpu.min()} max {group_gpu.max()}")
                ref_gpu = [group_gpu] * len(self._group_refs[g])
            chunks = cpu_ids[cpos:cpos + rows]
            sub = np.arange(skip, skip + size, dtype=np.int64)
            base = chunks[sub // bpc] * self.row_stride + self.slot_offset
            within = sub % bpc
            for (t, unpadded), ids in zip(self._group_refs[g], ref_gpu):
                offsets = base + (self.tensor_offsets[t] + within * self.page_sizes[t])
                copies.append(RefCopy(t, unpadded, ids, offsets))
                nbytes += size * unpadded
            gpos += size
            cpos += rows
        if gpos != num_gpu or cpos != len(cpu_ids):
            raise ValueError(
                f"transfer ids not consumed exactly: groups {group_sizes} with block "
                f"indices {block_indices} use {gpos} GPU block ids and {cpos} chunk ids "
                f"({bpc} blocks per chunk), but the specs carry {num_gpu} GPU block "
                f"ids and {len(cpu_ids)} chunk ids")
        return copies, nbytes

    def _slab(self, offset: int, n: int, nbytes: int, page: int) -> torch.Tensor:
        """``n`` sub-blocks of ``nbytes`` bytes, ``page`` apart, at arena ``offset``."""
        return torch.as_strided(self._arena, (n, nbytes), (page, 1), offset)

    # ------------------------------------------------------------------ CPU copies

    def _cpu_store(self, job: Job) -> None:
        """Gather KV blocks into arena sub-blocks (queue thread)."""
        self._cpu_copy(job, to_arena=True)

    def _cpu_load(self, job: Job) -> None:
        """Scatter arena sub-blocks into KV blocks (queue thread)."""
        self._cpu_copy(job, to_arena=False)

    def _cpu_copy(self, job: Job, to_arena: bool) -> None:
        """One ``memmove`` per run of blocks contiguous on both sides (a padded
        page: one per block), addresses computed vectorised.

        Plain memmove rather than torch ops: it releases the GIL, needs no
        per-run tensor views (~1 us per call instead of several), and does not
        use torch's intra-op thread pool, whose OpenMP teams collapse under
        oversubscription (``index_select`` measured 0.1-0.7 GB/s with 2 torch
        threads on a busy 2-core box, 3-4 GB/s with memmove). Every id was
        bounds-checked when the job was planned.
        """
        arena_base = self._arena.data_ptr()
        for rc in job.copies:
            tensor = self._blocks[rc.tensor_idx]
            page, row = self.page_sizes[rc.tensor_idx], tensor.stride(0)
            gpu = tensor.data_ptr() + rc.gpu_blocks * row
            cpu = arena_base + rc.cpu_offsets
            if rc.nbytes == page == row and len(gpu) > 1:
                breaks = (np.diff(cpu) != page) | (np.diff(gpu) != page)
                starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
                sizes = (np.diff(np.append(starts, len(gpu))) * page).tolist()
                gpu, cpu = gpu[starts], cpu[starts]
            else:
                sizes = [rc.nbytes] * len(gpu)
            dst, src = (cpu, gpu) if to_arena else (gpu, cpu)
            for d, s, n in zip(dst.tolist(), src.tolist(), sizes):
                _memmove(d, s, n)

    # ------------------------------------------------------------------ CUDA copies

    def _cuda_runs(self, rc: RefCopy) -> list[tuple[int, int]]:
        """Runs of blocks contiguous on both sides, so one cudaMemcpyAsync each
        (a padded page is never contiguous across blocks)."""
        page = self.page_sizes[rc.tensor_idx]
        n = len(rc.gpu_blocks)
        if rc.nbytes != page or self._blocks[rc.tensor_idx].stride(0) != page:
            return [(k, k + 1) for k in range(n)]
        breaks = (np.diff(rc.cpu_offsets) != page) | (np.diff(rc.gpu_blocks) != 1)
        return _run_bounds(breaks, n)

    def _cuda_store(self, job: Job) -> list[Any]:
        """Issue GPU -> pinned arena copies on the current (queue) stream."""
        keep: list[Any] = []
        for rc in job.copies:
            gpu = self._blocks[rc.tensor_idx]
            page = self.page_sizes[rc.tensor_idx]
            offsets, ids = rc.cpu_offsets, rc.gpu_blocks
            runs = self._cuda_runs(rc)
            if (len(runs) > 1 and rc.nbytes == page
                    and len(runs) * 2 > len(ids)):
                # Scattered GPU blocks: gather on device per contiguous arena
                # run, then one D2H copy per run.
                max_n = max(1, MAX_STAGING_BYTES // page)
                cpu_runs = _run_bounds(np.diff(offsets) != page, len(ids))
                for a0, b0 in cpu_runs:
                    for a in range(a0, b0, max_n):
                        b = min(b0, a + max_n)
                        index = torch.from_numpy(ids[a:b])
                        if gpu.is_cuda:  # pinned + non_blocking: never syncs a stream
                            index = index.pin_memory().to(gpu.device, non_blocking=True)
                        staged = torch.index_select(gpu, 0, index)
                        self._slab(int(offsets[a]), b - a, page, page).copy_(
                            staged, non_blocking=True)
                        keep += (index, staged)
                continue
            for a, b in runs:
                first = int(ids[a])
                self._slab(int(offsets[a]), b - a, rc.nbytes, page).copy_(
                    gpu[first:first + b - a, :rc.nbytes], non_blocking=True)
        return keep

    def _cuda_load(self, job: Job) -> list[Any]:
        """Issue pinned arena -> GPU copies on the current (queue) stream."""
        for rc in job.copies:
            gpu = self._blocks[rc.tensor_idx]
            page = self.page_sizes[rc.tensor_idx]
            offsets, ids = rc.cpu_offsets, rc.gpu_blocks
            for a, b in self._cuda_runs(rc):
                first = int(ids[a])
                gpu[first:first + b - a, :rc.nbytes].copy_(
                    self._slab(int(offsets[a]), b - a, rc.nbytes, page), non_blocking=True)
        return []

    def _pin_ranges(self, geometry: Any) -> list[tuple[int, int]]:
        """Address ranges to register: this rank's page-rounded slot of every
        row when that saves enough per row, else the whole arena in pieces."""
        base = self._arena.data_ptr()
        stride, slot = geometry.row_stride, geometry.page_size_per_worker
        if stride - slot >= max(PAGE_SIZE, MIN_SLOT_REGISTER_SAVINGS):
            ranges = []
            for row in range(self.num_chunks):
                start = base + row * stride + self.slot_offset
                aligned = start - start % PAGE_SIZE
                end = -(-(start + slot) // PAGE_SIZE) * PAGE_SIZE
                ranges.append((aligned, end - aligned))
            return ranges
        total = self.num_chunks * stride
        piece = max(1, MAX_HOST_REGISTER_BYTES // stride) * stride
        return [(base + off, min(piece, total - off)) for off in range(0, total, piece)]
