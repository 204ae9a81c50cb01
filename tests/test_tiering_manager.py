"""TieringOffloadingManager over a real segment, with real copies and in-process tiers."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
import torch

from shmtier import metrics
from shmtier.contract import (
    CacheHitSource,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
)
from shmtier.gpu.canonical import CanonicalKVCacheRef, CanonicalKVCaches
from shmtier.gpu.copy_worker import BlockCopyWorker
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.scheduler.tiering.factory import SecondaryTierFactory
from shmtier.scheduler.tiering.manager import TieringOffloadingManager
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment

import connector_calls

HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)
PAGE = 4096
END = ScheduleEndContext((), ())


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


class Rig:
    """One engine in one process: segment, tiering manager, a copy worker over
    a CPU "GPU" cache of 64 blocks (1 block per chunk)."""

    def __init__(self, engine_id: str, num_chunks: int, tier_configs: list[dict]):
        geometry = ArenaGeometry(num_chunks=num_chunks, row_stride=PAGE,
                                 page_size_per_worker=PAGE, world_size=1)
        self.segment = open_segment(engine_id, geometry, "fp", owner=True)
        primary = CPUPrimaryTierOffloadingManager(self.segment, "lru", enable_events=True)
        view = primary.get_kv_memoryview()
        try:
            tiers = [SecondaryTierFactory.create_secondary_tier(cfg, view, None,
                                                                where=f"secondary_tiers[{i}]")
                     for i, cfg in enumerate(tier_configs)]
        except Exception:
            del view
            primary.shutdown()
            raise
        self.manager = TieringOffloadingManager(primary, tiers)
        self.cache = torch.randint(-128, 128, (64, PAGE), dtype=torch.int8)
        self.original = self.cache.clone()
        self.member = open_segment(engine_id, geometry, "fp", owner=False, rank=0)
        kv = CanonicalKVCaches([self.cache], [[CanonicalKVCacheRef(0, PAGE)]])
        self.worker = BlockCopyWorker(kv, self.member, 1, 0, threads=False, close_segment=True)
        self.jobs = 0

    def offload(self, keys, blocks, ctx):
        """The connector's store path, ``keys`` from GPU ``blocks`` (one each)."""

        def copy(out):
            gpu = [blocks[keys.index(k)] for k in out.keys_to_store]
            self.jobs += 1
            self.worker.submit_store(self.jobs, GPULoadStoreSpec(gpu, [len(gpu)], [0]), out.store_spec)
            self.worker.wait({self.jobs})
            assert all(r.success for r in self.worker.get_finished())

        return connector_calls.offload(self.manager, keys, ctx, copy)

    def stored_request(self, keys, req_id="a"):
        """A new request stores ``keys`` from GPU blocks 0.. and a step passes (its
        cascades submitted); returns its context."""
        ctx = ReqContext(req_id)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        self.offload(keys, list(range(len(keys))), ctx)
        self.step()
        return ctx

    def load(self, keys, blocks, ctx):
        m = self.manager
        with m.lock:
            spec = m.prepare_load(keys, ctx)
        self.cache[blocks] = 0
        self.jobs += 1
        self.worker.submit_load(self.jobs, spec, GPULoadStoreSpec(blocks, [len(blocks)], [0]))
        self.worker.wait({self.jobs})
        assert all(r.success for r in self.worker.get_finished())
        with m.lock:
            m.complete_load(keys, ctx)

    def step(self):
        with self.manager.lock:
            self.manager.on_schedule_end(END)

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


@pytest.fixture
def rig_factory(engine_id):
    rigs = []

    def make(num_chunks=8, tiers=({"type": "example"},)):
        rig = Rig(f"{engine_id}-{len(rigs)}", num_chunks, [dict(t) for t in tiers])
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def wait_for_hit(rig, keys, ctx, max_steps=5):
    """Ask like the connector until every key is HIT; returns the answers seen."""
    seen = []
    for _ in range(max_steps):
        with rig.manager.lock:
            answers = [rig.manager.lookup(k, ctx) for k in keys]
        seen.append(answers)
        if all(a is HIT for a in answers):
            return seen
        rig.step()
    raise AssertionError(f"never all HIT: {seen}")


