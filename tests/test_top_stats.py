"""The scheduler's statistics in the segment (``shmtier/shared/stats_area.py``, published by
``shmtier/scheduler/stats_publisher.py``) as ``shmtier top`` shows them: against the
scheduler's own metrics on a live engine (real segment, tier workers, fs tier), the
seqlock against a writer publishing in a tight loop from another process, and the
states of an area that is not (or no longer) published."""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import subprocess
import sys
import time

import pytest

from fs_engine import END, Engine, key
from shmtier import metrics
from shmtier.cli import main
from shmtier.contract import ReqContext
from shmtier.config import KVLayout
from shmtier.options import ConfigError
from shmtier.scheduler.stats_publisher import ENV_INTERVAL, interval_from_env
from shmtier.shared.layout import HEADER_SIZE, STATS_OFFSET, STATS_SIZE, ArenaGeometry
from shmtier.shared.segment import SegmentMismatchError, open_segment, segment_name
from shmtier.shared.snapshot import snapshot
from shmtier.shared.stats_area import FIELDS, StatsAreaError, StatsWriter, read_stats
from shmtier.spec import TieringOffloadingSpec
from shmtier.top import frame_data

ROW = 8192


class MetricsFold:
    """What Prometheus would hold: every ``get_stats`` payload's counters summed, the last
    value of each gauge."""

    def __init__(self):
        self.counters: dict = {}
        self.gauges: dict = {}

    def step(self, manager) -> None:
        """One scheduler step as vLLM makes it: on_schedule_end, then get_stats."""
        with manager.lock:
            manager.on_schedule_end(END)
            stats = manager.get_stats()
        for name, series in stats.data["data"].items():
            kind = stats.data["types"][name]
            for labels, value in series.items():
                if kind == metrics.COUNTER:
                    self.counters[name, labels] = self.counters.get((name, labels), 0) + value
                elif kind == metrics.GAUGE:
                    self.gauges[name, labels] = value

    def counter(self, name: str, label: str) -> int:
        return self.counters.get((name, (label,)), 0)


def _stepped_and_published(fold: "MetricsFold", manager, engine_id: str) -> None:
    """``fold.step`` past the publish interval, then wait for a publish that holds it: by
    that step's ``get_stats``, or by a between-steps round after it while rounds come. A
    round may publish just before the step (the interval had passed): a publish counts
    only once the published lookups are the fold's."""
    fold.step(manager)
    deadline = time.monotonic() + 5
    while True:
        st = snapshot(engine_id).stats
        if st is not None and all(t["lookups"] == fold.counter(metrics.CHUNK_QUERIES, t["label"])
                                  for t in st.tiers):
            return
        assert time.monotonic() < deadline, f"the step's stats were never published: {st}"
        time.sleep(0.002)


def _top_json(engine_id: str) -> dict:
    got = subprocess.run([sys.executable, "-m", "shmtier", "top", engine_id, "--once", "--json",
                          "--interval", "0.1"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def test_top_shows_the_schedulers_metrics_of_a_live_engine(engine_id, tmp_path):
    e = Engine(engine_id, tmp_path, chunks=16, workers=2)
    fold = MetricsFold()
    try:
        m = e.manager
        e.offload([key(i) for i in range(10)], 0, ReqContext("a"))
        e.settle()
        fold.step(m)
        # 10 primary HITs, one key nowhere (a MISS in the primary and in fs)
        e.answers_settled([key(i) for i in range(10)] + [key(100)], ReqContext("b"))
        fold.step(m)
        # 16 more chunks evict the first 10 from the 16-row CPU tier (all 26 cascaded)
        e.offload([key(i) for i in range(20, 36)], 20, ReqContext("c"))
        e.settle()
        fold.step(m)
        e.until_hit([key(i) for i in range(4)], ReqContext("d"))  # 4 promotions from fs
        e.settle()
        time.sleep(0.15)  # past the publish interval: this step's stats are published
        _stepped_and_published(fold, m, engine_id)

        frame = _top_json(engine_id)
        st = frame["stats"]
        assert st["state"] == "live" and st["pid"] == os.getpid(), st
        assert st["interval_s"] == 0.1 and st["row_bytes"] == ROW and st["publishes"] >= 2
        tiers = {t["label"]: t for t in st["tiers"]}
        assert list(tiers) == ["0:primary", "1:fs"]
        files = list(tmp_path.rglob("*.kv"))
        fs, cpu = tiers["1:fs"], tiers["0:primary"]
        # the scheduler's metrics, exactly
        for label, t in tiers.items():
            assert t["lookups"] == fold.counter(metrics.CHUNK_QUERIES, label), (label, t)
            assert t["hits"] == fold.counter(metrics.CHUNK_HITS, label), (label, t)
            assert t["misses"] == t["lookups"] - t["hits"]
            assert t["hit_rate"] == round(t["hits"] / t["lookups"], 4)
            assert len({t["generation"] for t in st["tiers"]}) == 1
        tier = m.tiers[0]
        assert fs["bytes"] == fold.gauges[tier.BYTES_METRIC, ("1:fs",)]
        assert fs["bytes"] == sum(f.stat().st_size for f in files)
        assert fs["chunks"] == tier.chunks_on_disk == len(files) == 26
        assert fs["cascades"] * ROW == fs["cascaded_bytes"] == fold.counter(metrics.WRITE_BYTES, "1:fs")
        assert fs["promotions"] * ROW == fs["promoted_bytes"] == fold.counter(metrics.READ_BYTES, "1:fs")
        assert (fs["cascades"], fs["promotions"]) == (26, 4)
        assert fs["evictions"] == fold.counter(tier.EVICTED_METRIC, "1:fs") == 0
        assert fs["promotion_failures"] == fs["cascade_failures"] == 0
        assert fs["bp_dropped_jobs"] is None  # no backpressure configured: not counted
        # what the lookups were: b's 10 primary hits; d's 4 fs hits (promoted); 100 nowhere
        assert (cpu["hits"], fs["hits"]) == (10, 4)
        assert cpu["chunks"] == frame["rows"]["used"] == 16 and cpu["bytes"] == 16 * ROW
        assert cpu["promotions"] is None and cpu["evictions"] is None

        # the hit rate over an interval: 4 lookups, all primary HITs
        before = snapshot(engine_id)
        e.answers_settled([key(i) for i in range(30, 34)], ReqContext("e"))  # still in the CPU tier
        time.sleep(0.15)
        _stepped_and_published(fold, m, engine_id)
        data = frame_data(snapshot(engine_id), before)["stats"]["tiers"]
        assert data[0]["interval_hit_rate"] == 1.0 and data[0]["lookups"] == cpu["lookups"] + 4
        assert data[1]["interval_hit_rate"] is None  # no fs lookups meanwhile

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["top", engine_id, "--once", "--interval", "0.05"]) == 0
        text = out.getvalue()
        assert "stats  live, published" in text and "not in the segment" not in text
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("1:fs"))
        assert line.split()[1:5] == ["26", _human(fs["bytes"]).split()[0],
                                     _human(fs["bytes"]).split()[1], str(fs["lookups"])]
    finally:
        e.close()


