"""A multi-step scenario through vLLM 0.33's own OffloadingConnector halves with shmtier.

What runs is vLLM's code: ``OffloadingConnectorScheduler`` (lookups with
deferral, load/store job building, job completion counting over two workers,
reset fence, events translation, stats merging) and two
``OffloadingConnectorWorker`` ranks (``register_kv_caches`` building vLLM's
CanonicalKVCaches from per-layer CPU tensors, deferred stores, loads,
``get_finished``), each half over its own ``ShmTierOffloadingSpec`` made by
vLLM's ``OffloadingSpecFactory``. The test plays vLLM's Scheduler and model
runner: it calls the hooks in their order with real ``Request``,
``KVCacheBlocks``, ``SchedulerOutput`` and ``KVConnectorOutput`` objects.

How far vLLM allows offline, and why not further:

* ``OffloadingConnector.__init__`` runs ``build_offloading_config``, which
  reads ``vllm_config.model_config`` (``use_mla``, ``get_total_num_kv_heads``).
  A ``ModelConfig`` for a local config.json with no weights is possible, but
  constructing it inspects the model class, which imports
  ``vllm.model_executor.models.*`` -> ``einops``, a package not in
  ``requirements/vllm.txt`` (with it installed the inspection works offline but
  costs ~11 s). So the halves are constructed directly and the
  ``OffloadingConfig`` is written out as ``build_offloading_config`` derives it
  for this KV-cache config.
* vLLM's ``Scheduler`` reads ``model_config`` too, so its role is played here.
* ``register_kv_caches`` derives canonical mappings from ``model_config`` when
  the workers form exactly the TP x PCP grid; the engine here has two
  pipeline-parallel ranks, for which vLLM derives none, so it runs unmodified.
"""

from __future__ import annotations

import dataclasses

import pathlib
import tempfile
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import shmtier.vllm as sv  # noqa: E402,F401  (drift from vLLM must fail, not skip)
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ParallelConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm_harness import prom_front_end  # noqa: E402

BLOCK = 16  # tokens per GPU block (= tokens per hash)
BPC = 2  # GPU blocks per offloaded chunk ("block_size": 32 tokens)
NUM_BLOCKS = 40
LAYERS = ("layer.0", "layer.1")
WORLD = 2  # two pipeline-parallel worker ranks
ATTN = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
PAGE = ATTN.page_size_bytes  # 1024 bytes per layer per block
PREFIX = list(range(96))  # 6 full blocks = 3 chunks shared by every request