def test_bytes_round_trip_through_a_secondary_tier(rig_factory):
    rig = rig_factory(num_chunks=8)
    m = rig.manager
    first = [key(i) for i in range(8)]
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    rig.offload(first, list(range(8)), ctx)  # cascades all 8 to the example tier
    with m.lock:
        m.on_request_finished(ctx)
    rig.step()  # as in vLLM, a job finished after this step's poll is seen next step
    assert m.has_pending_work()
    rig.step()
    assert not m.has_pending_work()
    other = ReqContext("b")
    with m.lock:
        m.on_new_request(other)
    rig.offload([key(100 + i) for i in range(8)], list(range(8, 16)), other)  # evicts all of "a"
    rig.step()
    rig.step()  # b's cascades done: its rows are unpinned and evictable again
    reader = ReqContext("c")
    with m.lock:
        m.on_new_request(reader)
        assert m.primary.lookup(first[0], reader) is MISS
    seen = wait_for_hit(rig, first[:4], reader)
    assert seen[0] == [PENDING] * 4 and seen[-1] == [HIT] * 4  # promoted, then readable
    with m.lock:
        assert m.get_load_source(first[0], reader) is CacheHitSource.HOST  # example medium = CPU
    rig.load(first[:4], [40, 41, 42, 43], reader)
    assert torch.equal(rig.cache[40:44], rig.original[0:4])
    stats = m.get_stats().data["data"]
    assert stats[metrics.READ_BYTES][("1:example",)] == 4 * PAGE
    assert stats[metrics.WRITE_BYTES][("1:example",)] == 16 * PAGE
    assert stats[metrics.CHUNK_HITS][("1:example",)] == 4


SCRIPTED = textwrap.dedent('''
    from shmtier.contract import LookupResult, Medium, RequestOffloadingContext
    from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager

    class ScriptedTier(SecondaryTierManager):
        medium = Medium.STORAGE
        def __init__(self, answers=(), fail_keys=(), **kw):
            super().__init__(**kw)
            self.answers = list(answers)
            self.fail_keys = set(bytes.fromhex(k) for k in fail_keys)
            self.finished, self.stores, self.finished_requests = [], [], []
        def lookup(self, key, ctx):
            return LookupResult[self.answers.pop(0)] if self.answers else LookupResult.MISS
        def submit_store(self, job):
            self.stores.append(list(job.keys))
            self.finished.append(JobResult(job.job_id, True))
        def submit_load(self, job):
            ok = [k for k in job.keys if k not in self.fail_keys]
            self.finished.append(JobResult(job.job_id, len(ok) == len(job.keys), ok))
        def get_finished_jobs(self):
            out, self.finished = self.finished, []
            return out
        def on_new_request(self, ctx):
            return RequestOffloadingContext()
        def on_request_finished(self, ctx):
            self.finished_requests.append(ctx.req_id)
        def drain_jobs(self):
            pass

    class HostScriptedTier(ScriptedTier):
        medium = Medium.CPU

    class RequestLevelTier(ScriptedTier):
        """Asks for every chunk of a request, also those already in the primary."""
        def on_new_request(self, ctx):
            from shmtier.contract import OffloadPolicy
            return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)

    class ExternalTier(ScriptedTier):
        """Serves one external request through its parent at the first on_schedule_end."""
        def __init__(self, external_keys=(), **kw):
            super().__init__(**kw)
            self.external_keys = [bytes.fromhex(k) for k in external_keys]
            self.external_answers = None
        def serve_external_requests(self, parent):
            if self.external_answers is not None:
                return
            from shmtier.contract import ReqContext
            ctx = ReqContext("external")
            parent.on_new_request(ctx)
            self.external_answers = [parent.lookup(k, ctx).name for k in self.external_keys]
            parent.on_request_finished(ctx)
''')


