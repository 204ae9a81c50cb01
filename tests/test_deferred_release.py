"""Deferred release of failed promotions (vLLM 0.34's ``JobResult.deferred_release``),
in shmtier's core: the primary tier's held rows (``primary.defer_write_release``), the
manager's bookkeeping (``shmtier/scheduler/tiering/deferred_release.py``) and its metrics,
over a real segment with an in-process tier that hands out real events (set from another
thread, as a tier's own thread would). The tiers that set them from real processes are
tested in test_p2p_tier.py, test_pool.py and test_fs_deferred_release.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shmtier import metrics
from shmtier.contract import (LookupResult, Medium, ReqContext, RequestOffloadingContext,
                              ScheduleEndContext)
from shmtier.scheduler.primary import CPUPrimaryTierOffloadingManager
from shmtier.scheduler.tiering.base import JobResult, SecondaryTierManager
from shmtier.scheduler.tiering.manager import TieringOffloadingManager
from shmtier.shared.layout import ArenaGeometry
from shmtier.shared.segment import open_segment

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
PAGE = 4096
END = ScheduleEndContext((), ())
LABEL = ("1:held",)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


class HeldTier(SecondaryTierManager):
    """Holds the chunks ``have`` (key -> bytes). Loads wait until the test finishes them:
    ``land(job)`` writes the bytes into the job's primary rows and succeeds;
    ``fail(job, ok=(), release=Event)`` fails the rest, with ``release`` as the result's
    deferred_release. ``drain_jobs`` sets the events in ``set_on_drain``."""

    medium = Medium.STORAGE
    defers_release = True

    def __init__(self, view: memoryview, tier_type: str = "held", result_cls=JobResult):
        super().__init__(None, view, tier_type)
        self.rows = np.asarray(view)
        self.have: dict[bytes, bytes] = {}
        self.loads: list = []
        self.finished: list = []
        self.set_on_drain: list[threading.Event] = []
        self.result_cls = result_cls

    def lookup(self, key, req_context):
        return HIT if key in self.have else MISS

    def submit_store(self, job):
        self.finished.append(self.result_cls(job.job_id, True))

    def submit_load(self, job):
        self.loads.append(job)

    def land(self, job, keys=None):
        for k, row in zip(job.keys, job.rows):
            if keys is None or k in keys:
                self.rows[row] = np.frombuffer(self.have[k], dtype=np.uint8)

    def finish(self, job, ok=(), release=None, **extra):
        self.loads.remove(job)
        self.land(job, set(ok))
        if release is not None:
            extra["deferred_release"] = release
        self.finished.append(self.result_cls(job.job_id, len(ok) == len(job.keys), list(ok),
                                             **extra))

    def get_finished_jobs(self):
        out, self.finished = self.finished, []
        return out

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self):
        for event in self.set_on_drain:
            event.set()

    def shutdown(self):
        self.rows = None  # (the segment closes after the tiers)


class Rig:
    def __init__(self, engine_id: str, num_chunks: int = 8, **tier_kw):
        geometry = ArenaGeometry(num_chunks=num_chunks, row_stride=PAGE,
                                 page_size_per_worker=PAGE, world_size=1)
        self.segment = open_segment(engine_id, geometry, "fp", owner=True)
        self.primary = CPUPrimaryTierOffloadingManager(self.segment, "lru", enable_events=True)
        self.view = self.primary.get_kv_memoryview()
        self.tier = HeldTier(self.view, **tier_kw)
        self.manager = TieringOffloadingManager(self.primary, [self.tier])

    def promote(self, keys, ctx):
        """Look ``keys`` up (each a tier HIT: promoted) and end the step: the tier holds
        one load job for them; returns it."""
        m = self.manager
        with m.lock:
            assert [m.lookup(k, ctx) for k in keys] == [PENDING] * len(keys)
            m.on_schedule_end(END)
        job = self.tier.loads[-1]
        assert list(job.keys) == list(keys)
        return job

    def close(self):
        self.manager.shutdown()


@pytest.fixture
def rig(engine_id):
    made = []

    def make(**kw):
        r = Rig(f"{engine_id}-{len(made)}", **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def poll(manager):
    """A step: its tiers' finished jobs are processed (once per step)."""
    with manager.lock:
        manager.on_schedule_end(END)