def _fields_it_has(cls, **values):
    """``cls(**values)`` with only the fields this vLLM's ``cls`` has: the scheduler's
    output records gained and lost fields between 0.32 and 0.34 (0.34's NewRequestData
    needs ``prefill_token_ids``; its CachedRequestData has no ``resumed_req_ids``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})

class Engine:
    """vLLM's connector halves for one engine: the scheduler half and WORLD worker
    halves, each over its own spec instance, with per-rank CPU KV tensors."""

    def __init__(self, engine_id: str, tiers: list, sink_extra: dict | None = None):
        self.extra = {"spec_name": "ShmTierOffloadingSpec", "spec_module_path": "shmtier.vllm",
                      "cpu_bytes_to_use": 8 * WORLD * BPC * PAGE * len(LAYERS),
                      "block_size": BLOCK * BPC, "secondary_tiers": tiers,
                      **(sink_extra or {})}
        self.vllm_config = VllmConfig(
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            parallel_config=ParallelConfig(pipeline_parallel_size=WORLD),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                kv_connector_extra_config=self.extra, engine_id=engine_id),
            device_config=DeviceConfig(device="cpu"))
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), ATTN)])
        self.workers: list[OffloadingConnectorWorker] = []
        self.sched = OffloadingConnectorScheduler(
            OffloadingSpecFactory.create_spec(self.config(engine_id, 0)),
            self.vllm_config, self.kv_cache_config)
        try:
            self.kv: list[dict[str, torch.Tensor]] = []
            for rank in range(WORLD):
                g = torch.Generator().manual_seed(rank)
                layers = {name: torch.randint(-2**15, 2**15, (NUM_BLOCKS, 2, BLOCK, 2, 8),
                                              generator=g, dtype=torch.int16).view(torch.float16)
                          for name in LAYERS}
                self.kv.append(layers)
                worker = OffloadingConnectorWorker(
                    OffloadingSpecFactory.create_spec(self.config(engine_id, rank)),
                    self.vllm_config, self.kv_cache_config)
                self.workers.append(worker)
                worker.register_kv_caches(layers)
        except BaseException:
            self.close()
            raise
        self.original = [{n: t.clone() for n, t in layers.items()} for layers in self.kv]
        self.job_ids: set[int] = set()
        self.stats = []

    def config(self, engine_id: str, rank: int) -> OffloadingConfig:
        """What build_offloading_config derives for this engine, on rank ``rank``."""
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(BLOCK, LAYERS, 0),),
            worker_kv_bytes_per_block=PAGE * len(LAYERS),
            enable_kv_cache_events=True,
            extra_config=self.extra,
            engine_id=engine_id,
            model=_fields_it_has(OffloadingModelConfig, name="tiny-llama", dtype="float16",
                                 max_model_len=1024),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=BPC),
            parallel=OffloadingParallelConfig(rank, WORLD, 1, WORLD, 1, 1, 0, 1, None, False))

    # --- the Scheduler's and the model runner's side of one engine step ---

    def step(self, new=(), cached=(), finished=()):
        """``new``/``cached``: (request, block ids or None, tokens scheduled)."""
        out = SchedulerOutput(
            scheduled_new_reqs=[_fields_it_has(
                NewRequestData,
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, mm_features=[],
                sampling_params=r.sampling_params, pooling_params=None, block_ids=(list(b),),
                num_computed_tokens=r.num_computed_tokens, lora_request=None,
                prefill_token_ids=list(r.prompt_token_ids))
                for r, b, _ in new],
            scheduled_cached_reqs=_fields_it_has(
                CachedRequestData,
                req_ids=[r.request_id for r, _, _ in cached], resumed_req_ids=set(),
                new_token_ids=[[] for _ in cached], all_token_ids={},
                new_block_ids=[(list(b),) if b else None for _, b, _ in cached],
                num_computed_tokens=[r.num_computed_tokens for r, _, _ in cached],
                num_output_tokens=[r.num_output_tokens for r, _, _ in cached]),
            num_scheduled_tokens={r.request_id: n for r, _, n in (*new, *cached)},
            total_num_scheduled_tokens=sum(n for _, _, n in (*new, *cached)),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(finished), free_encoder_mm_hashes=[], preempted_req_ids=set())
        meta = self.sched.build_connector_meta(out)
        self.job_ids |= meta.load_jobs.keys() | meta.store_jobs.keys()
        recving, worker_meta = set(), None
        for worker in self.workers:  # each rank's model runner
            worker.handle_preemptions(meta)
            worker.start_kv_transfers(meta)
            if out.total_num_scheduled_tokens:
                worker.prepare_store_kv(meta)  # wait_for_save: submitted next step
            worker.worker.wait(self.job_ids)  # (CPU copies: make this step's finish certain)
            _, done = worker.get_finished(out.finished_req_ids)
            recving |= done
            rank_meta = worker.build_connector_worker_meta()
            if rank_meta is not None:
                worker_meta = rank_meta if worker_meta is None else worker_meta.aggregate(rank_meta)
        for r, _, n in (*new, *cached):  # the forward pass computed n tokens
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens:
                r.append_output_token_ids(7)
        self.sched.update_connector_output(
            KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta))
        stats = self.sched.get_stats()
        if stats is not None:
            self.stats.append(stats)
        return meta, recving

    def settle(self, timeout_s=20.0):
        deadline = time.monotonic() + timeout_s
        while self.sched.has_pending_push_work():
            assert time.monotonic() < deadline, "offloading work never finished"
            self.step()
            time.sleep(0.005)

    def matched(self, req, timeout_s=20.0):
        """get_num_new_matched_tokens until it stops deferring (an empty step after
        each deferral, as the Scheduler does); returns (result, deferrals)."""
        deadline, deferrals = time.monotonic() + timeout_s, 0
        while True:
            hit, is_async = self.sched.get_num_new_matched_tokens(req, 0)
            if hit is not None:
                return (hit, is_async), deferrals
            deferrals += 1
            assert time.monotonic() < deadline, "lookup deferred forever"
            self.step()
            time.sleep(0.005)

    def blocks(self, ids):
        return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))

    def assert_loaded(self, dst_ids, src_ids):
        for rank in range(WORLD):
            for name in LAYERS:
                got = self.kv[rank][name][dst_ids].view(torch.int16)
                want = self.original[rank][name][src_ids].view(torch.int16)
                assert torch.equal(got, want), f"rank {rank} {name}: wrong KV loaded"

    def close(self):
        for worker in self.workers:
            worker.shutdown()
        self.sched.shutdown()


def make_request(req_id: str, tail: list[int]) -> Request:
    return Request(request_id=req_id, prompt_token_ids=PREFIX + tail,
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@pytest.fixture
def fs_root():
    """A temporary fs-tier root, removed after the test whether it passed or not."""
    with tempfile.TemporaryDirectory(prefix="shmtier-vllm-test-") as root:
        yield pathlib.Path(root)


@pytest.fixture(scope="module", autouse=True)
def _hashes():
    init_none_hash(sha256)


@pytest.mark.parametrize("tier", ["example", "fs"])
def test_multi_step_scenario_through_vllms_connector(tier, engine_id, fs_root):
    tiers = [{"type": "example"}] if tier == "example" else [
        {"type": "fs", "root_dir": str(fs_root), "min_free_bytes": None,
         "enable_kv_events": True}]
    engine = Engine(engine_id, tiers)
    try:
        sched = engine.sched

        # step 1: A (100 prompt tokens) misses everywhere and computes its prefill
        a = make_request("A", [500, 501, 502, 503])
        sched.on_new_request(a)
        (hit, _), deferrals = engine.matched(a)
        assert hit == 0
        if tier == "fs":
            # the fs tier learns its index from a scan by a freshly spawned tier
            # worker; until that answers, lookups are RETRY and vLLM defers
            assert deferrals >= 1
        sched.update_state_after_alloc(a, engine.blocks(range(1, 8)), 0)
        a.status = RequestStatus.RUNNING
        meta, _ = engine.step(new=[(a, range(1, 8), 100)])
        ((store_id, store),) = meta.store_jobs.items()  # 3 complete chunks = GPU blocks 1..6
        assert list(store.src_spec.block_ids) == [1, 2, 3, 4, 5, 6]
        assert isinstance(store.dst_spec, sv._VllmCPULoadStoreSpec) and len(store.dst_spec.chunk_ids) == 3
        # step 2: A decodes; the deferred store runs on both ranks and completes
        engine.step(cached=[(a, None, 1)])
        assert store_id not in sched._jobs
        a.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert sched.request_finished(a) == (False, None)
        engine.step(finished=["A"])
        engine.settle()  # cascades to the secondary tier

        # B: same 96-token prefix -> 3 chunks HIT in the CPU tier, async load
        b = make_request("B", [600, 601, 602, 603])
        sched.on_new_request(b)
        assert engine.matched(b) == ((96, True), 0)
        sched.update_state_after_alloc(b, engine.blocks(range(10, 17)), 96)
        assert sched.get_external_cache_hit_sources(b, 96) == {CacheHitSource.HOST: 96}
        b.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        meta, recving = engine.step()
        assert len(meta.load_jobs) == 1 and recving == {"B"}
        engine.assert_loaded(list(range(10, 16)), list(range(1, 7)))
        b.num_computed_tokens, b.status = 96, RequestStatus.RUNNING
        meta, _ = engine.step(new=[(b, range(10, 17), 4)])
        assert not meta.store_jobs  # its chunks came from the tier: nothing new to store
        b.status = RequestStatus.FINISHED_STOPPED
        sched.request_finished(b)
        engine.step(finished=["B"])

        # reset: the CPU tier forgets (no jobs in flight: flushed at once); its rows
        # are then overwritten, so a later hit must come from the secondary tier
        sched.reset_cache()
        arena = np.asarray(sched.manager.core.primary.get_kv_memoryview())
        arena[:] = 0
        del arena

        # C: promotions from the secondary tier; vLLM defers while HIT_PENDING
        c = make_request("C", [700, 701, 702, 703])
        sched.on_new_request(c)
        (hit, is_async), deferrals = engine.matched(c)
        assert (hit, is_async) == (96, True) and deferrals >= 1
        sched.update_state_after_alloc(c, engine.blocks(range(20, 27)), 96)
        source = CacheHitSource.HOST if tier == "example" else CacheHitSource.DISK
        assert sched.get_external_cache_hit_sources(c, 96) == {source: 96}
        c.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        _, recving = engine.step()
        assert recving == {"C"}
        engine.assert_loaded(list(range(20, 26)), list(range(1, 7)))
        c.num_computed_tokens, c.status = 96, RequestStatus.RUNNING
        engine.step(new=[(c, range(20, 27), 4)])
        c.status = RequestStatus.FINISHED_STOPPED
        sched.request_finished(c)
        engine.step(finished=["C"])
        engine.settle()

        # events: vLLM translated shmtier's events (medium, ownership) into its own
        events = list(sched.take_events())
        stored = {(e.medium, getattr(e, "ownership", None)) for e in events
                  if isinstance(e, BlockStored)}
        assert ("CPU", None) in stored
        if tier == "fs":
            assert ("STORAGE", "1:fs") in stored

        # stats: connector + manager payloads, through vLLM's Prometheus front end
        _, prom = prom_front_end(engine.vllm_config)
        totals: dict[str, float] = {}
        for stats in engine.stats:
            prom.observe(stats.data, 0)
            for name in ("vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes"):
                totals[name] = totals.get(name, 0) + stats.data["data"].get(name, {}).get((), 0)
        if sv.DIALECT.name != "0.32":  # config info is 0.33's
            assert engine.stats[0].data["info"] is not None  # it rides the first payload
        block_bytes = PAGE * len(LAYERS)
        assert totals["vllm:kv_offload_store_bytes"] == 6 * block_bytes * WORLD
        assert totals["vllm:kv_offload_load_bytes"] == 2 * 6 * block_bytes * WORLD
    finally:
        engine.close()