@pytest.fixture
def scripted_module(tmp_path, monkeypatch):
    (tmp_path / "scripted_tier.py").write_text(SCRIPTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "scripted_tier"


def test_retry_does_not_stop_the_scan_and_first_hit_wins(rig_factory, scripted_module):
    rig = rig_factory(tiers=[
        {"type": "ScriptedTier", "module_path": scripted_module, "answers": ["RETRY", "MISS"]},
        {"type": "ScriptedTier", "module_path": scripted_module, "answers": ["HIT", "MISS"]},
    ])
    m = rig.manager
    ctx = ReqContext("r")
    with m.lock:
        m.on_new_request(ctx)
        assert m.lookup(key(1), ctx) is PENDING  # tier 1 said RETRY, tier 2 HIT: promote
        assert m.lookup(key(1), ctx) is PENDING  # the reserved row answers now
        assert m.get_load_source(key(1), ctx) is CacheHitSource.DISK
        assert m.lookup(key(2), ctx) is MISS
    data = m.get_stats().data["data"]
    # RETRY is not a resolved query; key 2 was a MISS in both tiers
    assert data[metrics.CHUNK_QUERIES] == {("0:primary",): 2, ("1:ScriptedTier",): 1,
                                           ("2:ScriptedTier",): 2}
    assert data[metrics.CHUNK_HITS] == {("2:ScriptedTier",): 1}


def test_partial_promotion_failure_frees_failed_rows(rig_factory, scripted_module):
    rig = rig_factory(tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                              "answers": ["HIT", "HIT"], "fail_keys": [key(2).hex()]}])
    m = rig.manager
    ctx = ReqContext("r")
    with m.lock:
        m.on_new_request(ctx)
        assert [m.lookup(k, ctx) for k in (key(1), key(2))] == [PENDING, PENDING]
    rig.step()  # submits one promotion job for (tier, request)
    with m.lock:
        assert m.lookup(key(1), ctx) is HIT
        assert m.lookup(key(2), ctx) is MISS  # failed row freed, tier answers MISS now
        events = [(e.removed, e.metadata_only) for e in m.take_events()]
    assert (True, True) in events and (False, False) in events
    data = m.get_stats().data["data"]
    assert data[metrics.PROMOTION_JOB_FAILURES][("1:ScriptedTier",)] == 1
    assert data[metrics.PROMOTION_LATENCY][("1:ScriptedTier", "failure")]


def test_promotion_needs_a_free_primary_row(rig_factory, scripted_module):
    rig = rig_factory(num_chunks=2, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                            "answers": ["HIT"]}])
    m = rig.manager
    ctx = ReqContext("r")
    with m.lock:
        m.on_new_request(ctx)
    rig.offload([key(1), key(2)], [0, 1], ctx)
    with m.lock:
        m.prepare_load([key(1), key(2)], ctx)  # both rows pinned
        assert m.lookup(key(3), ctx) is MISS
        data = m.get_stats().data["data"]
        assert data[metrics.PROMOTION_ALLOCATION_FAILURES][()] == 1


def test_tiers_hear_of_a_finished_request_after_its_last_store(rig_factory, scripted_module):
    rig = rig_factory(tiers=[{"type": "ScriptedTier", "module_path": scripted_module}])
    m, tier = rig.manager, rig.manager.tiers[0]
    ctx = ReqContext("r")
    with m.lock:
        m.on_new_request(ctx)
        out = m.prepare_store([key(1)], ctx)
        m.on_request_finished(ctx)
        assert tier.finished_requests == []  # a cascade may still follow
        m.complete_store(out.keys_to_store, ctx)
        assert tier.stores == [[key(1)]] and tier.finished_requests == ["r"]


VLLM_EXAMPLE_TIER = {"type": "ExampleSecondaryTierManager",
                     "module_path": "vllm.v1.kv_offload.tiering.example.manager"}


@pytest.mark.parametrize("tier", [{"type": "example"}, VLLM_EXAMPLE_TIER],
                         ids=["example", "vllms-example-tier"])
def test_reset_holds_promotions_until_flushed(rig_factory, tier):
    """With shmtier's example tier and with vLLM's own, loaded as an out-of-tree tier
    (whose HIT, in vLLM's enum, must cross into the manager as a promotion)."""
    if tier is VLLM_EXAMPLE_TIER:
        pytest.importorskip(tier["module_path"])
    rig = rig_factory(tiers=[tier])
    m = rig.manager
    ctx = rig.stored_request([key(1)])
    with m.lock:
        m.reset_cache()
        assert m.lookup(key(1), ctx) is MISS  # held: recompute instead of stalling
        m.on_reset_flushed()
        assert m.lookup(key(1), ctx) is PENDING  # the tier answered HIT
    wait_for_hit(rig, [key(1)], ctx)


def test_lock_is_real_and_not_reentrant(rig_factory):
    m = rig_factory().manager
    assert isinstance(m.lock, type(threading.Lock()))
    with m.lock:
        assert not m.lock.acquire(blocking=False)


