"""bench/node_pool.py run tiny as a user runs it (``python -m bench.node_pool``): real replica
processes, real segments, a real tmpfs root. Its report carries every figure the issue asks
for, every loaded chunk was checked, and nothing of it is left afterwards: no /dev/shm entry,
no tmpfs directory, no process, also when it is interrupted (Ctrl-C) mid-run."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from bench import node_pool

REPO = pathlib.Path(__file__).resolve().parents[1]
SHM = "/dev/shm"
FIGURES = ("hit", "hit_cpu", "hit_secondary", "promo_ms_p50", "promo_ms_p99",
           "promo_steps_p50", "lookups_per_loaded", "retry_per_promoted", "step_us_p50",
           "step_us_p99", "step_us_p99_worst", "memory_mib", "memory_kib_per_hit", "verified",
           "wrong_chunks", "wrong_bytes")


def _bench(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # its own session: a Ctrl-C reaches the bench and every process it started, as from
    # a terminal, and what is left of them can be found by the session id
    return subprocess.Popen([sys.executable, "-m", "bench.node_pool", *argv], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _left(pid: int) -> tuple[list, list]:
    """What a bench run as ``pid`` left: its /dev/shm entries (segments, semaphores, node
    pool, the fs root) and live processes of its session or naming its engine ids (the
    segment guardians run in sessions of their own)."""
    tags = (f"bench-np-{pid}-", f"bench-np-fs-{pid}-")
    entries = [e for e in os.listdir(SHM) if any(t in e for t in tags)]
    procs = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and (fields[3] == str(pid) or tags[0] in cmd):
            procs.append((int(p), cmd[:120]))
    return entries, procs


def _assert_clean(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        entries, procs = _left(pid)
        if not entries and not procs:
            return
        if time.monotonic() > deadline:
            for p, _ in procs:  # not this test's to leave running
                os.kill(p, signal.SIGKILL)
            raise AssertionError(f"the bench left /dev/shm entries {entries} and processes "
                                 f"{procs}")
        time.sleep(0.2)


def test_a_tiny_run_reports_every_figure_checks_every_chunk_and_leaves_nothing(tmp_path):
    out = tmp_path / "np.json"
    bench = _bench("--quick", "--workers", "1", "--json", str(out))
    try:
        text, _ = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    _assert_clean(bench.pid)
    assert bench.returncode == 0, text
    assert text.startswith("shmtier bench: node_pool"), text
    assert text.index("method:") < text.index("run 1/1"), "the method comes first"
    report = json.loads(out.read_text())
    variants = report["variants"]
    assert variants[:2] == ["cpu", "fs"], variants
    by_variant = {r["variant"]: r for r in report["runs"]}
    assert set(by_variant) == set(variants)
    memory = set()
    for v, run in by_variant.items():
        f = run["figures"]
        assert run["n"] == 2 and len(run["replicas"]) == 2, run
        for key in FIGURES:
            assert key in f, (v, key)
        assert f["verified"] > 0 and f["verified"] == f["hits"], (v, f)
        assert f["wrong_bytes"] == 0 and f["wrong_chunks"] == 0, (v, f)
        assert 0 < f["hit"] <= 1 and 0 <= f["hit_secondary"] <= f["hit"], (v, f)
        # the pooled p99 may pass the slowest replica's own p99 (interpolated percentiles)
        assert 0 < f["step_us_p50"] <= f["step_us_p99"] and f["step_us_p99_worst"] > 0, (v, f)
        assert f["memory_kib_per_hit"] == pytest.approx(f["memory_mib"] * 1024 / f["hits"])
        # what each replica's slowest 1% of steps (on-CPU) are made of: the call kinds add
        # up to those steps' on-CPU time, which is at least the replica's on-CPU p99
        for rep in run["replicas"]:
            s = rep["summary"]
            assert sum(s["slow_cpu_kind_us"].values()) == pytest.approx(s["slow_cpu_us"])
            assert s["slow_cpu_us"] >= s["step_cpu_us_p99"] > 0, (v, s["slow_cpu_us"])
        slow = [f[f"slow_cpu_{kind}"] for kind in node_pool.SLOW_KINDS]
        assert min(slow) >= 0 and sum(slow) > 0 and f["slow_cpu_lookups"] >= 0, (v, slow)
        memory.add(f["memory_mib"])
        # each replica stepped through its own half of the trace
        assert sorted(r["rank"] for r in run["replicas"]) == [0, 1]
        assert sum(r["requests"] for r in run["replicas"]) == report["trace"]["requests"]
    assert len(memory) == 1, f"the variants' total memory differs: {memory}"
    cpu, fs = by_variant["cpu"]["figures"], by_variant["fs"]["figures"]
    assert cpu["hit_secondary"] == 0 and cpu["promo_n"] == 0
    # a replica found chunks the other stored in the shared root, after RETRY steps
    assert fs["hit_secondary"] > 0 and fs["promo_ms_p50"] > 0 and fs["retry_per_promoted"] > 0
    assert 0 < by_variant["fs"]["fs_disk"]["bytes"] <= report["args"]["shared_mib"] << 20
    if "node" in by_variant:  # the node tier type is in this checkout
        node = by_variant["node"]["figures"]
        # a replica found chunks the other stored in the pool, answered at once: no RETRY
        assert node["hit_secondary"] > 0 and node["promo_n"] > 0
        assert node["retry"] == 0 and node["retry_per_promoted"] == 0
    assert "=== N = 2 replicas" in text and "wrong bytes served: 0" in text


def test_ctrl_c_mid_run_stops_every_replica_and_removes_everything():
    bench = _bench("--quick", "--workers", "1", "--variants", "fs", "--requests", "3000",
                   "--conversations", "200")
    try:
        deadline = time.monotonic() + 120
        tag = f"shmtier_bench-np-{bench.pid}-1_dp"
        # both replicas built and the run under way: their segments and the fs root exist
        while sum(e.startswith(tag) for e in os.listdir(SHM)) < 2:
            assert bench.poll() is None, bench.stdout.read()
            assert time.monotonic() < deadline, "the replicas never started"
            time.sleep(0.05)
        time.sleep(1.0)
        assert bench.poll() is None, "the run ended before it could be interrupted"
        os.killpg(bench.pid, signal.SIGINT)  # Ctrl-C in a terminal
        text, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert bench.returncode != 0, text
    assert "KeyboardInterrupt" in text, text
    _assert_clean(bench.pid)
