"""``shmtier run`` (what ``scripts/run`` runs): a short multi-turn stress run.

One process plays the scheduler and a GPU rank (CPU tensors stand in for the
GPU KV cache); the spec spawns the tier worker processes that cascade chunks
to an ``fs`` tier in a temporary directory and promote them back. Each step
follows the connector's order (docs/vllm-contract.md §2.3): look the request's prefix up
(HIT_PENDING / RETRY defer it to a later step), load the hits, store the new
chunks, finish, ``on_schedule_end``. The CPU tier holds a fraction of the
working set, so later turns find their prefix on disk. At the end every
loaded chunk has been compared byte for byte with what was offloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from shmtier.config import KVLayout
from shmtier.contract import GPULoadStoreSpec, LookupResult, ReqContext, ScheduleEndContext
from shmtier.tiers.fs import scheduler as fs_tier
from shmtier.spec import TieringOffloadingSpec

HIT, MISS = LookupResult.HIT, LookupResult.MISS
PAGE = 64 << 10  # bytes of one GPU block (one rank); bf16 KV of a small model


@dataclass
class _Conversation:
    cid: int
    chunks: int = 0
    turns_done: int = 0


@dataclass
class _Totals:
    steps: int = 0
    step_us: list = field(default_factory=list)
    deferred_steps: int = 0
    lookups_hit_cpu: int = 0
    lookups_promoted: int = 0
    chunks_computed: int = 0
    chunks_loaded: int = 0
    store_refused: int = 0
    exact: bool = True
    counters: dict = field(default_factory=dict)  # totals of _COUNTED over the run


def _keys(cid: int, n: int) -> list[bytes]:
    keys, parent = [], f"conv{cid}".encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        keys.append(parent + b"\0\0\0\0")
    return keys


def _content(key: bytes) -> np.ndarray:
    """Deterministic bf16-like KV bytes of one chunk (random normal, top 16 bits)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return (rng.standard_normal(PAGE // 2, dtype=np.float32).view(np.uint32) >> 16).astype(
        np.uint16).view(np.uint8)


def run_stress(conversations: int = 24, turns: int = 4, chunks_per_turn: int = 4,
               cpu_chunks: int = 48, workers: int = 2, seed: int = 0,
               settle_each: bool = False) -> int:
    """``settle_each``: after every request wait until the tiers are idle (each
    cascade written before the next request: deterministic hit counts, for tests)."""
    import torch

    from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches

    rng = np.random.default_rng(seed)
    root = tempfile.mkdtemp(prefix="shmtier-run-")
    layout = KVLayout("stress-model", "bfloat16", 16, PAGE, 1)
    extra = {"cpu_bytes_to_use": cpu_chunks * PAGE, "num_tier_workers": workers,
             "secondary_tiers": [{"type": "fs", "root_dir": root, "min_free_bytes": None}]}
    engine_id = f"run-{uuid.uuid4().hex[:8]}"
    spec = TieringOffloadingSpec(extra, layout, engine_id)
    max_chunks = turns * chunks_per_turn
    gpu = torch.zeros((2 * max_chunks, PAGE), dtype=torch.int8)
    manager = spec.get_manager()
    worker = None
    totals = _Totals()
    end = ScheduleEndContext((), ())
    jobs = iter(range(1, 1 << 30))
    try:
        worker = spec.get_worker(CanonicalKVCaches([gpu], [[CanonicalKVCacheRef(0, PAGE)]]), 0)
        _settle(manager, end)  # tier workers up and the (empty) fs root listed
        started = time.monotonic()
        print(f"shmtier run: engine {engine_id}, CPU tier {cpu_chunks} chunks x {PAGE >> 10} KiB, "
              f"fs tier in {root}, {workers} tier workers")
        convs = [_Conversation(c) for c in range(conversations)]
        queue = [c for _ in range(turns) for c in rng.permutation(conversations).tolist()]
        print(f"  {conversations} conversations x {turns} turns, +{chunks_per_turn} chunks "
              f"per turn: {len(queue)} requests, working set "
              f"{conversations * max_chunks / cpu_chunks:.1f}x the CPU tier")
        for n, cid in enumerate(queue):
            conv = convs[cid]
            keys = _keys(cid, conv.chunks + chunks_per_turn)
            ctx = ReqContext(f"req{n}")
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * 16)
            timer = _StepTimer(totals)
            with manager.lock:
                timer(manager.on_new_request, ctx)
            while True:  # lookup pass, repeated each step while deferred
                hits, deferred = 0, False
                with manager.lock:
                    for k in keys[: conv.chunks]:
                        result = timer(manager.lookup, k, ctx)
                        if result is HIT:
                            hits += 1 if not deferred else 0
                            continue
                        if result is MISS:
                            break
                        deferred = True
                    if deferred:
                        timer(manager.on_schedule_end, end)
                if not deferred:
                    break
                totals.deferred_steps += 1
                timer.close_step()
                time.sleep(0.001)
            hit_keys = keys[:hits]
            with manager.lock:
                if hit_keys:
                    sources = [manager.get_load_source(k, ctx).value for k in hit_keys]
                    totals.lookups_hit_cpu += sources.count("host")
                    totals.lookups_promoted += len(hit_keys) - sources.count("host")
                    load = timer(manager.prepare_load, hit_keys, ctx)
                new = keys[hits:]
                out = timer(manager.prepare_store, keys, ctx)
                if out is None:
                    totals.store_refused += len(new)
            if hit_keys:
                blocks = list(range(len(hit_keys)))
                gpu[blocks] = 0
                _copy(worker, "load", next(jobs), load, blocks)
                for b, k in zip(blocks, hit_keys):
                    totals.exact &= bool(np.array_equal(gpu[b].numpy().view(np.uint8), _content(k)))
                totals.chunks_loaded += len(hit_keys)
            totals.chunks_computed += len(new)
            if out is not None and out.keys_to_store:
                blocks = list(range(max_chunks, max_chunks + len(out.keys_to_store)))
                for b, k in zip(blocks, out.keys_to_store):
                    gpu[b] = torch.from_numpy(_content(k).view(np.int8))
                _copy(worker, "store", next(jobs), out.store_spec, blocks)
            with manager.lock:
                if hit_keys:
                    timer(manager.complete_load, hit_keys, ctx)
                if out is not None and out.keys_to_store:
                    timer(manager.complete_store, out.keys_to_store, ctx)
                timer(manager.on_request_finished, ctx)
                timer(manager.on_schedule_end, end)
                stats = timer(manager.get_stats)
                timer(manager.take_events)
            timer.close_step()
            _accumulate(totals, stats)
            conv.chunks += chunks_per_turn
            if settle_each:
                _settle(manager, end)
        _settle(manager, end)
        with manager.lock:
            _accumulate(totals, manager.get_stats())
        _report(totals, time.monotonic() - started)
    finally:
        if worker is not None:
            worker.shutdown()
        manager.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    left = [e for e in os.listdir("/dev/shm") if engine_id in e]
    print(f"segment and ring semaphores removed on shutdown: {'yes' if not left else left}")
    return 0 if totals.exact and not left else 1