def test_stats_and_config_info_are_declared(rig_factory):
    rig = rig_factory()
    m = rig.manager
    rig.stored_request([key(1)])
    declared = {**metrics.cpu_metric_definitions(), **metrics.tiering_metric_definitions()}
    data = m.get_stats().data
    assert set(data["types"]) <= set(declared)
    assert m.config_info() == [{"tier": "0:primary"}, {"example_info": 0, "tier": "1:example"}]


def test_unknown_tier_type_and_bad_options_are_clear_errors(rig_factory):
    with pytest.raises(ValueError, match=r"^Unknown secondary tier type: 'nfs'\. .*"
                                         r"type='nfs' is not a known secondary tier type; "
                                         r"accepted: \['example'"):
        SecondaryTierFactory.get_tier_class({"type": "nfs"}, "secondary_tiers[0]")
    with pytest.raises(ValueError, match=r"secondary_tiers\[0\] has unknown key\(s\) 'locality'; "
                                         r"accepted keys: \['custom_param'\]"):
        rig_factory(tiers=[{"type": "example", "locality": "LOCAL"}])


SLOW = textwrap.dedent('''
    import time
    from shmtier.contract import LookupResult, Medium, RequestOffloadingContext
    from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager

    class SlowTier(SecondaryTierManager):
        """Finishes each job only ``delay_s`` after it was submitted."""
        medium = Medium.STORAGE
        def __init__(self, delay_s=0.003, **kw):
            super().__init__(**kw)
            self.delay_s, self.pending, self.stores = delay_s, [], 0
        def lookup(self, key, ctx):
            return LookupResult.MISS
        def submit_store(self, job):
            self.stores += 1
            self.pending.append(job)
        def submit_load(self, job):
            self.pending.append(job)
        def get_finished_jobs(self):
            now = time.monotonic()
            done = [j for j in self.pending if now - j.submit_time >= self.delay_s]
            self.pending = [j for j in self.pending if j not in done]
            return [JobResult(j.job_id, True) for j in done]
        def on_new_request(self, ctx):
            return RequestOffloadingContext()
        def drain_jobs(self):
            time.sleep(self.delay_s)
''')


def test_a_slow_tier_makes_backpressure_drop_cascades(engine_id, tmp_path, monkeypatch):
    (tmp_path / "slow_tier.py").write_text(SLOW)
    monkeypatch.syspath_prepend(str(tmp_path))
    from shmtier.config import TieringConfig

    extra = {"secondary_tiers": [{"type": "SlowTier", "module_path": "slow_tier",
                                  "backpressure": {"warmup_completions": 3}}]}
    (tier_config,) = TieringConfig.from_extra_config(extra).secondary_tiers
    geometry = ArenaGeometry(num_chunks=64, row_stride=PAGE, page_size_per_worker=PAGE, world_size=1)
    with open_segment(engine_id, geometry, "fp", owner=True) as segment:
        primary = CPUPrimaryTierOffloadingManager(segment, "lru")
        tier = SecondaryTierFactory.create_secondary_tier(
            tier_config, primary.get_kv_memoryview(), None)
        m = TieringOffloadingManager(primary, [tier])
        offered = 0
        for i in range(60):
            ctx = ReqContext(f"r{i}")
            with m.lock:
                out = m.prepare_store([key(i)], ctx)
                m.complete_store(out.keys_to_store, ctx)  # cascade offered (or dropped)
                offered += 1
                m.on_request_finished(ctx)
                m.on_schedule_end(END)
            time.sleep(0.004)
        data = m.get_stats().data["data"]
        dropped = data["vllm:kv_offload_tiering_backpressure_stores_dropped"][("1:SlowTier",)]
        assert dropped > 0 and tier.stores == offered - dropped
        assert data["vllm:kv_offload_tiering_backpressure_store_latency_ema"][("1:SlowTier",)] > 0.01
        with m.lock:
            m.reset_cache()
        m.shutdown()