def stats(manager):
    with manager.lock:
        return manager.get_stats().data["data"]


def free_rows(primary) -> set[int]:
    """Rows a store could be given without eviction: free-listed or never used."""
    from shmtier.shared.chunk_table import NUM_ALLOCATED
    return set(primary._free_list) | set(range(primary._counters[NUM_ALLOCATED],
                                               primary._num_chunks))


# --- the primary tier ---------------------------------------------------------------------


def test_primary_holds_deferred_rows_out_of_the_free_pool_until_released(engine_id):
    geometry = ArenaGeometry(num_chunks=4, row_stride=PAGE, page_size_per_worker=PAGE,
                             world_size=1)
    seg = open_segment(engine_id, geometry, "fp", owner=True)
    primary = CPUPrimaryTierOffloadingManager(seg, "lru", enable_events=True)
    try:
        ctx = ReqContext("r")
        out = primary.prepare_store([key(1), key(2)], ctx)
        rows = out.store_spec.ids
        held = primary.defer_write_release([key(1), key(2), key(9)])  # key 9: not pending
        assert held == rows
        assert primary.num_deferred_release_chunks == 2
        assert primary.lookup(key(1), ctx) is MISS and primary.lookup(key(2), ctx) is MISS
        assert [e.metadata_only and e.removed for e in primary.take_events()] == [True]
        assert free_rows(primary).isdisjoint(rows)
        data = primary.get_stats().data["data"]
        assert data[metrics.CPU_CACHE_WRITE_USAGE_PERC][()] == 0.5  # still write-pending
        # the same key stored again gets a fresh row; with the held rows out, only 2 fit
        again = primary.prepare_store([key(1), key(3)], ctx)
        assert set(again.store_spec.ids).isdisjoint(rows)
        primary.complete_store([key(1), key(3)], ctx)
        assert primary.prepare_store([key(4), key(5), key(6)], ctx) is None
        with pytest.raises(RuntimeError, match="2 primary rows of failed promotions still held"):
            primary.reset_cache()
        with pytest.raises(KeyError, match="not held"):
            primary.release_deferred_write([rows[0], 3])
        assert primary.num_deferred_release_chunks == 2  # a refused release changes nothing
        primary.release_deferred_write(rows)
        assert primary.num_deferred_release_chunks == 0
        assert set(rows) <= free_rows(primary)
        assert primary.get_stats().data["data"][metrics.CPU_CACHE_WRITE_USAGE_PERC][()] == 0
        primary.reset_cache()
    finally:
        primary.shutdown()


# --- the manager --------------------------------------------------------------------------


def test_a_failed_promotion_fails_at_once_and_holds_its_rows_until_the_event(rig):
    r = rig()
    m, tier = r.manager, r.tier
    tier.have = {key(i): bytes([i]) * PAGE for i in range(1, 4)}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1), key(2), key(3)], ctx)
    rows = list(job.rows)
    release = threading.Event()
    tier.finish(job, ok=[key(1)], release=release)  # key 1 landed; 2 and 3 may be written
    poll(m)
    with m.lock:
        assert m.lookup(key(1), ctx) is HIT
        assert r.primary.lookup(key(2), ctx) is MISS and r.primary.lookup(key(3), ctx) is MISS
        assert m.has_pending_work()
    assert free_rows(r.primary).isdisjoint(rows[1:])
    assert r.primary.num_deferred_release_chunks == 2
    data = stats(m)
    assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 2}
    assert data[metrics.PROMOTION_JOB_FAILURES] == {LABEL: 1}
    assert metrics.DEFERRED_RELEASE_HOLD not in data
    # a later store of key 2 gets a fresh row, not a held one
    with m.lock:
        out = m.prepare_store([key(2)], ctx)
        assert out.store_spec.ids[0] not in rows
        m.complete_store([key(2)], ctx)

    hold_s = 0.2
    setter = threading.Timer(hold_s, release.set)  # the tier's own thread
    setter.start()
    poll(m)  # not yet: nothing changes
    assert r.primary.num_deferred_release_chunks == 2
    setter.join()
    poll(m)
    assert r.primary.num_deferred_release_chunks == 0
    assert set(rows[1:]) <= free_rows(r.primary)
    data = stats(m)
    assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}
    [held_s] = data[metrics.DEFERRED_RELEASE_HOLD][LABEL]
    assert held_s >= hold_s
    with m.lock:
        assert not m.has_pending_work()
    assert stats(m)[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}  # reported every step


