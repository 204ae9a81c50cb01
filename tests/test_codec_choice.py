"""Compression by cost (shmtier/shared/codec_choice.py): one test per rule of ``choose``
(deterministic inputs -> decision), and the chooser's measuring, probing and logging."""

from __future__ import annotations

import logging

import pytest

from shmtier.shared import codec_choice
from shmtier.shared.codec_choice import CodecChooser, CostInputs, choose, worker_seconds

GB = 1e9
# measured on the 2-core VM (bench/cost_per_byte.py, bench/README.md): codec ~1 GB/s per
# core at ratio 1.5, a raw frame's CRC ~8 GB/s, page-cache writes ~2 GB/s of CPU
CODEC = dict(compress_s=1 / GB, raw_s=0.12 / GB, ratio=1.5)
LOCAL_DISK = dict(write_cpu_s=0.5 / GB, write_wall_s=0.5 / GB)  # a copy into the page cache
SLOW_NET = dict(write_cpu_s=0.1 / GB, write_wall_s=10 / GB)  # 100 MB/s link, little CPU
IDLE = dict(idle_cores=1.5, share=1.0)
BUSY = dict(idle_cores=0.0, share=0.3)  # others run: the worker gets 30% of a core


def inputs(**kw) -> CostInputs:
    base = dict(**CODEC, **LOCAL_DISK, **IDLE, behind=False)
    base.update(kw)
    return CostInputs(**base)


def test_rule1_incompressible_data_goes_raw_whatever_else():
    for kw in ({}, dict(behind=True), SLOW_NET, dict(compress_s=None)):
        d = choose(inputs(ratio=1.03, **kw))
        assert (d.compress, d.reason) == (False, "incompressible")
    # just enough gain for min_gain 0.05: compress
    assert choose(inputs(ratio=1.06)).compress


def test_rule2_unmeasured_compresses_unless_behind():
    for missing in ("compress_s", "ratio", "write_cpu_s", "write_wall_s"):
        assert choose(inputs(**{missing: None})) == codec_choice.Decision(True, "unmeasured")
        assert choose(inputs(behind=True, **{missing: None})) == codec_choice.Decision(
            False, "unmeasured")


def test_rule3_keeping_up_with_cpu_to_spare_compresses_even_where_raw_is_faster():
    d = choose(inputs())
    assert (d.compress, d.reason) == (True, "keeping up")
    assert d.t_raw < d.t_compressed  # raw would be faster on this disk: bytes saved win


def test_rule4_fast_local_disk_on_a_busy_host_goes_raw():
    d = choose(inputs(**BUSY))
    assert (d.compress, d.reason) == (False, "faster")
    assert d.t_raw < d.t_compressed


def test_rule4_slow_network_tier_on_a_busy_host_compresses():
    d = choose(inputs(**{**SLOW_NET, **BUSY}))
    assert (d.compress, d.reason) == (True, "faster")
    assert d.t_compressed < d.t_raw


def test_rule4_behind_on_an_idle_host_picks_the_faster_option():
    assert choose(inputs(behind=True)).compress is False  # local disk: raw is faster
    assert choose(inputs(behind=True, **SLOW_NET)).compress is True  # the link is the limit


def test_rule4_a_near_tie_compresses():
    i = inputs(behind=True)
    t_raw, t_z = worker_seconds(i)
    # make compressing 5% slower than raw: within prefer_compress (10%) -> compress
    i = inputs(behind=True, prefer_compress=(t_z / t_raw - 1) + 0.05)
    assert choose(i).compress is True
    i = inputs(behind=True, prefer_compress=(t_z / t_raw - 1) - 0.05)
    assert choose(i).compress is False


def test_worker_seconds_model():
    i = inputs(**{**SLOW_NET, "idle_cores": 0.2, "share": 0.5})
    t_raw, t_z = worker_seconds(i)
    wait = (10 - 0.1) / GB
    assert t_raw == pytest.approx(wait + (0.12 + 0.1) / GB / 0.5)
    assert t_z == pytest.approx(wait / 1.5 + (1 + 0.1 / 1.5) / GB / 0.5)
    # no CPU at all still counts as a little (0.05 core), never a division by zero
    t_raw, _ = worker_seconds(inputs(idle_cores=0.0, share=0.0))
    assert t_raw == pytest.approx((0.12 + 0.5) / GB / 0.05)


class _Host:
    def __init__(self, idle_cores, share):
        self.idle_cores, self.share = idle_cores, share

    def update(self):
        pass


def test_chooser_measures_decides_probes_and_logs_changes(caplog):
    host = _Host(**BUSY)
    ch = CodecChooser("fs /x", 0.05, host=host)
    assert ch.compress_next(behind=False) is True  # unmeasured
    mib = 1 << 20
    for _ in range(5):
        ch.add_encode(True, mib, int(mib / 1.5), mib / GB)  # 1 GB/s, ratio 1.5
        ch.add_encode(False, mib, mib, 0.12 * mib / GB)
        ch.add_write(mib, 0.5 * mib / GB, 0.5 * mib / GB)
    assert ch.ratio == pytest.approx(1.5) and ch.compress_s == pytest.approx(1 / GB)
    with caplog.at_level(logging.INFO, logger=codec_choice.__name__):
        picks = [ch.compress_next(behind=False) for _ in range(2 * codec_choice.PROBE_EVERY)]
    assert ch.decision.reason == "faster" and not ch.decision.compress
    # raw, but every PROBE_EVERY-th chunk is compressed to keep the rates measured
    assert picks.count(True) == 2 and picks[codec_choice.PROBE_EVERY - 1] is True
    assert ch.changes == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "compression off (faster)" in lines[0] and "fs /x" in lines[0]
    host.idle_cores = 1.5  # the host frees up: back to compressing, no second line so soon
    with caplog.at_level(logging.INFO, logger=codec_choice.__name__):
        assert ch.compress_next(behind=False) is True
    assert ch.changes == 2 and len(caplog.records) == 1


def test_host_cpu_reads_proc_stat_and_schedstat():
    h = codec_choice.HostCpu()
    h._last = (h._last[0] - 1.0, *h._last[1:])  # pretend the sample is old
    h.update()
    assert 0.0 <= h.idle_cores <= 64 and 0.0 <= h.share <= 1.0


def test_the_chooser_clock_measures_this_threads_cpu_and_wall():
    ch = CodecChooser("fs /x", 0.05, host=_Host(**IDLE))
    since = ch.clock()
    sum(range(200_000))  # some CPU
    ch.note_encode(True, 1 << 20, 1 << 19, since)
    since = ch.clock()
    ch.note_write(1 << 20, since)
    assert ch.compress_s > 0 and ch.ratio == 2.0
    assert ch.write_wall_s >= ch.write_cpu_s >= 0