def test_a_scans_promotions_are_reserved_together_when_the_scan_ends(rig_factory, scripted_module):
    """A request's consecutive lookups promote without touching the primary; its rows
    are reserved in one call when another call comes, before anyone can see them,
    and another request's lookup then finds the keys pending."""
    rig = rig_factory(num_chunks=4, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                            "answers": ["HIT", "HIT", "HIT"]}])
    m = rig.manager
    calls = []
    real_reserve = m.primary.reserve_rows

    def counting_reserve(keys, ctx, protected=()):
        calls.append(list(keys))
        return real_reserve(keys, ctx, protected)

    m.primary.reserve_rows = counting_reserve
    a, b = ReqContext("a"), ReqContext("b")
    with m.lock:
        assert [m.lookup(key(i), a) for i in (1, 2, 3)] == [PENDING] * 3
        assert m.lookup(key(2), a) is PENDING  # asked twice in one scan: one promotion
        assert calls == [] and m.primary.lookup(key(1), a) is MISS
        assert m.lookup(key(1), b) is PENDING  # b's scan starts: a's rows reserved first
        assert calls == [[key(1), key(2), key(3)]]
        assert [m.primary.lookup(key(i), a) for i in (1, 2, 3)] == [PENDING] * 3
    rig.step()
    with m.lock:
        assert [m.lookup(key(i), a) for i in (1, 2, 3)] == [HIT] * 3
    assert calls == [[key(1), key(2), key(3)]]


#: Every public call of the manager but these ends the open lookup scan first: ``lookup``
#: begins or continues one, ``poll_between_steps`` leaves it as the engine left it (a
#: connector that released the lock inside a scan), and the rest touch neither the
#: primary nor the tiers' state (``shutdown`` runs without the lock, after the steps).
DOES_NOT_END_THE_SCAN = {"lookup", "poll_between_steps", "shutdown", "config_info",
                         "report_deferred_releases_of_every_tier"}
ENDS_THE_SCAN = {  # name -> the call, with arguments a connector could pass
    "get_load_source": lambda m, ctx: m.get_load_source(key(90), ctx),
    "prepare_store": lambda m, ctx: m.prepare_store([key(91)], ctx),
    "complete_store": lambda m, ctx: m.complete_store([], ctx),
    "prepare_load": lambda m, ctx: m.prepare_load([], ctx),
    "complete_load": lambda m, ctx: m.complete_load([], ctx),
    "touch": lambda m, ctx: m.touch([key(92)], ctx),
    "on_new_request": lambda m, ctx: m.on_new_request(ReqContext("another")),
    "on_request_finished": lambda m, ctx: m.on_request_finished(ctx),
    "on_schedule_end": lambda m, ctx: m.on_schedule_end(END),
    "has_pending_work": lambda m, ctx: m.has_pending_work(),
    "take_events": lambda m, ctx: m.take_events(),
    "get_stats": lambda m, ctx: m.get_stats(),
    "poll_tiers": lambda m, ctx: m.poll_tiers(),
    "_create_store_job": lambda m, ctx: m.tiers[0].submit_store(  # a tier's parent's
        m._parents[0].create_store_job([], ctx)),
    "reset_cache": lambda m, ctx: m.reset_cache(),
    "on_reset_flushed": lambda m, ctx: m.on_reset_flushed(),  # (after reset_cache)
}


def first_calls_of(code, call) -> list[str]:
    """The functions ``call`` runs whose caller is the function of ``code``, in order
    (traced: ``sys.settrace`` sees every Python call)."""
    import sys

    seen = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is code:
            seen.append(frame.f_code.co_qualname)
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return seen


def test_every_call_but_a_lookup_ends_the_lookup_scan_first(rig_factory, scripted_module):
    """The scan object is the only thing that ends a scan (``LookupScan.end``, which
    alone clears the manager's ``_scan``), and each public call of the manager but a
    lookup calls it before anything else while a scan is open: its promotions have their
    rows before any other call can see the primary. A new public method must be listed
    here, on one side or the other."""
    public = {name for name, value in vars(TieringOffloadingManager).items()
              if callable(value) and not name.startswith("_")}
    assert public == (set(ENDS_THE_SCAN) | DOES_NOT_END_THE_SCAN) - {"_create_store_job"}
    rig = rig_factory(num_chunks=48, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                             "answers": ["HIT"] * 64}])
    m = rig.manager
    for i, (name, call) in enumerate(ENDS_THE_SCAN.items()):
        ctx = ReqContext(f"r{i}")
        with m.lock:
            m.on_new_request(ctx)
            promoted = m.lookup(key(i), ctx) is PENDING  # (not while reset holds promotions)
            assert m._scan is not None
            assert m.primary.lookup(key(i), ctx) is MISS  # its row not reserved yet
            calls = first_calls_of(getattr(TieringOffloadingManager, name).__code__,
                                   lambda: call(m, ctx))
            assert calls[:1] == ["LookupScan.end"], (name, calls[:3])
            assert m._scan is None
            if promoted and name != "reset_cache":
                assert m.primary.lookup(key(i), ctx) is PENDING, name
    with m.lock:  # the step-window thread's round leaves an open scan alone
        ctx = ReqContext("window")
        assert m.lookup(key(60), ctx) is PENDING
        m.poll_between_steps()
        assert m._scan is not None and m.primary.lookup(key(60), ctx) is MISS
        m.take_events()


