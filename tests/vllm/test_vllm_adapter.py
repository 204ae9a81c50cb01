"""Conformance of shmtier.vllm with vLLM 0.33's offloading interfaces (docs/vllm-contract.md §1-2, §11-12, §14).

Everything on vLLM's side is vLLM's real class: the spec is loaded by vLLM's
OffloadingSpecFactory from a real OffloadingConfig; the manager is driven with
vLLM's ReqContext / ScheduleEndContext in the order of the connector's step
(docs/vllm-contract.md §2.3); the worker copies vLLM's CanonicalKVCaches (CPU tensors) with
vLLM's GPULoadStoreSpec; every stats payload goes through vLLM's own Prometheus
front end (OffloadPromMetrics) with a private registry. Segments, semaphores,
tier worker processes and temp dirs are cleaned up also on failure.
"""

from __future__ import annotations

import functools
import json
import pathlib
import pickle
import re
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")  # without vLLM these tests skip; an incompatible vLLM fails below

import shmtier.vllm as sv  # noqa: E402  (not importorskip: drift from vLLM must fail)
import vllm_harness  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402,E501
from vllm.v1.kv_offload import base as vb  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec as VllmTieringSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from shmtier.config import ConfigError  # noqa: E402

SPEC = {"spec_name": "ShmTierOffloadingSpec", "spec_module_path": "shmtier.vllm"}
LAYER_PAGE = 1024  # one layer's block: K+V x 16 tokens x 2 heads x 8 dims x fp16
LAYERS = 2
BLOCKS = 32
HIT, MISS, PENDING, RETRY = (vb.LookupResult.HIT, vb.LookupResult.MISS,
                             vb.LookupResult.HIT_PENDING, vb.LookupResult.RETRY)


# vLLM's normalized config for a 2-layer, one-group full-attention model
offloading_config = functools.partial(vllm_harness.offloading_config,
                                      kv_bytes_per_block=LAYER_PAGE * LAYERS)


def key(i: int, group: int = 0) -> bytes:
    return vb.make_offload_key(i.to_bytes(32, "big"), group)


def kv_caches(seed: int):
    """vLLM's CanonicalKVCaches for one rank: two layers, one tensor each (CPU)."""
    g = torch.Generator().manual_seed(seed)
    layers = [torch.randint(-2**15, 2**15, (BLOCKS, 2, 16, 2, 8), generator=g,
                            dtype=torch.int16).view(torch.float16) for _ in range(LAYERS)]
    caches = vb.CanonicalKVCaches(
        tensors=[vb.CanonicalKVCacheTensor(t, LAYER_PAGE) for t in layers],
        group_data_refs=[[vb.CanonicalKVCacheRef(i, LAYER_PAGE) for i in range(LAYERS)]])
    return caches, layers


def block_bytes(layers, block: int) -> list[bytes]:
    return [t[block].contiguous().view(torch.int8).numpy().tobytes() for t in layers]


class PromSink:
    """vLLM's Prometheus front end for an engine configured with ``extra``."""

    def __init__(self, extra):
        self.registry, self.prom = vllm_harness.prom_front_end(
            vllm_harness.connector_vllm_config(extra))
        self.seen: dict[str, set] = {}

    def observe(self, stats):
        assert isinstance(stats, OffloadingConnectorStats)
        for name, series in stats.data["data"].items():
            self.seen.setdefault(name, set()).update(series)
        self.prom.observe(stats.data, 0)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


@pytest.fixture
def fs_root():
    """A temporary fs-tier root, removed after the test whether it passed or not."""
    with tempfile.TemporaryDirectory(prefix="shmtier-vllm-test-") as root:
        yield pathlib.Path(root)


# ----------------------------------------------------------------------------- loading


def test_the_factory_loads_the_spec_by_name(engine_id):
    extra = {**SPEC, "cpu_bytes_to_use": 1 << 20}
    assert OffloadingSpecFactory.get_spec_cls(extra) is sv.ShmTierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, engine_id))
    assert isinstance(spec, vb.OffloadingSpec)
    # vLLM's base constructor ran: the connector reads these
    assert spec.offload_prompt_only is True and spec.tokens_per_block == (16,)
    assert spec.kv_events_config.enable_kv_cache_events is True
    assert spec.core.engine_id == engine_id and spec.core.layout.model == "tiny-llama"
    assert spec.core.data_parallel_index == 0