def _human(n: int) -> str:
    from shmtier.shared.segment import human_bytes

    return human_bytes(n)


# ------------------------------------------------------------------ not published / old

def _no_tier_spec(engine_id: str) -> TieringOffloadingSpec:
    return TieringOffloadingSpec({"cpu_bytes_to_use": 4 * ROW}, KVLayout("m", "bfloat16", 16,
                                                                         ROW, 1), engine_id)


def test_unpublished_old_and_stale_areas_are_shown_as_such(engine_id, monkeypatch):
    monkeypatch.setenv(ENV_INTERVAL, "0")
    spec = _no_tier_spec(engine_id)
    m = spec.get_manager()
    try:
        m.get_stats()
        st = snapshot(engine_id).stats
        assert st.state == "unpublished" and ENV_INTERVAL in st.note
        path = os.path.join("/dev/shm", segment_name(engine_id).lstrip("/"))
        with open(path, "r+b") as f:  # what an older shmtier's segment says
            f.seek(8)
            f.write((1).to_bytes(4, "little"))
        st = snapshot(engine_id).stats
        assert st.state == "absent" and "layout version 1" in st.note
        frame = frame_data(snapshot(engine_id), None)
        assert frame["stats"]["state"] == "absent" and frame["stats"]["tiers"] == []
        with pytest.raises(SegmentMismatchError, match="layout version is 1 in the segment, 2 "
                                                       "expected"):
            open_segment(engine_id, spec.geometry, spec.fingerprint, owner=False, rank=0)
    finally:
        m.shutdown()
    for bad in ("fast", "-1", "0.001", "61"):
        with pytest.raises(ConfigError, match=rf"{ENV_INTERVAL} = '{bad}' is invalid: expected "
                                              r"0 .* or seconds between 0.01 and 60"):
            interval_from_env({ENV_INTERVAL: bad})
    assert interval_from_env({}) == 0.1 and interval_from_env({ENV_INTERVAL: "0.25"}) == 0.25


def test_a_publish_that_never_finished_or_a_damaged_area_is_never_read_as_good():
    area = memoryview(bytearray(STATS_SIZE))
    assert read_stats(area) is None  # nothing published
    w = StatsWriter(area, ["0:primary", "1:fs"], interval_s=0.1, row_bytes=ROW)
    w.publish([[0] + [5] * (len(FIELDS) - 1), [0] + [7] * (len(FIELDS) - 1)])
    got = read_stats(area)
    assert got.publishes == 1 and [t["hits"] for t in got.tiers] == [5, 7]
    words = area[:16].cast("Q")
    try:
        words[1] += 1  # odd: a writer that died mid-publish
        with pytest.raises(StatsAreaError, match="no consistent copy"):
            read_stats(area)
        words[1] += 1
        area[400] ^= 1  # even, but a byte differs from what the CRC covers
        with pytest.raises(StatsAreaError):
            read_stats(area)
        w.publish([[0] + [6] * (len(FIELDS) - 1), [0] + [8] * (len(FIELDS) - 1)])
        assert words[1] % 2 == 0 and read_stats(area).publishes == 2
    finally:
        words.release()


