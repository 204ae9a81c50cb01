#!/usr/bin/env python
"""Block copy worker vs a plain pinned copy: bandwidth of KV blocks into and out of the arena.

Run from a checkout (issue 27, deliverable 6: the GPU run of the e2e suite adds this)::

    .venv/bin/python -m bench.copy_bandwidth                    # CUDA if available, else CPU
    .venv/bin/python -m bench.copy_bandwidth --device cpu --quick

Method: one engine segment (``open_segment``, a real /dev/shm mapping) whose arena holds
``--chunks`` rows of one rank; a KV cache of ``--tensors`` tensors of ``--page-kib`` KiB
pages on ``--device``, random bytes. Per repeat, in one process and one run:

* ``shmtier store`` / ``shmtier load``: :class:`~shmtier.gpu.BlockCopyWorker` copies every
  block of the cache into the arena rows (``submit_store``), then back (``submit_load``),
  in jobs of ``--job-chunks`` chunks as vLLM submits them, then ``wait``; timed from the
  first submit to the last job's end. On CUDA the arena's slot ranges are registered with
  the driver (pinned) as in a GPU worker.
* ``plain d2h`` / ``plain h2d``: the same bytes as one ``copy_`` between the cache and a
  host tensor allocated pinned (``pin_memory=True``, CUDA) or plain (CPU), then a
  synchronize: what a pinned ``cudaMemcpy`` of contiguous memory reaches here.

Figures: GB/s (10^9 bytes) per direction, median of ``--repeats`` with [min-max]; the
loaded bytes are checked equal to the stored ones on every repeat (a wrong byte fails the
run). The segment is removed at the end, also on failure. On a CPU-only machine the
"device" is CPU memory: the figures then only show the copy paths work, not GPU speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

import numpy as np
import torch

from shmtier.contract import CPULoadStoreSpec, GPULoadStoreSpec
from shmtier.gpu import BlockCopyWorker, CanonicalKVCacheRef, CanonicalKVCaches
from shmtier.gpu import CanonicalKVCacheTensor
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment

FINGERPRINT = "bench-copy-bandwidth"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _caches(device: torch.device, tensors: int, num_blocks: int, page: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    made = [CanonicalKVCacheTensor(
        torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=gen).to(device),
        page) for _ in range(tensors)]
    refs = [[CanonicalKVCacheRef(i, page) for i in range(tensors)]]
    return CanonicalKVCaches(made, refs)


def _jobs(chunks: int, job_chunks: int, bpc: int):
    """(GPU block ids, arena rows) of each job: consecutive chunks, one group."""
    for first in range(0, chunks, job_chunks):
        rows = np.arange(first, min(first + job_chunks, chunks), dtype=np.int64)
        blocks = np.arange(rows[0] * bpc, (rows[-1] + 1) * bpc, dtype=np.int64)
        yield (GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0]),
               CPULoadStoreSpec(rows))


def _copy_all(worker: BlockCopyWorker, jobs, store: bool, first_id: int) -> float:
    ids = set()
    t0 = time.perf_counter()
    for i, (gpu, cpu) in enumerate(jobs):
        if store:
            worker.submit_store(first_id + i, gpu, cpu)
        else:
            worker.submit_load(first_id + i, cpu, gpu)
        ids.add(first_id + i)
    worker.wait(ids)
    seconds = time.perf_counter() - t0
    results = worker.get_finished()
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} copy jobs failed")
    return seconds


def run(device: torch.device, chunks: int, bpc: int, tensors: int, page: int, job_chunks: int,
        repeats: int) -> dict[str, list[float]]:
    num_blocks = chunks * bpc
    row = ArenaGeometry.for_kv(cpu_bytes_to_use=1 << 40, worker_kv_bytes_per_block=tensors * page,
                               blocks_per_chunk=bpc, world_size=1).row_stride
    geometry = ArenaGeometry.for_kv(cpu_bytes_to_use=chunks * row,
                                    worker_kv_bytes_per_block=tensors * page,
                                    blocks_per_chunk=bpc, world_size=1)
    nbytes = num_blocks * page * tensors
    src = _caches(device, tensors, num_blocks, page, seed=1)
    dst = _caches(device, tensors, num_blocks, page, seed=2)
    figures: dict[str, list[float]] = {k: [] for k in (
        "shmtier store", "shmtier load", "plain d2h", "plain h2d")}
    segment = open_segment(f"bench-cw-{uuid.uuid4().hex[:12]}", geometry, FINGERPRINT,
                           owner=True, rank=0)
    try:
        with BlockCopyWorker(src, segment, bpc, 0) as store_w, \
                BlockCopyWorker(dst, segment, bpc, 0) as load_w:
            host = [torch.empty((num_blocks, page), dtype=torch.int8,
                                pin_memory=device.type == "cuda") for _ in range(tensors)]
            job_id = 0
            for _ in range(repeats):
                jobs = list(_jobs(chunks, job_chunks, bpc))
                _sync(device)
                seconds = _copy_all(store_w, jobs, True, job_id)
                figures["shmtier store"].append(_gbps(nbytes, seconds))
                job_id += len(jobs)
                seconds = _copy_all(load_w, jobs, False, job_id)
                figures["shmtier load"].append(_gbps(nbytes, seconds))
                job_id += len(jobs)
                for s, d in zip(src.tensors, dst.tensors):
                    if not torch.equal(s.tensor, d.tensor):
                        raise RuntimeError("the loaded blocks differ from the stored ones")
                    d.tensor.zero_()
                for direction in ("plain d2h", "plain h2d"):
                    _sync(device)
                    t0 = time.perf_counter()
                    for s, h in zip(src.tensors, host):
                        if direction == "plain d2h":
                            h.copy_(s.tensor, non_blocking=True)
                        else:
                            s.tensor.copy_(h, non_blocking=True)
                    _sync(device)
                    figures[direction].append(_gbps(nbytes, time.perf_counter() - t0))
    finally:
        segment.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--chunks", type=int, default=256, help="arena rows (chunks) copied")
    ap.add_argument("--blocks-per-chunk", type=int, default=16)
    ap.add_argument("--tensors", type=int, default=2, help="KV tensors (e.g. layers x K/V)")
    ap.add_argument("--page-kib", type=int, default=64, help="bytes of one block per tensor")
    ap.add_argument("--job-chunks", type=int, default=8, help="chunks per copy job")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32 chunks, 3 repeats")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    if args.quick:
        args.chunks, args.repeats = 32, 3
    device = torch.device(args.device)
    page = args.page_kib << 10
    nbytes = args.chunks * args.blocks_per_chunk * args.tensors * page
    print(f"method: {args.chunks} chunks x {args.blocks_per_chunk} blocks x {args.tensors} "
          f"tensors x {args.page_kib} KiB = {nbytes / 2**20:.0f} MiB each way on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}"
          f", jobs of {args.job_chunks} chunks, {args.repeats} repeats; GB/s, median [min-max]")
    figures = run(device, args.chunks, args.blocks_per_chunk, args.tensors, page,
                  args.job_chunks, args.repeats)
    for name, values in figures.items():
        print(f"  {name:14s} {statistics.median(values):8.2f} GB/s  "
              f"[{min(values):.2f}-{max(values):.2f}]")
    print("  (every repeat's loaded bytes equal the stored ones)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