def test_the_data_parallel_index_reaches_the_core_spec(engine_id):
    """vLLM's parallel.data_parallel_index is what a p2p tier adds to its port."""
    import dataclasses
    extra = {**SPEC, "cpu_bytes_to_use": 1 << 20,
             "secondary_tiers": [{"type": "p2p", "plaintext": True, "port": 6000}]}
    config = offloading_config(extra, engine_id)
    config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                      data_parallel_index=3))
    spec = sv.ShmTierOffloadingSpec(config)
    assert spec.core.data_parallel_index == 3
    assert spec.core.tiering_config.secondary_tiers[0].options.listen_port(3) == 6003


@pytest.mark.parametrize("case", [
    dict(world_size=1, bpc=1, extra={"blocks_per_chunk": 1}),
    dict(world_size=2, pp=2, bpc=2, extra={"block_size": 32}),
    dict(world_size=4, pp=4, bpc=3, extra={"blocks_per_chunk": 3}),
    dict(world_size=2, pp=2, bpc=2, replicated=True, extra={"block_size": 32}),
], ids=["tp1", "pp2-block_size", "pp4-bpc3", "replicated"])
def test_arena_geometry_and_info_equal_vllms_own_tiering_spec(case, engine_id):
    """Same OffloadingConfig -> the same chunk count, row and slot sizes as vLLM's
    TieringOffloadingSpec computes, and the same config-info values."""
    extra = {**SPEC, "cpu_bytes_to_use": 10_000_000, **case["extra"]}
    config = offloading_config(extra, engine_id, world_size=case["world_size"],
                               pp=case.get("pp", 1), bpc=case["bpc"],
                               replicated=case.get("replicated", False))
    ours = OffloadingSpecFactory.create_spec(config)
    theirs = VllmTieringSpec(config)  # computes sizes only; creates nothing
    g = ours.geometry
    assert (g.num_chunks, g.row_stride, g.page_size_per_worker) == (
        theirs.num_chunks, theirs.kv_bytes_per_chunk, theirs.cpu_page_size_per_worker)
    assert ours.core.blocks_per_chunk == theirs.blocks_per_chunk == case["bpc"]
    assert ours.replicated_layout == theirs.replicated_layout
    if hasattr(theirs, "cpu_info"):  # config info is 0.33's (0.32 has none)
        assert ours.core._tier_info().as_config_info() == theirs.cpu_info.as_config_info()
    assert "block_size" not in ours.core.extra_config  # vLLM resolved it already


def test_invalid_configs_fail_at_construction_naming_the_key(engine_id):
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        OffloadingSpecFactory.create_spec(offloading_config(dict(SPEC), engine_id))
    with pytest.raises(ConfigError, match="did you mean 'eviction_policy'"):
        OffloadingSpecFactory.create_spec(offloading_config(
            {**SPEC, "cpu_bytes_to_use": 1 << 20, "evicton_policy": "lru"}, engine_id))
    with pytest.raises(ConfigError, match="canonical_layout"):
        OffloadingSpecFactory.create_spec(offloading_config(
            {**SPEC, "cpu_bytes_to_use": 1 << 20, "canonical_layout": True}, engine_id,
            canonical=True))
    with pytest.raises(ConfigError, match="store_threshold"):
        OffloadingSpecFactory.create_spec(offloading_config(
            {**SPEC, "cpu_bytes_to_use": 1 << 20, "store_threshold": 2}, engine_id))


# ----------------------------------------------------------------------------- version guard


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.33.0", True), ("0.33.2", True), ("0.34.0rc1", True),
    ("0.34.1.dev4+gabcdef", True), ("0.31.9", False), ("0.35.0", False), ("1.33.0", False),
    ("dev", False), ("", False)])
def test_supported_version_range(version, ok):
    assert sv.vllm_version_supported(version) is ok


def _installed_line() -> str:
    """The release line of the installed vLLM by its version string (0.32, 0.33, 0.34)."""
    import vllm

    return ".".join(vllm.__version__.split(".")[:2])