def test_holds_are_released_each_by_its_own_event(rig):
    r = rig()
    m, tier = r.manager, r.tier
    tier.have = {key(i): bytes([i]) * PAGE for i in range(1, 5)}
    events = []
    for i, req in ((1, "a"), (3, "b")):
        ctx = ReqContext(req)
        with m.lock:
            m.on_new_request(ctx)
        job = r.promote([key(i), key(i + 1)], ctx)
        events.append((threading.Event(), list(job.rows)))
        tier.finish(job, release=events[-1][0])
    poll(m)
    assert r.primary.num_deferred_release_chunks == 4
    events[1][0].set()  # the younger one first
    poll(m)
    assert r.primary.num_deferred_release_chunks == 2
    assert free_rows(r.primary).isdisjoint(events[0][1])
    assert set(events[1][1]) <= free_rows(r.primary)
    assert len(stats(m)[metrics.DEFERRED_RELEASE_HOLD][LABEL]) == 1
    events[0][0].set()
    poll(m)
    assert r.primary.num_deferred_release_chunks == 0


def test_an_event_set_before_the_result_is_processed_releases_in_the_same_poll(rig):
    r = rig()
    m, tier = r.manager, r.tier
    tier.have = {key(1): b"\1" * PAGE}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1)], ctx)
    release = threading.Event()
    release.set()
    tier.finish(job, release=release)
    poll(m)
    assert r.primary.num_deferred_release_chunks == 0
    assert job.rows[0] in free_rows(r.primary)
    data = stats(m)
    assert len(data[metrics.DEFERRED_RELEASE_HOLD][LABEL]) == 1
    with m.lock:
        assert not m.has_pending_work()


def test_a_failure_without_an_event_frees_its_rows_at_once(rig):
    r = rig()
    m, tier = r.manager, r.tier
    tier.have = {key(1): b"\1" * PAGE}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1)], ctx)
    tier.finish(job)
    poll(m)
    assert job.rows[0] in free_rows(r.primary)
    data = stats(m)
    assert data[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}  # declared: reported
    assert metrics.DEFERRED_RELEASE_HOLD not in data


def test_reset_waits_for_drain_to_set_every_event_and_refuses_otherwise(rig):
    r = rig()
    m, tier = r.manager, r.tier
    tier.have = {key(1): b"\1" * PAGE, key(2): b"\2" * PAGE}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1), key(2)], ctx)
    release = threading.Event()
    tier.finish(job, release=release)
    poll(m)
    # a tier whose drain_jobs returns with the event unset: the reset is refused, named,
    # and nothing was reset (the rows stay held)
    with m.lock:
        with pytest.raises(RuntimeError, match=r"\['1:held'\] did not set the deferred_release"):
            m.reset_cache()
    assert r.primary.num_deferred_release_chunks == 2
    # drain_jobs sets it (as a tier must): the reset releases the rows, then resets
    tier.set_on_drain.append(release)
    with m.lock:
        m.reset_cache()
        assert not m.has_pending_work()
    assert r.primary.num_deferred_release_chunks == 0
    assert r.primary.resident_keys() == {}
    assert stats(m)[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}


def test_the_gauge_of_a_tier_that_does_not_declare_deferring_starts_with_its_first_hold(
        rig, monkeypatch):
    monkeypatch.setattr(HeldTier, "defers_release", False)
    r = rig()
    m, tier = r.manager, r.tier
    assert metrics.DEFERRED_RELEASE_CHUNKS not in stats(m)
    tier.have = {key(1): b"\1" * PAGE}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1)], ctx)
    release = threading.Event()
    tier.finish(job, release=release)
    poll(m)
    assert stats(m)[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 1}
    release.set()
    poll(m)
    assert stats(m)[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}


def test_report_every_tier(rig, monkeypatch):
    monkeypatch.setattr(HeldTier, "defers_release", False)
    m = rig().manager
    assert metrics.DEFERRED_RELEASE_CHUNKS not in stats(m)
    m.report_deferred_releases_of_every_tier()
    assert stats(m)[metrics.DEFERRED_RELEASE_CHUNKS] == {LABEL: 0}


