"""The fs tier's test engine: the scheduler (spec manager) and GPU ranks (copy workers)
in the test process, tier worker processes and real files under a root (shared by
test_tiering_fs.py and test_fs_accounting.py). The manager is called through the
connector driver (shmtier/connector_driver.py), in the connector's order."""

from __future__ import annotations

import time

import pytest
import torch

from shmtier.config import KVLayout
from shmtier.connector_driver import ConnectorDriver, Lookup
from shmtier.contract import GPULoadStoreSpec, LookupResult, ScheduleEndContext
from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches
from shmtier.spec import TieringOffloadingSpec

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)
END = ScheduleEndContext((), ())
GPU_BLOCKS = 96


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


class Engine:
    """Scheduler (spec manager) and ``world_size`` GPU ranks (copy workers) in one process,
    with one storage tier: ``fs`` on ``root`` (``tier`` its other options), or with
    ``tier_type`` another worker-backed tier whose options are ``tier`` (``root`` unused);
    ``top``: more top-level keys of the connector config."""

    def __init__(self, engine_id, root, *, page=8192, world_size=1, bpc=1, chunks=16,
                 workers=None, tier_type="fs", data_parallel_index=0, top=None, **tier):
        self.layout = KVLayout("m", "bfloat16", 16, page, world_size)
        row = -(-page * world_size * bpc // 4096) * 4096
        if tier_type == "fs":
            tier = {"root_dir": str(root), "min_free_bytes": None, **tier}
        extra = {"cpu_bytes_to_use": chunks * row, "blocks_per_chunk": bpc,
                 "secondary_tiers": [{"type": tier_type, **tier}]}
        if workers is not None:
            extra["num_tier_workers"] = workers
        extra.update(top or {})  # other top-level keys of kv_connector_extra_config
        self.spec = TieringOffloadingSpec(extra, self.layout, engine_id,
                                          data_parallel_index=data_parallel_index)
        self.manager = self.spec.get_manager()
        self.driver = ConnectorDriver(self.manager)
        self.bpc = bpc
        self.caches, self.originals, self.workers = [], [], []
        try:
            for rank in range(world_size):
                cache = torch.randint(-128, 128, (GPU_BLOCKS, page), dtype=torch.int8)
                self.caches.append(cache)
                self.originals.append(cache.clone())
                kv = CanonicalKVCaches([cache], [[CanonicalKVCacheRef(0, page)]])
                self.workers.append(self.spec.get_worker(kv, rank))
        except BaseException:
            self.close()
            raise
        self.job = 0

    def copy(self, kind, cpu_spec, gpu_blocks):
        self.job += 1
        gpu = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        for w in self.workers:
            if kind == "store":
                w.submit_store(self.job, gpu, cpu_spec)
            else:
                w.submit_load(self.job, cpu_spec, gpu)
            w.wait({self.job})
            assert all(r.success for r in w.get_finished())

    def offload(self, keys, first_block, ctx):
        """Store ``keys`` (which the manager must not refuse) from GPU blocks
        ``first_block``... (``bpc`` each, in key order)."""

        def copy(out):
            blocks = [first_block + keys.index(k) * self.bpc + j
                      for k in out.keys_to_store for j in range(self.bpc)]
            self.copy("store", out.store_spec, blocks)

        out = self.driver.store(keys, ctx, copy)
        assert out is not None
        return out

    def load(self, keys, ctx, dst):
        """Load ``keys`` (all HIT in the CPU tier for ``ctx``) into GPU blocks ``dst`` and
        finish ``ctx``; rank 0's blocks ``dst`` afterwards."""

        def copy(spec):
            for cache in self.caches:
                cache[dst] = 0
            self.copy("load", spec, dst)

        self.driver.load(keys, ctx, copy, finish=True)
        return self.caches[0][dst]

    def _steps(self, keys, ctx, timeout_s, done=None, before_step=None, sleep_s=0.005):
        """Look ``keys`` up once per step (each key's answer) until ``done`` (default:
        none is PENDING or RETRY) or the timeout; the answers of each step."""
        req = Lookup(keys, ctx)
        self.driver.until([req], timeout_s=timeout_s, sleep_s=sleep_s, before_step=before_step,
                          done=done)
        return req.answers

    def answers_while(self, other, keys, ctx, timeout_s=20.0):
        """This engine's answers for ``keys``, asked once per step until none is PENDING
        or RETRY, while engine ``other`` steps too (its cascades and evictions go on)."""
        answers = self._steps(keys, ctx, timeout_s, before_step=other.driver.step,
                              sleep_s=0.002)[-1]
        assert PENDING not in answers and RETRY not in answers, answers
        return answers

    def settle(self, timeout_s=20.0):
        assert self.driver.settle(timeout_s), "tier jobs did not finish"

    def steps_until(self, done, what, timeout_s=20.0):
        """End steps (``on_schedule_end`` under the lock, 5 ms apart, no lookups) until
        ``done()`` holds; fails naming ``what`` never happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            with self.manager.lock:
                self.manager.on_schedule_end(END)
            assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
            time.sleep(0.005)

    def until_hit(self, keys, ctx, timeout_s=20.0):
        """Look up like the connector (one pass per step) until all HIT; returns answers seen."""
        seen = self._steps(keys, ctx, timeout_s,
                           done=lambda answers: MISS in answers or all(a is HIT for a in answers))
        assert MISS not in seen[-1], f"a key was lost: {seen}"
        assert all(a is HIT for a in seen[-1]), f"never all HIT: {seen[-3:]}"
        return seen

    def answers_settled(self, keys, ctx, timeout_s=20.0):
        """Look ``keys`` up once per step until no answer is PENDING or RETRY; the answers."""
        return self._steps(keys, ctx, timeout_s)[-1]

    def record_pool_results(self) -> list:
        """Every pool result the fs tier takes from now on (a list that fills up)."""
        pool, seen = self.spec.worker_pool, []
        real = pool.take

        def take(tier):
            got = real(tier)
            seen.extend(got)
            return got

        pool.take = take
        return seen

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()


@pytest.fixture
def engines(engine_id):
    made = []

    def make(root, **kw):
        engine = Engine(f"{engine_id}-{len(made)}", root, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in reversed(made):
        engine.close()