def test_the_installed_vllm_is_recognised_by_its_interfaces():
    """The dialect picked by the interfaces is the installed release line, and the
    per-line report says exactly which newer lines' interfaces it lacks."""
    line = _installed_line()
    assert sv.DIALECT.name == line
    assert sv.check_vllm() is sv.DIALECT
    report = sv.missing_vllm_interfaces()
    assert set(report) == {"0.32", "0.33", "0.34"}
    assert report[line] == []
    older = {"0.34": ("0.33", "0.32"), "0.33": ("0.32",), "0.32": ()}[line]
    for name in older:  # an older line's interfaces are all there too
        assert report[name] == []
    base = "vllm.v1.kv_offload.base"
    if line in ("0.32", "0.33"):
        assert f"{base}.DevicePointers" in report["0.34"]
        assert "vllm.v1.kv_offload.tiering.base.JobResult.deferred_release" in report["0.34"]
    if line == "0.32":
        assert set(report["0.33"]) == {
            f"{base}.OffloadingSpec.config_info_keys", f"{base}.OffloadingManager.lock",
            f"{base}.OffloadingManager.on_reset_flushed", f"{base}.OffloadingManager.config_info",
            f"{base}.OffloadingEvent.metadata_only",
            f"{base}.OffloadingGaugeMetadata.multiprocess_mode",
            "vllm.v1.kv_offload.config.OffloadingModelConfig.max_model_len"}
    # what each line asks of the adapter
    assert sv.DIALECT.connector_takes_lock is (line != "0.32")
    assert sv.DIALECT.device_pointers is (line == "0.34")
    assert sv.DIALECT.failed_transfers is (line == "0.34")


def test_the_installed_vllm_passes_and_another_version_is_refused(monkeypatch):
    sv.check_vllm()
    with pytest.raises(sv.VLLMCompatibilityError,
                       match=r"vLLM 0\.35\.1 is installed, shmtier supports vLLM >=0\.32,<0\.35"):
        sv.check_vllm(vllm_module=types.SimpleNamespace(__version__="0.35.1"))
    monkeypatch.setenv(sv.VERSION_CHECK_ENV, "0")
    assert sv.check_vllm(vllm_module=types.SimpleNamespace(__version__="dev")) is sv.DIALECT


def test_the_interface_check_names_every_missing_piece_per_version():
    import importlib

    real_base = importlib.import_module("vllm.v1.kv_offload.base")

    class WorkerWithoutWait:  # an OffloadingWorker that lost wait()
        def submit_store(self): ...
        def submit_load(self): ...
        def get_finished(self): ...
        def shutdown(self): ...

    fake_base = types.SimpleNamespace(**{n: getattr(real_base, n) for n in dir(real_base)
                                         if n != "TransferResult"})
    fake_base.OffloadingWorker = WorkerWithoutWait

    def fake_import(name):
        if name == "vllm.v1.kv_offload.base":
            return fake_base
        if name == "vllm.v1.metrics.cache_hit_source":
            raise ImportError("gone")
        return importlib.import_module(name)

    common = [
        "vllm.v1.kv_offload.base.OffloadingWorker.wait",
        "vllm.v1.kv_offload.base.TransferResult",
        "module vllm.v1.metrics.cache_hit_source (ImportError: gone)",
    ]
    missing = sv.missing_vllm_interfaces(fake_import)
    assert missing["0.32"] == common  # what every line needs comes first, in order
    for name in ("0.33", "0.34"):
        assert missing[name][:3] == common
    with pytest.raises(sv.VLLMCompatibilityError) as info:
        sv.check_vllm(import_module=fake_import)
    text = str(info.value)
    for name in ("0.34", "0.33", "0.32"):
        assert f"as vLLM {name} it lacks: vllm.v1.kv_offload.base.OffloadingWorker.wait" in text


# ----------------------------------------------------------------------------- metrics


def test_metric_definitions_and_info_keys_are_vllms(fs_root):
    extra = {**SPEC, "cpu_bytes_to_use": 1 << 20,
             "secondary_tiers": [{"type": "example"}, {"type": "fs", "root_dir": str(fs_root)}]}
    defs = sv.ShmTierOffloadingSpec.build_metric_definitions(extra)
    kinds = {vb.OffloadingCounterMetadata: "counter", vb.OffloadingGaugeMetadata: "gauge",
             vb.OffloadingHistogramMetadata: "histogram"}
    assert {type(md) for md in defs.values()} <= set(kinds)
    # the fs tier's own series are declared too
    assert "vllm:kv_offload_shmtier_fs_bytes_on_disk" in defs
    assert defs["vllm:kv_offload_tiering_promotion_latency_seconds"].labelnames == ("tier", "result")
    assert sv.ShmTierOffloadingSpec.config_info_keys(extra) == (
        "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes",
        "cpu_kv_cache_size_tokens", "tier", "example_info", "fs_max_bytes")
    sink = PromSink(extra)  # vLLM creates every declared metric, with base labels
    bogus = OffloadingConnectorStats()
    bogus.increase_counter("vllm:kv_offload_shmtier_undeclared", 1)
    with pytest.raises(AssertionError):  # what would happen to an undeclared series
        sink.observe(bogus)