def test_a_scans_promotions_never_evict_a_chunk_the_scan_answered_hit(rig_factory,
                                                                        scripted_module):
    """Per key, promoting key 3 would evict key 1 -- the least recent chunk, which the
    same scan had just answered HIT -- and the request's load of key 1 would fail."""
    rig = rig_factory(num_chunks=2, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                            "answers": ["HIT"]}])
    m = rig.manager
    old = ReqContext("old")
    rig.offload([key(1), key(2)], [0, 1], old)  # key 1 is the LRU victim
    rig.step()
    reader = ReqContext("reader")
    with m.lock:
        assert m.lookup(key(1), reader) is HIT
        assert m.lookup(key(3), reader) is PENDING
        spec = m.prepare_load([key(1)], reader)  # ends the scan: key 3 takes key 2's row
        assert spec.chunk_ids.tolist() == [0]
        assert m.primary.lookup(key(2), reader) is MISS
        evicted = [e.keys for e in m.take_events() if e.removed]
    assert evicted == [[key(2)]]
    rig.load([key(1)], [10], reader)
    assert torch.equal(rig.cache[10], rig.original[0])


def test_no_room_for_a_scans_next_promotion_is_a_miss_at_once(rig_factory, scripted_module):
    """The room check at lookup counts the scan's unreserved promotions: with one free
    row the second promotion of the scan answers MISS, as per-key reservation would."""
    rig = rig_factory(num_chunks=1, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                            "answers": ["HIT", "HIT"]}])
    m = rig.manager
    ctx = ReqContext("r")
    with m.lock:
        assert [m.lookup(key(1), ctx), m.lookup(key(2), ctx)] == [PENDING, MISS]
        data = m.get_stats().data["data"]
    assert data[metrics.PROMOTION_ALLOCATION_FAILURES][()] == 1
    assert m.primary.lookup(key(1), ctx) is PENDING


def test_external_requests_go_through_the_parent_with_the_origin_tier_left_out(
        rig_factory, scripted_module):
    """A tier serving a peer's request (serve_external_requests) uses the manager as its
    parent: lookups ask the primary and the other tiers, never the origin tier itself;
    a scan of a local request in progress is reserved first."""
    ext, other = key(7), key(8)
    rig = rig_factory(num_chunks=4, tiers=[
        {"type": "ExternalTier", "module_path": scripted_module,
         "external_keys": [ext.hex(), other.hex()], "answers": ["HIT"]},
        {"type": "ScriptedTier", "module_path": scripted_module, "answers": ["HIT", "MISS"]},
    ])
    m = rig.manager
    local = ReqContext("local")
    with m.lock:
        assert m.lookup(key(1), local) is PENDING  # tier 1 HIT: a scan with a promotion
        m.on_schedule_end(END)  # the parent's calls end the scan first
        assert m.primary.lookup(key(1), local) is PENDING
    tier = m.tiers[0]
    # the external lookups skipped tier 1 (its script still holds nothing else) and
    # tier 2 answered: HIT for the first key (promoted), MISS for the second
    assert tier.external_answers == ["HIT_PENDING", "MISS"]
    assert "external" not in tier.finished_requests  # the origin tier is not told


