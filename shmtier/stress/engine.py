"""One scheduler process's part of the stress run: its engine (spec, manager, GPU rank,
fs tier, job ledger) and the loop that plays requests through it.

Who calls: ``run_stress`` (the run's process) and, for a run with a warm restart, the
child that plays the trace until it is killed (``shmtier/stress/restart.py``); both on
their one scheduler thread. ``play`` blocks only on its own GPU copies (``worker.wait``);
every manager call is timed (``invariants.CallTimer``).

Each request follows the connector's order (docs/vllm-contract.md §2.3): look the prefix
up (HIT_PENDING / RETRY defer it to a later step), load the hits and compare each byte
with what was offloaded, store the new chunks, finish, ``on_schedule_end``. Every
``check_every`` steps the rows invariant is checked against the job ledger.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from shmtier.config import KVLayout
from shmtier.contract import GPULoadStoreSpec, LookupResult, ReqContext
from shmtier.stress import trace
from shmtier.stress.checks import END
from shmtier.stress.invariants import CallTimer, Clock, JobLedger, check_rows
from shmtier.stress.verdict import StressResult
from shmtier.tiers.fs import scheduler as fs_tier

HIT, MISS = LookupResult.HIT, LookupResult.MISS
LAYOUT = KVLayout("stress-model", "bfloat16", 16, trace.PAGE, 1)

_COUNTED = ("vllm:kv_offload_tiering_write_bytes", "vllm:kv_offload_tiering_read_bytes",
            "vllm:kv_offload_tiering_cascade_job_failures", fs_tier.EVICTED_CHUNKS,
            fs_tier.STORED_RATIO, fs_tier.CORRUPT_CHUNKS, fs_tier.WORKER_RESTARTS)


@dataclass
class Totals:
    deferred_steps: int = 0
    lookups_hit_cpu: int = 0
    lookups_promoted: int = 0
    chunks_computed: int = 0
    chunks_loaded: int = 0
    store_refused: int = 0
    wrong_bytes: int = 0  # loaded bytes that differ from what was offloaded
    counters: dict = field(default_factory=dict)  # totals of _COUNTED over the run

    def add(self, other: dict) -> None:
        """Add another process's totals (``asdict`` form)."""
        for k, v in other.items():
            if k == "counters":
                for name, n in v.items():
                    self.counters[name] = self.counters.get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return asdict(self)


class Engine:
    """The spec and what one scheduler process drives of it (module docstring)."""

    def __init__(self, extra: dict, engine_id: str, gpu_blocks: int, result: StressResult,
                 clock: Clock):
        import torch

        from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches
        from shmtier.spec import TieringOffloadingSpec

        self.spec = TieringOffloadingSpec(extra, LAYOUT, engine_id)
        self.engine_id = engine_id
        self.manager = self.spec.get_manager()
        self.worker = None
        try:
            self.gpu = torch.zeros((gpu_blocks, trace.PAGE), dtype=torch.int8)
            self.worker = self.spec.get_worker(
                CanonicalKVCaches([self.gpu], [[CanonicalKVCacheRef(0, trace.PAGE)]]), 0)
            self.fs = next(t for t in self.manager.tiers if isinstance(t, fs_tier.FsTierManager))
            self.ledger = JobLedger(self.fs, self.spec.worker_pool, result, clock)
        except BaseException:
            self.close()
            raise
        self.jobs = iter(range(1, 1 << 30))

    @property
    def pool(self):
        return self.spec.worker_pool

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        self.manager.shutdown()

    def copy(self, kind: str, cpu_spec, blocks: list[int]) -> None:
        job_id = next(self.jobs)
        gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
        if kind == "store":
            self.worker.submit_store(job_id, gpu, cpu_spec)
        else:
            self.worker.submit_load(job_id, cpu_spec, gpu)
        self.worker.wait({job_id})
        for done in self.worker.get_finished():
            if not done.success:
                raise RuntimeError(f"copy job {done.job_id} failed")

    def stats_into(self, totals: Totals, timer: CallTimer):
        stats = timer(self.manager.get_stats)
        data = stats.data["data"]
        for name in _COUNTED:
            for value in data.get(name, {}).values():
                totals.counters[name] = totals.counters.get(name, 0) + value
        return stats


