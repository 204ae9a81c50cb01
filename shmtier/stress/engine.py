"""One scheduler process's part of the stress run: its engine (spec, manager, GPU rank,
fs tier, job ledger) and the loop that plays requests through it.

Who calls: ``run_stress`` (the run's process) and, for a run with a warm restart, the
child that plays the trace until it is killed (``shmtier/stress/restart.py``); both on
their one scheduler thread. ``play`` blocks only on its own GPU copies (``worker.wait``);
every manager call is timed (``invariants.CallTimer``).

Each request is played alone through the connector driver (``ConnectorDriver.play``,
shmtier/connector_driver.py, in the connector's order): look the prefix up (HIT_PENDING /
RETRY defer it to a later step), load the hits and compare each byte with what was
offloaded, store the new chunks, finish; then the engine's hooks. Every ``check_every``
steps the rows invariant is checked against the job ledger.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from shmtier.config import KVLayout
from shmtier.connector_driver import ConnectorDriver
from shmtier.contract import GPULoadStoreSpec
from shmtier.stress import trace
from shmtier.stress.invariants import CallTimer, Clock, JobLedger, check_rows
from shmtier.stress.verdict import StressResult
from shmtier.tiers.fs import scheduler as fs_tier

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
        self.driver = ConnectorDriver(self.manager)  # its meter: the run's CallTimer (play)
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

    def idle_step(self) -> None:
        """One engine step with no request, its calls timed by no meter: the chaos runner's
        waits (the pool restarts tier workers in the manager's calls)."""
        with self.driver.unmeasured():
            self.driver.settle(0.0, sleep_s=0.0)

    def count(self, totals: Totals, stats) -> None:
        """Add the counters of one ``get_stats`` payload to ``totals``."""
        data = stats.data["data"]
        for name in _COUNTED:
            for value in data.get(name, {}).values():
                totals.counters[name] = totals.counters.get(name, 0) + value


def play(engine: Engine, convs: list, queue: list[int], first: int, last: int, *,
         chunks_per_turn: int, runner, totals: Totals, timer: CallTimer, clock: Clock,
         result: StressResult, check_every: int, settle_each: bool = False,
         expected=trace.content) -> None:
    """Play requests ``first`` to ``last`` of ``queue`` (module docstring), each manager
    call timed by ``timer``. ``expected``: key -> the bytes a load of it must give (a test
    may pass a wrong one)."""
    import torch

    driver, gpu = engine.driver, engine.gpu
    max_chunks = gpu.shape[0] // 2
    next_check = clock.step + check_every
    driver.measure(timer)  # the requests' calls; not the settling (``settle_each``, after)
    try:
        for n in range(first, last):
            clock.request = n
            runner.tick(n)
            conv = convs[queue[n]]
            keys = trace.chunk_keys(conv.cid, conv.chunks + chunks_per_turn)

            def deferred():  # a step in which the request waited for its lookups
                totals.deferred_steps += 1
                timer.close_step()
                time.sleep(0.001)
                runner.tick(n)

            def copy_load(spec, hit_keys):  # the hits into GPU blocks 0..., each byte checked
                blocks = list(range(len(hit_keys)))
                gpu[blocks] = 0
                engine.copy("load", spec, blocks)
                for b, k in zip(blocks, hit_keys):
                    wrong = int(np.count_nonzero(gpu[b].numpy().view(np.uint8) != expected(k)))
                    if wrong:
                        totals.wrong_bytes += wrong
                        result.violate(clock.step, n, "no wrong byte served",
                                       f"chunk {k.hex()[:16]}... loaded with {wrong} wrong bytes")

            def copy_store(out):  # the new chunks' bytes from GPU blocks max_chunks...
                blocks = list(range(max_chunks, max_chunks + len(out.keys_to_store)))
                for b, k in zip(blocks, out.keys_to_store):
                    gpu[b] = torch.from_numpy(trace.content(k).view(np.int8))
                engine.copy("store", out.store_spec, blocks)

            played = driver.play(f"req{n}", keys, known=conv.chunks, copy_load=copy_load,
                                 copy_store=copy_store, on_deferred=deferred)
            hits = len(played.hits)
            from_host = sum(1 for s in played.sources if s.value == "host")
            totals.lookups_hit_cpu += from_host
            totals.lookups_promoted += hits - from_host
            totals.chunks_loaded += hits
            new = len(keys) - hits
            totals.chunks_computed += new
            if played.store is None:
                totals.store_refused += new
            engine.count(totals, driver.engine_hooks().stats)
            timer.close_step()
            if clock.step >= next_check:
                next_check = clock.step + check_every
                check_rows(engine.engine_id, engine.ledger, result, clock, engine.manager.lock)
            conv.chunks += chunks_per_turn
            if settle_each:
                with driver.unmeasured():
                    driver.settle(30.0, sleep_s=0.002)
    finally:
        driver.measure(None)


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