# ----------------------------------------------------------------------------- manager + worker


class Rig:
    """Scheduler-side manager plus one GPU rank, each from its own spec instance
    (as vLLM builds one per process role), over a CPU tier of ``chunks`` rows."""

    def __init__(self, engine_id, tiers, *, chunks=16, bpc=2, **extra):
        self.extra = {**SPEC, "cpu_bytes_to_use": chunks * LAYER_PAGE * LAYERS * bpc,
                      "block_size": 16 * bpc, "secondary_tiers": tiers, **extra}
        self.bpc = bpc
        self.config = offloading_config(self.extra, engine_id, bpc=bpc)
        self.manager = OffloadingSpecFactory.create_spec(self.config).get_manager()
        self.workers = []
        try:
            self.caches, self.layers = kv_caches(seed=1)
            self.original = [t.clone() for t in self.layers]
            spec = OffloadingSpecFactory.create_spec(self.config)
            self.worker = spec.get_worker(self.caches)
            self.workers.append(self.worker)
        except BaseException:
            self.manager.shutdown()
            raise
        self.job = 0

    def copy(self, store: bool, cpu_spec, gpu_blocks, block_index=0):
        assert isinstance(cpu_spec, CPULoadStoreSpec)
        self.job += 1
        gpu = vb.GPULoadStoreSpec(gpu_blocks, group_sizes=[len(gpu_blocks)],
                                  block_indices=[block_index])
        ok = (self.worker.submit_store(self.job, gpu, cpu_spec) if store
              else self.worker.submit_load(self.job, cpu_spec, gpu))
        assert ok is True
        self.worker.wait({self.job})
        (result,) = self.worker.get_finished()
        assert isinstance(result, vb.TransferResult)
        assert (result.job_id, result.success) == (self.job, True)
        assert result.transfer_size == len(gpu_blocks) * LAYER_PAGE * LAYERS
        return result

    def load(self, keys, ctx, *, gpu_blocks, stored_from):
        """The load path of a request whose keys all HIT: prepare_load, the worker's
        copy into ``gpu_blocks`` (byte-exact against the GPU blocks ``stored_from``
        held when they were stored), complete_load, on_request_finished."""
        gpu_blocks, stored_from = list(gpu_blocks), list(stored_from)
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        self.copy(False, spec, gpu_blocks)
        for layer, orig in zip(self.layers, self.original):
            assert torch.equal(layer[gpu_blocks].view(torch.int16),
                               orig[stored_from].view(torch.int16))
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
            self.manager.on_request_finished(ctx)

    def close(self):
        for w in self.workers:
            w.shutdown()
        assert not self.manager.core.lock.locked()
        self.manager.shutdown()  # without the lock, as the connector does