def play(engine: Engine, convs: list, queue: list[int], first: int, last: int, *,
         chunks_per_turn: int, runner, totals: Totals, timer: CallTimer, clock: Clock,
         result: StressResult, check_every: int, settle_each: bool = False,
         expected=trace.content) -> None:
    """Play requests ``first`` to ``last`` of ``queue`` (module docstring). ``expected``:
    key -> the bytes a load of it must give (a test may pass a wrong one)."""
    import torch

    from shmtier.stress.checks import settle

    manager, gpu = engine.manager, engine.gpu
    max_chunks = gpu.shape[0] // 2
    next_check = clock.step + check_every
    for n in range(first, last):
        clock.request = n
        runner.tick(n)
        conv = convs[queue[n]]
        keys = trace.chunk_keys(conv.cid, conv.chunks + chunks_per_turn)
        ctx = ReqContext(f"req{n}")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, (i + 1) * 16)
        with manager.lock:
            timer(manager.on_new_request, ctx)
        while True:  # lookup pass, repeated each step while deferred
            hits, deferred = 0, False
            with manager.lock:
                for k in keys[: conv.chunks]:
                    answer = timer(manager.lookup, k, ctx)
                    if answer is HIT:
                        hits += 1 if not deferred else 0
                        continue
                    if answer is MISS:
                        break
                    deferred = True
                if deferred:
                    timer(manager.on_schedule_end, END)
            if not deferred:
                break
            totals.deferred_steps += 1
            timer.close_step()
            time.sleep(0.001)
            runner.tick(n)
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
            engine.copy("load", load, blocks)
            for b, k in zip(blocks, hit_keys):
                wrong = int(np.count_nonzero(gpu[b].numpy().view(np.uint8) != expected(k)))
                if wrong:
                    totals.wrong_bytes += wrong
                    result.violate(clock.step, n, "no wrong byte served",
                                   f"chunk {k.hex()[:16]}... loaded with {wrong} wrong bytes")
            totals.chunks_loaded += len(hit_keys)
        totals.chunks_computed += len(new)
        if out is not None and out.keys_to_store:
            blocks = list(range(max_chunks, max_chunks + len(out.keys_to_store)))
            for b, k in zip(blocks, out.keys_to_store):
                gpu[b] = torch.from_numpy(trace.content(k).view(np.int8))
            engine.copy("store", out.store_spec, blocks)
        with manager.lock:
            if hit_keys:
                timer(manager.complete_load, hit_keys, ctx)
            if out is not None and out.keys_to_store:
                timer(manager.complete_store, out.keys_to_store, ctx)
            timer(manager.on_request_finished, ctx)
            timer(manager.on_schedule_end, END)
            engine.stats_into(totals, timer)
            timer(manager.take_events)
        timer.close_step()
        if clock.step >= next_check:
            next_check = clock.step + check_every
            check_rows(engine.engine_id, engine.ledger, result, clock, manager.lock)
        conv.chunks += chunks_per_turn
        if settle_each:
            settle(manager)


def arena_mismatches(engine: Engine, expected=trace.content) -> tuple[int, int]:
    """(rows, rows whose bytes differ): every chunk the primary holds, against what its
    key's chunk must hold (a warm restart's adopted rows)."""
    primary = engine.manager.primary
    arena = np.frombuffer(primary.get_kv_memoryview(), dtype=np.uint8).reshape(
        engine.spec.geometry.num_chunks, -1)
    resident = primary.resident_keys()
    bad = sum(1 for k, row in resident.items()
              if not np.array_equal(arena[row, :trace.PAGE], expected(k)))
    return len(resident), bad


def shm_left(engine_id: str) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if engine_id in e]
