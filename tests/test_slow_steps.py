"""shmtier/bench/slow_steps.py: the probe records GC, faults and keys inside timed regions
only; ``attribute`` and ``format_table`` turn fixed per-step lists into the table."""

from __future__ import annotations

import gc
import mmap

import pytest

from shmtier.bench.slow_steps import FIELDS, StepProbe, attribute, format_table

KINDS = ("lock wait", "lookup", "prepare_store", "get_stats")


def _run(step_ns, step_cpu_ns, step_kinds, **per_step):
    """A run dict as the driver returns it, with the probe's lists given per field
    (zeros where not given) and keys per kind from ``keys``."""
    n = len(step_ns)
    slow = {"kinds": list(KINDS), "keys": per_step.pop("keys", [[0] * len(KINDS)] * n),
            "nivcsw_kinds": per_step.pop("nivcsw_kinds", [[0] * len(KINDS)] * n)}
    for f in FIELDS:
        slow[f] = per_step.pop(f, [-1 if f == "gc_gen_max" else 0] * n)
    assert not per_step
    return {"step_ns": step_ns, "step_cpu_ns": step_cpu_ns, "step_kinds": step_kinds, "slow": slow}


def test_probe_books_gc_faults_and_keys_inside_regions_only():
    probe = StepProbe(KINDS)
    gc.callbacks.append(probe.on_gc)
    try:
        gc.collect()  # outside any region: not booked
        tok = probe.begin()
        gc.collect(1)
        probe.end(tok, "lookup", 7)
        probe.step_end()
        # step 2: a region first-touching 64 fresh pages of an anonymous mapping
        with mmap.mmap(-1, 64 * mmap.PAGESIZE) as mem:
            tok = probe.begin()
            for off in range(0, len(mem), mmap.PAGESIZE):
                mem[off] = 1
            probe.end(tok, "prepare_store", 3)
            gc.collect()  # after the region: not booked
            probe.step_end()
    finally:
        gc.callbacks.remove(probe.on_gc)
    r = probe.result()
    assert r["gc_collections"] == [1, 0]
    assert r["gc_gen_max"] == [1, -1]
    assert r["gc_ns"][0] > 0 and r["gc_ns"][1] == 0
    assert r["minflt"][1] >= 64
    assert r["keys"] == [[0, 7, 0, 0], [0, 0, 3, 0]]


def test_attribute_groups_and_shares():
    # 10 steps: step 9 is the max (GC and a batch of 40 keys), step 8 the next (descheduled)
    n = 10
    wall = [100_000 + 1000 * i for i in range(8)] + [800_000, 2_000_000]
    cpu = list(wall[:8]) + [200_000, 1_900_000]
    kinds = [[0, w // 2, w // 2, 0] for w in wall[:8]] + [[0, 100_000, 100_000, 600_000],
                                                          [100_000, 100_000, 1_500_000, 300_000]]
    keys = [[0, 4, 4, 0]] * 8 + [[0, 4, 4, 0], [0, 4, 40, 0]]
    gc_ns = [0] * 9 + [1_000_000]
    gc_n = [0] * 9 + [2]
    gc_gen = [-1] * 9 + [2]
    minflt = [0] * 8 + [3, 300]
    nivcsw = [0] * 8 + [1, 0]
    sw_kinds = [[0] * 4] * 8 + [[0, 0, 0, 1], [0] * 4]
    run = _run(wall, cpu, kinds, keys=keys, gc_ns=gc_ns, gc_collections=gc_n, gc_gen_max=gc_gen,
               minflt=minflt, nivcsw=nivcsw, nivcsw_kinds=sw_kinds)
    att = attribute([run], q=90)
    assert set(att) == {"p90", "max", "p50"}
    p90, mx, p50 = att["p90"], att["max"], att["p50"]
    assert p90["steps"] == 2 and mx["steps"] == 1 and p50["steps"] == 1
    assert mx["wall_us"] == 2000 and mx["gc"] == pytest.approx(0.5)
    assert mx["descheduled"] == pytest.approx(0.05)
    assert mx["kinds"]["prepare_store"] == (pytest.approx(0.75), 40, 0)
    assert p90["kinds"]["get_stats"][2] == 0.5
    assert mx["kinds"]["lock wait"][0] == pytest.approx(0.05)
    assert mx["gc_gen_max"] == 2 and mx["minflt"] == 300
    assert p90["wall_us"] == 1400 and p90["descheduled"] == pytest.approx(0.7 / 2.8)
    assert p90["with_faults"] == 1 and p90["with_gc"] == 0.5 and p90["with_nivcsw"] == 0.5
    assert p90["kinds"]["prepare_store"][1] == 22
    assert p50["wall_us"] == 104 and p50["gc"] == 0 and p50["gc_gen_max"] == -1

    lines = format_table(att, top=2)
    text = "\n".join(lines)
    assert lines[0].split() == ["p90", "steps", "(n=2)", "max", "step", "p50", "step"]
    row = {ln[:34].strip(): ln[34:].split() for ln in lines[1:]}
    assert row["wall µs (mean)"] == ["1400", "2000", "104"]
    assert row["GC inside the calls"] == ["36%", "50%", "0%"]
    assert row["collections; oldest gen"] == ["1.0;", "2", "2.0;", "2", "0.0;", "-"]
    assert row["prepare_store"] == ["57%", "(22;", "0.0)", "75%", "(40;", "0.0)", "50%", "(4;", "0.0)"]
    assert row["get_stats"][:3] == ["32%", "(0;", "0.5)"]
    assert "lookup" not in row  # top=2: prepare_store and get_stats only
    assert row["page faults minor / major"] == ["151.5", "/", "0.0", "300.0", "/", "0.0",
                                                 "0.0", "/", "0.0"]
    assert "lock wait" in text


def test_attribute_pools_runs_and_checks_lengths():
    a = _run([10, 20, 30], [10, 20, 30], [[0, 10, 0, 0], [0, 20, 0, 0], [0, 30, 0, 0]])
    b = _run([50, 60], [25, 60], [[0, 0, 50, 0], [0, 0, 60, 0]])
    att = attribute([a, b], q=99.9)
    assert att["max"]["steps"] == 2 and att["max"]["wall_us"] == pytest.approx(0.045)
    assert att["max"]["kinds"]["lookup"][0] == pytest.approx(30 / 90)
    assert att["p50"]["wall_us"] == pytest.approx(0.035)  # steps 20 and 50
    assert att["p50"]["descheduled"] == pytest.approx(25 / 70)
    bad = _run([1, 2], [1], [[0] * 4, [0] * 4])
    with pytest.raises(ValueError, match="step_cpu_ns has 1 steps, step_ns has 2"):
        attribute([bad])
    with pytest.raises(ValueError, match="no runs"):
        attribute([])
