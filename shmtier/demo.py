"""``shmtier demo``: offload and reload chunks through the CPU primary tier.

What runs where (the same split as under vLLM)::

    this process (scheduler)            2 spawned processes (GPU workers, rank 0/1)
    CPUPrimaryTierOffloadingManager     BlockCopyWorker over a CPU "GPU" KV cache
      prepare_store / prepare_load ──jobs──▶ copy blocks ⇄ own slot of arena rows
      complete_store / complete_load ◀─results── (sizes, seconds, byte check)
                 └──────────── one shared-memory segment ────────────┘

Turn 1 offloads every chunk of every request (evicting when the tier is
full); turn 2 looks the prefixes up again, loads the hits into other GPU blocks
and checks them byte for byte against the blocks they were stored from. Each request
is played through the connector driver (shmtier/connector_driver.py), which times each
manager call.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import uuid
from statistics import median

from shmtier.config import KVLayout, PrimaryTierConfig
from shmtier.connector_driver import LOCK_WAIT, ConnectorDriver, Meter
from shmtier.contract import CPULoadStoreSpec, GPULoadStoreSpec
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.shared.segment import open_segment

WORLD_SIZE = 2
GPU_BLOCKS = 512
PAGE_BYTES = 16 << 10  # one GPU block of one rank
TOKENS_PER_BLOCK = 16


def _gpu_worker(engine_id: str, rank: int, geometry, fingerprint: str, blocks_per_chunk: int,
                jobs, results) -> None:
    """GPU worker process: serve copy jobs until told to stop."""
    import torch

    from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches
    from shmtier.gpu.copy_worker import BlockCopyWorker

    generator = torch.Generator().manual_seed(rank)
    cache = torch.randint(-128, 128, (GPU_BLOCKS, PAGE_BYTES), dtype=torch.int8, generator=generator)
    original = cache.clone()
    kv = CanonicalKVCaches(tensors=[cache], group_data_refs=[[CanonicalKVCacheRef(0, PAGE_BYTES)]])
    segment = open_segment(engine_id, geometry, fingerprint, owner=False, rank=rank)
    worker = BlockCopyWorker(kv, segment, blocks_per_chunk, rank, close_segment=True)
    try:
        while True:
            job = jobs.get()
            if job[0] == "stop":
                break
            kind, job_id, gpu_ids, chunk_ids, source_ids = job
            gpu = GPULoadStoreSpec(gpu_ids, [len(gpu_ids)], [0])
            cpu = CPULoadStoreSpec(chunk_ids)
            if kind == "store":
                worker.submit_store(job_id, gpu, cpu)
            else:
                cache[gpu_ids] = 0
                worker.submit_load(job_id, cpu, gpu)
            worker.wait({job_id})
            (result,) = [r for r in worker.get_finished() if r.job_id == job_id]
            exact = True
            if kind == "load":
                exact = bool(torch.equal(cache[gpu_ids], original[source_ids]))
            results.put((rank, job_id, result.transfer_size, result.transfer_time, exact))
    finally:
        worker.shutdown()


def _chunk_keys(request: int, num_chunks: int) -> list[bytes]:
    """Chained prefix hashes, one key per chunk (group 0), like vLLM's block hashes."""
    keys, parent = [], b"demo"
    for i in range(num_chunks):
        parent = hashlib.sha256(parent + f"{request}:{i}".encode()).digest()
        keys.append(parent + (0).to_bytes(4, "big"))
    return keys


class _Timer(Meter):
    """µs per manager call, by kind (a lookup scan: its time over its lookups, once per
    lookup)."""

    def __init__(self):
        self.samples: dict[str, list[float]] = {}

    def end(self, token, kind, calls, keys, wall_ns, cpu_ns):
        if kind != LOCK_WAIT and calls:
            self.samples.setdefault(kind, []).extend([wall_ns / calls / 1e3] * calls)