def test_the_tier_poll_thread_processes_opted_in_tiers_between_steps(engine_id, scripted_module):
    """A tier that sets tolerates_off_thread_polling has its finished jobs processed by
    the tier-poll thread (no scheduler call needed) and serves external requests from
    it; the thread stops at shutdown. With interval 0 there is no thread."""
    import importlib

    mod = importlib.import_module(scripted_module)

    class Polled(mod.ScriptedTier):
        tolerates_off_thread_polling = True

    geometry = ArenaGeometry(num_chunks=4, row_stride=PAGE, page_size_per_worker=PAGE, world_size=1)
    for interval, expect_thread in ((0.0, False), (0.001, True)):
        segment = open_segment(f"{engine_id}-poll{int(expect_thread)}", geometry, "fp", owner=True)
        primary = CPUPrimaryTierOffloadingManager(segment, "lru")
        tier = Polled(offloading_spec=None, primary_kv_view=primary.get_kv_memoryview(),
                      tier_type="polled", answers=["HIT"])
        served = []
        tier.serve_external_requests = lambda parent: served.append(parent)
        m = TieringOffloadingManager(primary, [tier], tier_poll_interval_s=interval)
        try:
            assert (m._poll_thread is not None) == expect_thread
            ctx = ReqContext("r")
            with m.lock:
                assert m.lookup(key(1), ctx) is PENDING
                m.on_schedule_end(END)  # submits the promotion; the tier finishes it at once
                serves_in_step = len(served)
            deadline = time.monotonic() + 5
            while expect_thread and m.primary.lookup(key(1), ctx) is not HIT:
                assert time.monotonic() < deadline, "the poll thread never processed the job"
                time.sleep(0.002)
            if not expect_thread:
                time.sleep(0.05)
                assert m.primary.lookup(key(1), ctx) is PENDING  # waits for the next step
            with m.lock:
                assert (len(served) > serves_in_step) == expect_thread
        finally:
            thread = m._poll_thread
            m.shutdown()
            assert thread is None or not thread.is_alive()


def test_no_room_but_the_scans_own_hits_is_a_miss(rig_factory, scripted_module):
    """The room check does not count chunks the scan answered HIT: with every row held
    by those, a promotion in the same scan is a MISS and both HITs stay loadable."""
    rig = rig_factory(num_chunks=2, tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                                            "answers": ["HIT"]}])
    m = rig.manager
    rig.offload([key(1), key(2)], [0, 1], ReqContext("old"))
    rig.step()
    reader = ReqContext("reader")
    with m.lock:
        assert [m.lookup(key(1), reader), m.lookup(key(2), reader)] == [HIT, HIT]
        assert m.lookup(key(3), reader) is MISS
        assert m.prepare_load([key(1), key(2)], reader).chunk_ids.tolist() == [0, 1]
        data = m.get_stats().data["data"]
    assert data[metrics.PROMOTION_ALLOCATION_FAILURES][()] == 1


def test_load_tier_filter_decides_which_tiers_a_lookup_asks(rig_factory, scripted_module):
    from shmtier.contract import Medium, TierFilter, TierMatcher
    rig = rig_factory(tiers=[
        {"type": "ScriptedTier", "module_path": scripted_module, "answers": ["HIT", "HIT"]},
        {"type": "HostScriptedTier", "module_path": scripted_module, "answers": ["HIT", "HIT"]},
    ])
    m = rig.manager
    disk, host = m.tiers

    class ForeignFilter:  # vLLM's shape, unhashable (a list of matchers)
        ALL = None
        __hash__ = None

        def __init__(self, matchers):
            self.matchers = matchers

    host_only = TierFilter((TierMatcher(Medium.CPU),))
    cases = [(ReqContext("host", load_tier_filter=host_only), CacheHitSource.HOST),
             (ReqContext("any"), CacheHitSource.DISK),
             (ReqContext("host-again", load_tier_filter=host_only), CacheHitSource.HOST),
             (ReqContext("foreign", load_tier_filter=ForeignFilter([TierMatcher(Medium.STORAGE)])),
              CacheHitSource.DISK)]
    with m.lock:
        for i, (ctx, source) in enumerate(cases):
            m.on_new_request(ctx)
            assert m.lookup(key(i), ctx) is PENDING
            assert m.get_load_source(key(i), ctx) is source, ctx.req_id
        # each tier was asked exactly by the requests its filter lets through
        assert disk.answers == [] and host.answers == []
        nothing = ReqContext("nothing", load_tier_filter=TierFilter(()))
        m.on_new_request(nothing)
        assert m.lookup(key(9), nothing) is MISS