@pytest.fixture
def rigs():
    made = []

    def make(*args, **kw):
        made.append(Rig(*args, **kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def step(manager, sink, new=(), preempted=()):
    """The end of one scheduler step (docs/vllm-contract.md §2.3 4.): on_schedule_end last, then
    the connector's short-lock hooks: stats and events."""
    with manager.lock:
        manager.on_schedule_end(vb.ScheduleEndContext(list(new), list(preempted)))
    with manager.lock:
        stats = manager.get_stats()
        events = list(manager.take_events())
    if stats is not None:
        sink.observe(stats)
    for event in events:
        assert isinstance(event, vb.OffloadingEvent)
        assert isinstance(event.medium, vb.Medium)
    return events


def lookup_until(manager, sink, keys, ctx, want, *, timeout_s=20.0):
    """Ask every step like the connector until all answers are ``want``; returns every pass."""
    deadline, seen = time.monotonic() + timeout_s, []
    while True:
        with manager.lock:
            answers = [manager.lookup(k, ctx) for k in keys]
        seen.append(answers)
        assert all(type(a) is vb.LookupResult for a in answers)
        step(manager, sink)
        if all(a is want for a in answers):
            return seen
        assert time.monotonic() < deadline, f"never all {want}: {seen[-3:]}"
        time.sleep(0.005)


def settle(manager, sink, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        step(manager, sink)
        with manager.lock:
            if not manager.has_pending_work():
                return
        assert time.monotonic() < deadline, "tier jobs did not finish"
        time.sleep(0.005)


def only_in_the_secondary_tier(manager, sink, keys):
    """Request "A" stores ``keys`` (no GPU copy: only their presence matters), the
    cascades finish, then a confirmed reset empties the primary: the keys stand in
    the secondary tier alone and a lookup promotes them."""
    a = vb.ReqContext("A")
    with manager.lock:
        manager.on_new_request(a)
        out = manager.prepare_store(keys, a)
        manager.complete_store(out.keys_to_store, a)
        manager.on_request_finished(a)
    settle(manager, sink)
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()


@pytest.mark.parametrize("tier", ["example", "fs"])
def test_the_connector_call_sequence_with_vllm_types(tier, rigs, engine_id, fs_root):
    """on_new_request, lookup (RETRY / HIT_PENDING deferral), prepare_store, worker
    store, complete_store, on_request_finished, on_schedule_end, take_events,
    get_stats, prepare_load + worker load (byte-exact), complete_load, reset_cache
    + on_reset_flushed, promotion from the secondary tier, shutdown without the lock."""
    tiers = [{"type": "example"}] if tier == "example" else [
        {"type": "fs", "root_dir": str(fs_root), "min_free_bytes": None,
         "enable_kv_events": True}]
    extra = {"workers": "external", "num_tier_workers": 2} if tier == "fs" else {}
    rig = rigs(engine_id, tiers, **extra)
    m, sink, supervisor = rig.manager, PromSink(rig.extra), None
    keys = [key(i) for i in range(3)]
    try:
        # --- request A: first sight, lookup, store of 3 chunks (GPU blocks 2..7)
        a = vb.ReqContext("A")
        with m.lock:
            policy = m.on_new_request(a)
            assert type(policy) is vb.RequestOffloadingContext
            assert policy.policy is vb.OffloadPolicy.CHUNK_LEVEL
            first = [m.lookup(k, a) for k in keys]
        if tier == "fs":
            # the external pool is not running yet: the tier's index is unknown -> RETRY
            # (the connector defers the request and asks again next step)
            assert first == [RETRY] * 3
            step(m, sink)
            with m.lock:
                assert [m.lookup(k, a) for k in keys] == [RETRY] * 3
            supervisor = subprocess.Popen(
                [sys.executable, "-m", "shmtier", "workers", "--engine-id", engine_id],
                stdout=subprocess.PIPE, text=True)
            assert "2 tier workers" in supervisor.stdout.readline()
            lookup_until(m, sink, keys, a, MISS)
        else:
            assert first == [MISS] * 3
        with m.lock:
            out = m.prepare_store(keys, a)
        assert type(out) is vb.PrepareStoreOutput and out.keys_to_store == keys
        assert out.evicted_keys == [] and isinstance(out.store_spec, CPULoadStoreSpec)
        # vLLM's spec type, pickled to the GPU workers as a multiprocess executor does
        sent = pickle.loads(pickle.dumps(out.store_spec))
        assert isinstance(sent, CPULoadStoreSpec) and sent.chunk_ids.dtype == np.int32
        assert sent.chunk_ids.tolist() == out.store_spec.chunk_ids.tolist() and len(sent.chunk_ids) == 3
        rig.copy(True, out.store_spec, list(range(2, 8)))
        with m.lock:
            m.complete_store(out.keys_to_store, a)
            assert [m.lookup(k, a) for k in keys] == [HIT] * 3
            m.on_request_finished(a)
        events = step(m, sink, new=["A"])
        assert [(e.keys, e.medium, e.removed) for e in events] == [(keys, vb.Medium.CPU, False)]
        settle(m, sink)  # cascades reach the secondary tier
        if tier == "fs":
            assert len(list(fs_root.rglob("*.kv"))) == 3  # one file per chunk

        # --- request B: all HIT in the primary, load into GPU blocks 10..15
        b = vb.ReqContext("B")
        with m.lock:
            m.on_new_request(b)
            assert [m.lookup(k, b) for k in keys] == [HIT] * 3
            assert m.get_load_source(keys[0], b) is CacheHitSource.HOST
        rig.load(keys, b, gpu_blocks=range(10, 16), stored_from=range(2, 8))
        step(m, sink, new=["B"])

        # --- reset: primary forgets, promotions held until the flush is confirmed
        with m.lock:
            m.reset_cache()
        np.asarray(m.core.primary.get_kv_memoryview())[:] = 0  # the rows get reused
        c = vb.ReqContext("C")
        with m.lock:
            m.on_new_request(c)
            if sv.DIALECT.calls_on_reset_flushed:  # (0.32: nothing was in flight, no hold)
                assert [m.lookup(k, c) for k in keys] == [MISS] * 3
                m.on_reset_flushed()
            assert [m.lookup(k, c) for k in keys] == [PENDING] * 3  # promotions reserved
            assert [m.lookup(k, c) for k in keys] == [PENDING] * 3
        step(m, sink)  # on_schedule_end submits the promotion
        lookup_until(m, sink, keys, c, HIT)
        source = CacheHitSource.HOST if tier == "example" else CacheHitSource.DISK
        with m.lock:
            assert m.get_load_source(keys[1], c) is source
        rig.load(keys, c, gpu_blocks=range(20, 26), stored_from=range(2, 8))
        settle(m, sink)

        # --- metrics: every emitted name and label set was accepted by vLLM's front end
        if hasattr(OffloadingConnectorStats, "set_info"):  # config info is 0.33's
            with m.lock:
                info = OffloadingConnectorStats()
                info.set_info(m.config_info())
            sink.observe(info)
        label = f"1:{tier}"
        assert sink.seen["vllm:kv_offload_tiering_chunk_hits"] >= {(label,)}
        assert (label, "success") in sink.seen["vllm:kv_offload_tiering_promotion_latency_seconds"]
        text = sink.text()
        assert f'vllm:kv_offload_tiering_read_bytes_total{{engine="0",model_name="m",tier="{label}"}}' in text
        if hasattr(OffloadingConnectorStats, "set_info"):
            assert 'vllm:kv_offload_config_info{' in text and 'tier="0:primary"' in text
        if tier == "fs":
            assert "vllm:kv_offload_shmtier_fs_bytes_on_disk" in sink.seen
    finally:
        if supervisor is not None:
            supervisor.terminate()
            supervisor.wait(10)


def test_kv_load_tiers_filter_applies_to_vllm_contexts(rigs, engine_id):
    """A request restricted to storage tiers must not be served by the CPU
    (example) tier, one restricted to CPU tiers must (docs/vllm-contract.md §1.3)."""
    rig = rigs(engine_id, [{"type": "example"}])
    m, sink = rig.manager, PromSink(rig.extra)
    keys = [key(i) for i in range(2)]
    only_in_the_secondary_tier(m, sink, keys)
    only_storage = vb.ReqContext("S", load_tier_filter=vb.TierFilter(
        (vb.TierMatcher(medium=vb.Medium.STORAGE),)))
    only_cpu = vb.ReqContext("C", load_tier_filter=vb.TierFilter(
        (vb.TierMatcher(medium=vb.Medium.CPU, locality=None),)))
    nothing = vb.ReqContext("N", load_tier_filter=vb.TierFilter(()))
    with m.lock:
        for ctx in (only_storage, only_cpu, nothing):
            m.on_new_request(ctx)
        assert [m.lookup(k, only_storage) for k in keys] == [MISS, MISS]
        assert [m.lookup(k, nothing) for k in keys] == [MISS, MISS]
        assert [m.lookup(k, only_cpu) for k in keys] == [PENDING, PENDING]
    step(m, sink)  # a step's lookups always end with on_schedule_end


def test_a_tier_written_for_vllm_loads_through_module_path(rigs, engine_id):
    """vLLM's own ExampleSecondaryTierManager as an out-of-tree tier: its enums,
    results and config info cross into shmtier's manager and back out as vLLM's."""
    rig = rigs(engine_id, [{"type": "ExampleSecondaryTierManager",
                            "module_path": "vllm.v1.kv_offload.tiering.example.manager",
                            "custom_param": 7}])
    m, sink = rig.manager, PromSink(rig.extra)
    keys = [key(i) for i in range(2)]
    only_in_the_secondary_tier(m, sink, keys)
    c = vb.ReqContext("C")
    with m.lock:
        m.on_new_request(c)
        assert [m.lookup(k, c) for k in keys] == [PENDING, PENDING]
    step(m, sink)
    lookup_until(m, sink, keys, c, HIT)
    with m.lock:
        assert m.get_load_source(keys[0], c) is CacheHitSource.HOST
        own = {"example_info": 7} if sv.DIALECT.name != "0.32" else {}  # 0.32's has none
        assert m.config_info()[1] == {**own, "tier": "1:ExampleSecondaryTierManager"}


def test_ranks_write_their_own_slots_and_replicated_ranks_share_one(engine_id):
    """world_size=2: each rank's worker fills its slot of the row; with
    replicated_layout both ranks map the single slot (only rank 0 writes)."""
    for replicated in (False, True):
        eid = f"{engine_id}-{int(replicated)}"
        extra = {**SPEC, "cpu_bytes_to_use": 8 * 8192, "blocks_per_chunk": 2}
        configs = [offloading_config(extra, eid, rank=r, world_size=2, pp=2, bpc=2,
                                     replicated=replicated) for r in range(2)]
        manager = OffloadingSpecFactory.create_spec(configs[0]).get_manager()
        workers, layers = [], []
        try:
            for r in range(2):
                caches, ls = kv_caches(seed=10 + r)
                layers.append(ls)
                workers.append(OffloadingSpecFactory.create_spec(configs[r]).get_worker(caches))
            ctx = vb.ReqContext("A")
            with manager.lock:
                manager.on_new_request(ctx)
                out = manager.prepare_store([key(1)], ctx)
            gpu = vb.GPULoadStoreSpec([4, 5], group_sizes=[2], block_indices=[0])
            writers = workers[:1] if replicated else workers
            for job, w in enumerate(writers):
                assert w.submit_store(job, gpu, out.store_spec)
                w.wait({job})
                assert [r.success for r in w.get_finished()] == [True]
            row = np.asarray(manager.core.primary.get_kv_memoryview())[out.store_spec.chunk_ids[0]]
            slot = 2 * LAYER_PAGE * LAYERS
            expected = b"".join(  # rank slot = [layer0 blocks 4,5][layer1 blocks 4,5]
                b"".join(block_bytes(ls, 4)[i] + block_bytes(ls, 5)[i] for i in range(LAYERS))
                for ls in (layers[:1] if replicated else layers))
            assert row[:len(expected)].tobytes() == expected
            assert len(expected) == (slot if replicated else 2 * slot)
            # every rank loads the row back into other blocks: rank r gets its own bytes
            # (replicated: rank 0's, which in a real MLA model every rank holds)
            for job, w in enumerate(workers, start=10):
                assert w.submit_load(job, out.store_spec,
                                     vb.GPULoadStoreSpec([7, 8], group_sizes=[2],
                                                         block_indices=[0]))
                w.wait({job})
                assert [r.success for r in w.get_finished()] == [True]
            for r in range(2):
                src = layers[0] if replicated else layers[r]
                for i in range(LAYERS):
                    assert block_bytes(layers[r], 7)[i] == block_bytes(src, 4)[i]
                    assert block_bytes(layers[r], 8)[i] == block_bytes(src, 5)[i]
        finally:
            for w in workers:
                w.shutdown()
            manager.shutdown()


# ----------------------------------------------------------------------------- README


def _readme_section() -> str:
    text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("## Use with vLLM")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_readme_kv_transfer_configs_are_valid_and_accepted(engine_id, fs_root):
    blocks = re.findall(r"--kv-transfer-config '(\{.*?\})'", _readme_section(), re.S)
    assert len(blocks) >= 2  # the fs example first, the out-of-tree tier, the e2e server's
    examples = [json.loads(b) for b in blocks]
    fs_example = examples[0]
    for example in examples:
        KVTransferConfig(**example)  # vLLM accepts it as --kv-transfer-config
        assert OffloadingSpecFactory.get_spec_cls(
            example["kv_connector_extra_config"]) is sv.ShmTierOffloadingSpec
    extra = dict(fs_example["kv_connector_extra_config"])
    extra["secondary_tiers"] = [{**extra["secondary_tiers"][0], "root_dir": str(fs_root)}]
    config = offloading_config(extra, engine_id, bpc=2)
    spec = OffloadingSpecFactory.create_spec(config)  # every key validated by shmtier
    assert spec.core.tiering_config.secondary_tiers[0].options.max_bytes == 200 << 30


def test_readme_links_the_reference_that_documents_every_config_key():
    from shmtier.config import KNOWN_KEYS

    assert "(docs/configuration.md)" in _readme_section()
    reference = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md")
    text = reference.read_text()
    undocumented = sorted(k for k in KNOWN_KEYS if f"| `{k}` |" not in text)
    assert not undocumented, f"docs/configuration.md lacks config keys: {undocumented}"


def test_without_the_connectors_lock_and_flush_callback_the_manager_fences_itself(rigs, engine_id):
    """The manager for vLLM 0.32 (a connector that never takes ``manager.lock`` and
    never calls ``on_reset_flushed``), on every installed vLLM: a step's lookups
    open a region holding the core's lock until ``on_schedule_end`` (so a HIT and
    its ``prepare_load`` are never split by a poll thread's round); a reset with no
    copy in flight holds nothing; one with a copy in flight holds promotions for
    ``reset_flush_steps`` steps, then lookups promote again."""
    rig = rigs(engine_id, [{"type": "example"}])
    m = sv._SelfLockingManager(rig.manager.core, reset_flush_steps=3)
    sink = PromSink(rig.extra)
    keys = [key(i) for i in range(2)]
    a = vb.ReqContext("A")
    m.on_new_request(a)
    m.complete_store(m.prepare_store(keys, a).keys_to_store, a)
    m.on_request_finished(a)
    settle(m, sink)
    m.reset_cache()  # nothing in flight: no hold
    b = vb.ReqContext("B")
    m.on_new_request(b)
    assert [m.lookup(k, b) for k in keys] == [PENDING] * 2
    assert m.core.lock.locked()  # the step's region, from its first lookup ...
    step(m, sink)
    assert not m.core.lock.locked()  # ... to on_schedule_end
    lookup_until(m, sink, keys, b, HIT)
    m.on_request_finished(b)
    settle(m, sink)

    w = vb.ReqContext("W")  # a store whose GPU copy may still be writing its row
    m.on_new_request(w)
    assert m.prepare_store([key(9)], w).keys_to_store == [key(9)]
    m.reset_cache()
    assert m.has_pending_work()  # the engine keeps stepping until the hold ends
    c = vb.ReqContext("C")
    m.on_new_request(c)
    for _ in range(3):
        assert [m.lookup(k, c) for k in keys] == [MISS] * 2
        step(m, sink)
    assert [m.lookup(k, c) for k in keys] == [PENDING] * 2
    step(m, sink)
    lookup_until(m, sink, keys, c, HIT)
    m.on_request_finished(c)
    settle(m, sink)
    assert not m.core.lock.locked()


def test_a_failed_copy_is_reported_where_vllm_takes_it_and_named_where_not(rigs, engine_id):
    """0.34's connector turns a failed load into a failed receive: the result says
    success=False. Before 0.34 it asserts success, so the worker raises TransferFailed
    naming the job instead (and the next jobs still run)."""
    rig = rigs(engine_id, [])
    core = rig.worker.core

    def boom(job):
        raise OSError("injected copy failure")

    core._load_queue._execute = boom
    spec = CPULoadStoreSpec([0])
    gpu = vb.GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
    assert rig.worker.submit_load(7, spec, gpu) is True
    rig.worker.wait({7})
    if sv.DIALECT.failed_transfers:
        (result,) = rig.worker.get_finished()
        assert isinstance(result, vb.TransferResult)
        assert (result.job_id, result.success) == (7, False)
    else:
        with pytest.raises(sv.TransferFailed, match=r"copy job\(s\) \[7\] failed"):
            rig.worker.get_finished()


def test_an_engine_spread_over_nodes_is_refused_at_spec_build(engine_id):
    """shmtier keeps an engine's KV in one host's shared memory: vLLM's config putting
    one engine (one data-parallel replica) on two nodes fails the spec build, on every
    vLLM, saying so; data parallelism across nodes (one replica per node) is fine."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config

    config = offloading_config({**SPEC, "cpu_bytes_to_use": 1 << 20}, engine_id)
    spread = VllmConfig(parallel_config=ParallelConfig(nnodes=2, tensor_parallel_size=2),
                        device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(spread):
        with pytest.raises(ConfigError, match=r"nnodes = 2 puts one engine's workers on 2 "
                                              r"nodes: shmtier keeps an engine's KV in one "
                                              r"host's shared memory"):
            sv.ShmTierOffloadingSpec(config)
    replicas = VllmConfig(parallel_config=ParallelConfig(nnodes=2, data_parallel_size=2,
                                                         data_parallel_size_local=1),
                          device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(replicas):
        assert replicas.parallel_config.nnodes_within_dp == 1
        spec = sv.ShmTierOffloadingSpec(config)
        spec.get_manager().shutdown()
