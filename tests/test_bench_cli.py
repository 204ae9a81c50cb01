"""``shmtier bench``: traces as JSON lines (round trip, replay, schema errors), the seeded
generators, and one ``--quick`` run whose report is checked for shape and sanity."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from shmtier.bench import trace as bench_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_VLLM = (os.environ.get("SHMTIER_SKIP_VLLM") != "1"
             and importlib.util.find_spec("vllm") is not None)
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.parametrize("kind", sorted(bench_trace.GENERATORS))
def test_generators_seeded_and_round_trip(kind, tmp_path):
    a = bench_trace.generate(kind, "quick", seed=7)
    b = bench_trace.generate(kind, "quick", seed=7)
    c = bench_trace.generate(kind, "quick", seed=8)
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    assert [r.keys for r in a.requests] != [r.keys for r in c.requests]
    steps = [r.arrival_step for r in a.requests]
    assert steps == sorted(steps)
    for r in a.requests:
        assert 0 <= r.gpu_cached < len(r.keys) and all(len(k) == 36 for k in r.keys)
    path = tmp_path / f"{kind}.jsonl"
    bench_trace.write_jsonl(a, path)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["shmtier_trace"] == 1 and len(lines) == len(a.requests) + 1
    back = bench_trace.read_jsonl(path)
    for x, y in zip(a.requests, back.requests, strict=True):
        assert (x.keys, x.arrival_step, x.gpu_cached, x.decode_steps, x.new_chunks, x.conv,
                x.turn) == (y.keys, y.arrival_step, y.gpu_cached, y.decode_steps, y.new_chunks,
                            y.conv, y.turn)
    assert back.distinct_keys == a.distinct_keys


def test_generators_have_their_shapes():
    docqa = bench_trace.generate("docqa", "quick")
    # many readers per document: documents are shared prefixes read again and again
    assert len(docqa.requests) / docqa.conversations_used >= 5
    agent = bench_trace.generate("agent", "default")
    # branching: some session has two requests whose prefixes diverge after a shared part
    by_session = {}
    for r in agent.requests:
        by_session.setdefault(r.conv, []).append(r.keys)
    forks = 0
    for prefixes in by_session.values():
        for p, q in zip(prefixes, prefixes[1:]):
            if q[:len(p)] != p:
                forks += 1
    assert forks > 0


def test_foreign_trace_replays(tmp_path):
    """A trace from elsewhere: integer block hashes and strings, no header, comments."""
    path = tmp_path / "mine.jsonl"
    path.write_text("# exported from my serving logs\n"
                    + json.dumps({"arrival_step": 3, "keys": [11, 12, 13], "output_steps": 2}) + "\n"
                    + json.dumps({"arrival_step": 0, "keys": ["sys", "a"], "gpu_cached": 1}) + "\n"
                    + "\n")
    t = bench_trace.read_jsonl(path)
    assert [r.arrival_step for r in t.requests] == [0, 3]
    assert t.requests[1].keys[0] == bench_trace.key_of(11)
    assert t.requests[0].gpu_cached == 1 and t.requests[1].decode_steps == 2
    assert t.distinct_keys == 5
    for bad in ({"keys": [1]}, {"arrival_step": 0, "keys": []},
                {"arrival_step": 0, "keys": [1], "gpu_cached": 1},
                {"arrival_step": 0, "keys": [1, 2], "prompt_chunks": 3}):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError):
            bench_trace.read_jsonl(path)


def _run(cmd, timeout, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` whose result also has the
    process's ``pid``: the bench tags what it makes with it (``bench-ts-<pid>-``), so a
    test checks its own leftovers, not those of another suite running beside it."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


def _shm_of(*runs) -> list[str]:
    """The /dev/shm entries (segments, semaphores) the bench processes ``runs`` made."""
    tags = [f"bench-ts-{r.pid}-" for r in runs]
    return [e for e in os.listdir("/dev/shm") if any(t in e for t in tags)]


def _bench(tmp_path, *extra):
    env = dict(os.environ)
    env.pop("DISPLAY", None)
    return _run([sys.executable, "-m", "shmtier", "bench", "--quick",
                 "--out", str(tmp_path / "out"), "--dir", str(tmp_path), *extra],
                240, cwd=REPO, env=env)


def test_bench_quick_report(tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    p = _bench(tmp_path, "--write-trace", str(trace_file))
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text()
    assert rep["verification"]["passed"] and rep["verification"]["wrong"] == 0
    assert rep["verification"]["checked"] > 0
    names = rep["managers"]
    # with vLLM the baseline runs, unless the bench refuses that vLLM (0.32), saying why
    measured = HAVE_VLLM and "fits neither" not in rep["vllm"]
    assert names[0] == "shmtier" and ("vllm" in names) == measured
    for n in names:
        (s,) = rep["runs"][n]
        assert s["wrong_kv"] == 0 and s["verified"] > 0
        assert 0 < s["step_us_p50"] <= s["step_us_p90"] <= s["step_us_p99"] <= s["step_us_p999"] \
            <= s["step_us_max"]
        assert abs(s["hit_cpu"] + s["hit_fs"] + s["miss"] + s["hit_other"] - 1) < 1e-9
        assert s["cpu_s"] > 0 and s["peak_rss_mib"] > 0
        assert s["cascade_gbps"] > 0 and s["disk_per_logical"] > 0
        assert len(s["step_us_cdf"]) == 201 and s["hits_over_time"] and s["bytes_over_time"]
        assert set(s["fraction_of_limit"]) >= {"cascade_gbps", "promo_gbps"}
    assert rep["runs"]["shmtier"][0]["workers_cpu_s"] > 0
    lim = rep["limits"]
    for key in ("memcpy_gbps", "codec_encode_gbps_per_core", "codec_decode_gbps_per_core",
                "disk_write_gbps", "disk_read_gbps"):
        assert lim[key] > 0
    if measured:
        r = rep["ratios"]["shmtier"]["step_us_p99"]
        assert r["min"] <= r["median"] <= r["max"] and r["median"] > 0
        # the baseline is named by the vLLM that ran, and its connector's calls replayed
        import vllm

        version = vllm.__version__
        base = rep["baseline"]
        assert base["vllm_version"] == version
        assert base["baseline"] == f"vLLM {version} TieringOffloadingSpec"
        assert base["connector_line"] == ".".join(version.split(".")[:2])
        assert f"vLLM baseline: vLLM {version} TieringOffloadingSpec" in md
        assert f"shmtier/vLLM {version}" in md and f"| vLLM {version} |" in md
        assert f"vLLM {version} {rep['runs']['vllm'][0]['verified']} (of which" in \
            rep["verification"]["text"]
    else:
        assert rep["ratios"] == {}
        assert rep["baseline"]["baseline"] is None and "vLLM baseline: none" in md
    if HAVE_MPL:
        assert len(rep["plots"]) == 3
        for name in rep["plots"]:
            assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "plots skipped" in rep["plots_text"] and "plots skipped" in md
    assert "verification: PASSED" in md and "## This machine's limits" in md
    # the trace it wrote replays the same run (shmtier alone, no plots: seconds)
    back = bench_trace.read_jsonl(trace_file)
    assert len(back.requests) == rep["trace"]["requests"]
    p2 = _run([sys.executable, "-m", "shmtier", "bench", "--trace", str(trace_file),
               "--no-vllm", "--no-plots", "--no-limits", "--cpu-mib", "32",
               "--step-ms", "2", "--repeats", "1", "--out", str(tmp_path / "replay"),
               "--dir", str(tmp_path), "--busy", "1"], 120, cwd=REPO)
    assert p2.returncode == 0, p2.stdout + p2.stderr
    assert "1 busy process(es) at niceness 0" in p2.stdout  # the method line
    assert "busy host: 1 process spinning at niceness" in p2.stdout
    rep2 = json.loads((tmp_path / "replay" / "report.json").read_text())
    assert rep2["config"]["busy"] == 1 and len(rep2["busy"]["niceness"]) == 1
    assert "busy host: 1 process(es) spinning" in (tmp_path / "replay" / "report.md").read_text()
    assert rep2["managers"] == ["shmtier"] and rep2["verification"]["passed"]
    assert rep2["trace"]["distinct_keys"] == rep["trace"]["distinct_keys"]
    assert rep2["plots_text"] == "plots skipped: --no-plots" and rep2["limits"] is None
    assert "plots skipped" in (tmp_path / "replay" / "report.md").read_text()
    # every fs root and /dev/shm entry the runs made is gone
    assert _shm_of(p, p2) == []
    assert sorted(os.listdir(tmp_path)) == ["out", "replay", "trace.jsonl"]


def test_bench_usage_errors(tmp_path):
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--managers", "nope",
                        "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "bad --managers" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--trace",
                        str(tmp_path / "missing.jsonl"), "--no-vllm", "--out", str(tmp_path / "o")],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--busy", "-1", "--no-vllm",
                        "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "--busy -1: expected a number of processes >= 0" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--stress", "--busy", "1",
                        "--out", str(tmp_path / "o")], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "--busy is for the side-by-side runs" in p.stderr


def test_the_long_preset_is_issue_29_s_long_run_and_refuses_other_sizes(tmp_path):
    """``--long`` (issue 29): the seeded "long" chat trace at 1408 KiB chunks is at least
    10 GiB of distinct KV (over 10x its 1 GiB CPU tier) over ~2 minutes of 5 ms steps;
    it is a chat trace of its own size, so both benches refuse it with another size or
    workload, saying why (exit 2), before anything runs."""
    t = bench_trace.generate("chat", "long", seed=1234)
    assert t.distinct_keys == bench_trace.generate("chat", "long", seed=1234).distinct_keys
    preset = bench_trace.LONG_RUN
    distinct_gib = t.distinct_keys * preset["chunk_kib"] / 2**20
    assert distinct_gib >= 10 and distinct_gib * 1024 / preset["cpu_mib"] >= 10
    steps = max(r.arrival_step for r in t.requests)
    assert len(t.requests) == 600 and steps * preset["step_ms"] / 1000 >= 100
    with pytest.raises(ValueError, match="size 'long' is a chat trace, not 'docqa'"):
        bench_trace.generate("docqa", "long")
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--long", "--workload", "docqa",
                        "--no-vllm", "--out", str(tmp_path / "o")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--long is a chat trace of its own" in p.stderr
    p = subprocess.run([sys.executable, "-m", "bench.tiering_steps", "--long", "--quick"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--long is a chat trace of its own size" in p.stderr
    assert not (tmp_path / "o").exists()


def test_bench_stress_quick_verdict(tmp_path):
    p = subprocess.run([sys.executable, "-m", "shmtier", "bench", "--stress", "--quick",
                        "--out", str(tmp_path / "s")], cwd=REPO, capture_output=True, text=True,
                       timeout=180)
    failed = [x for x in p.stdout.splitlines() if "[FAIL]" in x or "violation at" in x]
    assert p.returncode == 0, "\n".join(failed) + p.stdout[-3000:] + p.stderr[-3000:]
    v = json.loads((tmp_path / "s" / "stress.json").read_text())
    assert v["verdict"] == "PASS" and v["failed"] == 0 and v["passed"] >= 15
    assert v["violation_counts"] == {} and v["violations"] == []
    names = {c["name"] for c in v["checks"]}
    for name in ("no wrong byte served", "jobs exactly once", "rows and pins", "call latency",
                 "damaged files accounted",
                 "calls bounded while a worker stalled", "fresh engine: orphans"):
        assert name in names
    f = v["faults"]  # every fault injected and counted (filling the root needs root: skips say why)
    assert f["kill_workers"]["kills"] >= 1 and f["delete_root"]["done"] == 1
    assert f["corrupt_files"]["events"] == 3 and f["stall_worker"]["stalls"] == 1
    assert f["warm_restart"].get("rows_kept", 0) > 0 or "shmtier clean" in f["warm_restart"]["skipped"]
    assert f["fill_root"].get("fills") == 1 or f["fill_root"]["skipped"]
    assert v["figures"]["latency"]["max_us"] < 500e3 and v["loadavg"]["after"]
    assert p.stdout.splitlines()[-1].startswith("stress verdict: PASS")


def test_retired_run_dir_is_emptied_then_removed_at_exit(tmp_path):
    """A finished run's fs directory: every file truncated at once (blocks and page cache
    freed, inodes kept: ext4 without a journal taxes creations after mass deletion), the
    tree removed when the bench process exits."""
    root = tmp_path / "run"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "x.kv").write_bytes(b"k" * 5000)
    (root / "y.kv").write_bytes(b"v" * 7000)
    code = (
        "import os, sys\n"
        "from shmtier.bench.driver import retire_root\n"
        "root = sys.argv[1]\n"
        "retire_root(root)\n"
        "sizes = sorted(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)\n"
        "print(sizes)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[0, 0]"  # both files still there, emptied, while it ran
    assert not root.exists()  # gone once the process exited


def test_a_stalled_run_is_run_once_more_and_reported():
    """A run that makes no progress (a manager that never answers) costs one more run,
    reported, instead of the whole set; a second stall in a row stops the bench with its
    error. (The stall is injected: no real manager stalls on demand.)"""
    from shmtier.bench.driver import NoProgress, run_once_more_on_stall

    calls = []

    def flaky(name, trace, cfg, pool, run_no):
        calls.append(run_no)
        if len(calls) == 1:
            raise NoProgress(f"{name}: no progress after 9 steps (1 waiting, 0 running)")
        return {"run_no": run_no}

    stalls = []
    res, used = run_once_more_on_stall("vllm", None, None, None, 4, stalls, run=flaky)
    assert res == {"run_no": 5} and used == 5 and calls == [4, 5]
    assert stalls == [{"manager": "vllm", "run_no": 4,
                       "error": "vllm: no progress after 9 steps (1 waiting, 0 running)"}]

    def stuck(name, trace, cfg, pool, run_no):
        raise NoProgress(f"{name}: stuck in run {run_no}")

    with pytest.raises(NoProgress, match="stuck in run 8"):
        run_once_more_on_stall("vllm", None, None, None, 7, [], run=stuck)


def test_wake_lateness_is_summarised_from_the_driver_s_sleeps():
    """The driver's per-step lateness after its forward-pass sleep (ns) as µs percentiles;
    an older result without it reads None, not zero."""
    from shmtier.bench.report import wake_lateness

    late = wake_lateness([100_000] * 998 + [2_000_000, 9_000_000])
    assert late == {"wake_us_p50": 100.0, "wake_us_p99": 100.0, "wake_us_p999": 2000.0,
                    "wake_us_max": 9000.0}
    assert set(wake_lateness(None).values()) == {None}