def test_lookup_metrics_count_each_key_once_and_time_retries(rig_factory, scripted_module):
    rig = rig_factory(tiers=[{"type": "ScriptedTier", "module_path": scripted_module,
                              "answers": ["RETRY", "RETRY", "HIT", "MISS", "MISS"]}])
    m = rig.manager
    ctx = ReqContext("r")
    with m.lock:
        m.on_new_request(ctx)
        assert m.lookup(key(1), ctx) is RETRY
        assert m.lookup(key(1), ctx) is RETRY
        m.get_load_source(key(1), ctx)  # another call between: a new scan, same record
        assert m.lookup(key(1), ctx) is PENDING
        assert m.lookup(key(1), ctx) is PENDING  # the reserved row answers: not counted
        assert m.lookup(key(2), ctx) is MISS
        assert m.lookup(key(2), ctx) is MISS  # resolved before: not counted again
        data = m.get_stats().data["data"]
        assert data[metrics.CHUNK_QUERIES] == {("0:primary",): 2, ("1:ScriptedTier",): 2}
        assert data[metrics.CHUNK_HITS] == {("1:ScriptedTier",): 1}
        assert len(data[metrics.LOOKUP_SYNC_DELAY][("1:ScriptedTier",)]) == 2
        # one RETRY -> HIT resolution, timed from the first RETRY
        assert len(data[metrics.LOOKUP_ASYNC_DELAY][("1:ScriptedTier",)]) == 1
        m.on_schedule_end(ScheduleEndContext(("r",), ()))  # scheduled: stops contributing
        assert m.lookup(key(3), ctx) is MISS
        data = m.get_stats().data["data"]
        assert metrics.CHUNK_QUERIES not in data
        later = ReqContext("later")
        m.on_new_request(later)
        assert m.lookup(key(3), later) is MISS
        assert m.get_stats().data["data"][metrics.CHUNK_QUERIES] == {
            ("0:primary",): 1, ("1:ScriptedTier",): 1}


def test_a_jobs_chunk_ids_are_an_int32_array_parallel_to_its_keys():
    from shmtier.scheduler.tiering.base import TransferJob
    job = TransferJob(1, [key(1), key(2)], [7, 3], True, ReqContext("r"))
    assert job.rows == [7, 3]
    assert job.chunk_ids.dtype.name == "int32" and job.chunk_ids.tolist() == [7, 3]
    assert job.chunk_ids is job.chunk_ids  # built once
    import numpy as np
    from_array = TransferJob(2, [key(1)], np.array([5], dtype=np.int64), False, ReqContext("r"))
    assert from_array.chunk_ids.dtype.name == "int32" and from_array.rows == [5]


def test_request_level_tiers_get_present_chunks_and_pending_ones_once_stored(
        rig_factory, scripted_module):
    from shmtier.contract import OffloadPolicy
    rig = rig_factory(tiers=[{"type": "RequestLevelTier", "module_path": scripted_module}])
    m = rig.manager
    tier = m.tiers[0]
    writer, reader = ReqContext("writer"), ReqContext("reader")
    with m.lock:
        m.on_new_request(writer)
    rig.offload([key(1)], [1], writer)  # stored and cascaded: chunk-level for the writer too
    with m.lock:
        assert tier.stores == [[key(1)]]
        assert m.prepare_store([key(2)], writer).keys_to_store == [key(2)]  # pending
        assert m.on_new_request(reader).policy is OffloadPolicy.REQUEST_LEVEL
        # the reader offers a present chunk (cascaded now) and a pending one (parked)
        assert m.prepare_store([key(1), key(2)], reader).keys_to_store == []
        assert tier.stores == [[key(1)], [key(1)]]
        m.on_request_finished(reader)
        assert m.has_pending_work()  # the parked key
        m.on_schedule_end(END)  # still pending: parked again
        assert tier.stores == [[key(1)], [key(1)]] and m.has_pending_work()
        m.complete_store([key(2)], writer)  # the writer's own cascade, then the parked one
        assert tier.stores == [[key(1)], [key(1)], [key(2)]]
        m.on_schedule_end(END)
        assert tier.stores == [[key(1)], [key(1)], [key(2)], [key(2)]]
    assert "reader" in tier.finished_requests  # once nothing of it was parked any more
    rig.step()  # the last cascade's result
    with m.lock:
        assert not m.has_pending_work()