# ------------------------------------------------------------------ the seqlock

_WRITER = """
import sys, time
from shmtier.shared.segment import join_existing
from shmtier.shared.stats_area import FIELDS, MAX_RECORDS, StatsWriter
seg = join_existing(sys.argv[1])
w = StatsWriter(seg.stats, [f"{i}:t" for i in range(MAX_RECORDS)], interval_s=0.01,
                row_bytes=4096)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    g = w.publishes + 1
    w.publish([[0] + [g * 1000 + r * 100 + f for f in range(1, len(FIELDS))]
               for r in range(MAX_RECORDS)])
print(w.publishes, flush=True)
seg.close()
"""


def _consistent(tiers: list[dict]) -> bool:
    """Every field of every record from one publish (generation g)."""
    g = tiers[0]["generation"]
    return all(t["generation"] == g and all(t[f] == g * 1000 + r * 100 + i
                                            for i, f in enumerate(FIELDS[1:], start=1))
               for r, t in enumerate(tiers))


def test_a_reader_never_sees_a_torn_publish(engine_id):
    """A writer process publishes in a tight loop; this process reads through a read-only
    mapping (as ``top`` does). Every read is one publish; a plain copy of the same bytes
    (no seqlock) is counted torn when it mixes two, to show the race is real here."""
    seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True)
    writer = None
    try:
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, engine_id, "3"],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        path = os.path.join("/dev/shm", seg.name.lstrip("/"))
        fd = os.open(path, os.O_RDONLY)
        buf = mmap.mmap(fd, HEADER_SIZE, prot=mmap.PROT_READ)
        os.close(fd)
        view = memoryview(buf)[STATS_OFFSET:HEADER_SIZE]
        reads, gens, torn_plain = 0, set(), 0
        try:
            while writer.poll() is None and reads < 200_000:
                got = read_stats(view)
                if got is None:
                    continue
                assert _consistent(got.tiers), got.tiers
                assert got.publishes == got.tiers[0]["generation"]
                gens.add(got.publishes)
                reads += 1
                plain = bytes(view)  # the control: the same bytes without the seqlock
                lo = int.from_bytes(plain[368:376], "little")  # record 0's generation
                hi = int.from_bytes(plain[368 + 11 * 120:376 + 11 * 120], "little")
                torn_plain += lo != hi
        finally:
            view.release()
            buf.close()
        published = int(writer.stdout.readline())
        writer.wait(20)
        print(f"\n{reads} reads of {len(gens)} distinct publishes (of {published}); "
              f"plain copies torn: {torn_plain}")
        assert reads >= 1000 and len(gens) >= 100 and published >= len(gens)
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait(10)
        seg.close()


def test_two_tiers_of_one_type_have_their_own_evictions_and_bytes_counted_once(engine_id):
    """Two fs tiers emit one evictions counter and one bytes gauge, each series labelled
    by its tier: the publisher folds each series once into its tier's record."""
    from shmtier.scheduler.stats_publisher import StatsPublisher
    from shmtier.tiers.fs.scheduler import FsTierManager

    class FsTier:  # what the publisher reads of an fs tier: its series' names
        EVICTED_METRIC, BYTES_METRIC = FsTierManager.EVICTED_METRIC, FsTierManager.BYTES_METRIC
        bp_detector = None

    seg = open_segment(engine_id, ArenaGeometry(4, 4096, 4096, 1), "fp", owner=True)
    try:
        publisher = StatsPublisher(seg, ["0:primary", "1:fs", "2:fs"], [FsTier(), FsTier()],
                                   4096, 0.1)
        for step in range(2):
            stats = metrics.OffloadingStats()
            stats.increase_counter(FsTier.EVICTED_METRIC, 3, ("1:fs",))
            stats.increase_counter(FsTier.EVICTED_METRIC, 5, ("2:fs",))
            stats.set_gauge(FsTier.BYTES_METRIC, 100 + step, ("1:fs",))
            stats.set_gauge(FsTier.BYTES_METRIC, 200 + step, ("2:fs",))
            stats.increase_counter(metrics.CHUNK_QUERIES, 4, ("1:fs",))
            publisher.observe(stats, publish=False)
        publisher.publish()
        tiers = {t["label"]: t for t in read_stats(seg.stats).tiers}
        assert (tiers["1:fs"]["evictions"], tiers["2:fs"]["evictions"]) == (6, 10)
        assert (tiers["1:fs"]["bytes"], tiers["2:fs"]["bytes"]) == (101, 201)
        assert (tiers["1:fs"]["lookups"], tiers["2:fs"]["lookups"]) == (8, 0)
    finally:
        seg.close()