def test_series_are_declared_as_vllm_034_declares_them():
    defs = metrics.deferred_release_metric_definitions()
    gauge, hist = defs[metrics.DEFERRED_RELEASE_CHUNKS], defs[metrics.DEFERRED_RELEASE_HOLD]
    assert isinstance(gauge, metrics.GaugeMetadata) and gauge.labelnames == ("tier",)
    assert isinstance(hist, metrics.HistogramMetadata) and hist.labelnames == ("tier",)
    assert gauge.multiprocess_mode == "mostrecent"
    vbase = pytest.importorskip("vllm.v1.kv_offload.tiering.base")
    if not hasattr(vbase.TieringOffloadingMetrics, "DEFERRED_RELEASE_CHUNKS"):
        pytest.skip("this vLLM has no deferred release (< 0.34)")
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    theirs = TieringOffloadingSpec.build_metric_definitions(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "example"}]})
    names = (vbase.TieringOffloadingMetrics.DEFERRED_RELEASE_CHUNKS,
             vbase.TieringOffloadingMetrics.DEFERRED_RELEASE_HOLD)
    assert names == (metrics.DEFERRED_RELEASE_CHUNKS, metrics.DEFERRED_RELEASE_HOLD)
    for name, ours in defs.items():
        md = theirs[name]
        assert type(md).__name__ == "Offloading" + type(ours).__name__
        assert tuple(md.labelnames) == ours.labelnames
        assert (tuple(map(float, md.buckets)) if getattr(md, "buckets", None) else None) == (
            tuple(map(float, ours.buckets)) if getattr(ours, "buckets", None) else None)
        assert getattr(md, "multiprocess_mode", None) == getattr(ours, "multiprocess_mode", None)


def test_a_tier_written_for_vllm_returns_vllms_job_result(rig):
    """A tier loaded by module_path returns vLLM's own JobResult: on 0.34 its
    deferred_release holds the rows; before 0.34 it has no such field and a failed
    promotion frees its rows at once."""
    vbase = pytest.importorskip("vllm.v1.kv_offload.tiering.base")
    r = rig(result_cls=vbase.JobResult)
    m, tier = r.manager, r.tier
    tier.have = {key(1): b"\1" * PAGE}
    ctx = ReqContext("a")
    with m.lock:
        m.on_new_request(ctx)
    job = r.promote([key(1)], ctx)
    release = threading.Event()
    if "deferred_release" in vbase.JobResult.__dataclass_fields__:
        tier.finish(job, release=release)
        poll(m)
        assert r.primary.num_deferred_release_chunks == 1
        release.set()
        poll(m)
    else:
        tier.finish(job)
        poll(m)
    assert r.primary.num_deferred_release_chunks == 0
    assert job.rows[0] in free_rows(r.primary)
    with m.lock:
        assert r.primary.lookup(key(1), ctx) is MISS


def test_a_row_release_is_set_once_sealed_and_every_holder_let_go():
    """The pool's release (``shmtier/scheduler/pool/row_release.py``): held once per killed
    worker process, sealed when its pool job completes; a tier chains its own to it."""
    from shmtier.scheduler.pool.row_release import RowRelease

    pool_release, tier_release, called = RowRelease(), RowRelease(), []
    pool_release.hold()
    pool_release.hold()  # two killed workers held parts of the job
    pool_release.let_go()  # one is gone before the job completes: not set, not sealed
    assert not pool_release.event.is_set()
    assert pool_release.seal() is pool_release
    tier_release.hold()
    pool_release.then(tier_release.let_go)
    pool_release.then(lambda: called.append(1))
    assert tier_release.seal() is tier_release
    with pytest.raises(RuntimeError, match="after seal"):
        pool_release.hold()
    pool_release.let_go()  # the second is gone
    assert pool_release.event.is_set() and tier_release.event.is_set() and called == [1]
    pool_release.then(lambda: called.append(2))  # already set: at once
    assert called == [1, 2]
    with pytest.raises(RuntimeError, match="without a holder"):
        pool_release.let_go()
    nobody = RowRelease()
    assert nobody.seal() is None and nobody.event.is_set()