def run_demo(requests: int = 12, chunks_per_request: int = 8, cpu_mib: int = 8,
             blocks_per_chunk: int = 4, policy: str = "lru") -> int:
    layout = KVLayout(model="demo-model", dtype="bfloat16", gpu_block_size=TOKENS_PER_BLOCK,
                      worker_kv_bytes_per_block=PAGE_BYTES, world_size=WORLD_SIZE)
    config = PrimaryTierConfig.from_extra_config(
        {"cpu_bytes_to_use": cpu_mib << 20, "blocks_per_chunk": blocks_per_chunk,
         "eviction_policy": policy}, layout)
    geometry, fingerprint = config.geometry(layout), config.fingerprint(layout)
    engine_id = f"demo-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(WORLD_SIZE)]
    results = ctx.Queue()
    segment = open_segment(engine_id, geometry, fingerprint, owner=True)
    manager = CPUPrimaryTierOffloadingManager(segment, policy, enable_events=True)
    workers = [ctx.Process(target=_gpu_worker, name=f"gpu-worker-{rank}", daemon=True,
                           args=(engine_id, rank, geometry, fingerprint, blocks_per_chunk,
                                 queues[rank], results))
               for rank in range(WORLD_SIZE)]
    for w in workers:
        w.start()
    timer = _Timer()
    moved = {"store": [0, 0.0], "load": [0, 0.0]}
    exact_loads = []
    next_job = iter(range(1, 1 << 30))
    gpu_chunks = GPU_BLOCKS // blocks_per_chunk

    def gpu_blocks(slot: int) -> list[int]:
        return list(range(slot * blocks_per_chunk, (slot + 1) * blocks_per_chunk))

    def run_job(kind: str, gpu_ids: list[int], chunk_ids: list[int], source_ids: list[int]):
        job_id = next(next_job)
        for q in queues:
            q.put((kind, job_id, gpu_ids, chunk_ids, source_ids))
        for _ in range(WORLD_SIZE):
            _, _, size, seconds, exact = results.get(timeout=60)
            moved[kind][0] += size or 0
            moved[kind][1] += seconds or 0.0
            if kind == "load":
                exact_loads.append(exact)

    print(f"shmtier demo: engine {engine_id}, segment {segment.name}")
    print(f"  {geometry.num_chunks} chunk rows x {geometry.row_stride >> 10} KiB "
          f"({WORLD_SIZE} GPU ranks x {geometry.page_size_per_worker >> 10} KiB slot), "
          f"{blocks_per_chunk} blocks/chunk, policy {policy}")
    print(f"  {requests} requests x {chunks_per_request} chunks = "
          f"{requests * chunks_per_request} chunks offered "
          f"({requests * chunks_per_request / max(geometry.num_chunks, 1):.1f}x the CPU tier)")
    driver = ConnectorDriver(manager, meter=timer,
                             tokens_per_chunk=TOKENS_PER_BLOCK * blocks_per_chunk)
    try:
        offered = stored = refused = 0
        for r in range(requests):  # turn 1: compute and offload every prefix
            keys = _chunk_keys(r, chunks_per_request)

            def store(out):
                slots = [(r * chunks_per_request + keys.index(k)) % gpu_chunks for k in out.keys_to_store]
                gpu_ids = [b for s in slots for b in gpu_blocks(s)]
                run_job("store", gpu_ids, out.store_spec.chunk_ids.tolist(), gpu_ids)

            out = driver.play(f"turn1-{r}", keys, known=0, copy_store=store).store
            offered += len(keys)
            if out is None:
                refused += len(keys)
            else:
                stored += len(out.keys_to_store)
        hits = misses = 0
        for r in range(requests):  # turn 2: the same prefixes come back
            keys = _chunk_keys(r, chunks_per_request)

            def load(spec, hit_keys):
                sources = [b for i in range(len(hit_keys))
                           for b in gpu_blocks((r * chunks_per_request + i) % gpu_chunks)]
                scratch = [b for i in range(len(hit_keys)) for b in gpu_blocks(gpu_chunks - 1 - i)]
                run_job("load", scratch, spec.chunk_ids.tolist(), sources)

            hit_keys = driver.play(f"turn2-{r}", keys, offer=(), copy_load=load).hits
            hits += len(hit_keys)
            misses += len(keys) - len(hit_keys)
        after = driver.engine_hooks()
        evicted = sum(len(e.keys) for e in after.events if e.removed)
        stats = after.stats.data["data"]
    finally:
        for q in queues:
            q.put(("stop",))
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
                w.join()
        manager.shutdown()

    def rate(kind):
        nbytes, seconds = moved[kind]
        return f"{nbytes / 2**20:.1f} MiB at {nbytes / seconds / 1e9:.2f} GB/s" if seconds else "none"

    ok = all(exact_loads) and all(w.exitcode == 0 for w in workers)
    print("\nturn 1 (offload)")
    print(f"  stored {stored} chunks, refused {refused}, evicted {evicted}; copied {rate('store')}")
    print("turn 2 (reload)")
    print(f"  prefix hits {hits}, misses {misses} (hit rate {hits / max(hits + misses, 1):.0%}); "
          f"copied {rate('load')}")
    print(f"  loaded bytes identical to the offloaded GPU blocks: {'yes' if all(exact_loads) else 'NO'}"
          f" ({len(exact_loads)} rank-jobs checked)")
    print(f"  CPU tier usage now {stats['vllm:kv_offload_cpu_cache_usage_perc'][()]:.0%} pinned")
    print("scheduler cost per manager call (µs, median / max)")
    for name, samples in timer.samples.items():
        print(f"  {name:<20} {median(samples):8.1f} / {max(samples):8.1f}   ({len(samples)} calls)")
    leftover = [e for e in os.listdir("/dev/shm") if segment.name.lstrip("/") in e]
    print(f"segment removed on shutdown: {'yes' if not leftover else 'NO'}")
    return 0 if ok and not leftover else 1