def _settle(manager, end, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with manager.lock:
            manager.on_schedule_end(end)
            if not manager.has_pending_work():
                return
        time.sleep(0.002)


class _StepTimer:
    """Sums the time spent in manager calls for the current step."""

    def __init__(self, totals: _Totals):
        self.totals, self.spent = totals, 0.0

    def __call__(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent += time.perf_counter() - start

    def close_step(self) -> None:
        self.totals.steps += 1
        self.totals.step_us.append(self.spent * 1e6)
        self.spent = 0.0


_COUNTED = ("vllm:kv_offload_tiering_write_bytes", "vllm:kv_offload_tiering_read_bytes",
            fs_tier.STORED_RATIO, fs_tier.CORRUPT_CHUNKS, fs_tier.WORKER_RESTARTS)


def _accumulate(totals: _Totals, stats) -> None:
    data = stats.data["data"]
    sums = totals.counters
    for name in _COUNTED:
        for value in data.get(name, {}).values():
            sums[name] = sums.get(name, 0) + value


def _copy(worker, kind: str, job_id: int, cpu_spec, blocks: list[int]) -> None:
    gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
    if kind == "store":
        worker.submit_store(job_id, gpu, cpu_spec)
    else:
        worker.submit_load(job_id, cpu_spec, gpu)
    worker.wait({job_id})
    for result in worker.get_finished():
        if not result.success:
            raise RuntimeError(f"copy job {result.job_id} failed")


def _report(t: _Totals, elapsed: float) -> None:
    c = t.counters
    lookups = t.chunks_loaded + t.chunks_computed
    written = c.get("vllm:kv_offload_tiering_write_bytes", 0)
    stored = c.get(fs_tier.STORED_RATIO, 0)
    steps = np.array(t.step_us) if t.step_us else np.zeros(1)
    print(f"\nfinished in {elapsed:.1f} s, {t.steps} scheduler steps ({t.deferred_steps} deferred)")
    print("hit rates (chunks of the prompts)")
    print(f"  CPU tier   {t.lookups_hit_cpu:6d}  ({t.lookups_hit_cpu / max(lookups, 1):.0%})")
    print(f"  fs tier    {t.lookups_promoted:6d}  ({t.lookups_promoted / max(lookups, 1):.0%}, promoted)")
    print(f"  computed   {t.chunks_computed:6d}  ({t.chunks_computed / max(lookups, 1):.0%}; "
          f"{t.store_refused} of them not offloaded: no free CPU row)")
    print("bytes moved")
    print(f"  CPU -> fs (cascades)   {written / 2**20:8.1f} MiB logical, {stored / 2**20:.1f} MiB on disk"
          f" (compression {written / stored if stored else 1:.2f}x)")
    print(f"  fs -> CPU (promotions) {c.get('vllm:kv_offload_tiering_read_bytes', 0) / 2**20:8.1f} MiB")
    print(f"  checksum failures {c.get(fs_tier.CORRUPT_CHUNKS, 0)}, worker restarts "
          f"{c.get(fs_tier.WORKER_RESTARTS, 0)}")
    print("scheduler-thread time in manager calls per step (µs)")
    print(f"  p50 {np.percentile(steps, 50):.0f}   p99 {np.percentile(steps, 99):.0f}   "
          f"max {steps.max():.0f}")
    print(f"loaded chunks identical to what was offloaded: {'yes' if t.exact else 'NO'}"
          f" ({t.chunks_loaded} chunks)")
